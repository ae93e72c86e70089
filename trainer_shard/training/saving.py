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
from ..sharding.zero3 import sharded_part

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


def sharded_state_dict(sharded, model) -> dict:
    """The state dict `_save` hands a model that is not a `PreTrainedModel` (transformers then
    calls its own `save_pretrained`), from a ZeRO-3 model, on every rank (collective). A PEFT
    model saves its adapter alone: only its trainable parameters (the adapters, the
    `modules_to_save` copies) are copied out, each unit holding some gathered on its own, so a
    frozen base bigger than RAM is never whole. Any other model: `model.state_dict()`, gathered
    a unit at a time."""
    if not hasattr(model, "peft_config"):
        return model.state_dict()
    by_unit = {}  # unit index -> (unit, [(name, parameter)]); None: kept whole on every rank
    for name, p in model.named_parameters():
        if p.requires_grad:
            part = (sharded_part(p) or (None, None))[1]
            key = None if part is None else part.unit.index
            by_unit.setdefault(key, (None if part is None else part.unit, []))[1].append((name, p))
    state = {}
    with torch.no_grad():
        for key in sorted(k for k in by_unit if k is not None):  # the same order on every rank: collectives
            unit, params = by_unit[key]
            with sharded.gathered([unit]):
                state.update((name, p.detach().clone()) for name, p in params)
        state.update((name, p.detach().clone()) for name, p in by_unit.get(None, (None, []))[1])
    return state
