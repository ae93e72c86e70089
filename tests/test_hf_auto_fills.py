"""trainer_shard fills "auto" in a DeepSpeed config as the Hugging Face DeepSpeed integration does.

The reference is tests/data/deepspeed/hf_auto_fills.json, recorded by bench/record_hf_auto_fills.py
from transformers' own `HfTrainerDeepSpeedConfig` (`trainer_config_process(args)` then
`trainer_config_finalize(args, model, num_training_steps)`), in a venv with DeepSpeed; this test
needs neither DeepSpeed nor the recording venv. Each case rebuilds the same TrainingArguments and
resolves the same config with trainer_shard's API (`config.load_config`, then
`config.apply.scheduler_params` and `hidden_size_fills`), and every key that was "auto" in the
input must come out equal to what the integration wrote there.

The cases were recorded on one process (`args.world_size` 1, nothing monkeypatched);
`train_batch_size` at world size 2 is checked against DeepSpeed's rule, micro batch x
accumulation x 2, from the micro batch and accumulation the integration filled.

A case the integration refuses (an explicit value contradicting the arguments) must be refused
by trainer_shard too, with a ConfigError naming the same key.
"""

import json
import math
import re
import types
from pathlib import Path

import pytest
import torch
import transformers

from trainer_shard.args import ShardedSeq2SeqTrainingArguments
from trainer_shard.config import load_config
from trainer_shard.config.apply import hidden_size_fills, scheduler_params, zero3_kwargs
from trainer_shard.errors import ConfigError

DATA = Path(__file__).resolve().parent / "data" / "deepspeed"
RECORD = json.loads((DATA / "hf_auto_fills.json").read_text())
CASES = {case["name"]: case for case in RECORD["cases"]}

PRECISION_KEYS = ("fp16.enabled", "bf16.enabled")
# every key HfTrainerDeepSpeedConfig fills, and where trainer_shard has it
COMPARED = (
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping",
    "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps", "zero_optimization.reduce_bucket_size", *PRECISION_KEYS,
)  # fmt: skip


def auto_paths(tree, prefix=""):
    """The dotted paths of every "auto" value in a config."""
    out = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out += auto_paths(value, path + ".")
        elif value == "auto":
            out.append(path)
    return out


def get(tree, path):
    for key in path.split("."):
        tree = tree[key]
    return tree


def same(hf, mine) -> bool:
    if isinstance(hf, list):
        return isinstance(mine, (list, tuple)) and len(hf) == len(mine) and all(map(same, hf, mine))
    if isinstance(hf, bool) or isinstance(mine, bool):
        return hf is mine
    if hf is None or mine is None:
        return hf is mine
    return hf == mine or math.isclose(hf, mine, rel_tol=1e-12, abs_tol=0.0)


def input_config(case) -> dict:
    return json.loads((DATA / case["config_file"]).read_text()) if "config_file" in case else case["config"]


def config_path(case, tmp_path) -> Path:
    if "config_file" in case:
        return DATA / case["config_file"]
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(case["config"]))
    return path


def training_args(case, tmp_path):
    return ShardedSeq2SeqTrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none",
                                           **case["flags"])  # fmt: skip


def trainer_shard_values(config, args, case) -> dict:
    """What trainer_shard resolves for each compared key."""
    model = types.SimpleNamespace(config=transformers.T5Config(d_model=case["hidden_size"]))
    optimizer = (config.optimizer or {}).get("params", {})
    scheduler = scheduler_params(config, case["num_training_steps"], args) if config.scheduler else {}
    values = {
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "train_batch_size": config.train_batch_size,
        "gradient_clipping": config.gradient_clipping,
        "zero_optimization.reduce_bucket_size": hidden_size_fills(config, model)["reduce_bucket_size"],
        "fp16.enabled": config.precision == "fp16",
        "bf16.enabled": config.precision == "bf16",
    }
    values |= {f"optimizer.params.{k}": optimizer.get(k) for k in ("lr", "betas", "eps", "weight_decay")}
    values |= {f"scheduler.params.{k}": (config.scheduler or {}).get("params", {}).get(k)
               for k in ("warmup_min_lr", "warmup_max_lr")}  # fmt: skip
    values |= {f"scheduler.params.{k}": scheduler.get(k) for k in ("warmup_num_steps", "total_num_steps")}
    return values


def test_record_is_what_the_brief_asks():
    """The reference covers the configs, flags, step counts and hidden sizes it should."""
    assert RECORD["versions"]["transformers"] == "5.24.0"
    assert RECORD["versions"]["deepspeed"]
    accepted = [c for c in CASES.values() if "filled" in c]
    assert len(accepted) >= 8
    assert all(c["world_size"] == 1 for c in CASES.values())
    files = {c.get("config_file") for c in accepted}
    assert {"hf_docs_zero2_auto.json", "hf_ds_config_zero2.json", "accelerate_zero_stage2_offload_config.json",
            "llamafactory_ds_z2_offload_config.json", "axolotl_zero2.json", None} <= files  # fmt: skip
    warmups = {c["flags"].get("warmup_steps", 0) for c in accepted}
    assert {0, 7, 0.03, 0.5} <= warmups
    assert {48, 512} <= {c["hidden_size"] for c in accepted}
    assert {50, 200} <= {c["num_training_steps"] for c in accepted}
    assert {"fp32", "fp16", "bf16"} <= {c["dtype"] for c in accepted}
    # the written config has every key the integration fills
    written = next(c for c in accepted if "config" in c)
    assert set(auto_paths(written["config"])) == set(COMPARED) - {"fp16.enabled"}


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if "filled" in c])
def test_auto_filled_as_hugging_face(name, tmp_path):
    case = CASES[name]
    given, filled = input_config(case), case["filled"]
    autos = auto_paths(given)
    assert set(autos) <= set(COMPARED), f"an \"auto\" this test does not compare: {set(autos) - set(COMPARED)}"
    assert autos, "a case with nothing to compare"
    args = training_args(case, tmp_path)
    config = load_config(config_path(case, tmp_path), training_args=args, world_size=1)
    mine = trainer_shard_values(config, args, case)
    differ = {path: (get(filled, path), mine[path]) for path in autos if not same(get(filled, path), mine[path])}
    assert not differ, "key: (Hugging Face, trainer_shard): " + ", ".join(f"{k}: {v}" for k, v in differ.items())

    # the run's precision: with both sections in the file the integration's dtype is the config's own.
    # (A missing section is added by accelerate's DeepSpeedPlugin.set_mixed_precision from the
    # flags, not by HfTrainerDeepSpeedConfig, whose dtype then says nothing of the run's.)
    if "fp16" in given and "bf16" in given:
        assert config.precision == case["dtype"]

    # two ranks: DeepSpeed's train_batch_size = micro x accumulation x world size
    if "train_batch_size" in autos:
        two = load_config(config_path(case, tmp_path), training_args=args, world_size=2)
        expected = filled["train_micro_batch_size_per_gpu"] * filled["gradient_accumulation_steps"] * 2
        assert two.train_batch_size == expected


def refused_keys(message: str) -> list:
    """`$.`-paths of the keys the integration's mismatch error names (`- ds fp16.enabled=True vs ...`)."""
    return ["$." + key for key in re.findall(r"^- ds ([\w.]+)=", message, flags=re.M)]


# One deliberate difference: a file that turns fp16 (or bf16) on, run without the flag, trains in
# that precision here (configs/README.md: the fp16/bf16 sections "turn the precision on"), where
# the integration refuses it. A file that contradicts a flag given is refused by both.
PRECISION_FROM_THE_FILE = "accelerate_z2_offload-fp32 (file fp16 true, no flag)"


def test_a_file_that_turns_fp16_on_without_the_flag_trains_in_fp16(tmp_path):
    case = CASES[PRECISION_FROM_THE_FILE]
    assert refused_keys(case["error"]) == ["$.fp16.enabled"] and not case["flags"].get("fp16")
    config = load_config(config_path(case, tmp_path), training_args=training_args(case, tmp_path), world_size=1)
    assert config.precision == "fp16"


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if "error" in c and n != PRECISION_FROM_THE_FILE])
def test_refused_as_hugging_face(name, tmp_path):
    """The integration refuses an explicit value that contradicts the arguments; so does trainer_shard,
    naming the same key."""
    case = CASES[name]
    keys = refused_keys(case["error"])
    assert keys, case["error"]
    args = training_args(case, tmp_path)
    with pytest.raises(ConfigError) as e:
        load_config(config_path(case, tmp_path), training_args=args, world_size=1)
    assert set(keys) <= {path for path, _ in e.value.problems}, e.value


# ZeRO-3: tests/data/deepspeed/hf_auto_fills_zero3.json, recorded by bench/record_zero3_fills.py beside
# it, holds what the integration filled in each stage-3 file and DeepSpeed's own reading of the
# result (`DeepSpeedZeroConfig`: "auto" left unfilled is its default, two names of one setting are
# refused). `zero3_kwargs` must give shard_model exactly DeepSpeed's persistence threshold, and
# its prefetch capped by max_live_parameters; the 16-bit save flag is "as the engine does" where
# DeepSpeed reads true, and ignored with a warning where it reads false.
ZERO3 = json.loads((DATA / "hf_auto_fills_zero3.json").read_text())


class ConfigOnly(torch.nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.config = transformers.T5Config(d_model=hidden_size)


def zero3_config(case, tmp_path):
    from test_deepspeed_configs import fixed

    data = fixed(DATA / case["config_file"]) if "config_file" in case else {"zero_optimization": dict(case["config"])}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(data))
    return path


def test_zero3_record_covers_the_stage_3_files():
    assert ZERO3["versions"]["transformers"] == "5.24.0"
    files = {c.get("config_file") for c in ZERO3["cases"]}
    from test_deepspeed_configs import FILES, stage_of

    stage3 = {p.name for p in FILES if stage_of(p) == 3}
    assert len(stage3) == 8 and stage3 <= files
    assert sum("error" in c for c in ZERO3["cases"]) == 1


@pytest.mark.parametrize("name", [c["name"] for c in ZERO3["cases"]])
def test_zero3_settings_as_deepspeed_reads_them(name, tmp_path):
    case = next(c for c in ZERO3["cases"] if c["name"] == name)
    path = zero3_config(case, tmp_path)
    if "error" in case:  # two names of one setting
        with pytest.raises(ConfigError, match="name one setting; keep one"):
            load_config(path)
        return
    config = load_config(path)
    resolved = case["resolved"]
    kwargs = zero3_kwargs(config, ConfigOnly(case["hidden_size"]))
    assert kwargs == {"persistence_threshold": resolved["param_persistence_threshold"],
                      "prefetch": min(resolved["prefetch_bucket_size"], resolved["max_live_parameters"])}  # fmt: skip
    save = [p for p in dict(config.given) | dict(config.ignored) if "weights_on_model_save" in p]
    if save:
        assert (save[0] in dict(config.given)) is resolved["gather_16bit_weights_on_model_save"]
