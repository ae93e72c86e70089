"""The `ShardedOptimizer` a run's plan asks for, around the optimizer the Trainer would have built
(same class, hyperparameters and weight-decay groups), or a check of the one a user passed.

    cast_for_mixed_precision(model, args)           # bf16/fp16 parameters; fp32 masters in the shards
    optimizer = wrap(plain, stage, spec, args, config)
    adopt(trainer, optimizer)                       # the Trainer steps through it (a user's: checked first)
    force_prepare_model(accelerator, device_placement=False)   # accelerate's prepare told what to skip

ZeRO-3's model sharding, before the optimizer is built, is in `stage3.py`.
"""

import functools
import logging

import torch

from .. import dtypes
from . import precision
from ..config import apply as config_apply
from ..constants import BUCKET_NUMEL
from ..errors import ArgumentError
from ..sharding import DynamicLossScaler, ShardedGradScaler, ShardedOptimizer

logger = logging.getLogger(__name__)

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


def adopt(trainer, optimizer) -> None:
    """Make the Trainer step through `optimizer` (built by `wrap`, or the user's own through
    `optimizers=(...)`, refused if it would silently not shard)."""
    stage, args = trainer.sharding_stage, trainer.args
    check_adoptable(optimizer, stage, trainer.offload_spec, args)
    trainer.sharded_optimizer = optimizer
    if stage == 3:
        trainer.sharded_model = optimizer.sharded_model
    if args.fp16:  # accelerate scales the loss and steps through this; see ShardedGradScaler
        trainer.accelerator.scaler = ShardedGradScaler(optimizer)
    if stage == 2:  # no DDP around the model: the optimizer's hooks reduce-scatter the gradients
        force_prepare_model(trainer.accelerator, evaluation_mode=True)
    elif stage == 3:
        # nor at stage 3 (the model's hooks reduce-scatter), and no `.to(device)`: the model was
        # sharded where it is, and its sharded parameters' dtype and device cannot change
        force_prepare_model(trainer.accelerator, evaluation_mode=True, device_placement=False)
    precision.install(trainer, trainer.accelerator.unwrap_model(trainer.model))
    logger.info("--sharded_ddp: %r", optimizer)


def force_prepare_model(accelerator, **forced) -> None:
    """Make `accelerator.prepare_model` always run with `forced` keywords: `accelerator.prepare`
    passes `device_placement` explicitly (None: the accelerator's default), which a
    `functools.partial` default would not override."""
    original = accelerator.prepare_model

    @functools.wraps(original)
    def prepare_model(model, *args, **kwargs):
        return original(model, *args, **{**kwargs, **forced})

    accelerator.prepare_model = prepare_model
