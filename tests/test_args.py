"""--sharded_ddp / --offload parsing and every refusal, without a process group."""

import json
from types import SimpleNamespace

import pytest

from trainer_shard import ArgumentError, ShardedDDPOption, ShardedSeq2SeqTrainingArguments, ShardedTrainingArguments
from trainer_shard.args import _distributed_problems, parse_sharded_ddp


def make_args(tmp_path, cls=ShardedSeq2SeqTrainingArguments, **kw):
    return cls(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, **kw)


@pytest.mark.parametrize("value", ["", None])
def test_no_option_is_a_drop_in(tmp_path, value):
    args = make_args(tmp_path, sharded_ddp=value)
    assert args.sharded_ddp == [] and args.offload is None and not args.sharding_enabled


@pytest.mark.parametrize(
    "value, expected",
    [
        ("simple", ["simple"]),
        ("zero_dp_2 offload", ["zero_dp_2", "offload"]),
        ("zero_dp_3,auto_wrap", ["zero_dp_3", "auto_wrap"]),
        (["zero_dp_2"], ["zero_dp_2"]),
        ("simple simple", ["simple"]),
    ],
)
def test_valid_options_parse(value, expected):
    options, problems = parse_sharded_ddp(value)
    assert [o.value for o in options] == expected and problems == []
    assert all(isinstance(o, ShardedDDPOption) for o in options)


@pytest.mark.parametrize(
    "value, fragment",
    [
        ("zero2", "unknown option 'zero2'"),
        ("simple zero_dp_2", "simple and zero_dp_2 are different sharding strategies"),
        ("zero_dp_2 zero_dp_3", "pick one"),
        ("offload", "'offload' needs a strategy"),
        ("zero_dp_2 auto_wrap", "'auto_wrap' wraps submodules for parameter sharding"),
        (3, "must be a string"),
    ],
)
def test_bad_options_are_named(value, fragment):
    _, problems = parse_sharded_ddp(value)
    assert any(fragment in p for p in problems), problems


def test_all_problems_reported_at_once(tmp_path):
    with pytest.raises(ArgumentError) as e:
        make_args(tmp_path, sharded_ddp="zero2 offload", offload=str(tmp_path / "missing.json"))
    message = str(e.value)
    assert "3 problems" in message
    assert "unknown option 'zero2'" in message and "needs a strategy" in message and "missing.json" in message


@pytest.mark.parametrize("option", ["simple", "zero_dp_2", "zero_dp_3", "zero_dp_3 auto_wrap", "zero_dp_3 offload"])
def test_built_options_are_accepted(tmp_path, option):
    args = make_args(tmp_path, sharded_ddp=option)
    assert [o.value for o in args.sharded_ddp] == option.split() and args.sharding_enabled


def test_offload_missing_file_is_named(tmp_path):
    with pytest.raises(ArgumentError, match="config file .*nope.json' does not exist"):
        make_args(tmp_path, offload=str(tmp_path / "nope.json"))


def test_offload_directory_is_refused(tmp_path):
    with pytest.raises(ArgumentError, match="is not a file"):
        make_args(tmp_path, offload=str(tmp_path))


def test_offload_config_sets_what_it_turns_on(tmp_path):
    config = tmp_path / "offload.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1, "reduce_bucket_size": 2**22}, "bf16": {"enabled": True}}))
    args = make_args(tmp_path, offload=str(config))
    assert args.bf16 is True  # the config's precision takes effect
    assert args.ddp_bucket_cap_mb == 8  # stage 1 reduces through DDP: 2**22 bf16 elements
    assert args.offload_config.stage == 1


def test_offload_twice_is_refused(tmp_path):
    config = tmp_path / "offload.json"
    config.write_text("{}")
    with pytest.raises(ArgumentError, match="both ask for offload"):
        make_args(tmp_path, offload=str(config), sharded_ddp="zero_dp_2 offload")


def test_sharded_ddp_with_fsdp_is_refused(tmp_path):
    with pytest.raises(ArgumentError, match="--sharded_ddp and --fsdp"):
        make_args(tmp_path, sharded_ddp="simple", fsdp="full_shard")


def test_error_is_a_value_error(tmp_path):
    # code written for the transformers Trainer catches ValueError for bad arguments
    with pytest.raises(ValueError):
        make_args(tmp_path, sharded_ddp="bogus")


def fake_args(**kw):
    return SimpleNamespace(**{"use_cpu": False, "ddp_backend": None, **kw})


def test_world_size_without_gpu_sets_use_cpu(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("trainer_shard.args.has_accelerator", lambda: False)
    args = fake_args()
    assert _distributed_problems(args) == [] and args.use_cpu is True


def test_one_process_is_left_alone(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = fake_args()
    assert _distributed_problems(args) == [] and args.use_cpu is False


def test_nccl_on_cpu_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("trainer_shard.args.has_accelerator", lambda: False)
    problems = _distributed_problems(fake_args(ddp_backend="nccl"))
    assert problems and "--ddp_backend nccl cannot run on the CPU" in problems[0]


def test_sortish_sampler_groups_by_length(tmp_path):
    assert make_args(tmp_path, sortish_sampler=True).train_sampling_strategy == "group_by_length"
    assert make_args(tmp_path).train_sampling_strategy == "random"
    with pytest.raises(ArgumentError, match="--sortish_sampler and --train_sampling_strategy sequential disagree"):
        make_args(tmp_path, sortish_sampler=True, train_sampling_strategy="sequential")


def test_unshardable_optimizer_refused_at_parse_time(tmp_path):
    with pytest.raises(ArgumentError, match="--optim adafactor cannot be sharded"):
        make_args(tmp_path, sharded_ddp="zero_dp_2", optim="adafactor")
    assert make_args(tmp_path, optim="adafactor").optim == "adafactor"  # fine without sharding


@pytest.mark.parametrize("flags, fragment", [
    (dict(compute_dtype="float64"), "--compute_dtype 'float64': choose auto, fp32, bf16, fp16"),
    (dict(compute_dtype="bf16"), "but they are fp32 (--bf16/--fp16 choose it); add --bf16"),
    (dict(compute_dtype="fp16", bf16=True), "but they are bf16 (--bf16/--fp16 choose it); pass --compute_dtype bf16 or fp32"),
])  # fmt: skip
def test_a_compute_dtype_the_parameters_cannot_compute_in_is_refused(tmp_path, flags, fragment):
    with pytest.raises(ArgumentError) as raised:
        make_args(tmp_path, **flags)
    assert fragment in str(raised.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags", [dict(), dict(compute_dtype="fp32"), dict(compute_dtype="fp32", bf16=True),
                                   dict(compute_dtype="bf16", bf16=True), dict(compute_dtype="auto", fp16=True)])
def test_compute_dtypes_that_fit_the_storage_are_taken(tmp_path, flags):
    assert make_args(tmp_path, **flags).compute_dtype == flags.get("compute_dtype", "auto")
