"""The checkpoint manifest catches a missing, truncated or altered file the checkpoint needs, and
lets the weights be re-split (or merged) the way transformers' tooling does it; the files the
checkpoint code opens are closed; reads of more than 2 GiB come back whole."""

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSeq2SeqLM

from trainer_shard.checkpoint import MANIFEST, SafetensorsFile, manifest_problems, save_model, write_manifest
from trainer_shard.consolidate import consolidate
from trainer_shard.errors import CheckpointError
from trainer_shard.sharding import ShardedOptimizer, state_io
from trainer_shard.training import checkpoints


def saved_checkpoint(tiny_model, folder: Path) -> Path:
    """A checkpoint as the trainer writes one: the weights from the writer, an optimizer shard set,
    a side file, and the manifest over them."""
    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=2, lr=1e-3)
    model(input_ids=torch.ones(1, 4, dtype=torch.long), labels=torch.ones(1, 3, dtype=torch.long)).loss.backward()
    opt.step()
    known = save_model(model, folder)
    shards = state_io.save_shards(opt, folder / state_io.FOLDER, state_io.param_names(model))
    (folder / "trainer_state.json").write_text("{}")
    write_manifest(folder, {**known, **{f"{state_io.FOLDER}/{n}": info for n, info in shards.items()}})
    return folder


def resplit(folder: Path, max_shard_size="40KB") -> list:
    """What transformers' tooling does: the weights saved again in files of at most
    `max_shard_size` with model.safetensors.index.json, the single file removed."""
    model = AutoModelForSeq2SeqLM.from_pretrained(folder)
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    (folder / "model.safetensors").unlink()
    return json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]


def test_resplit_weights_are_the_same_checkpoint(tiny_model, tmp_path):
    ckpt = saved_checkpoint(tiny_model, tmp_path / "checkpoint-2")
    before = load_file(ckpt / "model.safetensors")
    weight_map = resplit(ckpt)
    assert len(set(weight_map.values())) > 2 and not (ckpt / "model.safetensors").exists()
    assert manifest_problems(ckpt) == []
    assert manifest_problems(ckpt, 0, 2) == [] and manifest_problems(ckpt, 1, 2) == []  # ranks sharing the reading
    # and merged back into one file
    AutoModelForSeq2SeqLM.from_pretrained(ckpt).save_pretrained(ckpt)
    for name in set(weight_map.values()) | {"model.safetensors.index.json"}:
        (ckpt / name).unlink(missing_ok=True)
    assert manifest_problems(ckpt) == []
    after = load_file(ckpt / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)


def _damaged(tiny_model, tmp_path, name):
    ckpt = saved_checkpoint(tiny_model, tmp_path / name)
    files = sorted(set(resplit(ckpt).values()))
    return ckpt, files[1], ckpt / files[1]


def test_a_missing_truncated_or_altered_file_of_the_new_form_is_named(tiny_model, tmp_path):
    ckpt, name, victim = _damaged(tiny_model, tmp_path, "missing")
    victim.unlink()
    problems = manifest_problems(ckpt)
    assert problems == [f"{str(victim)!r} is missing (model.safetensors.index.json names it)"]

    ckpt, name, victim = _damaged(tiny_model, tmp_path, "truncated")
    victim.write_bytes(victim.read_bytes()[:-10])
    problems = manifest_problems(ckpt)
    assert len(problems) == 1 and problems[0].startswith(f"checkpoint file {str(victim)!r} is corrupt or truncated")

    ckpt, name, victim = _damaged(tiny_model, tmp_path, "altered")
    with SafetensorsFile(victim) as f:
        tensor = sorted(f.keys())[0]
        _, _, begin, _ = f.tensors[tensor]
        offset = f._data_start + begin
    data = bytearray(victim.read_bytes())
    data[offset] ^= 0x40
    victim.write_bytes(bytes(data))
    expected = f"{str(victim)!r} is corrupt: the bytes of {tensor!r} differ from those saved (CRC-32)"
    assert manifest_problems(ckpt) == [expected]
    # the ranks share the reading: the one whose share holds the file finds it
    assert sorted(manifest_problems(ckpt, 0, 2) + manifest_problems(ckpt, 1, 2)) == [expected]
    with pytest.raises(CheckpointError, match="cannot be resumed: .* is corrupt: the bytes of"):
        checkpoints.check_manifest(ckpt, _args())

    # a tensor the checkpoint saved that no file holds any more
    ckpt = saved_checkpoint(tiny_model, tmp_path / "lacking")
    save_file({"shared.weight": load_file(ckpt / "model.safetensors")["shared.weight"]}, ckpt / "model.safetensors")
    (problem,) = manifest_problems(ckpt)
    assert problem.startswith(f"the weights in {str(ckpt)!r} (model.safetensors) lack ")


def _args():
    from types import SimpleNamespace

    return SimpleNamespace(process_index=0, world_size=1, local_process_index=0, save_on_each_node=False)


def test_consolidate_closes_every_file_it_opens(tiny_model, tmp_path):
    ckpt = saved_checkpoint(tiny_model, tmp_path / "checkpoint-2")
    consolidate(ckpt, tmp_path / "warm")  # imports and caches out of the count
    before = sorted(os.listdir("/proc/self/fd"))
    consolidate(ckpt, tmp_path / "plain")
    assert sorted(os.listdir("/proc/self/fd")) == before
    with pytest.warns(ResourceWarning, match="unclosed checkpoint file"):
        SafetensorsFile(ckpt / "model.safetensors")  # dropped open: warns as Python's own files do


def test_short_reads_are_continued(tmp_path, monkeypatch):
    """One read call may return fewer bytes than asked (Linux: at most 0x7ffff000): the rest is
    read, not reported as a truncated file; a file that really ends early still is."""
    values = torch.arange(10_000, dtype=torch.float32)
    path = tmp_path / "x.safetensors"
    save_file({"x": values}, path)
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: preadv(fd, [buffers[0][:1000]], offset))
    with SafetensorsFile(path) as f:
        assert torch.equal(f.read("x"), values) and torch.equal(f.read("x", 100, 9000), values[100:9000])
        os.truncate(path, os.path.getsize(path) - 4)  # shorter than its header says, after it was opened
        with pytest.raises(CheckpointError, match="ends inside 'x': truncated"):
            f.read("x")


@pytest.mark.slow
def test_a_read_over_2_gib_comes_back_whole(tmp_path):
    """Linux returns at most 0x7ffff000 bytes from one read call: a tensor over 2 GiB (a hole in a
    sparse file: no disk used) is read whole, each part in its place."""
    numel = 2**31 + 8192
    header = json.dumps({"big": {"dtype": "U8", "shape": [numel], "data_offsets": [0, numel]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "big.safetensors"
    start = 8 + len(header)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for offset, value in ((0x7FFFF000 - 1, 1), (0x7FFFF000, 2), (numel - 1, 3)):
            f.seek(start + offset)
            f.write(bytes([value]))
        f.truncate(start + numel)
    with SafetensorsFile(path) as f:
        data = f.read("big")
        assert data.shape == (numel,)
        assert [data[0x7FFFF000 - 1].item(), data[0x7FFFF000].item(), data[-1].item(), data[-2].item()] == [1, 2, 3, 0]
        part = f.read("big", numel - 4, numel)
        assert part.tolist() == [0, 0, 0, 3]


def train(model_dir, out, sharded_ddp, resume=None) -> Path:
    """3 steps of the Trainer in this process, a checkpoint at step 2; the final weights' file."""
    from transformers import default_data_collator

    from trainer_shard import ShardedSeq2SeqTrainer, ShardedSeq2SeqTrainingArguments

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": torch.randint(3, 300, (8,), generator=g), "attention_mask": torch.ones(8, dtype=torch.long),
             "labels": torch.randint(3, 300, (6,), generator=g)} for _ in range(16)]  # fmt: skip
    args = ShardedSeq2SeqTrainingArguments(
        output_dir=str(out), sharded_ddp=sharded_ddp, use_cpu=True, max_steps=3, per_device_train_batch_size=4,
        save_strategy="steps", save_steps=2, report_to="none", seed=7, disable_tqdm=True, learning_rate=3e-3,
    )  # fmt: skip
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    trainer = ShardedSeq2SeqTrainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    return out / "model.safetensors"


@pytest.mark.parametrize("sharded_ddp", [None, "zero_dp_2"], ids=["plain", "zero_dp_2"])
def test_resume_from_a_resplit_checkpoint_ends_where_the_straight_run_does(tiny_model, tmp_path, sharded_ddp):
    """Without sharding the weights come from the re-split files alone (with it, from the masters
    of the optimizer shards); either way the run ends bit for bit where the straight one does."""
    straight = load_file(train(tiny_model, tmp_path / "straight", sharded_ddp))
    out = tmp_path / "resplit"
    shutil.copytree(tmp_path / "straight" / "checkpoint-2", out / "checkpoint-2")
    resplit(out / "checkpoint-2")
    again = load_file(train(tiny_model, out, sharded_ddp, resume=str(out / "checkpoint-2")))
    assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight)
    assert json.loads((out / "checkpoint-2" / MANIFEST).read_text())["weights"]  # recorded by tensor
