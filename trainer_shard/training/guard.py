"""The distributed guard: a run launched on several processes that would not train together
stops with a clear error instead of training N separate models."""

import os
import sys

import torch.distributed as dist
from accelerate.utils import DistributedType
from transformers.training_args import ParallelMode

from ..args import world_size_from_env
from ..dtypes import precision
from ..errors import ArgumentError, DistributedSetupError


def check_distributed_setup(args) -> None:
    """Raise unless every process torchrun started is in one process group the Trainer uses.

    Catches the traps of DESIGN.md for any TrainingArguments, ours or a user's own:
    no `use_cpu` without GPUs (each rank trains alone), or a backend set without `use_cpu`
    (the data is sharded but the model never wrapped, so ranks diverge). Also refuses what
    `accelerate launch` sets behind the flags' back: a precision (`check_launcher_precision`) and,
    with --cpu, a process count it never starts (`accelerate_cpu_launch`).
    """
    check_launcher_precision(args)
    world_size = world_size_from_env()
    if world_size <= 1:
        launch = accelerate_cpu_launch(launcher_argv(), sys.argv[0])
        if launch is not None:
            raise DistributedSetupError(
                f"`accelerate launch --cpu --num_processes {launch.num_processes}` started this script as one "
                "process (accelerate starts several CPU processes only through mpirun, --mpirun_hostfile), so it "
                f"would train alone. Launch it with `torchrun --nproc_per_node {launch.num_processes}`, or with "
                f"`accelerate launch --multi_gpu --num_processes {launch.num_processes}` (torchrun's launcher; "
                "without GPUs the ranks train on the CPU); scripts/finetune_trainer.py does this by itself."
            )
        return
    state = args.distributed_state
    joined = (
        args.parallel_mode == ParallelMode.DISTRIBUTED
        and state is not None
        and state.distributed_type != DistributedType.NO
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() == world_size
        and args.world_size == world_size
    )
    if not joined:
        raise DistributedSetupError(
            f"WORLD_SIZE={world_size} processes were launched, but the Trainer did not join them into one "
            f"process group (parallel_mode={args.parallel_mode.value}, device={args.device}), so each rank would "
            "train on its own. On a machine without GPUs pass --use_cpu (ShardedTrainingArguments sets it for "
            "you); with GPUs, launch one process per GPU with torchrun."
        )
    if state.distributed_type == DistributedType.MULTI_CPU and args.device.type != "cpu":
        raise DistributedSetupError(
            f"the process group is set up for the CPU but the model would go to {args.device}; pass --use_cpu"
        )


def check_launcher_precision(args) -> None:
    """`accelerate launch --mixed_precision bf16|fp16` sets ACCELERATE_MIXED_PRECISION, which
    TrainingArguments read into `mixed_precision` when neither --bf16 nor --fp16 is given: the
    Trainer would then autocast fp32 parameters, a precision trainer_shard does not manage (with
    --bf16 it keeps 16-bit parameters and fp32 masters in the shards). Refused, with the fix."""
    launcher = getattr(args, "mixed_precision", None) or "no"
    if launcher != "no" and launcher != {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}[precision(args)]:
        raise ArgumentError(
            f"ACCELERATE_MIXED_PRECISION={launcher} (set by `accelerate launch --mixed_precision {launcher}` or an "
            f"accelerate config) asks for {launcher} autocast over fp32 parameters, which trainer_shard does not "
            f"manage; pass --{launcher} to the script as well (16-bit parameters, fp32 master weights in the shards), "
            "or launch with --mixed_precision no"
        )


def launcher_argv() -> list:
    """The command line of this process's parent (Linux: /proc), [] where it cannot be read."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def accelerate_cpu_launch(argv: list, script: str, env=None):
    """The parsed arguments of `accelerate launch --cpu --num_processes N` (N > 1, no
    --mpirun_hostfile) when `argv`, the parent's command line, is that launcher running `script`
    and this process is not a rank of a launched group (no WORLD_SIZE); None otherwise.

    accelerate runs such a job through its simple launcher: one process, with ACCELERATE_USE_CPU=True,
    MASTER_ADDR and MASTER_PORT set but no RANK or WORLD_SIZE, so N shows only in its arguments.
    """
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env or env.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true", "yes"):
        return None
    starts = [i + 1 for i, token in enumerate(argv) if token == "accelerate.commands.launch"
              or (token == "launch" and i and os.path.basename(argv[i - 1]).startswith("accelerate"))]  # fmt: skip
    if not starts:
        return None
    from accelerate.commands.launch import launch_command_parser

    try:
        launch = launch_command_parser().parse_args(argv[starts[0] :])
    except SystemExit:
        return None
    asked = launch.cpu and (launch.num_processes or 1) > 1 and launch.mpirun_hostfile is None
    same = not launch.module and os.path.realpath(launch.training_script) == os.path.realpath(script)
    return launch if asked and same else None
