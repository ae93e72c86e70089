"""The kept ranks of tests/distributed.py fail a test as fresh ones would: a check that raises on
one rank (its peer left waiting in a collective) fails with that rank's traceback within the
grace period, and the next check runs on a new set, from torch's default seed."""

import pytest
import torch
import torch.distributed as dist

import distributed
from distributed import RanksFailed, spawn


def fails_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("planted on rank 1")
    dist.barrier()  # rank 0 waits here for a peer that never comes


def seeded_and_summed(rank, world_size):
    assert torch.initial_seed() == distributed.TORCH_DEFAULT_SEED
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    assert value.item() == sum(range(1, world_size + 1))


@pytest.mark.multiproc
def test_a_failing_rank_fails_the_test_and_the_next_check_gets_new_ranks(monkeypatch):
    monkeypatch.setattr(distributed, "PEERS_GRACE_S", 2)
    spawn(seeded_and_summed, 2)
    first = distributed._kept[2].procs
    with pytest.raises(RanksFailed, match=r"(?s)fails_on_rank_1 failed.*-- rank 0:\nrank 0 still running.*-- rank 1:.*"
                                          r"ValueError: planted on rank 1"):
        spawn(fails_on_rank_1, 2)
    assert not any(p.is_alive() for p in first)
    spawn(seeded_and_summed, 2)  # a new set, in a process group of its own
    assert distributed._kept[2].procs != first
