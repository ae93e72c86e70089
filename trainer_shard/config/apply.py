"""What each section of a loaded offload config does to a run: plain values, built into objects by
`training/plan.py` and `training/build.py` (config/ imports nothing from sharding/ or offload/).

    stage = zero_stage(config, stage_from_flags)         # ZeRO stage (or None)
    spec = OffloadSpec.from_config(config)               # `offload_optimizer`: the engine's spec (or None)
    cls, kwargs = optimizer_cls_and_kwargs(config, args) # the `optimizer` section, or None
    scheduler = make_scheduler(config, optimizer, num_training_steps, base_lr)  # `scheduler`, or None
    scaler = DynamicLossScaler(**loss_scaler_kwargs(config))  # `fp16` loss-scale settings

The TrainingArguments side (precision flags, DDP bucket size) is applied when the arguments
are checked (`args._offload_problems`); everything else is read here for `training/`.
"""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def zero_stage(config, stage_from_flags):
    """The ZeRO stage of this run (1, 2) or None.

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
        return torch.optim.SGD, {"lr": lr, "momentum": params.get("momentum") or 0.0}
    betas = tuple(params["betas"]) if params.get("betas") is not None else (args.adam_beta1, args.adam_beta2)
    eps = params.get("eps") if params.get("eps") is not None else args.adam_epsilon
    decoupled = kind == "AdamW" or params.get("adam_w_mode") is not False
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls, {"lr": lr, "betas": betas, "eps": eps, "fused": True}


def scheduler_lambda(kind: str, params: dict, base_lr: float, total_num_steps: int):
    """DeepSpeed's WarmupLR / WarmupDecayLR as a multiplier of `base_lr` for the k-th optimizer step.

    DeepSpeed sets lr(iteration -1) = warmup_min_lr at construction and steps the schedule after
    each optimizer step, so optimizer step k (from 0) runs at its lr(iteration k - 1).
    """
    low = params["warmup_min_lr"] or 0.0
    high = params["warmup_max_lr"] if params["warmup_max_lr"] is not None else base_lr
    warmup = max(2, params["warmup_num_steps"] if params["warmup_num_steps"] is not None else 1000)
    total = params["total_num_steps"] or total_num_steps
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


def make_scheduler(config, optimizer, num_training_steps: int, base_lr: float):
    section = config.scheduler if config is not None else None
    if section is None:
        return None
    return LambdaLR(optimizer, scheduler_lambda(section["type"], section["params"], base_lr, num_training_steps))


def loss_scaler_kwargs(config) -> dict:
    """The keyword arguments of the fp16 loss scaler (`sharding.scaler.DynamicLossScaler`) that
    the `fp16` section describes; {} (DeepSpeed's defaults) without a config."""
    if config is None:
        return {}
    if config.loss_scale > 0:
        return {"init_scale": config.loss_scale, "static": True}
    return {"init_scale": 2.0**config.initial_scale_power, "growth_interval": config.loss_scale_window,
            "min_scale": config.min_loss_scale}  # fmt: skip
