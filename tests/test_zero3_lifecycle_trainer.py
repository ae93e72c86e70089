"""ZeRO-3 through finetune_trainer.py where its parameter lifecycle meets the Trainer: a run with
its parameters, gradients and optimizer state on disk stopped at a checkpoint and resumed ends
where the uninterrupted run ends."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import assert_ok, run_script
from test_sharded_trainer import log, train_flags
from test_zero3_offload_param_trainer import offload_config

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def test_resumed_with_parameters_on_disk_ends_where_the_uninterrupted_run_ends(tiny_model, tiny_data, tmp_path):
    """2 ranks, `zero_dp_3 offload` with offload_param on nvme (the model built on the meta
    device, sharded when the Trainer is built): transformers' resume loads the weights into the
    sharded model (it segfaulted writing into freed memory), and the run from checkpoint-3 ends
    within 1e-6 of the run that never stopped, logging the same losses."""
    extra = ["--sharded_ddp", "zero_dp_3 offload", "--offload", offload_config(tmp_path), "--save_strategy", "steps",
             "--save_steps", "3"]  # fmt: skip
    straight = tmp_path / "straight"
    assert_ok(run_script(train_flags(tiny_model, tiny_data, straight, *extra), nproc=2))
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(straight / "checkpoint-3", resumed / "checkpoint-3")
    proc = run_script([*train_flags(tiny_model, tiny_data, resumed, *extra), "--resume_from_checkpoint",
                       str(resumed / "checkpoint-3")], nproc=2)  # fmt: skip
    assert_ok(proc)
    want, got = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert want.keys() == got.keys()
    worst = max((want[k].float() - got[k].float()).abs().max().item() for k in want)
    assert worst <= 1e-6, f"the resumed run ends {worst:.3g} from the uninterrupted one"
    flat = [v for entry in log(resumed)[-3:] for v in entry]
    assert flat == pytest.approx([v for entry in log(straight)[-3:] for v in entry], rel=1e-5)
    assert not (tmp_path / "store").exists() or not any(p.is_file() for p in (tmp_path / "store").rglob("*"))
