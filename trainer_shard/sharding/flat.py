"""One flat buffer of parameters and this rank's fp32 shard of it.

A `FlatGroup` holds the parameters of one optimizer param group that share a dtype and device.
Their storage moves into one flat buffer (the parameters become views of it), laid out by
`partition.plan_layout`. This rank keeps, for its shard only: the fp32 master weights and the
fp32 gradient the inner optimizer steps.

[Note: parameters edited from outside] `load_best_model_at_end`, loading weights on resume or a
user's `model.load_state_dict` write into the parameters in place, behind the optimizer's back.
Each parameter's version counter moves when that happens (a parameter made a view with
`.data = ...` keeps a counter of its own, which our all-gather into the buffer does not touch),
and `refresh_master` then reloads the fp32 master from the buffer, so the next step does not
put the old weights back. A parameter whose `.data` was replaced is copied back into the buffer.
"""

import torch

from .. import comm
from .partition import FlatLayout


class FlatGroup:
    def __init__(self, params: list, layout: FlatLayout, rank: int, group=None, master_dtype=torch.float32):
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
        self.master = torch.zeros(layout.shard_numel, dtype=master_dtype, device=first.device)
        self.grad = torch.zeros_like(self.master)
        self.master.grad = self.grad
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
    def refresh_master(self) -> None:
        """Master <- this rank's slices of the flat buffer. See [Note: parameters edited from outside]."""
        for bucket in self.layout.buckets:
            lo, hi = bucket.slice_range(self.rank)
            self.shard_of(self.master, bucket).copy_(self.buffer[lo:hi])
        self._seen_versions = self._versions()

    def _versions(self) -> tuple:
        return tuple(p._version for p in self.params)

    @torch.no_grad()
    def follow_outside_edits(self) -> bool:
        """Re-adopt replaced `.data` and reload the master if the buffer changed since the last gather."""
        for p, slot in zip(self.params, self.layout.slots):
            view = self.buffer[slot.offset : slot.offset + slot.numel]
            if p.data.data_ptr() != view.data_ptr() or p.data.shape != p.shape:
                view.copy_(p.data.reshape(-1))
                p.data = self._view(slot)
        if self._versions() != self._seen_versions:
            self.refresh_master()
            return True
        return False

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
        """Updated masters -> every rank's flat buffer (all-gather, bucket by bucket). Collective."""
        same_dtype = self.master.dtype == self.buffer.dtype
        works = []
        for bucket in self.layout.buckets:
            piece = self.shard_of(self.master, bucket)
            piece = piece if same_dtype else piece.to(self.buffer.dtype)
            works.append((comm.all_gather(self.bucket_view(bucket), piece, self.group, async_op=True), piece))
        for work, _ in works:
            work.wait()
