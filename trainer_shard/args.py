"""The two flags trainer_shard adds to TrainingArguments: `--sharded_ddp` and `--offload`.

    --sharded_ddp "zero_dp_2 offload"   space-separated options, as in transformers 4.x
    --offload configs/offload_cpu.json  the offload engine's JSON config

Both are parsed and checked in `__post_init__`, so a bad value stops the run at parse time,
before any output is written. Every problem is collected and reported at once.

[Note: unbuilt options] The options are the whole planned surface. Those whose engine is not in
this release are refused with a message saying so, never accepted and ignored: `_NOT_BUILT`
names them and what each is missing; a release that adds an engine removes its option there.
"""

import difflib
import enum
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from transformers import Seq2SeqTrainingArguments, TrainingArguments

from . import dtypes
from .errors import ArgumentError

logger = logging.getLogger(__name__)


class ShardedDDPOption(str, enum.Enum):
    SIMPLE = "simple"  # ZeRO-1: optimizer state partitioned, gradients all-reduced
    ZERO_DP_2 = "zero_dp_2"  # ZeRO-2: gradients reduce-scattered into shards too
    ZERO_DP_3 = "zero_dp_3"  # ZeRO-3: parameters partitioned too
    OFFLOAD = "offload"  # CPU offload with the default offload config
    AUTO_WRAP = "auto_wrap"  # wrap submodules for parameter sharding (ZeRO-3 only)
    AUTO = "auto"  # the least costly of DDP, simple, zero_dp_2 (+ cpu / disk offload) that fits (planner.py)


STRATEGIES = (ShardedDDPOption.SIMPLE, ShardedDDPOption.ZERO_DP_2, ShardedDDPOption.ZERO_DP_3, ShardedDDPOption.AUTO)

# See [Note: unbuilt options].
_NOT_BUILT = {}


def parse_sharded_ddp(value) -> tuple[list, list]:
    """`"zero_dp_2 offload"` (or a list of strings) -> (options, problems). Pure, no torch.

    Problems quote what was given abbreviated, so that hostile input makes a short message."""
    if value is None or value is False or value == "":
        return [], []
    if isinstance(value, str):
        words = value.replace(",", " ").split()
    elif isinstance(value, (list, tuple)):
        words = value
    else:
        return [], [f"--sharded_ddp must be a string of space-separated options, got {_shown(value)}"]
    options, unknown = [], []
    for word in words:
        if isinstance(word, ShardedDDPOption):
            option = word
        elif isinstance(word, str) and word in ShardedDDPOption._value2member_map_:
            option = ShardedDDPOption(word)
        else:
            unknown.append(word)
            continue
        if option not in options:
            options.append(option)
    return options, _unknown_problems(unknown) + _combination_problems(options)


def _unknown_problems(unknown: list) -> list:
    if not unknown:
        return []
    allowed = ", ".join(o.value for o in ShardedDDPOption)
    shown = list(dict.fromkeys(_shown(word) + _did_you_mean(word) for word in unknown))
    names = ", ".join(shown[:3])
    more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
    plural = "s" if len(shown) > 1 else ""
    return [f"--sharded_ddp: unknown option{plural} {names}{more}; the options are: {allowed}"]


def _did_you_mean(word) -> str:
    if not isinstance(word, str) or len(word) > 40:
        return ""
    close = difflib.get_close_matches(word, [o.value for o in ShardedDDPOption], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _shown(value) -> str:
    """repr(value) cut to 40 characters (repr of a 5,000-digit integer or a deeply nested list raises: its
    type is named instead)."""
    try:
        text = repr(value[:41] if isinstance(value, str) else value)
    except (ValueError, RecursionError):
        return f"<{type(value).__name__}, too large to show>"
    return text if len(text) <= 40 else text[:37] + "..."


def _combination_problems(options) -> list:
    problems = []
    strategies = [o for o in options if o in STRATEGIES]
    if len(strategies) > 1:
        names = " and ".join(o.value for o in strategies)
        problems.append(f"--sharded_ddp: {names} are different sharding strategies; pick one of them")
    if ShardedDDPOption.OFFLOAD in options and ShardedDDPOption.AUTO in options:
        problems.append("--sharded_ddp: 'auto' chooses the offload itself; drop 'offload'")
    if ShardedDDPOption.OFFLOAD in options and not strategies:
        problems.append(
            "--sharded_ddp: 'offload' needs a strategy to offload from, e.g. --sharded_ddp 'zero_dp_2 offload'; "
            "to offload with no sharding, pass --offload CONFIG.json instead"
        )
    if ShardedDDPOption.AUTO_WRAP in options and ShardedDDPOption.ZERO_DP_3 not in options:
        problems.append(
            "--sharded_ddp: 'auto_wrap' wraps submodules for parameter sharding and means nothing without it; "
            "use it only as --sharded_ddp 'zero_dp_3 auto_wrap', or drop it"
        )
    return problems


def _offload_problems(args, options) -> list:
    path = args.offload
    if path is None or path == "":
        return []
    config = Path(path)
    if not config.exists():
        return [f"--offload: config file {str(config)!r} does not exist; pass the path of a JSON config"]
    if not config.is_file():
        return [f"--offload: {str(config)!r} is not a file; pass the path of a JSON config"]
    from .config import load_config, stage_notes, stage_problems
    from .config.apply import zero_stage
    from .errors import ConfigError

    flag_offload = ShardedDDPOption.OFFLOAD in options
    try:
        loaded = load_config(config, training_args=args, world_size=world_size_from_env(), flag_offload=flag_offload)
    except ConfigError as e:
        return [f"--offload {path}: {where}: {message}" for where, message in e.problems]
    if flag_offload and not _offloads_parameters(loaded, options):
        return [
            "--offload CONFIG and --sharded_ddp 'offload' both ask for offload; keep --offload CONFIG "
            "and drop 'offload' from --sharded_ddp ('zero_dp_3 offload' goes with a config only when the config's "
            "offload_param says where the parameters go)"
        ]
    auto = ShardedDDPOption.AUTO in options
    if "max_memory" in loaded.raw and not auto:
        return [f"--offload {path}: max_memory is the per-rank budget of --sharded_ddp auto and means nothing "
                "without it; remove it or pass --sharded_ddp auto"]  # fmt: skip
    extra = sorted(set(loaded.raw) & {"zero_optimization", "optimizer", "scheduler", "data_types", "inference"})
    if auto and extra:
        return [f"--offload {path}: {', '.join(extra)}: --sharded_ddp auto chooses the stage and the offload itself; "
                "give it a config with max_memory (and precision, batch keys) only, or name a strategy"]  # fmt: skip
    stage = stage_from_options(options)
    if stage is not None and loaded.stage not in (0, stage):
        return [f"--offload {path}: zero_optimization.stage is {loaded.stage} but --sharded_ddp asks for stage {stage}; "
                "make them agree"]  # fmt: skip
    problems = [f"--offload {path}: {where}: {message}"
                for where, message in stage_problems(loaded, stage, world_size_from_env(), flag_offload)]  # fmt: skip
    if problems:
        return problems
    problems += _apply_config_to_args(args, loaded, zero_stage(loaded, stage), path)
    if not auto:  # auto chooses the stage when the model is known; its configs hold no stage-bound keys
        loaded = loaded.with_notes(stage_notes(loaded, stage, world_size_from_env(), dtypes.precision(args)))
    args.offload_config = loaded
    if not problems:
        log_notes(loaded, path)
    return problems


def _offloads_parameters(config, options) -> bool:
    """`--sharded_ddp "zero_dp_3 offload"` with a config whose `offload_param` names a device: the
    documented form of parameter offload (the config says where the parameters go, and where the
    optimizer state goes: CPU RAM, the flag's offload, when it names no offload_optimizer)."""
    settings = config.param_offload or {}
    return stage_from_options(options) == 3 and settings.get("device", "none") != "none"


def log_notes(config, path) -> None:
    """One warning line for each key accepted and ignored, and an info line for each taken as what
    the engine does anyway; on the first rank only (every rank reads the same file)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    for key, why in config.ignored:
        logger.warning("--offload %s: %s ignored: %s", path, key, why)
    for key, why in config.given:
        logger.info("--offload %s: %s accepted: %s", path, key, why)


def stage_from_options(options):
    """The ZeRO stage `--sharded_ddp` asks for: 3 (zero_dp_3), 2 (zero_dp_2), 1 (simple) or None."""
    if ShardedDDPOption.ZERO_DP_3 in options:
        return 3
    if ShardedDDPOption.ZERO_DP_2 in options:
        return 2
    if ShardedDDPOption.SIMPLE in options:
        return 1
    return None


def _apply_config_to_args(args, config, stage, path) -> list:
    """The TrainingArguments side of a config: precision, DDP buckets, and what cannot be honoured."""
    problems = []
    if config.precision in ("bf16", "fp16") and not getattr(args, config.precision):
        logger.info("--offload %s turns on %s", path, config.precision)
        setattr(args, config.precision, True)
    if stage == 1 and config.reduce_bucket_size is not None:  # "auto": from the hidden size, once the model is known
        problems += set_ddp_bucket(args, config.reduce_bucket_size, path)
    accum = config.grad_accum_dtype
    precision = dtypes.precision(args)
    comm_dtype = config.communication_data_type
    if stage == 1 and comm_dtype not in (None, precision):
        problems.append(f"--offload {path}: communication_data_type is {comm_dtype}, and at stage 1 DDP sums the "
                        f"gradients in the training dtype ({precision}); remove it, or use stage 2")  # fmt: skip
    if accum not in (None, "fp32") and accum != precision:
        problems.append(f"--offload {path}: data_types.grad_accum_dtype is {accum} but the run trains in {precision}; "
                        f"use fp32 or {precision}")  # fmt: skip
    elif accum not in (None, "fp32") and config.offload_device == "none":
        problems.append(f"--offload {path}: data_types.grad_accum_dtype {accum} needs offload (the optimizer steps "
                        "fp32 master shards on the device from an fp32 gradient shard); use fp32 or set "
                        "offload_optimizer.device")  # fmt: skip
    param_dtype = (config.raw.get("data_types") or {}).get("param_dtype")
    if param_dtype not in (None, precision):
        problems.append(f"--offload {path}: data_types.param_dtype is {param_dtype} but the run trains in {precision} "
                        f"(the model is cast to it); write {precision}, or train with --{param_dtype}")  # fmt: skip
    if config.offload_device == "nvme":
        from .offload.store import OffloadStoreError, check_disk_store

        try:
            check_disk_store(config.nvme_path, 0, 0)  # room is checked once the model's size is known
        except OffloadStoreError as e:
            problems.append(f"--offload {path}: {e}")
    params = config.param_offload or {}
    if stage == 3 and params.get("device") == "nvme":
        from .offload.param_store import PARAM_FOLDER, PARAMS
        from .offload.store import OffloadStoreError, check_disk_store

        try:  # the parameter store's folder (room and other runs: training/plan.py, once the model is known)
            check_disk_store(Path(params["nvme_path"]) / PARAM_FOLDER, 0, 0, role=PARAMS)
        except OffloadStoreError as e:
            problems.append(f"--offload {path}: offload_param: {e}")
    folder = (config.inference or {}).get("offload_folder")
    if folder:
        from .offload.store import OffloadStoreError, check_disk_store

        try:
            check_disk_store(folder, 0, 0)
        except OffloadStoreError as e:
            problems.append(f"--offload {path}: inference.offload_folder: {e}")
    if config.offload_device != "none" and config.pin_memory and not has_accelerator():
        logger.info("--offload %s: pin_memory applies to CUDA host-device copies; this run has no GPU", path)
    return problems


def set_ddp_bucket(args, numel: int, path) -> list:
    """Stage 1 reduces through DDP: its bucket (`--ddp_bucket_cap_mb`) is the config's reduce
    bucket of `numel` elements. Problems if the flag says otherwise."""
    element = 2 if args.bf16 or args.fp16 else 4  # the config's precision is applied to args by now
    cap_mb = max(1, math.ceil(numel * element / 2**20))
    if args.ddp_bucket_cap_mb not in (None, cap_mb):
        return [f"--offload {path}: zero_optimization.reduce_bucket_size is {numel:,} elements ({cap_mb} MB) but "
                f"--ddp_bucket_cap_mb is {args.ddp_bucket_cap_mb}; keep one"]  # fmt: skip
    args.ddp_bucket_cap_mb = cap_mb
    return []


def _size_problems(args) -> list:
    from .config.load import parse_size

    try:
        if parse_size(args.max_shard_size) < 1:
            raise ValueError("must be at least 1 byte")
    except ValueError as e:
        return [f"--max_shard_size {args.max_shard_size!r}: {e}"]
    return []


def _compute_problems(args) -> list:
    """--compute_dtype: a name it knows, and 16-bit compute only in the 16-bit dtype parameters are
    stored in (fp32 storage computes in fp32; bf16 storage cannot compute in fp16)."""
    from .constants import PRECISIONS

    value = args.compute_dtype
    if value not in ("auto", *PRECISIONS):
        return [f"--compute_dtype {value!r}: choose auto, {', '.join(PRECISIONS)}"]
    storage = dtypes.precision(args)
    if value in ("bf16", "fp16") and value != storage:
        fix = f"add --{value}" if storage == "fp32" else f"pass --compute_dtype {storage} or fp32"
        return [f"--compute_dtype {value} computes in the 16-bit dtype the parameters are stored in, but they are "
                f"{storage} (--bf16/--fp16 choose it); {fix}"]
    return []


def _output_problems(args) -> list:
    """--output_dir on a read-only disk: the Trainer would fail creating it, with a traceback.
    (Room for checkpoints is checked when training starts, once the model's size is known.)"""
    if not args.output_dir:
        return []
    from .checkpoint import check_writable
    from .errors import CheckpointError

    try:
        check_writable(args.output_dir, 0, "--output_dir")
    except CheckpointError as e:
        return [str(e)]
    return []


def _peer_problems(args, options) -> list:
    problems = []
    if options and getattr(args, "deepspeed", None):
        problems.append("--sharded_ddp and --deepspeed both shard the optimizer; use one of them")
    if args.offload and getattr(args, "deepspeed", None):
        problems.append("--offload and --deepspeed both manage offload; use one of them")
    if options and getattr(args, "fsdp", None):
        problems.append("--sharded_ddp and --fsdp are two sharding engines; use one of them")
    optim = str(getattr(getattr(args, "optim", ""), "value", getattr(args, "optim", "")))
    config = getattr(args, "offload_config", None)
    sharded = any(o in STRATEGIES for o in options) or (config is not None and (config.stage > 0 or config.offload_device != "none"))
    if sharded and (config is None or config.optimizer is None) and any(word in optim for word in _UNSHARDABLE_OPTIM):
        problems.append(
            f"--optim {optim} cannot be sharded: its update of an element depends on the whole tensor, which a flat "
            "shard does not keep; use --optim adamw_torch_fused (or another elementwise optimizer) with --sharded_ddp"
        )
    return problems


# Trainer optimizers (`--optim`) whose update is not elementwise (see sharding.optimizer.ELEMENTWISE).
_UNSHARDABLE_OPTIM = ("adafactor", "lomo", "galore", "apollo", "muon", "dion", "schedule_free")


def _unbuilt_problems(options) -> list:
    return [
        f"--sharded_ddp {o.value}: {_NOT_BUILT[o]} is not in this release of trainer_shard; "
        "drop the option to train with plain data parallel"
        for o in options
        if o in _NOT_BUILT
    ]


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def has_accelerator() -> bool:
    import torch

    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


def _distributed_problems(args) -> list:
    """See the trap in DESIGN.md: under torchrun without GPUs the Trainer must be told `use_cpu`.

    Without it each rank trains alone (or shards the data but never wraps the model), silently.
    """
    if world_size_from_env() <= 1:
        return []
    if not has_accelerator() and not args.use_cpu:
        logger.warning(
            "WORLD_SIZE=%s and no GPU: setting use_cpu=True so that the ranks train together on gloo",
            world_size_from_env(),
        )
        args.use_cpu = True
    if args.use_cpu and args.ddp_backend not in (None, "gloo", "ccl", "mpi"):
        return [f"--ddp_backend {args.ddp_backend} cannot run on the CPU; use --ddp_backend gloo (or leave it unset)"]
    return []


@dataclass
class ShardingArguments:
    """The fields and checks shared by both argument classes. Mix in before TrainingArguments."""

    sharded_ddp: str = field(
        default="",
        metadata={
            "help": "Sharded data parallel, space-separated options: 'simple' (ZeRO-1: optimizer state sharded), "
            "'zero_dp_2' (ZeRO-2: gradients sharded too), 'zero_dp_3' (parameters sharded too), 'offload' "
            "(CPU offload, with a strategy), 'auto_wrap' (with zero_dp_3), 'auto' (the least costly strategy that "
            "fits the memory per rank, see trainer-shard estimate). Example: --sharded_ddp 'zero_dp_2 offload'."
        },
    )
    offload: str | None = field(
        default=None,
        metadata={"help": "Path of a JSON offload config (a DeepSpeed-compatible subset); see configs/README.md."},
    )
    save_on_interrupt: bool = field(
        default=False,
        metadata={"help": "On SIGINT (Ctrl-C) or SIGTERM, finish the current step on every rank, write a checkpoint, "
                  "and exit with 128 + the signal's number; without it the run stops after the step unsaved."},
    )
    ddp_timeout: int = field(
        default=300,
        metadata={"help": "Seconds a rank waits in a collective, and for a silent peer, before it stops with an "
                  "error naming the rank at fault (the Trainer's default is 1800; raise it when one rank does long "
                  "work alone)."},
    )
    compute_dtype: str = field(
        default="auto",
        metadata={"help": "The dtype the matrix products run in, apart from the parameters' storage (--bf16/--fp16 "
                  "keep 16-bit parameters, shards, stores and gradient reduction): 'auto' (on a CPU, times a small "
                  "product at start and computes in fp32 where 16-bit is more than 2x slower, as on CPUs without "
                  "bf16 kernels; on CUDA the 16-bit dtype), 'bf16', 'fp16' (the storage dtype) or 'fp32'."},
    )
    max_shard_size: str = field(
        default="5GB",
        metadata={"help": "Largest weights file of a saved model or checkpoint (5GB, 500MB, 2GiB...): bigger models "
                  "are split into several files and an index, which loaders read one at a time."},
    )

    def __post_init__(self):
        self.offload_config = None  # the loaded --offload config (config.OffloadConfig)
        options, problems = parse_sharded_ddp(self.sharded_ddp)
        problems += _offload_problems(self, options)
        problems += _peer_problems(self, options)
        problems += _distributed_problems(self)
        problems += _size_problems(self)
        problems += _compute_problems(self)
        problems += _output_problems(self)
        if not problems:
            problems = _unbuilt_problems(options)
        if problems:
            raise ArgumentError(problems)
        self.sharded_ddp = options
        super().__post_init__()

    @property
    def sharding_enabled(self) -> bool:
        return bool(self.sharded_ddp) or bool(self.offload)


@dataclass
class ShardedTrainingArguments(ShardingArguments, TrainingArguments):
    """`TrainingArguments` plus `--sharded_ddp` and `--offload`."""


@dataclass
class ShardedSeq2SeqTrainingArguments(ShardingArguments, Seq2SeqTrainingArguments):
    """`Seq2SeqTrainingArguments` plus `--sharded_ddp` and `--offload`.

    `--sortish_sampler` is still a Seq2SeqTrainingArguments field in transformers 5 but nothing
    reads it; here it means what it meant: batches of similar lengths, drawn in random order,
    which is the Trainer's `train_sampling_strategy="group_by_length"` today.
    """

    def __post_init__(self):
        if self.sortish_sampler:
            if self.train_sampling_strategy not in ("random", "group_by_length"):
                raise ArgumentError(
                    f"--sortish_sampler and --train_sampling_strategy {self.train_sampling_strategy} disagree; "
                    "pass only one of them"
                )
            self.train_sampling_strategy = "group_by_length"
        super().__post_init__()
