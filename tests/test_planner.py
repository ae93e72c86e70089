"""`trainer-shard estimate` and `--sharded_ddp auto`: exact state arithmetic, and predictions
checked against the measured peak RSS of real 2-rank runs (tolerance: 15%)."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, TINY_FLAGS, assert_ok, run_script
from trainer_shard import planner
from trainer_shard.args import ShardedSeq2SeqTrainingArguments
from trainer_shard.errors import ArgumentError

PEAK = ROOT / "tests" / "helpers" / "peak_rss.py"
TOLERANCE = 0.15
GiB = 2**30


def test_named_architectures_count_their_parameters():
    assert planner.count_parameters(planner.model_config("t5-small")) == (60_506_624, 60_506_624)
    assert planner.count_parameters(planner.model_config("t5-3b"))[0] == 2_851_598_336


def test_state_bytes_per_strategy():
    P, N = 1_000_000, 2
    ddp = planner.strategy_bytes("ddp", None, P, P, N, "fp32")
    assert ddp == {"device": 20 * P, "cpu": 0, "disk": 0}  # weights 4, .grad 4, DDP buckets 4, Adam 8
    buckets = 3 * P * 4  # this model is smaller than one bucket: all of it, three times at most
    zero2 = planner.strategy_bytes("zero_dp_2", None, P, P, N, "fp32")
    assert zero2["device"] == 4 * P + 4 * P // N + buckets + 8 * P // N  # fp32 weights are their own masters
    bf16 = planner.strategy_bytes("zero_dp_2", None, P, P, N, "bf16")
    assert bf16["device"] == 2 * P + 4 * P // N + 3 * P * 2 + 12 * P // N  # 16-bit weights, fp32 master + Adam
    cpu = planner.strategy_bytes("zero_dp_2", "cpu", P, P, N, "bf16")
    assert cpu == {"device": 2 * P + 2 * P // N + 3 * P * 2, "cpu": 12 * P // N, "disk": 0}
    disk = planner.strategy_bytes("zero_dp_2", "disk", P, P, N, "bf16")
    assert disk["disk"] == 12 * P // N and disk["device"] == cpu["device"]
    simple = planner.strategy_bytes("simple", None, P, P, N, "fp32")
    assert simple["device"] == 4 * P + 4 * P + 4 * P + 4 * P // N + 8 * P // N
    with pytest.raises(ValueError, match="DDP has no offload"):
        planner.strategy_bytes("ddp", "cpu", P, P, N, "fp32")


def test_auto_takes_the_least_costly_strategy_that_fits():
    probe = planner.Probe(runtime=0, act_base=0, act_per_sample=0)
    rows = planner.estimate(planner.model_config("t5-small"), world_size=2, precision="fp32", batch_size=8,
                            source_length=32, target_length=32, probes={"ddp": probe, "sharded": probe})  # fmt: skip
    per_rank = {(r["strategy"], r["offload"]): r["per_rank"] for r in rows}
    assert planner.choose(rows, 10 * GiB)["strategy"] == "ddp"
    assert planner.choose(rows, per_rank[("zero_dp_2", "none")])["strategy"] == "zero_dp_2"
    assert planner.choose(rows, per_rank[("zero_dp_2", "disk")])["offload"] == "disk"
    assert planner.choose(rows, per_rank[("zero_dp_2", "disk")] - 1) is None
    assert "nothing fits" in planner.explain(rows, None, 1)


def test_auto_refuses_what_it_would_override(tmp_path):
    budget = tmp_path / "budget.json"
    budget.write_text(json.dumps({"max_memory": {"cpu": "4GiB"}}))
    base = dict(output_dir=str(tmp_path / "o"), use_cpu=True, report_to="none")
    ShardedSeq2SeqTrainingArguments(**base, sharded_ddp="auto", offload=str(budget))  # accepted
    with pytest.raises(ArgumentError, match="max_memory is the per-rank budget of --sharded_ddp auto"):
        ShardedSeq2SeqTrainingArguments(**base, offload=str(budget))
    stage = tmp_path / "stage.json"
    stage.write_text(json.dumps({"zero_optimization": {"stage": 2}, "max_memory": {"cpu": "4GiB"}}))
    with pytest.raises(ArgumentError, match="zero_optimization: --sharded_ddp auto chooses the stage"):
        ShardedSeq2SeqTrainingArguments(**base, sharded_ddp="auto", offload=str(stage))
    with pytest.raises(ArgumentError, match="'auto' chooses the offload itself"):
        ShardedSeq2SeqTrainingArguments(**base, sharded_ddp="auto offload")


@pytest.mark.slow
def test_estimate_command_prints_every_strategy(tiny_model):
    proc = subprocess.run([sys.executable, "-m", "trainer_shard.cli", "estimate", "--model", "t5-3b", "--world_size",
                           "2", "--precision", "bf16", "--no_probe", "--max_memory", "24GiB", "--batch_size", "4"],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "2,851,598,336 parameters" in proc.stdout
    assert proc.stdout.count("| zero_dp_2 |") == 3 and "| ddp | none |" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "trainer_shard.cli", "estimate", "--model", "t5-3b", "--max_memory",
                          "lots"], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert bad.returncode == 2 and "must be a size" in bad.stderr
    import torch

    if not torch.cuda.is_available():
        gpu = subprocess.run([sys.executable, "-m", "trainer_shard.cli", "estimate", "--model", "t5-small", "--device",
                              "cuda"], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
        assert gpu.returncode == 2 and "no CUDA device" in gpu.stderr


# ---- predictions against measured peaks -----------------------------------------------------------


@pytest.fixture(scope="module")
def small_model(tiny_data, tmp_path_factory):
    """The t5-small architecture (60.5 M parameters): big enough that the state, not the runtime,
    decides the peak."""
    from trainer_shard.demo import build_demo_model

    return build_demo_model(tiny_data, tmp_path_factory.mktemp("small"), d_model=512, d_ff=2048, num_layers=6,
                            num_heads=8, d_kv=64, model_vocab_size=32128)  # fmt: skip


def run_flags(model, data, out, *extra):
    return ["--model_name_or_path", model, "--data_dir", data, "--output_dir", out, *TINY_FLAGS, "--do_train",
            "--max_steps", "3", "--per_device_train_batch_size", "8", "--optim", "adamw_torch_fused", *extra]  # fmt: skip


def measured_peak(out) -> int:
    return max(json.loads(p.read_text())["peak_rss_bytes"] for p in out.glob("peak_rss_rank*.json"))


def data_lengths(model, data) -> tuple:
    from transformers import AutoTokenizer

    from trainer_shard.finetune import source_prefix
    from transformers import AutoConfig

    tokenizer = AutoTokenizer.from_pretrained(model)

    class Args:  # the prefix finetune_trainer.py puts before each source
        source_prefix, task = None, "translation_en_to_ro"

    prefix = source_prefix(Args, AutoConfig.from_pretrained(model))
    lengths = []
    for name, extra in (("train.source", prefix), ("train.target", "")):
        lines = [extra + line for line in (data / name).read_text(encoding="utf-8").splitlines()]
        lengths.append(max(len(ids) for ids in tokenizer(lines, max_length=32, truncation=True)["input_ids"]))
    return tuple(lengths)


@pytest.mark.slow
@pytest.mark.multiproc
def test_predictions_within_tolerance_of_measured_peaks(small_model, tiny_data, tmp_path):
    source, target = data_lengths(small_model, tiny_data)
    probes = planner.measure_probes(str(small_model), "fp32", source, target)
    rows = planner.estimate(planner.model_config(str(small_model)), world_size=2, precision="fp32", batch_size=8,
                            source_length=source, target_length=target, probes=probes)  # fmt: skip
    predicted = {r["strategy"]: r["per_rank"] for r in rows if r["offload"] == "none"}
    report = {}
    for strategy, extra in (("ddp", []), ("simple", ["--sharded_ddp", "simple"]), ("zero_dp_2", ["--sharded_ddp", "zero_dp_2"])):
        out = tmp_path / strategy
        assert_ok(run_script(run_flags(small_model, tiny_data, out, *extra), nproc=2, script=PEAK))
        report[strategy] = (predicted[strategy] / GiB, measured_peak(out) / GiB)
    errors = {s: p / m - 1 for s, (p, m) in report.items()}
    print("predicted, measured GiB per rank:", report, "errors:", errors)
    assert all(abs(e) <= TOLERANCE for e in errors.values()), f"predicted vs measured GiB: {report}"
    assert report["zero_dp_2"][1] < report["ddp"][1]  # and the measured order is the predicted one


@pytest.mark.slow
@pytest.mark.multiproc
def test_sharded_ddp_auto_chooses_what_fits_and_trains(small_model, tiny_data, tmp_path):
    budget = tmp_path / "budget.json"
    budget.write_text(json.dumps({"max_memory": {"cpu": "1.5GiB"}}))
    out = tmp_path / "auto"
    proc = run_script(run_flags(small_model, tiny_data, out, "--sharded_ddp", "auto", "--offload", budget), nproc=2,
                      script=PEAK)  # fmt: skip
    assert_ok(proc)
    assert "--sharded_ddp auto: chose zero_dp_2: the least costly strategy that fits 1.50 GiB" in proc.stdout
    assert measured_peak(out) <= 1.5 * GiB * (1 + TOLERANCE)
    budget.write_text(json.dumps({"max_memory": {"cpu": "600MiB"}}))
    proc = run_script(run_flags(small_model, tiny_data, tmp_path / "none", "--sharded_ddp", "auto", "--offload", budget),
                      nproc=2)  # fmt: skip
    assert proc.returncode != 0 and "nothing fits 0.59 GiB per rank" in proc.stderr
