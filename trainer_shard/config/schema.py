"""The keys of the offload config: DeepSpeed's config schema, closed and typed, with a decision
for every key.

Each key is a `Key` with its type, bounds, default, a line of help and its `role`:

- "effect": the key takes effect here;
- "given": accepted as what the engine already does; a value outside `choices` contradicts it and
  is refused, naming the key;
- "ignored": diagnostics, logging, or the settings of another system: accepted, and each one
  present is named in one warning line with `help` (the reason);
- "stage3": ZeRO-3 settings, ignored with a warning at stages 0-2, as DeepSpeed ignores them; at
  stage 3 a value in `stage3_given` is as the engine does, and any other value has the decision
  `at_stage3` (effect, given, ignored or refused), `stage3_why` saying why. Where the Hugging Face
  integration leaves "auto" in them, DeepSpeed drops it: the key's `default` (DeepSpeed's) is
  decided instead. The keys of a stage-3 object (`offload_param`) carry their own decisions at
  stage 3; at 0-2 the object is one warning line.
- "refused": a setting whose meaning cannot be honoured here; `help` says why and what to do.

`configs/README.md` documents every key with its decision. A key in no schema (a typo) is an
error with close names suggested, never silently ignored.
"""

from dataclasses import dataclass, field, replace

from ..constants import BUCKET_NUMEL, DTYPE_NAMES, PRECISIONS

AUTO = "auto"


@dataclass(frozen=True)
class Key:
    kind: str  # bool | int | float | str | choice | object | floats | strs | memory | device_map
    help: str
    default: object = None
    auto: bool = False  # "auto" takes the TrainingArguments' value
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    choices: tuple = ()
    children: dict = field(default_factory=dict)  # for objects
    length: int | None = None  # for floats (a fixed-length list of numbers)
    role: str = "effect"  # effect | given | ignored | stage3 | refused: see the module docstring
    at_stage3: str = ""  # role "stage3": the decision at stage 3 for a value outside `stage3_given`
    stage3_given: tuple = ()  # role "stage3": the values that are what the engine does at stage 3
    stage3_why: str = ""  # role "stage3": what the engine does at stage 3, and so why

    @property
    def auto_is_a_value(self) -> bool:
        """Whether "auto" is one of this key's own values (a device-map strategy; "the checkpoint's
        dtype"), checked as any other value, rather than the placeholder that `auto=True` keys take
        from the TrainingArguments and other keys refuse."""
        return self.kind == "device_map" or AUTO in self.choices


ROLES = ("effect", "given", "ignored", "stage3", "refused")


def given(kind: str, why: str, allowed: tuple, default=None, **kwargs) -> Key:
    """Accepted with a value in `allowed`: what the engine does anyway (`why` says what)."""
    return Key(kind, why, allowed[0] if default is None else default, choices=allowed, role="given", **kwargs)


def ignored(why: str, default=None) -> Key:
    """Accepted and ignored, named in one warning line with `why`."""
    return Key("any", why, default, role="ignored")


def stage3(kind: str, meaning: str, at_stage3: str, why: str, given_values: tuple = (), **kwargs) -> Key:
    """A ZeRO-3 setting (see the module docstring): `meaning` is DeepSpeed's; at stage 3 a value in
    `given_values` is as the engine does, any other has the decision `at_stage3`, for `why`.
    "auto" is accepted as DeepSpeed accepts it (its config drops "auto": the default)."""
    return Key(kind, f"{_STAGE3}: {meaning}", role="stage3", at_stage3=at_stage3, stage3_why=why,
               stage3_given=given_values, auto=kwargs.pop("auto", kind not in ("object", "any")), **kwargs)  # fmt: skip


def refused(why: str) -> Key:
    """Refused wherever it appears; `why` is the reason and the fix."""
    return Key("any", why, role="refused")


OFFLOAD_OPTIMIZER = {
    "device": Key("choice", "where the fp32 master weights and optimizer state live", "none",
                  choices=("none", "cpu", "nvme")),
    "nvme_path": Key("str", "folder for the disk store (device nvme); one set of files per rank"),
    "pin_memory": Key("bool", "page-locked CPU buffers for faster host-device copies (CUDA only)", False),
    "buffer_count": Key("int", "chunk buffers in flight for the disk store", 4, minimum=1, maximum=64),
    "pipeline_read": given("bool", "the disk store always reads the next chunks ahead while one is stepped", (True, False)),
    "pipeline_write": given("bool", "the disk store always writes a stepped chunk back while the next is stepped",
                            (True, False)),
    "fast_init": ignored("DeepSpeed's initialisation shortcut for its NVMe swapper; the disk store here writes its "
                         "files once, at the first step"),
    "ratio": given("float", "the whole of the optimizer state is offloaded (DeepSpeed's partial offload, ratio < 1, "
                   "is not done here)", (1.0, 1)),
    "super_offload": given("bool", "SuperOffload (for CPU-GPU superchips, stage 3) is not done here", (False,)),
    "cpuadam_cores_perc": ignored("the share of cores DeepSpeed's CPU Adam uses; the CPU step here uses torch's "
                                  "threads (torch.set_num_threads)"),
}

_STAGE3 = "a ZeRO-3 (parameter sharding) setting"

PARAM_STORE = "<nvme_path>/zero3_params/rank<R>/"  # offload.param_store.PARAM_FOLDER, per rank

# DeepSpeed's DeepSpeedZeroOffloadParamConfig: its defaults, "auto" read as them (DeepSpeed drops it)
OFFLOAD_PARAM = {
    "device": stage3("choice", "where the parameter shards live between uses", "effect",
                     "none: in this process's memory; cpu: each unit's parameter shard in CPU RAM; nvme: each unit's "
                     f"parameter and gradient shards in files under {PARAM_STORE}, read ahead on a thread in the "
                     "recorded order of the units. cpu and nvme need the optimizer offloaded too "
                     "(offload_optimizer.device cpu or nvme, or --sharded_ddp \"zero_dp_3 offload\": CPU RAM)",
                     default="none", choices=("none", "cpu", "nvme")),
    "nvme_path": stage3("str", "folder for the parameter store (device nvme)", "effect",
                        f"the files are under {PARAM_STORE}, so it may be the optimizer's nvme_path; locked for the run, "
                        "checked for room (with the optimizer store's bytes when on the same disk) before anything is "
                        "written, deleted at the end; required with device nvme, refused with another device"),
    "buffer_count": stage3("int", "parameter buffers in flight (device nvme)", "effect",
                           "units whose gather buffers may be alive at once, the running one and those read ahead "
                           "(devices cpu and nvme); at least 2", default=5, minimum=0),
    "buffer_size": stage3("int", "elements a parameter buffer holds (device nvme)", "effect",
                          "the most elements one unit may hold (devices cpu and nvme): a bigger unit is refused when "
                          "the model is sharded, naming it; raise it or wrap smaller units", default=100_000_000,
                          minimum=0),
    "max_in_cpu": stage3("int", "parameter elements kept in CPU RAM (device nvme)", "effect",
                         "device nvme: the first units' shards, up to this many elements a rank, stay in RAM (set 0 to "
                         "put every shard on disk); ignored with device cpu, where every shard is in RAM",
                         default=1_000_000_000, minimum=0),
    "pin_memory": stage3("bool", "page-locked parameter buffers", "effect",
                         "the parameter shards kept in RAM are page-locked when CUDA is present (asynchronous copies "
                         "to the device); nothing without a GPU", default=False),
}

STAGE3_PREFETCH = 50_000_000  # DeepSpeed's default stage3_prefetch_bucket_size
STAGE3_PERSISTENCE = 100_000  # DeepSpeed's default stage3_param_persistence_threshold (= sharding.zero3's)
STAGE3_MAX_LIVE = 1_000_000_000  # DeepSpeed's default stage3_max_live_parameters

_ONE_GATHER = "each unit is gathered with one all-gather of its flat buffer"

# the ZeRO-3 keys under their stage3_ names; DeepSpeed reads each under its other names too
_STAGE3_KEYS = {
    "stage3_prefetch_bucket_size": stage3(
        "int", "elements gathered ahead of use", "effect",
        "the units that follow in the recorded order are gathered ahead while their elements stay within it (at "
        'least the next unit when above 0; 0: no prefetch); "auto": 0.9 x hidden size squared, as the Hugging Face '
        "integration fills it", default=STAGE3_PREFETCH, minimum=0),
    "stage3_param_persistence_threshold": stage3(
        "int", "parameters of at most this many elements stay whole on every rank", "effect",
        "they are not sharded: every rank keeps them whole, and their gradients are all-reduced; \"auto\": 10 x "
        "hidden size, as the Hugging Face integration fills it", default=STAGE3_PERSISTENCE, minimum=0),
    "stage3_model_persistence_threshold": stage3(
        "int", "most elements kept whole by stage3_param_persistence_threshold, in all", "given",
        "every parameter of at most the persistence threshold (and every frozen one) stays whole, however many: a "
        "value below their total for the model is refused once the model is known", minimum=0),
    "stage3_max_live_parameters": stage3(
        "int", "most gathered parameter elements alive at once", "effect",
        "caps the prefetch: at most this many elements are gathered ahead (DeepSpeed prefetches only while fewer are "
        "gathered); the running unit is gathered whatever the cap, as in DeepSpeed, and freed right after its use",
        default=STAGE3_MAX_LIVE, minimum=0),
    "stage3_max_reuse_distance": stage3(
        "int", "parameters used again within this many elements stay gathered", "ignored",
        "each unit is freed as soon as its forward or its backward is done and gathered again at its next use, as "
        "DeepSpeed does with 0: less memory for one more gather, the same results", (0,), default=1_000_000_000,
        minimum=0),
    "stage3_gather_16bit_weights_on_model_save": stage3(
        "bool", "gather the whole model to write its weights at save_model", "ignored",
        "DeepSpeed writes the weights at save_model only with true (false, or \"auto\" as accelerate fills it by "
        "default: only its checkpoint's shards); save_model here always writes the whole model.safetensors, streamed a "
        "unit at a time (no rank holds the whole model)", (True,), default=False),
    "stage3_module_granularity_threshold": stage3(
        "int", "fetch the parameters of modules finer than this together", "ignored",
        "each unit (a class --sharded_ddp auto_wrap picks, or the whole model) is gathered whole, one flat buffer, "
        "however fine its modules", default=0),
    "stage3_use_all_reduce_for_fetch_params": stage3(
        "bool", "fetch parameters with an all-reduce instead of an all-gather", "ignored", _ONE_GATHER, (False,),
        default=False),
    "stage3_allgather_sequential": stage3(
        "bool", "gather parameters one at a time, without a bucket", "ignored", _ONE_GATHER, (False,), default=False),
    "stage3_partition_stream_chunk_size": stage3(
        "int", "partition large parameters in chunks of this many elements while loading", "ignored",
        "the model is sharded once, a unit at a time, after it is loaded"),
}  # fmt: skip

STAGE3_ALIASES = {
    "stage3_prefetch_bucket_size": ("prefetch_bucket_size",),
    "stage3_param_persistence_threshold": ("param_persistence_threshold",),
    "stage3_model_persistence_threshold": ("model_persistence_threshold",),
    "stage3_max_live_parameters": ("max_live_parameters",),
    "stage3_max_reuse_distance": ("max_reuse_distance",),
    "stage3_gather_16bit_weights_on_model_save": ("stage3_gather_fp16_weights_on_model_save",
                                                  "gather_16bit_weights_on_model_save"),
    "stage3_module_granularity_threshold": ("module_granularity_threshold",),
    "stage3_use_all_reduce_for_fetch_params": ("use_all_reduce_for_fetch_params",),
    "stage3_allgather_sequential": ("allgather_sequential",),
    "stage3_partition_stream_chunk_size": ("partition_stream_chunk_size",),
}  # fmt: skip
"""Each ZeRO-3 setting's other names (DeepSpeed reads the field name and the stage3_ alias alike,
and the fp16 one as the old name of the 16-bit one)."""

_FILLED_BY_HF = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")


def _other_name(name: str, other: str) -> Key:
    key = _STAGE3_KEYS[name]
    why = f"as {name}"
    if name in _FILLED_BY_HF:
        why += (f'; "auto" under this name is DeepSpeed\'s default (the Hugging Face integration fills only {name})')
    old = "old" if "fp16" in other else "other"
    return replace(key, help=f"{_STAGE3}: {old} name of {name}", stage3_why=why)


def _stage3_keys() -> dict:
    out = {}
    for name, key in _STAGE3_KEYS.items():
        out[name] = key
        out |= {other: _other_name(name, other) for other in STAGE3_ALIASES[name]}
    return out


ZERO_OPTIMIZATION = {
    "stage": Key("int", "0: no sharding, 1: optimizer state sharded (simple), 2: gradients too (zero_dp_2), 3: "
                 "parameters too (zero_dp_3)", 0, minimum=0, maximum=3),
    "offload_optimizer": Key("object", "the offload store", children=OFFLOAD_OPTIMIZER),
    "cpu_offload": Key("bool", "old form of offload_optimizer.device = cpu", False),
    "reduce_bucket_size": Key("int", 'elements per gradient bucket; "auto": hidden size squared, as the Hugging Face '
                              "integration fills it; 0 only at stage 3, where it is not used", BUCKET_NUMEL, auto=True,
                              minimum=0),
    "allgather_bucket_size": Key("int", "elements per all-gather bucket at stage 1; at stage 2 the buckets are "
                                 "all-gathered as they were reduced (a different value is ignored with a warning)",
                                 BUCKET_NUMEL, auto=True, minimum=1),
    "overlap_comm": Key("bool", "reduce gradient buckets while backward runs", True),
    "contiguous_gradients": given("bool", "gradients are always copied into contiguous buckets as they are produced",
                                  (True,)),
    "reduce_scatter": given("bool", "stage 2 reduce-scatters the gradient buckets (false would all-reduce them)", (True,)),
    "allgather_partitions": given("bool", "each rank's updated shard is all-gathered after the step (false would "
                                  "broadcast it)", (True,)),
    "round_robin_gradients": given("bool", "the order gradients are copied to the offload store in; the result is the "
                                   "same either way", (False, True)),
    "use_multi_rank_bucket_allreduce": ignored("tunes DeepSpeed's own all-reduce of several ranks' buckets; not used "
                                               "here"),
    "load_from_fp32_weights": given("bool", "resuming restores the fp32 master weights from the checkpoint's optimizer "
                                    "shards", (True,)),
    "elastic_checkpoint": given("bool", "checkpoints here always load at another world size, without conversion",
                                (False, True)),
    "ignore_unused_parameters": given("bool", "parameters that get no gradient in a step are skipped", (True,)),
    "legacy_stage1": given("bool", "DeepSpeed's old stage-1 implementation", (False,)),
    "sub_group_size": stage3("int", "elements of the fp32 shard the optimizer steps at a time", "ignored",
                             "the optimizer steps the shard here in chunks of its own (the offload store's, or the "
                             "whole shard on the device); the update is the same element by element",
                             default=1_000_000_000, minimum=0),
    "offload_param": stage3("object", "where the parameter shards live", "effect", "decided key by key",
                            children=OFFLOAD_PARAM),
    "cpu_offload_param": stage3("bool", "old form of offload_param.device = cpu", "effect",
                                "true: offload_param.device cpu (refused with another device there); false: as "
                                "offload_param says", default=False),
    "cpu_offload_use_pin_memory": stage3("bool", "old form of the pin_memory of offload_param and offload_optimizer",
                                         "ignored", "deprecated in DeepSpeed, where it sets nothing any more; "
                                         "pin_memory belongs in offload_optimizer"),
    **_stage3_keys(),
    "memory_efficient_linear": stage3("bool", "DeepSpeed's linear layer that keeps no weight for backward (under "
                                      "zero.Init)", "ignored", "modules run their own forward here; a unit's weights "
                                      "are gathered again for its backward", default=True),
    "pipeline_loading_checkpoint": stage3("bool", "load a checkpoint into the shards while they are made", "ignored",
                                          "the model is loaded whole on each rank, then sharded unit by unit",
                                          (False,), default=False),
    "override_module_apply": stage3("bool", "gather parameters for nn.Module.apply under zero.Init", "ignored",
                                    "the model is built and initialized whole, then sharded, so apply sees whole "
                                    "parameters", default=True),
    "log_trace_cache_warnings": stage3("bool", "warn when the recorded module order is invalidated", "ignored",
                                       "diagnostics of DeepSpeed's prefetch trace", default=False),
    "save_muon_momentum_buffer_in_memory": stage3("bool", "Muon's momentum in memory with NVMe offload", "ignored",
                                                  "a Muon setting; the optimizers here are AdamW, Adam and SGD",
                                                  default=False),
    "leaf_module": stage3("any", "modules gathered whole, without hooks on their children", "ignored",
                          "each unit here (a class --sharded_ddp auto_wrap picks) is gathered whole, with its "
                          "children"),
    "zero_hpz_partition_size": given("int", "ZeRO++ hierarchical partitioning (a secondary shard per node) is not "
                                     "done here; 1 is the only value", (1,)),
    "zero_quantized_weights": given("bool", "ZeRO++ quantized weight all-gather is not done here", (False,)),
    "zero_quantized_nontrainable_weights": given("bool", "ZeRO++ quantized frozen weights are not done here", (False,)),
    "zero_quantized_gradients": given("bool", "ZeRO++ quantized gradient reduction is not done here", (False,)),
    "zeropp_loco_param": given("any", "ZeRO++ LoCo error feedback is not done here", (None,)),
    "mics_shard_size": given("int", "MiCS sub-group sharding is not done here: every rank shares one partition",
                             (-1,)),
    "mics_hierarchical_params_gather": given("bool", "MiCS hierarchical gather is not done here", (False,)),
    "compute_grad_norm": given("bool", "the global gradient norm is computed when clipping needs it", (True,)),
    "parameter_alignment": ignored("pads DeepSpeed's flat buffers for aligned access; the flat buffers here are laid "
                                   "out by their own rule"),
    "enable_sanity_checks": ignored("DeepSpeed's internal debug checks"),
    "zenflow": refused("ZenFlow's selective, delayed updates change the optimizer step and are not done here; remove "
                       "the section"),
}

OPTIMIZER_PARAMS = {
    "lr": Key("float", "learning rate", auto=True, minimum=0.0),
    "betas": Key("floats", "Adam betas", auto=True, minimum=0.0, maximum=1.0, length=2),
    "eps": Key("float", "Adam epsilon", auto=True, minimum=0.0, exclusive_minimum=True),
    "weight_decay": Key("float", "decoupled weight decay", auto=True, minimum=0.0),
    "momentum": Key("float", "SGD momentum", minimum=0.0),
    "nesterov": Key("bool", "SGD: Nesterov momentum"),
    "dampening": Key("float", "SGD: momentum dampening", minimum=0.0),
    "amsgrad": Key("bool", "Adam/AdamW: the AMSGrad variant (torch's fused kernel)"),
    "adam_w_mode": Key("bool", "type Adam only: true (the default, as in DeepSpeed) = decoupled weight decay "
                       "(AdamW); false = L2 penalty (torch Adam)"),
    "fp32_optimizer_states": given("bool", "optimizer state is fp32 here", (True,)),
    "foreach": ignored("chooses torch's foreach Adam with torch_adam; Adam here is torch's fused kernel"),
    "set_grad_none": given("bool", "gradients are released after each step here", (True, False)),
    "max_grad_norm": refused("DeepSpeed refuses it too: clip with the top-level gradient_clipping (= --max_grad_norm)"),
    "eps_inside_sqrt": refused("a Lamb argument; the optimizers here are AdamW, Adam and SGD"),
    "max_coeff": refused("a Lamb argument; the optimizers here are AdamW, Adam and SGD"),
    "min_coeff": refused("a Lamb argument; the optimizers here are AdamW, Adam and SGD"),
    "ns_method": refused("a Muon argument; the optimizers here are AdamW, Adam and SGD"),
    "muon_lr": refused("a Muon argument; the optimizers here are AdamW, Adam and SGD"),
    "adam_lr": refused("a Muon argument; the optimizers here are AdamW, Adam and SGD"),
    "torch_adam": given("bool", "Adam and AdamW always run torch's fused kernel here; DeepSpeed's own kernels compute "
                        "the same update", (True, False)),
    "bias_correction": given("bool", "Adam's bias correction is always applied (torch's Adam)", (True,)),
}

OPTIMIZER = {
    "type": Key("choice", "the optimizer", "AdamW", choices=("AdamW", "Adam", "SGD")),
    "params": Key("object", "its arguments", children=OPTIMIZER_PARAMS),
    "legacy_fusion": given("bool", "DeepSpeed's old fused fp16 Adam is not used", (False,)),
}

SCHEDULER_PARAMS = {
    "warmup_min_lr": Key("float", "learning rate at step 0", auto=True, minimum=0.0),
    "warmup_max_lr": Key("float", "learning rate at the end of warmup", auto=True, minimum=0.0),
    "warmup_num_steps": Key("int", 'warmup steps; "auto": --warmup_steps, a count, or a ratio of the training steps '
                            "when below 1", auto=True, minimum=0),
    "total_num_steps": Key("int", 'WarmupDecayLR: steps to decay to 0 over; "auto": the run\'s training steps',
                           auto=True, minimum=1),
    "warmup_type": Key("choice", "warmup curve", "log", choices=("log", "linear")),
    **{key: refused(f"an argument of DeepSpeed's {kind} schedule, which is not here; use the Trainer's "
                    "--lr_scheduler_type (cosine, linear, constant_with_warmup...) and remove the scheduler section")
       for kind, keys in (("WarmupCosineLR", ("warmup_min_ratio", "cos_min_ratio")),
                          ("LRRangeTest", ("lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                                           "lr_range_test_staircase")),
                          ("OneCycle", ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size",
                                        "cycle_second_step_size", "cycle_first_stair_count", "cycle_second_stair_count",
                                        "decay_step_size", "cycle_momentum", "cycle_min_mom", "cycle_max_mom",
                                        "decay_mom_rate")))
       for key in keys},  # fmt: skip
    "last_batch_iteration": given("int", "the schedule starts at the beginning, or where the checkpoint resumed "
                                  "stands", (-1,)),
}

SCHEDULER = {
    "type": Key("choice", "the LR schedule (omit the section to keep the Trainer's --lr_scheduler_type); DeepSpeed's "
                "WarmupCosineLR, OneCycle and LRRangeTest are not here: use --lr_scheduler_type", None,
                choices=("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")),
    "params": Key("object", "its arguments", children=SCHEDULER_PARAMS),
}

FP16 = {
    "enabled": Key("bool", "fp16 mixed precision", False, auto=True),
    "loss_scale": Key("float", "0: dynamic loss scaling; > 0: this static scale", 0.0, minimum=0.0),
    "initial_scale_power": Key("int", "dynamic scaling starts at 2**this", 16, minimum=0, maximum=64),
    "loss_scale_window": Key("int", "good steps before the scale grows", 1000, minimum=1),
    "hysteresis": Key("int", "overflows the scale absorbs before it halves (DeepSpeed's delayed shift), counted "
                      "since the count was last restored: when the scale grows, or with consecutive_hysteresis after "
                      "every step without overflow", 2, minimum=1),
    "consecutive_hysteresis": Key("bool", "a step without overflow restores the hysteresis (false: only when the "
                                  "scale grows)", False),
    "min_loss_scale": Key("float", "the scale never drops below this; an overflow at this scale stops the run, as in "
                          "DeepSpeed", 1.0, minimum=0.0, exclusive_minimum=True),
    "auto_cast": given("bool", "the model's parameters are cast to fp16 and it runs in fp16; inputs are not "
                       "autocast", (False,)),
    "fp16_master_weights_and_grads": given("bool", "master weights are fp32 here", (False,)),
}

BF16 = {
    "enabled": Key("bool", "bf16 mixed precision", False, auto=True),
    "immediate_grad_update": ignored("how DeepSpeed's bf16 optimizer accumulates gradients; here they go into the "
                                     "gradient shard as backward produces them"),
    "check_grad_overflow": given("bool", "bf16 steps are not checked for overflow (there is no loss scale)", (False,)),
    "bf16_master_weights_and_grads": given("bool", "master weights are fp32 here", (False,)),
    "bf16_optimizer_states": given("bool", "optimizer state is fp32 here", (False,)),
}

AMP = {
    "enabled": given("bool", "NVIDIA apex AMP is not used; mixed precision comes from --fp16/--bf16 or the fp16/bf16 "
                     "sections", (False,)),
    "opt_level": ignored("an apex AMP setting; apex AMP is not used"),
}

DATA_TYPES = {
    "grad_accum_dtype": Key("choice", "dtype of the gradient shard the optimizer steps from: fp32 (DeepSpeed's "
                            "layout; the upcast happens as gradients are reduced) or the 16-bit training dtype (half "
                            "the memory; offload only, upcast a chunk at a time in the step). Default: fp32, or the "
                            "training dtype with offload", None, choices=PRECISIONS),
    "param_dtype": Key("choice", "the parameters' dtype: must be the training dtype (fp32, or bf16/fp16 with "
                       "--bf16/--fp16), to which the model is cast", None, choices=PRECISIONS),
    "buffer_dtype": given("any", "buffers are cast with the parameters to the training dtype", (None,)),
    "keep_in_fp32_modules": refused("the whole model is cast to the training dtype here (fp32 masters live in the "
                                    "optimizer); remove it"),
}

INFERENCE = {
    "device_map": Key("device_map", "where each module goes for evaluation and prediction: auto, balanced, "
                      "balanced_low_0, sequential (planned from the model's shapes under max_memory), or an explicit "
                      '{"module.name": "cpu" | "disk" | GPU index} map', "auto"),
    "max_memory": Key("memory", 'most bytes per device, e.g. {"cpu": "2GiB", "0": "20GiB"}; what does not fit goes to '
                      "the next device, then to disk (default: what each device has free)"),
    "offload_folder": Key("str", "folder for the weights offloaded to disk (needed when any go there)"),
    "dtype": Key("choice", "dtype to load the weights in (auto: the checkpoint's)", "auto",
                 choices=(AUTO, *DTYPE_NAMES)),
    "no_split_module_classes": Key("strs", "module classes never split across devices (default: the model's own "
                                   "_no_split_modules, T5Block for T5)"),
    "offload_buffers": Key("bool", "offload buffers with the parameters of offloaded modules", False),
}

CHECKPOINT = {
    "use_node_local_storage": Key("bool", "= --save_on_each_node: every node writes its own ranks' shards (a run "
                                  "without a shared filesystem)", auto=True),
    "tag_validation": ignored("DeepSpeed's check that every rank saves under the same tag; here every checkpoint has a "
                              "manifest of every rank's files, checked at load"),
    "load_universal": ignored("DeepSpeed's universal-checkpoint loading; checkpoints here load at any world size "
                              "without a conversion"),
    "checkpoint_serialization": ignored("DeepSpeed's choice of torch serialization; shards here are safetensors and "
                                        "torch files"),
    "writer": ignored("DeepSpeed's fast checkpoint writer"),
    "parallel_write": ignored("DeepSpeed's pipelined checkpoint writer; each rank writes its own shards here"),
}

_MONITOR = "a monitoring backend; the Trainer reports through --report_to"

TOP = {
    "zero_optimization": Key("object", "sharding and offload (the old form true/false: stage 1 or 0)",
                             children=ZERO_OPTIMIZATION),
    "optimizer": Key("object", "the optimizer (omit to keep the Trainer's --optim)", children=OPTIMIZER),
    "scheduler": Key("object", "the LR schedule", children=SCHEDULER),
    "gradient_clipping": Key("float", "clip the global gradient norm to this (0: off)", auto=True, minimum=0.0),
    "fp16": Key("object", "fp16 mixed precision", children=FP16),
    "bf16": Key("object", "bf16 mixed precision", children=BF16),
    "bfloat16": Key("object", "old name of bf16", children=BF16),
    "amp": Key("object", "NVIDIA apex AMP", children=AMP),
    "data_types": Key("object", "dtypes of the sharded optimizer's buffers", children=DATA_TYPES),
    "communication_data_type": Key("choice", "stage 2: the dtype gradient buckets are summed over ranks in (default: "
                                   "the training dtype up to 8 ranks, fp32 beyond); stage 1 sums in the training dtype",
                                   None, choices=PRECISIONS),
    "allgather_size": Key("int", 'old form of zero_optimization.allgather_bucket_size, read with "zero_optimization": '
                          "true or false", minimum=1),
    "train_micro_batch_size_per_gpu": Key("int", "= --per_device_train_batch_size", auto=True, minimum=1),
    "gradient_accumulation_steps": Key("int", "= --gradient_accumulation_steps", auto=True, minimum=1),
    "train_batch_size": Key("int", "= micro batch x accumulation x world size", auto=True, minimum=1),
    "checkpoint": Key("object", "checkpoint options", children=CHECKPOINT),
    "prescale_gradients": given("bool", "gradients are divided by the world size before they are summed here (as "
                                "with true); the average is the same either way", (False, True)),
    "gradient_predivide_factor": given("float", "gradients are divided by the world size before they are summed "
                                       "here; the average is the same whatever the factor", (1.0,),
                                       minimum=0.0, exclusive_minimum=True),
    "sparse_gradients": given("bool", "sparse embedding gradients are not supported: gradients are dense", (False,)),
    "disable_allgather": given("bool", "the updated shards are always all-gathered after the step", (False,)),
    "zero_allow_untested_optimizer": given("bool", "any elementwise torch optimizer is sharded here (others are "
                                           "refused by name)", (True, False)),
    "zero_force_ds_cpu_optimizer": ignored("forces DeepSpeed's own CPU Adam; the offloaded step here is torch's fused "
                                           "AdamW"),
    "dataloader_drop_last": ignored("DeepSpeed's own data loader; the Trainer's follows --dataloader_drop_last"),
    "steps_per_print": ignored("DeepSpeed's progress print; the Trainer logs every --logging_steps"),
    "wall_clock_breakdown": ignored("DeepSpeed's timers; trainer_shard labels each phase for torch.profiler"),
    "memory_breakdown": ignored("DeepSpeed's memory print; the planner (trainer-shard estimate) and the run's log "
                                "report memory"),
    "dump_state": ignored("DeepSpeed prints its config at start; trainer-shard validate-config prints this one"),
    "timers": ignored("DeepSpeed's throughput timers"),
    "flops_profiler": ignored("DeepSpeed's FLOPs profiler"),
    "comms_logger": ignored("DeepSpeed's communication logger"),
    "comms_config": ignored("DeepSpeed's communication logger (old name)"),
    "monitor_config": ignored(_MONITOR),
    "tensorboard": ignored(_MONITOR),
    "wandb": ignored(_MONITOR),
    "csv_monitor": ignored(_MONITOR),
    "comet": ignored(_MONITOR),
    "activation_checkpointing": ignored("DeepSpeed's Megatron-style checkpointing API, used only by models that call "
                                        "it; Hugging Face models checkpoint with --gradient_checkpointing"),
    "autotuning": ignored("DeepSpeed's autotuner; --sharded_ddp auto plans the strategy here"),
    "elasticity": refused("elastic batch sizes across world sizes are not supported; remove the section and set the "
                          "batch size with --per_device_train_batch_size"),
    "compression_training": refused("DeepSpeed's compression (quantization-aware training, pruning) is not done here; "
                                    "remove the section"),
    "data_efficiency": refused("DeepSpeed's curriculum and data sampling change which samples train and are not done "
                               "here; remove the section"),
    "curriculum_learning": refused("DeepSpeed's curriculum learning changes which samples train and is not done "
                                   "here; remove the section"),
    "progressive_layer_drop": refused("progressive layer dropping changes the model's forward and is not done here; "
                                      "remove the section"),
    "eigenvalue": ignored("DeepSpeed's Hessian eigenvalue diagnostics"),
    "pipeline": ignored("DeepSpeed's pipeline-parallel engine settings; there is no pipeline parallelism here"),
    "sparse_attention": refused("DeepSpeed's sparse attention kernels replace the model's attention and are not "
                                "available here; remove the section"),
    "quantize_training": refused("DeepSpeed's mixed-precision quantization is not done here; remove the section"),
    "weight_quantization": refused("DeepSpeed's weight quantization is not done here; remove the section"),
    "hybrid_engine": ignored("DeepSpeed-Chat's RLHF inference engine"),
    "nebula": ignored("Azure Nebula checkpoint service settings; checkpoints here are written by each rank"),
    "aio": ignored("DeepSpeed's libaio settings; the disk store here reads and writes with its own threads "
                   "(buffer_count)"),
    "compile": ignored("DeepSpeed's torch.compile switch; use the Trainer's --torch_compile"),
    "graph_harvesting": ignored("DeepSpeed's CUDA graph capture of its own kernels"),
    "torch_autocast": given("any", "autocast is not used: the model runs in the training dtype; remove the section",
                            (None,)),
    "seq_parallel_communication_data_type": ignored("a sequence-parallel setting; there is no sequence parallelism here"),
    "managed_gradient_accumulation": given("bool", "the Trainer steps the optimizer at the end of each "
                                           "--gradient_accumulation_steps", (True,)),
    "gradient_allreduce_op": given("choice", "gradients are averaged over the ranks", ("mean",)),
    "disable_python_gc": ignored("DeepSpeed switches Python's garbage collector off during training"),
    "vocabulary_size": ignored("DeepSpeed uses it only for a warning"),
    "log_level": ignored("DeepSpeed's logger; use the Trainer's --log_level"),
    "data_parallel_size": ignored("with sequence parallelism, DeepSpeed's device mesh; the data-parallel size here is "
                                  "the launcher's world size"),
    "expert_parallel": refused("mixture-of-experts expert parallelism is not done here; remove the section"),
    "datastates_ckpt": ignored("DataStates asynchronous checkpointing; each rank writes its own shards here"),
    "sequence_parallel_size": given("int", "sequence parallelism is not done here", (1,)),
    "tensor_parallel": ignored("DeepSpeed's automatic tensor parallelism for inference"),
    "use_data_before_expert_parallelism": ignored("a mixture-of-experts setting of DeepSpeed's engine"),
    "max_memory": Key("memory", "per-rank memory budget --sharded_ddp auto plans for, e.g. {\"cpu\": \"8GiB\"} "
                      "or {\"0\": \"24GiB\"} (default: the GPU's memory, or the free RAM over the local ranks)"),
    "inference": Key("object", "big-model loading for --do_eval/--do_predict without --do_train and for "
                     "scripts/generate.py: device map, memory caps, disk offload of parameters", children=INFERENCE),
}
