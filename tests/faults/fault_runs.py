"""What the fault tests share: the flags of their runs and the run that no fault touched."""

import pytest
from safetensors.torch import load_file

from conftest import ROOT, TINY_FLAGS, assert_ok, run_script

INJECT = ROOT / "tests" / "helpers" / "inject_fault.py"
TIMEOUT = 6  # --ddp_timeout of these runs, in seconds


def flags(model, data, out, *extra):
    """8 steps of ZeRO-2 on 2 ranks (or 1), a checkpoint every 2."""
    return ["--model_name_or_path", model, "--data_dir", data, "--output_dir", out, *TINY_FLAGS, "--do_train",
            "--max_steps", "8", "--per_device_train_batch_size", "4", "--save_strategy", "steps", "--save_steps", "2",
            "--sharded_ddp", "zero_dp_2", "--ddp_timeout", str(TIMEOUT), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def straight(tiny_model, tiny_data, tmp_path_factory):
    """The final weights of the run on 2 ranks that nothing interrupted."""
    out = tmp_path_factory.mktemp("straight") / "out"
    assert_ok(run_script(flags(tiny_model, tiny_data, out), nproc=2))
    return load_file(out / "model.safetensors")
