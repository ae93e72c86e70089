"""The offload engine: this rank's fp32 master weights and optimizer state live in a store (CPU
RAM or disk) and are stepped chunk by chunk.

    engine = OffloadEngine(OffloadSpec("nvme", nvme_path="/scratch/offload"), torch.optim.AdamW, defaults)
    engine.add(flat, hyper)            # a FlatGroup's shard: master read from its parameters
    engine.step(hypers, factors=[])    # every shard: read chunk -> step -> write back -> parameters

`ShardedOptimizer(..., offload=spec)` drives it; nothing else decides what moves where.

One step of a flat group's shard, chunk by chunk:

    store --read--> master, state chunk --+-- inner optimizer step (fp32, CPU) --> write back --> store
    gradient shard (16-bit or fp32, on the compute device) --> fp32 chunk --'           |
                                          parameters (their dtype, on the device) <-----'

The parts, one concern a module:

    engine.py       OffloadEngine: builds the store, and runs the step's pipeline over chunks and
                    flats (what is read, stepped and written when)
    chunk_step.py   ChunkStep: the inner optimizer on one chunk (torch's fused kernel, the one-pass
                    `cpu_adam` kernel or the optimizer's own step; gradient factors; scalar state)
    store_io.py     StoreIO: chunks in and out of the store (mapped pages or chunk buffers), and
                    the `Stepper` interface's state access
    device_link.py  _DeviceLink: gradient chunks to the CPU step, updated weights back to the
                    parameters (pinned staging and a side stream on CUDA)

- Disk store: a reader thread loads chunk i+1 and a writer thread writes chunk i-1 back while
  chunk i is stepped; `buffer_count` chunks in flight are all the RAM it costs. A chunk is its
  files' page-cache pages, mapped and stepped in place, not a copy ([Note: stepping on mapped
  pages] in store.py; `TRAINER_SHARD_NO_MMAP=1`, or a chunk size that is not a whole number of
  pages, reads and writes copies in `buffer_count` sets of chunk buffers instead).
- CUDA: gradients come to pinned staging buffers and updated parameters go back on a side
  stream, so host-device copies overlap the CPU step (see `_DeviceLink`). With `buffer_count`
  1 there is one staging slot, and the next chunk's gradient is copied after the step, not during it.
"""

import logging
import threading
import weakref
from dataclasses import dataclass

import torch

from ..constants import CHUNK_NUMEL
from .chunk_step import ChunkStep, _cpu_defaults, per_element_state
from .device_link import _DeviceLink, _param_views  # `_link` looks `_DeviceLink` up here (tests patch it)
from .store import CpuStore, DiskStore, bytes_needed
from .store_io import StoreIO
from .workers import Workers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OffloadSpec:
    """Where the shard lives and how it streams (the `offload_optimizer` section of the config)."""

    device: str  # "cpu" | "nvme"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4
    chunk_numel: int = CHUNK_NUMEL

    def __post_init__(self):
        if self.device not in ("cpu", "nvme"):
            raise ValueError(f"offload device must be 'cpu' or 'nvme', got {self.device!r}")
        if self.device == "nvme" and not self.nvme_path:
            raise ValueError("offload device 'nvme' needs nvme_path")
        if self.buffer_count < 1 or self.chunk_numel < 1:
            raise ValueError("buffer_count and chunk_numel must be at least 1")

    @classmethod
    def from_config(cls, config) -> "OffloadSpec | None":
        if config.offload_device == "none":
            return None
        return cls(config.offload_device, config.nvme_path, config.pin_memory, config.buffer_count)


@dataclass(frozen=True)
class _Carry:
    """What one flat's step leaves in flight for the next: [Note: reading across flats]."""

    read: object  # the future of the next flat's first chunk, or None
    slot: int  # the buffer set the next flat's first chunk uses
    writes: dict  # buffer set -> the future of its write-back


class OffloadEngine(ChunkStep, StoreIO):
    """This rank's shards in a store, stepped chunk by chunk; implements the `Stepper` interface
    (sharding/stepper.py). The chunk update is `ChunkStep`'s, the store traffic `StoreIO`'s."""

    def __init__(self, spec: OffloadSpec, optim_class, defaults: dict, *, rank: int = 0):
        self.spec = spec
        self.rank = rank
        self.optim_class = optim_class
        self.defaults = dict(defaults)
        self.state_names = per_element_state(optim_class, defaults)
        self.names = ("master", *self.state_names)
        self.flats = []
        self.sizes = {}  # flat index -> shard numel
        self.scalars = []  # per flat group: the optimizer's scalar state ("step"), None before step 1
        self.store = None
        self._param = torch.zeros(0)
        self._optim = optim_class([self._param], **_cpu_defaults(optim_class, defaults))
        self._links = {}
        self._io = None
        self._buffers = None  # disk store: `buffer_count` sets of chunk buffers, made at the first step
        self._grad_buffers = {}  # (slot, dtype) -> a chunk buffer for gradients read from a store
        self._param_buffers = {}  # (slot, dtype) -> a chunk of updated 16-bit parameters being written to one
        self._flusher = None  # disk store: the thread that starts the write-back of each chunk written

    # ---- building ----------------------------------------------------------------------------

    def add(self, flat, hyper: dict | None = None) -> None:
        """Take on a FlatGroup's shard: its master weights are read from the parameters."""
        index = len(self.sizes)
        self.flats.append(flat)
        self.sizes[index] = flat.layout.shard_numel
        self.scalars.append(None)
        self._open_store(index)
        self.refresh_master(index, flat)

    def _open_store(self, index: int) -> None:
        sizes = {f"{index}.{name}": self.sizes[index] for name in self.names}
        if self.store is None:
            if self.spec.device == "nvme":
                self.store = DiskStore(sizes, self.spec.nvme_path, rank=self.rank)
                self._io = Workers(max_workers=2, thread_name_prefix="trainer_shard-offload")
                self._flusher = Workers(max_workers=1, thread_name_prefix="trainer_shard-flush")
                logger.info("offload: %s bytes of shard state on disk in %s", f"{bytes_needed(sizes):,}", self.store.folder)
            else:
                self.store = CpuStore(sizes, pin_memory=self.spec.pin_memory)
            self._finalizer = weakref.finalize(self, _close, self.store, self._io, self._flusher)
        else:
            self.store.add(sizes)

    def close(self) -> None:
        """Free the store (a disk store deletes its files). Idempotent; also runs at exit."""
        if self.store is not None:
            self._finalizer()

    # ---- the step ----------------------------------------------------------------------------

    def _link(self, flat) -> "_DeviceLink":
        key = (flat.grad.device, flat.grad.dtype, flat.dtype)
        if key not in self._links:
            self._links[key] = _DeviceLink(*key, slots=self.spec.buffer_count, chunk_numel=self.spec.chunk_numel)
        return self._links[key]

    def step(self, hypers: list, factors=()) -> None:
        """One step of every shard, with its group's hyperparameters and the gradient factors.

        [Note: reading across flats] With the disk store, the first chunk of the next flat is read
        while the last chunk of this one is stepped, and writes still in flight carry over, so a
        model of many small flats (ZeRO-3: one per unit) keeps reading, stepping and writing at
        once instead of starting the pipeline afresh at each flat.
        """
        carry = None
        for index, (flat, hyper) in enumerate(zip(self.flats, hypers)):
            following = index + 1 if index + 1 < len(self.flats) else None
            carry = self._step_flat(index, flat, hyper, factors, carry, following)
        if carry is not None:
            for future in carry.writes.values():
                future.result()

    @torch.no_grad()
    def _step_flat(self, index: int, flat, hyper: dict, factors, carry=None, following=None) -> "_Carry | None":
        """One step of flat group `index`'s shard; the updated weights go into `flat`'s parameters.
        Disk store: `carry` is what the previous flat left in flight, and what this one leaves
        (with the first chunk of flat `following` read ahead) is returned; see [Note: reading across flats]."""
        group = self._optim.param_groups[0]
        group.update(_cpu_defaults(self.optim_class, hyper))
        link = self._link(flat)
        disk = isinstance(self.store, DiskStore)
        stored = flat.grad_stored  # ZeRO-3 with parameters on disk: so are the gradients
        plan = self._plan(index, flat, hyper, factors, link)
        new_scalars = None if plan.kernel is None else {"step": plan.step}
        if plan.one_pass and not (disk or link.cuda or stored) and self._step_in_place(index, flat, plan.one_pass):
            self.scalars[index] = new_scalars
            return None
        ranges = self._ranges(index)
        if not ranges:
            self.scalars[index] = new_scalars
            return carry
        link.begin()
        slots = self.spec.buffer_count
        # one buffer set: read, step and write one chunk after the other, and fetch the next chunk's
        # gradient after the step (on CUDA it comes into the staging slot the step is reading)
        prefetch = slots > 1
        first = carry.slot if carry is not None else 0

        def slot_of(i):
            return (first + i) % slots

        if disk:
            if not self._mapped():
                self._ensure_chunk_buffers()
            writes = carry.writes if carry is not None else {}
            if carry is not None and carry.read is not None:
                reads = {0: carry.read}
            else:
                if first in writes:
                    writes.pop(first).result()
                reads = {0: self._io.submit(self._read, index, *ranges[0], first)}
        ahead = None  # the following flat's first chunk, read ahead
        if not stored:
            link.fetch_grad(flat.grad[ranges[0][0] : ranges[0][1]], slot_of(0))
        for i, (start, end) in enumerate(ranges):
            slot = slot_of(i)
            if disk:
                if i not in reads:
                    reads[i] = self._io.submit(self._read, index, start, end, slot)
                chunk = reads.pop(i).result()
                if prefetch:
                    next_slot = slot_of(i + 1)
                    upcoming = self._upcoming(index, ranges, i, following)
                    if upcoming is not None:
                        if next_slot in writes:  # that buffer set is still being written back
                            writes.pop(next_slot).result()
                        future = self._io.submit(self._read, *upcoming, next_slot)
                        if upcoming[0] == index:
                            reads[i + 1] = future
                        else:
                            ahead = future
            else:
                chunk = {name: self.store.view(self._key(index, name), start, end) for name in self.names}
            if stored:  # read with the state chunk on the disk store's reader thread, else here
                link.fetch_grad(chunk.pop("grad") if disk else self._read_grad(flat, start, end, slot), slot)
            grad = link.take_raw(slot, end - start) if plan.one_pass else link.take_grad(slot, end - start, plan.factors)
            fetch_next = not stored and i + 1 < len(ranges)
            if fetch_next and prefetch:
                link.fetch_grad(flat.grad[ranges[i + 1][0] : ranges[i + 1][1]], slot_of(i + 1))
            staged = disk and flat.params_stored  # ZeRO-3, parameters on disk: written with the state, off this thread
            params = self._param_buffer(slot, flat.dtype, end - start) if staged else None
            scalars = self._update_chunk(index, flat, link, chunk, grad, (start, end, slot), plan, hyper, params)
            if fetch_next and not prefetch:  # one slot: only now is its staging buffer (`grad` on CUDA) free
                link.fetch_grad(flat.grad[ranges[i + 1][0] : ranges[i + 1][1]], slot_of(i + 1))
            new_scalars = new_scalars if plan.kernel is not None else scalars
            if staged:
                writes[slot] = self._io.submit(self._write, index, start, chunk, flat, params)
            elif disk:
                writes[slot] = self._io.submit(self._write, index, start, chunk)
            if disk and not prefetch:
                writes.pop(slot).result()
        link.end()
        self.scalars[index] = new_scalars
        if disk and prefetch:
            return _Carry(ahead, slot_of(len(ranges)), writes)
        if disk:
            for future in writes.values():
                future.result()
        return None

    def _upcoming(self, index: int, ranges: list, i: int, following) -> tuple | None:
        """(flat index, start, end) of the chunk read after chunk `i` of flat `index`: its next
        one, else the first of flat `following` (None when there is none)."""
        if i + 1 < len(ranges):
            return (index, *ranges[i + 1])
        if following is not None and self.sizes[following] > 0:
            return (following, *self._ranges(following)[0])
        return None

    def _step_in_place(self, index: int, flat, args: dict) -> bool:
        """The whole shard in one `cpu_adam` call, when all of it is in RAM and the parameters are
        plain CPU memory (False, and nothing done, where they are not)."""
        numel = self.sizes[index]
        targets = _param_views(flat, 0, numel)
        if targets is None:
            return False
        state = {name: self.store.view(self._key(index, name), 0, numel) for name in self.names}
        self._one_pass_chunk(state, flat.grad, targets, args)
        return True


def _close(store, io, flusher=None) -> None:
    for pool in (io, flusher):
        if pool is not None:  # a finalizer the collector ran on one of the pool's own threads cannot join it
            pool.shutdown(wait=threading.current_thread() not in getattr(pool, "_threads", ()))
    store.close()
