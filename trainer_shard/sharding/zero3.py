"""ZeRO-3 core: parameters sharded unit by unit, gathered only while their unit runs.

    sharded = shard_model(model, units=[T5Block], persistence_threshold=100)
    opt = torch.optim.AdamW(sharded.shard_parameters(), lr=1e-3)
    loss = model(**batch).loss; loss.backward()
    sharded.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

A *unit* is a wrapped module (every instance of the given classes, or the given modules; the
model itself is always the root unit). Each parameter belongs to the innermost unit holding
every module that registers it, so a tied parameter (T5's shared embedding, used by both stacks and
by lm_head) stays one parameter, in the outermost unit that contains all its users. Parameters
with at most `persistence_threshold` elements (and frozen ones) stay whole on every rank
("persistent"): their gradients are all-reduced (averaged) at the end of backward and the
optimizer steps them, identically, on every rank.

A unit's sharded parameters are laid end to end in one flat buffer (`FlatParams`; one per
`group_fn` key and dtype; `partition.plan_layout` with a single bucket, padded to a multiple of
the world size); the parameters are views of it. Between
uses the buffer's storage has size 0 and the rank keeps only its slice (`shard`, persistent);
the optimizer steps that slice in place (fp32: the slice *is* the optimizer's parameter; 16-bit:
an fp32 master, cast into the slice before the next gather), so nothing is all-gathered after
the step.

[Note: free and re-gather] A flat buffer keeps one storage for its life; the parameters and
every tensor autograd saved as a view of them point at it. Freeing leaves that storage empty
(0 bytes); gathering gives it memory again and all-gathers the shards into it, so what backward
reads is the refilled data. The memory comes from a `GatherPool` and goes back to it: a swap of
data pointers between storages, so after the first step gathering allocates nothing (without
the private swap, `resize_` to full size and to 0, as FSDP does). Never replace the storage
(`p.data = ...`): saved views would keep the old one.

[Note: unit lifecycle]
- forward pre-hook: gather (waiting for a prefetch if one is in flight), then start an
  asynchronous gather of the unit that followed it in the first recorded forward (backward:
  the one before it);
- forward post-hook: free (not when the unit is held, nor inside backward, where gradient
  checkpointing re-runs forward); with grad enabled, a hook on the outputs (`register_multi_grad_hook`,
  mode "any") re-gathers the unit before its backward starts;
- backward: each sharded parameter's post-accumulate-grad hook hands its gradient to the
  existing `GradReducer` (a unit's flat buffer is one bucket: divided by the world size, then
  `comm.reduce_scatter`, point to point on gloo, measured faster there than its collectives, and
  a real reduce-scatter on NCCL; this rank's slice is added into the fp32 gradient shard); once
  every sharded parameter of the unit has its gradient, the unit is freed;
- end of backward (an autograd engine callback): persistent gradients all-reduced, and any unit
  still gathered freed (units with parameters unused in this forward, unused prefetches);
- the root unit's forward post-hook also frees prefetched units that did not run.
Gradient checkpointing: transformers 5 checkpoints a layer's `forward` inside its module hooks,
so a checkpointed unit is gathered by the hook on its outputs and its recompute finds it there;
units inside a checkpointed layer run their hooks again in backward (reentrant or not).

[Note: collective calls] `shard_model`, a forward, a backward, `clip_grad_norm_`, `gathered`,
`full_state_dict` and `load_full_state_dict` are collectives: every rank runs them, in the same
order, on the same modules, or the job hangs. Prefetch follows the recorded order, which is the
same on every rank. A parameter used on one rank and not on another is such a mismatch too.

[Note: parameter offload] With `param_offload` (`offload.param_store`), a flat buffer's shard
lives in the parameter store instead of a tensor of its own: a CPU RAM tensor (device "cpu"),
or a file (device "nvme"; `shard` is None). A shard on disk is read into this rank's slice of
the gather buffer (`load`, on the store's reader thread), started for the units after the
running one in the recorded order while at most `buffer_count` units have buffers alive, and
all-gathered in place. Its gradient shard is on disk too: each reduced slice is written as
backward produces it (on the store's writer thread, one in flight; summed with what is there when
micro-batches accumulate), its squared norm kept (`grad_sq`), so clipping needs no pass over the files. The optimizer must be
offloaded as well: its engine reads the gradient chunk by chunk and writes the updated
parameters back to the store (`write_shard`).

[Note: meta-device model] A model whose weights do not fit in memory is built on the meta
device (shapes only) and sharded with `weights`: each unit's flat buffer is filled from it a
tensor at a time, the rank's shard kept (or written to the parameter store), the buffer freed,
before the next unit; the parameter objects stay the same (`torch.utils.swap_tensors` gives each
its real tensor), so ties and names are the model's. Persistent parameters are read whole.

Not handled yet: weights written behind its back (`model.load_state_dict`: use
`load_full_state_dict`), `model.to(...)` after sharding, frozen parameters kept whole rather
than sharded, a backward that raises halfway (its end-of-backward callback never runs).
"""

import contextlib
import functools

import torch
from torch.autograd.profiler import record_function
from torch.utils._pytree import tree_flatten

from .. import comm
from ..constants import CHUNK_NUMEL
from ..errors import ShardingError
from ..memory import release_freed_memory
from .partition import plan_layout
from .norms import power_sum
from .reducer import GradReducer

PERSISTENCE_THRESHOLD = 100_000
"""Parameters of at most this many elements stay whole on every rank (DeepSpeed's
`stage3_param_persistence_threshold` default; DeepSpeed too keeps `numel <= threshold` whole)."""


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class GatherPool:
    """Storages for gathered flat buffers, reused: after the first step no gather allocates.

    A flat buffer keeps its own (empty) storage, so the parameters and autograd's saved views
    keep pointing at it; gathering swaps a pool storage's memory into it
    (`UntypedStorage._swap_data_ptr_`, which swaps the data pointers and sizes of two storages)
    and releasing swaps it back. Free storages are kept by size: the pool grows to the most
    buffers of each size gathered at once (about three: the root, the running unit, the one
    prefetched), then stays. Where the private swap is missing, buffers are allocated and freed
    with `resize_` instead (`pooled` False).
    """

    pooled = hasattr(torch.UntypedStorage, "_swap_data_ptr_")

    def __init__(self, enabled: bool = True, limit: int | None = None):
        if not enabled:
            self.pooled = False
        self.limit = limit  # at most this many storages, lent and free (parameter offload: buffer_count)
        self.free = {}  # (nbytes, device) -> [UntypedStorage]
        self.lent = 0
        self.created = 0
        self.created_bytes = 0

    def attach(self, buffer: torch.Tensor, nbytes: int):
        """Give `buffer` (an empty storage) `nbytes` of memory; returns the token `detach` wants."""
        storage = buffer.untyped_storage()
        if not self.pooled:
            storage.resize_(nbytes)
            return None
        free = self.free.setdefault((nbytes, storage.device), [])
        self.lent += 1
        if free:
            slot = free.pop()
        else:
            if self.limit is not None and self.lent + self.free_count > self.limit:
                self._drop_one()  # a free storage of another size goes: the limit counts storages
            slot = torch.UntypedStorage(nbytes, device=storage.device)
            self.created += 1
            self.created_bytes += nbytes
        storage._swap_data_ptr_(slot)  # now `slot` is the empty one
        return slot

    def detach(self, buffer: torch.Tensor, slot) -> None:
        """Take the memory back from `buffer`, which is left with an empty storage."""
        storage = buffer.untyped_storage()
        if slot is None:
            storage.resize_(0)
            return
        storage._swap_data_ptr_(slot)
        self.lent -= 1
        self.free[(slot.nbytes(), slot.device)].append(slot)

    @property
    def free_count(self) -> int:
        return sum(len(slots) for slots in self.free.values())

    def _drop_one(self) -> None:
        for slots in self.free.values():
            if slots:
                slots.pop()
                return

    @property
    def free_bytes(self) -> int:
        return sum(s.nbytes() for slots in self.free.values() for s in slots)

    def clear(self) -> None:
        self.free = {}


class FlatParams:
    """One flat buffer of a unit's sharded parameters (those of one param group): the buffer
    (alive only while gathered), this rank's shard of it, the fp32 gradient shard and the
    optimizer's view of the shard. Also what `GradReducer` needs of a flat group: `layout`,
    `params`, `buffer` (its device), `dtype` and `add_to_grad`."""

    def __init__(self, params: list, names: list, key, rank: int, world_size: int, group, pool: GatherPool,
                 store=None, name: str = "", fetch=None, device=None):  # fmt: skip
        self.params, self.names, self.key = params, names, key
        self.rank, self.group, self.pool = rank, group, pool
        numels = [p.numel() for p in params]
        # one bucket: the unit's gradients are reduced once its backward is done
        self.layout = plan_layout(numels, world_size, bucket_numel=sum(numels), order=range(len(params)))
        self.bucket = self.layout.buckets[0]
        self.segments = self.layout.segments(rank)
        first = params[0]
        device = device if first.device.type == "meta" else first.device
        self.buffer = torch.zeros(self.layout.total_numel, dtype=first.dtype, device=device)
        with torch.no_grad():
            for p, slot in zip(params, self.layout.slots):
                view = self.buffer[slot.offset : slot.offset + slot.numel]
                if p.device.type == "meta":  # [Note: meta-device model] read now, a tensor at a time
                    view.copy_(fetch(p).reshape(-1))
                    # a real parameter in place of the meta one, then pointed at the buffer with `.data =`
                    # as below: it keeps a version counter of its own (a Parameter made of the view
                    # would share the buffer's, and each gather into the buffer would then fail
                    # backward's check of the tensors forward saved)
                    shape = p.shape
                    real = torch.nn.Parameter(torch.empty(0, dtype=p.dtype, device=device))
                    real.requires_grad_(p.requires_grad)
                    torch.utils.swap_tensors(p, real)
                    p.data = view.view(shape)
                else:
                    view.copy_(p.detach().reshape(-1))
                    p.data = view.view(p.shape)
            comm.broadcast(self.buffer, 0, group)  # every rank starts from rank 0's weights
            mine = self.buffer[slice(*self.bucket.slice_range(rank))]
            self.store, self.store_name = store, name
            if store is None:
                self.shard = mine.clone()
            else:  # [Note: parameter offload]
                store.write(name, 0, mine)
                self.shard = None if store.on_disk(name) else store.tensor(name)
        self.nbytes = self.buffer.numel() * self.buffer.element_size()
        self.offloaded = False
        self.grad_stored = False  # the gradient shard lives in the parameter store (on disk)
        self.grad_sq = 0.0  # then: its squared 2-norm, kept as backward writes it
        self._grad_write = None  # the future of its last write
        if store is not None:  # the fp32 master lives in the offload engine's store: no copy here
            self.master = None
            self.shard_param = torch.nn.Parameter(torch.empty(self.layout.shard_numel, device="meta"))
        elif first.dtype == torch.float32:
            self.master = None
            self.shard_param = torch.nn.Parameter(self.shard)  # shares the shard's storage
        else:
            self.master = self.shard.float()
            self.shard_param = torch.nn.Parameter(self.master)
        self._master_version = self.shard_param._version
        # with a store, made when the optimizer says where and in what dtype (`configure`)
        self.grad = torch.zeros(self.layout.shard_numel, dtype=torch.float32,
                                device=first.device if store is None else "meta")  # fmt: skip
        self.stale = {0}  # the gradient shard holds nothing of this step yet (counts as zero)
        self.accumulated = False  # a second backward added into it before the step
        self.edited = False  # weights written through `ShardedModel.gathered(writeback=True)`
        self.buffer.untyped_storage().resize_(0)  # from now on its memory comes from the pool
        self.slot, self.attached = None, False  # the pool's token while the buffer has memory
        self.pending = None  # the handle of an asynchronous gather in flight
        self.loading = None  # the future of this rank's shard being read from disk into the buffer
        self.gathered = False  # the gather has completed

    @property
    def dtype(self):
        return self.buffer.dtype

    @property
    def params_stored(self) -> bool:
        """This rank's parameter shard is on disk (the offload engine writes it there)."""
        return self.shard is None

    @torch.no_grad()
    def add_to_grad(self, bucket, values: torch.Tensor, alpha: float = 1.0, owned: bool = False) -> None:
        """The gradient shard += alpha * values (= when stale: after `zero_grad`, or never written).
        `owned`: `values` is the caller's no longer (the reducer's output): on disk it is written
        as it is, with no copy."""
        if self.grad_stored:
            self._add_to_stored_grad(values, alpha, owned)
            return
        if self.grad.device.type == "meta":
            raise ShardingError("offload_param: the gradients have nowhere to go before the optimizer is built "
                                "(ShardedOptimizer(..., stage=3, offload=...)), or configure(offloaded=True) is "
                                "called on each flat buffer")  # fmt: skip
        if self.shard_param.grad is None and not self.offloaded:  # a plain optimizer's zero_grad(set_to_none=True)
            self.shard_param.grad = self.grad
            self.stale = {0}
        target = self.grad[bucket.shard_offset : bucket.shard_offset + bucket.shard_numel]
        if self.stale:
            target.copy_(values)
            if alpha != 1.0:
                target.mul_(alpha)
            self.stale = set()
        else:
            target.add_(values, alpha=alpha)
            self.accumulated = True

    def _add_to_stored_grad(self, values: torch.Tensor, alpha: float, owned: bool) -> None:
        """[Note: parameter offload] The reduced slice goes to the store as backward makes it, its
        squared norm kept on the way (the sum's, when micro-batches accumulate)."""
        self._wait_grad_write()
        if self.stale and owned and alpha == 1.0 and values.dtype == self.grad.dtype and values.is_contiguous():
            total = values  # written as it is (t5-11b: a unit's gradient is 0.5 GB; no second copy)
        else:
            total = torch.empty(values.numel(), dtype=self.grad.dtype)
            if self.stale:  # as `add_to_grad` does in memory, operation for operation
                total.copy_(values)
                if alpha != 1.0:
                    total.mul_(alpha)
            else:
                self.store.read(self.grad_name, 0, total).add_(values, alpha=alpha)
                self.accumulated = True
        self.stale = set()
        self.grad_sq = _square_sum(total)
        self._grad_write = self.store.write_async(self.grad_name, 0, total)  # backward goes on meanwhile

    def _wait_grad_write(self) -> None:
        if self._grad_write is not None:
            self._grad_write.result()
            self._grad_write = None

    @torch.no_grad()
    def read_grad(self, start: int, out: torch.Tensor) -> torch.Tensor:
        """Gradient shard elements [start, start + out.numel()) into `out` (of the gradient's dtype)."""
        if self.grad_stored:
            self._wait_grad_write()
            return self.store.read(self.grad_name, start, out)
        return out.copy_(self.grad[start : start + out.numel()])

    # -- what `ShardedOptimizer(stage=3)` and its steppers use of a flat (as of `flat.FlatGroup`):
    # the shard stands where FlatGroup has this rank's slice of the buffer, and nothing is
    # all-gathered after the step (the next forward gathers).
    def configure(self, offloaded: bool, grad_dtype=None) -> None:
        """For `ShardedOptimizer`: with `offloaded` the fp32 master lives in the offload store (no
        copy here) and the gradient shard is kept in `grad_dtype` (default: the parameters')."""
        if self.store is not None and not offloaded:
            raise ShardingError("offload_param keeps the parameter shards out of memory, but the optimizer steps fp32 "
                                "masters in memory: offload the optimizer too (offload_optimizer.device cpu or "
                                "nvme; --sharded_ddp \"zero_dp_3 offload\")")  # fmt: skip
        self.offloaded = offloaded
        dtype = grad_dtype or (self.dtype if offloaded else torch.float32)
        if offloaded:
            self.master = None
            self.shard_param.grad = None
        if self.store is not None and self.shard is None:  # parameters on disk: the gradients too
            self.grad_name = self.store_name.replace(".param", ".grad")
            if not self.grad_stored:
                self.store.add(self.grad_name, self.layout.shard_numel, dtype, on_disk=True)
            self.grad_stored = True
            self.grad = torch.empty(self.layout.shard_numel, dtype=dtype, device="meta")  # shape and dtype
            return
        if dtype != self.grad.dtype or self.grad.device.type == "meta":
            device = self.buffer.device
            self.grad = torch.zeros(self.layout.shard_numel, dtype=dtype, device=device)
        if not offloaded:
            self.shard_param.grad = self.grad

    grad_views = False  # see [Note: gradient views] in flat.py: a FlatParams keeps its own gradient shard

    def reduce_target(self, bucket, dtype):
        """None: reductions go through `add_to_grad`, which may keep the result rather than copy it."""
        return None

    @property
    def master_views(self) -> list:
        return [] if self.offloaded else [self.shard_param]

    @property
    def master_ranges(self) -> list:
        """(first element in the shard, elements) of each of `master_views`."""
        return [] if self.offloaded else [(0, self.layout.shard_numel)]

    def grad_tensors(self) -> list:
        return [self.grad]

    @property
    def grad_bytes(self) -> int:
        return 0 if self.grad_stored else self.grad.numel() * self.grad.element_size()

    @property
    def separate_master(self) -> bool:
        return self.master is not None or self.offloaded

    @torch.no_grad()
    def write_shard(self, start: int, values: torch.Tensor, non_blocking: bool = False) -> None:
        """This rank's parameters, shard elements [start, start + len(values)) <- `values` (cast)."""
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
    def refresh_master(self) -> None:
        """Master <- the shard (weights loaded into the model)."""
        if self.master is not None:
            self.master.copy_(self.shard)
        self._master_version = self.shard_param._version

    def follow_outside_edits(self) -> bool:
        """True when weights were loaded since the last look and the master is elsewhere."""
        return self.separate_master and self.edited

    def mark_seen(self) -> None:
        self.edited = False

    def mark_grads_stale(self) -> None:
        self.stale = {0}

    @torch.no_grad()
    def zero_stale(self) -> None:
        if self.stale:
            if self.grad_stored:
                self._wait_grad_write()
                zeros = torch.zeros(min(CHUNK_NUMEL, self.layout.shard_numel), dtype=self.grad.dtype)
                for start in range(0, self.layout.shard_numel, CHUNK_NUMEL):
                    self.store.write(self.grad_name, start, zeros[: min(CHUNK_NUMEL, self.layout.shard_numel - start)])
                self.grad_sq = 0.0
            else:
                self.grad.zero_()
        self.stale = set()

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
        if self.attached:
            return
        self.slot, self.attached = self.pool.attach(self.buffer, self.nbytes), True
        if self.shard is None:
            self.loading = self.store.read_async(self.store_name, 0, self._mine())

    def _mine(self) -> torch.Tensor:
        return self.buffer[slice(*self.bucket.slice_range(self.rank))]

    def start_gather(self) -> None:
        """Refill the flat buffer from every rank's shard, asynchronously. Collective."""
        if self.gathered or self.pending is not None:
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
            self.pending = comm.all_gather(self.buffer, mine, self.group, async_op=True)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None
            self.gathered = True

    def release(self) -> None:
        """Free the flat buffer (this rank's shard stays). Not collective."""
        if self.pending is not None:  # a prefetch never used: let it land first
            self.pending.wait()
            self.pending = None
        if self.loading is not None:  # a read ahead never used: the same
            self.loading.result()
            self.loading = None
        if self.attached:
            self.pool.detach(self.buffer, self.slot)
            self.slot, self.attached = None, False
        self.gathered = False

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


def _square_sum(t: torch.Tensor) -> float:
    """sum(t ** 2), from fp32 norms of short rows summed in fp64 (`norms.power_sum`: no full-size
    copy, one pass; an fp64 square a chunk at a time took a third of t5-large's backward)."""
    return float(power_sum(t, 2.0))


class Unit:
    """A wrapped module's sharded parameters, one `FlatParams` per param group key."""

    def __init__(self, module, parts: list, all_trainable: bool, name: str = "", check=None):
        self.module, self.parts, self.all_trainable = module, parts, all_trainable
        self.name = name or type(module).__name__
        self.check = check  # called before each gather this unit starts: [Note: diverging calls]
        self.params = [p for part in parts for p in part.params]
        self.numel = sum(p.numel() for p in self.params)
        self.holds = 0  # `ShardedModel.gathered` blocks (and wrapped methods) holding it
        self.for_backward = False
        self.grads_seen = 0

    @property
    def gathered(self) -> bool:
        return any(part.gathered or part.pending is not None for part in self.parts)

    @property
    def attached(self) -> bool:
        """Its buffers have memory (gathered, gathering, or read ahead from disk)."""
        return any(part.attached for part in self.parts)

    def load(self) -> None:
        for part in self.parts:
            part.load()

    def start_gather(self) -> None:
        if self.check is not None and not self.gathered:
            self.check(self)
        for part in self.parts:
            part.start_gather()

    def gather(self) -> None:
        self.start_gather()
        for part in self.parts:
            part.wait()

    def release(self) -> None:
        for part in self.parts:
            part.release()
        self.for_backward = False


class ShardedModel:
    """The ZeRO-3 state of a model; see the module docstring. Built by `shard_model`."""

    def __init__(self, model, unit_modules: list, group, persistence_threshold: int, prefetch,
                 group_fn=None, gather_pool: bool = True, reduce_dtype=None, check_calls: bool = True,
                 release_memory: bool = True, param_offload=None, weights=None, device=None):  # fmt: skip
        self.model, self.group, self.prefetch = model, group, prefetch
        self.param_offload = param_offload
        self.release_memory = release_memory
        self.reduce_dtype = reduce_dtype
        self.rank, self.world_size = comm.rank_and_size(group)
        self.units, self.persistent, self.persistent_keys, self._handles = [], [], [], []
        self._order, self._recording = [], True  # forward order of the inner units, recorded once
        self._next, self._prev = {}, {}  # unit -> the unit after (before) it in that order
        self._callback_queued = False
        owner, names = _owners(model, unit_modules)
        key_of = {p: (group_fn(names[p], p) if group_fn else None) for p in owner}
        by_unit = {id(m): {} for m in unit_modules}  # unit -> (key, dtype) -> params, in model order
        for p, unit_module in owner.items():
            if p.numel() <= persistence_threshold or not p.requires_grad:
                self.persistent.append(p)
                self.persistent_keys.append(key_of[p])
            else:
                by_unit[id(unit_module)].setdefault((key_of[p], p.dtype), []).append(p)
        fetch = _weight_reader(model, weights)
        device = torch.device(device) if device is not None else _device_of(model)
        frozen_users = _units_using_frozen(model, unit_modules)
        self.pool = GatherPool(gather_pool, param_offload.buffer_count if param_offload else None)
        module_names = {id(m): name for name, m in model.named_modules()}
        self.gathers = 0  # unit gathers started, counted alike on every rank: [Note: diverging calls]
        check = self._check_same_call if self.world_size > 1 and check_calls else None
        groups = [ps for module in unit_modules for ps in by_unit[id(module)].values()]
        self.store = self._open_store(groups, module_names, unit_modules, by_unit) if param_offload else None
        index = iter(range(len(groups)))
        for module in unit_modules:  # the root last in the list: see `_unit_modules`
            if not by_unit[id(module)]:
                continue
            parts = [FlatParams(ps, [names[p] for p in ps], key, self.rank, self.world_size, group, self.pool,
                                self.store, f"{next(index)}.param", fetch, device)
                     for (key, _), ps in by_unit[id(module)].items()]  # fmt: skip
            name = module_names.get(id(module)) or "the model"
            self.units.append(Unit(module, parts, id(module) not in frozen_users, name, check))
            self.units[-1].index = len(self.units) - 1
        self.root = next((u for u in self.units if u.module is model), None)
        self.parts = [part for unit in self.units for part in unit.parts]
        with torch.no_grad():
            for p in self.persistent:
                if p.device.type == "meta":
                    value = fetch(p).to(device=device, dtype=p.dtype, copy=True)
                    torch.utils.swap_tensors(p, torch.nn.Parameter(value, requires_grad=p.requires_grad))
                comm.broadcast(p.data, 0, group)  # as the flat buffers: rank 0's weights
        for part in self.parts:
            for p in part.params:
                p._trainer_shard_zero3 = (self, part)
        for p in self.persistent:
            p._trainer_shard_zero3 = (self, None)
        self._install_hooks(unit_modules)
        self._wrapped_methods = []
        if hasattr(model, "generate"):
            self.register_forward_method("generate")

    def _open_store(self, groups: list, module_names: dict, unit_modules: list, by_unit: dict):
        """[Note: parameter offload] The parameter store, sized for every flat buffer's shard at
        once (one check for room on disk); a unit larger than `buffer_size` is refused here."""
        from ..offload.param_store import ParamStore

        spec, sizes = self.param_offload, {}
        for module in unit_modules:
            numel = sum(p.numel() for ps in by_unit[id(module)].values() for p in ps)
            if numel > spec.buffer_size:
                raise ShardingError(f"offload_param: the unit {module_names.get(id(module)) or 'the model'!r} holds "
                                    f"{numel:,} sharded elements, more than buffer_size {spec.buffer_size:,}; raise "
                                    f"offload_param.buffer_size to at least {numel:,}, or wrap smaller units")  # fmt: skip
        for i, ps in enumerate(groups):
            numels = [p.numel() for p in ps]
            layout = plan_layout(numels, self.world_size, bucket_numel=sum(numels), order=range(len(ps)))
            sizes[f"{i}.param"] = (layout.shard_numel, ps[0].dtype)
        return ParamStore(spec, sizes, rank=self.rank)

    def _install_hooks(self, unit_modules: list) -> None:
        # parameters offloaded: one unit's reduction in flight (t5-11b's are 0.5 GB each)
        self.reducer = GradReducer(self.group, reduce_dtype=self.reduce_dtype,
                                   max_in_flight=1 if self.param_offload is not None else 2)  # fmt: skip
        # backward meets the inner units in reverse module order, the root's tied embedding last
        inner = [u for u in self.units if u is not self.root]
        for unit in reversed(inner) if self.root is None else [*reversed(inner), self.root]:
            for part in unit.parts:
                self.reducer.add(part)
        for unit in self.units:
            for p in unit.params:
                self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(self._on_grad, unit)))
        for p in self.persistent:
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(lambda _: self._queue_callback()))
        by_module = {id(u.module): u for u in self.units}
        for module in unit_modules:
            unit, is_root = by_module.get(id(module)), module is self.model
            self._handles.append(module.register_forward_pre_hook(functools.partial(self._pre_forward, unit, is_root)))
            self._handles.append(module.register_forward_hook(functools.partial(self._post_forward, unit, is_root)))

    # -- the optimizer's side
    def shard_parameters(self) -> list:
        """What to hand the optimizer: each flat buffer's shard (an fp32 Parameter whose `.grad`
        is its gradient shard) and the trainable persistent parameters, whole."""
        return [part.shard_param for part in self.parts] + [p for p in self.persistent if p.requires_grad]

    def param_groups(self, settings: dict) -> list:
        """Optimizer param groups by the keys `group_fn` gave (`settings`: key -> that group's
        options, e.g. {"decay": {"weight_decay": 0.01}, "no_decay": {"weight_decay": 0.0}})."""
        found = {}
        for part in self.parts:
            found.setdefault(part.key, []).append(part.shard_param)
        for p, key in zip(self.persistent, self.persistent_keys):
            if p.requires_grad:
                found.setdefault(key, []).append(p)
        missing = [k for k in found if k not in settings]
        if missing:
            raise ShardingError(f"param_groups: no settings for the group keys {missing!r} that group_fn gave; "
                                f"pass settings for every key (given: {sorted(map(repr, settings))})")  # fmt: skip
        return [{"params": params, **settings[key]} for key, params in found.items()]

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every gradient by the global norm over all ranks, as `torch.nn.utils.clip_grad_norm_`
        on the unsharded model would; returns that norm. Collective."""
        if float(norm_type) != 2.0:
            raise ShardingError(f"clip_grad_norm_ supports the 2-norm only, got norm_type={norm_type}")
        shards = [part.shard_param.grad for part in self.parts if part.shard_param.grad is not None]
        whole = [p.grad for p in self.persistent if p.grad is not None]
        device = next((g.device for g in shards + whole), torch.device("cpu"))
        sharded_sq = torch.zeros((), dtype=torch.float32, device=device)
        for g in shards:
            sharded_sq += g.float().pow(2).sum()
        comm.all_reduce(sharded_sq, group=self.group)  # padding is zero: it adds nothing
        whole_sq = sum((g.float().pow(2).sum() for g in whole), torch.zeros((), device=device))  # same on every rank
        total = (sharded_sq + whole_sq).sqrt()
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in shards + whole:
            g.mul_(coef.to(g.dtype))
        return total

    # -- accounting
    def held_parameter_bytes(self) -> dict:
        """Bytes of parameters this rank holds right now, by kind: "shards" (each unit's slice, in
        the parameters' dtype), "masters" (separate fp32 masters, 16-bit only), "persistent"
        (whole small parameters), "gathered" (flat buffers alive now, read ahead from disk
        included; 0 between steps) and "pool" (gather buffers kept for reuse, attached to no
        unit now); besides, "grad_shards" (the gradient shards in memory, kept between steps)
        and "on_disk" (parameter and gradient shards in the parameter store's files)."""
        return {
            "shards": sum(part.shard_bytes for part in self.parts),
            "masters": sum(part.master.numel() * 4 for part in self.parts if part.master is not None),
            "persistent": sum(p.numel() * p.element_size() for p in self.persistent),
            "gathered": sum(part.buffer.untyped_storage().nbytes() for part in self.parts),
            "pool": self.pool.free_bytes,
            "grad_shards": sum(part.grad.numel() * part.grad.element_size() for part in self.parts
                               if part.grad.device.type != "meta"),
            "on_disk": self.store.bytes()["disk"] if self.store is not None else 0,
        }

    # -- whole parameters on demand
    @contextlib.contextmanager
    def gathered(self, units=None, writeback: bool = False):
        """Hold `units` (default: all; `full_state_dict` takes one at a time) gathered in the
        block; with `writeback`, what the block wrote into their parameters is kept (every rank
        must have written the same). Collective."""
        units = self.units if units is None else units
        for unit in units:
            unit.holds += 1
            unit.gather()
        try:
            yield
            if writeback:
                for part in (part for unit in units for part in unit.parts):
                    part.write_back()
        finally:
            for unit in units:
                unit.holds -= 1
                if unit.holds == 0 and not unit.for_backward:
                    unit.release()

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The model's state dict, whole, on every rank, gathered one unit at a time (tied
        parameters under every name they have, as `model.state_dict()`). Collective."""
        values = {}
        for unit in self.units:
            with self.gathered([unit]):
                for p in unit.params:
                    values[id(p)] = p.detach().clone()
        out = {}
        for name, p in self.model.named_parameters(remove_duplicate=False):
            out[name] = values[id(p)] if id(p) in values else p.detach().clone()
        for name, b in self.model.named_buffers():
            out[name] = b.detach().clone()
        return out

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load whole weights (as `full_state_dict` gives, or the unsharded model's state dict;
        any mapping that reads tensors by name) unit by unit; every parameter must be there
        under one of its names. Use it instead of `model.load_state_dict`, which
        would write into freed buffers. An optimizer's state is left as it is. Collective."""
        where, missing = {}, []  # a tied parameter needs one of its names there
        for name, p in self.model.named_parameters(remove_duplicate=False):
            if id(p) not in where and name in state_dict:
                where[id(p)] = name
        missing = [n for n, p in self.model.named_parameters() if id(p) not in where]
        missing += [n for n, _ in self.model.named_buffers() if n not in state_dict]
        if missing:
            raise ShardingError(f"load_full_state_dict: {len(missing)} keys missing, e.g. {missing[:3]}; "
                                "pass a full state dict of this model")  # fmt: skip
        for unit in self.units:
            with self.gathered([unit], writeback=True):
                for p in unit.params:
                    p.copy_(state_dict[where[id(p)]])
        for p in self.persistent:
            p.copy_(state_dict[where[id(p)]])
        for name, b in self.model.named_buffers():
            b.copy_(state_dict[name])

    def register_forward_method(self, name: str) -> None:
        """Hold the root unit gathered through `model.<name>(...)` (e.g. generate, which calls
        the encoder and the embeddings outside the root's forward)."""
        method = getattr(self.model, name)

        # transformers' synced_gpus agrees over the default (world) group: a smaller group cannot use it
        synced = name == "generate" and 1 < self.world_size == comm.rank_and_size(None)[1]

        @functools.wraps(method)
        def wrapped(*args, **kwargs):
            if synced:  # ranks that finish first go on running forward with the others: no hang
                kwargs["synced_gpus"] = True
            with self.gathered([self.root] if self.root else []):
                return method(*args, **kwargs)

        setattr(self.model, name, wrapped)
        self._wrapped_methods.append(name)

    def close(self) -> None:
        """Remove the hooks and empty the gather pool (the parameters stay sharded)."""
        self.pool.clear()
        if self.store is not None:
            self.store.close()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.reducer.close()
        for name in self._wrapped_methods:
            delattr(self.model, name)
        self._wrapped_methods = []

    # -- hooks: see [Note: unit lifecycle]
    def _pre_forward(self, unit, is_root, module, args):
        if unit is not None:
            if _in_backward() and not unit.for_backward:  # reentrant checkpointing's recompute
                unit.for_backward, unit.grads_seen = True, 0
            unit.gather()
        if is_root or _in_backward():
            return
        if self._recording:
            if unit is not None:
                self._order.append(unit)
        else:
            self._prefetch(unit, self._next)

    def _post_forward(self, unit, is_root, module, args, output):
        if is_root and self._recording:
            self._recording = False
            self._next = dict(zip(self._order, self._order[1:]))
            self._prev = dict(zip(self._order[1:], self._order))
        if unit is not None and not _in_backward():
            if unit.holds == 0:
                unit.release()
            if torch.is_grad_enabled():
                tensors = [t for t in tree_flatten(output)[0] if torch.is_tensor(t) and t.requires_grad]
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, functools.partial(self._pre_backward, unit), mode="any")  # fmt: skip
        if is_root:
            for other in self.units:  # prefetches of units that did not run
                if other is not self.root and other.holds == 0 and not other.for_backward and other.gathered:
                    other.release()

    def _pre_backward(self, unit, grad):
        self._queue_callback()
        unit.gather()
        if not unit.for_backward:  # a unit run twice in forward gets this hook twice
            unit.for_backward = True
            unit.grads_seen = 0
        self._prefetch(unit, self._prev)  # backward runs the forward order in reverse

    def _check_same_call(self, unit) -> None:
        """[Note: diverging calls] Ranks that run their modules a different number of times (a
        module called on one rank only, generate() without synced_gpus, data-dependent routing)
        would pair one unit's gather on one rank with another unit's on the next, silently
        mixing weights when the sizes agree, and aborting the process in gloo (SIGABRT) when they
        do not. So before each gather the ranks exchange (unit, count) first, 16 bytes in one
        small all-gather, and all raise the same error naming both sides if they differ.
        Measured cost: bench/results/zero3.md. Collective."""
        header = torch.tensor([unit.index, self.gathers], dtype=torch.int64, device=unit.parts[0].buffer.device)
        everyone = torch.empty(2 * self.world_size, dtype=torch.int64, device=header.device)
        with record_function("trainer_shard::zero3_check_calls"):
            comm.all_gather(everyone, header, self.group)
        self.gathers += 1
        seen = everyone.view(-1, 2).tolist()
        if all(pair == seen[0] for pair in seen):
            return
        said = "; ".join(f"rank {r}: {self.units[i].name if 0 <= i < len(self.units) else i!r} (gather {n + 1})"
                         for r, (i, n) in enumerate(seen))  # fmt: skip
        raise ShardingError(f"ZeRO-3: the ranks ran different modules, so their gathers no longer pair up ({said}); "
                            "every rank must call the same modules the same number of times (generate() with "
                            "synced_gpus=True; no module run on some ranks only)")  # fmt: skip

    def _prefetch(self, unit, following: dict) -> None:
        """Start gathering the units `_ahead` of `unit`; with parameters on disk, also start
        reading the ones after them, while at most `buffer_count` units have buffers alive."""
        if self.store is None:
            for ahead in self._ahead(unit, following):
                ahead.start_gather()
            return
        room = self.param_offload.buffer_count - sum(u.attached for u in self.units)
        gathering = set()
        for ahead in self._ahead(unit, following):
            if not ahead.attached:
                if room <= 0:
                    return
                room -= 1
            ahead.start_gather()
            gathering.add(ahead)
        if self.store.disk is None:
            return
        seen = 0
        while room > 0 and unit in following and seen < len(self._order):
            unit, seen = following[unit], seen + 1
            if unit not in gathering and not unit.attached:
                unit.load()
                room -= 1

    def _ahead(self, unit, following: dict):
        """The units to prefetch when `unit` starts: the next one with `prefetch` True, else the
        following ones while their elements add up to at most `prefetch` (at least one if > 0)."""
        if not self.prefetch:
            return
        budget = None if self.prefetch is True else int(self.prefetch)
        total, seen = 0, 0
        while unit in following and seen < len(self._order):
            unit = following[unit]
            seen += 1
            total += unit.numel
            if seen > 1 and (budget is None or total > budget):
                return
            yield unit

    def _on_grad(self, unit, param):
        self._queue_callback()
        unit.grads_seen += 1
        if unit.grads_seen == len(unit.params) and unit.all_trainable and unit.holds == 0 and unit is not self.root:
            unit.release()

    def _queue_callback(self):
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._callback_queued = True

    def _end_of_backward(self):
        self._callback_queued = False
        if self.release_memory:  # after every other end-of-backward callback (the reducer's too)
            torch.autograd.Variable._execution_engine.queue_callback(release_freed_memory)
        for unit in self.units:  # also a prefetch whose unit had no backward
            if unit.holds == 0 and unit.gathered:
                unit.release()
            unit.for_backward = False
        grads = [p.grad for p in self.persistent if p.grad is not None]
        if grads and self.world_size > 1:
            with record_function("trainer_shard::zero3_persistent_all_reduce"):
                flat = torch._utils._flatten_dense_tensors(grads)
                comm.all_reduce(flat, group=self.group)
                flat.div_(self.world_size)
                for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    g.copy_(reduced)


def _device_of(model) -> torch.device:
    """Where the flat buffers of a meta-device model go: its first real tensor's device, else the CPU."""
    real = next((t for t in [*model.parameters(), *model.buffers()] if t.device.type != "meta"), None)
    return real.device if real is not None else torch.device("cpu")


def _weight_reader(model, weights):
    """`fetch(parameter) -> tensor` for the parameters still on the meta device, from `weights` (a
    mapping read by name: any of a tied parameter's names will do); checks first that every one
    of them is there, and that no buffer is on the meta device, so nothing is built on a miss."""
    names = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(p, []).append(name)
    on_meta = [p for p in names if p.device.type == "meta"]
    meta_buffers = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if meta_buffers:
        raise ShardingError(f"buffers {meta_buffers[:3]} are on the meta device; materialize them (module.to_empty, "
                            "then set their values) before shard_model")  # fmt: skip
    if not on_meta:
        return None
    if weights is None:
        raise ShardingError(f"{len(on_meta)} parameters are on the meta device (e.g. {names[on_meta[0]][0]!r}); pass "
                            "their values: shard_model(..., weights=<a mapping of name -> tensor>, such as "
                            "zero3_weights.checkpoint_weights(folder))")  # fmt: skip
    missing = [names[p][0] for p in on_meta if not any(n in weights for n in names[p])]
    if missing:
        raise ShardingError(f"weights: {len(missing)} parameters of the model are not there, e.g. {missing[:3]}; "
                            "pass the weights of this model")  # fmt: skip

    def fetch(p):
        value = weights[next(n for n in names[p] if n in weights)]
        if tuple(value.shape) != tuple(p.shape):
            raise ShardingError(f"weights: {names[p][0]!r} has shape {tuple(value.shape)}, the model's is "
                                f"{tuple(p.shape)}")  # fmt: skip
        return value

    return fetch


def sharded_part(param):
    """(ShardedModel, FlatParams) of a parameter `shard_model` sharded, (ShardedModel, None) for
    one it keeps whole, None for a parameter of no sharded model (an attribute of the parameter:
    a WeakKeyDictionary of parameters crashed the interpreter here)."""
    return getattr(param, "_trainer_shard_zero3", None)


def shard_model(model, units=None, group=None, persistence_threshold: int = PERSISTENCE_THRESHOLD,
                prefetch=True, group_fn=None, gather_pool: bool = True, reduce_dtype=None,
                check_calls: bool = True, release_memory: bool = True, param_offload=None, weights=None,
                device=None) -> ShardedModel:  # fmt: skip
    """Shard `model`'s parameters ZeRO-3 style, in place; see the module docstring. Collective.

    Args:
        model: the model, with the same weights on every rank (seed it, or load the same file).
        units: module classes (every instance is a unit) or modules; default: the model alone.
        group: the process group (default: the world).
        persistence_threshold: parameters of at most this many elements stay whole on every rank.
        prefetch: True: start gathering the next unit (in the recorded forward order) as one
            starts; an int: the following units while their elements add up to at most that
            many (at least the next one); 0 or False: no prefetch.
        group_fn: `group_fn(name, parameter) -> key`: parameters of different keys go in
            different flat buffers, so `param_groups` can give each key its own optimizer
            settings (weight decay or not); default: one key, None.
        gather_pool: reuse gather buffers (`GatherPool`); False: allocate and free each time.
            Measured on t5-small (2 ranks, 2 cores): the same speed and peak RSS either way,
            within noise; the pool keeps its buffers between steps (`pool.clear()` frees them).
        reduce_dtype: the dtype gradients are summed over ranks in (default: as ZeRO-2's
            `GradReducer`, the parameters' up to 8 ranks).
        check_calls: before each gather, check that every rank gathers the same unit (see
            [Note: diverging calls]); False saves one small collective per gather.
        release_memory: at the end of each backward, hand the memory freed into the C heap
            back to the OS (`memory.release_freed_memory`): glibc keeps the step's full
            gradients and reduce buckets resident otherwise. Measured on t5-small (2 ranks):
            35-57 ms a call, peak RSS 90-120 MiB lower (bench/results/zero3.md).
        param_offload: an `offload.param_store.ParamOffloadSpec`: each unit's parameter shard
            lives in CPU RAM or on disk between uses (see [Note: parameter offload]); the
            optimizer must be offloaded too (`ShardedOptimizer(..., offload=...)`).
        weights: for a model built on the meta device (`with torch.device("meta"): ...`): a
            mapping name -> tensor its parameters are read from, a tensor at a time, straight
            into each unit's buffer and store (`zero3_weights.checkpoint_weights(folder)` reads
            a saved model's safetensors files that way); see [Note: meta-device model].
        device: where a meta-device model's parameters go (default: the CPU).
    """
    if int(persistence_threshold) < 0:
        raise ShardingError(f"persistence_threshold must be 0 or more, got {persistence_threshold}")
    if not isinstance(prefetch, bool) and int(prefetch) < 0:
        raise ShardingError(f"prefetch must be True, False or a number of elements >= 0, got {prefetch}")
    return ShardedModel(model, _unit_modules(model, units), group, int(persistence_threshold), prefetch, group_fn,
                        gather_pool, reduce_dtype, check_calls, release_memory, param_offload, weights, device)


def _unit_modules(model, units) -> list:
    """The unit modules in module order (outer before inner), the model itself last."""
    units = list(units or [])
    classes = tuple(u for u in units if isinstance(u, type))
    chosen = {id(u) for u in units if isinstance(u, torch.nn.Module)}
    found = [m for m in model.modules() if m is not model and (id(m) in chosen or (classes and isinstance(m, classes)))]
    missing = chosen - {id(m) for m in found} - {id(model)}
    if missing:
        raise ShardingError(f"{len(missing)} of the unit modules given are not submodules of the model")
    return found + [model]


def _owners(model, unit_modules: list):
    """{parameter: the innermost unit module holding every module that uses it} and each
    parameter's first name. A module reached by two paths counts under both."""
    unit_ids = {id(m) for m in unit_modules}
    owner, names = {}, {}

    def walk(module, prefix, chain):  # chain: the unit modules above, root first, itself if a unit
        chain = chain + [module] if id(module) in unit_ids else chain
        for pname, p in module.named_parameters(recurse=False):
            if p in owner:
                owner[p] = _common(owner[p], chain)
            else:
                owner[p] = chain
                names[p] = prefix + pname
        for child_name, child in module.named_children():
            walk(child, f"{prefix}{child_name}.", chain)

    walk(model, "", [])
    return {p: chain[-1] for p, chain in owner.items()}, names


def _common(a: list, b: list) -> list:
    n = 0
    while n < min(len(a), len(b)) and a[n] is b[n]:
        n += 1
    return a[:n]


def _units_using_frozen(model, unit_modules: list) -> set:
    """Ids of unit modules with a frozen parameter inside (their weights may still be read in
    backward after every trainable one has its gradient: they are freed at the end of backward)."""
    return {id(m) for m in unit_modules if any(not p.requires_grad for p in m.parameters())}
