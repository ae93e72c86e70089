"""--sharded_ddp zero_dp_3 through finetune_trainer.py, against plain DDP (and zero_dp_2 for
16-bit), on 2 gloo ranks: weights, logged loss and grad norm, generations, checkpoints. (3 ranks,
with padding in every flat buffer, against plain AdamW: tests/test_zero3_optimizer.py, the
optimizer the Trainer builds, without a launch per case.)"""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, TINY_FLAGS, assert_ok, run_script
from test_sharded_trainer import DUMP, ddp_run, log, train_flags  # noqa: F401 (ddp_run: the DDP reference fixture)
from trainer_shard.sharding import state_io

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def small_units(folder, **zero):
    """A stage-3 config that shards every parameter of the tiny test model (DeepSpeed's default
    persistence threshold, 100,000 elements, would keep all of them whole)."""
    path = folder / "zero3_small.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}))
    return ["--offload", path]


def assert_matches(out, reference, ranks, atol=1e-6):
    """Every rank ends with the same weights, within `atol` of the reference run's; the logged
    loss and grad norm as the reference's."""
    want = torch.load(reference / "rank0.pt")
    got = [torch.load(out / f"rank{r}.pt") for r in range(ranks)]
    assert got[0].keys() == want.keys()
    assert all(torch.equal(got[0][k], other[k]) for other in got[1:] for k in want), "ranks diverged"
    worst = max((got[0][k].float() - want[k].float()).abs().max().item() for k in want)
    assert worst <= atol, f"{out.name}: {worst:.3g} from {reference.name}"
    for (loss, norm), (ref_loss, ref_norm) in zip(log(out), log(reference), strict=True):
        assert loss == pytest.approx(ref_loss, abs=1e-4) and norm == pytest.approx(ref_norm, rel=1e-4)
    saved = load_file(out / "model.safetensors")  # streamed unit by unit: the same weights, ties once
    assert all(torch.equal(saved[k], got[0][k]) for k in saved) and "lm_head.weight" not in saved
    held = json.loads((out / "held0.json").read_text())  # really sharded: ceil(P/N) and the whole ones
    assert held["gathered"] == 0 and held["shards"] < held["total"] / ranks + 4096, held
    return held


@pytest.mark.parametrize("case", ["auto_wrap offload", "auto_wrap disk", "shipped config"])
def test_matches_ddp(ddp_run, tiny_model, tiny_data, tmp_path, case):
    """One unit per T5Block, every parameter sharded (the 32-element layer norms too, padded),
    the optimizer state in CPU RAM, or on disk with the gradient shards beside it ([Note: gradient
    store]: written in backward, accumulated over micro-batches there, clipped and stepped from
    there); and configs/zero3.json as shipped (units from the config, prefetch and persistence
    "auto" from the hidden size: the matrices sharded, the layer norms whole). Without auto_wrap
    and offload: the resume test."""
    nvme = {"device": "nvme", "nvme_path": str(tmp_path / "store")}
    extra = {"auto_wrap offload": ["--sharded_ddp", "zero_dp_3 auto_wrap",
                                   *small_units(tmp_path, offload_optimizer={"device": "cpu"})],
             "auto_wrap disk": ["--sharded_ddp", "zero_dp_3 auto_wrap",
                                *small_units(tmp_path, offload_optimizer=nvme)],
             "shipped config": ["--offload", ROOT / "configs" / "zero3.json"]}[case]  # fmt: skip
    out = tmp_path / "out"
    proc = run_script(train_flags(tiny_model, tiny_data, out, *extra), nproc=2, script=DUMP)
    assert_ok(proc)
    held = assert_matches(out, ddp_run, 2)
    assert (held["persistent"] == 0) == (case != "shipped config")
    if case == "auto_wrap disk":  # no gradient shard in RAM: all of them in the files
        assert held["grad_shards"] == 0 and held["on_disk"] >= held["shards"], held
        assert not (tmp_path / "store").exists()  # the stores' folders go when the run ends


@pytest.mark.parametrize("precision", ["--bf16", "--fp16"])
def test_16_bit_logs_as_zero_dp_2(tiny_model, tiny_data, tmp_path, precision):
    """16-bit parameters, fp32 masters (fp16: a dynamic loss scale, its first step skipped on
    overflow): the logged loss and grad norm are zero_dp_2's."""
    runs = {}
    for option in ("zero_dp_2", "zero_dp_3 auto_wrap"):
        out = runs[option] = tmp_path / option.replace(" ", "_")
        if option.startswith("zero_dp_3"):
            extra = small_units(tmp_path)
        else:  # a config too: its fp16 defaults (DeepSpeed's hysteresis 2) are the flags' no longer
            (tmp_path / "zero2.json").write_text(json.dumps({"zero_optimization": {"stage": 2}}))
            extra = ["--offload", tmp_path / "zero2.json"]
        assert_ok(run_script(train_flags(tiny_model, tiny_data, out, "--sharded_ddp", option, precision, *extra), nproc=2))
    logged = {option: log(out) for option, out in runs.items()}
    for (loss, norm), (ref_loss, ref_norm) in zip(logged["zero_dp_3 auto_wrap"], logged["zero_dp_2"], strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-3) and norm == pytest.approx(ref_norm, rel=1e-3, nan_ok=True)
    weights = load_file(runs["zero_dp_3 auto_wrap"] / "model.safetensors")
    assert all(v.dtype == {"--bf16": torch.bfloat16, "--fp16": torch.float16}[precision] for v in weights.values())


def test_eval_generate_and_best_model(tiny_model, tiny_data, tmp_path):
    """Eval during training, load_best_model_at_end, gradient checkpointing, and predict with beam
    search (ranks whose sequences end at different lengths keep in step: synced_gpus): the
    generations are those of the trained model run whole on one process, line for line."""
    out = tmp_path / "out"
    extra = ["--sharded_ddp", "zero_dp_3 auto_wrap", *small_units(tmp_path), "--gradient_checkpointing", "--do_eval", "--do_predict",
             "--predict_with_generate", "--n_val", "10", "--n_test", "10", "--eval_beams", "2",
             "--eval_strategy", "steps", "--eval_steps", "3", "--save_strategy", "steps", "--save_steps", "3",
             "--load_best_model_at_end", "--metric_for_best_model", "loss", "--per_device_eval_batch_size", "3"]  # fmt: skip
    assert_ok(run_script(train_flags(tiny_model, tiny_data, out, *extra), nproc=2, script=DUMP))
    state = json.loads((out / "trainer_state.json").read_text())
    best = state["best_model_checkpoint"]
    assert best is not None and best.endswith(("checkpoint-3", "checkpoint-6"))
    final = torch.load(out / "rank0.pt")  # the best checkpoint's weights, loaded unit by unit
    assert all(torch.equal(final[k], v) for k, v in load_file(f"{best}/model.safetensors").items())
    whole = tmp_path / "whole"
    flags = ["--model_name_or_path", out, "--data_dir", tiny_data, "--output_dir", whole, *TINY_FLAGS, "--do_predict",
             "--predict_with_generate", "--n_test", "10", "--eval_beams", "2", "--use_cpu"]  # fmt: skip
    assert_ok(run_script(flags))
    lines = (out / "test_generations.txt").read_text().splitlines()
    assert len(lines) == 10 and lines == (whole / "test_generations.txt").read_text().splitlines()


def test_resume_exactly_and_across_stages_and_world_sizes(ddp_run, tiny_model, tiny_data, tmp_path):
    """zero_dp_3 without auto_wrap (the whole model one unit) trains as DDP; its checkpoint
    resumes exactly at the same world size, and with no conversion as zero_dp_2 on 2 ranks and
    as plain training on 1; `trainer-shard consolidate` reads it."""
    out = tmp_path / "out"
    save = ["--save_strategy", "steps", "--save_steps", "3"]
    flags = train_flags(tiny_model, tiny_data, out, "--sharded_ddp", "zero_dp_3", *small_units(tmp_path), *save)
    assert_ok(run_script(flags, nproc=2, script=DUMP))
    assert_matches(out, ddp_run, 2)
    straight = load_file(out / "model.safetensors")
    assert sorted(p.name for p in (out / "checkpoint-3" / "optimizer_shards").iterdir()) == [
        "index.json", "rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]  # fmt: skip
    assert_ok(run_script([*flags, "--resume_from_checkpoint", out / "checkpoint-3"], nproc=2))
    resumed = load_file(out / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight), "same world size: not exact"
    for name, nproc, extra in (("stage2", 2, ["--sharded_ddp", "zero_dp_2"]), ("plain", 1, ["--use_cpu"])):
        other = tmp_path / name
        other.mkdir()
        subprocess.run(["cp", "-r", out / "checkpoint-3", other], check=True)
        again = [*train_flags(tiny_model, tiny_data, other, *extra, *save), "--resume_from_checkpoint",
                 other / "checkpoint-3"]  # fmt: skip
        if nproc == 1:  # the same 4 micro-batches of 4 a step as 2 ranks accumulating 2 each
            again += ["--gradient_accumulation_steps", "4"]
        assert_ok(run_script(again, nproc=nproc))
        weights = load_file(other / "model.safetensors")
        worst = max((weights[k] - straight[k]).abs().max().item() for k in straight)
        assert worst < 1e-5, f"resumed as {name}: {worst:.3g} from the straight run"
    consolidated = tmp_path / "consolidated"
    proc = subprocess.run([sys.executable, "-m", "trainer_shard.cli", "consolidate", out / "checkpoint-3", consolidated],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    at_three = load_file(out / "checkpoint-3" / "model.safetensors")
    weights = load_file(consolidated / "model.safetensors")
    assert all(torch.equal(weights[k], at_three[k]) for k in at_three)
    sources = state_io.ShardSources(out / "checkpoint-3" / state_io.FOLDER)
    assert sources.read_param("shared.weight", "exp_avg").shape == at_three["shared.weight"].shape
    sources.close()
