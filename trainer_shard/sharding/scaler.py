"""Dynamic loss scaling for fp16, with the overflow decision shared by all ranks.

The scale multiplies the loss before backward; the optimizer divides the gradient shards by it,
checks them for inf/NaN, and all-reduces that verdict, so a step skipped on one rank is skipped
on every rank and `DynamicLossScaler.update` sees the same verdicts in the same order everywhere:
the scaler's state stays identical across ranks, and an error it raises is raised on every rank.

[Note: DeepSpeed's loss scale] `DynamicLossScaler` follows DeepSpeed's ZeRO loss scaler
(deepspeed/runtime/fp16/loss_scaler.py, `DynamicLossScaler.update_scale`, 0.18.0 and later),
checked update by update against sequences recorded from DeepSpeed 0.19.8
(tests/data/loss_scaler/deepspeed_sequences.json, written by bench/record_loss_scaler.py):

- an overflow multiplies the scale by `backoff_factor`, never below `min_scale`. With
  `hysteresis` h > 1 only an overflow that finds the hysteresis budget down to 1 does; the ones
  before it spend the budget (h, h-1, ..., 1) and leave the scale alone. The budget stays at 1
  until it is refilled to h: when the scale grows, or after every good step with
  `consecutive_hysteresis`. Every overflow, scale lowered or not, restarts the growth count.
- a good step multiplies the scale by `growth_factor` when the good steps before it since the
  last overflow (or the start) are a positive multiple of `growth_interval`: the first growth
  comes on the (growth_interval + 1)-th good step, then every growth_interval-th good step.
  DeepSpeed 0.17.0 and earlier grew on the growth_interval-th, as this module did before hysteresis.
- `raise_error_at_min_scale`: an overflow that would lower a scale already equal to `min_scale`
  raises `LossScaleAtMinimumError` (DeepSpeed's ZeRO engine always does: it never passes the
  flag, whose default there is True) instead of skipping steps at that scale for ever.

DeepSpeed's `fp16` config, in these arguments: `initial_scale_power` p -> init_scale=2**p,
`loss_scale_window` -> growth_interval, `min_loss_scale` -> min_scale, `hysteresis` -> hysteresis
(DeepSpeed's `delayed_shift`; its default is 2, here 1 = none), `consecutive_hysteresis` ->
consecutive_hysteresis, `loss_scale` > 0 -> init_scale and static=True. DeepSpeed's factors are
fixed at 2 (growth_factor 2.0, backoff_factor 0.5, the defaults here).
"""

import math
import numbers

import torch


class LossScaleAtMinimumError(RuntimeError):
    """fp16 gradients overflowed with the loss scale already at its minimum (only with
    `raise_error_at_min_scale=True`)."""


def _argument_problems(args: dict) -> list:
    """Every problem with `DynamicLossScaler`'s arguments, each naming the argument, its value and
    what is allowed."""

    def number(v) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)

    def integer(v) -> bool:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)

    checks = [
        ("init_scale", number(args["init_scale"]) and args["init_scale"] > 0, "a finite number > 0"),
        ("growth_factor", number(args["growth_factor"]) and args["growth_factor"] > 1, "a finite number > 1"),
        ("backoff_factor", number(args["backoff_factor"]) and 0 < args["backoff_factor"] < 1, "a number in (0, 1)"),
        ("growth_interval", integer(args["growth_interval"]) and args["growth_interval"] >= 1,
         "an int >= 1 (DeepSpeed's fp16 loss_scale_window)"),
        ("min_scale", number(args["min_scale"]) and args["min_scale"] > 0,
         "a finite number > 0 (DeepSpeed's fp16 min_loss_scale)"),
        ("hysteresis", integer(args["hysteresis"]) and args["hysteresis"] >= 1,
         "an int >= 1: the overflows it takes to lower the scale, 1 = lower it on every overflow "
         "(DeepSpeed's fp16 hysteresis, default 2 there)"),
    ]  # fmt: skip
    problems = [f"{name}={args[name]!r}: must be {allowed}" for name, ok, allowed in checks if not ok]
    for name in ("static", "consecutive_hysteresis", "raise_error_at_min_scale"):
        if not isinstance(args[name], bool):
            problems.append(f"{name}={args[name]!r}: must be True or False")
    return problems


class DynamicLossScaler:
    """The fp16 loss scale, DeepSpeed's rules (see [Note: DeepSpeed's loss scale]).

    Args:
        init_scale: the first scale.
        growth_factor: the scale is multiplied by it on growth (DeepSpeed: 2).
        backoff_factor: the scale is multiplied by it on an overflow that lowers it (DeepSpeed: 1/2).
        growth_interval: good steps per growth (DeepSpeed's `scale_window`).
        min_scale: the scale never drops below it.
        static: keep `init_scale` for ever (overflowing steps are still skipped).
        hysteresis: overflows it takes to lower the scale, counted since the budget was last
            refilled; 1 (the default) lowers it on every overflow (DeepSpeed's `delayed_shift`).
        consecutive_hysteresis: refill the budget after every good step, so only `hysteresis`
            overflows in a row lower the scale; otherwise it is refilled when the scale grows.
        raise_error_at_min_scale: raise `LossScaleAtMinimumError` on an overflow that would lower
            a scale already at `min_scale` (DeepSpeed's engine does); otherwise keep skipping.

    Raises ValueError naming every bad argument.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0, static: bool = False, hysteresis: int = 1,
                 consecutive_hysteresis: bool = False, raise_error_at_min_scale: bool = False):  # fmt: skip
        problems = _argument_problems(locals())
        if problems:
            raise ValueError("DynamicLossScaler: " + "; ".join(problems) + ".")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = int(growth_interval)
        self.min_scale = min_scale
        self.static = static  # a fixed scale: overflowing steps are still skipped, the scale stays
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        # DeepSpeed's counters, under its names: the hysteresis budget left, the number of
        # updates so far, and the update that last overflowed (-1: none yet)
        self.cur_hysteresis = self.hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def update(self, found_inf: bool) -> None:
        """Once per optimizer step, skipped or not, with the verdict shared by all ranks.
        Raises `LossScaleAtMinimumError` (before changing anything) as described in the class."""
        if self.static:
            return
        if found_inf:
            self._overflow()
            self.last_overflow_iter = self.cur_iter
        else:
            self._good_step()
        self.cur_iter += 1

    def _overflow(self) -> None:
        if self.cur_hysteresis > 1:
            self.cur_hysteresis -= 1
            return
        if self.raise_error_at_min_scale and self.scale == self.min_scale:
            raise LossScaleAtMinimumError(
                f"fp16 gradients overflowed with the loss scale already at its minimum, min_scale={self.min_scale} "
                f"(update {self.cur_iter}): training has diverged or the minimum is too high. Lower the minimum "
                "(DeepSpeed config fp16.min_loss_scale), lower the learning rate, resume from an earlier "
                "checkpoint, or train in bf16.")  # fmt: skip
        self.scale = float(max(self.scale * self.backoff_factor, self.min_scale))

    def _good_step(self) -> None:
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.hysteresis
        good_before = self.cur_iter - self.last_overflow_iter - 1  # since the last overflow or the start
        if good_before > 0 and good_before % self.growth_interval == 0:
            self.cur_hysteresis = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "cur_hysteresis": self.cur_hysteresis, "cur_iter": self.cur_iter,
                "last_overflow_iter": self.last_overflow_iter}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Restores the scale and the counters; the settings stay the constructor's. A state
        saved before hysteresis (`scale` and `good_steps` alone) loads as `good_steps` good
        updates since the last overflow, with a full hysteresis budget. A budget above this
        scaler's `hysteresis` (saved with a larger one) is cut down to it."""
        self.scale = float(state["scale"])
        self.cur_iter = int(state.get("cur_iter", state.get("good_steps", 0)))
        self.last_overflow_iter = int(state.get("last_overflow_iter", -1))
        self.cur_hysteresis = max(1, min(int(state.get("cur_hysteresis", self.hysteresis)), self.hysteresis))


class ShardedGradScaler:
    """The `torch.amp.GradScaler` interface that accelerate and the Trainer call, backed by the
    optimizer's own scaler: unscaling, the shared overflow check and the update happen inside
    `ShardedOptimizer`; a skipped step never calls the optimizer's `step`, which is how accelerate
    learns it was skipped."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def scale(self, loss):
        return self.optimizer.loss_scaler.scale_loss(loss)

    def unscale_(self, optimizer) -> None:
        self.optimizer.prepare_grads()

    def step(self, optimizer, *args, **kwargs):
        self.optimizer.prepare_grads()
        if self.optimizer.found_inf:
            self.optimizer.skip_step()
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale=None) -> None:
        if new_scale is not None:
            self.optimizer.loss_scaler.scale = float(new_scale)

    def get_scale(self) -> float:
        return self.optimizer.loss_scaler.scale

    def is_enabled(self) -> bool:
        return True

    def state_dict(self) -> dict:
        return self.optimizer.loss_scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.loss_scaler.load_state_dict(state)
