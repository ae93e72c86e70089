"""One flat buffer of parameters and this rank's fp32 shard of it.

A `FlatGroup` holds the parameters of one optimizer param group that share a dtype and device.
Their storage moves into one flat buffer (the parameters become views of it), laid out by
`partition.plan_layout`. For its shard, this rank keeps an fp32 gradient and the weights the
inner optimizer steps, one tensor per bucket (`master_views`):

- fp32 parameters: the master *is* the parameter storage (views of this rank's slices of the
  buffer), so no weight is stored twice;
- 16-bit parameters: a separate contiguous fp32 master shard, copied into the buffer in the
  parameters' dtype after each step;
- offloaded (`offloaded=True`): no master here at all; the offload engine keeps it in its store
  and writes each updated chunk into the buffer (`write_shard`). The gradient shard then stays
  in the parameters' dtype (2 bytes an element for bf16/fp16): the engine upcasts it a chunk at
  a time.

[Note: gradient views] At stage 1 the full gradients are already in `.grad`, all-reduced by DDP
(or by the persistent parameters' hooks at stage 3). With fp32 parameters stepped on the device
(`grad_views=True`) no gradient shard is allocated: the inner optimizer gets one tensor per
segment of this rank's shard (a view of the buffer, so still the parameters' own storage), and
its `.grad` is the same segment of the parameter's `.grad`, a view too (`copy_grads_to_shard`
attaches them, copying nothing). The
optimizer side then holds the optimizer state alone, as torch's `ZeroRedundancyOptimizer` does,
not 0.5x of the gradients more. The views are dropped once the step is done
(`mark_grads_stale`), so they never keep a freed `.grad` alive into the next backward.

[Note: parameters edited from outside] `load_best_model_at_end`, loading weights on resume or a
user's `model.load_state_dict` write into the parameters in place, behind the optimizer's back.
With fp32 parameters the optimizer steps that very storage, so it follows by construction. With
a separate master, each parameter's version counter tells (a parameter made a view with
`.data = ...` keeps a counter of its own, which the all-gather into the buffer does not touch),
and `refresh_master` reloads the master from the buffer, so the next step does not put the old
weights back. A parameter whose `.data` was replaced is copied back into the buffer.
"""

import bisect

import torch

from .. import comm
from ..memory import release_freed_memory
from .partition import FlatLayout

_TRIM_EVERY = 2**25  # elements moved into the flat buffer between two trims of the C heap


class FlatGroup:
    grad_stored = False  # the gradient shard is `grad`, in memory (ZeRO-3 may keep it on disk)
    params_stored = False  # and so the parameters

    def __init__(self, params: list, layout: FlatLayout, rank: int, group=None, *, offloaded: bool = False,
                 grad_dtype=None, grad_views: bool = False):  # fmt: skip
        self.params = params
        self.layout = layout
        self.rank = rank
        self.group = group
        self.offloaded = offloaded
        self.segments = layout.segments(rank)
        self._shard_starts = [b.shard_offset for b in layout.buckets]
        first = params[0]
        # Filled parameter by parameter, each original freed as soon as it is copied: the buffer's
        # pages are touched as the originals go, so building it does not hold the model twice.
        self.buffer = torch.empty(layout.total_numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for bucket in layout.buckets:  # the padding, which no parameter covers
                self.buffer[bucket.offset + bucket.numel : bucket.offset + bucket.padded_numel].zero_()
            moved = 0
            for p, slot in zip(params, layout.slots):
                self.buffer[slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))
                p.data = self._view(slot)
                moved += slot.numel
                if moved >= _TRIM_EVERY:  # the originals freed so far go back to the OS
                    release_freed_memory()
                    moved = 0
            release_freed_memory()
        if grad_dtype is None:
            grad_dtype = first.dtype if offloaded else torch.float32
        # see [Note: gradient views]
        fp32 = first.dtype == torch.float32 == grad_dtype
        self.grad_views = bool(grad_views and self.segments and fp32 and not offloaded)
        self.grad = None if self.grad_views else torch.zeros(layout.shard_numel, dtype=grad_dtype, device=first.device)
        # [Note: stale gradients] Buckets whose gradient slice still holds the last step's values,
        # which count as zero: the next reduction overwrites them instead of adding, so clearing
        # the gradients after a step costs no pass over the shard. All of them, to begin with.
        self.stale = {bucket.index for bucket in layout.buckets}
        self.accumulated = False  # a backward has added into gradients another had written
        if offloaded:
            self.master = None
            self.master_views = []
        elif self.grad_views:
            self.master = None
            starts = [layout.slots[seg.index].offset + seg.param_start for seg in self.segments]
            self.master_views = [self.buffer[a : a + seg.numel] for a, seg in zip(starts, self.segments)]
        elif first.dtype == torch.float32:
            self.master = None
            self.master_views = [self.buffer[slice(*b.slice_range(rank))] for b in layout.buckets]
        else:
            self.master = torch.zeros(layout.shard_numel, dtype=torch.float32, device=first.device)
            self.master_views = [self.shard_of(self.master, b) for b in layout.buckets]
        # (first element in the shard, elements) of each of `master_views`
        if self.grad_views:
            self.master_ranges = [(seg.shard_start, seg.numel) for seg in self.segments]
        else:
            self.master_ranges = [(b.shard_offset, b.shard_numel) for b in layout.buckets]
            for view, bucket in zip(self.master_views, layout.buckets):
                view.grad = self.shard_of(self.grad, bucket)
        self.refresh_master()

    @property
    def dtype(self):
        return self.buffer.dtype

    def _view(self, slot):
        return self.buffer[slot.offset : slot.offset + slot.numel].view(self.params[slot.index].shape)

    def bucket_view(self, bucket):
        return self.buffer[bucket.offset : bucket.offset + bucket.padded_numel]

    def shard_of(self, tensor: torch.Tensor, bucket) -> torch.Tensor:
        """`bucket`'s slice of a shard-sized tensor (master, grad, optimizer state)."""
        return tensor[bucket.shard_offset : bucket.shard_offset + bucket.shard_numel]

    @property
    def separate_master(self) -> bool:
        """Whether the weights the optimizer steps are a copy of the parameters (16-bit, or offloaded)."""
        return self.master is not None or self.offloaded

    def _buffer_pieces(self, start: int, numel: int):
        """(offset in [start, start + numel), this rank's buffer slice) covering that range of the shard."""
        end = start + numel
        i = max(bisect.bisect_right(self._shard_starts, start) - 1, 0)
        buckets = self.layout.buckets
        while i < len(buckets) and buckets[i].shard_offset < end:
            bucket = buckets[i]
            lo, hi = max(start, bucket.shard_offset), min(end, bucket.shard_offset + bucket.shard_numel)
            if lo < hi:
                first = bucket.slice_range(self.rank)[0] - bucket.shard_offset
                yield lo - start, self.buffer[first + lo : first + hi]
            i += 1

    @torch.no_grad()
    def write_shard(self, start: int, values: torch.Tensor, non_blocking: bool = False) -> None:
        """This rank's parameters, shard elements [start, start + len(values)) <- `values` (cast)."""
        for offset, target in self._buffer_pieces(start, values.numel()):
            target.copy_(values[offset : offset + target.numel()], non_blocking=non_blocking)

    @torch.no_grad()
    def read_shard(self, start: int, out: torch.Tensor) -> torch.Tensor:
        """`out` <- this rank's parameters, shard elements [start, start + len(out)) (cast)."""
        for offset, source in self._buffer_pieces(start, out.numel()):
            out[offset : offset + source.numel()].copy_(source)
        return out

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Master <- this rank's slices of the buffer. See [Note: parameters edited from outside]."""
        if self.master is not None:
            self.read_shard(0, self.master)
        self._seen_versions = self._versions()

    def _versions(self) -> tuple:
        return tuple(p._version for p in self.params)

    @torch.no_grad()
    def follow_outside_edits(self) -> bool:
        """Re-adopt replaced `.data`; True if a separate master must be reloaded from the parameters."""
        for p, slot in zip(self.params, self.layout.slots):
            view = self.buffer[slot.offset : slot.offset + slot.numel]
            if p.data.data_ptr() != view.data_ptr() or p.data.shape != p.shape:
                view.copy_(p.data.reshape(-1))
                p.data = self._view(slot)
        return self.separate_master and self._versions() != self._seen_versions

    def mark_seen(self) -> None:
        """The master now matches the parameters as they are."""
        self._seen_versions = self._versions()

    def mark_grads_stale(self) -> None:
        """The gradients are cleared: see [Note: stale gradients] (with gradient views, let go of them)."""
        self.stale = {bucket.index for bucket in self.layout.buckets}
        if self.grad_views:
            for view in self.master_views:
                view.grad = None

    def grad_tensors(self) -> list:
        """The tensors that hold this rank's gradient shard: the shard, or its views (once attached)."""
        if self.grad_views:
            return [view.grad for view in self.master_views if view.grad is not None]
        return [self.grad]

    @property
    def grad_bytes(self) -> int:
        """Bytes of gradient this flat holds itself (gradient views hold none: they are `.grad`'s)."""
        return 0 if self.grad is None else self.grad.numel() * self.grad.element_size()

    @torch.no_grad()
    def add_to_grad(self, bucket, values: torch.Tensor, alpha: float = 1.0, owned: bool = False) -> None:
        """The bucket's gradient slice += alpha * values (= alpha * values when it is stale).
        `owned`: the caller lets go of `values` (a ZeRO-3 flat may keep it rather than copy it)."""
        target = self.shard_of(self.grad, bucket)
        if bucket.index in self.stale:
            target.copy_(values)
            if alpha != 1.0:
                target.mul_(alpha)
            self.stale.discard(bucket.index)
        else:
            target.add_(values, alpha=alpha)
            # a second backward before the step, summed in the shard's own (16-bit?) precision
            self.accumulated = True

    def reduce_target(self, bucket, dtype):
        """Where a reduction of `bucket` may write this rank's slice directly: the gradient shard's
        slice when it is stale (its old values count as zero) and of `dtype`, else None (the
        result goes through `add_to_grad`). After writing there, call `mark_reduced`."""
        if bucket.index in self.stale and self.grad is not None and self.grad.dtype == dtype:
            return self.shard_of(self.grad, bucket)
        return None

    def mark_reduced(self, bucket) -> None:
        """`bucket`'s slice of the gradient shard was written by a reduction (`reduce_target`)."""
        self.stale.discard(bucket.index)

    @torch.no_grad()
    def zero_stale(self) -> None:
        """Zero what no reduction has written since the gradients were cleared."""
        for bucket in self.layout.buckets:
            if bucket.index in self.stale:
                self.shard_of(self.grad, bucket).zero_()
        self.stale = set()

    @torch.no_grad()
    def copy_grads_to_shard(self) -> None:
        """ZeRO-1: this rank's slices of the (already all-reduced) full `.grad` tensors -> fp32 shard;
        with gradient views, each segment's `.grad` <- that slice itself, a view (zeros where a
        parameter has none). See [Note: gradient views]."""
        if self.grad_views:
            for view, seg in zip(self.master_views, self.segments):
                grad = self.params[seg.index].grad
                if grad is None:
                    view.grad = torch.zeros_like(view)
                else:
                    view.grad = grad.reshape(-1)[seg.param_start : seg.param_start + seg.numel].to(view)
            self.stale = set()
            return
        for seg in self.segments:
            grad = self.params[seg.index].grad
            target = self.grad[seg.shard_start : seg.shard_start + seg.numel]
            if grad is None:
                target.zero_()
            else:
                target.copy_(grad.reshape(-1)[seg.param_start : seg.param_start + seg.numel])
        self.stale = set()  # every element written (the padding is never written, so stays zero)

    @torch.no_grad()
    def gather_params(self) -> None:
        """Updated shards -> every rank's flat buffer (all-gather, bucket by bucket). Collective.

        In place: this rank's slice of the buffer is the all-gather's input (for 16-bit parameters
        the fp32 master is first cast into it; the offload engine has already written it), so no
        copy of the shard is made.
        """
        works = []
        for bucket in self.layout.buckets:
            mine = self.buffer[slice(*bucket.slice_range(self.rank))]
            if self.master is not None:
                mine.copy_(self.shard_of(self.master, bucket))
            works.append(comm.all_gather(self.bucket_view(bucket), mine, self.group, async_op=True))
        for work in works:
            work.wait()
