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

The class is split by concern: construction, step and lifecycle here; building the flats in
optimizer_flats.py (`FlatsMixin`); gradients, loss-scale unscaling, norms and clipping in
optimizer_grads.py (`GradientsMixin`); saving, loading and consolidating the state in
optimizer_state.py (`StateDictMixin`, with `NotConsolidatedError`, re-exported here).
"""

import inspect
import logging
import weakref

import torch
from torch.autograd.profiler import record_function

from .. import comm
from ..constants import BUCKET_NUMEL
from ..errors import ShardingError
from ..memory import release_freed_memory
from ..offload.engine import OffloadEngine
from . import owners
from .frozen import Held
from .on_device import OnDevice
from .optimizer_flats import FlatsMixin
from .optimizer_grads import GradientsMixin
from .optimizer_state import NotConsolidatedError, StateDictMixin
from .reducer import MAX_16BIT_RANKS, GradReducer
from .scaler import DynamicLossScaler
from .stepper import Stepper

logger = logging.getLogger(__name__)

__all__ = ["ELEMENTWISE", "NotConsolidatedError", "ShardedOptimizer"]

# torch.optim's optimizers whose update of each element depends only on that element's own
# gradient and state, so that stepping flat shards equals stepping whole tensors; a subclass of
# one is too, as long as it keeps its `step`.
ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam", "RAdam", "ASGD"}
_ELEMENTWISE_CLASSES = tuple(getattr(torch.optim, name) for name in sorted(ELEMENTWISE))

_NOT_ELEMENTWISE = {
    "Adafactor": "it factors the second moment over each weight matrix's rows and columns",
    "LBFGS": "it takes whole-model line-search steps",
    "SparseAdam": "it needs sparse gradients",
}


class ShardedOptimizer(FlatsMixin, GradientsMixin, StateDictMixin, torch.optim.Optimizer):
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

    def _device(self):
        if self.flats:
            return self.flats[0].buffer.device
        first = next((p for g in self.param_groups for p in g["params"]), None)
        return first.device if first is not None else torch.device("cpu")

    def _state_device(self):
        """Where whole state shards are read to: the compute device, or the CPU when offloaded."""
        return torch.device("cpu") if self.offload is not None else self._device()

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
