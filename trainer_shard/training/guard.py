"""The distributed guard: a run launched on several processes that would not train together
stops with a clear error instead of training N separate models."""

import torch.distributed as dist
from accelerate.utils import DistributedType
from transformers.training_args import ParallelMode

from ..args import world_size_from_env
from ..errors import DistributedSetupError


def check_distributed_setup(args) -> None:
    """Raise unless every process torchrun started is in one process group the Trainer uses.

    Catches the traps of DESIGN.md for any TrainingArguments, ours or a user's own:
    no `use_cpu` without GPUs (each rank trains alone), or a backend set without `use_cpu`
    (the data is sharded but the model never wrapped, so ranks diverge).
    """
    world_size = world_size_from_env()
    if world_size <= 1:
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
