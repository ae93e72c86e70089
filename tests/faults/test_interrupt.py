"""SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption) during training: every rank finishes
the same step, writes a checkpoint under --save_on_interrupt, exits 128 + the signal, and the
checkpoint resumes to the same weights as a run never interrupted (faults.py, [Note: interrupts]).
The resume after a kill is tested in test_rank_faults.py and test_checkpoint_resume.py; a second
signal's immediate stop in test_second_signal.py."""

import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, assert_ok, free_port, run_script, script_env
from fault_runs import INJECT, flags, straight  # noqa: F401 - a fixture
from trainer_shard.checkpoint import manifest_problems

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def run_in_own_session(args, env, nproc=2):
    """torchrun in a process group of its own, so that a signal to the group spares pytest."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                str(free_port())]  # fmt: skip
    return subprocess.run([*launcher, str(INJECT), *map(str, args)], cwd=ROOT, env={**script_env(), **env},
                          capture_output=True, text=True, timeout=300, start_new_session=True)  # fmt: skip


@pytest.mark.parametrize("fault, signum", [("signal_launcher", "TERM"), ("signal_group", "INT")],
                         ids=["SIGTERM-to-torchrun", "Ctrl-C-to-the-process-group"])  # fmt: skip
def test_interrupt_saves_and_resumes_exactly(tiny_model, tiny_data, tmp_path, straight, fault, signum):
    out, stamp = tmp_path / "out", tmp_path / "fault_time"
    env = {"FAULT": fault, "FAULT_SIGNAL": signum, "FAULT_STEP": "3", "FAULT_RANK": "0", "FAULT_STAMP": str(stamp)}
    stopped = run_in_own_session([*flags(tiny_model, tiny_data, out), "--save_on_interrupt"], env)
    took = time.time() - float(stamp.read_text())
    assert stopped.returncode != 0, "an interrupted run must not exit 0"
    said = re.findall(rf"training interrupted by SIG{signum} after step (\d+): checkpoint saved to (\S+);", stopped.stderr)
    assert len(said) == 2, f"both ranks should report the stop\n{stopped.stderr[-4000:]}"
    assert said[0] == said[1], f"the ranks stopped after different steps: {said}"
    step = int(said[0][0])
    assert 3 <= step < 8, step
    checkpoint = out / f"checkpoint-{step}"
    assert said[0][1] == str(checkpoint) and manifest_problems(checkpoint) == []
    assert not (out / "model.safetensors").exists(), "the final model was saved as if the run had finished"
    print(f"SIG{signum}: every rank stopped after step {step} and saved; torchrun exited {took:.1f} s after the signal")
    resumed = run_script([*flags(tiny_model, tiny_data, out), "--resume_from_checkpoint", "latest"], nproc=2)
    assert_ok(resumed)
    final = load_file(out / "model.safetensors")
    assert all(torch.equal(final[k], straight[k]) for k in straight), "the resumed run differs from the straight one"


def test_without_save_on_interrupt_it_stops_unsaved_with_128_plus_the_signal(tiny_model, tiny_data, tmp_path):
    out = tmp_path / "out"
    args = [*flags(tiny_model, tiny_data, out), "--sharded_ddp", ""]
    stopped = run_script(args, script=INJECT, env={"FAULT": "signal_self", "FAULT_STEP": "3", "FAULT_RANK": "0"})
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "training interrupted by SIGTERM after step 3: no checkpoint was written" in stopped.stderr
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
