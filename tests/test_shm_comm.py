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


# ---- [Note: gathered in shared memory] --------------------------------------------------------


def left(shm) -> list:
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"trainer_shard-{shm.name}")]


def edits_on_every_rank(rank, world_size):
    """ZeRO-3 on 2 ranks, gathered buffers in shared memory: edits that every rank makes (`gathered(
    writeback=True)`, also nested in a plain `gathered()` whose buffers are shared already, and
    `load_state_dict`) count once, as on the unsharded model; training goes on from them."""
    from test_zero3_lifecycle import LR, UNITS, data, make

    from trainer_shard.sharding import shard_model

    model = make()
    plain = make()
    sharded = shard_model(model, units=UNITS, persistence_threshold=0)
    shm = shm_comm.for_group(None)
    for step in range(2):  # the pool holds shared storages from here
        x, y = data(step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        for p in sharded.shard_parameters():
            p.grad = None
    assert shm.zero_copy_gathers > 0
    want = {k: v * 0.5 for k, v in plain.state_dict().items()}
    with sharded.gathered(writeback=True):
        for p in model.parameters():
            p.data.mul_(0.5)
    got = sharded.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want if k != "scale"), "an edit made twice, or lost"
    with sharded.gathered(), sharded.gathered(writeback=True):  # the outer gather's buffers are shared
        for p in model.parameters():
            p.data.mul_(2.0)
    want = {k: v * 2.0 for k, v in want.items()}
    got = sharded.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want if k != "scale"), "an edit made twice, or lost"
    model.load_state_dict({k: v + 1 for k, v in want.items()})
    assert all(torch.equal(sharded.full_state_dict()[k], want[k] + 1) for k in want)
    plain.load_state_dict({k: v + 1 for k, v in want.items()})
    opt = torch.optim.AdamW(sharded.shard_parameters(), lr=LR)  # and it trains on as the plain model does
    ref = torch.optim.AdamW(plain.parameters(), lr=LR)
    x, y = data(5)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    torch.nn.functional.cross_entropy(plain(x), y).backward()
    sharded.clip_grad_norm_(1e9)
    opt.step(), ref.step()
    got = sharded.full_state_dict()
    diffs = {k: (got[k] - v).abs().max().item() for k, v in plain.state_dict().items()}
    assert max(diffs.values()) < 1e-6, diffs
    sharded.close()
    torch.distributed.barrier()  # both closed: a storage made but never gathered into goes with its pool
    assert not left(shm), ("files left", left(shm))
    torch.distributed.barrier()  # the peer makes the next part's storages only after this rank looked


def diverging(rank, world_size):
    """Two ranks gathering into different shared storages raise on both, naming it."""
    shm = shm_comm.for_group(None)
    first, second = shm.new_storage(64), shm.new_storage(64)
    storage, number = (first, second)[rank]
    out = torch.empty(0).set_(storage).view(torch.float32)
    with pytest.raises(shm_comm.ShmCollectiveError, match="different buffers"):
        comm.all_gather(out, torch.ones(8), shared=(number, 1, 64))
    shm.forget((second, first)[rank][1])  # the other one, dropped unused: its file goes
    torch.distributed.barrier()
    assert not left(shm), ("files left", left(shm))
    torch.distributed.barrier()  # the peer makes the next part's storages only after this rank looked


def no_room_on_one_rank(rank, world_size):
    """/dev/shm full for rank 1 (posix_fallocate fails, as it does there with ENOSPC): its buffer
    is its own memory and the gather goes through the slots, on both ranks, still exact."""
    import errno

    shm = shm_comm.for_group(None)
    if rank == 1:
        def full(*args):
            raise OSError(errno.ENOSPC, "No space left on device")

        os.posix_fallocate, fallocate = full, os.posix_fallocate
    storage, number = shm.new_storage(4 * 2 * 1000)
    if rank == 1:
        os.posix_fallocate = fallocate
    assert (number == -1) == (rank == 1)
    out = torch.empty(0).set_(storage).view(torch.float32)
    before = shm.zero_copy_gathers
    comm.all_gather(out, torch.full((1000,), float(rank + 1)), shared=(number, 1 if number >= 0 else 0, out.nbytes))
    assert torch.equal(out, torch.tensor([1.0, 2.0]).repeat_interleave(1000))
    assert shm.zero_copy_gathers == before
    torch.distributed.barrier()
    assert not left(shm), ("files left", left(shm))
    torch.distributed.barrier()  # the peer makes the next part's storages only after this rank looked


def spare_buckets(rank, world_size):
    """ZeRO-3 on 2 ranks with every bucket kept for the next of its size ([Note: spare buckets]
    in reducer.py, there only past 32 MiB): 6 blocks of one size, so later buckets take the
    earlier ones' buffers in the same backward; the weights are plain AdamW's on the whole model,
    and no buffer is held between steps."""
    from test_zero3_lifecycle import assert_close, reference, train

    from trainer_shard.sharding import reducer

    previous, reducer.SPARE_BYTES = reducer.SPARE_BYTES, 0
    try:
        model, sharded = train(rank, world_size, n=6)
    finally:
        reducer.SPARE_BYTES = previous
    grads = sharded.reducer
    most = (grads.max_in_flight + 1) * max(s.bucket.padded_numel for s in grads.states) * 4
    assert grads.reused > 0 and 0 < grads.peak_spare_bytes <= most and grads.spare_bytes == 0
    assert_close(sharded.full_state_dict(), reference(n=6))
    sharded.close()


def shared_gathers(rank, world_size):
    spare_buckets(rank, world_size)
    edits_on_every_rank(rank, world_size)
    no_room_on_one_rank(rank, world_size)
    diverging(rank, world_size)  # last: the group's later collectives fail after it


def test_gathered_buffers_in_shared_memory():
    """One launch: bucket buffers reused within a backward; edits every rank makes count once; a
    rank without room in /dev/shm gathers through the slots; ranks gathering into different
    shared buffers raise."""
    spawn(shared_gathers, 2, fresh=True)
