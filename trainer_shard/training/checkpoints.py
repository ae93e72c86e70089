"""Checkpoints of a sharded run: staged, published whole, resumable at any world size.

[Note: sharded checkpoints] A sharded run saves the model in the usual Hugging Face form and each
rank's optimizer shard next to it (`optimizer_shards/`, see sharding/state_io.py); it resumes from
such a folder at any world size, stage or offload, or without sharding. Every checkpoint is
written under `.checkpoint-staging/` and renamed into place once all ranks have finished, with a
manifest of its files' sizes and CRC-32s that resuming checks first (a checkpoint of this project
without one is refused: `missing_manifest`). Every file and folder of it is fsynced before the
rename, and the rename before older checkpoints are rotated away (checkpoint.publish); a crash
between publish's two renames is repaired by the next start (`clear_staging`).

    save = StagedSave(run_dir, step, args, size, last)   # one checkpoint; the Trainer writes into
    save.begin()                                         # save.staging, then:
    save.record(error)                                   # a write error, for every rank to learn of
    save.gather()                                        # every rank's outcome; raises if one failed
    save.publish(state, shard_index)                     # manifest, rename, rotation

[Note: nodes without a shared filesystem] With --save_on_each_node (transformers' flag for nodes
that do not share --output_dir's filesystem) `args.should_save` is true on each node's local main
process, not only on rank 0: each node's --output_dir gets the model, the trainer state and the
scheduler, and each node's local main publishes its own staging folder, which holds the
optimizer shards its own ranks wrote. The index in every copy names all the ranks' files and
where each was written (node, host, folder). Resuming at the same world size, each rank checks
and reads only the files its new shard needs (state_io.load_shards): its own, so each node's
folder is enough. At another world size a rank may need files another node wrote; it is refused
with the files it lacks and where they are. `check_output_dirs` checks at the start of training
that the flag matches the filesystems: without it every node must see rank 0's --output_dir
(else its ranks' shards would never reach rank 0's checkpoint), and with it no two nodes may
share one (they would write the same files at once).
"""

import os
import shutil
import socket
import uuid
import warnings
import zipfile
from pathlib import Path

import torch
from transformers.trainer import (OPTIMIZER_NAME, OPTIMIZER_NAME_BIN, SCHEDULER_NAME, TRAINER_STATE_NAME,
                                  TRAINING_ARGS_NAME)
from transformers.trainer_pt_utils import reissue_pt_warnings
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, rotate_checkpoints

from .. import comm, faults
from ..checkpoint import MANIFEST, STAGING, check_writable, finish_publish, manifest_problems, publish, write_manifest
from ..disk import describe_write_error, format_bytes, is_write_error
from ..errors import CheckpointError
from ..sharding import state_io
from .supervision import save_on_interrupt


def check_output_room(args, checkpoint_bytes) -> None:
    """Before training: --output_dir writable, with room for a checkpoint (or the final model:
    `checkpoint_bytes(with_optimizer=...)`), each node's as --save_on_each_node needs; a staging
    folder a crash left behind cleared."""
    saves = args.save_strategy != "no" or save_on_interrupt(args)
    purpose = " for a checkpoint of this run" if saves else " for the trained model"
    check_writable(args.output_dir, checkpoint_bytes(with_optimizer=saves), "--output_dir", purpose)
    if saves:
        check_output_dirs(args)
    if args.should_save:
        clear_staging(args.output_dir)


def clear_staging(output_dir) -> None:
    """Remove what a run killed while saving left in `output_dir/.checkpoint-staging`; first put
    back a checkpoint a crash in the middle of `publish` left there (`finish_publish`)."""
    for restored in finish_publish(output_dir):
        warnings.warn(f"{str(restored)!r} was put back in place: the run that saved it stopped while publishing it")
    shutil.rmtree(os.path.join(output_dir, STAGING), ignore_errors=True)


def last_checkpoint_or_none(output_dir):
    return get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None


class StagedSave:
    """One checkpoint, `checkpoint-N`: written under `run_dir/.checkpoint-staging/checkpoint-N`,
    renamed into `run_dir` once every rank has written its files. A rank that cannot write (a full
    or read-only disk) makes every rank raise `CheckpointError` naming it, with the partial
    checkpoint removed and the earlier ones untouched. `begin`, `gather` and `publish` are
    collectives.

    `size()` says about how many bytes a checkpoint takes (for the error message); `last` is the
    last complete checkpoint of this run, if any.
    """

    def __init__(self, run_dir: str, step: int, args, size, last=None):
        self.args, self.size, self.last = args, size, last
        self.run_dir = run_dir
        self.name = f"{PREFIX_CHECKPOINT_DIR}-{step}"
        self.staging = os.path.join(run_dir, STAGING, self.name)
        self.final = os.path.join(run_dir, self.name)
        self.model_files = None  # {file: {"bytes", "crc32"}} of the weights, from save_model (rank 0)
        self.shard_folder = self.shard_written = None  # this rank's optimizer shard: its file's info, or an error
        self.failure = None  # the first write error on this rank, as text
        self.outcomes = None  # every rank's (failure, shard_written), once gathered
        self.locations = None  # every rank's {"node", "host", "folder"}: where its shard is published

    def begin(self) -> None:
        faults.at(phase=f"saving {self.name}")
        if self.args.should_save:
            shutil.rmtree(self.staging, ignore_errors=True)  # left by a run killed while saving
        comm.barrier()

    def record(self, error: BaseException, folder=None) -> None:
        """Keep a write error in `folder` (default: the staging folder) for `gather`: raising
        would leave the other ranks waiting at the Trainer's barrier. Re-raise anything else
        (torch.save reports a full disk as a RuntimeError, which counts as a write error)."""
        if not isinstance(error, OSError) and not is_write_error(error):
            raise error
        self.failure = self.failure or describe_write_error(error, folder or self.staging)

    def save_optimizer_shard(self, optimizer, model, output_dir) -> None:
        """This rank's optimizer shard into `output_dir/optimizer_shards/` (not collective)."""
        self.shard_folder = Path(output_dir) / state_io.FOLDER
        self.shard_written = state_io.write_shard(optimizer, self.shard_folder, state_io.param_names(model))

    def gather(self) -> None:
        """Every rank's files are written, or every rank raises naming who failed and why."""
        location = {"node": node_rank(self.args), "host": socket.gethostname(),
                    "folder": os.path.realpath(os.path.join(self.final, state_io.FOLDER))}  # fmt: skip
        gathered = comm.all_gather_objects((self.failure, self.shard_written, location))
        self.outcomes = [(failure, written) for failure, written, _ in gathered]
        self.locations = [where for _, _, where in gathered]
        self._raise_if_failed(self.outcomes)

    def shard_index(self, optimizer, model) -> dict:
        """The publisher (rank 0, or each node's: see [Note: nodes without a shared filesystem]):
        the index of the optimizer shards every rank wrote; the manifest entries of their files."""
        if optimizer is None or self.shard_folder is None:
            return {}
        files = state_io.shard_files([written for _, written in self.outcomes])
        written_by = dict(zip(files, self.locations))
        state_io.write_index(optimizer, self.shard_folder, state_io.param_names(model), files, written_by)
        return {f"{state_io.FOLDER}/{name}": info for name, info in files.items()}

    def publish(self, state, optimizer=None, model=None) -> str:
        """Manifest, rename into place, rotation; returns the published path. Nobody goes on
        before the checkpoint is in place. The publisher is `args.should_save`: rank 0, or with
        --save_on_each_node each node's local main, for what its node's ranks wrote (see
        [Note: nodes without a shared filesystem])."""
        best = state.best_model_checkpoint
        if best is not None and os.path.dirname(best) == os.path.join(self.run_dir, STAGING):
            state.best_model_checkpoint = os.path.join(self.run_dir, os.path.basename(best))
        failure = None
        if self.args.should_save:
            try:
                if best != state.best_model_checkpoint:
                    state.save_to_json(os.path.join(self.staging, TRAINER_STATE_NAME))
                write_manifest(self.staging, {**(self.model_files or {}), **self.shard_index(optimizer, model)})
                publish(self.staging, self.final)
            except OSError as e:
                failure = describe_write_error(e, self.staging)
        self._raise_if_failed([(f, None) for f in comm.all_gather_objects(failure)])
        if self.args.should_save:
            rotate_checkpoints(self.run_dir, self.args.save_total_limit, state.best_model_checkpoint, use_mtime=False)
        faults.at(phase="training")
        return self.final

    def _raise_if_failed(self, outcomes) -> None:
        failed = [(r, failure or shard) for r, (failure, shard) in enumerate(outcomes)
                  if failure or isinstance(shard, str)]  # fmt: skip
        if not failed:
            return
        if self.args.should_save:
            shutil.rmtree(self.staging, ignore_errors=True)
            try:
                os.rmdir(os.path.dirname(self.staging))
            except OSError:
                pass
        comm.barrier()
        last = self.last or last_checkpoint_or_none(self.args.output_dir)
        kept = f"{last} (the last complete checkpoint) is untouched" if last else "no earlier checkpoint exists"
        causes = "; ".join(f"rank {r}: {text}" for r, text in failed)
        fix = ("make it writable again, or point --output_dir at a writable disk" if "read-only" in causes else
               "free space there (or lower --save_total_limit), or point --output_dir at a disk with room")  # fmt: skip
        raise CheckpointError(
            f"{self.name} was not saved: {causes}. A checkpoint of this run takes about "
            f"{format_bytes(self.size())}. What it had written was removed; {kept}. To go on, {fix}, "
            "and resume with --resume_from_checkpoint latest"
        )


def save_scheduler(scheduler, output_dir) -> None:
    with warnings.catch_warnings(record=True) as caught:
        torch.save(scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
    reissue_pt_warnings(caught)


def has_optimizer_shards(checkpoint) -> bool:
    """Whether `checkpoint` holds optimizer shards; if it holds neither those nor the Trainer's
    own optimizer file, raise: resuming would restart the optimizer silently."""
    if (Path(checkpoint) / state_io.FOLDER).is_dir():
        return True
    if not any((Path(checkpoint) / name).is_file() for name in (OPTIMIZER_NAME, OPTIMIZER_NAME_BIN)):
        raise CheckpointError(
            f"{str(checkpoint)!r} holds no optimizer state ({state_io.FOLDER}/ or {OPTIMIZER_NAME}): it was "
            "saved with --save_only_model, or its save did not finish. Resuming would restart the optimizer "
            "silently; resume from a complete checkpoint, or start a new run from these weights with "
            "--model_name_or_path"
        )
    return False


def load_optimizer_shards(checkpoint, optimizer, model, sharded: bool) -> None:
    """The shards of `checkpoint` into `optimizer`: re-partitioned for a `ShardedOptimizer`
    (`sharded`; collective), or whole into a plain torch optimizer."""
    shards = Path(checkpoint) / state_io.FOLDER
    if sharded:
        state_io.load_shards(optimizer, shards, state_io.param_names(model))
    else:
        state_io.load_into_plain(optimizer, model, shards)


def load_scheduler(checkpoint, scheduler) -> None:
    path = Path(checkpoint) / SCHEDULER_NAME
    if not path.is_file():
        raise CheckpointError(f"{str(path)!r} is missing: the LR schedule cannot resume; resume from a complete "
                              "checkpoint")  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        scheduler.load_state_dict(torch.load(path, weights_only=True))
    reissue_pt_warnings(caught)


def check_manifest(checkpoint, args) -> None:
    """Check `checkpoint` against its manifest before loading; refuse one of this project's
    checkpoints that has none (`missing_manifest`). The ranks that read one copy share
    the CRC work: all of them, or with --save_on_each_node each node's own ranks, its copy.
    Collective when there are several ranks: every rank raises the same error."""
    rank, world_size = args.process_index, args.world_size
    if getattr(args, "save_on_each_node", False):
        rank, world_size = args.local_process_index, local_world_size(args)
    problems = missing_manifest(checkpoint) or manifest_problems(checkpoint, rank, world_size)
    if args.world_size > 1:
        problems = sorted({p for found in comm.all_gather_objects(problems) for p in found})
    if problems:
        raise CheckpointError(f"checkpoint {str(checkpoint)!r} cannot be resumed: " + "; ".join(problems)
                              + ". Resume from an earlier checkpoint")  # fmt: skip


def missing_manifest(checkpoint) -> list:
    """[the problem] when `checkpoint` is this project's and has no manifest; else []. Every
    checkpoint this project publishes has one, so a missing one was removed, or never reached the
    disk (a crash or power loss right after the save, by a version that did not fsync it). A
    plain Trainer's checkpoint has none and resumes unchecked, as it does in the Trainer: see
    `made_here` for how the two are told apart."""
    if (Path(checkpoint) / MANIFEST).is_file():
        return []
    sign = made_here(checkpoint)
    if sign is None:
        return []
    return [f"it has no {MANIFEST}, yet trainer_shard saved it ({sign}) and writes one into every checkpoint: the "
            "file was removed, or the save never reached the disk (a crash or power loss right after it), so nothing "
            "says its files are whole (if you trust its weights, they can start a new run: --model_name_or_path "
            f"{str(checkpoint)!r})"]  # fmt: skip


def made_here(checkpoint) -> str | None:
    """How `checkpoint` shows it was saved by this project: its optimizer_shards/ folder (no other
    trainer writes one), or its training_args.bin pickling this project's arguments (read as
    bytes, never unpickled); None for a plain Trainer's checkpoint."""
    folder = Path(checkpoint)
    if (folder / state_io.FOLDER).is_dir():
        return f"it holds {state_io.FOLDER}/"
    path = folder / TRAINING_ARGS_NAME
    try:
        with zipfile.ZipFile(path) as archive:
            pickled = b"".join(archive.read(n) for n in archive.namelist() if n.endswith("data.pkl"))
    except (OSError, zipfile.BadZipFile):
        return None
    return f"its {TRAINING_ARGS_NAME} holds trainer_shard's arguments" if b"trainer_shard." in pickled else None


def local_world_size(args) -> int:
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE; all of them when not set)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", getattr(args, "world_size", 1)))


def node_rank(args) -> int:
    """This node's index (torchrun's GROUP_RANK, which --node_rank sets)."""
    return int(os.environ.get("GROUP_RANK", getattr(args, "process_index", 0) // max(1, local_world_size(args))))


def check_output_dirs(args) -> None:
    """Several nodes: --save_on_each_node must match whether they share --output_dir (see
    [Note: nodes without a shared filesystem]); raises `CheckpointError` on every rank otherwise.
    Each node's local main leaves a file of a name of its own in its --output_dir, and looks for
    the others' files. Collective with several nodes; nothing (and no collective) on one node."""
    if args.world_size <= 1 or local_world_size(args) >= args.world_size:
        return
    folder = Path(args.output_dir)
    marker = None
    if args.local_process_index == 0:
        marker = folder / f".trainer_shard-node-check-{uuid.uuid4().hex}"
        folder.mkdir(parents=True, exist_ok=True)
        marker.touch()
    try:
        markers = comm.all_gather_objects(marker.name if marker else None)
        others = [r for r, name in enumerate(markers) if name and r != args.process_index]
        seen = sorted(r for r in others if (folder / markers[r]).exists()) if marker else None
        seen = comm.all_gather_objects(seen)
    finally:
        if marker is not None:
            marker.unlink(missing_ok=True)
    mains = [r for r, name in enumerate(markers) if name]
    out = str(args.output_dir)
    if getattr(args, "save_on_each_node", False):
        shared = [(r, seen[r]) for r in mains if seen[r]]
        if shared:
            pairs = "; ".join(f"rank {r} sees rank {', '.join(map(str, seen_))}'s files there" for r, seen_ in shared)
            raise CheckpointError(
                f"--save_on_each_node, but nodes share --output_dir {out!r} ({pairs}): each node's "
                "local main would write the same checkpoint files at once. Remove --save_on_each_node (rank 0 then "
                "publishes every checkpoint for all nodes), or give each node an --output_dir of its own"
            )
        return
    blind = [r for r in mains if r != 0 and 0 not in seen[r]]
    if blind:
        raise CheckpointError(
            f"--output_dir {out!r}: the node(s) of rank(s) {', '.join(map(str, blind))} do not see the files rank 0 "
            "writes there: the nodes do not share a filesystem, so their ranks' optimizer shards would never reach "
            "rank 0's checkpoints. Pass --save_on_each_node (each node then saves and publishes its own ranks' files; "
            "resume on the same number of ranks, or bring the files a rank needs), or point --output_dir at a "
            "filesystem all nodes share"
        )
