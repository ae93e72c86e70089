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

- The inner optimizer is the run's own class and hyperparameters; Adam and AdamW call torch's
  fused CPU kernel directly (`torch._fused_adamw_`, what `AdamW(fused=True)` runs, without the
  per-call bookkeeping of `torch.optim`, which on 1 M-element chunks cost 30% of the step). Every elementwise optimizer is stepped
  chunk by chunk with the same result as stepping the whole shard at once: its per-element
  state ("exp_avg", "momentum_buffer"...) is found by stepping a probe tensor once, and its
  scalar state ("step") is kept once per flat group and handed to every chunk.
- Gradient factors (1/loss scale, the clipping coefficient) are never applied to the 16-bit
  gradient shard in its own precision. The fused kernel takes their product as its `grad_scale`
  (it divides each gradient by it as it reads it), so clipping costs no pass over the shard of
  its own; other optimizers get them multiplied into each fp32 chunk, in order.
- One pass (`cpu_adam.py`): with Adam/AdamW, a compiled kernel reads each chunk's gradient in its
  own dtype and writes the updated weights straight into the parameters (or the staging buffer
  they go out of), where the path above makes three passes (upcast, torch's kernel, cast); with
  the state, the gradients and the parameters all in RAM, the whole shard in one call. The same
  bits as the path above, which runs where the kernel cannot be built.
- Disk store: a reader thread loads chunk i+1 and a writer thread writes chunk i-1 back while
  chunk i is stepped; `buffer_count` chunks in flight are all the RAM it costs. A chunk is its
  files' page-cache pages, mapped and stepped in place, not a copy ([Note: stepping on mapped
  pages] in store.py; `TRAINER_SHARD_NO_MMAP=1`, or a chunk size that is not a whole number of
  pages, reads and writes copies in `buffer_count` sets of chunk buffers instead).
- CUDA: gradients come to pinned staging buffers and updated parameters go back on a side
  stream, so host-device copies overlap the CPU step (see `_DeviceLink`). With `buffer_count`
  1 there is one staging slot, and the next chunk's gradient is copied after the step, not during it.
"""

import inspect
import logging
import math
import mmap
import os
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..constants import CHUNK_NUMEL
from . import cpu_adam
from .store import CpuStore, DiskStore, bytes_needed

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


_FUSED_ON_CPU = ("Adam", "AdamW")
NO_MMAP_ENV = "TRAINER_SHARD_NO_MMAP"  # "1": the disk store's chunks are read and written as copies
_MAPS = "maps"  # a mapped chunk's entry: the mappings to give back once it is written


def per_element_state(optim_class, defaults: dict) -> list:
    """The names of the state entries `optim_class` keeps one value per element of (probed).
    `defaults` may be a built optimizer's (`ShardedOptimizer.defaults`): what its constructor
    does not take ("decoupled_weight_decay" of AdamW) is left out."""
    probe = torch.zeros(2, requires_grad=True)
    optim = optim_class([probe], **_accepted(optim_class, _cpu_defaults(optim_class, defaults)))
    probe.grad = torch.zeros(2)
    optim.step()
    return sorted(k for k, v in optim.state[probe].items() if k != "step" and torch.is_tensor(v) and v.shape == probe.shape)


def _accepted(optim_class, kwargs: dict) -> dict:
    """The entries of `kwargs` that `optim_class`'s constructor takes (all, if it takes **kwargs)."""
    parameters = inspect.signature(optim_class.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in parameters}


def _fused_kernel(optim_class, hyper: dict):
    """torch's fused CPU Adam/AdamW kernel for this optimizer and settings, or None."""
    if optim_class not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    if hyper.get("capturable") or hyper.get("differentiable") or torch.is_tensor(hyper.get("lr")):
        return None
    decoupled = optim_class is torch.optim.AdamW or bool(hyper.get("decoupled_weight_decay", False))
    return torch._fused_adamw_ if decoupled else torch._fused_adam_


def _grad_scale(factors) -> torch.Tensor | None:
    """What the fused kernel divides the gradients by to apply `factors`: 1 / their product.

    None (the factors are then multiplied into each chunk) when there are none, or when the
    product is 0 or its inverse overflows. The kernel writes the divided gradient back into the
    chunk it read, as clipping in place does to `.grad` without offload."""
    if not factors:
        return None
    product = math.prod(float(factor) for factor in factors)
    if product == 0.0 or not abs(1.0 / product) <= torch.finfo(torch.float32).max:  # also NaN, inf
        return None
    return torch.tensor(1.0 / product, dtype=torch.float32)


_ONE_PASS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _one_pass_ok(flat) -> bool:
    """Whether `cpu_adam`'s one-pass kernel can step `flat`'s shard (the kernel is built, dtypes it takes)."""
    return flat.grad.dtype in _ONE_PASS_DTYPES and flat.dtype in _ONE_PASS_DTYPES and cpu_adam.available()


def _param_views(flat, start: int, numel: int) -> list | None:
    """`flat`'s parameters for shard elements [start, start + numel) as (offset, contiguous CPU
    tensor) pieces to write updated weights straight into; None where they are not plain CPU
    memory (on disk, or a flat of another kind): the caller stages them and calls `write_shard`."""
    if flat.params_stored:
        return None
    if hasattr(flat, "_buffer_pieces"):  # FlatGroup: this rank's slices of the flat buffer, bucket by bucket
        pieces = list(flat._buffer_pieces(start, numel))
    elif getattr(flat, "shard", None) is not None:  # ZeRO-3: the shard itself
        pieces = [(0, flat.shard[start : start + numel])]
    else:
        return None
    plain = all(t.device.type == "cpu" and t.is_contiguous() for _, t in pieces)
    return pieces if plain and sum(t.numel() for _, t in pieces) == numel else None


def _cpu_defaults(optim_class, hyper: dict) -> dict:
    """`hyper` for CPU fp32 tensors: Adam and AdamW on torch's fused kernel."""
    out = {k: v for k, v in hyper.items() if k != "params"}
    if optim_class.__name__ in _FUSED_ON_CPU:
        out.update(fused=True, foreach=None)
    return out


@dataclass(frozen=True)
class _Carry:
    """What one flat's step leaves in flight for the next: [Note: reading across flats]."""

    read: object  # the future of the next flat's first chunk, or None
    slot: int  # the buffer set the next flat's first chunk uses
    writes: dict  # buffer set -> the future of its write-back


@dataclass(frozen=True)
class _StepPlan:
    """How one step of a flat group runs (`OffloadEngine._plan`)."""

    kernel: object  # torch's fused Adam/AdamW kernel, or None: the optimizer's own step, a chunk at a time
    grad_scale: torch.Tensor | None  # what the kernel divides the gradients by (the factors' product)
    factors: tuple  # the gradient factors left to multiply into each fp32 chunk
    fresh: bool  # step 1: the moments start from zero
    step: torch.Tensor | None  # the step count after this step, for the kernel
    one_pass: dict | None  # `cpu_adam.step`'s arguments, where the one-pass kernel steps


class OffloadEngine:
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
                self._io = ThreadPoolExecutor(max_workers=2, thread_name_prefix="trainer_shard-offload")
                self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer_shard-flush")
                logger.info("offload: %s bytes of shard state on disk in %s", f"{bytes_needed(sizes):,}", self.store.folder)
            else:
                self.store = CpuStore(sizes, pin_memory=self.spec.pin_memory)
            self._finalizer = weakref.finalize(self, _close, self.store, self._io, self._flusher)
        else:
            self.store.add(sizes)

    def _key(self, index: int, name: str) -> str:
        return f"{index}.{name}"

    # ---- the step ----------------------------------------------------------------------------

    def _ranges(self, index: int) -> list:
        numel, chunk = self.sizes[index], self.spec.chunk_numel
        return [(s, min(s + chunk, numel)) for s in range(0, numel, chunk)]

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

    def _plan(self, index: int, flat, hyper: dict, factors, link) -> "_StepPlan":
        """How this step of flat group `index` runs: which kernel, what it does with `factors`."""
        kernel = _fused_kernel(self.optim_class, hyper)
        if kernel is None:
            return _StepPlan(None, None, tuple(factors), False, None, None)
        grad_scale = _grad_scale(factors)
        if grad_scale is not None:
            factors = ()  # the kernel applies them
        fresh = self.scalars[index] is None
        step = torch.zeros((), dtype=torch.float32) if fresh else self.scalars[index]["step"].clone()
        step += 1  # once per optimizer step, as torch.optim does before its fused call
        one_pass = None
        if not factors and _one_pass_ok(flat):
            # an fp32 gradient shard is left divided by grad_scale, as torch's kernel leaves it (see `_grad_scale`)
            write_grad = flat.grad.dtype == torch.float32 and not link.cuda and not flat.grad_stored
            one_pass = self._one_pass_args(hyper, kernel, step, fresh, grad_scale, write_grad)
        return _StepPlan(kernel, grad_scale, tuple(factors), fresh, step, one_pass)

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

    def _update_chunk(self, index: int, flat, link, chunk: dict, grad, where: tuple, plan: "_StepPlan", hyper: dict,
                      params) -> dict | None:
        """Step one chunk and write its weights into the parameters, or into `params` (a staging
        buffer) when given. Returns the optimizer's scalar state where the optimizer's own step ran."""
        start, end, slot = where
        if plan.one_pass:
            targets = [(0, params)] if params is not None else link.param_targets(flat, start, end - start, slot)
            self._one_pass_chunk(chunk, grad, targets, plan.one_pass)
            if params is None:
                link.params_written(flat, start, end - start, slot)
            return None
        scalars = None
        if plan.kernel is not None:
            self._fused_chunk(plan.kernel, chunk, grad, plan.step, hyper, plan.fresh, plan.grad_scale)
        else:
            scalars = self._step_chunk(index, chunk, grad)
        if params is not None:
            params.copy_(chunk["master"])
        else:
            link.put_params(flat, start, chunk["master"], slot)
        return scalars

    def _param_buffer(self, slot: int, dtype, numel: int) -> torch.Tensor:
        key = (slot, dtype)
        if key not in self._param_buffers:
            self._param_buffers[key] = torch.empty(self.spec.chunk_numel, dtype=dtype)
        return self._param_buffers[key][:numel]

    def _one_pass_args(self, hyper: dict, kernel, step: torch.Tensor, fresh: bool, grad_scale, write_grad: bool) -> dict:
        """`cpu_adam.step`'s keyword arguments for this step: what `_fused_chunk` gives torch's kernel."""
        betas = hyper.get("betas", self.defaults.get("betas", (0.9, 0.999)))
        amsgrad = bool(hyper.get("amsgrad", False))
        return dict(
            step=float(step), lr=float(hyper["lr"]), beta1=float(betas[0]), beta2=float(betas[1]),
            weight_decay=float(hyper.get("weight_decay", 0.0)), eps=float(hyper.get("eps", 1e-8)), amsgrad=amsgrad,
            maximize=bool(hyper.get("maximize", False)), decoupled=kernel is torch._fused_adamw_,
            grad_scale=None if grad_scale is None else float(grad_scale), fresh=fresh, write_grad=write_grad,
            segment=self.spec.chunk_numel,  # a call over several chunks computes what one call a chunk would
        )  # fmt: skip

    def _one_pass_chunk(self, chunk: dict, grad: torch.Tensor, targets: list, args: dict) -> None:
        """A chunk (or the whole shard) through `cpu_adam` in one call, with the bits torch's kernel
        gives each chunk: the updated weights go into `targets`, (offset, tensor) pieces covering
        it (the parameters, or a staging buffer)."""
        cpu_adam.step(chunk["master"], chunk["exp_avg"], chunk["exp_avg_sq"], grad, out=targets,
                      max_exp_avg_sq=chunk.get("max_exp_avg_sq"), **args)  # fmt: skip

    def _fused_chunk(self, kernel, chunk: dict, grad: torch.Tensor, step: torch.Tensor, hyper: dict, fresh: bool,
                     grad_scale: torch.Tensor | None) -> None:
        if fresh:  # step 1 starts from zero moments, whatever the store holds
            for name in self.state_names:
                chunk[name].zero_()
        betas = hyper.get("betas", self.defaults.get("betas", (0.9, 0.999)))
        amsgrad = bool(hyper.get("amsgrad", False))
        kernel(
            [chunk["master"]], [grad], [chunk["exp_avg"]], [chunk["exp_avg_sq"]],
            [chunk["max_exp_avg_sq"]] if amsgrad else [], [step],
            amsgrad=amsgrad, lr=float(hyper["lr"]), beta1=float(betas[0]), beta2=float(betas[1]),
            weight_decay=float(hyper.get("weight_decay", 0.0)), eps=float(hyper.get("eps", 1e-8)),
            maximize=bool(hyper.get("maximize", False)), grad_scale=grad_scale,
        )  # fmt: skip

    def _step_chunk(self, index: int, chunk: dict, grad: torch.Tensor) -> dict:
        param = self._param
        param.data = chunk["master"]
        param.grad = grad
        state = self._optim.state[param]
        state.clear()
        if self.scalars[index] is not None:  # later steps: the stored state, in place
            state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in self.scalars[index].items()})
            state.update({name: chunk[name] for name in self.state_names})
        self._optim.step()
        if self.scalars[index] is None:  # step 1: the optimizer made its state; keep it
            for name in self.state_names:
                chunk[name].copy_(state[name])
        scalars = {k: v for k, v in state.items() if k not in self.state_names}
        param.grad = None
        param.data = torch.zeros(0)
        state.clear()
        return scalars

    def _ensure_chunk_buffers(self) -> None:
        if self._buffers is None:
            n = self.spec.chunk_numel
            self._buffers = [{name: torch.empty(n) for name in self.names} for _ in range(self.spec.buffer_count)]

    def _mapped(self) -> bool:
        """Whether the disk store's chunks are stepped on their mapped pages (every chunk starts
        on a page boundary of the store's fp32 files, and `TRAINER_SHARD_NO_MMAP` is not set)."""
        aligned = self.spec.chunk_numel * 4 % mmap.ALLOCATIONGRANULARITY == 0
        return aligned and os.environ.get(NO_MMAP_ENV) != "1"

    def _read(self, index: int, start: int, end: int, slot: int) -> dict:
        if self._mapped():
            mapped = {name: self.store.map(self._key(index, name), start, end - start) for name in self.names}
            chunk = {name: tensor for name, (tensor, _) in mapped.items()}
            chunk[_MAPS] = [mapping for _, mapping in mapped.values()]
        else:
            buffers = self._buffers[slot]
            chunk = {name: self.store.read(self._key(index, name), start, buffers[name][: end - start])
                     for name in self.names}  # fmt: skip
        if self.flats[index].grad_stored:
            chunk["grad"] = self._read_grad(self.flats[index], start, end, slot)
        return chunk

    def _flush(self, index: int, start: int, numel: int) -> None:
        for name in self.names:
            self.store.flush(self._key(index, name), start, numel)

    def _read_grad(self, flat, start: int, end: int, slot: int) -> torch.Tensor:
        """A gradient chunk of a flat that keeps its gradients in its own store (ZeRO-3, on disk)."""
        key = (slot, flat.grad.dtype)
        if key not in self._grad_buffers:
            self._grad_buffers[key] = torch.empty(self.spec.chunk_numel, dtype=flat.grad.dtype)
        return flat.read_grad(start, self._grad_buffers[key][: end - start])

    def _write(self, index: int, start: int, chunk: dict, flat=None, params=None) -> None:
        """Chunk `chunk` of flat `index` back to the store, and its write-back to the disk started:
        see [Note: stepping on mapped pages] in store.py."""
        maps = chunk.pop(_MAPS, None)
        numel = chunk[self.names[0]].numel()
        if maps is not None:  # stepped in place: the pages go back, the views of them first
            for name in self.names:
                del chunk[name]
            for mapping in maps:
                self.store.unmap(mapping)
        else:
            for name in self.names:
                self.store.write(self._key(index, name), start, chunk[name])
        self._flusher.submit(self._flush, index, start, numel)
        if params is not None:
            flat.write_shard(start, params)

    # ---- state in and out: the `Stepper` interface, see [Note: chunked state access] in sharding/stepper.py

    @torch.no_grad()
    def refresh_master(self, index: int, flat) -> None:
        """Master <- the parameters (their values as the model holds them), chunk by chunk."""
        buffer = torch.empty(min(self.spec.chunk_numel, max(self.sizes[index], 1)))
        for start, end in self._ranges(index):
            chunk = buffer[: end - start]
            flat.read_shard(start, chunk)
            self.store.write(self._key(index, "master"), start, chunk)

    def tensor_names(self, index: int) -> list:
        return list(self.names) if self.scalars[index] is not None else ["master"]

    def read(self, index: int, name: str, start: int, out: torch.Tensor) -> torch.Tensor:
        return self.store.read(self._key(index, name), start, out)

    def write(self, index: int, name: str, start: int, values: torch.Tensor) -> None:
        self.store.write(self._key(index, name), start, values)

    def scalar_state(self, index: int) -> dict:
        return dict(self.scalars[index] or {})

    def set_scalar_state(self, index: int, scalars: dict) -> None:
        self.scalars[index] = {k: (v.detach().clone().cpu() if torch.is_tensor(v) else v) for k, v in scalars.items()}

    def clear_state(self, index: int) -> None:
        self.scalars[index] = None  # the next step starts the state afresh (what is stored is unused)

    def state_bytes(self) -> dict:
        where = "disk" if isinstance(self.store, DiskStore) else "cpu"
        return {"offload_device": where, "offload_bytes": bytes_needed(self.store.sizes) if self.store else 0}

    def close(self) -> None:
        """Free the store (a disk store deletes its files). Idempotent; also runs at exit."""
        if self.store is not None:
            self._finalizer()


def _close(store, io, flusher=None) -> None:
    for pool in (io, flusher):
        if pool is not None:
            pool.shutdown(wait=True)
    store.close()


class _DeviceLink:
    """Moves gradient chunks to the CPU step and updated weights back to the parameters.

    On the CPU: a gradient chunk is a view (fp32) or an upcast copy (16-bit), and weights are
    cast straight into the parameters. On CUDA: gradient chunks come into pinned staging buffers
    and weights go out of them on a side stream, `slots` of each, so the copies of chunk i+1 and
    i-1 overlap the CPU step of chunk i; an event per slot guards a staging buffer until the
    copy that reads it has finished. The one-pass kernel (`cpu_adam`) takes a gradient chunk as
    it is (`take_raw`) and writes the weights where `param_targets` says: the parameters on the
    CPU, a staging buffer on CUDA (sent by `params_written`).
    """

    def __init__(self, device, grad_dtype, param_dtype, *, slots: int, chunk_numel: int):
        self.cuda = device.type == "cuda"
        self.slots = slots
        self.chunk_numel = chunk_numel
        self.param_dtype = param_dtype
        # One fp32 gradient chunk is enough (chunk i is stepped before chunk i+1 is taken), and
        # one buffer stays in cache between chunks: 4 rotating ones made the upcast 3x slower.
        self.grad32 = None  # made at the first `take_grad` (the one-pass kernel needs none)
        self.cpu_stage = None  # CPU parameters `param_views` cannot reach: staged, then `write_shard`
        self.staged = False
        self.pending = [None] * slots  # CPU: the gradient chunk to upcast; CUDA: (event, numel)
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self.grad_stage = [torch.empty(chunk_numel, dtype=grad_dtype, pin_memory=True) for _ in range(slots)]
            self.param_stage = [torch.empty(chunk_numel, dtype=param_dtype, pin_memory=True) for _ in range(slots)]
            self.param_events = [None] * slots

    def begin(self) -> None:
        if self.cuda:  # gradients were produced on the compute stream
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))

    def fetch_grad(self, source: torch.Tensor, slot: int) -> None:
        """Start bringing gradient chunk `source` to the CPU step (taken with `take_grad(slot)`)."""
        if not self.cuda:
            self.pending[slot] = source
            return
        stage = self.grad_stage[slot][: source.numel()]
        with torch.cuda.stream(self.stream):
            stage.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending[slot] = (event, source.numel())

    def take_raw(self, slot: int, numel: int) -> torch.Tensor:
        """This slot's gradient chunk on the CPU, in its own dtype (a view of the shard on the CPU)."""
        if self.cuda:
            event, numel = self.pending[slot]
            event.synchronize()
            source = self.grad_stage[slot][:numel]
        else:
            source = self.pending[slot]
        self.pending[slot] = None
        return source

    def take_grad(self, slot: int, numel: int, factors) -> torch.Tensor:
        """This slot's gradient chunk as fp32 on the CPU, multiplied by `factors` in order."""
        source = self.take_raw(slot, numel)
        if source.dtype == torch.float32 and not self.cuda and not factors:
            return source
        if self.grad32 is None:
            self.grad32 = torch.empty(self.chunk_numel)
        out = self.grad32[: source.numel()]
        out.copy_(source)
        for factor in factors:
            out.mul_(factor)
        return out

    def put_params(self, flat, start: int, master: torch.Tensor, slot: int) -> None:
        if not self.cuda:
            flat.write_shard(start, master)
            return
        self._stage(slot, master.numel()).copy_(master)
        self._upload(flat, start, slot, master.numel())

    def param_targets(self, flat, start: int, numel: int, slot: int) -> list:
        """Where the weights of shard elements [start, start + numel) are to be written on the CPU,
        as (offset, tensor) pieces; `params_written` when they are."""
        pieces = None if self.cuda else _param_views(flat, start, numel)
        self.staged = pieces is None
        return [(0, self._stage(slot, numel))] if pieces is None else pieces

    def params_written(self, flat, start: int, numel: int, slot: int) -> None:
        if self.cuda:
            self._upload(flat, start, slot, numel)
        elif self.staged:
            flat.write_shard(start, self.cpu_stage[:numel])

    def _stage(self, slot: int, numel: int) -> torch.Tensor:
        if not self.cuda:
            if self.cpu_stage is None:
                self.cpu_stage = torch.empty(self.chunk_numel, dtype=self.param_dtype)
            return self.cpu_stage[:numel]
        if self.param_events[slot] is not None:
            self.param_events[slot].synchronize()  # its previous upload has read the stage
        return self.param_stage[slot][:numel]

    def _upload(self, flat, start: int, slot: int, numel: int) -> None:
        with torch.cuda.stream(self.stream):
            flat.write_shard(start, self.param_stage[slot][:numel], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.param_events[slot] = event

    def end(self) -> None:
        if self.cuda:  # the all-gather that follows reads the parameters on the compute stream
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
