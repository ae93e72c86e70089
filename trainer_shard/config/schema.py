"""The keys of the offload config: a DeepSpeed-compatible subset, closed and typed.

Each key is a `Key` with its type, bounds, default and a line of help; `configs/README.md`
documents the same keys. Anything not listed here is an error, never silently ignored.
"""

from dataclasses import dataclass, field

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

    @property
    def auto_is_a_value(self) -> bool:
        """Whether "auto" is one of this key's own values (a device-map strategy; "the checkpoint's
        dtype"), checked as any other value, rather than the placeholder that `auto=True` keys take
        from the TrainingArguments and other keys refuse."""
        return self.kind == "device_map" or AUTO in self.choices


OFFLOAD_OPTIMIZER = {
    "device": Key("choice", "where the fp32 master weights and optimizer state live", "none",
                  choices=("none", "cpu", "nvme")),
    "nvme_path": Key("str", "folder for the disk store (device nvme); one set of files per rank"),
    "pin_memory": Key("bool", "page-locked CPU buffers for faster host-device copies (CUDA only)", False),
    "buffer_count": Key("int", "chunk buffers in flight for the disk store", 4, minimum=1, maximum=64),
}

ZERO_OPTIMIZATION = {
    "stage": Key("int", "0: no sharding, 1: optimizer state sharded (simple), 2: gradients too (zero_dp_2)", 0,
                 minimum=0, maximum=3),
    "offload_optimizer": Key("object", "the offload store", children=OFFLOAD_OPTIMIZER),
    "cpu_offload": Key("bool", "old form of offload_optimizer.device = cpu", False),
    "reduce_bucket_size": Key("int", "elements per gradient bucket (ZeRO-2)", BUCKET_NUMEL, auto=True, minimum=1),
    "allgather_bucket_size": Key("int", "elements per all-gather bucket", BUCKET_NUMEL, auto=True, minimum=1),
    "overlap_comm": Key("bool", "reduce gradient buckets while backward runs", True),
    "contiguous_gradients": Key("bool", "copy gradients into contiguous buckets as they are produced (always "
                                "done: only true is accepted)", True, choices=(True,)),
}

OPTIMIZER_PARAMS = {
    "lr": Key("float", "learning rate", auto=True, minimum=0.0),
    "betas": Key("floats", "Adam betas", auto=True, minimum=0.0, maximum=1.0, length=2),
    "eps": Key("float", "Adam epsilon", auto=True, minimum=0.0, exclusive_minimum=True),
    "weight_decay": Key("float", "decoupled weight decay", auto=True, minimum=0.0),
    "momentum": Key("float", "SGD momentum", minimum=0.0),
    "adam_w_mode": Key("bool", "type Adam only: true (the default, as in DeepSpeed) = decoupled weight decay "
                       "(AdamW); false = L2 penalty (torch Adam)"),
}

OPTIMIZER = {
    "type": Key("choice", "the optimizer", "AdamW", choices=("AdamW", "Adam", "SGD")),
    "params": Key("object", "its arguments", children=OPTIMIZER_PARAMS),
}

SCHEDULER_PARAMS = {
    "warmup_min_lr": Key("float", "learning rate at step 0", auto=True, minimum=0.0),
    "warmup_max_lr": Key("float", "learning rate at the end of warmup", auto=True, minimum=0.0),
    "warmup_num_steps": Key("int", "warmup steps", auto=True, minimum=0),
    "total_num_steps": Key("int", "WarmupDecayLR: steps to decay to 0 over", auto=True, minimum=1),
    "warmup_type": Key("choice", "warmup curve", "log", choices=("log", "linear")),
}

SCHEDULER = {
    "type": Key("choice", "the LR schedule (omit the section to keep the Trainer's --lr_scheduler_type)", None,
                choices=("WarmupLR", "WarmupDecayLR")),
    "params": Key("object", "its arguments", children=SCHEDULER_PARAMS),
}

FP16 = {
    "enabled": Key("bool", "fp16 mixed precision", False, auto=True),
    "loss_scale": Key("float", "0: dynamic loss scaling; > 0: this static scale", 0.0, minimum=0.0),
    "initial_scale_power": Key("int", "dynamic scaling starts at 2**this", 16, minimum=0, maximum=64),
    "loss_scale_window": Key("int", "good steps before the scale grows", 1000, minimum=1),
    "min_loss_scale": Key("float", "the scale never drops below this", 1.0, minimum=0.0, exclusive_minimum=True),
}

BF16 = {"enabled": Key("bool", "bf16 mixed precision", False, auto=True)}

DATA_TYPES = {
    "grad_accum_dtype": Key("choice", "dtype of the gradient shard the optimizer steps from: fp32 (DeepSpeed's "
                            "layout; the upcast happens as gradients are reduced) or the 16-bit training dtype (half "
                            "the memory; offload only, upcast a chunk at a time in the step). Default: fp32, or the "
                            "training dtype with offload", None, choices=PRECISIONS),
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

TOP = {
    "zero_optimization": Key("object", "sharding and offload", children=ZERO_OPTIMIZATION),
    "optimizer": Key("object", "the optimizer (omit to keep the Trainer's --optim)", children=OPTIMIZER),
    "scheduler": Key("object", "the LR schedule", children=SCHEDULER),
    "gradient_clipping": Key("float", "clip the global gradient norm to this (0: off)", auto=True, minimum=0.0),
    "fp16": Key("object", "fp16 mixed precision", children=FP16),
    "bf16": Key("object", "bf16 mixed precision", children=BF16),
    "data_types": Key("object", "dtypes of the sharded optimizer's buffers", children=DATA_TYPES),
    "train_micro_batch_size_per_gpu": Key("int", "= --per_device_train_batch_size", auto=True, minimum=1),
    "gradient_accumulation_steps": Key("int", "= --gradient_accumulation_steps", auto=True, minimum=1),
    "train_batch_size": Key("int", "= micro batch x accumulation x world size", auto=True, minimum=1),
    "max_memory": Key("memory", "per-rank memory budget --sharded_ddp auto plans for, e.g. {\"cpu\": \"8GiB\"} "
                      "or {\"0\": \"24GiB\"} (default: the GPU's memory, or the free RAM over the local ranks)"),
    "inference": Key("object", "big-model loading for --do_eval/--do_predict without --do_train and for "
                     "scripts/generate.py: device map, memory caps, disk offload of parameters", children=INFERENCE),
}
