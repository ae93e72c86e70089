"""`ShardedOptimizer`: ZeRO-1 and ZeRO-2 around any elementwise torch optimizer.

    model = DDP(model)                       # ZeRO-1 (stage=1): gradients all-reduced by DDP
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, lr=1e-3)
    # or, ZeRO-2: no DDP; gradients reduce-scattered by hooks as backward runs
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=2, lr=1e-3)
    # or, ZeRO-3: the parameters sharded first, unit by unit (zero3.shard_model)
    shard_model(model, units=[T5Block]); opt = ShardedOptimizer(model.parameters(), optim=..., stage=3)
    loss.backward(); opt.clip_grad_norm(1.0); opt.step(); opt.zero_grad()

Each rank steps only its shard of every parameter group: fp32 master weights, fp32 gradients
and the inner optimizer's state live for that shard alone (see `flat.FlatGroup`); after the
step the updated shards are all-gathered back into the model's parameters (in their own dtype,
bf16 or fp16 for mixed precision).

With `offload=OffloadSpec(...)` the master weights and the inner optimizer's state of the shard
live in the offload engine's store (CPU RAM or disk) instead, and are streamed through a CPU
step chunk by chunk (see `offload.engine`); the gradient shard stays in the parameters' dtype.
Who holds the state is the stepper's business (`stepper.Stepper`: `OnDevice` or `OffloadEngine`);
this class does not branch on where things live.

[Note: collective methods] The constructor, `add_param_group`, `step`, `clip_grad_norm`,
`prepare_grads`, `consolidate_state_dict` and `load_state_dict` are collectives: call them on
every rank, in the same order, or the job hangs.

Where it follows torch's optimizers and `ZeroRedundancyOptimizer`, and where it differs:
`param_groups` and `defaults` hold every hyperparameter of the inner optimizer, defaults filled
in; `state_dict()` is the full, unsharded state after `consolidate_state_dict(to=...)` on that
rank and raises elsewhere (`NotConsolidatedError`), except before the first step, when the
state is empty and any rank can say so; `local_state_dict()` is this rank's shard alone.
Parameters that start or stop requiring grad: see [Note: trainability] in frozen.py. A second
optimizer on the same parameters: see [Note: one optimizer per parameter] in owners.py.
"""

import contextlib
import inspect
import logging
import math
import weakref
from collections import defaultdict

import torch
from torch.autograd.profiler import record_function

from .. import comm
from ..constants import BUCKET_NUMEL, CHUNK_NUMEL
from ..errors import ShardingError
from ..memory import release_freed_memory
from ..offload.engine import OffloadEngine, per_element_state
from . import owners
from .flat import FlatGroup
from .frozen import Held
from .norms import power_sum
from .partition import plan_layout
from .on_device import OnDevice, per_element
from .reducer import MAX_16BIT_RANKS, GradReducer
from .repartition import TensorSource, fill_shard
from .scaler import DynamicLossScaler
from .stepper import Stepper

logger = logging.getLogger(__name__)

# torch.optim's optimizers whose update of each element depends only on that element's own
# gradient and state, so that stepping flat shards equals stepping whole tensors; a subclass of
# one is too, as long as it keeps its `step`.
ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam", "RAdam", "ASGD"}
_ELEMENTWISE_CLASSES = tuple(getattr(torch.optim, name) for name in sorted(ELEMENTWISE))


class NotConsolidatedError(ShardingError, RuntimeError):
    """`state_dict()` where no full state was consolidated (a RuntimeError, as ZeroRedundancyOptimizer's)."""

_NOT_ELEMENTWISE = {
    "Adafactor": "it factors the second moment over each weight matrix's rows and columns",
    "LBFGS": "it takes whole-model line-search steps",
    "SparseAdam": "it needs sparse gradients",
}


class ShardedOptimizer(torch.optim.Optimizer):
    """See the module docstring. Constructor as `ZeroRedundancyOptimizer` and fairscale's `OSS`.

    Args:
        params: tensors or param-group dicts, as for any torch optimizer.
        optim: the optimizer class to shard (`optimizer_class=` is an alias).
        group: the process group (default: the world).
        stage: 1 (optimizer state sharded), 2 (gradients too) or 3 (parameters too: the
            parameters must come from a model `zero3.shard_model` sharded, whose flat buffers
            and gradient reduction the optimizer takes as they are; see [Note: ZeRO-3 flats]).
        bucket_numel: elements per communication bucket.
        loss_scaler: a `DynamicLossScaler` for fp16 (or True for the default one).
        offload: an `OffloadSpec`: master weights and optimizer state in CPU RAM or on disk.
        overlap_comm: ZeRO-2: reduce buckets while backward runs (False: all at its end).
        grad_dtype: the gradient shard's dtype: fp32 (default without offload), or, with offload,
            the parameters' 16-bit dtype (the default there: half the memory; micro-batches are
            then summed in 16 bits, which is logged once).
        reduce_dtype: ZeRO-2: the dtype gradient buckets are summed over ranks in (default: the
            parameters' up to `reducer.MAX_16BIT_RANKS` ranks, fp32 beyond; see [Note: 16-bit
            reduction] in reducer.py).
        assume_elementwise: shard an optimizer not in `ELEMENTWISE` anyway, on your word.
        **defaults: the inner optimizer's arguments (lr, betas, weight_decay, fused...).
    """

    def __init__(self, params, optim=None, group=None, *, optimizer_class=None, stage: int = 1,
                 bucket_numel: int = BUCKET_NUMEL, loss_scaler=None, offload=None,
                 assume_elementwise: bool = False, overlap_comm: bool = True, grad_dtype=None, reduce_dtype=None,
                 **defaults):  # fmt: skip
        self.optim_class = _resolve_class(optim, optimizer_class, assume_elementwise)
        if stage not in (1, 2, 3):
            raise ShardingError(f"stage must be 1 (ZeRO-1), 2 (ZeRO-2) or 3 (ZeRO-3), got {stage!r}")
        if reduce_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise ShardingError(f"reduce_dtype must be torch.float32, torch.bfloat16 or torch.float16, not {reduce_dtype}")
        self.stage = stage
        self.group = group
        self.rank, self.world_size = comm.rank_and_size(group)
        self.bucket_numel = int(bucket_numel)
        self.loss_scaler = DynamicLossScaler() if loss_scaler is True else (loss_scaler or None)
        self.sharded_model = None  # stage 3: the zero3.ShardedModel whose flats this steps
        self.flats = []  # FlatGroups; `_flat_owner[i]` is the param group of flats[i]
        self._flat_owner = []
        self._flattened = set()  # the parameters in some flat; the others wait: [Note: trainability]
        self.closed = False
        self._closed_why = None
        self.optim_kwargs = dict(defaults)  # what the inner optimizers are built with
        self.reducer = GradReducer(group, overlap=overlap_comm, reduce_dtype=reduce_dtype) if stage == 2 else None
        self._building = True
        super().__init__(params, _full_defaults(self.optim_class, defaults))  # calls add_param_group for each group
        self._building = False
        self.offload = offload
        self.grad_dtype = grad_dtype
        self._take_over([p for g in self.param_groups for p in g["params"]])
        if self.reducer is not None and stage == 2:  # hooks go with the optimizer, even one never closed
            weakref.finalize(self, GradReducer.close, self.reducer)
        # where the masters and the state live, and who steps them: see stepper.py
        self.stepper: Stepper
        if offload is None:
            self.stepper = OnDevice(self.optim_class, self.optim_kwargs)
        else:
            self.stepper = OffloadEngine(offload, self.optim_class, self.optim_kwargs, rank=self.rank)
        for index in range(len(self.param_groups)):
            self._build_flats(index)
        release_freed_memory()  # the parameters' old storage, freed into the heap by the move above
        self._grad_factors = []  # offload: 1/loss scale and clip coefficients, applied in the step
        self._fresh = True  # no step taken: the state is empty and the masters equal the parameters
        self._grads_ready = False
        self.found_inf = False
        self.step_was_skipped = False
        self._consolidated = None
        self._consolidated_to = None
        self._logged_accumulation = False
        self._log_reduction()

    def _log_reduction(self) -> None:
        """Say so when buckets are summed in 16 bits over more ranks than the default allows."""
        if self.reducer is None or self.rank != 0:
            return
        if self.world_size > MAX_16BIT_RANKS and self.reducer.reduce_dtype in (torch.bfloat16, torch.float16):
            logger.warning("reduce_dtype=%s over %d ranks trades accuracy for bandwidth: a ring sum rounds once per "
                           "rank (at 64 ranks, bf16 is 4.0x as far from the exact mean as one rounding; "
                           "bench/results/grad_reduction.md); the default reduces in fp32 beyond %d ranks",
                           self.reducer.reduce_dtype, self.world_size, MAX_16BIT_RANKS)  # fmt: skip

    @classmethod
    def wrap(cls, optimizer: torch.optim.Optimizer, **kwargs) -> "ShardedOptimizer":
        """Shard an already built (not yet stepped) optimizer: same class, groups and arguments."""
        if optimizer.state:
            raise ShardingError("wrap the optimizer before its first step: its state would be lost")
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        return cls(optimizer.param_groups, optim=type(optimizer), **kwargs, **defaults)

    # ---- construction ----------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        """Add a group; its trainable parameters are flattened, checked across ranks and sharded
        (the others once they require grad: [Note: trainability]). Collective."""
        self._check_open()
        super().add_param_group(param_group)
        if self._building:
            return  # the constructor flattens every group once the inner optimizer exists
        self._take_over(self.param_groups[-1]["params"])
        self._build_flats(len(self.param_groups) - 1)

    def _take_over(self, params) -> None:
        """Close every other live optimizer that holds any of `params` (owners.py)."""
        for previous in owners.claim(self, params):
            previous.close(why="a newer ShardedOptimizer took its parameters over")

    def _build_flats(self, index: int, params=None) -> None:
        """Flatten `params` (default: the trainable ones of group `index`), one FlatGroup per
        dtype and device. Collective."""
        if params is None:
            params = [p for p in self.param_groups[index]["params"] if p.requires_grad]
        _check_same_everywhere(index, params, self.group)
        if self.stage == 3:
            params = self._adopt_zero3_flats(index, params)
            if not params:
                return
        self._flattened.update(params)
        by_kind = defaultdict(list)
        for p in params:
            by_kind[(p.dtype, p.device)].append(p)
        for kind_params in by_kind.values():
            layout = plan_layout([p.numel() for p in kind_params], self.world_size, self.bucket_numel)
            grad_dtype = self.grad_dtype
            if grad_dtype is not None and grad_dtype not in (torch.float32, kind_params[0].dtype):
                raise ShardingError(f"grad_dtype must be float32 or the parameters' dtype {kind_params[0].dtype}, "
                                    f"got {grad_dtype}")  # fmt: skip
            if grad_dtype not in (None, torch.float32) and self.offload is None:
                raise ShardingError("a 16-bit gradient shard needs offload: the inner optimizer steps fp32 masters "
                                    "from fp32 gradients")  # fmt: skip
            # ZeRO-1 (and ZeRO-3's persistent parameters) step views of the all-reduced `.grad`s:
            # [Note: gradient views] in flat.py
            flat = FlatGroup(kind_params, layout, self.rank, self.group, offloaded=self.offload is not None,
                             grad_dtype=grad_dtype, grad_views=self.stage != 2)  # fmt: skip
            comm.broadcast(flat.buffer, 0, self.group)  # every rank starts from rank 0's weights
            flat.refresh_master()
            self.flats.append(flat)
            self._flat_owner.append(index)
            self.stepper.add(flat, self._hyperparameters(len(self.flats) - 1))
            if self.reducer is not None and self.stage == 2:
                self.reducer.add(flat)

    def _adopt_zero3_flats(self, index: int, params: list) -> list:
        """[Note: ZeRO-3 flats] At stage 3 the flat buffers are the sharded model's own
        (`zero3.FlatParams`: one per unit and param-group key), and so is the gradient reduction:
        each is stepped here as a `FlatGroup` would be, its shard standing for this rank's slice
        of the buffer, and nothing is all-gathered after the step (the next forward gathers). The
        parameters the model keeps whole (persistent: small or frozen ones), their gradients
        all-reduced by the model, are flattened here as at stage 1. Returns those."""
        from .zero3 import sharded_part

        found = [sharded_part(p) for p in params]
        if any(f is None for f in found):
            raise ShardingError("stage=3 steps the parameters of a model zero3.shard_model sharded; shard the model "
                                "first (shard_model(model, ...)), then build the optimizer on its parameters")  # fmt: skip
        models = {id(f[0]): f[0] for f in found}
        if len(models) > 1:
            raise ShardingError("stage=3: the parameters come from several sharded models; one optimizer per model")
        sharded = next(iter(models.values()), None)
        if sharded is not None:
            if sharded.world_size != self.world_size:
                raise ShardingError(f"stage=3: the model is sharded over {sharded.world_size} ranks, the optimizer's "
                                    f"group has {self.world_size}; use the same process group")  # fmt: skip
            self.sharded_model = sharded
            self.reducer = sharded.reducer
        ours = set(params)
        parts = list({id(f[1]): f[1] for f in found if f[1] is not None}.values())
        for part in parts:
            outside = [n for p, n in zip(part.params, part.names) if p not in ours]
            if outside:
                raise ShardingError(f"stage=3: param group {index} holds some of the parameters of one flat buffer and "
                                    f"not {outside[:3]}; shard the model with a group_fn that gives every param "
                                    "group its own key, so no flat buffer spans two groups")  # fmt: skip
            part.configure(self.offload is not None, self.grad_dtype)
            self._flattened.update(part.params)
            self.flats.append(part)
            self._flat_owner.append(index)
            self.stepper.add(part, self._hyperparameters(len(self.flats) - 1))
        return [p for p, f in zip(params, found) if f[1] is None]

    def _hyperparameters(self, flat_index: int) -> dict:
        """The outer group's settings (lr as the scheduler left it, weight_decay...) for flats[i]."""
        group = self.param_groups[self._flat_owner[flat_index]]
        return {k: v for k, v in group.items() if k not in ("params", "param_names")}

    def _adopt_newly_trainable(self) -> None:
        """Flatten the parameters that require grad now but did not when their group was added,
        and bring their gradients (in `.grad`, from before they had hooks) into the new shards.
        Collective when any parameter waits: every rank must unfreeze the same ones. See
        [Note: trainability] in frozen.py."""
        if len(self._flattened) == sum(len(g["params"]) for g in self.param_groups):
            return  # every parameter is in a flat: the common case, checked in a sum per step
        waiting = [(i, [p for p in g["params"] if p not in self._flattened]) for i, g in enumerate(self.param_groups)]
        waiting = [(i, params) for i, params in waiting if params]
        if not waiting:
            return
        ready = [(i, [p for p in params if p.requires_grad]) for i, params in waiting]
        ready = [(i, params) for i, params in ready if params]
        if ready and self.stage == 3:
            raise ShardingError("stage=3: parameters frozen when the model was sharded require grad now; the sharded "
                                "model keeps them whole and never reduces their gradients: set requires_grad before "
                                "shard_model")  # fmt: skip
        count = sum(len(params) for _, params in ready)
        counts = torch.tensor([count, -count], device=self._device())
        most, fewest = comm.all_reduce(counts, op=torch.distributed.ReduceOp.MAX, group=self.group).tolist()
        if most != -fewest:
            raise ShardingError(f"ranks unfroze different parameters ({-fewest} to {most} on different ranks, "
                                f"{count} here); change requires_grad the same way on every rank")  # fmt: skip
        before = len(self.flats)
        for index, params in ready:
            self._build_flats(index, params)
        for flat in self.flats[before:]:
            if self.reducer is not None:
                self.reducer.reduce_from_grads(flat)
        if ready:
            logger.info("%d parameters that did not require grad when the optimizer was built do now: sharded and "
                        "stepped from this step on", count)  # fmt: skip

    @property
    def optim(self):
        """The inner torch optimizer over the master shards (None when they are offloaded)."""
        return getattr(self.stepper, "optim", None)

    @property
    def fresh(self) -> bool:
        """No step taken and no state loaded: the state is empty, the masters equal the parameters."""
        return self._fresh

    def group_of(self, flat_index: int) -> int:
        """The index of the param group `flats[flat_index]` belongs to."""
        return self._flat_owner[flat_index]

    def _check_open(self) -> None:
        if self.closed:
            raise ShardingError(f"this ShardedOptimizer is closed ({self._closed_why}): it holds no shards any more; "
                                "step the optimizer that replaced it, or build a new one")  # fmt: skip

    # ---- gradients -------------------------------------------------------------------------

    @torch.no_grad()
    def prepare_grads(self) -> None:
        """Bring this rank's gradient shards up to date, unscaled, and check them (once a step).

        ZeRO-1 copies its slices out of the all-reduced `.grad`s; ZeRO-2 already has them.
        With a loss scaler, divides by the scale and agrees with all ranks on overflow.
        Collective when a loss scaler is set.
        """
        if self._grads_ready:
            return
        self._check_open()
        if self.reducer is not None and self.reducer.pending:
            self.reducer.finish()
        self._adopt_newly_trainable()
        for flat in self.flats:
            if self.stage == 1 or (self.stage == 3 and isinstance(flat, FlatGroup)):
                flat.copy_grads_to_shard()
            else:
                flat.zero_stale()  # buckets no backward has reduced into since the last step
        self._log_16_bit_accumulation()
        self.found_inf = False
        if self.loss_scaler is not None:
            bad = torch.zeros(1, device=self._device())
            for flat in self.flats:
                if flat.grad_stored:
                    bad += not math.isfinite(flat.grad_sq)
                else:
                    for grad in flat.grad_tensors():
                        bad += ~_all_finite(grad)
            self.found_inf = bool(comm.all_reduce(bad, group=self.group).item() > 0)
            self._scale_grads(1.0 / self.loss_scaler.scale)
        self._grads_ready = True

    def _log_16_bit_accumulation(self) -> None:
        """Once: micro-batches were summed in a 16-bit gradient shard (grad_dtype)."""
        if self._logged_accumulation:
            return
        flat = next((f for f in self.flats if f.accumulated and f.grad.dtype != torch.float32), None)
        if flat is None:
            return
        self._logged_accumulation = True
        if self.rank == 0:
            logger.warning("gradient accumulation sums the micro-batches in the %s gradient shard (grad_dtype; with "
                           "--offload, data_types.grad_accum_dtype, 16-bit by default there): half the memory of fp32, "
                           "at a rounding per micro-batch (measured: the sum of 4 is 1.6x as far from the exact one "
                           "as one rounding, of 64 4.5x; bench/results/grad_reduction.md); grad_dtype=torch.float32 "
                           "(grad_accum_dtype fp32) sums them exactly", flat.grad.dtype)  # fmt: skip

    def _scale_grads(self, factor) -> None:
        """Multiply the gradient shards by `factor`: in place in fp32, or (offload) in the step,
        on each fp32 chunk, so a 16-bit shard is never rescaled in its own precision."""
        if self.offload is not None:
            self._grad_factors.append(factor)
            return
        for flat in self.flats:
            for grad in flat.grad_tensors():
                grad.mul_(factor)

    def _pending_factor(self) -> float:
        return math.prod(float(factor) for factor in self._grad_factors)

    def _device(self):
        if self.flats:
            return self.flats[0].buffer.device
        first = next((p for g in self.param_groups for p in g["params"]), None)
        return first.device if first is not None else torch.device("cpu")

    def _state_device(self):
        """Where whole state shards are read to: the compute device, or the CPU when offloaded."""
        return torch.device("cpu") if self.offload is not None else self._device()

    @torch.no_grad()
    def global_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of all gradients across all shards, unclipped. Collective."""
        self.prepare_grads()
        norm_type = float(norm_type)
        with record_function("trainer_shard::grad_norm"):
            scale = abs(self._pending_factor())
            zero = torch.zeros((), dtype=torch.float64, device=self._device())
            stored = [f for f in self.flats if f.grad_stored]  # ZeRO-3, on disk: the norm kept as written
            if stored and norm_type != 2.0:
                raise ShardingError(f"with the gradients on disk (offload_param nvme) the gradient norm is the 2-norm "
                                    f"only, got norm_type={norm_type}")  # fmt: skip
            flats = [f for f in self.flats if not f.grad_stored]
            if norm_type == float("inf"):
                maxima = (g.abs().max().float() for f in flats for g in f.grad_tensors() if g.numel())
                local = torch.stack([zero.float(), *maxima]).max().reshape(1)
                return comm.all_reduce(local, op=torch.distributed.ReduceOp.MAX, group=self.group)[0] * scale
            local = sum((power_sum(g, norm_type) for f in flats for g in f.grad_tensors()), zero).reshape(1)
            local += sum(f.grad_sq for f in stored)
            total = comm.all_reduce(local, group=self.group)[0] ** (1.0 / norm_type)
            return (total * scale).float() if scale != 1.0 else total.float()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over all shards; returns the norm before clipping. Collective.

        Same rule as `torch.nn.utils.clip_grad_norm_`: scale by max_norm / (norm + 1e-6) when below 1.
        """
        total = self.global_norm(norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if coef < 1.0:
            self._scale_grads(coef)
        return total

    def grad_norm(self) -> torch.Tensor:
        """The global 2-norm of the gradients, unclipped. Collective."""
        return self.global_norm(2.0)

    @contextlib.contextmanager
    def no_sync(self):
        """ZeRO-2: backward passes in this context keep their gradients in `.grad` (full size) and
        communicate nothing; the next backward outside it reduces the accumulated sum once.
        ZeRO-1 leaves gradient reduction to DDP: use DDP's own `no_sync` there."""
        if self.reducer is None:
            yield
            return
        previous, self.reducer.sync = self.reducer.sync, False
        try:
            yield
        finally:
            self.reducer.sync = previous

    # ---- step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):
        """Step this rank's shards, then all-gather the updated parameters. Collective."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_open()
        self._consolidated = None  # the state it gathered is stale from now on
        with record_function("trainer_shard::optim_step"):
            for index, flat in enumerate(self.flats):
                if flat.follow_outside_edits():
                    self.stepper.refresh_master(index, flat)
                    flat.mark_seen()
            self.prepare_grads()
            if self.found_inf:
                self.skip_step()
                return loss
            if self.flats:
                hypers = [self._hyperparameters(i) for i in range(len(self.flats))]
                held = Held(self.stepper, self.flats, self._state_device())  # frozen since: [Note: trainability]
                self.stepper.step(hypers, list(self._grad_factors))
                held.restore()
                self._fresh = False
            if self.loss_scaler is not None:
                self.loss_scaler.update(False)
        with record_function("trainer_shard::all_gather"):
            for flat in self.flats:
                flat.gather_params()
        self.step_was_skipped = False
        self._clear_grads()
        return loss

    def skip_step(self) -> None:
        """Drop this step's gradients (fp16 overflow on some rank); every rank does the same."""
        if self.loss_scaler is not None:
            self.loss_scaler.update(True)
        logger.info("fp16 overflow: step skipped, loss scale now %s", getattr(self.loss_scaler, "scale", None))
        self.step_was_skipped = True
        self._clear_grads()

    def _clear_grads(self) -> None:
        for flat in self.flats:
            flat.mark_grads_stale()
            flat.accumulated = False
        self._grad_factors = []
        self._grads_ready = False
        self.found_inf = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self._clear_grads()

    # ---- state -----------------------------------------------------------------------------

    def _param_ids(self) -> dict:
        """{param: index} in the standard torch numbering (groups in order, params in order)."""
        ids, n = {}, 0
        for group in self.param_groups:
            for p in group["params"]:
                ids[p] = n
                n += 1
        return ids

    def shard_tensors(self, index: int) -> dict:
        """The state of flats[index] on this rank: per-element tensors, whole shards (read from
        wherever the stepper keeps them), and scalars ("step"); empty while fresh."""
        if self._fresh:
            return {}
        numel = self.flats[index].layout.shard_numel
        names = [n for n in self.stepper.tensor_names(index) if n != "master"]
        out = {n: self.stepper.read(index, n, 0, torch.empty(numel, device=self._state_device())) for n in names}
        return {**out, **self.stepper.scalar_state(index)}

    def master_shard(self, index: int):
        """This rank's fp32 master shard of flats[index]; None for fp32 parameters, which are
        their own masters (saved with the model)."""
        flat = self.flats[index]
        if flat.dtype == torch.float32:
            return None
        return self.stepper.read(index, "master", 0, torch.empty(flat.layout.shard_numel, device=self._state_device()))

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the full optimizer state on rank `to`, in the local optimizer's format. Collective.

        Afterwards `state_dict()` on rank `to` returns what the unsharded optimizer would, with
        the fp32 master weights under "master_params" when the parameters are 16-bit, until the
        next `step` (which frees it: a saved state is never stale) or `release_consolidated`.
        """
        self._check_open()
        self._consolidated_to = to
        ids = self._param_ids()
        state, masters = {}, {}
        for index, flat in enumerate(self.flats):
            inner = self.shard_tensors(index)
            like = _shard_like(flat)
            keys = comm.all_gather_objects(sorted(k for k, v in inner.items() if per_element(k, v, like)), self.group)[0]
            pieces = {key: _gather_to(inner[key], to, self.group) for key in keys}
            master = self.master_shard(index)
            if master is not None:  # fp32 parameters are their own masters: nothing to gather
                pieces["__master__"] = _gather_to(master, to, self.group)
            if self.rank != to:
                continue
            for key, stacked in pieces.items():
                for slot, full in zip(flat.layout.slots, _unshard(stacked, flat, self.world_size)):
                    pid = ids[flat.params[slot.index]]
                    if key == "__master__":
                        masters[pid] = full
                    else:
                        state.setdefault(pid, {})[key] = full
            for p in flat.params:
                for key, value in inner.items():
                    if key not in pieces:  # scalars such as "step": the same on every rank
                        state.setdefault(ids[p], {})[key] = value.clone() if torch.is_tensor(value) else value
        if self.rank == to:
            result = {"state": state, "param_groups": self._groups_for_state_dict(ids)}
            if masters:
                result["master_params"] = masters
            if self.loss_scaler is not None:
                result["loss_scaler"] = self.loss_scaler.state_dict()
            self._consolidated = result
        else:
            self._consolidated = None

    def _groups_for_state_dict(self, ids) -> list:
        return [{**{k: v for k, v in g.items() if k != "params"}, "params": [ids[p] for p in g["params"]]}
                for g in self.param_groups]  # fmt: skip

    def release_consolidated(self) -> None:
        """Free the state gathered by `consolidate_state_dict`."""
        self._consolidated = None

    def state_dict(self) -> dict:
        """The full state, in the unsharded optimizer's format: on rank `to` after
        `consolidate_state_dict(to)` (and before the next step); before the first step, the empty
        state, on any rank. Otherwise raises `NotConsolidatedError`, as ZeroRedundancyOptimizer
        does: this rank's shard alone is `local_state_dict()`.

        [Note: state_dict callers] accelerate's `prepare()` round-trips the state of the optimizer
        it wraps (`AcceleratedOptimizer.__init__`: state_dict, moved to the device, load_state_dict)
        before training starts; the fresh optimizer's empty state makes that free (nothing is read
        from an offload store, nothing moved). The Trainer's checkpoints do not call it: each rank
        streams its shard (state_io.write_shard).
        """
        if self._consolidated is not None:
            return self._consolidated
        self._check_open()
        if self._fresh:
            return self._empty_state_dict()
        if self._consolidated_to is not None and self._consolidated_to != self.rank:
            where = f"it was consolidated on rank {self._consolidated_to}: call state_dict() there"
        else:
            where = (f"call consolidate_state_dict(to={self.rank}) on every rank first (a collective; the state may "
                     "have changed since an earlier one)")  # fmt: skip
        raise NotConsolidatedError(f"the optimizer state is sharded across ranks and not consolidated here: {where}; "
                                   "or save this rank's shard alone with local_state_dict()")  # fmt: skip

    def _empty_state_dict(self) -> dict:
        """What the unsharded optimizer's `state_dict()` is before its first step."""
        result = {"state": {}, "param_groups": self._groups_for_state_dict(self._param_ids())}
        if self.loss_scaler is not None:
            result["loss_scaler"] = self.loss_scaler.state_dict()
        return result

    def local_state_dict(self) -> dict:
        """This rank's shard of the state: it loads back (`load_state_dict`) only on the same
        rank and world size. Reads the whole shard from wherever it lives (offload store included)."""
        self._check_open()
        indices = range(len(self.flats))
        return {
            "shard": {"rank": self.rank, "world_size": self.world_size, "stage": self.stage},
            "fresh": self._fresh,
            "inner": [self.shard_tensors(i) for i in indices],
            # fp32 parameters are their own masters (saved with the model): None
            "masters": [None if self._fresh else self.master_shard(i) for i in indices],
            "param_groups": self._groups_for_state_dict(self._param_ids()),
            **({"loss_scaler": self.loss_scaler.state_dict()} if self.loss_scaler is not None else {}),
        }

    def _load_shard(self, state_dict: dict) -> None:
        shard = state_dict["shard"]
        if (shard["rank"], shard["world_size"]) != (self.rank, self.world_size):
            raise ShardingError(
                f"this optimizer state is rank {shard['rank']}'s shard of {shard['world_size']}, but this is rank "
                f"{self.rank} of {self.world_size}; load the consolidated state (consolidate_state_dict) instead"
            )
        if "loss_scaler" in state_dict and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
        if state_dict.get("fresh") and self._fresh:
            return  # a state saved before any step, into an optimizer before any step: nothing to load
        for index, (state, master) in enumerate(zip(state_dict["inner"], state_dict["masters"])):
            flat = self.flats[index]
            self.stepper.clear_state(index)
            like = _shard_like(flat)
            for key, value in state.items():  # the same rank's shard: no re-partitioning
                if per_element(key, value, like):
                    self.stepper.write(index, key, 0, value)
            if state:
                self.stepper.set_scalar_state(index, {k: v for k, v in state.items() if not per_element(k, v, like)})
            if master is not None:
                self.stepper.write(index, "master", 0, master)
            else:
                self.stepper.refresh_master(index, flat)
            flat.mark_seen()
        self._fresh = bool(state_dict.get("fresh"))

    @torch.no_grad()
    def load_repartitioned(self, source, names: list, saved: list) -> None:
        """Fill this rank's shards from state saved at any world size (repartition.py): for flat
        i, `names[i][j]` is what `source` calls `flats[i].params[j]`, and `saved[i]` is the
        `(keys, scalars)` to load, keys the per-element state names (with "master" when the
        source holds the fp32 masters; otherwise the masters are read from the parameters) and
        scalars None for a fresh flat. Not collective: each rank reads only its own part."""
        for index, (flat, (keys, scalars)) in enumerate(zip(self.flats, saved)):
            self.stepper.clear_state(index)
            for key in keys:
                fill_shard(self.stepper, index, flat, key, source, names[index])
            if "master" not in keys:
                self.stepper.refresh_master(index, flat)
            if scalars is not None:
                self.stepper.set_scalar_state(index, scalars)
            flat.mark_seen()
        self._fresh = all(scalars is None for _, scalars in saved)

    def _check_state_names(self, keys: list) -> None:
        missing = sorted(set(per_element_state(self.optim_class, self.optim_kwargs)) - set(keys))
        if missing:
            raise ShardingError(f"the optimizer state lacks {missing} that {self.optim_class.__name__} keeps for "
                                "every element; load a state saved by the same optimizer")  # fmt: skip

    @torch.no_grad()
    def params_from_masters(self) -> None:
        """The model follows the masters: each rank casts its shard into the parameters, then the
        all-gather gives every rank all of them. Collective."""
        for index, flat in enumerate(self.flats):
            numel = flat.layout.shard_numel
            buffer = torch.empty(min(CHUNK_NUMEL, max(numel, 1)))
            for start in range(0, numel, CHUNK_NUMEL):
                chunk = buffer[: min(CHUNK_NUMEL, numel - start)]
                self.stepper.read(index, "master", start, chunk)
                flat.write_shard(start, chunk)
            flat.gather_params()
            flat.mark_seen()

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state (consolidated, or a local optimizer's): each rank keeps its shard of it.

        Also takes the shard `state_dict()` returned on this same rank.
        """
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise ShardingError(
                f"optimizer state has {len(groups) if isinstance(groups, list) else 'no'} param groups, "
                f"this optimizer has {len(self.param_groups)}"
            )
        self._check_open()
        self._consolidated = None
        for mine, saved in zip(self.param_groups, groups):
            mine.update({k: v for k, v in saved.items() if k != "params"})
        if "shard" in state_dict:
            self._load_shard(state_dict)
            return
        if self._fresh and not state_dict.get("state") and state_dict.get("master_params") is None:
            # an empty state into an empty optimizer (accelerate's round trip: [Note: state_dict callers])
            if "loss_scaler" in state_dict and self.loss_scaler is not None:
                self.loss_scaler.load_state_dict(state_dict["loss_scaler"])
            return
        ids = self._param_ids()
        saved_state = state_dict.get("state", {})
        masters = state_dict.get("master_params")
        full, names, saved = {}, [], []
        for flat in self.flats:
            pids = [ids[p] for p in flat.params]
            names.append(pids)
            per_param = [saved_state.get(pid, saved_state.get(str(pid), {})) for pid in pids]
            keys, scalars = [], {}
            for key in set().union(*(s.keys() for s in per_param)):
                values = [s.get(key) for s in per_param]
                if all(per_element(key, v, p) for v, p in zip(values, flat.params)):
                    keys.append(key)
                else:
                    value = values[0]  # placed by the stepper, as torch places "step" (set_scalar_state)
                    scalars[key] = value.detach().clone() if torch.is_tensor(value) else value
            for pid, state in zip(pids, per_param):
                full[pid] = dict(state)
            if masters is not None and flat.dtype != torch.float32:  # fp32 parameters are their own masters
                keys.append("master")
                for pid in pids:
                    full[pid]["master"] = masters.get(pid, masters.get(str(pid)))
            if any(per_param):
                self._check_state_names(keys)
            saved.append((sorted(keys), scalars if any(per_param) else None))
        self.load_repartitioned(TensorSource(full), names, saved)
        if masters is not None:
            self._fresh = False
        if "loss_scaler" in state_dict and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(state_dict["loss_scaler"])

    # ---- reporting -------------------------------------------------------------------------

    def shard_bytes(self) -> dict:
        """Bytes this rank holds for its shards on the compute device (master weights, gradients,
        optimizer state) and, offloaded, in the store."""
        return {"grad": sum(f.grad_bytes for f in self.flats),
                **self.stepper.state_bytes()}

    def close(self, why: str = "close() was called") -> None:
        """Remove the gradient hooks and free the shards, the inner state and the offload store (a
        disk store deletes its files). The parameters keep their values and train with any other
        optimizer; this one refuses further use. Also done at exit, and when a newer
        ShardedOptimizer takes the parameters over ([Note: one optimizer per parameter]).
        Idempotent; not collective."""
        if self.closed:
            return
        self.closed, self._closed_why = True, why
        if self.reducer is not None and self.stage == 2:  # at stage 3 it is the sharded model's
            self.reducer.close()
        stepper = getattr(self, "stepper", None)  # None when the constructor failed before building it
        if stepper is not None:
            stepper.close()
        self.flats, self._flat_owner = [], []  # a consolidated state stays: the caller asked for it
        release_freed_memory()

    def __repr__(self) -> str:
        where = f", offload={self.offload.device}" if self.offload is not None else ""
        closed = ", closed" if self.closed else ""
        return (f"ShardedOptimizer(stage={self.stage}, rank={self.rank}/{self.world_size}{where}{closed}, "
                f"optim={self.optim_class.__name__}({self.optim_kwargs}))")  # fmt: skip


def _resolve_class(optim, optimizer_class, assume_elementwise: bool):
    if optim is not None and optimizer_class is not None and optim is not optimizer_class:
        raise ShardingError("pass the optimizer class once: optim= or optimizer_class=, not both")
    cls = optim if optim is not None else optimizer_class
    if cls is None:
        raise ShardingError("ShardedOptimizer needs the optimizer class to shard: optim=torch.optim.AdamW, for example")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ShardingError(f"optim must be a torch.optim.Optimizer class, got {cls!r}")
    if assume_elementwise or _elementwise_base(cls) is not None:
        return cls
    name = cls.__name__
    why = _NOT_ELEMENTWISE.get(name, "it is not known to update each element from its own gradient and state alone")
    base = next((b for b in cls.__mro__[1:] if b in _ELEMENTWISE_CLASSES), None)
    if base is not None:
        why = f"it replaces the step of {base.__name__}, its base"
    raise ShardingError(
        f"cannot shard {name}: {why}, so stepping flat shards might change its results. Sharding works with "
        f"torch.optim's {', '.join(sorted(ELEMENTWISE))} and their subclasses that keep their step; pass "
        f"assume_elementwise=True if {name} is elementwise, or train without --sharded_ddp"
    )


def _elementwise_base(cls):
    """The optimizer of `_ELEMENTWISE_CLASSES` whose update `cls` runs: itself, or the nearest such
    base when `cls` keeps its `step` (torch wraps `step` for its hooks: compared unwrapped). None
    otherwise: a subclass with a step of its own, or a class of another library that only shares
    a name (bitsandbytes' "AdamW" quantizes its state block-wise)."""
    base = next((b for b in cls.__mro__ if b in _ELEMENTWISE_CLASSES), None)
    if base is None or inspect.unwrap(cls.step) is not inspect.unwrap(base.step):
        return None
    return base


def _full_defaults(optim_class, kwargs: dict) -> dict:
    """Every hyperparameter of `optim_class(**kwargs)`, its defaults filled in, as a torch
    optimizer keeps them in `defaults` and in each param group (read from one built on a probe
    tensor). If the probe cannot be built (an option that needs the real parameters' device),
    `kwargs` as given: the inner optimizer's own construction reports what is wrong."""
    try:
        return dict(optim_class([torch.zeros(1, requires_grad=True)], **kwargs).defaults)
    except (TypeError, ValueError, RuntimeError):
        return dict(kwargs)


def _check_same_everywhere(index: int, params: list, group) -> None:
    """Every rank must shard the same parameters, or collectives would mismatch and hang."""
    mine = [(tuple(p.shape), str(p.dtype)) for p in params]
    everyone = comm.all_gather_objects(mine, group)
    for rank, theirs in enumerate(everyone):
        if theirs != mine:
            diff = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
            raise ShardingError(
                f"param group {index}: the parameters differ across ranks (rank {rank} has {len(theirs)}, this rank "
                f"{len(mine)}; first difference at position {diff}); every rank must build the same model"
            )


def _shard_like(flat) -> torch.Tensor:
    """A tensor shaped like `flat`'s shard (no memory): per-element state has this shape."""
    return torch.empty(flat.layout.shard_numel, device="meta")


def _all_finite(t: torch.Tensor, chunk: int = CHUNK_NUMEL) -> torch.Tensor:
    """No inf/NaN in `t` (a bool tensor on its device, so no sync per chunk), checked a chunk at a
    time (no shard-sized temporary)."""
    checks = [torch.isfinite(t[s : s + chunk]).all() for s in range(0, t.numel(), chunk)]
    return torch.stack(checks).all() if checks else torch.ones((), dtype=torch.bool, device=t.device)


def _gather_to(tensor: torch.Tensor, to: int, group):
    """Rank `to` receives every rank's shard-sized tensor stacked [world, n]; others None."""
    rank, world = comm.rank_and_size(group)
    flat = tensor.detach().reshape(-1).contiguous()
    if world == 1:
        return flat.reshape(1, -1).clone()
    import torch.distributed as dist

    gathered = [torch.empty_like(flat) for _ in range(world)] if rank == to else None
    dist.gather(flat, gathered, dst=dist.get_global_rank(group, to) if group else to, group=group)
    return torch.stack(gathered) if rank == to else torch.empty(0)


def _unshard(stacked: torch.Tensor, flat: FlatGroup, world: int) -> list:
    """[world, shard] stacked shards -> one full tensor per parameter (shaped like it)."""
    out = [torch.empty(p.numel(), dtype=stacked.dtype, device=stacked.device) for p in flat.params]
    for rank in range(world):
        for seg in flat.layout.segments(rank):
            out[seg.index][seg.param_start : seg.param_start + seg.numel] = stacked[rank, seg.shard_start : seg.shard_start + seg.numel]
    return [t.view(p.shape) for t, p in zip(out, flat.params)]
