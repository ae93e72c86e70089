"""The offload config: every class of bad input reported at once, with its JSON path and the fix."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_shard import ArgumentError, ShardedSeq2SeqTrainingArguments
from trainer_shard.config import load_config
from trainer_shard.config.schema import TOP
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
        ('{"gradient_clipping": NaN}', "$", "NaN is not a number JSON allows"),
        ({"steps_per_prnt": 10}, "$.steps_per_prnt", "unknown key (did you mean steps_per_print?)"),
        ({"zero_optimization": {"offload_optimizer": {"devise": "cpu"}}},
         "$.zero_optimization.offload_optimizer.devise", "allowed here: device, nvme_path"),
        ({"zero_optimization": {"stage": "2"}}, "$.zero_optimization.stage", "must be an integer"),
        ({"zero_optimization": {"stage": 2.5}}, "$.zero_optimization.stage", "must be an integer"),
        ({"zero_optimization": {"stage": 7}}, "$.zero_optimization.stage", "must be <= 3"),
        ({"zero_optimization": {"stage": "auto"}}, "$.zero_optimization.stage", '"auto" is not allowed here'),
        ({"zero_optimization": {"overlap_comm": "yes"}}, "$.zero_optimization.overlap_comm", "true or false"),
        ({"zero_optimization": {"contiguous_gradients": False}}, "$.zero_optimization.contiguous_gradients", "must be true"),
        ({"zero_optimization": {"reduce_bucket_size": 1e400}}, "$", "Infinity is not a number JSON allows"),
        ({"zero_optimization": {"reduce_bucket_size": 0}}, "$.zero_optimization.reduce_bucket_size", ">= 1"),
        ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
         "$.zero_optimization.offload_optimizer.device", "one of none, cpu, nvme"),
        ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}},
         "$.zero_optimization.offload_optimizer.nvme_path", 'device "nvme" needs nvme_path'),
        ({"zero_optimization": {"offload_optimizer": {"nvme_path": "/tmp/x"}}},
         "$.zero_optimization.offload_optimizer.nvme_path", 'only used with device "nvme"'),
        ({"zero_optimization": {"cpu_offload": True, "offload_optimizer": {"device": "nvme", "nvme_path": "x"}}},
         "$.zero_optimization.cpu_offload", "contradicts"),
        ({"zero_optimization": {"stage": 3}}, "$.zero_optimization.stage", "not in this release"),
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
    assert "needs stage 1 or 2" in found["$.zero_optimization.stage"]
    load_config(write(tmp_path, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}), world_size=1)


def test_every_problem_at_once(tmp_path):
    data = {"zero_optimization": {"stage": 9, "bogus": 1, "offload_optimizer": {"device": "nvme"}},
            "fp16": {"enabled": True}, "bf16": {"enabled": True}, "gradient_clipping": -1}  # fmt: skip
    found, message = problems(tmp_path, data)
    assert set(found) == {"$.zero_optimization.stage", "$.zero_optimization.bogus",
                          "$.zero_optimization.offload_optimizer.nvme_path", "$.fp16.enabled", "$.gradient_clipping"}
    assert message.startswith(f"offload config {tmp_path / 'c.json'}: 5 problems")


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


@pytest.mark.parametrize("name", ["offload_cpu.json", "offload_disk.json", "zero2.json"])
def test_shipped_configs_are_valid(name):
    load_config(CONFIGS / name, world_size=2)


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
    ok = subprocess.run([exe, "validate-config", CONFIGS / "offload_disk.json"], capture_output=True, text=True)
    assert ok.returncode == 0 and "valid on 1 rank" in ok.stdout
    assert "  optimizer offload: nvme at offload_store/rank<R>" in ok.stdout.splitlines()
    bad = write(tmp_path, {"zero_optimization": {"stage": "two"}})
    proc = subprocess.run([exe, "validate-config", bad], capture_output=True, text=True)
    assert proc.returncode == 2 and "$.zero_optimization.stage: must be an integer" in proc.stderr
