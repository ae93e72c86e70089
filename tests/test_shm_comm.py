"""comm.py's all-gather and reduce-scatter through shared memory ([Note: shared-memory
collectives] in shm_comm.py), on 2 and 3 gloo ranks of this host, against the same sums and
concatenations computed on one process from every rank's inputs (which each rank can make)."""

import os
import time

import pytest
import torch

from distributed import spawn
from trainer_shard import comm, shm_comm

pytestmark = pytest.mark.multiproc

# numels: empty, one element, not a multiple of anything, and larger than a slot (several chunks)
SIZES = [0, 1, 1000, shm_comm.SLOT_BYTES // 4 + 12345]
DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def inputs(rank, n, dtype, world):
    g = torch.Generator().manual_seed(1000 * rank + n)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, (n * world,), generator=g)
    return torch.randn(n * world, generator=g).to(dtype)


def collectives(rank, world_size):
    import torch.distributed as dist

    assert comm._shared_memory(None, torch.zeros(1)) is not None, "not through shared memory"
    handles = []
    for dtype in DTYPES:
        for n in SIZES:
            mine = inputs(rank, n, dtype, world_size)
            everyone = [inputs(r, n, dtype, world_size) for r in range(world_size)]
            # all-gather: each rank's first n elements
            out = torch.empty(n * world_size, dtype=dtype)
            handles.append((comm.all_gather(out, mine[:n], async_op=True), out,
                            torch.cat([e[:n] for e in everyone])))  # fmt: skip
            # reduce-scatter: chunk `rank` summed in rank order (the gloo path's order)
            got = torch.empty(n, dtype=dtype)
            want = torch.add(everyone[0][rank * n : (rank + 1) * n], everyone[1][rank * n : (rank + 1) * n])
            for e in everyone[2:]:
                want.add_(e[rank * n : (rank + 1) * n])
            handles.append((comm.reduce_scatter(got, mine.clone(), async_op=True), got, want))
    for handle, got, want in handles:  # all in flight at once, waited in order
        handle.wait()
        assert torch.equal(got, want), (got.dtype, got.numel())
    # in place: this rank's input is its chunk of the output
    out = torch.zeros(6 * world_size)
    out[rank * 6 : (rank + 1) * 6] = rank + 1
    comm.all_gather(out, out[rank * 6 : (rank + 1) * 6])
    assert torch.equal(out, torch.arange(1, world_size + 1).float().repeat_interleave(6))
    assert not any(name.startswith("trainer_shard-") for name in os.listdir("/dev/shm")), "files left in /dev/shm"
    dist.barrier()


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_gather_and_reduce_scatter_through_shared_memory(world_size):
    spawn(collectives, world_size)


def one_dies(rank, world_size):
    x = torch.ones(10)
    comm.all_gather(torch.empty(20), x)  # the transport made, both ranks in
    if rank == 1:
        os._exit(0)
    started = time.monotonic()
    with pytest.raises(shm_comm.ShmCollectiveError, match="rank 1 .* exited"):
        comm.all_gather(torch.empty(20), x)
    assert time.monotonic() - started < 5


def test_a_peer_that_exits_mid_collective_is_named_not_waited_for():
    spawn(one_dies, 2, fresh=True)


def switched_off(rank, world_size):
    assert comm._shared_memory(None, torch.zeros(1)) is None
    out = torch.empty(4)
    comm.all_gather(out, torch.full((2,), float(rank)))
    assert out.tolist() == [0, 0, 1, 1]


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("TRAINER_SHARD_SHM_COLLECTIVES", "0")
    spawn(switched_off, 2, fresh=True)
