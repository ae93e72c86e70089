"""The model's files, as the Trainer's `_save` writes them (the final model and each checkpoint's).

    files = save(trainer, output_dir)    # the weights' file names, or None where this rank wrote none
"""

import logging
import os

from transformers.trainer import TRAINING_ARGS_NAME

import torch

from ..checkpoint import save_model
from ..config.load import parse_size
from ..sharding import zero3_weights

logger = logging.getLogger(__name__)


def save(trainer, output_dir) -> list | None:
    """The weights tensor by tensor, without the full copy `save_pretrained` makes of parameters
    that share storage (the flat buffer's views; see checkpoint.py), split into files of at most
    --max_shard_size, then the tokenizer and the training arguments. ZeRO-3: every rank takes part
    in each unit's gather (Trainer.save_model calls `_save` on every rank), the saving ones write.
    Raises OSError as the disk did."""
    args, sharded = trainer.args, trainer.sharded_model
    if not args.should_save and sharded is None:
        return None
    if args.should_save:
        logger.info("Saving model checkpoint to %s", output_dir)
    max_size = parse_size(getattr(args, "max_shard_size", "5GB"))
    if sharded is not None:
        files = zero3_weights.save_weights(sharded, output_dir, max_size, args.should_save)
        if not args.should_save:
            return None
    else:
        files = save_model(trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False), output_dir,
                           max_size)  # fmt: skip
    if trainer.processing_class is not None:
        trainer.processing_class.save_pretrained(output_dir)
    torch.save(args, os.path.join(output_dir, TRAINING_ARGS_NAME))
    return files
