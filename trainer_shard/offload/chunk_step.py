"""The inner optimizer on one chunk of a shard: which kernel steps it, and the step itself.

`OffloadEngine` (engine.py) moves chunks between its store, the gradients and the parameters;
`ChunkStep`, mixed into it, updates each chunk it is handed (`_plan` once a flat group, then
`_update_chunk` a chunk).

- The inner optimizer is the run's own class and hyperparameters; Adam and AdamW call torch's
  fused CPU kernel directly (`torch._fused_adamw_`, what `AdamW(fused=True)` runs, without the
  per-call bookkeeping of `torch.optim`, which on 1 M-element chunks cost 30% of the step).
  Every elementwise optimizer is stepped chunk by chunk with the same result as stepping the
  whole shard at once: its per-element state ("exp_avg", "momentum_buffer"...) is found by
  stepping a probe tensor once (`per_element_state`), and its scalar state ("step") is kept
  once per flat group and handed to every chunk.
- Gradient factors (1/loss scale, the clipping coefficient) are never applied to the 16-bit
  gradient shard in its own precision. The fused kernel takes their product as its `grad_scale`
  (it divides each gradient by it as it reads it), so clipping costs no pass over the shard of
  its own; other optimizers get them multiplied into each fp32 chunk, in order.
- One pass (`cpu_adam.py`): with Adam/AdamW, a compiled kernel reads each chunk's gradient in its
  own dtype and writes the updated weights straight into the parameters (or the staging buffer
  they go out of), where the path above makes three passes (upcast, torch's kernel, cast); with
  the state, the gradients and the parameters all in RAM, the whole shard in one call. The same
  bits as the path above, which runs where the kernel cannot be built.
"""

import inspect
import math
from dataclasses import dataclass

import torch

from . import cpu_adam

_FUSED_ON_CPU = ("Adam", "AdamW")


def per_element_state(optim_class, defaults: dict) -> list:
    """The names of the state entries `optim_class` keeps one value per element of (probed).
    `defaults` may be a built optimizer's (`ShardedOptimizer.defaults`): what its constructor
    does not take ("decoupled_weight_decay" of AdamW) is left out."""
    probe = torch.zeros(2, requires_grad=True)
    optim = optim_class([probe], **_accepted(optim_class, _cpu_defaults(optim_class, defaults)))
    probe.grad = torch.zeros(2)
    optim.step()
    return sorted(k for k, v in optim.state[probe].items() if k != "step" and torch.is_tensor(v) and v.shape == probe.shape)


def _accepted(optim_class, kwargs: dict) -> dict:
    """The entries of `kwargs` that `optim_class`'s constructor takes (all, if it takes **kwargs)."""
    parameters = inspect.signature(optim_class.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in parameters}


def _fused_kernel(optim_class, hyper: dict):
    """torch's fused CPU Adam/AdamW kernel for this optimizer and settings, or None."""
    if optim_class not in (torch.optim.Adam, torch.optim.AdamW):
        return None
    if hyper.get("capturable") or hyper.get("differentiable") or torch.is_tensor(hyper.get("lr")):
        return None
    decoupled = optim_class is torch.optim.AdamW or bool(hyper.get("decoupled_weight_decay", False))
    return torch._fused_adamw_ if decoupled else torch._fused_adam_


def _grad_scale(factors) -> torch.Tensor | None:
    """What the fused kernel divides the gradients by to apply `factors`: 1 / their product.

    None (the factors are then multiplied into each chunk) when there are none, or when the
    product is 0 or its inverse overflows. The kernel writes the divided gradient back into the
    chunk it read, as clipping in place does to `.grad` without offload."""
    if not factors:
        return None
    product = math.prod(float(factor) for factor in factors)
    if product == 0.0 or not abs(1.0 / product) <= torch.finfo(torch.float32).max:  # also NaN, inf
        return None
    return torch.tensor(1.0 / product, dtype=torch.float32)


_ONE_PASS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _one_pass_ok(flat) -> bool:
    """Whether `cpu_adam`'s one-pass kernel can step `flat`'s shard (the kernel is built, dtypes it takes)."""
    return flat.grad.dtype in _ONE_PASS_DTYPES and flat.dtype in _ONE_PASS_DTYPES and cpu_adam.available()


def _cpu_defaults(optim_class, hyper: dict) -> dict:
    """`hyper` for CPU fp32 tensors: Adam and AdamW on torch's fused kernel."""
    out = {k: v for k, v in hyper.items() if k != "params"}
    if optim_class.__name__ in _FUSED_ON_CPU:
        out.update(fused=True, foreach=None)
    return out


@dataclass(frozen=True)
class _StepPlan:
    """How one step of a flat group runs (`ChunkStep._plan`)."""

    kernel: object  # torch's fused Adam/AdamW kernel, or None: the optimizer's own step, a chunk at a time
    grad_scale: torch.Tensor | None  # what the kernel divides the gradients by (the factors' product)
    factors: tuple  # the gradient factors left to multiply into each fp32 chunk
    fresh: bool  # step 1: the moments start from zero
    step: torch.Tensor | None  # the step count after this step, for the kernel
    one_pass: dict | None  # `cpu_adam.step`'s arguments, where the one-pass kernel steps


class ChunkStep:
    """Steps the chunks `OffloadEngine` hands it, with torch's fused kernel, `cpu_adam`'s one-pass
    kernel or the optimizer's own step. A mixin: it uses the engine's `optim_class`, `defaults`,
    `state_names`, `scalars` and `spec`, and `_param` and `_optim` (the inner optimizer over one
    placeholder parameter that each chunk is swapped into)."""

    def _plan(self, index: int, flat, hyper: dict, factors, link) -> "_StepPlan":
        """How this step of flat group `index` runs: which kernel, what it does with `factors`."""
        kernel = _fused_kernel(self.optim_class, hyper)
        if kernel is None:
            return _StepPlan(None, None, tuple(factors), False, None, None)
        grad_scale = _grad_scale(factors)
        if grad_scale is not None:
            factors = ()  # the kernel applies them
        fresh = self.scalars[index] is None
        step = torch.zeros((), dtype=torch.float32) if fresh else self.scalars[index]["step"].clone()
        step += 1  # once per optimizer step, as torch.optim does before its fused call
        one_pass = None
        if not factors and _one_pass_ok(flat):
            # an fp32 gradient shard is left divided by grad_scale, as torch's kernel leaves it (see `_grad_scale`)
            write_grad = flat.grad.dtype == torch.float32 and not link.cuda and not flat.grad_stored
            one_pass = self._one_pass_args(hyper, kernel, step, fresh, grad_scale, write_grad)
        return _StepPlan(kernel, grad_scale, tuple(factors), fresh, step, one_pass)

    def _update_chunk(self, index: int, flat, link, chunk: dict, grad, where: tuple, plan: "_StepPlan", hyper: dict,
                      params) -> dict | None:
        """Step one chunk and write its weights into the parameters, or into `params` (a staging
        buffer) when given. Returns the optimizer's scalar state where the optimizer's own step ran."""
        start, end, slot = where
        if plan.one_pass:
            targets = [(0, params)] if params is not None else link.param_targets(flat, start, end - start, slot)
            self._one_pass_chunk(chunk, grad, targets, plan.one_pass)
            if params is None:
                link.params_written(flat, start, end - start, slot)
            return None
        scalars = None
        if plan.kernel is not None:
            self._fused_chunk(plan.kernel, chunk, grad, plan.step, hyper, plan.fresh, plan.grad_scale)
        else:
            scalars = self._step_chunk(index, chunk, grad)
        if params is not None:
            params.copy_(chunk["master"])
        else:
            link.put_params(flat, start, chunk["master"], slot)
        return scalars

    def _one_pass_args(self, hyper: dict, kernel, step: torch.Tensor, fresh: bool, grad_scale, write_grad: bool) -> dict:
        """`cpu_adam.step`'s keyword arguments for this step: what `_fused_chunk` gives torch's kernel."""
        betas = hyper.get("betas", self.defaults.get("betas", (0.9, 0.999)))
        amsgrad = bool(hyper.get("amsgrad", False))
        return dict(
            step=float(step), lr=float(hyper["lr"]), beta1=float(betas[0]), beta2=float(betas[1]),
            weight_decay=float(hyper.get("weight_decay", 0.0)), eps=float(hyper.get("eps", 1e-8)), amsgrad=amsgrad,
            maximize=bool(hyper.get("maximize", False)), decoupled=kernel is torch._fused_adamw_,
            grad_scale=None if grad_scale is None else float(grad_scale), fresh=fresh, write_grad=write_grad,
            segment=self.spec.chunk_numel,  # a call over several chunks computes what one call a chunk would
        )  # fmt: skip

    def _one_pass_chunk(self, chunk: dict, grad: torch.Tensor, targets: list, args: dict) -> None:
        """A chunk (or the whole shard) through `cpu_adam` in one call, with the bits torch's kernel
        gives each chunk: the updated weights go into `targets`, (offset, tensor) pieces covering
        it (the parameters, or a staging buffer)."""
        cpu_adam.step(chunk["master"], chunk["exp_avg"], chunk["exp_avg_sq"], grad, out=targets,
                      max_exp_avg_sq=chunk.get("max_exp_avg_sq"), **args)  # fmt: skip

    def _fused_chunk(self, kernel, chunk: dict, grad: torch.Tensor, step: torch.Tensor, hyper: dict, fresh: bool,
                     grad_scale: torch.Tensor | None) -> None:
        if fresh:  # step 1 starts from zero moments, whatever the store holds
            for name in self.state_names:
                chunk[name].zero_()
        betas = hyper.get("betas", self.defaults.get("betas", (0.9, 0.999)))
        amsgrad = bool(hyper.get("amsgrad", False))
        kernel(
            [chunk["master"]], [grad], [chunk["exp_avg"]], [chunk["exp_avg_sq"]],
            [chunk["max_exp_avg_sq"]] if amsgrad else [], [step],
            amsgrad=amsgrad, lr=float(hyper["lr"]), beta1=float(betas[0]), beta2=float(betas[1]),
            weight_decay=float(hyper.get("weight_decay", 0.0)), eps=float(hyper.get("eps", 1e-8)),
            maximize=bool(hyper.get("maximize", False)), grad_scale=grad_scale,
        )  # fmt: skip

    def _step_chunk(self, index: int, chunk: dict, grad: torch.Tensor) -> dict:
        param = self._param
        param.data = chunk["master"]
        param.grad = grad
        state = self._optim.state[param]
        state.clear()
        if self.scalars[index] is not None:  # later steps: the stored state, in place
            state.update({k: v.clone() if torch.is_tensor(v) else v for k, v in self.scalars[index].items()})
            state.update({name: chunk[name] for name in self.state_names})
        self._optim.step()
        if self.scalars[index] is None:  # step 1: the optimizer made its state; keep it
            for name in self.state_names:
                chunk[name].copy_(state[name])
        scalars = {k: v for k, v in state.items() if k not in self.state_names}
        param.grad = None
        param.data = torch.zeros(0)
        state.clear()
        return scalars
