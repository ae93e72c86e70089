"""A second SIGINT/SIGTERM stops a run that is slow to reach the end of its step ([Note: interrupts]
in faults.py): one within FORCE_AFTER seconds of the first is taken as the same request, one later
stops the process at once (SIGTERM: exit 128 + 15; SIGINT: KeyboardInterrupt, as Python's own)."""

import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, script_env
from trainer_shard.faults import FORCE_AFTER

# A "training step" that never ends: the guard must be what stops it.
CHILD = """
import sys, time
from trainer_shard.faults import InterruptGuard
guard = InterruptGuard()
print("ready", flush=True)
try:
    while True:
        time.sleep(0.05)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
    sys.exit(130)
"""


def start():
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, env=script_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdout.readline().strip() == "ready"
    return child


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_signal_after_force_after_stops_at_once(signum):
    child = start()
    child.send_signal(signum)
    time.sleep(0.3)
    child.send_signal(signum)  # too soon: the same request as the first
    time.sleep(0.5)
    assert child.poll() is None, "a second signal within FORCE_AFTER stopped the process"
    time.sleep(FORCE_AFTER)
    sent = time.monotonic()
    child.send_signal(signum)
    out, err = child.communicate(timeout=30)
    took = time.monotonic() - sent
    name = signal.Signals(signum).name
    assert f"{name} received: stopping after the current step" in err
    assert took < 20, f"the process took {took:.1f} s to stop"  # without the guard's exit it never stops
    if signum == signal.SIGTERM:
        assert child.returncode == 128 + signal.SIGTERM, (child.returncode, err[-2000:])
    else:
        assert child.returncode == 130 and "KeyboardInterrupt" in out, (child.returncode, out, err[-2000:])
