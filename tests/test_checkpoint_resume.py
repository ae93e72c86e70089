"""Checkpoints of sharded and offloaded runs through finetune_trainer.py: a run killed in the middle
of a save resumes from the last complete checkpoint and ends bit for bit where the uninterrupted
run ends; resumes at another world size or stage; consolidation; damaged checkpoints."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, TINY_FLAGS, assert_ok, run_script
from trainer_shard.sharding import state_io

KILL = ROOT / "tests" / "helpers" / "kill_during_save.py"

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def flags(model, data, out, *extra):
    return ["--model_name_or_path", model, "--data_dir", data, "--output_dir", out, *TINY_FLAGS, "--do_train",
            "--max_steps", "6", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
            "--max_grad_norm", "0.3", "--weight_decay", "0.1", "--save_strategy", "steps", "--save_steps", "2",
            *extra]  # fmt: skip


def offload_config(tmp_path, device):
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": device}}, "bf16": {"enabled": "auto"}}
    if device == "nvme":
        config["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / "nvme")
    path = tmp_path / f"{device}.json"
    path.write_text(json.dumps(config))
    return path


def run_killed_then_resumed(model, data, out, nproc, extra):
    """Kill the run while it saves checkpoint-4 (rank `nproc - 1`), then resume from the newest."""
    env = {"KILL_AT_STEP": "4", "KILL_RANK": str(nproc - 1)}
    killed = run_script(flags(model, data, out, *extra), nproc=nproc, script=KILL, env=env)
    assert killed.returncode != 0, "the kill did not happen"
    assert not (out / "checkpoint-4").exists(), "a half-written checkpoint was published"
    assert (out / ".checkpoint-staging" / "checkpoint-4").is_dir()  # what the killed save left
    assert (out / "checkpoint-2" / "checkpoint_manifest.json").is_file()
    return run_script([*flags(model, data, out, *extra), "--resume_from_checkpoint", "latest"], nproc=nproc)


# (a disk-offload checkpoint resumes exactly in test_offload_trainer.py; a kill in the middle of a
# save on 2 ranks started by hand is in tests/faults/test_rank_faults.py)
@pytest.mark.parametrize(
    "nproc, extra, device",
    [(2, ["--sharded_ddp", "zero_dp_2", "--bf16"], "cpu")],
    ids=["2-ranks-zero2-bf16-cpu-offload"],
)
def test_killed_during_save_resumes_exactly(tiny_model, tiny_data, tmp_path, nproc, extra, device):
    extra = [*extra, "--offload", offload_config(tmp_path, device)]
    straight = tmp_path / "straight"
    assert_ok(run_script(flags(tiny_model, tiny_data, straight, *extra), nproc=nproc))
    assert sorted(p.name for p in straight.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    assert not (straight / ".checkpoint-staging").exists()
    out = tmp_path / "killed"
    resumed = run_killed_then_resumed(tiny_model, tiny_data, out, nproc, [*extra, "--save_total_limit", "1"])
    assert_ok(resumed)
    a, b = load_file(straight / "model.safetensors"), load_file(out / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "resumed run differs"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-6"]  # save_total_limit 1: the newest


# Micro-batches of 2 samples, 6 of them a step: 2 ranks x 3 accumulation steps here, 1 x 6 or 3 x 2
# on resume. The seedable sampler deals the same micro-batches to each step at any world size, and
# the loss is the mean of the micro-batches' means either way: the same gradients, summed in
# another order.
MICRO = ["--per_device_train_batch_size", "2"]


@pytest.fixture(scope="module")
def two_rank_run(tiny_model, tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("two") / "out"
    extra = ["--sharded_ddp", "zero_dp_2", *MICRO, "--gradient_accumulation_steps", "3"]
    assert_ok(run_script(flags(tiny_model, tiny_data, out, *extra), nproc=2))
    return out


def resume_copy(run, tmp_path, step):
    """A fresh output folder holding only checkpoint-`step` of `run`."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(run / f"checkpoint-{step}", out / f"checkpoint-{step}")
    return out


def resumed_steps(out):
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [e["step"] for e in history if "loss" in e]


@pytest.mark.parametrize(
    "nproc, extra",
    [(1, ["--sharded_ddp", "zero_dp_2"]), (1, []), (3, ["--sharded_ddp", "simple"])],
    ids=["2to1-zero2", "2to1-no-sharding", "2to3-zero1"],
)
def test_resume_at_another_world_size_or_stage(two_rank_run, tiny_model, tiny_data, tmp_path, nproc, extra):
    """Resumed at step 4 on 1 or 3 ranks, the run ends where the uninterrupted 2-rank run ends.

    Tolerance: the same micro-batches and the same mean (see MICRO), but the gradients are summed
    in another order (over 1, 2 or 3 ranks, in buckets or not), so they may differ in the last
    bits, which Adam's two steps after the resume carry into the weights: measured 1.2e-7 at most
    (an ulp of the largest weights) against 2e-3 moved by those two steps; the bar is 1e-6. A
    resume that lost the moments or the masters, or took other batches, is off by far more."""
    out = resume_copy(two_rank_run, tmp_path, 4)
    extra = [*extra, *MICRO, "--gradient_accumulation_steps", str(6 // nproc), "--resume_from_checkpoint", "latest"]
    assert_ok(run_script(flags(tiny_model, tiny_data, out, *extra), nproc=nproc))
    assert resumed_steps(out) == [1, 2, 3, 4, 5, 6]  # 1-4 from the checkpoint's history, then 5 and 6 here
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["global_step"] == 6
    straight, resumed = load_file(two_rank_run / "model.safetensors"), load_file(out / "model.safetensors")
    initial = load_file(two_rank_run / "checkpoint-4" / "model.safetensors")
    assert straight.keys() == resumed.keys()
    worst = max((straight[k] - resumed[k]).abs().max().item() for k in straight)
    moved = max((straight[k] - initial[k]).abs().max().item() for k in straight)
    print(f"resumed on {nproc}: {worst:.2e} from the uninterrupted run; the last steps moved {moved:.2e}")
    assert moved > 5e-4, "the last two steps changed nothing"
    assert worst <= 1e-6, f"resumed run ends {worst:.2e} from the uninterrupted one (the steps moved {moved:.2e})"


def test_one_rank_checkpoint_resumes_on_two(tiny_model, tiny_data, tmp_path):
    one = tmp_path / "one"
    assert_ok(run_script(flags(tiny_model, tiny_data, one, "--sharded_ddp", "zero_dp_2", "--max_steps", "2"), nproc=1))
    out = resume_copy(one, tmp_path, 2)
    extra = ["--sharded_ddp", "zero_dp_2", "--max_steps", "4", "--resume_from_checkpoint", "latest"]
    assert_ok(run_script(flags(tiny_model, tiny_data, out, *extra), nproc=2))
    assert resumed_steps(out) == [1, 2, 3, 4]


def test_consolidated_model_loads_and_matches(two_rank_run, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    checkpoint = two_rank_run / "checkpoint-6"
    out = tmp_path / "plain"
    exe = [sys.executable, "-m", "trainer_shard.cli", "consolidate"]
    proc = subprocess.run([*exe, checkpoint, out, "--max_shard_size", "20KB", "--optimizer"], capture_output=True,
                          text=True, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    final = load_file(two_rank_run / "model.safetensors")  # fp32 training: the masters are the weights
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in final.items())
    optimizer = load_file(out / "optimizer.safetensors")
    sources = state_io.ShardSources(checkpoint / state_io.FOLDER)
    name = "shared.weight"
    assert torch.equal(optimizer[f"state.{name}.exp_avg_sq"], sources.read_param(name, "exp_avg_sq"))
    sources.close()
    bf16 = tmp_path / "bf16"
    assert subprocess.run([*exe, checkpoint, bf16, "--dtype", "bfloat16"], cwd=ROOT).returncode == 0
    weights = load_file(bf16 / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    assert json.loads((bf16 / "config.json").read_text()).get("dtype") in ("bfloat16", None)
    bad = subprocess.run([*exe, two_rank_run, tmp_path / "x"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "has no optimizer_shards/" in bad.stderr


def test_damaged_checkpoint_is_refused_by_name(two_rank_run, tiny_model, tiny_data, tmp_path):
    out = resume_copy(two_rank_run, tmp_path, 4)
    weights = out / "checkpoint-4" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    resume = [*flags(tiny_model, tiny_data, out, "--sharded_ddp", "zero_dp_2"), "--resume_from_checkpoint", "latest"]
    proc = run_script(resume, nproc=2)
    assert proc.returncode != 0
    assert "checkpoint-4/model.safetensors' is corrupt" in proc.stderr
    shutil.rmtree(out / "checkpoint-4" / state_io.FOLDER)
    (out / "checkpoint-4" / "checkpoint_manifest.json").unlink()
    proc = run_script(resume, nproc=1)  # this project wrote it (its training_args.bin says so): no manifest, refused
    assert proc.returncode != 0 and "cannot be resumed: it has no checkpoint_manifest.json" in proc.stderr
    (out / "checkpoint-4" / "training_args.bin").unlink()  # now it could be a plain Trainer's: resumed unchecked
    proc = run_script(resume, nproc=1)
    assert proc.returncode != 0 and "holds no optimizer state" in proc.stderr


def test_best_checkpoint_is_the_published_folder(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "out"
    extra = ["--sharded_ddp", "zero_dp_2", "--eval_strategy", "steps", "--eval_steps", "2", "--do_eval", "--n_val", "8",
             "--load_best_model_at_end", "--metric_for_best_model", "loss", "--save_total_limit", "1"]  # fmt: skip
    assert_ok(run_script(flags(tiny_model, tiny_data, out, *extra), nproc=1))
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    best = state["best_model_checkpoint"]
    assert ".checkpoint-staging" not in best and (out / best.rsplit("/", 1)[1]).is_dir()
    assert best.rsplit("/", 1)[1] in [p.name for p in out.glob("checkpoint-*")]  # rotation kept it
