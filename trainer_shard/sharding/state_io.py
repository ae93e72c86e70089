"""Sharded optimizer checkpoints: each rank writes its own shard; any world size reads them back.

    checkpoint-N/optimizer_shards/
        index.json                         the layout: parameter names and shapes, each rank's
                                           segments, world size, stage, dtypes, hyperparameters,
                                           and every file's size and CRC-32
        rank-00000-of-00002.safetensors    rank 0: flat0.master, flat0.exp_avg, flat0.exp_avg_sq,
        rank-00001-of-00002.safetensors    flat0.step, flat1.master, ... (fp32, shard order)

    save_shards(optimizer, folder, names)   # collective; streams, a chunk at a time
    load_shards(optimizer, folder, names)   # collective; any world size, stage or offload
    ShardSources(folder).read_param(name, "exp_avg")   # one parameter's full tensor

Saving streams every tensor from where the state lives (device, CPU store, disk store) through
one chunk buffer, so no rank ever holds more than its shard, and a disk store is copied, not
loaded. Loading re-partitions (repartition.py, the path `load_state_dict` takes too): for each
range of this rank's new shard, the index says which old rank holds which elements of which
parameter (`ShardSources`, a source), and those are read with `pread` (the equivalent of
DeepSpeed's universal checkpoint, without a conversion step). The master weights are always
saved, fp32, even when the parameters are fp32 themselves, so a shard set alone rebuilds the
model at full precision (`trainer-shard consolidate`).
"""

import bisect
import functools
import json
import os
import socket
from pathlib import Path

import torch

from .. import comm
from ..checkpoint import Chunked, SafetensorsFile, file_problems, save_safetensors
from ..constants import CHUNK_NUMEL
from ..disk import describe_write_error
from ..errors import CheckpointError

FOLDER = "optimizer_shards"
INDEX = "index.json"
FORMAT = "trainer_shard.optimizer_shards/1"


def rank_file(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def param_names(model) -> dict:
    """{parameter: name} as `model.named_parameters()` names them (tied ones once)."""
    return {p: name for name, p in model.named_parameters()}


# ---- save ----------------------------------------------------------------------------------------


@torch.no_grad()
def save_shards(optimizer, folder, names: dict) -> dict:
    """Write this rank's shard and (rank 0) the index into `folder`. Collective. Returns every
    shard file's {"bytes", "crc32"} by name (on every rank). A rank that cannot write its file
    (a full or read-only disk) makes every rank raise `CheckpointError` naming it.

    The same three steps as a Trainer checkpoint, which gathers the shard outcomes together with
    the model's (trainer_state... see training/checkpoints.py): `write_shard` on every rank,
    `shard_files` of the gathered outcomes, `write_index` on rank 0."""
    written = write_shard(optimizer, folder, names)
    outcomes = comm.all_gather_objects(written, optimizer.group)
    failed = [(r, out) for r, out in enumerate(outcomes) if isinstance(out, str)]
    if failed:
        raise CheckpointError("; ".join(f"rank {r}: {text}" for r, text in failed))
    files = shard_files(outcomes)
    if optimizer.rank == 0:
        write_index(optimizer, folder, names, files)
    comm.barrier(optimizer.group)
    return files


def shard_files(outcomes: list) -> dict:
    """{file name: {"bytes", "crc32"}} from every rank's `write_shard` result, in rank order."""
    return {rank_file(r, len(outcomes)): written for r, written in enumerate(outcomes)}


def write_shard(optimizer, folder, names: dict):
    """This rank's shard file, streamed: its {"bytes", "crc32"}, or the text of the OSError that
    stopped it (the partial file removed). Not collective: the Trainer gathers the outcomes of
    every file of a checkpoint at once (training/checkpoints.py)."""
    folder = Path(folder)
    inner, fresh = optimizer.stepper, optimizer.fresh
    tensors = {}
    for i, flat in enumerate(optimizer.flats):
        keys = ["master"] if fresh else inner.tensor_names(i)
        for key in keys:
            read = functools.partial(inner.read, i, key)
            tensors[f"flat{i}.{key}"] = Chunked(torch.float32, (flat.layout.shard_numel,), read, CHUNK_NUMEL)
        scalars = {} if fresh else inner.scalar_state(i)
        for key, value in scalars.items():
            if torch.is_tensor(value):
                tensors[f"flat{i}.{key}"] = value.detach().cpu().reshape(())
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return save_safetensors(tensors, folder / rank_file(optimizer.rank, optimizer.world_size))
    except OSError as e:
        return describe_write_error(e)


def write_index(optimizer, folder, names: dict, files: dict, written_by: dict | None = None) -> None:
    """`folder/index.json` (rank 0, or each node's publisher; see training/checkpoints.py): what
    every rank's file holds and how to re-partition it; `written_by` {file: {"node", "host",
    "folder"}} says where each file was written, for the message when one is missing."""
    fresh = optimizer.fresh
    flats = []
    for i in range(len(optimizer.flats)):
        keys = ["master"] if fresh else optimizer.stepper.tensor_names(i)
        scalars = {} if fresh else optimizer.stepper.scalar_state(i)
        flats.append(_flat_entry(optimizer, i, names, keys, scalars))
    index = {
        "format": FORMAT,
        "world_size": optimizer.world_size,
        "stage": optimizer.stage,
        "offload": optimizer.offload.device if optimizer.offload is not None else None,
        "optimizer": optimizer.optim_class.__name__,
        "fresh": fresh,
        "param_groups": [
            {**_jsonable({k: v for k, v in g.items() if k != "params"}),
             "params": [names[p] for p in g["params"] if p in names]}
            for g in optimizer.param_groups
        ],  # fmt: skip
        "loss_scaler": optimizer.loss_scaler.state_dict() if optimizer.loss_scaler is not None else None,
        "flats": flats,
        "files": files,
        **({"written_by": written_by} if written_by else {}),
    }
    _write_json(Path(folder) / INDEX, index)


def _flat_entry(optimizer, i: int, names: dict, keys: list, scalars: dict) -> dict:
    flat = optimizer.flats[i]
    layout = flat.layout
    return {
        "group": optimizer.group_of(i),
        "dtype": str(flat.dtype).removeprefix("torch."),
        "shard_numel": layout.shard_numel,
        "keys": keys,
        "scalars": {k: v for k, v in _jsonable(scalars).items() if not torch.is_tensor(scalars[k])},
        "tensor_scalars": [k for k, v in scalars.items() if torch.is_tensor(v)],
        "params": [{"name": names[p], "shape": list(getattr(p, "ds_shape", p.shape))} for p in flat.params],
        # per rank: [param index, first element in the parameter, first element in the shard, count]
        "segments": [[[s.index, s.param_start, s.shard_start, s.numel] for s in layout.segments(r)]
                     for r in range(layout.world_size)],  # fmt: skip
    }


def _jsonable(values: dict) -> dict:
    out = {}
    for k, v in values.items():
        if torch.is_tensor(v):
            v = v.item() if v.numel() == 1 else v.tolist()
        elif isinstance(v, tuple):
            v = list(v)
        out[k] = v
    return out


def _write_json(path: Path, value) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(value, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ---- read ----------------------------------------------------------------------------------------


def read_index(folder) -> dict:
    """The index of a shard folder; `CheckpointError` naming the file when missing or corrupt."""
    path = Path(folder) / INDEX
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{str(path)!r} is missing: the optimizer shards of this checkpoint cannot be read; "
                              "the save did not finish, resume from an earlier checkpoint") from None  # fmt: skip
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{str(path)!r} is corrupt ({e}); resume from an earlier checkpoint") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{str(path)!r} is not a trainer_shard optimizer index (format {FORMAT})")
    return index


def verify_files(folder, index: dict, rank: int = 0, world_size: int = 1, group=None, needed=None) -> None:
    """The shard files this rank reads (`needed`, file names; default all, with this rank checking
    the CRC-32 of every `world_size`-th) are there, with their sizes and CRC-32s. Collective when
    `world_size` > 1: all ranks raise the same error, which names each missing file, the rank
    that needs it and where it was written (see [Note: nodes without a shared filesystem] in
    training/checkpoints.py)."""
    files = index["files"]
    if needed is None:
        problems = file_problems(folder, files, rank, world_size)
        missing = sorted(name for name in files if not (Path(folder) / name).is_file())
    else:
        problems = file_problems(folder, {name: files[name] for name in needed})
        missing = sorted(name for name in needed if not (Path(folder) / name).is_file())
    missing = [(rank, socket.gethostname(), str(Path(folder).resolve()), missing)] if missing else []
    if world_size > 1:
        gathered = comm.all_gather_objects((problems, missing), group)
        problems = sorted({p for rank_problems, _ in gathered for p in rank_problems})
        missing = [m for _, rank_missing in gathered for m in rank_missing]
    if problems:
        raise CheckpointError("the optimizer shards of this checkpoint cannot be used: " + "; ".join(problems)
                              + ". " + _missing_fix(index, missing))  # fmt: skip


def _missing_fix(index: dict, missing: list) -> str:
    """What to do: for files a rank needs that were written on another node (or into another
    folder), where they are and how to bring them (or to need fewer); otherwise, the files are
    simply gone: resume from an earlier checkpoint."""
    written_by = index.get("written_by") or {}
    needs = []
    for rank, host, folder, names in missing:
        places = {}
        for name in names:
            where = written_by.get(name)
            if where and (where["host"], where["folder"]) != (host, folder):
                place = f"node {where['node']} (host {where['host']}) wrote into {where['folder']}"
                places.setdefault(place, []).append(name)
        if places:
            found = "; ".join(f"{', '.join(files)}, which {place}" for place, files in places.items())
            needs.append(f"Rank {rank} reads {folder} and needs {found}")
    if not needs:
        return "Resume from an earlier checkpoint"
    world = index["world_size"]
    return (f"{'. '.join(needs)}. Copy the missing files into that folder from where they were written, or resume on "
            f"{world} rank{'s' if world > 1 else ''} as they were saved (each rank then reads only its own file, "
            "which is all a node keeps with --save_on_each_node), or resume from an earlier checkpoint")  # fmt: skip


class ShardSources:
    """Reads the saved shards by parameter: which old rank holds which elements of which
    parameter, from the index; the elements themselves with `pread` (see `SafetensorsFile`)."""

    def __init__(self, folder, index: dict | None = None):
        self.folder = Path(folder)
        self.index = index if index is not None else read_index(folder)
        self.world_size = self.index["world_size"]
        self.files = {}
        self.where = {}  # name -> (flat index, shape, [(param_start, rank, shard_start, numel)] sorted)
        for f, flat in enumerate(self.index["flats"]):
            pieces = [[] for _ in flat["params"]]
            for rank, segments in enumerate(flat["segments"]):
                for p, param_start, shard_start, numel in segments:
                    pieces[p].append((param_start, rank, shard_start, numel))
            for p, info in enumerate(flat["params"]):
                self.where[info["name"]] = (f, tuple(info["shape"]), sorted(pieces[p]))

    def file(self, rank: int) -> SafetensorsFile:
        if rank not in self.files:
            self.files[rank] = SafetensorsFile(self.folder / rank_file(rank, self.world_size))
        return self.files[rank]

    def keys(self, name: str) -> list:
        return self.index["flats"][self.where[name][0]]["keys"]

    def read_range(self, name: str, key: str, start: int, out: torch.Tensor) -> None:
        """out <- elements [start, start + len(out)) of parameter `name`'s `key` (flattened)."""
        f, _, pieces = self.where[name]
        end = start + out.numel()
        i = max(bisect.bisect_right(pieces, (start, float("inf"))) - 1, 0)
        covered = 0
        for param_start, rank, shard_start, numel in pieces[i:]:
            if param_start >= end:
                break
            lo, hi = max(start, param_start), min(end, param_start + numel)
            if lo < hi:
                source = shard_start + lo - param_start
                self.file(rank).read(f"flat{f}.{key}", source, source + hi - lo, out[lo - start : hi - start])
                covered += hi - lo
        if covered != out.numel():
            raise CheckpointError(f"{str(self.folder)!r}: the index does not cover {name!r} elements [{start}, {end})")

    def read_param(self, name: str, key: str = "master") -> torch.Tensor:
        """Parameter `name`'s whole `key` tensor (fp32, in its shape)."""
        shape = self.where[name][1]
        out = torch.empty(shape, dtype=torch.float32)
        self.read_range(name, key, 0, out.reshape(-1))
        return out

    def needed_files(self, flats, names: dict) -> list:
        """The file names a new shard reads: those of the old ranks that hold any element of
        `flats`' segments (this rank's, in the new layout), by the index alone."""
        ranks = set()
        for flat in flats:
            for seg in flat.segments:
                name = names.get(flat.params[seg.index])
                if name is None or name not in self.where:
                    continue  # refused by name when the shards are loaded
                start, end = seg.param_start, seg.param_start + seg.numel
                for param_start, rank, _, numel in self.where[name][2]:
                    if param_start < end and start < param_start + numel:
                        ranks.add(rank)
        ranks = ranks or {self.scalar_rank}  # an empty new shard still reads the scalars (step)
        self.scalar_rank = min(ranks)  # every file holds them: read them from one this rank needs anyway
        return [rank_file(r, self.world_size) for r in sorted(ranks)]

    scalar_rank = 0  # the old rank whose file the scalars are read from

    def scalars(self, flat: int) -> dict:
        entry = self.index["flats"][flat]
        scalars = dict(entry["scalars"])
        for key in entry["tensor_scalars"]:
            scalars[key] = self.file(self.scalar_rank).read(f"flat{flat}.{key}").clone()
        return scalars

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files = {}


# ---- load ----------------------------------------------------------------------------------------


@torch.no_grad()
def load_shards(optimizer, folder, names: dict) -> None:
    """Load a shard folder saved at any world size, stage or offload into `optimizer`: every
    rank fills its own new shard from the old ranks' files. Collective."""
    index = read_index(folder)
    sources = ShardSources(folder, index)
    try:
        # each rank checks and reads only the old ranks' files its new shard needs: at the same
        # world size its own, which is all a node holds without a shared filesystem
        needed = sources.needed_files(optimizer.flats, names)
        verify_files(folder, index, optimizer.rank, optimizer.world_size, optimizer.group, needed)
        _check_params(sources, [[names.get(p) for p in f.params] for f in optimizer.flats], folder)
        _load_hyperparameters(optimizer, index, names)
        if optimizer.loss_scaler is not None and index.get("loss_scaler"):
            optimizer.loss_scaler.load_state_dict(index["loss_scaler"])
        fresh = index["fresh"]
        flat_names, saved = [], []
        for flat in optimizer.flats:
            names_here = [names[p] for p in flat.params]
            old = {sources.where[n][0] for n in names_here}
            keys = sources.keys(names_here[0])
            if any(sources.index["flats"][o]["keys"] != keys for o in old):
                raise CheckpointError(f"{str(folder)!r}: parameters stepped together now were saved with different state")
            _check_state_keys(optimizer, keys, fresh, folder, index.get("optimizer", "another optimizer"))
            flat_names.append(names_here)
            saved.append((keys, None if fresh else sources.scalars(min(old))))
        optimizer.load_repartitioned(sources, flat_names, saved)
        optimizer.params_from_masters()
    finally:
        sources.close()


def _check_params(sources: ShardSources, flat_names: list, folder) -> None:
    problems = []
    for names in flat_names:
        if None in names:
            problems.append("a trainable parameter of this model has no name in it")
            continue
        for name in names:
            if name not in sources.where:
                problems.append(f"{name!r} is not in the checkpoint")
    saved = set(sources.where)
    mine = {n for names in flat_names for n in names}
    problems += [f"{name!r} is in the checkpoint but not trainable in this model" for name in sorted(saved - mine)]
    if problems:
        shown = "; ".join(problems[:5]) + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
        raise CheckpointError(f"the optimizer shards in {str(folder)!r} were saved for other parameters: {shown}")


def _check_state_keys(optimizer, keys: list, fresh: bool, folder, saved_by: str) -> None:
    """A state saved by another optimizer (SGD's momentum into AdamW...) is refused, not half-loaded."""
    from ..offload.engine import per_element_state

    expected = per_element_state(optimizer.optim_class, optimizer.defaults)
    saved = [k for k in keys if k != "master"]
    if not fresh and sorted(expected) != sorted(saved):
        raise CheckpointError(
            f"the optimizer shards in {str(folder)!r} hold {saved} ({saved_by}), this "
            f"{optimizer.optim_class.__name__} keeps {list(expected)}; resume with the same optimizer"
        )


def _load_hyperparameters(optimizer, index: dict, names: dict) -> None:
    saved = index["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved)} param groups, this one {len(optimizer.param_groups)}")
    for mine, theirs in zip(optimizer.param_groups, saved):
        for key, value in theirs.items():
            if key == "params":
                continue
            if isinstance(mine.get(key), tuple) and isinstance(value, list):
                value = tuple(value)
            mine[key] = value


@torch.no_grad()
def load_into_plain(optimizer: torch.optim.Optimizer, model, folder) -> None:
    """Resume an unsharded run from a shard folder: the model's trainable parameters take the
    fp32 masters, and `optimizer` (a plain torch optimizer) the full state, built a parameter
    at a time (a plain optimizer holds all of it anyway)."""
    index = read_index(folder)
    verify_files(folder, index)
    sources = ShardSources(folder, index)
    try:
        names = param_names(model)
        _check_params(sources, [[names.get(p) for g in optimizer.param_groups for p in g["params"]]], folder)
        if len(optimizer.param_groups) != len(index["param_groups"]):
            raise CheckpointError(f"the checkpoint's optimizer has {len(index['param_groups'])} param groups, "
                                  f"this one {len(optimizer.param_groups)}")  # fmt: skip
        state, groups, pid = {}, [], 0
        for group, saved in zip(optimizer.param_groups, index["param_groups"]):
            ids = []
            for p in group["params"]:
                name = names[p]
                p.copy_(sources.read_param(name, "master"))
                if not index["fresh"]:
                    flat = sources.where[name][0]
                    entry = {key: sources.read_param(name, key).to(p.device) for key in sources.keys(name) if key != "master"}
                    state[pid] = {**sources.scalars(flat), **entry}
                ids.append(pid)
                pid += 1
            hyper = {k: (tuple(v) if isinstance(group.get(k), tuple) else v) for k, v in saved.items() if k != "params"}
            groups.append({**{k: v for k, v in group.items() if k != "params"}, **hyper, "params": ids})
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    finally:
        sources.close()
