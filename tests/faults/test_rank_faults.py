"""A rank that dies, raises or hangs in the middle of a step, a collective or a save: the other
rank exits within a bounded time with a message naming it, and the last complete checkpoint is
intact (trainer_shard/faults.py, [Note: fault watch]).

The ranks are started by hand (as on two machines, where no launcher stops the survivors) and
under torchrun (which stops them itself, with SIGTERM).
"""

import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, free_port, run_script, script_env
from fault_runs import INJECT, TIMEOUT, flags
from trainer_shard.checkpoint import manifest_problems

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def launch_by_hand(args, env, nproc=2):
    """Ranks started as separate machines would start them: no agent watches over them."""
    port = str(free_port())
    procs = []
    for rank in range(nproc):
        rank_env = {**script_env(), **env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
                    "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc)}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(INJECT), *map(str, args)], cwd=ROOT, env=rank_env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))  # fmt: skip
    return procs


def finish(procs, limit=120):
    """[(returncode, output, wall-clock time it ended)] of each process, in rank order."""
    ended, outputs = [None] * len(procs), [None] * len(procs)
    deadline = time.time() + limit
    while any(e is None for e in ended) and time.time() < deadline:
        for i, p in enumerate(procs):
            if ended[i] is None and p.poll() is not None:
                ended[i] = time.time()
        time.sleep(0.05)
    for i, p in enumerate(procs):
        if ended[i] is None:
            p.kill()
        outputs[i] = p.communicate()[0]
    return [(p.returncode, outputs[i], ended[i]) for i, p in enumerate(procs)]


# case -> (fault, the survivor's bound in seconds after the fault, what its message says of rank 1), ZeRO-2
FAULTS = {
    "kill": ("kill", 8, "its process"),  # SIGKILL at the start of step 3
    "raise": ("raise", 8, "it raised RuntimeError: injected fault on rank 1 at step 3"),
    "kill_in_collective": ("kill_in_collective", 8, "its process"),  # SIGKILL entering step 3's reduce-scatter
    "kill_in_save": ("kill_in_save", 8, "its process"),  # SIGKILL with its shard of checkpoint-4 written
    "hang": ("hang", TIMEOUT + 8, f"it is alive but did not join the collective within {TIMEOUT} s"),  # asleep
    "kill-plain-ddp": ("kill", 8, "its process"),  # in DDP's own all-reduce, no sharding
}


@pytest.mark.parametrize("case", FAULTS)
def test_the_other_rank_stops_in_bounded_time_naming_the_failed_rank(tiny_model, tiny_data, tmp_path, case):
    fault, bound, reason = FAULTS[case]
    out, stamp = tmp_path / "out", tmp_path / "fault_time"
    step = "4" if fault == "kill_in_save" else "3"
    extra = ["--sharded_ddp", ""] if case.endswith("plain-ddp") else []
    procs = launch_by_hand(flags(tiny_model, tiny_data, out, *extra),
                           {"FAULT": fault, "FAULT_STEP": step, "FAULT_STAMP": str(stamp)})  # fmt: skip
    (code0, out0, end0), (code1, out1, end1) = finish(procs)
    assert stamp.is_file(), f"the fault was not injected\n{out0[-3000:]}\n{out1[-3000:]}"
    assert end0 is not None, f"rank 0 was still running 120 s after the fault (killed)\n{out0[-3000:]}"
    took = end0 - float(stamp.read_text())
    assert code0 == 3, f"rank 0 exit {code0}\n{out0[-3000:]}"
    assert took < bound, f"rank 0 took {took:.1f} s to stop after the fault (bound {bound} s)"
    message = next(line for line in out0.splitlines() if "error:" in line)
    assert "because rank 1 failed" in message and reason in message, message
    assert f"The last complete checkpoint is {out / 'checkpoint-2'}" in message, message
    print(f"{case}: rank 0 stopped {took:.1f} s after the fault: {message}")
    if fault == "hang":  # the sleeper learns that rank 0 gave up on it, and stops too
        assert code1 == 3 and "gave up waiting for this rank" in out1, out1[-3000:]
    else:
        assert code1 != 0
    # what survived: checkpoint-2 whole; nothing of the step that failed published
    assert manifest_problems(out / "checkpoint-2") == []
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]


def test_under_torchrun_a_killed_rank_is_named(tiny_model, tiny_data, tmp_path):
    """torchrun stops the survivor itself (SIGTERM); the survivor still names the rank. (A run killed
    mid-save resumes exactly: test_checkpoint_resume.py; an interrupted one: test_interrupt.py.)"""
    out = tmp_path / "out"
    killed = run_script(flags(tiny_model, tiny_data, out), nproc=2, script=INJECT, env={"FAULT": "kill", "FAULT_STEP": "5"})
    assert killed.returncode != 0
    assert "rank 0 stopped at step 5" in killed.stderr and "because rank 1 failed" in killed.stderr, killed.stderr[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    assert manifest_problems(out / "checkpoint-4") == []


def test_with_three_ranks_every_survivor_names_the_one_that_died(tiny_model, tiny_data, tmp_path):
    """Rank 2 killed: ranks 0 and 1 both blame it, though one of them may first hear of it from
    the other (a stopping rank passes on whom it blames)."""
    out = tmp_path / "out"
    procs = launch_by_hand(flags(tiny_model, tiny_data, out), {"FAULT": "kill", "FAULT_RANK": "2"}, nproc=3)
    results = finish(procs)
    assert results[2][0] == -signal.SIGKILL
    for rank, (code, output, _) in enumerate(results[:2]):
        assert code == 3 and "because rank 2 failed" in output, f"rank {rank}: exit {code}\n{output[-3000:]}"
