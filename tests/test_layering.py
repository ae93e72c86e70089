"""Layering and single homes (issue 16): config/ is plain data (no arrow to sharding/ or offload/),
comm.py knows nothing of faults.py, and each shared size, dtype table and disk check has one home
that every user takes it from."""

import ast
import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainer_shard import ShardedDDPOption, constants, disk, dtypes
from trainer_shard.config import apply
from trainer_shard.offload import OffloadSpec
from trainer_shard.training import plan
from trainer_shard.config.schema import DATA_TYPES, INFERENCE, ZERO_OPTIMIZATION
from trainer_shard.sharding.scaler import DynamicLossScaler

PACKAGE = Path(__file__).resolve().parents[1] / "trainer_shard"


def imported_modules(path: Path) -> list:
    """(function name or None, absolute module name) of every import in `path`, at any depth."""
    package = ("trainer_shard." + ".".join(path.relative_to(PACKAGE).parent.parts)).rstrip(".")
    found = []

    def visit(node, function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, function or child.name)
                continue
            if isinstance(child, ast.Import):
                found.extend((function, alias.name) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = package.rsplit(".", child.level - 1)[0] if child.level else ""
                module = ".".join(filter(None, [base, child.module]))
                found.extend((function, f"{module}.{alias.name}" if child.module is None else module) for alias in child.names)
            visit(child, function)

    visit(ast.parse(path.read_text()), None)
    return found


def test_config_imports_nothing_from_sharding_or_offload():
    files = sorted((PACKAGE / "config").glob("*.py"))
    assert files
    for path in files:
        name = path.relative_to(PACKAGE).as_posix()
        for function, module in imported_modules(path):
            assert not module.startswith(("trainer_shard.sharding", "trainer_shard.offload", "trainer_shard.training")), (
                name, function, module)  # fmt: skip


def test_comm_imports_nothing_from_faults():
    modules = [module for _, module in imported_modules(PACKAGE / "comm.py")]
    assert not any(m.startswith("trainer_shard.faults") for m in modules), modules


def test_zero_stage_and_the_offload_spec_come_from_the_config():
    def config(stage, device):
        return SimpleNamespace(stage=stage, offload_device=device)

    assert apply.zero_stage(None, None) is None
    assert apply.zero_stage(None, 1) == 1
    assert apply.zero_stage(config(0, "none"), None) is None
    assert apply.zero_stage(config(1, "cpu"), None) == 1
    assert apply.zero_stage(config(0, "nvme"), None) == 2  # offload on one process: stage 2
    assert apply.zero_stage(config(2, "none"), 1) == 1  # --sharded_ddp wins

    def args(sharded_ddp=()):
        return SimpleNamespace(sharded_ddp=[ShardedDDPOption(o) for o in sharded_ddp])

    cpu = SimpleNamespace(stage=0, offload_device="cpu", nvme_path=None, pin_memory=False, buffer_count=4)
    stage, spec = plan.plan(args(), cpu)
    assert stage == 2 and spec.device == "cpu" and spec.chunk_numel == constants.CHUNK_NUMEL
    assert plan.plan(args(), None) == (None, None)
    stage, spec = plan.plan(args(["zero_dp_2", "offload"]), None)  # the flag alone: CPU offload, the defaults
    assert stage == 2 and spec == OffloadSpec("cpu")
    assert plan.plan(args(["simple"]), None) == (1, None)


def test_loss_scaler_kwargs_build_the_scaler_the_fp16_section_describes():
    def fp16(**kw):
        return SimpleNamespace(**{"loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                                  "min_loss_scale": 1.0, "hysteresis": 2, "consecutive_hysteresis": False, **kw})  # fmt: skip

    assert apply.loss_scaler_kwargs(None) == {}
    assert apply.loss_scaler_kwargs(fp16(loss_scale=128.0)) == {"init_scale": 128.0, "static": True}
    scaler = DynamicLossScaler(**apply.loss_scaler_kwargs(fp16(initial_scale_power=10, loss_scale_window=50)))
    assert (scaler.scale, scaler.growth_interval, scaler.min_scale, scaler.static) == (2.0**10, 50, 1.0, False)
    assert (scaler.hysteresis, scaler.consecutive_hysteresis, scaler.raise_error_at_min_scale) == (2, False, True)


def test_every_default_size_is_the_one_in_constants():
    from trainer_shard import consolidate, planner
    from trainer_shard.checkpoint import Chunked
    from trainer_shard.sharding.optimizer import ShardedOptimizer

    assert ZERO_OPTIMIZATION["reduce_bucket_size"].default == constants.BUCKET_NUMEL
    assert ZERO_OPTIMIZATION["allgather_bucket_size"].default == constants.BUCKET_NUMEL
    assert inspect.signature(ShardedOptimizer).parameters["bucket_numel"].default == constants.BUCKET_NUMEL
    assert planner.BUCKET_NUMEL == constants.BUCKET_NUMEL
    assert OffloadSpec("cpu").chunk_numel == constants.CHUNK_NUMEL
    assert Chunked(torch.float32, (1,), None).chunk_numel == constants.CHUNK_NUMEL
    assert consolidate.CHUNK_NUMEL == constants.CHUNK_NUMEL


def test_one_dtype_table():
    assert dtypes.DTYPES["bf16"] is dtypes.DTYPES["bfloat16"] is torch.bfloat16
    assert dtypes.DTYPES["fp16"] is dtypes.DTYPES["float16"] is torch.float16
    assert dtypes.DTYPES["fp32"] is dtypes.DTYPES["float32"] is torch.float32
    assert DATA_TYPES["grad_accum_dtype"].choices == constants.PRECISIONS
    assert set(INFERENCE["dtype"].choices) - {"auto"} == set(constants.DTYPE_NAMES)
    for bf16, fp16, name, half in [(True, False, "bf16", torch.bfloat16), (False, True, "fp16", torch.float16),
                                   (False, False, "fp32", None)]:  # fmt: skip
        assert dtypes.precision(SimpleNamespace(bf16=bf16, fp16=fp16)) == name
        assert dtypes.half_dtype(name) is half


def test_disk_checks(tmp_path, monkeypatch):
    folder = tmp_path / "not" / "yet"
    assert disk.existing_parent(folder) == tmp_path
    assert disk.is_writable(folder) and not disk.is_read_only(folder)
    assert disk.free_bytes(folder) > 0
    monkeypatch.setattr("os.access", lambda path, mode: False)
    assert not disk.is_writable(folder)
    assert [disk.format_bytes(n) for n in (100, 1536, 3 * 2**30, 5 * 2**40)] == [
        "100 bytes", "1.50 KiB", "3.00 GiB", "5120.00 GiB"]  # fmt: skip


@pytest.mark.parametrize("error, says", [(OSError(28, "No space left on device", "/x/f"), "No space left on device writing /x/f"),
                                         (RuntimeError("file write failed"), "torch.save could not write into")])  # fmt: skip
def test_write_errors_are_described(tmp_path, error, says):
    text = disk.describe_write_error(error, tmp_path)
    assert text.startswith(says) and text.endswith("free there)"), text
    assert disk.is_write_error(RuntimeError("[enforce fail] file write failed")) and not disk.is_write_error(RuntimeError("x"))
