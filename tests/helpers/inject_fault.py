"""Run finetune_trainer.main with one fault injected on one rank, as the environment says.

    FAULT        kill | raise | hang | kill_in_collective | kill_in_save | signal_self |
                 signal_launcher | signal_group | fill_disk | read_only
    FAULT_STEP   the optimizer step (1-based) at whose start it happens (kill_in_save: the
                 checkpoint step whose save it cuts)
    FAULT_RANK   the rank it happens on (default 1)
    FAULT_SIGNAL for signal_*: TERM or INT (default TERM)

kill: SIGKILL at the start of the step, while the other ranks wait in its collectives.
raise: a RuntimeError there. hang: sleep there for an hour, alive and silent in the collectives.
kill_in_collective: SIGKILL on entering the step's first gradient reduce-scatter.
kill_in_save: SIGKILL after this rank's optimizer shard of that checkpoint is written.
signal_self: the signal sent to this process alone.
signal_launcher: the signal sent to the launcher (torchrun), which passes it on to every rank,
as a scheduler preempting the job does. signal_group: the signal sent to the whole process group,
as Ctrl-C in a terminal does. fill_disk: a file filling the disk of --output_dir but for 4 KiB.
read_only: the filesystem of --output_dir remounted read-only (both need a mount namespace of
their own: tests/faults/test_disk_faults.py runs this under `unshare`).
"""

import faulthandler
import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

from transformers import TrainerCallback

from trainer_shard import comm
from trainer_shard.sharding import state_io

FAULT = os.environ["FAULT"]
faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stack dump on demand, for debugging a hang
STEP = int(os.environ.get("FAULT_STEP", "3"))
RANK = int(os.environ.get("FAULT_RANK", "1"))
SIGNUM = getattr(signal, "SIG" + os.environ.get("FAULT_SIGNAL", "TERM"))


def _me() -> bool:
    return int(os.environ.get("RANK", "0")) == RANK


def _stamp() -> None:
    """FAULT_STAMP: a file that gets the wall-clock time of the fault, for the tests' timings."""
    if os.environ.get("FAULT_STAMP"):
        Path(os.environ["FAULT_STAMP"]).write_text(repr(time.time()))


class Inject(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 != STEP or not _me():
            return
        _stamp()
        if FAULT == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif FAULT == "raise":
            raise RuntimeError(f"injected fault on rank {RANK} at step {STEP}")
        elif FAULT == "hang":
            time.sleep(3600)
        elif FAULT == "kill_in_collective":
            _kill_on_next_reduce_scatter()
        elif FAULT == "signal_self":
            os.kill(os.getpid(), SIGNUM)
        elif FAULT == "signal_launcher":
            os.kill(os.getppid(), SIGNUM)
        elif FAULT == "signal_group":
            os.killpg(os.getpgid(0), SIGNUM)
        elif FAULT == "fill_disk":
            _fill(Path(args.output_dir))
        elif FAULT == "read_only":
            target = os.environ["FAULT_MOUNT"]
            subprocess.run(["mount", "-o", "remount,ro", target], check=True)


def _fill(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    with open(folder / "ballast", "wb") as f:
        f.write(b"\0" * max(0, free - 4096))


def _kill_on_next_reduce_scatter():
    original = comm.reduce_scatter

    def reduce_scatter(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    comm.reduce_scatter = reduce_scatter  # the reducer calls it through the module


if FAULT == "kill_in_save":
    _write_shard = state_io.write_shard

    def write_shard(optimizer, folder, names):
        written = _write_shard(optimizer, folder, names)
        if _me() and Path(folder).parent.name == f"checkpoint-{STEP}":
            _stamp()
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    state_io.write_shard = write_shard

script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "finetune_trainer.py"))
sys.exit(script["run"](sys.argv[1:], callbacks=[Inject()]))
