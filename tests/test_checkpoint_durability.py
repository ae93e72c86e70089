"""Saves that fail or are cut short lose nothing already saved (issue 31, items 1 and 2).

A model saved over in place: a save that fails half-way (a full disk) leaves the previous model
loadable and no temporary file; a save that succeeds removes only the previous weights files of
this project's own shapes. A checkpoint: every file and folder fsynced before it is published,
the publish fsynced before older checkpoints are rotated away, a crash between publish's two
renames repaired by the next start, and a checkpoint of this project without its manifest
refused on resume. The references: the files on disk, `safetensors.load_file`,
`from_pretrained`, and the paths the kernel names for the descriptors fsync was given.
"""

import errno
import json
import os
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM, Seq2SeqTrainingArguments, TrainerState

from trainer_shard import ShardedSeq2SeqTrainingArguments
from trainer_shard import checkpoint as ckpt_module
from trainer_shard.checkpoint import MANIFEST, STAGING, manifest_problems, save_model, save_sharded
from trainer_shard.consolidate import consolidate
from trainer_shard.errors import CheckpointError
from trainer_shard.training import checkpoints

from test_manifest import saved_checkpoint

USER_FILES = {"model_ema.safetensors", "notes.txt"}


def weights(seed: int, n: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.weight": torch.randn(64, 64, generator=g) for i in range(n)}  # 16 KiB each


def with_user_files(folder: Path) -> None:
    save_file({"ema": torch.ones(3)}, folder / "model_ema.safetensors")
    (folder / "notes.txt").write_text("mine")


def loaded(folder: Path) -> dict:
    """The weights as `from_pretrained` would read them: model.safetensors when there, else the index's files."""
    if (folder / "model.safetensors").is_file():
        return load_file(folder / "model.safetensors")
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    return {k: v for name in set(weight_map.values()) for k, v in load_file(folder / name).items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def fail_on_tensor(monkeypatch, n: int) -> None:
    """The n-th tensor written from now raises ENOSPC, as a full disk does."""
    write_tensor, calls = ckpt_module._Crc.write_tensor, []

    def failing(self, pieces):
        calls.append(1)
        if len(calls) == n:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_tensor(self, pieces)

    monkeypatch.setattr(ckpt_module._Crc, "write_tensor", failing)


@pytest.mark.parametrize("before_limit, after_limit", [(10**9, 40_000), (40_000, 10**9), (40_000, 70_000), (40_000, 40_000)],
                         ids=["single-to-split", "split-to-single", "split-to-other-split", "split-to-same-split"])  # fmt: skip
def test_a_save_that_fails_half_way_leaves_the_previous_model(tmp_path, monkeypatch, before_limit, after_limit):
    save_sharded(weights(0), tmp_path, before_limit)
    with_user_files(tmp_path)
    files_before, model_before = sorted(os.listdir(tmp_path)), loaded(tmp_path)
    fail_on_tensor(monkeypatch, 5)  # the third file of a split, or the middle of the single file
    with pytest.raises(OSError, match="No space left"):
        save_sharded(weights(1), tmp_path, after_limit)
    assert sorted(os.listdir(tmp_path)) == files_before  # no temporary file left, nothing removed
    assert same(loaded(tmp_path), model_before)


@pytest.mark.parametrize("before_limit, after_limit", [(10**9, 40_000), (40_000, 10**9), (40_000, 70_000)],
                         ids=["single-to-split", "split-to-single", "split-to-other-split"])  # fmt: skip
def test_a_save_removes_only_the_stale_weights_files_of_its_own_shapes(tmp_path, before_limit, after_limit):
    save_sharded(weights(0), tmp_path, before_limit)
    with_user_files(tmp_path)
    (tmp_path / "model-00001-of-00009.safetensors.tmp").write_bytes(b"left by a killed save")
    new = weights(1)
    files = save_sharded(new, tmp_path, after_limit)
    index = {"model.safetensors.index.json"} if len(files) > 1 else set()
    assert set(os.listdir(tmp_path)) == set(files) | index | USER_FILES
    assert same(loaded(tmp_path), new)
    assert torch.equal(load_file(tmp_path / "model_ema.safetensors")["ema"], torch.ones(3))


def test_save_model_and_consolidate_keep_the_previous_model_when_they_fail(tiny_model, tmp_path, monkeypatch):
    """Trainer.save_model's writer and `consolidate OUT`, over a folder holding a model and a user's file."""
    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model)
    checkpoint = saved_checkpoint(tiny_model, tmp_path / "checkpoint-2")
    trained = load_file(checkpoint / "model.safetensors")  # fp32: the masters consolidate writes
    for folder, save, expected in [
        (tmp_path / "saved", lambda out: save_model(model, out, 40_000), model.state_dict()),
        (tmp_path / "consolidated", lambda out: consolidate(checkpoint, out, max_shard_size="40KB"), trained),
    ]:  # fmt: skip
        save_model(AutoModelForSeq2SeqLM.from_pretrained(tiny_model), folder)
        with_user_files(folder)
        files_before, model_before = sorted(os.listdir(folder)), loaded(folder)
        with monkeypatch.context() as m:
            fail_on_tensor(m, 4)
            with pytest.raises(OSError, match="No space left"):
                save(folder)
        assert sorted(os.listdir(folder)) == files_before, folder.name
        assert same(loaded(folder), model_before)
        save(folder)  # and with room: the split, the user's files kept
        assert "model.safetensors" not in os.listdir(folder) and USER_FILES <= set(os.listdir(folder))
        reloaded = AutoModelForSeq2SeqLM.from_pretrained(folder).state_dict()
        assert all(torch.equal(reloaded[k], v) for k, v in expected.items()), folder.name


# ---- checkpoints ----------------------------------------------------------------------------


def _args(run_dir, limit=None):
    return SimpleNamespace(should_save=True, save_total_limit=limit, output_dir=str(run_dir))


def staged_save(run_dir, step, limit=None, content=b"x"):
    """A checkpoint's files as the Trainer writes them (none fsynced), staged; the `StagedSave`."""
    save = checkpoints.StagedSave(str(run_dir), step, _args(run_dir, limit), lambda: 1, None)
    save.begin()
    staging = Path(save.staging)
    (staging / "optimizer_shards").mkdir(parents=True)
    for name in ["trainer_state.json", "scheduler.pt", "rng_state.pth", "config.json", "model.safetensors",
                 "optimizer_shards/rank-00000-of-00001.safetensors"]:  # fmt: skip
        (staging / name).write_bytes(content * (10 + step))
    save.gather()
    return save


class Log:
    """The order of fsyncs (by the path the kernel names for the descriptor), renames and rmtrees."""

    def __init__(self, monkeypatch):
        self.events = []
        fsync, replace, rmtree = os.fsync, os.replace, shutil.rmtree

        def logged_fsync(fd):
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            return fsync(fd)

        def logged_replace(src, dst, **kw):
            self.events.append(("replace", str(src), str(dst)))
            return replace(src, dst, **kw)

        def logged_rmtree(path, *args, **kw):
            self.events.append(("rmtree", str(path)))
            return rmtree(path, *args, **kw)

        monkeypatch.setattr(os, "fsync", logged_fsync)
        monkeypatch.setattr(os, "replace", logged_replace)
        monkeypatch.setattr(shutil, "rmtree", logged_rmtree)

    def index(self, event) -> int:
        return self.events.index(event)

    def synced_before(self, position) -> set:
        return {e[1] for e in self.events[:position] if e[0] == "fsync"}


def test_a_checkpoint_is_durable_before_it_is_published_and_rotation_waits_for_the_publish(tmp_path, monkeypatch):
    first = staged_save(tmp_path, 1).publish(TrainerState())
    save = staged_save(tmp_path, 2, limit=1)
    log = Log(monkeypatch)
    final = save.publish(TrainerState())
    published = log.index(("replace", save.staging, final))
    assert {MANIFEST, "trainer_state.json", "scheduler.pt", "rng_state.pth", "config.json"} <= set(os.listdir(final))
    # every file and folder of the published checkpoint, at its staged path, fsynced before the rename
    staging = os.path.realpath(save.staging)
    on_disk = {os.path.join(staging, p.relative_to(final)) for p in Path(final).rglob("*")} | {staging}
    missing = sorted(on_disk - log.synced_before(published))
    assert not missing, f"published before these were fsynced: {missing}"
    # the folder the checkpoint was renamed into, fsynced after the rename and before rotation removed the previous one
    rotated = log.index(("rmtree", first))
    assert os.path.realpath(tmp_path) in log.synced_before(rotated) - log.synced_before(published)
    assert not Path(first).exists() and manifest_problems(final) == []


class Crash(BaseException):
    """The process dies here (not an error anything handles)."""


def crash_between_the_renames(monkeypatch, save) -> None:
    replace = os.replace

    def crashing(src, dst, **kw):
        if str(src) == save.staging:
            raise Crash
        return replace(src, dst, **kw)

    monkeypatch.setattr(os, "replace", crashing)
    with pytest.raises(Crash):
        save.publish(TrainerState())
    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("manifest_written", [True, False], ids=["new-one-back", "old-one-back"])
def test_a_crash_between_the_renames_of_publish_leaves_one_complete_checkpoint(tmp_path, monkeypatch, manifest_written):
    """The same step saved again (e.g. at the end of training): the published folder is moved
    aside, then the crash; the next start's staging cleanup must not remove both copies."""
    final = staged_save(tmp_path, 2, content=b"o").publish(TrainerState())
    save = staged_save(tmp_path, 2, content=b"n")
    crash_between_the_renames(monkeypatch, save)
    assert not Path(final).exists()  # moved aside: the crash came between the two renames
    if not manifest_written:  # (publish writes the manifest first; without it the new copy is not trusted)
        (Path(save.staging) / MANIFEST).unlink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoints.clear_staging(tmp_path)  # what the next start does
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2"]
    assert manifest_problems(final) == [] and (Path(final) / MANIFEST).is_file()
    assert (Path(final) / "model.safetensors").read_bytes()[:1] == (b"n" if manifest_written else b"o")
    assert [str(w.message) for w in caught] == [f"{final!r} was put back in place: the run that saved it stopped "
                                                "while publishing it"]  # fmt: skip


def test_a_publish_whose_second_rename_fails_puts_the_published_checkpoint_back(tmp_path, monkeypatch):
    final = staged_save(tmp_path, 2, content=b"o").publish(TrainerState())
    save = staged_save(tmp_path, 2, content=b"n")
    replace = os.replace

    def failing(src, dst, **kw):
        if str(src) == save.staging:
            raise OSError(errno.EIO, "Input/output error")
        return replace(src, dst, **kw)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(CheckpointError, match="checkpoint-2 was not saved: rank 0: .*Input/output error"):
        save.publish(TrainerState())
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2"]
    assert manifest_problems(final) == [] and (Path(final) / "model.safetensors").read_bytes()[:1] == b"o"


def _resume_args():
    return SimpleNamespace(process_index=0, world_size=1, local_process_index=0, save_on_each_node=False)


def test_a_checkpoint_of_this_project_without_its_manifest_is_refused(tiny_model, tmp_path):
    sharded = saved_checkpoint(tiny_model, tmp_path / "sharded" / "checkpoint-2")
    (sharded / MANIFEST).unlink()
    files = sorted(p for p in sharded.rglob("*"))
    with pytest.raises(CheckpointError) as raised:
        checkpoints.check_manifest(sharded, _resume_args())
    text = str(raised.value)
    assert f"checkpoint {str(sharded)!r} cannot be resumed: it has no {MANIFEST}" in text
    assert "it holds optimizer_shards/" in text and "Resume from an earlier checkpoint" in text
    assert "--model_name_or_path" in text
    assert sorted(p for p in sharded.rglob("*")) == files  # nothing removed
    # a run of this project without sharding: no optimizer_shards/, but its training_args.bin
    unsharded, plain = tmp_path / "unsharded", tmp_path / "plain"
    for folder, args_class in [(unsharded, ShardedSeq2SeqTrainingArguments), (plain, Seq2SeqTrainingArguments)]:
        folder.mkdir()
        shutil.copy(sharded / "model.safetensors", folder)
        torch.save(args_class(output_dir=str(tmp_path / "x"), report_to="none", use_cpu=True), folder / "training_args.bin")
    with pytest.raises(CheckpointError, match="training_args.bin holds trainer_shard's arguments"):
        checkpoints.check_manifest(unsharded, _resume_args())
    checkpoints.check_manifest(plain, _resume_args())  # a plain Trainer's checkpoint: resumed unchecked, as before
