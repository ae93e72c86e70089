"""Loss normalization: whether a model's loss honours the `num_items_in_batch` the Trainer passes.

The Trainer takes any `**kwargs` in `forward` as a yes, then multiplies the loss by the world
size and skips the division by the gradient accumulation steps. T5, BART, Marian, mBART and
Pegasus (transformers 5.x) accept `**kwargs` but return a plain per-batch mean, so their loss
and gradients would come out world_size x accumulation_steps too large.

What a model declares wins: its `accepts_loss_kwargs`, or a `num_items_in_batch` parameter of
its `forward`. A model that declares neither is watched on its first training step
(`LossKwargsObserver`): Hugging Face models compute their loss through `self.loss_function`, and
the loss is normalized exactly when that call receives a `num_items_in_batch`. A model with no
`loss_function` anywhere cannot be watched: the Trainer's own judgement stands.

Where the answer is no, the Trainer is told `model_accepts_loss_kwargs = False`: per-batch mean
losses, averaged over ranks by DDP and over micro-steps by the Trainer, the classic data-parallel
loss. On one process without accumulation both answers compute the same thing.
"""

import inspect
import logging

from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

_MISSING = object()


def declared_normalization(model):
    """True or False where `model` says whether it divides by `num_items_in_batch`; None where it
    does not say (a `**kwargs` forward: `LossKwargsObserver` tells on the first step)."""
    explicit = getattr(model, "accepts_loss_kwargs", None)
    if explicit is not None:
        return bool(explicit)
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    return True if "num_items_in_batch" in parameters else None


class LossKwargsObserver:
    """Within `with observer:` every `loss_function` of the model's Hugging Face modules records
    whether it was given a `num_items_in_batch`; `normalized` says so afterwards.

        observer = LossKwargsObserver(model)
        if observer.can_observe:
            with observer:
                loss = model(**inputs, num_items_in_batch=n).loss
            observer.normalized   # True: the loss was divided by n
    """

    def __init__(self, model):
        self.modules = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
        self.normalized = False
        self._saved = []

    @property
    def can_observe(self) -> bool:
        return bool(self.modules)

    def __enter__(self):
        for module in self.modules:
            self._saved.append((module, module.__dict__.get("_loss_function", _MISSING)))
            module.loss_function = self._recording(module.loss_function)
        return self

    def __exit__(self, *exc):
        for module, saved in self._saved:
            if saved is _MISSING:
                del module._loss_function
            else:
                module._loss_function = saved
        self._saved = []
        return False

    def _recording(self, loss_function):
        try:
            signature = inspect.signature(loss_function)
        except (TypeError, ValueError):
            signature = None

        def recording(*args, **kwargs):
            count = kwargs.get("num_items_in_batch")
            if count is None and signature is not None:
                try:
                    count = signature.bind_partial(*args, **kwargs).arguments.get("num_items_in_batch")
                except TypeError:
                    count = None
            self.normalized = self.normalized or count is not None
            return loss_function(*args, **kwargs)

        return recording


def observed_first_step(trainer, model, inputs, num_items_in_batch, return_outputs, compute):
    """The first training step of a model that takes **kwargs and declares nothing: it is given the
    count as the Trainer would give it, with the Trainer's rescaling held back until the model
    shows whether it divides by the count; `trainer.model_accepts_loss_kwargs` set by what it did.
    `compute(inputs)`: the Trainer's own `compute_loss` on `inputs`."""
    unwrapped = trainer.accelerator.unwrap_model(model)
    observer = LossKwargsObserver(unwrapped)
    trainer.model_accepts_loss_kwargs = False
    with observer:
        result = compute({**inputs, "num_items_in_batch": num_items_in_batch})
    name = type(unwrapped).__name__
    if not observer.normalized:
        logger.info("%s returns a per-batch mean loss: not rescaling it by token counts", name)
        return result
    trainer.model_accepts_loss_kwargs = True
    args = trainer.args
    if args.average_tokens_across_devices:  # as Trainer.compute_loss scales a normalized loss
        scale = trainer.accelerator.num_processes // trainer.get_tp_size() if args.n_gpu <= 1 else args.n_gpu
        result = (result[0] * scale, result[1]) if return_outputs else result * scale
    logger.info("%s divides its loss by the token count: the Trainer's normalization applies", name)
    return result
