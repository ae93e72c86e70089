"""The compute dtype of a run apart from its storage dtype (`--compute_dtype`, `compute.py`).

`--bf16`/`--fp16` decide what the parameters are stored in: 16-bit under `--sharded_ddp` (shards,
stores, disk and gradient reduction in 16 bits), fp32 autocast under DDP. `--compute_dtype`
decides what the matrix products run in. Where that is fp32 over 16-bit parameters (`auto` on a
CPU without 16-bit kernels), accelerate's autocast is turned off before it wraps the model, and:

- under `--sharded_ddp` each layer's 16-bit parameters are cast to fp32 while it runs
  (`compute.ComputeCast`, one unit at a time: ZeRO-3's units, else `auto_wrap_units`' layers),
  and on the CPU glibc maps blocks of 1 MiB and more apart (`memory.map_large_blocks`), so that the
  fp32 blocks each layer frees go back to the OS instead of growing the heap;
- under DDP the parameters are fp32 already: the run is plain fp32.
"""

import logging

import torch

from ..compute import ComputeCast, choose_compute_dtype, dtype_name
from ..dtypes import half_dtype, precision
from ..memory import MAPPED_FROM, map_large_blocks
from ..sharding.zero3.selection import auto_wrap_units

logger = logging.getLogger(__name__)


def resolve(trainer) -> None:
    """Set `trainer.compute_dtype` (None: fp32 storage, nothing to choose) and log the choice on
    rank 0; turn accelerate's autocast off where fp32 compute replaces the 16-bit one. Before
    the model is prepared (autocast wraps its forward then)."""
    args = trainer.args
    half = half_dtype(precision(args))
    trainer.compute_dtype = trainer.compute_cast = None
    if half is None:
        return
    dtype, line = choose_compute_dtype(getattr(args, "compute_dtype", "auto"), half, args.device)
    trainer.compute_dtype = dtype
    if dtype == torch.float32:
        trainer.accelerator.native_amp = False  # no autocast around the forward: ours casts each layer
        line += ("; DDP keeps fp32 parameters: no autocast, the run is plain fp32" if trainer.sharding_stage is None
                 else "; each layer's 16-bit parameters are cast to fp32 while it runs")  # fmt: skip
    if args.process_index == 0:  # a warning where auto overrode --bf16/--fp16's compute: it changes speed and numerics
        chosen = getattr(args, "compute_dtype", "auto") == "auto" and dtype != half
        logger.log(logging.WARNING if chosen else logging.INFO, "%s", line)


def install(trainer, model) -> None:
    """Cast each layer of the (16-bit, possibly sharded) `model` to the compute dtype while it
    runs, once; nothing when the compute dtype is the parameters' own."""
    dtype = trainer.compute_dtype
    if dtype is None or trainer.compute_cast is not None or trainer.sharding_stage is None:
        return
    if not any(p.is_floating_point() and p.dtype != dtype for p in model.parameters()):
        return
    units = auto_wrap_units(model)[0]  # the layers; ZeRO-3's units under auto_wrap (the same rule)
    sharded = trainer.sharded_model
    ensure_ready = sharded.gather_for_backward if sharded is not None else None
    trainer.compute_cast = ComputeCast(model, dtype, units=units, ensure_ready=ensure_ready)
    mapped = trainer.args.device.type == "cpu" and map_large_blocks()  # the fp32 blocks freed each layer go back
    if trainer.args.process_index == 0:
        logger.info("compute dtype %s: %d layers cast while they run (parameters stay %s)%s", dtype_name(dtype),
                    len(units), dtype_name(next(p.dtype for p in model.parameters() if p.dtype != dtype)),
                    f"; C heap blocks of {MAPPED_FROM >> 20} MiB and more mapped apart, freed to the OS" if mapped
                    else "")  # fmt: skip
