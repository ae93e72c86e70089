"""`ShardedOptimizer`'s gradients: bringing the shards up to date, unscaling, norms and clipping.

Once a step, `prepare_grads` makes this rank's gradient shards current (ZeRO-1 copies slices
of the all-reduced `.grad`s, ZeRO-2 and ZeRO-3 have them reduced already), divides out the loss
scale and agrees with every rank on overflow; the norm and the clip work on those shards. With
offload the factors wait for the step, applied to each fp32 chunk (`_scale_grads`). The methods
marked collective follow [Note: collective methods] in optimizer.py.
"""

import contextlib
import logging
import math

import torch
from torch.autograd.profiler import record_function

from .. import comm
from ..constants import CHUNK_NUMEL
from ..errors import ShardingError
from .flat import FlatGroup
from .norms import power_sum

# ShardedOptimizer's one logger, whichever of its modules speaks (users filter by this name)
logger = logging.getLogger(f"{__package__}.optimizer")


class GradientsMixin:
    """The gradient side of a `ShardedOptimizer` (its `flats`, `reducer`, `loss_scaler`,
    `_grad_factors` and `_grads_ready` are the state it works on)."""

    @torch.no_grad()
    def prepare_grads(self) -> None:
        """Bring this rank's gradient shards up to date, unscaled, and check them (once a step).

        ZeRO-1 copies its slices out of the all-reduced `.grad`s; ZeRO-2 already has them.
        With a loss scaler, divides by the scale and agrees with all ranks on overflow.
        Collective when a loss scaler is set.
        """
        if self._grads_ready:
            return
        self._check_open()
        if self.reducer is not None and self.reducer.pending:
            self.reducer.finish()
        self._adopt_newly_trainable()
        for flat in self.flats:
            if self.stage == 1 or (self.stage == 3 and isinstance(flat, FlatGroup)):
                flat.copy_grads_to_shard()
            else:
                flat.zero_stale()  # buckets no backward has reduced into since the last step
        self._log_16_bit_accumulation()
        self.found_inf = False
        if self.loss_scaler is not None:
            bad = torch.zeros(1, device=self._device())
            for flat in self.flats:
                if flat.grad_stored:
                    bad += not math.isfinite(flat.grad_sq)
                else:
                    for grad in flat.grad_tensors():
                        bad += ~_all_finite(grad)
            self.found_inf = bool(comm.all_reduce(bad, group=self.group).item() > 0)
            self._scale_grads(1.0 / self.loss_scaler.scale)
        self._grads_ready = True

    def _log_16_bit_accumulation(self) -> None:
        """Once: micro-batches were summed in a 16-bit gradient shard (grad_dtype)."""
        if self._logged_accumulation:
            return
        flat = next((f for f in self.flats if f.accumulated and f.grad.dtype != torch.float32), None)
        if flat is None:
            return
        self._logged_accumulation = True
        if self.rank == 0:
            logger.warning("gradient accumulation sums the micro-batches in the %s gradient shard (grad_dtype; with "
                           "--offload, data_types.grad_accum_dtype, 16-bit by default there): half the memory of fp32, "
                           "at a rounding per micro-batch (measured: the sum of 4 is 1.6x as far from the exact one "
                           "as one rounding, of 64 4.5x; bench/results/grad_reduction.md); grad_dtype=torch.float32 "
                           "(grad_accum_dtype fp32) sums them exactly", flat.grad.dtype)  # fmt: skip

    def _scale_grads(self, factor) -> None:
        """Multiply the gradient shards by `factor`: in place in fp32, or (offload) in the step,
        on each fp32 chunk, so a 16-bit shard is never rescaled in its own precision."""
        if self.offload is not None:
            self._grad_factors.append(factor)
            return
        for flat in self.flats:
            for grad in flat.grad_tensors():
                grad.mul_(factor)

    def _pending_factor(self) -> float:
        return math.prod(float(factor) for factor in self._grad_factors)

    @torch.no_grad()
    def global_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of all gradients across all shards, unclipped. Collective."""
        self.prepare_grads()
        norm_type = float(norm_type)
        with record_function("trainer_shard::grad_norm"):
            scale = abs(self._pending_factor())
            zero = torch.zeros((), dtype=torch.float64, device=self._device())
            stored = [f for f in self.flats if f.grad_stored]  # ZeRO-3, on disk: the norm kept as written
            if stored and norm_type != 2.0:
                raise ShardingError(f"with the gradients on disk (offload_param nvme) the gradient norm is the 2-norm "
                                    f"only, got norm_type={norm_type}")  # fmt: skip
            flats = [f for f in self.flats if not f.grad_stored]
            if norm_type == float("inf"):
                maxima = (g.abs().max().float() for f in flats for g in f.grad_tensors() if g.numel())
                local = torch.stack([zero.float(), *maxima]).max().reshape(1)
                return comm.all_reduce(local, op=torch.distributed.ReduceOp.MAX, group=self.group)[0] * scale
            local = sum((power_sum(g, norm_type) for f in flats for g in f.grad_tensors()), zero).reshape(1)
            local += sum(f.grad_sq for f in stored)
            total = comm.all_reduce(local, group=self.group)[0] ** (1.0 / norm_type)
            return (total * scale).float() if scale != 1.0 else total.float()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global norm over all shards; returns the norm before clipping. Collective.

        Same rule as `torch.nn.utils.clip_grad_norm_`: scale by max_norm / (norm + 1e-6) when below 1.
        """
        total = self.global_norm(norm_type)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if coef < 1.0:
            self._scale_grads(coef)
        return total

    def grad_norm(self) -> torch.Tensor:
        """The global 2-norm of the gradients, unclipped. Collective."""
        return self.global_norm(2.0)

    @contextlib.contextmanager
    def no_sync(self):
        """ZeRO-2: backward passes in this context keep their gradients in `.grad` (full size) and
        communicate nothing; the next backward outside it reduces the accumulated sum once.
        ZeRO-1 leaves gradient reduction to DDP: use DDP's own `no_sync` there."""
        if self.reducer is None:
            yield
            return
        previous, self.reducer.sync = self.reducer.sync, False
        try:
            yield
        finally:
            self.reducer.sync = previous


def _all_finite(t: torch.Tensor, chunk: int = CHUNK_NUMEL) -> torch.Tensor:
    """No inf/NaN in `t` (a bool tensor on its device, so no sync per chunk), checked a chunk at a
    time (no shard-sized temporary)."""
    checks = [torch.isfinite(t[s : s + chunk]).all() for s in range(0, t.numel(), chunk)]
    return torch.stack(checks).all() if checks else torch.ones((), dtype=torch.bool, device=t.device)
