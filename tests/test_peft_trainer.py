"""LoRA (PEFT) through finetune_trainer.py's TRL-named flags (issue 34), 2 ranks on gloo: under
`simple`, `zero_dp_2`, `zero_dp_3 auto_wrap` (every parameter sharded) and with the base built on
the meta device and read into the parameter store on disk, the same losses, grad norms, saved
adapters and beam predictions as LoRA under plain DDP; the refusals without a launch."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_FLAGS, assert_ok, run_script
from test_zero3_offload_param_trainer import files_under, offload_config
from test_zero3_trainer import small_units
from trainer_shard.errors import ArgumentError
from trainer_shard.finetune import parse_args

LORA = ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_dropout", "0.0", "--lora_target_modules", "q", "v"]


def lora_flags(model, data, out, *extra):
    return ["--model_name_or_path", model, "--data_dir", data, "--output_dir", out, *TINY_FLAGS, *LORA,
            "--do_train", "--max_steps", "5", "--per_device_train_batch_size", "4", "--max_grad_norm", "0.5",
            "--learning_rate", "1e-2", "--do_predict", "--predict_with_generate", "--n_test", "6",
            "--eval_beams", "2", "--per_device_eval_batch_size", "3", *extra]  # fmt: skip


def steps(out):
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [(e["loss"], e["grad_norm"]) for e in history if "loss" in e]


@pytest.mark.slow
@pytest.mark.multiproc
def test_lora_under_every_sharding_trains_as_under_ddp(tiny_model, tiny_data, tmp_path):
    runs = {"ddp": [], "simple": ["--sharded_ddp", "simple"], "zero_dp_2": ["--sharded_ddp", "zero_dp_2"],
            "zero_dp_3": ["--sharded_ddp", "zero_dp_3 auto_wrap", *small_units(tmp_path)],
            # the base built on the meta device, read into the parameter store: never whole in RAM
            "base_on_disk": ["--sharded_ddp", "zero_dp_3 offload", "--offload", offload_config(tmp_path),
                             "--log_level", "info"]}  # fmt: skip
    for name, extra in runs.items():
        proc = run_script(lora_flags(tiny_model, tiny_data, tmp_path / name, *extra), nproc=2)
        assert_ok(proc)
        said = proc.stdout + proc.stderr
        if name.startswith(("zero_dp_3", "base_on_disk")):
            assert "of 0 parameter elements sharded" not in said
        if name == "base_on_disk":
            assert "built on the meta device; its weights were read from" in said
            assert files_under(tmp_path / "store") == []
    reference = tmp_path / "ddp"
    ref_adapter = load_file(reference / "adapter_model.safetensors")
    assert ref_adapter and all("lora_" in k for k in ref_adapter), sorted(ref_adapter)
    assert not (reference / "model.safetensors").exists()  # the adapter alone, as PEFT saves it
    assert json.loads((reference / "adapter_config.json").read_text())["r"] == 4
    ref_generations = (reference / "test_generations.txt").read_text()
    for name in ("simple", "zero_dp_2", "zero_dp_3", "base_on_disk"):
        out = tmp_path / name
        for (loss, norm), (ref_loss, ref_norm) in zip(steps(out), steps(reference), strict=True):
            assert loss == pytest.approx(ref_loss, rel=1e-4) and norm == pytest.approx(ref_norm, rel=1e-4), name
        adapter = load_file(out / "adapter_model.safetensors")
        assert adapter.keys() == ref_adapter.keys(), name
        worst = max((adapter[k] - ref_adapter[k]).abs().max().item() for k in adapter)
        assert worst <= 1e-6, f"{name}: adapters {worst:.3g} from DDP's"
        assert any(not torch.equal(v, torch.zeros_like(v)) for k, v in adapter.items() if "lora_B" in k)  # trained
        assert (out / "test_generations.txt").read_text() == ref_generations, name
    # the adapter of the run whose base never was whole loads with PEFT's own loader onto the base
    from peft import PeftModel
    from transformers import AutoModelForSeq2SeqLM

    loaded = PeftModel.from_pretrained(AutoModelForSeq2SeqLM.from_pretrained(tiny_model), tmp_path / "base_on_disk")
    state = loaded.state_dict()
    saved = load_file(tmp_path / "base_on_disk" / "adapter_model.safetensors")
    for key, value in saved.items():
        torch.testing.assert_close(state[key.replace(".weight", ".default.weight")].float(), value.float(), rtol=0, atol=0)


@pytest.mark.parametrize("flags, fragment", [
    (["--lora_r", "8"], "--lora_r configure LoRA, which only --use_peft turns on"),
    (["--use_peft", "--lora_r", "0"], "the rank must be at least 1"),
])  # fmt: skip
def test_lora_flags_that_would_do_nothing_or_cannot_work_are_refused(tmp_path, flags, fragment):
    argv = ["--model_name_or_path", "x", "--data_dir", str(tmp_path), "--output_dir", str(tmp_path / "out"),
            "--report_to", "none", *flags]  # fmt: skip
    with pytest.raises(ArgumentError, match=fragment):
        parse_args(argv)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.multiproc
def test_lora_under_zero3_resumes_exactly_and_loads_its_best_checkpoint(tiny_model, tiny_data, tmp_path):
    """Checkpoints hold the adapter and its optimizer shards: resumed from checkpoint-2, on 2 ranks
    or on one process, the run ends with the uninterrupted run's adapter; load_best_model_at_end
    reads the best adapter back into the sharded model (it raised: ZeRO-3's loader looked for a
    whole model's weights)."""
    def flags(out, *extra):
        return ["--model_name_or_path", tiny_model, "--data_dir", tiny_data, "--output_dir", out, *TINY_FLAGS,
                *LORA, "--do_train", "--max_steps", "4", "--per_device_train_batch_size", "4",
                "--learning_rate", "1e-2", "--sharded_ddp", "zero_dp_3 auto_wrap", *small_units(tmp_path),
                "--save_strategy", "steps", "--save_steps", "2", *extra]  # fmt: skip

    straight, resumed, best = tmp_path / "straight", tmp_path / "resumed", tmp_path / "best"
    assert_ok(run_script(flags(straight), nproc=2))
    saved = {p.name for p in (straight / "checkpoint-2").iterdir()}
    assert {"adapter_model.safetensors", "optimizer_shards"} <= saved and "model.safetensors" not in saved
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    assert_ok(run_script([*flags(resumed), "--resume_from_checkpoint", resumed / "checkpoint-2"], nproc=2))
    want, got = load_file(straight / "adapter_model.safetensors"), load_file(resumed / "adapter_model.safetensors")
    assert want.keys() == got.keys()
    assert max((want[k] - got[k]).abs().max().item() for k in want) <= 1e-6
    # on one process: the same micro-batches (2 ranks of 4 = one rank accumulating 2 of 4), no conversion
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copytree(straight / "checkpoint-2", alone / "checkpoint-2")
    assert_ok(run_script([*flags(alone), "--use_cpu", "--gradient_accumulation_steps", "2",
                          "--resume_from_checkpoint", alone / "checkpoint-2"]))  # fmt: skip
    got = load_file(alone / "adapter_model.safetensors")
    assert max((want[k] - got[k]).abs().max().item() for k in want) <= 1e-5
    assert_ok(run_script(flags(best, "--do_eval", "--eval_strategy", "steps", "--eval_steps", "2", "--n_val", "8",
                               "--load_best_model_at_end", "--metric_for_best_model", "loss"), nproc=2))  # fmt: skip
    state = json.loads((best / "trainer_state.json").read_text())
    chosen = load_file(Path(state["best_model_checkpoint"]) / "adapter_model.safetensors")
    final = load_file(best / "adapter_model.safetensors")  # saved after the best was loaded back
    assert all(torch.equal(chosen[k], final[k]) for k in chosen)


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_lora_under_zero3_with_gradient_checkpointing_trains_the_adapters(tiny_model, tiny_data, tmp_path, reentrant):
    """Frozen units under checkpointing (transformers issue 47254: with a frozen base, reentrant
    checkpointing saw no input requiring grad and the adapters got none): the adapters train as
    they do without checkpointing, within the rounding checkpointing moves in T5."""
    def run(out, *extra):
        flags = ["--model_name_or_path", tiny_model, "--data_dir", tiny_data, "--output_dir", out, *TINY_FLAGS, *LORA,
                 "--do_train", "--max_steps", "3", "--per_device_train_batch_size", "4", "--learning_rate", "1e-2",
                 "--sharded_ddp", "zero_dp_3 auto_wrap", *small_units(tmp_path), *extra]  # fmt: skip
        assert_ok(run_script(flags, nproc=2))
        return steps(out), load_file(out / "adapter_model.safetensors")

    plain, plain_adapter = run(tmp_path / "plain")
    kwargs = json.dumps({"use_reentrant": reentrant})
    checked, adapter = run(tmp_path / "ckpt", "--gradient_checkpointing", "--gradient_checkpointing_kwargs", kwargs)
    for (loss, norm), (ref_loss, ref_norm) in zip(checked, plain, strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-4) and norm == pytest.approx(ref_norm, rel=1e-4)
    assert norm > 0  # the adapters had gradients
    assert max((adapter[k] - plain_adapter[k]).abs().max().item() for k in adapter) <= 1e-5
