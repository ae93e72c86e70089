"""DeepSpeed configs as people have them (tests/data/deepspeed/, copied verbatim from DeepSpeed's,
transformers' and accelerate's documentation and from fine-tuning projects; SOURCES.md says where)
work as written: stages 0-2 accepted, stage 3 told so first, every ignored key named once."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, assert_ok, run_script
from test_sharded_trainer import DUMP, train_flags
from trainer_shard import ShardedSeq2SeqTrainingArguments
from trainer_shard.config import load_config
from trainer_shard.config.load import STAGE3_REFUSAL
from trainer_shard.errors import ConfigError

FILES = sorted(p for p in (ROOT / "tests" / "data" / "deepspeed").glob("*.json") if p.name != "hf_auto_fills.json")


def stage_of(path: Path):
    zero = json.loads(path.read_text()).get("zero_optimization", {})
    return int(zero) if isinstance(zero, bool) else zero.get("stage", 0)


def write(tmp_path, data, name="c.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def problems(tmp_path, data, **kwargs):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, data), **kwargs)
    return e.value.problems


def test_the_collection_covers_every_stage():
    assert len(FILES) >= 15 and {stage_of(f) for f in FILES} == {0, 1, 2, 3}


@pytest.mark.parametrize("path", [f for f in FILES if stage_of(f) < 3], ids=lambda p: p.stem)
def test_stage_0_to_2_configs_are_accepted_as_written(path):
    config = load_config(path, world_size=2)
    assert config.stage == stage_of(path)


@pytest.mark.parametrize("path", [f for f in FILES if stage_of(f) == 3], ids=lambda p: p.stem)
def test_stage_3_configs_hear_first_that_stage_3_is_the_reason(path):
    with pytest.raises(ConfigError) as e:
        load_config(path, world_size=2)
    assert e.value.problems[0] == ("$.zero_optimization.stage", STAGE3_REFUSAL)
    assert not [p for p, _ in e.value.problems if "stage3_" in p or "offload_param" in p]  # no line of their own


def test_stage_3_comes_first_whatever_else_is_wrong(tmp_path):
    data = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}, **{f"bogus{i}": 1 for i in range(8)}},
            "train_batch_size": "many"}  # fmt: skip
    found = problems(tmp_path, data)
    assert found[0] == ("$.zero_optimization.stage", STAGE3_REFUSAL) and len(found) == 3


def test_stage_3_keys_at_stage_2_are_ignored_with_a_warning(tmp_path):
    data = {"zero_optimization": {"stage": 2, "stage3_max_live_parameters": 1e9, "offload_param": {"device": "cpu"}}}
    ignored = dict(load_config(write(tmp_path, data)).ignored)
    assert set(ignored) == {"$.zero_optimization.stage3_max_live_parameters", "$.zero_optimization.offload_param"}
    assert all("not used in stage 2" in why for why in ignored.values())


@pytest.mark.parametrize(
    "data, path, fragment",
    [
        ({"steps_per_prnt": 1}, "$.steps_per_prnt", "unknown key (did you mean steps_per_print?)"),
        ({"zero_optimization": {"stage": 2, "overlap_com": True}}, "$.zero_optimization.overlap_com",
         "did you mean overlap_comm?"),
        ({"zero_optimization": {"stage": 2, "aio": {}}}, "$.zero_optimization.aio", "aio belongs at $.aio"),
        ({"zero_optimization": {"stage": 2, "reduce_scatter": False}}, "$.zero_optimization.reduce_scatter",
         "must be true: stage 2 reduce-scatters"),
        ({"fp16": {"enabled": True, "auto_cast": True}}, "$.fp16.auto_cast", "must be false"),
        ({"sparse_attention": {"mode": "fixed"}}, "$.sparse_attention", "not available here"),
        ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}}, "$.scheduler.type",
         "use the Trainer's --lr_scheduler_type"),
        ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, "$.optimizer.params.max_grad_norm",
         "gradient_clipping"),
        ({"bf16": {"enabled": True}, "bfloat16": {"enabled": True}}, "$.bfloat16", "keep bf16"),
    ],
)  # fmt: skip
def test_typos_contradictions_and_what_cannot_be_honoured_are_refused(tmp_path, data, path, fragment):
    found = dict(problems(tmp_path, data))
    assert fragment in found[path], found


def test_diagnostics_are_ignored_and_what_the_engine_does_is_taken_as_given(tmp_path):
    data = {"zero_optimization": {"stage": 2, "contiguous_gradients": True, "round_robin_gradients": True},
            "steps_per_print": 10, "wall_clock_breakdown": False, "tensorboard": {"enabled": True, "output_path": "x"},
            "zero_allow_untested_optimizer": True, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}  # fmt: skip
    config = load_config(write(tmp_path, data))
    assert set(dict(config.ignored)) == {"$.steps_per_print", "$.wall_clock_breakdown", "$.tensorboard"}
    assert set(dict(config.given)) == {"$.zero_optimization.contiguous_gradients",
                                       "$.zero_optimization.round_robin_gradients", "$.zero_allow_untested_optimizer",
                                       "$.optimizer.params.torch_adam"}  # fmt: skip


def args_for(tmp_path, **kw):
    return ShardedSeq2SeqTrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to="none", **kw)


def test_precision_comes_from_the_flags_when_the_file_has_no_section(tmp_path):
    path = write(tmp_path, {"zero_optimization": {"stage": 2}})
    assert load_config(path, training_args=args_for(tmp_path, bf16=True)).precision == "bf16"
    assert load_config(path, training_args=args_for(tmp_path)).precision == "fp32"
    found = problems(tmp_path, {"fp16": {"enabled": True}}, training_args=args_for(tmp_path, bf16=True))
    assert found == [("$.fp16.enabled", 'is true but the run asks for --bf16; enable one: drop the flag, or set '
                      'fp16.enabled to "auto"')]  # fmt: skip
    found = problems(tmp_path, {"bf16": {"enabled": False}}, training_args=args_for(tmp_path, bf16=True))
    assert found == [("$.bf16.enabled", 'is false but --bf16 is true; make them agree, or write "auto"')]


def test_a_fp16_section_in_a_bf16_run_is_ignored_with_a_warning(tmp_path):
    path = write(tmp_path, {"fp16": {"enabled": "auto", "loss_scale": 0, "hysteresis": 2}})
    config = load_config(path, training_args=args_for(tmp_path, bf16=True))
    assert dict(config.ignored) == {"$.fp16": "loss_scale, hysteresis: loss-scale settings, and fp16 is off in this run"}


def test_validate_config_prints_the_settings_and_each_ignored_key_once(tmp_path):
    path = ROOT / "tests" / "data" / "deepspeed" / "hf_docs_zero2_auto.json"
    proc = subprocess.run([sys.executable, "-m", "trainer_shard.cli", "validate-config", str(path), "--world_size", "2"],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "  stage: 2 (zero_dp_2)" in lines and "  optimizer offload: cpu" in lines
    ignored = [line.split(": ")[1] for line in lines if line.startswith("ignored: ")]
    assert ignored == ["$.steps_per_print", "$.wall_clock_breakdown"]
    bad = subprocess.run([sys.executable, "-m", "trainer_shard.cli", "validate-config",
                          str(write(tmp_path, {"steps_per_prnt": 1}))], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert bad.returncode == 2 and "did you mean steps_per_print?" in bad.stderr


# The common shape of a project's ZeRO-2 CPU-offload file: "auto" nearly everywhere, DeepSpeed's
# fp16 loss-scale defaults (hysteresis included), logging keys, no bf16 section; run with --bf16.
COMMON = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": "auto", "contiguous_gradients": True,
                          "round_robin_gradients": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}  # fmt: skip
# The same run with only the keys that take effect.
ESSENTIAL = {"optimizer": COMMON["optimizer"], "scheduler": COMMON["scheduler"], "gradient_clipping": "auto",
             "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "reduce_bucket_size": "auto"}}  # fmt: skip


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_common_zero2_offload_file_trains_two_ranks_in_bf16(tiny_model, tiny_data, tmp_path):
    """Trains as the same run with only the keys that take effect (same weights), and its warnings
    name exactly the keys it ignored, once each."""
    runs = {}
    for name, data in (("common", COMMON), ("essential", ESSENTIAL)):
        out = tmp_path / name
        flags = train_flags(tiny_model, tiny_data, out, "--bf16", "--warmup_steps", "0.5", "--logging_steps", "1",
                            "--offload", write(tmp_path, data, f"{name}.json"))  # fmt: skip
        proc = run_script(flags, nproc=2, script=DUMP)
        assert_ok(proc)
        runs[name] = (out, proc.stdout + proc.stderr)
    text = runs["common"][1]
    warned = re.findall(r"--offload \S+common\.json: (\$\S+) ignored: ", text)
    assert sorted(warned) == ["$.fp16", "$.steps_per_print", "$.wall_clock_breakdown",
                              "$.zero_optimization.allgather_bucket_size"], text[-3000:]  # fmt: skip
    assert not re.findall(r"--offload \S+essential\.json: \S+ ignored", runs["essential"][1])
    common, essential = (torch.load(runs[n][0] / "rank0.pt") for n in ("common", "essential"))
    assert all(common[k].dtype == torch.bfloat16 for k in common)
    assert all(torch.equal(common[k], essential[k]) for k in essential)
    history = json.loads((runs["common"][0] / "trainer_state.json").read_text())["log_history"]
    lrs = [e["learning_rate"] for e in history if "learning_rate" in e]
    # WarmupLR over 3 steps (0.5 of 6), log warmup: step k runs at DeepSpeed's lr of iteration k-1
    assert lrs[0] == 0.0 and lrs[3:] == [lrs[3]] * 3 and lrs[1] < lrs[2] < lrs[3], lrs
