"""Loss normalization: which models' losses the Trainer may rescale by token counts."""

import inspect


def model_normalizes_by_num_items(model) -> bool:
    """Whether the model's loss divides by the `num_items_in_batch` the Trainer passes it.

    The Trainer takes any `**kwargs` in `forward` as a yes, then multiplies the loss by the world
    size and skips the division by the gradient accumulation steps. T5, BART, Marian, mBART and
    Pegasus (transformers 5.x) accept `**kwargs` but return a plain per-batch mean, so their loss
    and gradients come out world_size x accumulation_steps too large. Models that honour the
    count go through `self.loss_function` or name `num_items_in_batch` in `forward`.

    Where it says no, the mixin sets `model_accepts_loss_kwargs = False`: per-batch mean losses,
    averaged over ranks by DDP and over micro-steps by the Trainer, the classic data-parallel loss.
    """
    explicit = getattr(model, "accepts_loss_kwargs", None)
    if explicit is not None:
        return bool(explicit)
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return True  # cannot tell: keep the Trainer's own judgement
    return "loss_function" in source or "num_items_in_batch" in source
