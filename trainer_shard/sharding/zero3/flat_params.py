"""One flat buffer of a unit's sharded parameters: the gather side (buffer, shard, the parameters'
views of it) here, the gradient side in `grad_shard.py`.

[Note: free and re-gather] A flat buffer keeps one storage for its life; every tensor autograd
saved as a view of a parameter (a transposed weight) points at it. Freeing leaves that storage
empty (0 bytes); gathering gives it memory again and all-gathers the shards into it, so what
backward reads through a saved view is the refilled data. The memory comes from a `GatherPool`
and goes back to it: a swap of data pointers between storages, so after the first step
gathering allocates nothing (without the private swap, `resize_` to full size and to 0, as FSDP
does). Never replace the buffer's storage: saved views would keep the old one.

[Note: a parameter between uses] While its unit is not gathered a sharded parameter's `.data` is
an empty tensor of its dtype and device (DeepSpeed's way; its shape is kept in `shapes`), never a
full-shape view of the freed storage: reading it cannot touch freed memory. Gathering points
`.data` back at its view of the buffer (`expose`), releasing at the empty tensor (`hide`);
`p.data = ...` keeps the parameter's own version counter and its autograd identity, so the leaf
that forward saved is the one backward finds, refilled. Each sharded parameter carries its whole
shape and size as `ds_shape` and `ds_numel`, the names DeepSpeed gives them, which PEFT and
transformers read when `numel()` is 0 (`full_numel`). A read of `module.weight` through the
module while the unit is not gathered goes through `access.ShardedParameters`: see there.
"""

import torch
from torch.autograd.profiler import record_function

from ... import comm
from ...memory import release_freed_memory
from ..partition import plan_layout
from .grad_shard import GradShard
from .unit import UnitState


def full_numel(param) -> int:
    """A parameter's elements, sharded or not (a sharded one is empty between uses)."""
    return getattr(param, "ds_numel", None) or param.numel()


class FlatParams(GradShard):
    """One flat buffer of a unit's sharded parameters (those of one param group, all trainable
    or all frozen): the buffer (with memory only while gathered), this rank's shard of it, and,
    for trainable ones, the gradient shard and the optimizer's view of the shard (`GradShard`).
    Also what `GradReducer` needs of a flat group: `layout`, `params`, `buffer` (its device),
    `dtype` and `add_to_grad`."""

    def __init__(self, params: list, names: list, key, rank: int, world_size: int, group, pool, store=None,
                 name: str = "", fetch=None, device=None):  # fmt: skip
        self.params, self.names, self.key = params, names, key
        self.rank, self.group, self.pool = rank, group, pool
        self.trainable = params[0].requires_grad
        self.shapes = [p.shape for p in params]
        numels = [p.numel() for p in params]
        # one bucket: the unit's gradients are reduced once its backward is done
        self.layout = plan_layout(numels, world_size, bucket_numel=sum(numels), order=range(len(params)))
        self.bucket = self.layout.buckets[0]
        self.segments = self.layout.segments(rank)  # which elements of which parameter the shard holds
        first = params[0]
        device = device if first.device.type == "meta" else first.device
        # read slice by slice from the files ([Note: meta-device model]): the buffer is not filled
        sliced = getattr(fetch, "read_slice", None) is not None and all(p.device.type == "meta" for p in params)
        self.buffer = (torch.empty if sliced else torch.zeros)(self.layout.total_numel, dtype=first.dtype, device=device)
        self.views = [self.buffer[s.offset : s.offset + s.numel].view(shape)
                      for s, shape in zip(self.layout.slots, self.shapes)]  # fmt: skip
        self.empty = torch.empty(0, dtype=first.dtype, device=device)  # every parameter's `.data` between uses
        self.store, self.store_name = store, name
        if sliced:
            self._fill_slice(fetch, device)
        else:
            self._fill(fetch, device)  # (a meta parameter swapped for a real one: attributes after this)
        for p, shape in zip(params, self.shapes):  # the names DeepSpeed gives them, which PEFT and others read
            p.ds_shape, p.ds_numel = shape, shape.numel()
        self._init_grad_side(device)
        self.nbytes = self.buffer.numel() * self.buffer.element_size()
        self.buffer.untyped_storage().resize_(0)  # from now on its memory comes from the pool
        self.hide()
        self.state = UnitState.SHARDED  # see [Note: unit lifecycle]; moved only by the methods below
        self.slot = None  # the pool's token while the buffer has memory (any state but SHARDED)
        self.pending = None  # GATHERING: the handle of the asynchronous all-gather
        self.loading = None  # LOADED: the future of this rank's shard being read from disk, if it is

    @torch.no_grad()
    def _fill_slice(self, fetch, device) -> None:
        """[Note: meta-device model] This rank's shard read straight from the files, each parameter's
        elements in its range and nothing else (every rank reads the same files: no broadcast);
        the padding zero."""
        lo, hi = self.bucket.slice_range(self.rank)
        shard = torch.zeros(hi - lo, dtype=self.buffer.dtype)  # in CPU memory: read into, then moved
        for p, slot in zip(self.params, self.layout.slots):
            start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if start < end:
                fetch.read_slice(p, start - slot.offset, shard[start - lo : end - lo])
            self._make_real(p, device)
        shard = shard.to(device)
        if self.store is None:
            self.shard = shard
        else:  # [Note: parameter offload]
            self.store.write(self.store_name, 0, shard)
            self.shard = None if self.store.on_disk(self.store_name) else self.store.tensor(self.store_name)
        # what the heap keeps of this unit's allocations, handed back before the next: t5-large, 2
        # ranks, a rank's load peaked 0.4-0.6 GiB above its shards in some runs without this, 0.06
        # with it, for 0.1-0.2 s a load (bench/results/load_rss.md)
        release_freed_memory()

    @staticmethod
    def _make_real(p, device) -> None:
        """A real (empty) parameter in place of the meta one, with a version counter of its own (a
        Parameter made of a view of the buffer would share the buffer's, and each gather into it
        would then fail backward's check of the tensors forward saved)."""
        real = torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=device))
        real.requires_grad_(p.requires_grad)
        torch.utils.swap_tensors(p, real)

    @torch.no_grad()
    def _fill(self, fetch, device) -> None:
        """The buffer <- the parameters (rank 0's), this rank's slice kept as the shard."""
        for p, view in zip(self.params, self.views):
            if p.device.type == "meta":  # [Note: meta-device model] read now, a tensor at a time
                fetch(p, view)
                self._make_real(p, device)
            else:
                view.copy_(p.detach())
        comm.broadcast(self.buffer, 0, self.group)  # every rank starts from rank 0's weights
        mine = self._mine()
        if self.store is None:
            self.shard = mine.clone()
        else:  # [Note: parameter offload]
            self.store.write(self.store_name, 0, mine)
            self.shard = None if self.store.on_disk(self.store_name) else self.store.tensor(self.store_name)

    @property
    def dtype(self):
        return self.buffer.dtype

    @property
    def params_stored(self) -> bool:
        """This rank's parameter shard is on disk (the offload engine writes it there)."""
        return self.shard is None

    def expose(self) -> None:
        """The parameters <- their views of the gathered buffer: see [Note: a parameter between uses]."""
        for p, view in zip(self.params, self.views):
            p.data = view

    def hide(self) -> None:
        for p in self.params:
            p.data = self.empty

    @torch.no_grad()
    def write_shard(self, start: int, values: torch.Tensor, non_blocking: bool = False) -> None:
        """This rank's parameters, shard elements [start, start + len(values)) <- `values` (cast).
        A read ahead of the old shard (`load`, not gathered yet) is dropped: the next gather reads
        the new one."""
        if self.state in (UnitState.LOADED, UnitState.GATHERING):
            self.release()
        if self.shard is None:
            self.store.write(self.store_name, start, values.to(self.dtype))
            return
        self.shard[start : start + values.numel()].copy_(values, non_blocking=non_blocking)

    @torch.no_grad()
    def read_shard(self, start: int, out: torch.Tensor) -> torch.Tensor:
        if self.shard is None:
            return out.copy_(self.store.read(self.store_name, start, torch.empty(out.numel(), dtype=self.dtype)))
        return out.copy_(self.shard[start : start + out.numel()])

    @torch.no_grad()
    def gather_params(self) -> None:
        """After the step: the fp32 master cast into the shard (offloaded: the engine wrote it).
        Not collective: the next forward gathers."""
        if self.master is not None:
            self.shard.copy_(self.master)
            self._master_version = self.shard_param._version

    # -- see [Note: free and re-gather]
    def load(self) -> None:
        """Give the buffer memory and start reading this rank's shard from disk into its slice
        (on the store's reader thread), ahead of the gather. Not collective."""
        if self.state is not UnitState.SHARDED:
            return
        # shared between the ranks where the gather is all that writes it: [Note: gathered in shared memory]
        self.slot = self.pool.attach(self.buffer, self.nbytes, shared=self.shard is not None)
        self.state = UnitState.LOADED
        if self.shard is None:
            self.loading = self.store.read_async(self.store_name, 0, self._mine())

    def _mine(self) -> torch.Tensor:
        return self.buffer[slice(*self.bucket.slice_range(self.rank))]

    def start_gather(self) -> None:
        """Refill the flat buffer from every rank's shard, asynchronously. Collective."""
        if self.state in (UnitState.GATHERING, UnitState.GATHERED):
            return
        if self.master is not None and self.shard_param._version != self._master_version:
            with torch.no_grad():
                self.shard.copy_(self.master)  # the step's update, in the parameters' dtype
            self._master_version = self.shard_param._version
        self.load()
        if self.loading is not None:
            with record_function("trainer_shard::zero3_param_read_wait"):
                self.loading.result()
            self.loading = None
        with record_function("trainer_shard::zero3_all_gather"):
            mine = self._mine() if self.shard is None else self.shard
            self.pending = comm.all_gather(self.buffer, mine, self.group, async_op=True,
                                           shared=self.pool.gather_token(self.slot, self.nbytes))  # fmt: skip
        self.state = UnitState.GATHERING

    def wait(self) -> None:
        if self.state is UnitState.GATHERING:
            self.pending.wait()
            self.pending = None
            self.state = UnitState.GATHERED
            self.expose()

    def release(self, drop: bool = False) -> None:
        """Free the flat buffer (this rank's shard stays); with `drop`, its memory is let go, not
        kept in the pool. Not collective."""
        if self.pending is not None:  # a prefetch never used: let it land first
            self.pending.wait()
            self.pending = None
        if self.loading is not None:  # a read ahead never used: the same
            self.loading.result()
            self.loading = None
        if self.state is UnitState.GATHERED:
            self.hide()
        if self.state is not UnitState.SHARDED:
            self.pool.detach(self.buffer, self.slot, drop)
            self.slot = None
        self.state = UnitState.SHARDED

    def make_private(self) -> None:
        """Gathered, in this rank's own memory (before edits every rank makes, which on memory
        the ranks share would be made once a rank)."""
        self.wait()
        self.slot = self.pool.privatize(self.buffer, self.slot)

    @torch.no_grad()
    def write_back(self) -> None:
        """Shard (and fp32 master) <- this rank's slice of the gathered buffer, edited in place."""
        if self.shard is None:
            self.store.write(self.store_name, 0, self._mine())
        else:
            self.shard.copy_(self._mine())
        if self.master is not None:
            self.master.copy_(self.shard)
            self._master_version = self.shard_param._version
        self.edited = True

    @property
    def shard_bytes(self) -> int:
        """Bytes of this rank's parameter shard in memory (0 on disk)."""
        return 0 if self.shard is None else self.shard.numel() * self.shard.element_size()
