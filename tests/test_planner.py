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


def _held_bytes(rank, world, nvme, out):
    """A bf16 model stepped once by ShardedOptimizer (ZeRO-2) without offload and with CPU and disk
    offload, on 2 gloo ranks: the bytes each rank really holds for the optimizer, measured on the
    tensors and files themselves."""
    import os

    import torch

    from trainer_shard.offload import OffloadSpec
    from trainer_shard.sharding import ShardedOptimizer

    held = {}
    for offload in (None, "cpu", "disk"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(100, 77), torch.nn.Linear(77, 33)).to(torch.bfloat16)
        spec = {None: None, "cpu": OffloadSpec("cpu"), "disk": OffloadSpec("nvme", nvme_path=nvme)}[offload]
        opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=2, offload=spec, lr=1e-3)
        model(torch.ones(2, 100, dtype=torch.bfloat16)).sum().backward()
        opt.step()
        grads = sum(f.grad.numel() * f.grad.element_size() for f in opt.flats)
        if offload is None:
            masters = sum(f.master.numel() * f.master.element_size() for f in opt.flats)
            state = sum(v.numel() * v.element_size() for s in opt.stepper.optim.state.values() for v in s.values()
                        if torch.is_tensor(v) and v.dim() > 0)  # fmt: skip
            held[offload] = {"device": grads + masters + state}
        elif offload == "cpu":
            held[offload] = {"device": grads, "cpu": sum(t.numel() * t.element_size()
                                                          for t in opt.stepper.store._tensors.values())}  # fmt: skip
        else:
            folder = os.path.join(nvme, f"rank{rank}")
            held[offload] = {"device": grads, "disk": sum(os.path.getsize(os.path.join(folder, f))
                                                           for f in os.listdir(folder) if not f.endswith(".lock"))}  # fmt: skip
        opt.close()
    torch.save(held, f"{out}/rank{rank}.pt")


@pytest.mark.multiproc
def test_state_bytes_are_what_the_optimizer_holds(tmp_path):
    """The planner's bytes for the optimizer's shard (its gradient shard, fp32 masters and Adam
    state: on the device, in the CPU store, or in the disk store's files) against what two real
    ranks hold after a step. The real layout pads each shard a little; nothing else may differ."""
    import torch

    from distributed import spawn

    spawn(_held_bytes, 2, str(tmp_path / "nvme"), str(tmp_path))
    P = 100 * 77 + 77 + 77 * 33 + 33  # odd: the two shards differ by padding
    w, buckets = 2, 3 * min(planner.BUCKET_NUMEL, P) * 2  # bf16 weights; reduce buckets in flight
    for rank in range(2):
        held = torch.load(tmp_path / f"rank{rank}.pt")
        for offload, measured in held.items():
            predicted = planner.strategy_bytes("zero_dp_2", offload, P, P, 2, "bf16")
            predicted["device"] -= w * P + buckets  # the weights and buckets: in the peaks measured below
            for where, value in measured.items():
                assert predicted[where] <= value <= predicted[where] * 1.01 + 64, (offload, where, predicted, measured)
    with pytest.raises(ValueError, match="DDP has no offload"):
        planner.strategy_bytes("ddp", "cpu", P, P, 2, "fp32")


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
