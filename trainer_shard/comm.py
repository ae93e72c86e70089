"""The collectives trainer_shard uses, behind one thin seam.

Every function takes the process group (None: the default group) and works without
torch.distributed at all on one process, so the optimizer runs unchanged in a plain loop.
gloo and NCCL both need equal-sized chunks for reduce-scatter and all-gather: callers pad
(see `sharding.partition`).

[Note: collective calls] Every function here is a collective: all ranks of the group must call
it, in the same order, with tensors of the same size, or the job hangs.

Each wait is wrapped in the registered wait tracker, `tracker(name)` (a context manager): faults.py
registers one when it is imported, so that the fault watch can say which collective a rank waits
in (see [Note: fault watch]); without it, nothing is tracked. This module knows nothing of faults.
"""

import contextlib
import itertools
import os
import pickle
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from . import shm_comm

_wait_tracker = contextlib.nullcontext


def set_wait_tracker(tracker) -> None:
    """Wrap every wait in a collective in `tracker(name)` from now on (None: no tracking). Looked
    up at each wait, so it takes effect whenever it is set, before or after this module's use."""
    global _wait_tracker
    _wait_tracker = tracker or contextlib.nullcontext


def _waiting(name: str):
    return _wait_tracker(name)


def is_distributed(group=None) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank_and_size(group=None) -> tuple:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


# torch 2.10 renamed the tensor collectives (the old names warn).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Done:
    """The handle of a collective that had nothing to do (one process)."""

    def wait(self):
        return None


def _uses_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def shared_memory_group(group=None):
    """The group's shared-memory transport where its collectives of CPU tensors go through one,
    else None: see [Note: shared-memory collectives] in shm_comm.py. Collective the first time
    for a group (as its first collective is)."""
    if not is_distributed(group) or not _uses_gloo(group):
        return None
    return shm_comm.for_group(group)


def _shared_memory(group, tensor: torch.Tensor):
    """The group's shared-memory transport for `tensor`'s collectives, or None."""
    return shared_memory_group(group) if tensor.device.type == "cpu" else None


class _Future:
    """The handle of a collective running on a shared-memory group's thread."""

    def __init__(self, future, name: str):
        self.future, self.name = future, name

    def wait(self):
        with _waiting(self.name):
            self.future.result()


class _Then:
    """A handle that runs `finish` once the collective it wraps has completed."""

    def __init__(self, work, finish, name: str):
        self.work, self.finish, self.done, self.name = work, finish, False, name

    def wait(self):
        if not self.done:
            with _waiting(self.name):
                self.work.wait()
            self.finish()
            self.done = True


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """Sum `input` over ranks; rank r receives chunk r into `output`. `input` may be overwritten.

    CPU ranks of one host use shared memory ([Note: shared-memory collectives] in shm_comm.py).
    Otherwise on gloo, whose reduce-scatter and all-reduce both move the whole tensor through every rank,
    each rank sends chunk j of its `input` straight to rank j and receives every peer's chunk r
    (point to point), then sums them in rank order: the bytes an optimal reduce-scatter moves.
    Measured by `bench/gloo_collectives.py` (2 ranks, medians of three runs): 16 MB 12.3 ms
    against 19.5 ms for an all-reduce and a slice and 20.8 ms for gloo's own reduce-scatter;
    64 MB 78.5 against 88.2 and 115.9 ms. NCCL gets the real reduce-scatter. See [Note:
    collective calls].
    """
    if not is_distributed(group):
        output.copy_(input)
        return _Done() if async_op else None
    with record_function("trainer_shard::reduce_scatter"):
        shm = _shared_memory(group, input)
        if shm is not None:
            handle = _Future(shm.submit(shm.reduce_scatter, output, input), "reduce_scatter")
        elif _uses_gloo(group):
            rank, world, n = dist.get_rank(group), dist.get_world_size(group), output.numel()
            received = {peer: torch.empty_like(output) for peer in range(world) if peer != rank}
            works = []
            for peer, buffer in received.items():
                works.append(dist.isend(input[peer * n : (peer + 1) * n], _global(group, peer), group=group))
                works.append(dist.irecv(buffer, _global(group, peer), group=group))

            def finish():
                parts = [input[rank * n : (rank + 1) * n] if peer == rank else received[peer] for peer in range(world)]
                shm_comm.sum_in_rank_order(parts, output)
                received.clear()

            handle = _Then(_All(works, "reduce_scatter"), finish, "reduce_scatter")
        else:
            work = _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True)
            handle = _Then(work, lambda: None, "reduce_scatter")
    if not async_op:
        handle.wait()
        return None
    return handle


def _global(group, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group else rank


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False, shared=None):
    """Concatenate every rank's `input` into `output`; `input` may be this rank's chunk of
    `output` itself (in place). See [Note: collective calls]. `shared`: `output` is a storage of
    the group's shared-memory transport, and this its token (`GatherPool.gather_token`).

    CPU ranks of one host use shared memory ([Note: shared-memory collectives] in shm_comm.py).
    Otherwise on gloo, all-gather measured slower than even an all-reduce of the full output (2 ranks,
    64 MB: 72 ms against 48 ms), while one broadcast per chunk took 22 ms; so there each rank
    broadcasts its chunk straight into everyone's `output`, measured faster again than sending
    it point to point (`bench/gloo_collectives.py`, 2 ranks, 64 MB: 18-23 ms against 28-31 ms).
    NCCL gets the real all-gather.
    """
    rank, n = (dist.get_rank(group) if is_distributed(group) else 0), input.numel()
    if shared is not None:  # this rank writes its part on the group's thread: [Note: gathered in shared memory]
        shm = shm_comm.for_group(group)
        with record_function("trainer_shard::all_gather"):
            handle = _Future(shm.submit(shm.all_gather_shared, output, input, shared), "all_gather")
        return handle if async_op else handle.wait()
    mine = output[rank * n : (rank + 1) * n]
    if mine.data_ptr() != input.data_ptr():
        mine.copy_(input)
    if not is_distributed(group):
        return _Done() if async_op else None
    with record_function("trainer_shard::all_gather"):
        if not _uses_gloo(group):
            handle = _Then(_all_gather(output, mine, group=group, async_op=True), lambda: None, "all_gather")
            return handle if async_op else handle.wait()
        shm = _shared_memory(group, output)
        if shm is not None:
            handle = _Future(shm.submit(shm.all_gather, output, mine), "all_gather")
            return handle if async_op else handle.wait()
        world = dist.get_world_size(group)
        works = [dist.broadcast(output[i * n : (i + 1) * n], src=_global(group, i), group=group, async_op=True)
                 for i in range(world)]  # fmt: skip
        handle = _All(works, "all_gather")
    if not async_op:
        handle.wait()
        return None
    return handle


class _All:
    """The handle of several works, all waited for."""

    def __init__(self, works, name: str):
        self.works, self.name = works, name

    def wait(self):
        with _waiting(self.name):
            for work in self.works:
                work.wait()


def all_reduce(tensor: torch.Tensor, op=None, group=None) -> torch.Tensor:
    """In place; SUM unless `op` says otherwise. See [Note: collective calls]."""
    if is_distributed(group):
        with record_function("trainer_shard::all_reduce"), _waiting("all_reduce"):
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op is None else op, group=group)
    return tensor


def broadcast(tensor: torch.Tensor, src_rank: int = 0, group=None) -> torch.Tensor:
    """`src_rank` is the rank within `group`. See [Note: collective calls]."""
    if is_distributed(group):
        with record_function("trainer_shard::broadcast"), _waiting("broadcast"):
            dist.broadcast(tensor, src=_global(group, src_rank), group=group)
    return tensor


def all_gather_objects(obj, group=None) -> list:
    """Every rank's picklable `obj`, in rank order. See [Note: collective calls]."""
    if not is_distributed(group):
        return [obj]
    out = [None] * dist.get_world_size(group)
    with _waiting("all_gather_object"):
        dist.all_gather_object(out, obj, group=group)
    return out


def barrier(group=None) -> None:
    """Wait for every rank of `group`. See [Note: collective calls]."""
    if is_distributed(group):
        with _waiting("barrier"):
            dist.barrier(group=group)


_shared = itertools.count()


def share_from_rank_zero(value, timeout: float):
    """Rank 0's picklable `value` on every rank, the others waiting for it up to `timeout` seconds
    rather than the process group's timeout: for what rank 0 takes long to compute (the planner's
    memory probe) while the others wait. Passed through the rendezvous store, not the group's
    backend. Every rank of the default group calls it, in the same order."""
    if not is_distributed():
        return value
    store = dist.distributed_c10d._get_default_store()
    # a restarted job (torchrun --max_restarts) finds the store as the last attempt left it
    key = f"trainer_shard/shared/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_shared)}"
    if dist.get_rank() == 0:
        store.set(key, pickle.dumps(value))
        return value
    with _waiting("waiting for rank 0's result"):
        store.wait([key], timedelta(seconds=timeout))
    return pickle.loads(store.get(key))
