"""ZeRO-2 gradient reduction: backward hooks fill buckets, each reduce-scattered when full.

As each parameter's gradient is accumulated, its hook copies it into its bucket's buffer and
frees it (`.grad = None`), so full gradients never pile up. A bucket whose parameters have all
reported is reduce-scattered asynchronously while backward goes on; each rank receives its own
slice, averaged over ranks, and adds it into its fp32 gradient shard. At most `max_in_flight`
reductions are outstanding: launching one more first completes the oldest and frees its
buffer, so the gradient memory beyond the shard stays at a few buckets. A bucket holding one
parameter that needs no padding is reduced straight from its `.grad`, with no copy. Several
backward passes before a step (gradient accumulation) simply add up in the shard; or, inside `no_sync()`, the
gradients stay in `.grad` (full size, as DDP's `no_sync`) and are reduced once, on the
backward that syncs.

[Note: bucket order] Collectives must be issued in the same order on every rank. Buckets are
launched strictly in bucket order: a bucket that becomes ready before an earlier one waits for
it. At the end of backward (an autograd engine callback) the remaining buckets are launched in
order too, with zeros for parameters that received no gradient (unused in this forward), then
all are waited for.

With `overlap=False` (config `overlap_comm: false`) no bucket is launched while backward runs:
all are reduced at its end, which holds every bucket's gradients until then (as much memory as
full gradients) but leaves backward's compute alone.
"""

import torch
from torch.autograd.profiler import record_function

from .. import comm


class _BucketState:
    __slots__ = ("flat", "bucket", "remaining", "buffer", "filled")

    def __init__(self, flat, bucket):
        self.flat, self.bucket = flat, bucket
        self.remaining = len(bucket.slots)
        self.buffer = None
        self.filled = set()

    def ensure_buffer(self):
        """The bucket's buffer; every element gets written (gradients, or zeros by `zero_missing`)."""
        if self.buffer is None:
            self.buffer = torch.empty(self.bucket.padded_numel, dtype=self.flat.dtype, device=self.flat.buffer.device)
            self.buffer[self.bucket.numel :].zero_()
        return self.buffer

    def zero_missing(self):
        """Zeros where no gradient arrived (parameters unused in this forward)."""
        for slot in self.bucket.slots:
            if slot.index not in self.filled:
                start = slot.offset - self.bucket.offset
                self.buffer[start : start + slot.numel].zero_()


class GradReducer:
    def __init__(self, group=None, max_in_flight: int = 2, overlap: bool = True):
        self.group = group
        self.overlap = overlap
        self.world_size = comm.rank_and_size(group)[1]
        self.max_in_flight = max(1, int(max_in_flight))
        self.flats = []
        self.sync = True  # False inside `ShardedOptimizer.no_sync()`: gradients stay in `.grad`
        self.bucket_bytes = 0  # bucket memory alive right now, and its peak (for reports)
        self.peak_bucket_bytes = 0
        self._reset()

    def add(self, flat) -> None:
        """Reduce `flat`'s gradients from now on: hooks on each of its parameters."""
        self.flats.append(flat)
        base = sum(len(f.layout.buckets) for f in self.flats[:-1])
        for bucket in flat.layout.buckets:
            for slot in bucket.slots:
                param = flat.params[slot.index]
                hook = self._make_hook(base + bucket.index, slot)
                param.register_post_accumulate_grad_hook(hook)
        self._reset()

    def _reset(self) -> None:
        self.states = [_BucketState(f, b) for f in self.flats for b in f.layout.buckets]
        self.next_bucket = 0
        self.in_flight = []
        self.callback_queued = False

    def _make_hook(self, state_index: int, slot):
        def hook(param):
            self._on_grad(state_index, slot, param)

        return hook

    def _on_grad(self, state_index: int, slot, param) -> None:
        if not self.sync:
            return  # accumulate in `.grad` until the micro-step that syncs
        if not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self.callback_queued = True
        state = self.states[state_index]
        grad, bucket, had_buffer = param.grad, state.bucket, state.buffer is not None
        param.grad = None
        if len(bucket.slots) == 1 and bucket.padded_numel == bucket.numel and grad.is_contiguous():
            state.buffer = grad.view(-1)  # reduce it where it is
        else:
            start = slot.offset - bucket.offset
            with torch.no_grad():
                state.ensure_buffer()[start : start + slot.numel].copy_(grad.reshape(-1))
        if not had_buffer:
            self._count(state.buffer, +1)
        state.filled.add(slot.index)
        state.remaining -= 1
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self, flush: bool = False) -> None:
        """Launch buckets in order; with `flush`, also those still waiting for gradients."""
        while self.next_bucket < len(self.states):
            state = self.states[self.next_bucket]
            if state.remaining > 0 and not flush:
                return
            if state.buffer is None:
                self._count(state.ensure_buffer(), +1)
            if state.remaining > 0:
                state.zero_missing()
            while len(self.in_flight) >= self.max_in_flight:
                self._complete_oldest()
            out = torch.empty(state.bucket.shard_numel, dtype=state.flat.dtype, device=state.flat.buffer.device)
            work = comm.reduce_scatter(out, state.buffer, self.group, async_op=True)
            self.in_flight.append((state, out, work))
            self.next_bucket += 1

    def _complete_oldest(self) -> None:
        state, out, work = self.in_flight.pop(0)
        with record_function("trainer_shard::reduce_scatter_wait"):
            work.wait()
        state.flat.add_to_grad(state.bucket, out, alpha=1.0 / self.world_size)
        self._count(state.buffer, -1)
        state.buffer = None

    def _count(self, buffer, sign: int) -> None:
        self.bucket_bytes += sign * buffer.numel() * buffer.element_size()
        self.peak_bucket_bytes = max(self.peak_bucket_bytes, self.bucket_bytes)

    def finish(self) -> None:
        """End of backward: launch what is left, wait, add this rank's slices into the shards."""
        self._launch_ready(flush=True)
        while self.in_flight:
            self._complete_oldest()
        self._reset()

    @property
    def pending(self) -> bool:
        """Gradients arrived since the last `finish` (backward still running or ended abnormally)."""
        return self.callback_queued
