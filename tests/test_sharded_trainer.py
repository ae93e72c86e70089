"""--sharded_ddp through finetune_trainer.py: the same training as plain DDP, on 1 and 2 ranks."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, TINY_FLAGS, assert_ok, run_script, shared_run

DUMP = ROOT / "tests" / "helpers" / "run_and_dump.py"

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def train_flags(model, data, out, *extra):
    return ["--model_name_or_path", model, "--data_dir", data, "--output_dir", out, *TINY_FLAGS, "--do_train",
            "--max_steps", "6", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2",
            "--max_grad_norm", "0.3", "--weight_decay", "0.1", *extra]  # fmt: skip


def log(out):
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [(e["loss"], e["grad_norm"]) for e in history if "loss" in e]


# The references: plain DDP on 2 ranks, the plain Trainer on 1 process. Each is made once per test
# session (`shared_run`) and compared against here, in test_zero3_trainer.py and in
# test_offload_trainer.py, which import these fixtures.
@pytest.fixture(scope="module")
def ddp_run(tiny_model, tiny_data, tmp_path_factory):
    def make(out):
        assert_ok(run_script(train_flags(tiny_model, tiny_data, out), nproc=2, script=DUMP))

    return shared_run("ddp", tmp_path_factory, (tiny_model, tiny_data), make)


@pytest.fixture(scope="module")
def plain_run(tiny_model, tiny_data, tmp_path_factory):
    def make(out):
        assert_ok(run_script(train_flags(tiny_model, tiny_data, out, "--use_cpu")))

    return shared_run("plain", tmp_path_factory, (tiny_model, tiny_data), make)


SAVE_AT_3 = ["--save_strategy", "steps", "--save_steps", "3"]


@pytest.fixture(scope="module")
def zero2_run(tiny_model, tiny_data, tmp_path_factory):
    """zero_dp_2 on 2 ranks with a checkpoint at step 3: matched against DDP
    (test_two_ranks_match_ddp) and resumed from (test_sharded_checkpoint_resumes_exactly)."""
    out = tmp_path_factory.mktemp("zero2") / "out"
    flags = train_flags(tiny_model, tiny_data, out, "--sharded_ddp", "zero_dp_2", *SAVE_AT_3)
    assert_ok(run_script(flags, nproc=2, script=DUMP))
    return out


@pytest.mark.parametrize("option", ["simple", "zero_dp_2"])
def test_two_ranks_match_ddp(ddp_run, tiny_model, tiny_data, tmp_path, request, option):
    if option == "zero_dp_2":  # the run that also saves a checkpoint: saving changes nothing trained
        out = request.getfixturevalue("zero2_run")
    else:
        out = tmp_path / "out"
        assert_ok(run_script(train_flags(tiny_model, tiny_data, out, "--sharded_ddp", option), nproc=2, script=DUMP))
    reference, rank0, rank1 = (torch.load(d / f"rank{r}.pt") for d, r in ((ddp_run, 0), (out, 0), (out, 1)))
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0), "ranks diverged"
    worst = max((rank0[k] - reference[k]).abs().max().item() for k in reference)
    assert worst < 1e-6, f"{option} differs from DDP by {worst}"
    for (loss, norm), (ref_loss, ref_norm) in zip(log(out), log(ddp_run), strict=True):
        assert loss == pytest.approx(ref_loss, abs=1e-4) and norm == pytest.approx(ref_norm, rel=1e-4)


def test_one_rank_zero_dp_2_matches_plain(plain_run, tiny_model, tiny_data, tmp_path):
    out = tmp_path / "zero_dp_2"
    assert_ok(run_script(train_flags(tiny_model, tiny_data, out, "--use_cpu", "--sharded_ddp", "zero_dp_2")))
    plain, ours = load_file(plain_run / "model.safetensors"), load_file(out / "model.safetensors")
    worst = max((plain[k] - ours[k]).abs().max().item() for k in plain)
    assert worst < 1e-6


def test_bf16_sharded_trains_and_generates_in_16_bit(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "out"
    extra = ["--sharded_ddp", "zero_dp_2", "--bf16", "--max_steps", "12",
             "--do_eval", "--predict_with_generate", "--n_val", "10"]  # fmt: skip
    assert_ok(run_script(train_flags(tiny_model, tiny_data, out, *extra), nproc=2, script=DUMP))
    results = json.loads((out / "all_results.json").read_text())
    assert results["val_n_objs"] == 10 and "val_bleu" in results and "val_loss" in results
    rank0, rank1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    assert all(v.dtype == torch.bfloat16 for v in rank0.values())
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    losses = [loss for loss, _ in log(out)]
    assert losses[-1] < losses[0]


def test_sharded_checkpoint_resumes_exactly(zero2_run, tiny_model, tiny_data, tmp_path):
    """The straight run is `zero2_run`; resumed from its checkpoint-3, in a copy of it."""
    straight = load_file(zero2_run / "model.safetensors")
    shards = zero2_run / "checkpoint-3" / "optimizer_shards"  # each rank's shard, no full state on rank 0
    assert sorted(p.name for p in shards.iterdir()) == ["index.json", "rank-00000-of-00002.safetensors",
                                                        "rank-00001-of-00002.safetensors"]  # fmt: skip
    assert not (zero2_run / "checkpoint-3" / "optimizer.pt").exists()
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(zero2_run / "checkpoint-3", out / "checkpoint-3")
    flags = train_flags(tiny_model, tiny_data, out, "--sharded_ddp", "zero_dp_2", *SAVE_AT_3)
    assert_ok(run_script([*flags, "--resume_from_checkpoint", out / "checkpoint-3"], nproc=2))
    resumed = load_file(out / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_fp16_dynamic_loss_scaling_through_the_trainer(tiny_model, tiny_data, tmp_path):
    """fp16 parameters, fp32 shard masters; an overflowing first step is skipped on both ranks.
    fp16 compute on every CPU: `auto` computes in fp32 where fp16 products are slow (an AMD EPYC
    with bf16 kernels has no fp16 ones), and fp32 products of this model do not overflow at 2**16."""
    out = tmp_path / "out"
    extra = ["--sharded_ddp", "zero_dp_2", "--fp16", "--compute_dtype", "fp16", "--max_steps", "8",
             "--gradient_accumulation_steps", "1"]  # fmt: skip
    assert_ok(run_script(train_flags(tiny_model, tiny_data, out, *extra), nproc=2, script=DUMP))
    rank0, rank1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    assert all(v.dtype == torch.float16 for v in rank0.values())
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    steps = [e for e in history if "loss" in e]
    # the initial scale 2**16 overflows: that step is skipped and the LR schedule waits for it
    assert steps[0]["grad_norm"] != steps[0]["grad_norm"] or steps[0]["grad_norm"] == float("inf")
    assert steps[1]["learning_rate"] == steps[0]["learning_rate"]
    assert all(e["loss"] == e["loss"] for e in steps) and steps[-1]["loss"] < steps[0]["loss"]


def test_own_optimizer_must_be_sharded(tiny_model, tmp_path):
    """optimizers=(plain AdamW, None) with --sharded_ddp would silently not shard: refused."""
    from transformers import AutoModelForSeq2SeqLM

    from trainer_shard import ArgumentError, ShardedOptimizer, ShardedSeq2SeqTrainer, ShardedSeq2SeqTrainingArguments

    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model)
    args = ShardedSeq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", sharded_ddp="zero_dp_2")
    plain = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(ArgumentError, match="asks for ZeRO-2 but the trainer was given AdamW"):
        ShardedSeq2SeqTrainer(model=model, args=args, optimizers=(plain, None))
    trainer = ShardedSeq2SeqTrainer(model=model, args=args, optimizers=(ShardedOptimizer.wrap(plain, stage=2), None))
    assert trainer.sharded_optimizer.stage == 2
