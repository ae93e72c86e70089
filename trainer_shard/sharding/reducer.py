"""ZeRO-2 gradient reduction: backward hooks fill buckets, each reduce-scattered when full.

As each parameter's gradient is accumulated, its hook copies it into its bucket's buffer and
frees it (`.grad = None`), so full gradients never pile up. A bucket whose parameters have all
reported is reduce-scattered asynchronously while backward goes on; each rank receives its own
slice, averaged over ranks, and adds it into its fp32 gradient shard (or receives it straight
into the shard, when that slice holds no gradient yet this step). At most `max_in_flight`
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

[Note: 16-bit reduction] Each rank's gradient is divided by the world size as it enters its
bucket, before the sum over ranks, as DDP and DeepSpeed do: a sum of N fp16 gradients
overflows at 1/N of the largest fp16 value, their mean only where one rank's own gradient
already has (the dynamic loss scale can then stay N times higher). Buckets are reduced in
`reduce_dtype`: by default the parameters' dtype up to `MAX_16BIT_RANKS` ranks (half the bytes
on the wire, as DDP) and fp32 beyond, because a ring reduction rounds once per rank it passes:
a bf16 sum over 8 ranks is 2.2x as far from the exact mean as one rounding, over 64 ranks 4.0x,
over 512 ranks 30x (bench/results/grad_reduction.md). An fp32 bucket also divides in fp32, so
the division costs fp16's smallest gradients nothing.

[Note: spare buckets] glibc maps every allocation larger than 32 MiB (its largest mmap threshold)
fresh from the kernel and unmaps it when freed, so a bucket that large is faulted in, page by
page, each time it is made: dividing a 38 MB gradient into a new bucket took 20 ms, into one made
before 4 ms (t5-base's decoder blocks, a bucket each under ZeRO-3). On the CPU such buffers are
kept once reduced, by size, and the next bucket of that size in the same backward takes one: at
most `max_in_flight` + 1 (as many as can be alive at once), and all let go at the end of backward, so nothing is held
between steps (forward's memory and the step's, which the planner counts, do not change).
Smaller ones come from glibc's heap, which reuses them already. Not with one rank, whose
bucket is the gradient itself; nor a parameter's own gradient, reduced where it is.

[Note: hooks belong to one optimizer] A parameter feeds one reducer: the hooks `add` registers
are removed by `close()`, which `ShardedOptimizer.close()` calls, as does a newer optimizer on
the same parameters for the one it replaces (see [Note: one optimizer per parameter] in owners.py).
"""

import torch
from torch.autograd.profiler import record_function

from .. import comm
from .owners import post_accumulate_grad_hook

SPARE_BYTES = 32 * 2**20
"""Bucket buffers larger than this are kept for the next backward: see [Note: spare buckets]."""

MAX_16BIT_RANKS = 8
"""Most ranks a 16-bit bucket is summed over by default; beyond, buckets are reduced in fp32. Over 8
ranks a ring sum is 2.2x (bf16) and 1.8x (fp16) as far from the exact mean as rounding it once,
over 16 ranks 3.1x and 2.6x (bench/results/grad_reduction.md)."""


def default_reduce_dtype(param_dtype, world_size: int):
    """The dtype buckets of `param_dtype` gradients are summed in: see [Note: 16-bit reduction]."""
    if param_dtype in (torch.bfloat16, torch.float16) and world_size > MAX_16BIT_RANKS:
        return torch.float32
    return param_dtype


class _BucketState:
    __slots__ = ("flat", "bucket", "remaining", "buffer", "filled", "dtype", "launched", "made")

    def __init__(self, flat, bucket, dtype, at_end: bool = False):
        self.flat, self.bucket, self.dtype = flat, bucket, dtype
        # at_end: never complete before `finish` (a flat whose parameters may report again later)
        self.remaining = len(bucket.slots) + (1 if at_end else 0)
        self.buffer = None
        self.made = False  # `buffer` is one of `ensure_buffer`'s (not a parameter's own gradient)
        self.filled = set()
        self.launched = False

    def ensure_buffer(self, spare: list):
        """The bucket's buffer (one of `spare` of its size when there is: see [Note: spare
        buckets]); every element gets written (gradients, or zeros by `zero_missing`)."""
        if self.buffer is None:
            numel, device = self.bucket.padded_numel, self.flat.buffer.device
            kept = next((i for i, b in enumerate(spare) if b.numel() == numel and b.dtype == self.dtype
                         and b.device == device), None)  # fmt: skip
            self.buffer = spare.pop(kept) if kept is not None else torch.empty(numel, dtype=self.dtype, device=device)
            self.buffer[self.bucket.numel :].zero_()
            self.made = True
        return self.buffer

    def zero_missing(self):
        """Zeros where no gradient arrived (parameters unused in this forward)."""
        for slot in self.bucket.slots:
            if slot.index not in self.filled:
                start = slot.offset - self.bucket.offset
                self.buffer[start : start + slot.numel].zero_()


class GradReducer:
    """Reduce-scatters the gradients of the `FlatGroup`s it is given into their shards; see the
    module docstring. `reduce_dtype`: None for `default_reduce_dtype`, else the dtype every bucket
    is summed in."""

    def __init__(self, group=None, max_in_flight: int = 2, overlap: bool = True, reduce_dtype=None,
                 queue_finish: bool = True):  # fmt: skip
        self.group = group
        self.queue_finish = queue_finish  # False: the owner calls `finish` at the end of backward (ZeRO-3)
        self.overlap = overlap
        self.world_size = comm.rank_and_size(group)[1]
        self.max_in_flight = max(1, int(max_in_flight))
        self.reduce_dtype = reduce_dtype
        self.flats = []
        self.at_end = set()  # ids of the flats reduced at the end of backward only (see `add`)
        self.sync = True  # False inside `ShardedOptimizer.no_sync()`: gradients stay in `.grad`
        self.bucket_bytes = 0  # bucket memory alive right now, and its peak (for reports)
        self.peak_bucket_bytes = 0
        self.reused = 0  # buckets that took a spare buffer, and the most spare bytes held (for tests)
        self.peak_spare_bytes = 0
        self._handles = []
        self._reset()

    def add(self, flat, at_end: bool = False) -> None:
        """Reduce `flat`'s gradients from now on: hooks on each of its parameters. `at_end`: its
        buckets wait for the end of backward, for parameters that may report several times in
        one backward (ZeRO-3's root, whose parameters reentrant checkpointing segments share);
        the last flats in bucket order only, as the others launch in order behind them."""
        self.flats.append(flat)
        if at_end:
            self.at_end.add(id(flat))
        base = sum(len(f.layout.buckets) for f in self.flats[:-1])
        for bucket in flat.layout.buckets:
            for slot in bucket.slots:
                param = flat.params[slot.index]
                self._handles.append(post_accumulate_grad_hook(param, self._on_grad, base + bucket.index, slot))
        self._reset()

    def dtype_for(self, flat):
        """The dtype `flat`'s buckets are summed in."""
        return self.reduce_dtype or default_reduce_dtype(flat.dtype, self.world_size)

    def close(self) -> None:
        """Remove every hook: backward leaves the gradients in `.grad` again. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.flats = []
        self._reset()

    def _reset(self) -> None:
        self.states = [_BucketState(f, b, self.dtype_for(f), id(f) in self.at_end) for f in self.flats
                       for b in f.layout.buckets]  # fmt: skip
        self.reopened = {}  # state index -> a second state for gradients that came after its launch
        self.next_bucket = 0
        self.in_flight = []
        self.callback_queued = False
        self._spare = []  # bucket buffers done with, oldest first: see [Note: spare buckets]

    def reset(self) -> None:
        """Drop a backward that never finished (it raised): reductions in flight are waited for and
        their results dropped, half-filled buckets too. The shards keep what earlier backward
        passes reduced."""
        for _, _, work in self.in_flight:
            work.wait()
        self._reset()

    def _on_grad(self, state_index: int, slot, param) -> None:
        if not self.sync:
            return  # accumulate in `.grad` until the micro-step that syncs
        if not self.callback_queued:
            if self.queue_finish:
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self.callback_queued = True
        state = self.states[state_index]
        if state.launched:  # a second gradient after its bucket went (reentrant checkpointing): reduced again
            state = self.reopened.setdefault(state_index, _BucketState(state.flat, state.bucket, state.dtype))
        self._take(state, slot, param)
        if self.overlap:
            self._launch_ready()

    def _take(self, state, slot, param) -> None:
        """`param.grad` / world size -> its place in the bucket (added to what is there when the
        parameter reported already in this backward); `.grad` freed."""
        grad, bucket, had_buffer = param.grad, state.bucket, state.buffer is not None
        param.grad = None
        if slot.index in state.filled:
            start = slot.offset - bucket.offset
            with torch.no_grad():
                state.buffer[start : start + slot.numel].add_(grad.reshape(-1).to(state.dtype), alpha=1.0 / self.world_size)
            return
        with torch.no_grad():
            if (len(bucket.slots) == 1 and bucket.padded_numel == bucket.numel and grad.is_contiguous()
                    and grad.dtype == state.dtype):  # fmt: skip
                state.buffer = _divided(grad.view(-1), self.world_size)  # reduce it where it is
            else:
                start = slot.offset - bucket.offset
                target = self._ensure_buffer(state)[start : start + slot.numel]
                _divided(grad.reshape(-1), self.world_size, out=target)
        if not had_buffer:
            self._count(state.buffer, +1)
        state.filled.add(slot.index)
        state.remaining -= 1

    def reduce_from_grads(self, flat) -> None:
        """`flat`'s gradients as they are in `.grad` (accumulated before its hooks existed: a
        parameter unfrozen after the optimizer was built) -> its shard. Collective; between
        backward passes only."""
        first = sum(len(f.layout.buckets) for f in self.flats[: self.flats.index(flat)])
        states = self.states[first : first + len(flat.layout.buckets)]
        for state in states:
            for slot in state.bucket.slots:
                if flat.params[slot.index].grad is not None:
                    self._take(state, slot, flat.params[slot.index])
        for state in states:
            self._launch(state)
        while self.in_flight:
            self._complete_oldest()
        self._reset()

    def _launch_ready(self, flush: bool = False) -> None:
        """Launch buckets in order; with `flush`, also those still waiting for gradients."""
        while self.next_bucket < len(self.states):
            state = self.states[self.next_bucket]
            if state.remaining > 0 and not flush:
                return
            self._launch(state)
            self.next_bucket += 1

    def _launch(self, state) -> None:
        """Reduce-scatter one bucket (zeros for gradients that did not arrive), asynchronously."""
        if state.buffer is None:
            self._count(self._ensure_buffer(state), +1)
        if state.remaining > 0:
            state.zero_missing()
        while len(self.in_flight) >= self.max_in_flight:
            self._complete_oldest()
        # straight into the gradient shard when its slice is stale and of the bucket's dtype
        direct = state.flat.reduce_target(state.bucket, state.dtype) if self.world_size > 1 else None
        if direct is not None:
            out = direct
        elif self.world_size == 1:  # nothing to reduce: this rank's slice is the bucket itself (no copy)
            out = state.buffer[: state.bucket.shard_numel]
        else:
            out = torch.empty(state.bucket.shard_numel, dtype=state.dtype, device=state.flat.buffer.device)
        state.launched = True
        work = comm.reduce_scatter(out, state.buffer, self.group, async_op=True)
        self.in_flight.append((state, out if direct is None else None, work))

    def _complete_oldest(self) -> None:
        state, out, work = self.in_flight.pop(0)
        with record_function("trainer_shard::reduce_scatter_wait"):
            work.wait()
        if out is None:  # reduced into the shard itself
            state.flat.mark_reduced(state.bucket)
        else:
            state.flat.add_to_grad(state.bucket, out, owned=True)  # already the mean: see [Note: 16-bit reduction]
        self._count(state.buffer, -1)
        buffer, made, state.buffer, state.made = state.buffer, state.made, None, False
        large = buffer.numel() * buffer.element_size() > SPARE_BYTES
        if made and large and self.world_size > 1 and buffer.device.type == "cpu":
            self._spare.append(buffer)
            if len(self._spare) > self.max_in_flight + 1:  # the oldest goes
                self._spare.pop(0)
            self.peak_spare_bytes = max(self.peak_spare_bytes, self.spare_bytes)

    @property
    def spare_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._spare)

    def _ensure_buffer(self, state):
        spares = len(self._spare)
        buffer = state.ensure_buffer(self._spare)
        self.reused += spares - len(self._spare)
        return buffer

    def _count(self, buffer, sign: int) -> None:
        self.bucket_bytes += sign * buffer.numel() * buffer.element_size()
        self.peak_bucket_bytes = max(self.peak_bucket_bytes, self.bucket_bytes)

    def finish(self) -> None:
        """End of backward: launch what is left, wait, add this rank's slices into the shards."""
        self._launch_ready(flush=True)
        for index in sorted(self.reopened):  # in bucket order on every rank: see [Note: bucket order]
            self._launch(self.reopened[index])
        while self.in_flight:
            self._complete_oldest()
        self._reset()

    @property
    def pending(self) -> bool:
        """Gradients arrived since the last `finish` (backward still running or ended abnormally)."""
        return self.callback_queued


def _divided(grad: torch.Tensor, world_size: int, out=None) -> torch.Tensor:
    """grad / world_size, in place or into `out` (in one pass; two when it casts to `out`'s dtype,
    dividing in that dtype)."""
    if out is None:
        return grad.div_(world_size) if world_size > 1 else grad
    if world_size > 1:
        return torch.div(grad, world_size, out=out) if out.dtype == grad.dtype else out.copy_(grad).div_(world_size)
    return out.copy_(grad)
