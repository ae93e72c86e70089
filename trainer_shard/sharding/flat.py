"""One flat buffer of parameters and this rank's fp32 shard of it.

A `FlatGroup` holds the parameters of one optimizer param group that share a dtype and device.
Their storage moves into one flat buffer (the parameters become views of it), laid out by
`partition.plan_layout`. For its shard, this rank keeps an fp32 gradient and the weights the
inner optimizer steps, one tensor per bucket (`master_views`):

- fp32 parameters: the master *is* the parameter storage (views of this rank's slices of the
  buffer), so no weight is stored twice;
- 16-bit parameters: a separate contiguous fp32 master shard, copied into the buffer in the
  parameters' dtype after each step.

[Note: parameters edited from outside] `load_best_model_at_end`, loading weights on resume or a
user's `model.load_state_dict` write into the parameters in place, behind the optimizer's back.
With fp32 parameters the optimizer steps that very storage, so it follows by construction. With
a separate master, each parameter's version counter tells (a parameter made a view with
`.data = ...` keeps a counter of its own, which the all-gather into the buffer does not touch),
and `refresh_master` reloads the master from the buffer, so the next step does not put the old
weights back. A parameter whose `.data` was replaced is copied back into the buffer.
"""

import torch

from .. import comm
from .partition import FlatLayout


class FlatGroup:
    def __init__(self, params: list, layout: FlatLayout, rank: int, group=None):
        self.params = params
        self.layout = layout
        self.rank = rank
        self.group = group
        self.segments = layout.segments(rank)
        first = params[0]
        self.buffer = torch.zeros(layout.total_numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, slot in zip(params, layout.slots):
                self.buffer[slot.offset : slot.offset + slot.numel].copy_(p.detach().reshape(-1))
                p.data = self._view(slot)
        self.grad = torch.zeros(layout.shard_numel, dtype=torch.float32, device=first.device)
        if first.dtype == torch.float32:
            self.master = None
            self.master_views = [self.buffer[slice(*b.slice_range(rank))] for b in layout.buckets]
        else:
            self.master = torch.zeros(layout.shard_numel, dtype=torch.float32, device=first.device)
            self.master_views = [self.shard_of(self.master, b) for b in layout.buckets]
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

    @torch.no_grad()
    def load_master(self, shard: torch.Tensor) -> None:
        for view, bucket in zip(self.master_views, self.layout.buckets):
            view.copy_(self.shard_of(shard, bucket))

    @torch.no_grad()
    def refresh_master(self) -> None:
        """Master <- this rank's slices of the buffer. See [Note: parameters edited from outside]."""
        if self.master is not None:
            for bucket in self.layout.buckets:
                self.shard_of(self.master, bucket).copy_(self.buffer[slice(*bucket.slice_range(self.rank))])
        self._seen_versions = self._versions()

    def _versions(self) -> tuple:
        return tuple(p._version for p in self.params)

    @torch.no_grad()
    def follow_outside_edits(self) -> None:
        """Re-adopt replaced `.data`; reload a separate master if parameters were written."""
        for p, slot in zip(self.params, self.layout.slots):
            view = self.buffer[slot.offset : slot.offset + slot.numel]
            if p.data.data_ptr() != view.data_ptr() or p.data.shape != p.shape:
                view.copy_(p.data.reshape(-1))
                p.data = self._view(slot)
        if self.master is not None and self._versions() != self._seen_versions:
            self.refresh_master()

    @torch.no_grad()
    def copy_grads_to_shard(self) -> None:
        """ZeRO-1: this rank's slices of the (already all-reduced) full `.grad` tensors -> fp32 shard."""
        for seg in self.segments:
            grad = self.params[seg.index].grad
            target = self.grad[seg.shard_start : seg.shard_start + seg.numel]
            if grad is None:
                target.zero_()
            else:
                target.copy_(grad.reshape(-1)[seg.param_start : seg.param_start + seg.numel])

    @torch.no_grad()
    def gather_params(self) -> None:
        """Updated shards -> every rank's flat buffer (all-gather, bucket by bucket). Collective.

        In place: this rank's slice of the buffer is the all-gather's input (for 16-bit parameters
        the fp32 master is first cast into it), so no copy of the shard is made.
        """
        works = []
        for view, bucket in zip(self.master_views, self.layout.buckets):
            mine = self.buffer[slice(*bucket.slice_range(self.rank))]
            if self.master is not None:
                mine.copy_(view)
            works.append(comm.all_gather(self.bucket_view(bucket), mine, self.group, async_op=True))
        for work in works:
            work.wait()
