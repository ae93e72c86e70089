"""What each section of a loaded offload config does to a run: plain values, built into objects by
`training/plan.py` and `training/build.py` (config/ imports nothing from sharding/ or offload/).

    stage = zero_stage(config, stage_from_flags)         # ZeRO stage (or None)
    spec = OffloadSpec.from_config(config)               # `offload_optimizer`: the engine's spec (or None)
    cls, kwargs = optimizer_cls_and_kwargs(config, args) # the `optimizer` section, or None
    scheduler = make_scheduler(config, optimizer, num_training_steps, base_lr, args)  # `scheduler`, or None
    scaler = DynamicLossScaler(**loss_scaler_kwargs(config))  # `fp16` loss-scale settings
    sizes = hidden_size_fills(config, model)             # "auto" sizes from the model's hidden size
    kwargs = zero3_kwargs(config, model)                 # stage 3: shard_model's persistence_threshold, prefetch
    params = param_offload_kwargs(config)                # stage 3: ParamOffloadSpec's arguments, or None

The TrainingArguments side (precision flags, DDP bucket size) is applied when the arguments
are checked (`args._offload_problems`); everything else is read here for `training/`.
"""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from ..constants import BUCKET_NUMEL
from ..errors import ConfigError
from .schema import AUTO, PARAM_STORE, STAGE3_ALIASES, STAGE3_MAX_LIVE, STAGE3_PERSISTENCE, STAGE3_PREFETCH


def zero_stage(config, stage_from_flags):
    """The ZeRO stage of this run (1, 2, 3) or None.

    `--sharded_ddp` wins when given (the two were checked to agree). Offload on one process with
    stage 0 runs stage 2 on a world of one: the leanest path (gradients go straight into the
    shard as backward produces them), and with nothing to shard, the same thing as no sharding.
    """
    stage = stage_from_flags
    if stage is None and config is not None and config.stage > 0:
        stage = config.stage
    if stage is None and config is not None and config.offload_device != "none":
        stage = 2  # one process here: the config check refuses stage 0 offload on several ranks
    return stage


def optimizer_cls_and_kwargs(config, args):
    """The optimizer the `optimizer` section names, with the run's hyperparameters, or None.

    DeepSpeed's "Adam" is AdamW unless `adam_w_mode` is false, and so it is here. Adam and AdamW
    run torch's fused kernel (CPU and CUDA).
    """
    section = config.optimizer if config is not None else None
    if section is None:
        return None
    kind, params = section["type"], section["params"]
    # weight_decay is set per param group by the Trainer (0 for biases and norms); "auto" or
    # equal to --weight_decay, as the config check made sure
    lr = params.get("lr") if params.get("lr") is not None else args.learning_rate
    if kind == "SGD":
        return torch.optim.SGD, {"lr": lr, "momentum": params.get("momentum") or 0.0,
                                 "nesterov": bool(params.get("nesterov")), "dampening": params.get("dampening") or 0.0}
    betas = tuple(params["betas"]) if params.get("betas") is not None else (args.adam_beta1, args.adam_beta2)
    eps = params.get("eps") if params.get("eps") is not None else args.adam_epsilon
    decoupled = kind == "AdamW" or params.get("adam_w_mode") is not False
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls, {"lr": lr, "betas": betas, "eps": eps, "amsgrad": bool(params.get("amsgrad")), "fused": True}


def scheduler_lambda(kind: str, params: dict, base_lr: float, total_num_steps: int):
    """DeepSpeed's WarmupLR / WarmupDecayLR as a multiplier of `base_lr` for the k-th optimizer step.

    DeepSpeed sets lr(iteration -1) = warmup_min_lr at construction and steps the schedule after
    each optimizer step, so optimizer step k (from 0) runs at its lr(iteration k - 1).
    """
    low = params["warmup_min_lr"] or 0.0
    high = params["warmup_max_lr"] if params["warmup_max_lr"] is not None else base_lr
    warmup = max(2, params["warmup_num_steps"] if params["warmup_num_steps"] is not None else 1000)
    total = params["total_num_steps"] if params["total_num_steps"] not in (None, AUTO) else total_num_steps
    log_warmup = params["warmup_type"] != "linear"

    def lr_at(iteration: int) -> float:
        if iteration < 0:
            return low
        if iteration < warmup:
            gamma = math.log(iteration + 1) / math.log(warmup) if log_warmup else iteration / warmup
        elif kind == "WarmupDecayLR":
            gamma = max(0.0, (total - iteration) / max(1.0, total - warmup))
        else:
            gamma = 1.0
        return low + (high - low) * gamma

    def multiplier(step: int) -> float:
        return lr_at(step - 1) / base_lr if base_lr else 0.0

    return multiplier


def make_scheduler(config, optimizer, num_training_steps: int, base_lr: float, args=None):
    """The `scheduler` section's LambdaLR, or None (see `scheduler_params`)."""
    section = config.scheduler if config is not None else None
    if section is None:
        return None
    params = scheduler_params(config, num_training_steps, args)
    return LambdaLR(optimizer, scheduler_lambda(section["type"], params, base_lr, num_training_steps))


def scheduler_params(config, num_training_steps: int, args=None) -> dict:
    """The `scheduler` section's params with `"auto"` resolved for a run of `num_training_steps`:
    `warmup_num_steps` is the run's (`--warmup_steps` as a count, or as a ratio of the steps when
    below 1, at least 1), `total_num_steps` the steps, as the Hugging Face integration fills them.
    An explicit warmup that contradicts a ratio is refused here, once the steps are known."""
    params = dict(config.scheduler["params"])
    if params["total_num_steps"] == AUTO:
        params["total_num_steps"] = num_training_steps
    if args is not None:
        from .load import warmup_is_ratio

        run_warmup = max(1, args.get_warmup_steps(num_training_steps))
        if params["warmup_num_steps"] == AUTO:
            params["warmup_num_steps"] = run_warmup
        elif params["warmup_num_steps"] is not None and warmup_is_ratio(args) and params["warmup_num_steps"] != run_warmup:
            raise ConfigError(args.offload, [("$.scheduler.params.warmup_num_steps", (
                f"is {params['warmup_num_steps']} but --warmup_steps {args.warmup_steps} is {run_warmup} of the "
                f"{num_training_steps} training steps; make them agree, or write \"auto\""))])  # fmt: skip
    if AUTO in params.values():  # no TrainingArguments: what "auto" stands for is unknown
        key = next(k for k, v in params.items() if v == AUTO)
        raise ConfigError("offload config", [(f"$.scheduler.params.{key}", '"auto" needs the training arguments; '
                                              "pass them, or write a number")])  # fmt: skip
    return params


def hidden_size(model) -> int | None:
    """The model's hidden size, where the Hugging Face DeepSpeed integration reads it: the config's
    `hidden_size` (T5 maps it to `d_model`), the largest of `hidden_sizes`, or the text config's."""
    config = getattr(model, "config", None)
    for holder in (config, getattr(config, "text_config", None)):
        if holder is None:
            continue
        if getattr(holder, "hidden_size", None):
            return int(holder.hidden_size)
        if getattr(holder, "hidden_sizes", None):
            return int(max(holder.hidden_sizes))
    return None


def hidden_size_fills(config, model) -> dict:
    """The `"auto"` sizes that come from the model's hidden size h, as the Hugging Face DeepSpeed
    integration fills them: `reduce_bucket_size` h*h (and `allgather_bucket_size`, which it leaves
    alone, the same), `stage3_prefetch_bucket_size` 0.9*h*h, `stage3_param_persistence_threshold`
    10*h. Explicit values as written; keys left out take their defaults."""
    zero = (config.raw.get("zero_optimization") if config is not None and isinstance(config.raw, dict) else None) or {}
    sizes = {"reduce_bucket_size": BUCKET_NUMEL, "allgather_bucket_size": BUCKET_NUMEL}
    sizes |= {k: v for k, v in zero.items() if k in HIDDEN_SIZE_KEYS and v != AUTO}  # explicit: as written
    wanted = [k for k in HIDDEN_SIZE_KEYS if zero.get(k) == AUTO]
    if not wanted:
        return sizes
    h = hidden_size(model)
    if h is None:
        raise ConfigError("offload config", [(f"$.zero_optimization.{wanted[0]}", (
            f'"auto" comes from the model\'s hidden size, and {type(model).__name__}\'s config has neither '
            "hidden_size nor hidden_sizes; write a number"))])  # fmt: skip
    fills = {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
             "stage3_param_persistence_threshold": 10 * h}  # fmt: skip
    sizes |= {k: fills[k] for k in wanted if k in fills}
    if "allgather_bucket_size" in wanted:  # the reduce bucket's size, filled or written
        sizes["allgather_bucket_size"] = sizes["reduce_bucket_size"]
    return sizes


HIDDEN_SIZE_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size",
                    "stage3_param_persistence_threshold")  # fmt: skip


def loss_scaler_kwargs(config) -> dict:
    """The keyword arguments of the fp16 loss scaler (`sharding.scaler.DynamicLossScaler`) that
    the `fp16` section describes; {} (DeepSpeed's defaults) without a config."""
    if config is None:
        return {}
    if config.loss_scale > 0:
        return {"init_scale": config.loss_scale, "static": True}
    return {"init_scale": 2.0**config.initial_scale_power, "growth_interval": config.loss_scale_window,
            "min_scale": config.min_loss_scale, "hysteresis": config.hysteresis, "raise_error_at_min_scale": True,
            "consecutive_hysteresis": config.consecutive_hysteresis}  # fmt: skip


def zero3_kwargs(config, model) -> dict:
    """`sharding.zero3.shard_model`'s keyword arguments that the ZeRO-3 keys describe:
    {"persistence_threshold": int, "prefetch": int}, DeepSpeed's defaults without a config. (Where
    the parameters live is `param_offload_kwargs(config)`: plain data, the arguments of
    `offload.param_store.ParamOffloadSpec`, which training/plan.py builds; config/ imports nothing
    from offload/.)

    - persistence_threshold: `stage3_param_persistence_threshold` (parameters of at most this many
      elements stay whole, DeepSpeed's rule); default 100,000; "auto": 10 x hidden size.
    - prefetch: parameter elements to gather ahead of use (0: none): `stage3_prefetch_bucket_size`
      (default 50,000,000; "auto": 0.9 x hidden size squared), capped by
      `stage3_max_live_parameters` (default 1e9), as DeepSpeed prefetches only while fewer are live.

    "auto" is filled as the Hugging Face integration fills it (`hidden_size_fills`), under the
    stage3_ names only; under the other names it is DeepSpeed's default, as DeepSpeed reads it.
    `stage3_model_persistence_threshold` is checked against `model`: ConfigError when the
    parameters kept whole here (those under the threshold, and frozen ones) hold more elements.
    """
    zero = (config.raw.get("zero_optimization") if config is not None and isinstance(config.raw, dict) else None) or {}
    fills = hidden_size_fills(config, model) if config is not None else {}
    persistence = _stage3_value(zero, "stage3_param_persistence_threshold", STAGE3_PERSISTENCE, fills)
    prefetch = _stage3_value(zero, "stage3_prefetch_bucket_size", STAGE3_PREFETCH, fills)
    max_live = _stage3_value(zero, "stage3_max_live_parameters", STAGE3_MAX_LIVE, fills)
    cap = _stage3_value(zero, "stage3_model_persistence_threshold", None, fills)
    if cap is not None:
        _check_model_persistence(model, zero, persistence, cap)
    return {"persistence_threshold": persistence, "prefetch": min(prefetch, max_live)}


def param_offload_kwargs(config) -> dict | None:
    """The arguments of `offload.param_store.ParamOffloadSpec` that `offload_param` (or
    `cpu_offload_param: true`) describes at stage 3: {device, nvme_path, buffer_count, buffer_size,
    max_in_cpu, pin_memory}, "auto" as DeepSpeed's defaults; None with device none or no config.
    The rules across keys (nvme_path, buffer_count >= 2, the optimizer offloaded too) were checked
    when the config loaded (load.py `param_offload_problems`)."""
    settings = getattr(config, "param_offload", None) if config is not None else None
    if not settings or settings["device"] == "none":
        return None
    out = dict(settings)
    if out["device"] != "nvme":
        out["nvme_path"] = None
    return out


def _stage3_value(zero: dict, name: str, default, fills: dict):
    """The setting `name` as written under any of its names ("auto": `fills`, else the default)."""
    for written in (name, *STAGE3_ALIASES[name]):
        if written in zero:
            value = zero[written]
            if value == AUTO:
                return int(fills[written]) if written in fills else default
            return int(value)  # checked when loaded: a whole number (JSON may write it 1e9)
    return default


def _check_model_persistence(model, zero: dict, threshold: int, cap: int) -> None:
    """`stage3_model_persistence_threshold` against what the engine keeps whole: every parameter of
    at most `threshold` elements (DeepSpeed would shard the rest instead)."""
    whole = sum(p.numel() for p in model.parameters() if p.numel() <= threshold)
    if whole > cap:
        name = next(n for n in ("stage3_model_persistence_threshold", "model_persistence_threshold") if n in zero)
        message = (f"is {cap:,} elements, but the parameters kept whole on every rank here (those of at most "
                   f"{threshold:,} elements, stage3_param_persistence_threshold) hold {whole:,} in "
                   f"{type(model).__name__}; raise it or remove it, or lower stage3_param_persistence_threshold")  # fmt: skip
        raise ConfigError("offload config", [(f"$.zero_optimization.{name}", message)])


def zero3_settings(config) -> list:
    """What the ZeRO-3 keys set, a line each, for `trainer-shard validate-config` ("auto": filled
    from the model at start)."""
    zero = (config.raw.get("zero_optimization") if isinstance(config.raw, dict) else None) or {}
    fills = {"stage3_prefetch_bucket_size": "auto (0.9 x hidden size squared)",
             "stage3_param_persistence_threshold": "auto (10 x hidden size)"}  # fmt: skip

    def shown(name, default):
        for written in (name, *STAGE3_ALIASES[name]):
            if written in zero:
                value = zero[written]
                return fills.get(written, f"{default:,}") if value == AUTO else f"{int(value):,}"
        return f"{default:,}"

    return [f"prefetch: {shown('stage3_prefetch_bucket_size', STAGE3_PREFETCH)} elements ahead, at most "
            f"{shown('stage3_max_live_parameters', STAGE3_MAX_LIVE)} (stage3_max_live_parameters)",
            f"persistence threshold: {shown('stage3_param_persistence_threshold', STAGE3_PERSISTENCE)} elements "
            "(parameters of at most this many stay whole on every rank)",
            *param_offload_settings(config),
            "save_model: the whole model.safetensors, streamed a unit at a time"]  # fmt: skip


def param_offload_settings(config) -> list:
    """What `offload_param` sets at stage 3, a line each, for `trainer-shard validate-config`."""
    spec = param_offload_kwargs(config)
    if spec is None:
        return ["parameter offload: none (the parameter shards stay in this process's memory between uses)"]
    where = ("cpu (each unit's parameter shard in CPU RAM)" if spec["device"] == "cpu" else
             f"nvme at {spec['nvme_path']}/{PARAM_STORE.split('/', 1)[1]} (parameter and gradient shards in files; "
             f"the first units' shards, up to {spec['max_in_cpu']:,} elements a rank, in RAM: max_in_cpu), read ahead "
             "on a thread in the units' recorded order")  # fmt: skip
    return [f"parameter offload: {where}",
            f"parameter buffers: at most {spec['buffer_count']} units' gather buffers alive (buffer_count), a unit of "
            f"at most {spec['buffer_size']:,} elements (buffer_size); pin_memory {str(spec['pin_memory']).lower()} "
            "(page-locked with CUDA only)"]  # fmt: skip
