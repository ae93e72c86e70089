"""DeepSpeed configs as people have them (tests/data/deepspeed/, copied verbatim from DeepSpeed's,
transformers' and accelerate's documentation and from fine-tuning projects; SOURCES.md says where)
work as written: stages 0-3 accepted, parameter offload (`offload_param`) included, every
ignored key named once."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, assert_ok, run_script
from test_sharded_trainer import DUMP, train_flags
from trainer_shard import ArgumentError, ShardedSeq2SeqTrainingArguments
from trainer_shard.args import log_notes
from trainer_shard.config import load_config, stage_notes, stage_problems
from trainer_shard.config.apply import param_offload_kwargs, zero_stage
from trainer_shard.errors import ConfigError

DATA = ROOT / "tests" / "data" / "deepspeed"
FILES = sorted(p for p in DATA.glob("*.json") if not p.name.startswith("hf_auto_fills"))  # the configs, not records


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


def offloads_parameters(path: Path) -> bool:
    return json.loads(path.read_text())["zero_optimization"].get("offload_param", {}).get("device", "none") != "none"


STAGE3 = [f for f in FILES if stage_of(f) == 3]
# what else the stage-3 files hold that is refused here, and the fix
OTHER_PROBLEMS = {
    "hf_docs_zero3_nvme": {"$.zero_optimization.aio": "aio belongs at $.aio"},  # DeepSpeed refuses it there too
    "fastchat_deepspeed_config_s3": {"$.micro_batch_size_per_gpu": "did you mean train_micro_batch_size_per_gpu?"},
}  # fmt: skip


def fixed(path: Path) -> dict:
    """The file with each fix its problems name applied."""
    data = json.loads(path.read_text())
    zero = data["zero_optimization"]
    if "aio" in zero:
        data["aio"] = zero.pop("aio")
    if "micro_batch_size_per_gpu" in data:
        data["train_micro_batch_size_per_gpu"] = data.pop("micro_batch_size_per_gpu")
    return data


def test_the_stage_3_files_hold_both_kinds():
    assert {offloads_parameters(f) for f in STAGE3} == {True, False} and len(STAGE3) == 8


@pytest.mark.parametrize("path", [f for f in STAGE3 if not offloads_parameters(f)], ids=lambda p: p.stem)
def test_stage_3_configs_without_parameter_offload_are_accepted_as_written(path):
    config = load_config(path, world_size=2)
    assert config.stage == 3 and zero_stage(config, None) == 3
    ignored = dict(config.ignored)
    assert {"$.zero_optimization.sub_group_size", "$.zero_optimization.stage3_max_reuse_distance",
            "$.zero_optimization.reduce_bucket_size"} <= set(ignored)  # fmt: skip
    assert not [p for p in ignored if "prefetch" in p or "persistence" in p or "max_live" in p]  # they take effect


@pytest.mark.parametrize("path", [f for f in STAGE3 if offloads_parameters(f)], ids=lambda p: p.stem)
def test_stage_3_configs_with_parameter_offload_run_as_written(path, tmp_path):
    """offload_param takes effect as written (DeepSpeed's defaults for the keys left out); only
    what else the file holds that is refused here is, and its fixes are enough."""
    expected = OTHER_PROBLEMS.get(path.stem, {})
    if expected:
        with pytest.raises(ConfigError) as e:
            load_config(path, world_size=2)
        found = dict(e.value.problems)
        assert set(found) == set(expected) and all(expected[k] in found[k] for k in found), found
    config = load_config(write(tmp_path, fixed(path)), world_size=2)
    assert config.stage == 3 and config.offload_device in ("cpu", "nvme")  # offload_optimizer takes effect
    written = fixed(path)["zero_optimization"]["offload_param"]
    defaults = {"nvme_path": None, "buffer_count": 5, "buffer_size": 10**8, "max_in_cpu": 10**9, "pin_memory": False}
    assert param_offload_kwargs(config) == {**defaults, **written}
    assert not [p for p in dict(config.ignored) | dict(config.given) if ".offload_param" in p]  # all take effect


def test_parameter_offload_rules_are_told_with_whatever_else_is_wrong(tmp_path):
    data = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "pin_memory": "yes",
                                                                "buffer_count": 1},
                                  "cpu_offload_param": True}, "train_batch_size": "many"}  # fmt: skip
    found = dict(problems(tmp_path, data))
    assert set(found) == {"$.zero_optimization.offload_param.pin_memory", "$.zero_optimization.cpu_offload_param",
                          "$.zero_optimization.offload_param.nvme_path", "$.zero_optimization.offload_param.buffer_count",
                          "$.zero_optimization.offload_param.device", "$.train_batch_size"}, found  # fmt: skip
    assert found["$.zero_optimization.offload_param.pin_memory"] == "must be true or false, got \"yes\""
    assert "and offload_param.device is \"nvme\"; keep one" in found["$.zero_optimization.cpu_offload_param"]
    assert found["$.zero_optimization.offload_param.nvme_path"].startswith('device "nvme" needs nvme_path')
    assert "at least 2 gather buffers" in found["$.zero_optimization.offload_param.buffer_count"]
    assert "the optimizer is not offloaded" in found["$.zero_optimization.offload_param.device"]


def test_parameter_offload_in_a_stage_0_file_is_decided_at_the_run_stage(tmp_path):
    data = {"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "x"}}}
    config = load_config(write(tmp_path, data))
    assert dict(config.ignored) == {"$.zero_optimization.offload_param": (
        "a ZeRO-3 (parameter sharding) setting: where the parameter shards live; not used in a run without sharding "
        "(stage 0, no offload)")}  # fmt: skip
    (path, why), = stage_problems(config, 3, world_size=2)
    assert path == "$.zero_optimization.offload_param.device" and "the optimizer is not offloaded" in why
    assert stage_problems(config, 3, world_size=2, flag_offload=True) == []  # "zero_dp_3 offload": CPU RAM
    assert stage_problems(config, 2, world_size=2) == []
    with_optimizer = load_config(write(tmp_path, {"zero_optimization": {**data["zero_optimization"],
                                                                        "offload_optimizer": {"device": "cpu"}}}))  # fmt: skip
    assert stage_problems(with_optimizer, 3, world_size=2) == []
    assert param_offload_kwargs(with_optimizer)["device"] == "nvme"


def test_the_old_form_cpu_offload_param_is_device_cpu(tmp_path):
    config = load_config(write(tmp_path, {"zero_optimization": {"stage": 3, "cpu_offload_param": True,
                                                                "cpu_offload": True}}))  # fmt: skip
    assert param_offload_kwargs(config)["device"] == "cpu" and config.offload_device == "cpu"
    found = dict(problems(tmp_path, {"zero_optimization": {"stage": 3, "cpu_offload_param": True}}))
    assert "the optimizer is not offloaded" in found["$.zero_optimization.cpu_offload_param"]


def test_keys_the_device_leaves_unused_are_ignored_with_a_warning(tmp_path):
    def ignored(param):
        zero = {"stage": 3, "offload_param": param, "offload_optimizer": {"device": "cpu"}}
        return dict(load_config(write(tmp_path, {"zero_optimization": zero})).ignored)

    assert set(ignored({"device": "none", "pin_memory": True, "buffer_count": 4})) == {
        "$.zero_optimization.offload_param.pin_memory", "$.zero_optimization.offload_param.buffer_count"}  # fmt: skip
    assert ignored({"device": "cpu", "max_in_cpu": 10, "buffer_size": 10}) == {
        "$.zero_optimization.offload_param.max_in_cpu": "device cpu keeps every parameter shard in CPU RAM"}
    assert ignored({"device": "nvme", "nvme_path": "x", "max_in_cpu": 0, "pin_memory": True}) == {}


def test_stage_3_keys_at_stage_2_are_ignored_with_a_warning(tmp_path):
    data = {"zero_optimization": {"stage": 2, "stage3_max_live_parameters": 1e9,
                                  "offload_param": {"device": "cpu", "pin_memory": True}}}  # fmt: skip
    ignored = dict(load_config(write(tmp_path, data)).ignored)
    assert set(ignored) == {"$.zero_optimization.stage3_max_live_parameters", "$.zero_optimization.offload_param"}
    assert all("not used in stage 2" in why for why in ignored.values())


def test_stage_3_keys_are_checked_at_every_stage_as_deepspeed_checks_them(tmp_path):
    for stage in (2, 3):
        data = {"zero_optimization": {"stage": stage, "stage3_prefetch_bucket_size": -1, "sub_group_size": "big",
                                      "stage3_gather_16bit_weights_on_model_save": 1, "offload_param": {"devise": 0},
                                      "stage3_max_live_parameters": "auto",
                                      "leaf_module": {"classes": ["X"]}}}  # fmt: skip
        found = dict(problems(tmp_path, data))
        assert set(found) == {"$.zero_optimization.stage3_prefetch_bucket_size", "$.zero_optimization.sub_group_size",
                              "$.zero_optimization.stage3_gather_16bit_weights_on_model_save",
                              "$.zero_optimization.offload_param.devise"}, found  # fmt: skip
        assert "must be >= 0" in found["$.zero_optimization.stage3_prefetch_bucket_size"]


IGNORED_AT_STAGE3 = {  # key: value -> a fragment of the reason in its warning line
    "sub_group_size": (1e9, "steps the shard here in chunks of its own"),
    "stage3_max_reuse_distance": (1e9, "freed as soon as its forward or its backward is done"),
    "max_reuse_distance": (5, "as stage3_max_reuse_distance"),
    "stage3_gather_16bit_weights_on_model_save": (False, "always writes the whole model.safetensors"),
    "stage3_gather_fp16_weights_on_model_save": ("auto", "as stage3_gather_16bit_weights_on_model_save"),
    "stage3_module_granularity_threshold": (100, "gathered whole, one flat buffer"),
    "stage3_use_all_reduce_for_fetch_params": (True, "one all-gather of its flat buffer"),
    "allgather_sequential": (True, "as stage3_allgather_sequential"),
    "memory_efficient_linear": (True, "modules run their own forward here"),
    "cpu_offload_use_pin_memory": (True, "sets nothing any more"),
    "leaf_module": ({"classes": ["T5Block"]}, "gathered whole, with its children"),
    "reduce_bucket_size": ("auto", "reduced as one bucket"),
    "allgather_bucket_size": (5e8, "each unit is gathered whole"),
    "allgather_partitions": (True, "nothing is all-gathered after the step"),
    "overlap_comm": (False, "false applies to stage 2"),
}
GIVEN_AT_STAGE3 = {"stage3_max_reuse_distance": 0, "stage3_gather_16bit_weights_on_model_save": True,
                   "stage3_use_all_reduce_for_fetch_params": False, "pipeline_loading_checkpoint": False,
                   "stage3_model_persistence_threshold": 10**12}  # fmt: skip
EFFECT_AT_STAGE3 = {"stage3_prefetch_bucket_size": 1, "stage3_param_persistence_threshold": 2,
                    "stage3_max_live_parameters": 3, "cpu_offload_param": False}  # fmt: skip


@pytest.mark.parametrize("key", sorted(IGNORED_AT_STAGE3))
def test_each_key_ignored_at_stage_3_is_named_in_one_warning_line(key, tmp_path, caplog):
    value, fragment = IGNORED_AT_STAGE3[key]
    config = load_config(write(tmp_path, {"zero_optimization": {"stage": 3, key: value}}))
    assert list(dict(config.ignored)) == [f"$.zero_optimization.{key}"] and fragment in dict(config.ignored)[
        f"$.zero_optimization.{key}"]
    assert f"$.zero_optimization.{key}" not in dict(config.given)
    with caplog.at_level("INFO", logger="trainer_shard.args"):
        log_notes(config, "c.json")
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    path = f"$.zero_optimization.{key}"
    assert warned == [f"--offload c.json: {path} ignored: {dict(config.ignored)[path]}"]


def test_keys_that_are_what_the_engine_does_or_take_effect_warn_nothing(tmp_path):
    data = {"zero_optimization": {"stage": 3, **GIVEN_AT_STAGE3, **EFFECT_AT_STAGE3}}
    config = load_config(write(tmp_path, data))
    assert config.ignored == ()
    assert set(dict(config.given)) == {f"$.zero_optimization.{k}" for k in GIVEN_AT_STAGE3}


def test_two_names_of_one_setting_are_refused_as_deepspeed_refuses_them(tmp_path):
    data = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 10, "prefetch_bucket_size": 10,
                                  "stage3_gather_16bit_weights_on_model_save": True,
                                  "stage3_gather_fp16_weights_on_model_save": True}}  # fmt: skip
    assert dict(problems(tmp_path, data)) == {
        "$.zero_optimization.prefetch_bucket_size": "and stage3_prefetch_bucket_size name one setting; keep one "
                                                    "(DeepSpeed refuses the two together too)",
        "$.zero_optimization.stage3_gather_fp16_weights_on_model_save": "and stage3_gather_16bit_weights_on_model_save"
                                                                        " name one setting; keep one (DeepSpeed "
                                                                        "refuses the two together too)"}  # fmt: skip


def test_offload_optimizer_takes_effect_at_stage_3_on_several_ranks(tmp_path):
    config = load_config(write(tmp_path, {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}),
                         world_size=2)  # fmt: skip
    assert (config.stage, config.offload_device) == (3, "cpu") and stage_problems(config, None, 2) == []
    alone = load_config(write(tmp_path, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}))
    assert stage_problems(alone, 3, 2) == [] and "needs stage 1, 2 or 3" in stage_problems(alone, None, 2)[0][1]


def test_a_stage_0_file_run_at_stage_3_decides_its_stage_3_keys_there(tmp_path):
    config = load_config(write(tmp_path, {"zero_optimization": {"sub_group_size": 1e9,
                                                                "stage3_prefetch_bucket_size": 100}}))  # fmt: skip
    assert set(dict(config.ignored)) == {"$.zero_optimization.sub_group_size",
                                         "$.zero_optimization.stage3_prefetch_bucket_size"}  # fmt: skip
    notes = stage_notes(config, 3, 2)
    assert [(role, path) for role, path, _ in notes] == [("ignored", "$.zero_optimization.sub_group_size")]


def test_stage_3_given_keys_leave_given_when_ignored(tmp_path):
    """allgather_partitions is what stages 1-2 do; at stage 3 it is ignored, in one list only."""
    config = load_config(write(tmp_path, {"zero_optimization": {"stage": 3, "allgather_partitions": True,
                                                                "contiguous_gradients": True}}))  # fmt: skip
    assert list(dict(config.ignored)) == ["$.zero_optimization.allgather_partitions"]
    assert list(dict(config.given)) == ["$.zero_optimization.contiguous_gradients"]


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


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
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


def test_a_stage_3_file_with_zero_dp_2_is_refused(tmp_path):
    with pytest.raises(ArgumentError, match="zero_optimization.stage is 3 but --sharded_ddp asks for stage 2"):
        args_for(tmp_path, offload=str(DATA / "llamafactory_ds_z3_config.json"), sharded_ddp="zero_dp_2")


@pytest.mark.parametrize("flags", [{}, {"sharded_ddp": "zero_dp_3"}, {"sharded_ddp": "zero_dp_3 auto_wrap"}])
def test_a_stage_3_file_runs_at_stage_3_and_names_each_ignored_key_once(tmp_path, caplog, flags):
    with caplog.at_level("WARNING", logger="trainer_shard.args"):
        args = args_for(tmp_path, offload=str(DATA / "llamafactory_ds_z3_config.json"), bf16=True, **flags)
    assert zero_stage(args.offload_config, 3 if flags else None) == 3
    warned = [re.search(r"(\$\S+) ignored: ", r.getMessage()).group(1) for r in caplog.records if r.levelname == "WARNING"]
    assert warned == ["$.fp16", "$.zero_optimization.sub_group_size", "$.zero_optimization.stage3_max_reuse_distance",
                      "$.zero_optimization.reduce_bucket_size"]


def test_parameter_offload_in_a_stage_0_file_run_with_zero_dp_3_needs_the_optimizer_offloaded(tmp_path):
    path = write(tmp_path, {"zero_optimization": {"offload_param": {"device": "cpu"}}})
    with pytest.raises(ArgumentError, match=re.escape("$.zero_optimization.offload_param.device: puts the parameter "
                                                      "shards in CPU RAM, but the optimizer is not offloaded")):  # fmt: skip
        args_for(tmp_path, offload=str(path), sharded_ddp="zero_dp_3")
    args = args_for(tmp_path, offload=str(path), sharded_ddp="zero_dp_3 offload")  # the optimizer state in CPU RAM
    assert param_offload_kwargs(args.offload_config)["device"] == "cpu"
    with pytest.raises(ArgumentError, match="both ask for offload"):  # the flag's offload goes with offload_param only
        args_for(tmp_path, offload=str(write(tmp_path, {"zero_optimization": {"stage": 3}})),
                 sharded_ddp="zero_dp_3 offload")  # fmt: skip


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
def test_validate_config_shows_the_stage_3_settings():
    proc = subprocess.run([sys.executable, "-m", "trainer_shard.cli", "validate-config",
                           str(DATA / "llamafactory_ds_z3_config.json")], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "  stage: 3 (zero_dp_3)" in proc.stdout.splitlines(), proc.stdout
