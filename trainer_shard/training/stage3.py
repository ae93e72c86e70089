"""ZeRO-3's wiring into the Trainer: the model sharded before the optimizer groups its parameters,
or at the Trainer's start when it was built on the meta device.

    sharded = shard_for_stage3(model, args, config, decay_names, param_offload=params)
    sharded = shard_meta_model(trainer, model)    # a `loading.load_meta` model, each rank reading its slice
    on_meta(model)                                # such a model, not sharded yet
"""

import logging
import re

from .. import dtypes
from ..args import ShardedDDPOption
from ..config import apply as config_apply
from ..errors import ArgumentError
from ..loading import META_WEIGHTS
from ..sharding import shard_model, zero3_weights
from ..sharding.zero3 import PERSISTENCE_THRESHOLD, auto_wrap_units, full_numel
from .build import cast_for_mixed_precision, force_prepare_model

logger = logging.getLogger(__name__)

WHOLE_MODEL = ("the whole model is one unit (gathered whole for each forward and backward: add auto_wrap to "
               "--sharded_ddp to gather one layer at a time)")  # fmt: skip


def shard_for_stage3(model, args, config, decay_names, weights=None, param_offload=None) -> "ShardedModel":
    """ZeRO-3: `model`'s parameters sharded in place (zero3.shard_model), in flat buffers split
    by weight decay or not (the Trainer's `decay_names`), so each param group steps its own.
    Units: `--sharded_ddp "zero_dp_3 auto_wrap"` (or `auto` choosing stage 3, or a config at stage
    3, as DeepSpeed gathers module by module) one per layer (`zero3.auto_wrap_units`), else the
    whole model; the config's stage-3 keys set the persistence threshold and prefetch
    (config/apply.py `zero3_kwargs`). `param_offload`: the parameter store the plan chose
    (`plan.param_offload_spec(config)`, whose checks at load made sure the optimizer is offloaded
    too, or `plan.choose_strategy`'s, with the optimizer on disk), or None. `weights`: where a
    meta-device model's parameters are read from (`shard_model`'s)."""
    options = getattr(args, "sharded_ddp", None) or []
    # auto_wrap when asked, when --sharded_ddp auto chose stage 3 (the planner's estimate has one
    # unit per layer), or from a config alone; parameters offloaded: one unit per layer always (the
    # whole model as one unit would be read from the store whole, every forward and backward)
    auto_wrap = (ShardedDDPOption.AUTO_WRAP in options or ShardedDDPOption.AUTO in options
                 or (config is not None and ShardedDDPOption.ZERO_DP_3 not in options)
                 or param_offload is not None)  # fmt: skip
    units, how = auto_wrap_units(model) if auto_wrap else ([], WHOLE_MODEL)
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


def shard_meta_model(trainer, model) -> "ShardedModel":
    """A model built on the meta device (`loading.load_meta`: its weights are never whole in
    memory) sharded at the Trainer's start, its weights read from its checkpoint a tensor at a
    time, each rank keeping its slice (in RAM or the parameter store), so that evaluation and
    prediction run sharded too, before training or without it; `create_optimizer` then finds it sharded, in the dtype --bf16/--fp16
    ask for (a sharded model's dtype no longer changes)."""
    folder = getattr(model, META_WEIGHTS)
    if trainer.sharding_stage != 3:
        raise ArgumentError("the model is on the meta device (no weights, trainer_shard.load_meta): that is for "
                            "ZeRO-3, which reads each rank's slice of its weights (--sharded_ddp zero_dp_3, or an "
                            "--offload config at stage 3); load the model with from_pretrained for other "
                            "strategies")  # fmt: skip
    cast_for_mixed_precision(model, trainer.args)  # on meta, free: the shards made in the run's dtype
    weights = zero3_weights.checkpoint_weights(folder)
    if hasattr(model, "peft_config"):  # a PEFT model: its parameters' names are PEFT's
        weights = PeftNames(weights)
    try:
        sharded = shard_for_stage3(model, trainer.args, trainer.offload_config,
                                   trainer.get_decay_parameter_names(model), weights=weights,
                                   param_offload=trainer.param_offload_spec)  # fmt: skip
    finally:
        weights.close()
    force_prepare_model(trainer.accelerator, evaluation_mode=True, device_placement=False)
    if trainer.args.process_index == 0:
        logger.info("zero_dp_3: the model was built on the meta device; its weights were read from %s a tensor "
                    "at a time into the parameter store", folder)  # fmt: skip
    return sharded


class PeftNames:
    """A base model's checkpoint weights read by the names its parameters have under PEFT: the
    `base_model.model.` prefix, the `base_layer` a LoRA layer wraps the original in and the
    `modules_to_save` / `original_module` copies all read the original tensor."""

    _PEFT = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")

    def __init__(self, weights):
        self.weights = weights

    def base_name(self, name: str) -> str:
        return self._PEFT.sub("", name.removeprefix("base_model.model."))

    def __contains__(self, name) -> bool:
        return self.base_name(name) in self.weights

    def __getitem__(self, name):
        return self.weights[self.base_name(name)]

    def shape(self, name) -> tuple:
        return self.weights.shape(self.base_name(name))

    def read_into(self, name, out, start: int = 0) -> None:
        self.weights.read_into(self.base_name(name), out, start)

    def close(self) -> None:
        self.weights.close()


def on_meta(model) -> bool:
    """Built on the meta device by `loading.load_meta`, not sharded yet (a device-mapped model's
    offloaded weights are on meta too, under accelerate's hooks: not this)."""
    return getattr(model, META_WEIGHTS, None) is not None and any(p.device.type == "meta" for p in model.parameters())
