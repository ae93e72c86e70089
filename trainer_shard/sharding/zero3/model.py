"""`ShardedModel`: the ZeRO-3 state of one model (its units, persistent parameters, store and
reducer), what the optimizer and the Trainer ask of it, and whole weights on demand."""

import contextlib
import functools
from pathlib import Path

import torch

from ... import comm
from ...errors import ShardingError
from ...memory import release_freed_memory
from ..partition import plan_layout
from ..reducer import GradReducer
from . import access
from .flat_params import FlatParams
from .calls import CallCheck
from .lifecycle import Lifecycle
from .root import RootRelease
from .unit import Phase, Unit


class ShardedModel(Lifecycle, RootRelease, CallCheck):
    """The ZeRO-3 state of a model; see the package docstring. Built by `shard_model`."""

    def __init__(self, model, unit_modules: list, owner: dict, names: dict, group, persistence_threshold: int,
                 prefetch, group_fn=None, gather_pool: bool = True, reduce_dtype=None, check_calls: bool = True,
                 release_memory: bool = False, param_offload=None, fetch=None, device=None):  # fmt: skip
        from .pool import GatherPool

        self.model, self.group, self.prefetch = model, group, prefetch
        self.param_offload, self.release_memory, self.reduce_dtype = param_offload, release_memory, reduce_dtype
        self.rank, self.world_size = comm.rank_and_size(group)
        self.units, self.persistent, self.persistent_keys, self._handles = [], [], [], []
        key_of = {p: (group_fn(names[p], p) if group_fn else None) for p in owner}
        by_unit = {id(m): {} for m in unit_modules}  # unit -> (key, dtype, trainable) -> params, in model order
        for p, unit_module in owner.items():
            if p.numel() <= persistence_threshold:
                self.persistent.append(p)
                self.persistent_keys.append(key_of[p])
            else:
                by_unit[id(unit_module)].setdefault((key_of[p], p.dtype, p.requires_grad), []).append(p)
        self.pool = GatherPool(gather_pool, param_offload.buffer_count if param_offload else None,
                               shm=lambda: comm.shared_memory_group(group))  # fmt: skip
        module_names = {id(m): name for name, m in model.named_modules()}
        check = self._check_same_call if self.world_size > 1 and check_calls else None
        groups = [ps for module in unit_modules for ps in by_unit[id(module)].values()]
        self.store = self._open_store(groups, module_names, unit_modules, by_unit) if param_offload else None
        self.grad_store = None  # opened by the optimizer when its state is on disk: `gradient_store`
        index = iter(range(len(groups)))
        for module in unit_modules:  # the root last in the list: see `selection.unit_modules`
            if not by_unit[id(module)]:
                continue
            parts = [FlatParams(ps, [names[p] for p in ps], key, self.rank, self.world_size, group, self.pool,
                                self.store, f"{next(index)}.param", fetch, device)
                     for (key, _, _), ps in by_unit[id(module)].items()]  # fmt: skip
            self.units.append(Unit(module, parts, module_names.get(id(module)) or "the model", check,
                                   self._announce_next))  # fmt: skip
            self.units[-1].index, self.units[-1].sharded = len(self.units) - 1, self
        self.root = next((u for u in self.units if u.module is model), None)
        self.parts = [part for unit in self.units for part in unit.parts]
        self._materialize_persistent(fetch, device)
        for part in self.parts:
            for p in part.params:
                p._trainer_shard_zero3 = (self, part)
        for p in self.persistent:
            p._trainer_shard_zero3 = (self, None)
        # parameters offloaded: one unit's reduction in flight (t5-11b's are 0.5 GB each)
        self.reducer = GradReducer(group, reduce_dtype=reduce_dtype, queue_finish=False,
                                   max_in_flight=1 if param_offload is not None else 2)  # fmt: skip
        inner = [u for u in self.units if u is not self.root]  # backward meets them in reverse, the root last
        for unit in [*reversed(inner), *([self.root] if self.root else [])]:
            for part in unit.parts:
                if part.trainable:  # the root's at the end: see the package docstring's "Gradients"
                    self.reducer.add(part, at_end=unit is self.root)
        self._install_call_check()
        self._install_lifecycle(unit_modules)
        self._handles += access.install(self)
        self._original_apply = model._apply
        model._apply = self._refuse_conversion
        self._wrapped_methods = []
        if hasattr(model, "generate"):
            self.register_forward_method("generate")

    @torch.no_grad()
    def _materialize_persistent(self, fetch, device) -> None:
        """Persistent parameters read whole (meta-device models), then every rank takes rank 0's
        values, buffers included (as DDP broadcasts them)."""
        for p in self.persistent:
            if p.device.type == "meta":
                value = fetch(p).to(device=device, dtype=p.dtype, copy=True)
                torch.utils.swap_tensors(p, torch.nn.Parameter(value, requires_grad=p.requires_grad))
            comm.broadcast(p.data, 0, self.group)
        for b in self.model.buffers():
            comm.broadcast(b, 0, self.group)

    def _open_store(self, groups: list, module_names: dict, unit_modules: list, by_unit: dict):
        """[Note: parameter offload] The parameter store, sized for every flat buffer's shard at
        once (one check for room on disk); a unit larger than `buffer_size` is refused here."""
        from ...offload.param_store import ParamStore

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

    def _refuse_conversion(self, fn, *args, **kwargs):
        """`model.to(...)`, `.half()`, `.cuda()` after sharding: a change of the sharded parameters'
        dtype or device is refused (their shards, masters and store would not follow); anything
        else (buffers, persistent parameters, a no-op) goes through."""
        for part in self.parts:
            probe = fn(part.empty)
            if probe.dtype != part.dtype or probe.device != part.empty.device:
                raise ShardingError(f"ZeRO-3: the model's parameters are sharded ({part.dtype} on {part.empty.device}); "
                                    f"converting them to {probe.dtype} on {probe.device} is not supported: cast or "
                                    "move the model before shard_model (the Trainer does it for --bf16/--fp16)")  # fmt: skip
        return self._original_apply(fn, *args, **kwargs)

    # -- the optimizer's side
    def gradient_store(self, nvme_path):
        """[Note: gradient store] The store of the gradient shards kept on disk beside the
        optimizer's state (under `nvme_path`), opened at the first call and closed with the model."""
        from ...offload.param_store import GRAD_FOLDER, GradStore

        if self.grad_store is None:
            self.grad_store = GradStore(nvme_path, rank=self.rank)
        elif self.grad_store.disk.folder.parent != Path(nvme_path) / GRAD_FOLDER:
            raise ShardingError(f"the gradient shards are on disk in {self.grad_store.disk.folder} already; build "
                                f"the optimizer with that nvme_path, not {nvme_path}")  # fmt: skip
        return self.grad_store

    def shard_parameters(self) -> list:
        """What to hand the optimizer: each trainable flat buffer's shard (an fp32 Parameter whose
        `.grad` is its gradient shard) and the trainable persistent parameters, whole."""
        for part in self.parts:
            part.ensure_master()
        return [part.shard_param for part in self.parts if part.trainable] + [
            p for p in self.persistent if p.requires_grad]  # fmt: skip

    def param_groups(self, settings: dict) -> list:
        """Optimizer param groups by the keys `group_fn` gave (`settings`: key -> that group's
        options, e.g. {"decay": {"weight_decay": 0.01}, "no_decay": {"weight_decay": 0.0}})."""
        found = {}
        for part in self.parts:
            if part.trainable:
                part.ensure_master()
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
        on the unsharded model would, wherever the gradient shards are (in memory, offloaded, on
        disk); returns that norm. Collective."""
        if float(norm_type) != 2.0:
            raise ShardingError(f"clip_grad_norm_ supports the 2-norm only, got norm_type={norm_type}")
        parts = [part for part in self.parts if part.trainable and (part.grad_stored or part.grad.device.type != "meta")]
        whole = [p.grad for p in self.persistent if p.grad is not None]
        sharded_sq = sum((part.grad_square_sum() for part in parts), torch.zeros(()))
        device = next((g.device for g in whole), torch.device("cpu"))
        sharded_sq = sharded_sq.to(self._comm_device())
        comm.all_reduce(sharded_sq, group=self.group)  # the padding is zero: it adds nothing
        sharded_sq = sharded_sq.to(device)
        whole_sq = sum((g.float().pow(2).sum() for g in whole), torch.zeros((), device=device))  # same on every rank
        total = (sharded_sq + whole_sq).sqrt()
        coef = float((max_norm / (total + 1e-6)).clamp(max=1.0))
        if coef < 1.0:
            for part in parts:
                part.scale_grad(coef)
            for g in whole:
                g.mul_(coef)
        return total

    def _comm_device(self) -> torch.device:
        return self.parts[0].buffer.device if self.parts else torch.device("cpu")

    # -- accounting
    def held_parameter_bytes(self) -> dict:
        """Bytes of parameters this rank holds right now, by kind: "shards" (each unit's slice, in
        the parameters' dtype, frozen ones included), "masters" (separate fp32 masters, 16-bit
        only), "persistent" (whole small parameters), "gathered" (flat buffers alive now, read
        ahead from disk included; 0 between steps) and "pool" (gather buffers kept for reuse,
        attached to no unit now); besides, "grad_shards" (the gradient shards in memory, kept
        between steps) and "on_disk" (parameter and gradient shards in the parameter and gradient
        stores' files)."""
        return {
            "shards": sum(part.shard_bytes for part in self.parts),
            "masters": sum(part.master.numel() * 4 for part in self.parts if part.master is not None),
            "persistent": sum(p.numel() * p.element_size() for p in self.persistent),
            "gathered": sum(part.buffer.untyped_storage().nbytes() for part in self.parts),
            "pool": self.pool.free_bytes,
            "grad_shards": sum(part.grad_bytes for part in self.parts),
            "on_disk": sum(s.bytes()["disk"] for s in (self.store, self.grad_store) if s is not None),
        }

    # -- whole parameters on demand
    @contextlib.contextmanager
    def gathered(self, units=None, writeback: bool = False):
        """Hold `units` (default: all; `full_state_dict` takes one at a time) gathered in the
        block, their parameters readable as `module.weight`; with `writeback`, what the block
        wrote into their parameters is kept (every rank must have written the same). Collective."""
        units = self.units if units is None else units
        for unit in units:
            unit.holds += 1
            unit.gather()
            if writeback:  # every rank writes: on memory of its own ([Note: gathered in shared memory])
                for part in unit.parts:
                    part.make_private()
        try:
            yield
            if writeback:
                for part in (part for unit in units for part in unit.parts):
                    part.write_back()
        finally:
            for unit in units:
                unit.holds -= 1
                if unit.holds == 0 and unit.phase is Phase.IDLE:
                    unit.release()

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """The model's state dict, whole, on every rank, gathered one unit at a time (tied
        parameters under every name they have, as `model.state_dict()`), every tensor a copy.
        Collective."""
        state = self.model.state_dict()  # the sharded parameters' entries are copies already
        shared = {t.untyped_storage()._cdata for t in [*self.persistent, *self.model.buffers()]}
        return {k: v.clone() if v.untyped_storage()._cdata in shared else v for k, v in state.items()}

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict) -> None:
        """Load whole weights (as `full_state_dict` gives, or the unsharded model's state dict;
        any mapping that reads tensors by name) unit by unit; every parameter must be there
        under one of its names (`model.load_state_dict` does the same, strictly by name). An
        optimizer's state is left as it is. Collective."""
        where = {}  # a tied parameter needs one of its names there
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
                for part in unit.parts:
                    for p, view in zip(part.params, part.views):
                        view.copy_(state_dict[where[id(p)]])
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
        self._drop_announcement()
        self.pool.clear()
        for store in (self.store, self.grad_store):
            if store is not None:
                store.close()
        self.grad_store = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        access.uninstall(self.model)
        self.model._apply = self._original_apply
        self.reducer.close()
        for name in self._wrapped_methods:
            delattr(self.model, name)
        self._wrapped_methods = []

    def _release_freed_memory(self) -> None:
        release_freed_memory()
