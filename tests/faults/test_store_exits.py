"""The disk store is deleted on every exit the process controls: an exception, SIGTERM (its
default action, after train(), and the forced stop of a second signal) and a peer's failure (the
fault reaper's hard exit). Only SIGKILL leaves it, and the next store there cleans it up
(tests/test_offload_store.py). See [Note: disk store lifetime] in trainer_shard/offload/store.py
and [Note: hard exits] in trainer_shard/faults.py.

Each case is a real process (tests/faults/store_exits.py) holding a store, ended as it would be."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, free_port, script_env

HOLDER = Path(__file__).with_name("store_exits.py")

pytestmark = pytest.mark.multiproc


def launch(mode, folder, *extra):
    return subprocess.Popen([sys.executable, str(HOLDER), mode, str(folder), *map(str, extra)], cwd=ROOT,
                            env=script_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def wait_ready(proc):
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the holder did not start: {line}{out}\n{err}")
    return proc


def start(mode, folder, *extra):
    return wait_ready(launch(mode, folder, *extra))


def held(folder) -> list:
    """What is on disk under the store's folder."""
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*"))


def test_an_exception_deletes_the_store(tmp_path):
    proc = start("raise", tmp_path / "nvme")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "RuntimeError: injected failure" in err, err
    assert not (tmp_path / "nvme").exists(), held(tmp_path / "nvme")


@pytest.mark.parametrize("mode", ["sigterm", "sigterm_after_train", "forced"])
def test_sigterm_deletes_the_store(tmp_path, mode):
    """SIGTERM with its default action (dies of it, as before: -15), after the signal guard of a
    train() call was restored, and the second signal that stops a process under the guard at
    once (exit 128 + 15)."""
    proc = start(mode, tmp_path / "nvme")
    assert (tmp_path / "nvme" / "rank0" / "0.master.f32").exists()  # there while the process runs
    proc.send_signal(signal.SIGTERM)
    if mode == "forced":
        time.sleep(0.5)  # past FORCE_AFTER (0.2 s in the holder)
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (143 if mode == "forced" else -signal.SIGTERM), (proc.returncode, err)
    assert not (tmp_path / "nvme").exists(), held(tmp_path / "nvme")


def test_a_peer_failure_deletes_the_store(tmp_path):
    """Rank 1 is killed while rank 0's main thread is blocked: rank 0's reaper ends it (exit 3,
    naming rank 1) with os._exit, and its store goes first."""
    port = free_port()
    rank0, rank1 = (launch("peer", tmp_path / "nvme", rank, port) for rank in (0, 1))
    try:
        wait_ready(rank0), wait_ready(rank1)
        assert (tmp_path / "nvme" / "rank0" / "0.master.f32").exists()
        rank1.kill()
        rank1.wait()
        _, err = rank0.communicate(timeout=60)
    finally:
        rank0.kill(), rank1.kill()
    assert rank0.returncode == 3 and "because rank 1 failed: its process" in err, (rank0.returncode, err)
    assert not (tmp_path / "nvme").exists(), held(tmp_path / "nvme")
