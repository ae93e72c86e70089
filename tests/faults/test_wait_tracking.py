"""The fault watch learns which collective a rank waits in: faults.py registers its tracker with
comm.py (which imports nothing from faults), in whichever order the two are imported."""

import subprocess
import sys

import pytest
import torch.distributed as dist

from conftest import ROOT, script_env
from trainer_shard import comm, faults


@pytest.fixture
def two_fake_ranks(monkeypatch):
    """comm's collectives run as on 2 ranks; each torch.distributed call records where this rank
    said it was waiting while it ran."""
    seen = []

    def record(*args, **kwargs):
        seen.append(faults.WHERE.collective)

    class Work:
        def wait(self):
            record()

    monkeypatch.setattr(comm, "is_distributed", lambda group=None: True)
    monkeypatch.setattr(comm, "_uses_gloo", lambda group: False)
    monkeypatch.setattr(comm, "_reduce_scatter", lambda *a, **k: Work())
    for name in ("all_reduce", "broadcast", "barrier", "all_gather_object"):
        monkeypatch.setattr(dist, name, record)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    return seen


def test_each_collective_names_itself_while_it_waits(two_fake_ranks):
    import torch

    comm.all_reduce(torch.zeros(2))
    comm.broadcast(torch.zeros(2))
    comm.barrier()
    comm.all_gather_objects(1)
    comm.reduce_scatter(torch.zeros(1), torch.zeros(2))
    assert two_fake_ranks == ["all_reduce", "broadcast", "barrier", "all_gather_object", "reduce_scatter"]
    assert faults.WHERE.collective is None  # and it is cleared once the wait is over
    assert "waiting in" not in faults.WHERE.describe()


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
@pytest.mark.parametrize("first", ["comm", "faults"])
def test_the_tracker_is_registered_whichever_module_comes_first(first):
    """In a fresh process (as each rank is): importing faults is enough."""
    second = "faults" if first == "comm" else "comm"
    code = (f"import importlib, sys; importlib.import_module('trainer_shard.{first}'); "
            f"importlib.import_module('trainer_shard.{second}'); from trainer_shard import comm, faults; "
            "assert comm._wait_tracker is faults.inside, comm._wait_tracker")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=script_env())
