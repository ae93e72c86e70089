"""The `ShardedOptimizer` a run's plan asks for, around the optimizer the Trainer would have built
(same class, hyperparameters and weight-decay groups), or a check of the one a user passed.

    cast_for_mixed_precision(model, args)           # bf16/fp16 parameters; fp32 masters in the shards
    sharded = shard_for_stage3(model, args, config, decay_names, param_offload=params)  # ZeRO-3: before the optimizer
    optimizer = wrap(plain, stage, spec, args, config)
    check_adoptable(optimizer, stage, spec, args)   # a user's optimizers=(...) would really shard
"""

import logging

import torch

from .. import dtypes
from ..config import apply as config_apply
from ..constants import BUCKET_NUMEL
from ..errors import ArgumentError
from ..sharding import DynamicLossScaler, ShardedOptimizer, shard_model
from ..sharding.zero3 import PERSISTENCE_THRESHOLD, full_numel

logger = logging.getLogger(__name__)

SIZE_BASED_UNIT_NUMEL = 10**8
"""auto_wrap's fallback for a model without `_no_split_modules` and without a ModuleList of layers:
a module of at least this many elements is a unit (FSDP's `size_based_auto_wrap_policy` default)."""


def bucket_numel(config, stage, model=None) -> int:
    """Elements a gradient bucket: the config's `reduce_bucket_size` (ZeRO-2, reduce-scattered by
    the optimizer) or `allgather_bucket_size` (ZeRO-1), else the default; `"auto"` from `model`'s
    hidden size (config/apply.py)."""
    if config is None:
        return BUCKET_NUMEL
    sizes = config_apply.hidden_size_fills(config, model)
    return sizes["reduce_bucket_size"] if stage == 2 else sizes["allgather_bucket_size"]


def cast_for_mixed_precision(model, args) -> None:
    """16-bit parameters and gradients on the device; fp32 masters live in the optimizer shards."""
    dtype = dtypes.half_dtype(dtypes.precision(args))
    if dtype is not None:
        model.to(dtype)


def unit_modules(model, auto_wrap: bool) -> tuple:
    """(the units ZeRO-3 gathers one at a time, how they were chosen). With `auto_wrap`: every
    instance of the classes in the model's `_no_split_modules` (`T5Block` for T5: what transformers
    keeps on one device), else the children of each `ModuleList` (a model's layers), else every
    module of at least `SIZE_BASED_UNIT_NUMEL` elements; without it, the model is one unit."""
    if not auto_wrap:
        return [], "the whole model is one unit (gathered whole for each forward and backward: add auto_wrap " \
                   "to --sharded_ddp to gather one layer at a time)"
    names = set(getattr(model, "_no_split_modules", None) or [])
    found = [m for m in model.modules() if type(m).__name__ in names]
    if found:
        return found, f"one unit per {', '.join(sorted({type(m).__name__ for m in found}))} ({len(found)} units, " \
                      "from the model's _no_split_modules)"
    found = [child for m in model.modules() if isinstance(m, torch.nn.ModuleList) for child in m]
    if found:
        return found, f"one unit per layer of the model's ModuleLists ({len(found)} units)"
    found = [m for m in model.modules() if m is not model
             and sum(p.numel() for p in m.parameters()) >= SIZE_BASED_UNIT_NUMEL]  # fmt: skip
    return found, f"one unit per module of at least {SIZE_BASED_UNIT_NUMEL:.0e} elements ({len(found)} units)"


def shard_for_stage3(model, args, config, decay_names, weights=None, param_offload=None) -> "ShardedModel":
    """ZeRO-3: `model`'s parameters sharded in place (zero3.shard_model), in flat buffers split
    by weight decay or not (the Trainer's `decay_names`), so each param group steps its own.
    Units: `--sharded_ddp "zero_dp_3 auto_wrap"` (or `auto` choosing stage 3, or a config at stage
    3, as DeepSpeed gathers module by module) one per layer, else the whole model; the config's stage-3 keys set the
    persistence threshold and prefetch (config/apply.py `zero3_kwargs`). `param_offload`: the parameter store the
    plan chose (`plan.param_offload_spec(config)`, whose checks at load made sure the optimizer is offloaded too,
    or `plan.choose_strategy`'s, with the optimizer on disk), or None. `weights`: where a meta-device model's
    parameters are read from (`shard_model`'s)."""
    from ..args import ShardedDDPOption

    options = getattr(args, "sharded_ddp", None) or []
    # auto_wrap when asked, when --sharded_ddp auto chose stage 3 (the planner's estimate has one
    # unit per layer), or from a config alone
    auto_wrap = (ShardedDDPOption.AUTO_WRAP in options or ShardedDDPOption.AUTO in options
                 or (config is not None and ShardedDDPOption.ZERO_DP_3 not in options))  # fmt: skip
    # parameters offloaded: one unit per layer always (the whole model as one unit would be
    # read from the store whole, every forward and backward)
    units, how = unit_modules(model, auto_wrap or param_offload is not None)
    if config is not None:  # DeepSpeed's keys and defaults (prefetch: 5e7 elements ahead)
        kwargs = config_apply.zero3_kwargs(config, model)
    else:  # the flags alone: prefetch one unit ahead (bench/results/zero3.md measures this)
        kwargs = {"persistence_threshold": PERSISTENCE_THRESHOLD, "prefetch": True}
    kwargs["param_offload"] = param_offload
    reduce = config.communication_data_type if config is not None else None
    decay = set(decay_names)
    # a meta-built model's parameters go where the Trainer computes (the CUDA device), not the CPU
    sharded = shard_model(model, units=units, group_fn=lambda name, p: name in decay, device=args.device,
                          reduce_dtype=dtypes.DTYPES.get(reduce), weights=weights, **kwargs)  # fmt: skip
    if args.process_index == 0:
        total = sum(full_numel(p) for p in model.parameters())
        whole = sum(p.numel() for p in sharded.persistent)
        level = logging.WARNING if 2 * whole > total else logging.INFO  # mostly whole: say it loudly
        logger.log(level, "zero_dp_3: %s; %s of %s parameter elements sharded (%d units hold some); %s stay whole "
                          "on every rank (parameters of at most %s elements: an --offload config's "
                          "stage3_param_persistence_threshold sets the size)", how, f"{total - whole:,}", f"{total:,}",
                   len(sharded.units), f"{whole:,}", f"{kwargs['persistence_threshold']:,}")  # fmt: skip
    return sharded


def wrap(plain: torch.optim.Optimizer, stage: int, spec, args, config, model=None) -> ShardedOptimizer:
    """`plain` sharded at `stage` with offload `spec` (at stage 3, over a model `shard_for_stage3`
    sharded), as the flags and the config say: the fp16
    loss scaler (the config's `fp16` section), `overlap_comm`, bucket size, gradient and
    communication dtypes. `model` gives the hidden size `"auto"` bucket sizes come from."""
    scaler = DynamicLossScaler(**config_apply.loss_scaler_kwargs(config)) if args.fp16 else None
    overlap = config.overlap_comm if config is not None else True
    accum = config.grad_accum_dtype if config is not None else None
    reduce = config.communication_data_type if config is not None and stage == 2 else None  # stage 3: the model's
    return ShardedOptimizer.wrap(
        plain, stage=stage, loss_scaler=scaler, offload=spec, bucket_numel=bucket_numel(config, stage, model),
        overlap_comm=overlap, grad_dtype=dtypes.DTYPES.get(accum), reduce_dtype=dtypes.DTYPES.get(reduce),
    )  # fmt: skip


def check_adoptable(optimizer, stage, spec, args) -> None:
    """Refuse an optimizer that would silently not shard as `--sharded_ddp` / `--offload` ask."""
    sharded = isinstance(optimizer, ShardedOptimizer)
    if not sharded or optimizer.stage != stage or (optimizer.offload is None) != (spec is None):
        raise ArgumentError(
            f"--sharded_ddp asks for ZeRO-{stage} but the trainer was given {type(optimizer).__name__}"
            f"{f' at stage {optimizer.stage}, offload {optimizer.offload}' if sharded else ''} through "
            f"optimizers=(...); let the trainer build it (optimizer_cls_and_kwargs=...), or pass "
            f"ShardedOptimizer.wrap(your_optimizer, stage={stage}, offload={spec})"
        )
    if args.fp16 and optimizer.loss_scaler is None:
        raise ArgumentError("--fp16 needs the ShardedOptimizer built with loss_scaler=True")
