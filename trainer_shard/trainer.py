"""Where trainer_shard hooks into the transformers Trainer.

`ShardedTrainerMixin` goes first in the bases of any Trainer subclass:

    class MyTrainer(ShardedTrainerMixin, Seq2SeqTrainer): ...

With neither `--sharded_ddp` nor `--offload` it changes nothing the Trainer computes: the same
seed and data give bit-identical weights. What it always adds is the distributed guard: a run
launched on several processes that would not train together stops with a clear error.
"""

import functools
import inspect
import logging

import torch.distributed as dist
from accelerate.utils import DistributedType
from transformers import Seq2SeqTrainer, Trainer
from transformers.training_args import ParallelMode

from .args import world_size_from_env
from .errors import DistributedSetupError

logger = logging.getLogger(__name__)


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


def model_normalizes_by_num_items(model) -> bool:
    """Whether the model's loss divides by the `num_items_in_batch` the Trainer passes it.

    The Trainer takes any `**kwargs` in `forward` as a yes, then multiplies the loss by the world
    size and skips the division by the gradient accumulation steps. T5, BART, Marian, mBART and
    Pegasus (transformers 5.x) accept `**kwargs` but return a plain per-batch mean, so their loss
    and gradients come out world_size x accumulation_steps too large. Models that honour the
    count go through `self.loss_function` or name `num_items_in_batch` in `forward`.
    """
    explicit = getattr(model, "accepts_loss_kwargs", None)
    if explicit is not None:
        return bool(explicit)
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return True  # cannot tell: keep the Trainer's own judgement
    return "loss_function" in source or "num_items_in_batch" in source


class ShardedTrainerMixin:
    """Adds the trainer_shard options to a Trainer subclass. See the module docstring."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_distributed_setup(self.args)
        model = self.accelerator.unwrap_model(self.model)
        if self.model_accepts_loss_kwargs and not model_normalizes_by_num_items(model):
            # Per-batch mean losses, averaged over ranks by DDP and over micro-steps by the
            # Trainer: the classic data-parallel loss. Nothing changes on one process without
            # accumulation, where the Trainer's scaling factors are both 1.
            logger.info("%s returns a per-batch mean loss: not rescaling it by token counts", type(model).__name__)
            self.model_accepts_loss_kwargs = False

    def evaluation_loop(self, *args, **kwargs):
        # Seq2SeqTrainer.evaluate/predict (transformers 5.x) switch the gather to
        # `accelerator.gather`, which keeps the samples that the even-batches sharding repeats to
        # fill the last batch, and the loop no longer truncates to the dataset length: with N
        # ranks, predictions, labels, loss and BLEU then include duplicates. `gather_for_metrics`
        # drops them. On one process the two are the same.
        self.gather_function = functools.partial(
            self.accelerator.gather_for_metrics, use_gather_object=self.args.eval_use_gather_object
        )
        return super().evaluation_loop(*args, **kwargs)


class ShardedTrainer(ShardedTrainerMixin, Trainer):
    """`transformers.Trainer` with `--sharded_ddp` / `--offload` support."""


class ShardedSeq2SeqTrainer(ShardedTrainerMixin, Seq2SeqTrainer):
    """`transformers.Seq2SeqTrainer` with `--sharded_ddp` / `--offload` support."""
