"""Dynamic loss scaling for fp16, with the overflow decision shared by all ranks.

The scale multiplies the loss before backward; the optimizer divides the gradient shards by it,
checks them for inf/NaN, and all-reduces that verdict, so a step skipped on one rank is
skipped on every rank. The scale halves on overflow and doubles after `growth_interval` good
steps, as torch's GradScaler does.
"""

import torch


class DynamicLossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 1.0, static: bool = False):  # fmt: skip
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1 and init_scale > 0):
            raise ValueError("loss scaler: need growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1")
        self.scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.good_steps = 0
        self.static = static  # a fixed scale: overflowing steps are still skipped, the scale stays

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def update(self, found_inf: bool) -> None:
        if self.static:
            return
        if found_inf:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])


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
