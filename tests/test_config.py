"""The offload config: every class of bad input reported at once, with its JSON path and the fix."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from trainer_shard import ArgumentError, ShardedSeq2SeqTrainingArguments
from trainer_shard.config import load_config
from trainer_shard.config.apply import param_offload_kwargs, zero3_kwargs, zero3_settings
from trainer_shard.config.schema import ROLES, STAGE3_ALIASES, TOP
from trainer_shard.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path, data, name="c.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def problems(tmp_path, data, **kwargs):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, data), **kwargs)
    return dict(e.value.problems), str(e.value)


@pytest.mark.parametrize(
    "data, path, fragment",
    [
        ("{'single': 'quotes'}", "$", "not valid JSON"),
        ('{"a": 1,}', "$", "line 1, column"),
        ('{"gradient_clipping": NaN}', "$.gradient_clipping", "NaN is not a number JSON allows"),
        ({"steps_per_prnt": 10}, "$.steps_per_prnt", "unknown key (did you mean steps_per_print?)"),
        ({"zero_optimization": {"offload_optimizer": {"devise": "cpu"}}},
         "$.zero_optimization.offload_optimizer.devise", "allowed here: device, nvme_path"),
        ({"zero_optimization": {"stage": "2"}}, "$.zero_optimization.stage", "must be an integer"),
        ({"zero_optimization": {"stage": 2.5}}, "$.zero_optimization.stage", "must be an integer"),
        ({"zero_optimization": {"stage": 7}}, "$.zero_optimization.stage", "must be <= 3"),
        ({"zero_optimization": {"stage": "auto"}}, "$.zero_optimization.stage", '"auto" is not allowed here'),
        ({"zero_optimization": {"overlap_comm": "yes"}}, "$.zero_optimization.overlap_comm", "true or false"),
        ({"zero_optimization": {"contiguous_gradients": False}}, "$.zero_optimization.contiguous_gradients", "must be true"),
        ({"zero_optimization": {"reduce_bucket_size": 1e400}}, "$.zero_optimization.reduce_bucket_size",
         "Infinity is not a number JSON allows"),
        ('{"optimizer": {"params": {"betas": [0.9, -Infinity]}}}', "$.optimizer.params.betas[1]",
         "-Infinity is not a number JSON allows"),
        ({"max_memory": {"cpu": "5iB"}}, "$.max_memory", '"cpu": must be a size such as 2GiB, 500MB or a number of '
         "bytes (units: B; KB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: powers of 1024), got \"5iB\""),
        ({"zero_optimization": {"reduce_bucket_size": 0}}, "$.zero_optimization.reduce_bucket_size", "a bucket holds at least 1 element"),
        ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
         "$.zero_optimization.offload_optimizer.device", "one of none, cpu, nvme"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
         "$.zero_optimization.offload_optimizer.nvme_path", 'device "nvme" needs nvme_path'),
        ({"zero_optimization": {"offload_optimizer": {"nvme_path": "/tmp/x"}}},
         "$.zero_optimization.offload_optimizer.nvme_path", 'only used with device "nvme"'),
        ({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "nvme", "nvme_path": "x"}}},
         "$.zero_optimization.cpu_offload", "contradicts"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
         "$.zero_optimization.offload_param.device", "puts the parameter shards in CPU RAM, but the optimizer is not "
         "offloaded: its fp32 master weights and moments"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}, "offload_optimizer": {"device": "cpu"}}},
         "$.zero_optimization.offload_param.nvme_path", 'device "nvme" needs nvme_path: the folder for the parameter '
         "store"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "nvme_path": "/tmp/p"},
                                "offload_optimizer": {"device": "cpu"}}},
         "$.zero_optimization.offload_param.nvme_path", 'is only used with device "nvme" (device is "cpu")'),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 1},
                                "offload_optimizer": {"device": "cpu"}}},
         "$.zero_optimization.offload_param.buffer_count", "is 1, and parameter offload needs at least 2"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_size": -1}}},
         "$.zero_optimization.offload_param.buffer_size", "must be >= 0"),
        ({"zero_optimization": {"stage": 2, "contiguous_gradients": False}}, "$.zero_optimization.contiguous_gradients",
         "must be true: gradients are always copied"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "$.fp16.enabled", "enable one"),
        ({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}}, "$.optimizer.params", "Adam arguments"),
        ({"optimizer": {"params": {"betas": [0.9]}}}, "$.optimizer.params.betas", "list of 2 numbers"),
        ({"optimizer": {"params": {"eps": 0}}}, "$.optimizer.params.eps", "> 0"),
        ({"scheduler": {"params": {"warmup_num_steps": 10}}}, "$.scheduler.type", "params without a type"),
        ({"zero_optimization": []}, "$.zero_optimization", "must be an object"),
        ([1, 2], "$", "must be an object"),
    ],
)  # fmt: skip
def test_each_bad_input_is_named(tmp_path, data, path, fragment):
    found, message = problems(tmp_path, data)
    assert path in found and fragment in found[path], message


def test_offload_on_two_ranks_needs_a_shard(tmp_path):
    found, _ = problems(tmp_path, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, world_size=2)
    assert "needs stage 1, 2 or 3" in found["$.zero_optimization.stage"]
    load_config(write(tmp_path, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}), world_size=1)


def test_every_problem_at_once(tmp_path):
    data = {"zero_optimization": {"stage": 9, "bogus": 1, "offload_optimizer": {"device": "nvme"}},
            "fp16": {"enabled": True}, "bf16": {"enabled": True}, "gradient_clipping": -1}  # fmt: skip
    found, message = problems(tmp_path, data)
    assert set(found) == {"$.zero_optimization.stage", "$.zero_optimization.bogus",
                          "$.zero_optimization.offload_optimizer.nvme_path", "$.fp16.enabled", "$.gradient_clipping"}
    assert message.startswith(f"offload config {tmp_path / 'c.json'}: 5 problems")


def test_non_finite_numbers_are_named_at_their_keys(tmp_path):
    """NaN and Infinity (which JSON does not allow, and json reads) are each named at their key,
    not at the file: every one of them, with a duplicate key in the same report; many are counted."""
    text = ('{"gradient_clipping": NaN, "steps_per_print": 1, "steps_per_print": 2, '
            '"optimizer": {"params": {"betas": [Infinity, 0.9]}}, "zero_optimization": {"stage": -Infinity}}')
    found, _ = problems(tmp_path, text)
    assert set(found) == {"$", "$.gradient_clipping", "$.optimizer.params.betas[0]", "$.zero_optimization.stage"}
    assert "written twice" in found["$"] and found["$.zero_optimization.stage"].startswith("-Infinity is not a number")
    found, _ = problems(tmp_path, '{"x": [' + ", ".join(["NaN"] * 9) + "]}")
    assert list(found) == [f"$.x[{i}]" for i in range(5)] + ["$"] and "4 more NaN or Infinity" in found["$"]


def test_sizes_name_their_accepted_forms():
    from trainer_shard.config.load import parse_size

    assert [parse_size(s) for s in ("5GB", "2GiB", "5 kib", "7B", "1.5MB", "100", 12)] == [
        5 * 10**9, 2 * 2**30, 5 * 1024, 7, 1_500_000, 100, 12]  # fmt: skip
    for bad in ("5iB", "5iKB", "GB", "5 XB", ""):
        with pytest.raises(ValueError, match=r"units: B; KB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB"):
            parse_size(bad)


def test_store_folders_are_resolved_once_at_validation(tmp_path, monkeypatch, capsys):
    """nvme_path "~/nvme" is the home folder's (it made a folder named "~"), and a relative one is
    taken from the working folder of the validation, whatever folder the ranks are in later;
    validate-config shows both resolved."""
    from trainer_shard.cli import main

    home, work = tmp_path / "home", tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    data = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "~/nvme"},
                                  "offload_param": {"device": "nvme", "nvme_path": "params/../store"}}}  # fmt: skip
    config = load_config(write(tmp_path, data))
    assert config.nvme_path == str(home / "nvme")
    assert config.param_offload["nvme_path"] == str(Path.cwd() / "store")
    assert main(["validate-config", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert f"optimizer offload: nvme at {home / 'nvme'}/rank<R>" in out
    assert f"parameter offload: nvme at {Path.cwd() / 'store'}/zero3_params/rank<R>/" in out
    monkeypatch.chdir(tmp_path)
    assert load_config(write(tmp_path, data)).nvme_path == str(home / "nvme")
    assert not list(tmp_path.rglob("~"))


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.json")


def training_args(tmp_path, **kw):
    return ShardedSeq2SeqTrainingArguments(output_dir=str(tmp_path / "o"), use_cpu=True, report_to="none", **kw)


def test_auto_takes_the_training_arguments(tmp_path):
    args = training_args(tmp_path, learning_rate=3e-4, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         max_grad_norm=0.5, bf16=True)  # fmt: skip
    config = load_config(CONFIGS / "offload_cpu.json", training_args=args, world_size=2)
    assert config.optimizer["params"]["lr"] == 3e-4 and config.optimizer["params"]["betas"] == [0.9, 0.999]
    assert (config.micro_batch_size, config.gradient_accumulation_steps, config.train_batch_size) == (4, 2, 16)
    assert config.gradient_clipping == 0.5 and config.precision == "bf16" and config.offload_device == "cpu"


def test_contradictions_show_both_values(tmp_path):
    args = training_args(tmp_path, learning_rate=5e-5, per_device_train_batch_size=8)
    data = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "train_micro_batch_size_per_gpu": 4}
    found, _ = problems(tmp_path, data, training_args=args)
    assert found["$.optimizer.params.lr"] == 'is 0.001 but --learning_rate is 5e-05; make them agree, or write "auto"'
    assert "is 4 but --per_device_train_batch_size is 8" in found["$.train_micro_batch_size_per_gpu"]


@pytest.mark.parametrize("name", ["offload_cpu.json", "offload_disk.json", "zero2.json", "zero3_offload_param.json"])
def test_shipped_configs_are_valid(name):
    load_config(CONFIGS / name, world_size=2)


def test_parameter_offload_takes_effect_at_stage_3_only(tmp_path):
    """offload_param: shard_model's ParamOffloadSpec arguments at stage 3 ("auto": DeepSpeed's
    defaults), one warning line at stages 0-2; validate-config shows it."""
    from trainer_shard.cli import effective_settings

    config = load_config(CONFIGS / "zero3_offload_param.json", world_size=2)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(d_model=8, d_ff=16, num_layers=1, d_kv=4,
                                                                          num_heads=2, vocab_size=32))  # fmt: skip
    param = param_offload_kwargs(config)
    store = str(Path.cwd() / "offload_store")  # resolved once, at validation
    assert param == {"device": "nvme", "nvme_path": store, "buffer_count": 5, "buffer_size": 100_000_000,
                     "max_in_cpu": 0, "pin_memory": False}  # fmt: skip
    lines = effective_settings(config, 2)
    assert f"parameter offload: nvme at {store}/zero3_params/rank<R>/ (parameter and gradient shards in files; " \
           "the first units' shards, up to 0 elements a rank, in RAM: max_in_cpu), read ahead on a thread in the " \
           "units' recorded order" in lines, lines
    data = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                  "offload_param": {"device": "auto", "buffer_count": "auto", "pin_memory": "auto"}}}  # fmt: skip
    assert param_offload_kwargs(load_config(write(tmp_path, data))) is None  # "auto": DeepSpeed's none
    data["zero_optimization"]["offload_param"]["device"] = "cpu"
    assert param_offload_kwargs(load_config(write(tmp_path, data))) == {
        "device": "cpu", "nvme_path": None, "buffer_count": 5, "buffer_size": 100_000_000, "max_in_cpu": 1_000_000_000,
        "pin_memory": False}  # fmt: skip
    assert "parameter offload: none (the parameter shards stay in this process's memory between uses)" in \
        effective_settings(load_config(CONFIGS / "zero3.json"), 2)
    data["zero_optimization"]["stage"] = 2
    assert dict(load_config(write(tmp_path, data)).ignored) == {"$.zero_optimization.offload_param": (
        "a ZeRO-3 (parameter sharding) setting: where the parameter shards live; not used in stage 2")}  # fmt: skip


@pytest.mark.parametrize(
    "data, flags, ignored",
    [
        ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 100, "allgather_bucket_size": 200}}, {},
         {"$.zero_optimization.allgather_bucket_size": "stage 2 all-gathers the buckets it reduced"}),
        ({"zero_optimization": {"overlap_comm": False}}, {"sharded_ddp": "simple"},
         {"$.zero_optimization.overlap_comm": "false applies to stage 2"}),
        ({"zero_optimization": {"reduce_bucket_size": 100}}, {},
         {"$.zero_optimization.reduce_bucket_size": "not used in a run without sharding"}),
        ({"fp16": {"loss_scale": 128}}, {}, {"$.fp16": "loss_scale: loss-scale settings, and fp16 is off"}),
        ({"fp16": {"enabled": True, "loss_scale": 128}}, {}, {"$.fp16": "the Trainer's GradScaler scales the loss"}),
    ],
)  # fmt: skip
def test_keys_that_do_nothing_in_this_run_are_ignored_with_one_warning(tmp_path, data, flags, ignored, caplog):
    with caplog.at_level("WARNING", logger="trainer_shard.args"):
        config = training_args(tmp_path, offload=str(write(tmp_path, data)), **flags).offload_config
    assert set(dict(config.ignored)) == set(ignored)
    assert all(fragment in dict(config.ignored)[key] for key, fragment in ignored.items())
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == len(ignored) and all(key in w for key, w in zip(ignored, warned)), warned


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
def test_readme_has_the_generated_table_of_every_key():
    table = subprocess.run([sys.executable, str(CONFIGS.parent / "scripts" / "config_keys_table.py")],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert table in (CONFIGS / "README.md").read_text(), "run scripts/config_keys_table.py into configs/README.md"


def test_readme_documents_every_key():
    readme = (CONFIGS / "README.md").read_text()

    def paths(spec, prefix=""):
        for key, k in spec.items():
            path = f"{prefix}.{key}" if prefix else key
            yield path
            yield from paths(k.children, path)

    missing = [p for p in paths(TOP) if f"`{p}`" not in readme]
    assert missing == []


def test_offload_flag_checks_the_config_against_the_flags(tmp_path):
    bad = write(tmp_path, {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})
    with pytest.raises(ArgumentError, match=r"--offload .*c.json: \$.zero_optimization.offload_optimizer.nvme_path"):
        training_args(tmp_path, offload=str(bad))
    assert training_args(tmp_path, offload=str(CONFIGS / "offload_cpu.json")).offload_config.offload_device == "cpu"
    with pytest.raises(ArgumentError, match="zero_optimization.stage is 2 but --sharded_ddp asks for stage 1"):
        training_args(tmp_path, offload=str(CONFIGS / "zero2.json"), sharded_ddp="simple")


@pytest.mark.parametrize(
    "data, flags, fragment",
    [
        ({"communication_data_type": "fp32"}, {"sharded_ddp": "simple", "bf16": True},
         "communication_data_type is fp32, and at stage 1 DDP sums the gradients in the training dtype"),
        ({"data_types": {"param_dtype": "fp16"}}, {"bf16": True}, "data_types.param_dtype is fp16 but the run trains in bf16"),
        ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, {}, "use type \"Adam\""),
        ({"optimizer": {"type": "Adam", "params": {"momentum": 0.9}}}, {}, "momentum: is an SGD argument"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/dev/null/store"}}}, {},
         "cannot create the disk store folder .*/dev/null.* is not a folder"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused(tmp_path, data, flags, fragment):
    with pytest.raises(ArgumentError, match=fragment):
        training_args(tmp_path, offload=str(write(tmp_path, data)), **flags)


@pytest.mark.slow
def test_validate_config_command(tmp_path):
    exe = Path(sys.executable).with_name("trainer-shard")
    ok = subprocess.run([exe, "validate-config", CONFIGS / "offload_disk.json"], capture_output=True, text=True,
                        cwd=tmp_path)  # fmt: skip
    assert ok.returncode == 0 and "valid on 1 rank" in ok.stdout
    assert f"  optimizer offload: nvme at {tmp_path.resolve() / 'offload_store'}/rank<R>" in ok.stdout.splitlines()
    bad = write(tmp_path, {"zero_optimization": {"stage": "two"}})
    proc = subprocess.run([exe, "validate-config", bad], capture_output=True, text=True)
    assert proc.returncode == 2 and "$.zero_optimization.stage: must be an integer" in proc.stderr


def stage3_keys(spec=TOP, prefix=""):
    for name, key in spec.items():
        path = f"{prefix}.{name}" if prefix else name
        if key.role == "stage3":
            yield path, key
        yield from stage3_keys(key.children, path)


def test_every_stage_3_key_has_a_decision_at_stage_3_and_why():
    keys = dict(stage3_keys())
    assert len(keys) >= 30 and all(k.at_stage3 in set(ROLES) - {"stage3"} and k.stage3_why for k in keys.values())
    names = {path.rsplit(".", 1)[1] for path in keys}
    assert {n for canonical, others in STAGE3_ALIASES.items() for n in (canonical, *others)} <= names


def test_stage_3_is_accepted(tmp_path):
    config = load_config(write(tmp_path, {"zero_optimization": {"stage": 3}}), world_size=2)
    assert config.stage == 3 and config.ignored == () and config.given == ()


class Tiny(torch.nn.Module):
    """hidden size 64 (T5's d_model), 4,096 + 64 + 100 + 10 elements in four parameters"""

    def __init__(self):
        super().__init__()
        self.config = transformers.T5Config(d_model=64)
        self.big, self.bias = torch.nn.Parameter(torch.zeros(64, 64)), torch.nn.Parameter(torch.zeros(64))
        self.frozen = torch.nn.Parameter(torch.zeros(100), requires_grad=False)
        self.small = torch.nn.Parameter(torch.zeros(10))


def kwargs_of(tmp_path, zero, model=None):
    return zero3_kwargs(load_config(write(tmp_path, {"zero_optimization": {"stage": 3, **zero}})), model or Tiny())


@pytest.mark.parametrize(
    "zero, expected",
    [
        ({}, {"persistence_threshold": 100_000, "prefetch": 50_000_000}),  # DeepSpeed's defaults
        ({"stage3_prefetch_bucket_size": 0.94e6, "stage3_param_persistence_threshold": 1e4},
         {"persistence_threshold": 10_000, "prefetch": 940_000}),
        ({"stage3_prefetch_bucket_size": 0}, {"persistence_threshold": 100_000, "prefetch": 0}),
        ({"stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto"},
         {"persistence_threshold": 640, "prefetch": int(0.9 * 64 * 64)}),  # from the hidden size, as HF fills them
        ({"prefetch_bucket_size": 1234, "param_persistence_threshold": 77},  # DeepSpeed's other names
         {"persistence_threshold": 77, "prefetch": 1234}),
        ({"prefetch_bucket_size": "auto", "param_persistence_threshold": "auto"},  # HF fills only the stage3_ names
         {"persistence_threshold": 100_000, "prefetch": 50_000_000}),
        ({"stage3_prefetch_bucket_size": 5000, "stage3_max_live_parameters": 1000},  # the cap on what is live
         {"persistence_threshold": 100_000, "prefetch": 1000}),
        ({"stage3_prefetch_bucket_size": "auto", "max_live_parameters": 100},
         {"persistence_threshold": 100_000, "prefetch": 100}),
        ({"stage3_max_live_parameters": "auto", "sub_group_size": 1e9, "stage3_max_reuse_distance": 0},
         {"persistence_threshold": 100_000, "prefetch": 50_000_000}),
    ],
)  # fmt: skip
def test_zero3_kwargs(tmp_path, zero, expected):
    assert kwargs_of(tmp_path, zero) == expected
    assert all(type(v) is int for v in kwargs_of(tmp_path, zero).values())


def test_zero3_kwargs_defaults_are_the_engines_and_deepspeeds():
    from trainer_shard.sharding import zero3

    assert zero3_kwargs(None, None) == {"persistence_threshold": zero3.PERSISTENCE_THRESHOLD, "prefetch": 50_000_000}
    assert param_offload_kwargs(None) is None
    assert zero3.PERSISTENCE_THRESHOLD == 100_000


def test_zero3_kwargs_auto_needs_a_hidden_size(tmp_path):
    with pytest.raises(ConfigError, match="stage3_prefetch_bucket_size: \"auto\" comes from the model's hidden size"):
        kwargs_of(tmp_path, {"stage3_prefetch_bucket_size": "auto"}, model=torch.nn.Linear(2, 2))


@pytest.mark.parametrize("name", ["stage3_model_persistence_threshold", "model_persistence_threshold"])
def test_model_persistence_threshold_below_what_stays_whole_is_refused(tmp_path, name):
    # persistence threshold 64: bias (64) and small (10) stay whole: 74 elements (the frozen 100 are sharded)
    zero = {"stage3_param_persistence_threshold": 64, name: 73}
    with pytest.raises(ConfigError) as e:
        kwargs_of(tmp_path, zero)
    assert e.value.problems == [(f"$.zero_optimization.{name}", (
        "is 73 elements, but the parameters kept whole on every rank here (those of at most 64 elements, "
        "stage3_param_persistence_threshold) hold 74 in Tiny; raise it or remove it, or lower "
        "stage3_param_persistence_threshold"))]  # fmt: skip
    assert kwargs_of(tmp_path, dict(zero, **{name: 74}))["persistence_threshold"] == 64


def test_zero3_settings_for_validate_config(tmp_path):
    config = load_config(write(tmp_path, {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
                                                                "param_persistence_threshold": 1e4,
                                                                "stage3_max_live_parameters": 1e9}}))  # fmt: skip
    assert zero3_settings(config) == [
        "prefetch: auto (0.9 x hidden size squared) elements ahead, at most 1,000,000,000 (stage3_max_live_parameters)",
        "persistence threshold: 10,000 elements (parameters of at most this many stay whole on every rank)",
        "parameter offload: none (the parameter shards stay in this process's memory between uses)",
        "save_model: the whole model.safetensors, streamed a unit at a time"]  # fmt: skip


def test_a_zero_reduce_bucket_size_is_taken_at_stage_3_only(tmp_path):
    """Configs in the wild (DeepSpeed takes it) write reduce_bucket_size 0 at stage 3, where buckets
    are the units' flat buffers; at stage 2 a bucket of 0 elements cannot be, and is named."""
    zero = {"reduce_bucket_size": 0, "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0}
    config = load_config(write(tmp_path, {"zero_optimization": {"stage": 3, **zero}}), world_size=2)
    assert config.stage == 3 and config.reduce_bucket_size == 0
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, {"zero_optimization": {"stage": 2, "reduce_bucket_size": 0}}), world_size=2)
    assert e.value.problems == [("$.zero_optimization.reduce_bucket_size", "is 0: a bucket holds at least 1 element "
                                 'at stages 1 and 2 (only stage 3 ignores it); write a size, "auto", or remove it')]
