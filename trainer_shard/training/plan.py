"""The ZeRO stage and offload of a run, and the room it needs, decided before anything is built.

    plan_trainer(trainer)                             # all of the below for a Trainer, at its start
    stage, spec = plan(args, config)                  # --sharded_ddp and the --offload config
    stage, spec, params = choose_strategy(args, model, dataset, config)   # --sharded_ddp auto; collective
    stage = choose_before_loading(args, config, model_config, dataset)   # the same, from the config alone
    states = state_tensors(optim_class, kwargs)       # per-element state tensors (AdamW: 2), or None
    params = param_offload_spec(config)               # stage 3: offload_param's ParamOffloadSpec, or None
    needed = param_store_bytes(params, model, world_size, args, config)  # its disk files, this rank
    grads = grad_store_bytes(stage, spec, params, model, world_size, args, config)  # stage 3, optimizer on disk
    check_disk_room(spec, model, states, rank, world_size, params, needed, grads)  # the disk stores fit, free
    checkpoint_bytes(model, sharded, states)          # about what one checkpoint writes

stage: 1 (ZeRO-1: `--sharded_ddp simple`), 2 (ZeRO-2: `zero_dp_2`, or offload on one process), or
None without sharding; spec: the `OffloadSpec` of the optimizer's store, or None; params: the
`ParamOffloadSpec` of ZeRO-3's parameter store (the config's `offload_param`, or what `--sharded_ddp
auto` chose: the planner's `disk_params`), or None.
"""

import logging
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from .. import comm, dtypes
from ..args import ShardedDDPOption, set_ddp_bucket, stage_from_options, world_size_from_env
from ..checkpoint import unique_state_dict
from ..config import apply as config_apply
from ..disk import free_bytes, same_disk
from ..errors import ArgumentError, TrainerShardError
from ..memory import MAPPED_FROM, map_large_blocks
from ..offload import OffloadSpec
from ..offload.engine import per_element_state
from ..offload.param_store import PARAMS, ParamOffloadSpec
from ..offload.store import OPTIMIZER, OffloadStoreError, check_disk_store
from ..sharding.zero3 import full_numel

logger = logging.getLogger(__name__)

ADAM_STATES = 2  # what an optimizer built by a factory is assumed to keep, for size estimates


def plan(args, config) -> tuple:
    """(stage, spec) from the flags and the config (`--sharded_ddp "zero_dp_2 offload"` without a
    config: CPU offload with the defaults, its store pinned when CUDA is present, so gradient and
    weight chunks cross to and from the GPU asynchronously)."""
    options = getattr(args, "sharded_ddp", None) or []
    stage = config_apply.zero_stage(config, stage_from_options(options))
    spec = OffloadSpec.from_config(config) if config is not None else None
    if ShardedDDPOption.OFFLOAD in options and spec is None:
        spec = OffloadSpec("cpu", pin_memory=torch.cuda.is_available())
    check_stage_args(args, stage)
    return stage, spec


def plan_trainer(trainer) -> None:
    """A Trainer's plan, when it is built: its `_sharding_stage`, `offload_spec` and
    `param_offload_spec` from the flags and the --offload config (or chosen by `--sharded_ddp
    auto` when there is a training set), the config's optimizer as the Trainer's
    `optimizer_cls_and_kwargs`, its "auto" sizes checked, and room on disk for both stores.
    Collective under `auto`."""
    args, config = trainer.args, trainer.offload_config
    stage, spec = plan(args, config)
    params = param_offload_spec(config) if stage == 3 else None  # ZeRO-3's parameter store
    model = trainer.accelerator.unwrap_model(trainer.model)
    if ShardedDDPOption.AUTO in (getattr(args, "sharded_ddp", None) or []) and trainer.train_dataset is not None:
        chosen = getattr(args, CHOSEN, None)  # chosen before the model was loaded: taken as it is
        stage, spec, params = chosen or choose_strategy(args, model, trainer.train_dataset, config)  # none for eval
    trainer._sharding_stage, trainer.offload_spec, trainer.param_offload_spec = stage, spec, params
    if stage == 3 and args.device.type == "cpu" and on_disk(spec, params) and map_large_blocks():
        logger.info("ZeRO-3 with offload to disk: C heap blocks of %d MiB and more mapped apart, handed back to the "
                    "OS when freed", MAPPED_FROM >> 20)  # fmt: skip
    config_optimizer = config_apply.optimizer_cls_and_kwargs(config, args)
    if config_optimizer is not None:
        if trainer.optimizer_cls_and_kwargs is not None or trainer.optimizer is not None:
            raise ArgumentError("the --offload config has an `optimizer` section and the trainer was given its own "
                                "optimizer; keep one")  # fmt: skip
        trainer.optimizer_cls_and_kwargs = config_optimizer
    if config is not None:  # "auto" sizes need the model's hidden size: say so before training
        sizes = config_apply.hidden_size_fills(config, model)
        if stage == 1 and config.reduce_bucket_size is None:
            problems = set_ddp_bucket(args, sizes["reduce_bucket_size"], args.offload)
            if problems:
                raise ArgumentError(problems)
    world_size = world_size_from_env()
    states = trainer._state_tensors()
    param_bytes = param_store_bytes(params, model, world_size, args, config)
    grad_bytes = grad_store_bytes(stage, spec, params, model, world_size, args, config)
    check_disk_room(spec, model, states, args.process_index, world_size, params, param_bytes, grad_bytes)


def on_disk(spec, params) -> bool:
    """The optimizer's state (`spec`) or ZeRO-3's parameters (`params`) in files: a run planned for
    a RAM too small for them, where what the C heap keeps after a free counts, so `plan_trainer`
    maps large blocks apart at stage 3 (`memory.map_large_blocks`). t5-large in fp32, 2 ranks,
    optimizer on disk, one step (bench/load_rss.py's train row, by hand): a rank peaked at 2.56
    GiB before the first step and 3.17-3.41 GiB in backward with glibc's heap, 1.86 and 2.96 GiB
    with the blocks mapped apart."""
    return any(s is not None and s.device == "nvme" for s in (spec, params))


def check_stage_args(args, stage) -> None:
    """Flags the chosen stage cannot take, refused before anything runs."""
    if stage == 3 and getattr(args, "auto_find_batch_size", False):
        raise ArgumentError("--auto_find_batch_size retries a step that ran out of memory, re-running a forward and "
                            "backward that raised halfway, which ZeRO-3 cannot take (transformers refuses it with "
                            "DeepSpeed ZeRO-3 too); drop the flag and set --per_device_train_batch_size (trainer-shard "
                            "estimate says what fits)")  # fmt: skip


def choose_strategy(args, model, train_dataset, config) -> tuple:
    """--sharded_ddp auto: rank 0 estimates every strategy (planner.py: exact state bytes, a
    measured activation probe) and picks the least costly one that fits the memory per rank
    (the config's max_memory, else what it detects); every rank takes its choice: (stage, the
    optimizer's `OffloadSpec` or None, the parameter store's `ParamOffloadSpec` or None). The
    stores of a disk choice go under `--output_dir`/offload_store. Collective.

    The probe takes minutes on a big model: the other ranks wait for its outcome through the
    rendezvous store (`comm.share_from_rank_zero`), as long as the probe may take, not the
    process group's timeout; a probe that fails makes every rank raise the same error."""
    from .. import planner

    configured = getattr(config, "max_memory", None) or {}
    device = args.device
    budget = configured.get("cpu" if device.type == "cpu" else device.index or 0) or planner.detect_budget(device)
    outcome = None
    if args.process_index == 0:
        try:
            outcome = _plan_on_rank_zero(args, model, train_dataset, budget)
        except Exception as e:  # every rank must learn of it, not wait for the answer
            outcome = ("failed", f"{type(e).__name__}: {e}")
    kind, value = comm.share_from_rank_zero(outcome, timeout=2 * planner.PROBE_TIMEOUT_S + 60)
    if kind == "failed":
        raise TrainerShardError(f"--sharded_ddp auto: the memory probe on rank 0 failed ({value}); name a strategy "
                                "instead (--sharded_ddp simple|zero_dp_2|zero_dp_3 [offload], or --offload CONFIG.json)")  # fmt: skip
    chosen, why = value
    if chosen is None:
        raise ArgumentError(f"--sharded_ddp auto: {why}; lower --per_device_train_batch_size or the sequence "
                            "lengths, or add ranks")  # fmt: skip
    if args.process_index == 0:
        print(f"--sharded_ddp auto: {why}", flush=True)
    strategy, offload = chosen
    stage = {"ddp": None, "simple": 1, "zero_dp_2": 2, "zero_dp_3": 3}[strategy]
    store = os.path.join(args.output_dir, "offload_store")
    specs = {"none": None, "cpu": OffloadSpec("cpu"), "disk": OffloadSpec("nvme", nvme_path=store)}
    spec = specs["disk" if offload == planner.PARAM_OFFLOAD else offload]  # disk_params: the optimizer's on disk too
    params = auto_param_offload(store, model) if offload == planner.PARAM_OFFLOAD else None
    return stage, spec, params


def auto_param_offload(store: str, model) -> ParamOffloadSpec:
    """The parameter store of the planner's `disk_params` row, in `store`/zero3_params: the row's
    `buffer_count` and `max_in_cpu` (`planner.AUTO_PARAM_OFFLOAD`); `buffer_size` (here only the
    largest unit allowed, not an allocation) no smaller than the model, so any of its layers is
    a unit, as the row assumes."""
    from .. import planner

    total = sum(full_numel(p) for p in model.parameters())
    return ParamOffloadSpec("nvme", nvme_path=store, buffer_size=max(ParamOffloadSpec.buffer_size, total),
                            **planner.AUTO_PARAM_OFFLOAD)  # fmt: skip


CHOSEN = "_trainer_shard_chosen_strategy"
"""The attribute of a run's TrainingArguments holding what `choose_before_loading` chose."""


def choose_before_loading(args, config, model_config, train_dataset, lora: dict | None = None):
    """--sharded_ddp auto before any weight is loaded: `choose_strategy` on the model built on the
    meta device from `model_config` (with `lora`, `planner.lora_settings`, LoRA applied as
    finetune.py applies it), so the load can be the one the choice needs (ZeRO-3: each rank reads
    its slice, `loading.load_meta`). The choice is kept on `args` (`CHOSEN`), where the Trainer
    takes it rather than choosing again. Returns the chosen stage (None: DDP). Collective."""
    from .. import planner

    chosen = choose_strategy(args, planner.meta_model(model_config, lora), train_dataset, config)
    setattr(args, CHOSEN, chosen)
    return chosen[0]


def _plan_on_rank_zero(args, model, train_dataset, budget: int) -> tuple:
    """("chosen", ((strategy, offload) or None, why)): the planner's estimate and choice. A PEFT
    model is counted as it is (its frozen base and trainable adapters: gradients and optimizer
    state for the adapters only); any other by its config, every parameter trainable."""
    from .. import planner

    source, target = planner.dataset_lengths(train_dataset) if train_dataset is not None else (128, 128)
    precision = dtypes.precision(args)
    compute, _ = planner.compute_dtype(getattr(args, "compute_dtype", "auto"), precision, args.device.type)
    with tempfile.TemporaryDirectory() as folder:
        model.config.save_pretrained(folder)
        probes = planner.measure_probes(folder, precision, source, target, args.device.type, compute)
    rows = planner.estimate(model.config, world_size=max(1, args.world_size), precision=precision,
                            batch_size=args.per_device_train_batch_size, source_length=source, target_length=target,
                            device=args.device.type, probes=probes, max_memory=budget, compute=compute,
                            model=model if hasattr(model, "peft_config") else None)  # fmt: skip
    choice = planner.choose(rows, budget)
    return "chosen", (choice and (choice["strategy"], choice["offload"]), planner.explain(rows, choice, budget))


def state_tensors(optim_class, kwargs: dict):
    """How many per-element state tensors `optim_class(**kwargs)` keeps (AdamW: 2), before it is
    built; None for an optimizer factory (its class is known only once built)."""
    if not (isinstance(optim_class, type) and issubclass(optim_class, torch.optim.Optimizer)):
        return None
    kwargs = {k: v for k, v in kwargs.items() if k not in ("params", "model", "optimizer_dict")}
    return len(per_element_state(optim_class, kwargs))


def trainable_numel(model) -> int:
    return sum(full_numel(p) for p in model.parameters() if p.requires_grad)


def param_offload_spec(config) -> ParamOffloadSpec | None:
    """The `offload_param` of a config run at stage 3 (config/apply.py `param_offload_kwargs`), or
    None. The config is its only source: the flags say nothing of where parameters go."""
    kwargs = config_apply.param_offload_kwargs(config)
    return ParamOffloadSpec(**kwargs) if kwargs is not None else None


def param_store_bytes(params, model, world_size: int, args, config) -> int:
    """About the bytes this rank's parameter store puts on disk (`offload_param` nvme): its shard
    of the sharded parameters, in the training dtype, and of their gradients (in
    `data_types.grad_accum_dtype`, else the parameters' dtype), less the `max_in_cpu` elements kept
    in RAM. Parameters above the persistence threshold are sharded, frozen ones too (without a
    gradient); smaller ones stay whole in memory. The store checks the exact, padded size again
    when it opens."""
    if params is None or params.device != "nvme":
        return 0
    threshold = config_apply.zero3_kwargs(config, model)["persistence_threshold"]
    world_size = max(1, world_size)
    sharded = [p for p in model.parameters() if full_numel(p) > threshold]
    params = max(0, -(-sum(map(full_numel, sharded)) // world_size) - params.max_in_cpu)
    param_dtype = dtypes.half_dtype(dtypes.precision(args)) or torch.float32
    return params * param_dtype.itemsize + _grad_shard_bytes(model, world_size, args, config, threshold)


def grad_store_bytes(stage, spec, params, model, world_size: int, args, config) -> int:
    """About the bytes of this rank's gradient shards on disk beside the optimizer's state
    (stage 3 with `spec` on nvme: [Note: gradient store] in offload/param_store.py), in the
    gradient dtype; 0 where the parameter store holds them (`param_store_bytes` counts them)."""
    if stage != 3 or spec is None or spec.device != "nvme" or (params is not None and params.device == "nvme"):
        return 0
    threshold = config_apply.zero3_kwargs(config, model)["persistence_threshold"]
    return _grad_shard_bytes(model, max(1, world_size), args, config, threshold)


def _grad_shard_bytes(model, world_size: int, args, config, threshold: int) -> int:
    """This rank's shard of the gradients of the trainable parameters above `threshold` (the
    persistence threshold), in `data_types.grad_accum_dtype` (else the parameters' dtype, as an
    offloaded optimizer keeps them)."""
    grads = -(-sum(full_numel(p) for p in model.parameters() if p.requires_grad and full_numel(p) > threshold)
              // world_size)  # fmt: skip
    param_dtype = dtypes.half_dtype(dtypes.precision(args)) or torch.float32
    grad_dtype = dtypes.DTYPES.get(getattr(config, "grad_accum_dtype", None)) or param_dtype
    return grads * grad_dtype.itemsize


def check_disk_room(spec, model, states, rank: int, world_size: int, params=None, param_bytes: int = 0,
                    grad_bytes: int = 0) -> None:  # fmt: skip
    """Before training, before anything is written: room on disk for this rank's optimizer shard
    (master + the optimizer's per-element state, fp32, and the gradient shards stored beside it:
    `grad_bytes`, `grad_store_bytes`) and, with `params` (a ParamOffloadSpec on
    nvme), for its parameter store's `param_bytes` (`param_store_bytes`), the two counted together
    when they share a disk; and neither store's folder in use by another run. The stores check
    their exact, padded sizes again when they open. An optimizer factory (`states` None): its store
    checks once it is built."""
    optimizer = None
    if spec is not None and spec.device == "nvme" and states is not None:
        needed = 4 * (1 + states) * -(-trainable_numel(model) // max(1, world_size)) + grad_bytes
        role = OPTIMIZER if not grad_bytes else replace(OPTIMIZER, what=f"{OPTIMIZER.what} and the gradient shards")
        check_disk_store(spec.nvme_path, rank, needed, in_use=True, role=role)
        optimizer = (Path(spec.nvme_path) / f"rank{rank}", needed)
    if params is not None and params.device == "nvme":
        _check_param_room(params.folder, rank, param_bytes, optimizer)


def _check_param_room(store: Path, rank: int, needed: int, optimizer) -> None:
    """The parameter store's folder (`store`/rank<R>) writable and not in use, with room for `needed`
    bytes, and for the optimizer store's `(folder, bytes)` too when it is on the same disk."""
    folder = store / f"rank{rank}"
    check_disk_store(store, rank, 0, in_use=True, role=PARAMS)
    shared = optimizer is not None and same_disk(folder, optimizer[0])
    total, free = needed + (optimizer[1] if shared else 0), free_bytes(folder)
    if free >= total:
        return
    what = f"rank {rank}'s parameter and gradient shards need {needed:,} bytes in {str(folder)!r}"
    if shared:
        what += (f" and its optimizer state (fp32 master weights and moments) {optimizer[1]:,} bytes in "
                 f"{str(optimizer[0])!r}, on the same disk: {total:,} bytes in all")  # fmt: skip
    raise OffloadStoreError(
        f"not enough disk for parameters, gradients and optimizer state: {what}, but only {free:,} are free; free "
        "some space, or point zero_optimization.offload_param.nvme_path (and offload_optimizer.nvme_path) to a larger "
        "disk, or keep more parameter elements in RAM (offload_param.max_in_cpu)"
    )


def checkpoint_bytes(model, sharded: bool, states, with_optimizer: bool = True) -> int:
    """About what a checkpoint writes: the weights as `save_model` writes them, and the optimizer's
    state (fp32 masters and state when sharded, else the state in the parameters' dtype)."""
    every = model.state_dict(keep_vars=True)  # the parameters themselves: a sharded one knows its size
    total = sum(full_numel(every[name]) * every[name].element_size() for name in unique_state_dict(model))
    if not with_optimizer:
        return total
    states = ADAM_STATES if states is None else states
    if sharded:
        return total + 4 * (1 + states) * trainable_numel(model)
    return total + states * sum(full_numel(p) * p.element_size() for p in model.parameters() if p.requires_grad)
