"""Re-partition saved optimizer state into this rank's shards: source -> segments -> shard.

One path for every way state comes in, whatever world size, stage or offload saved it:

    source = TensorSource(full_tensors)       # a full state_dict in memory (load_state_dict)
    source = state_io.ShardSources(folder)    # shard files of any world size (checkpoints)
    fill_shard(stepper, index, flat, "exp_avg", source, names)

A source reads any range of one parameter's full, flattened tensor by (parameter name, state
name). `fill_shard` walks this rank's segments of a `FlatGroup` (which elements of which
parameter sit where in the shard: `partition.FlatLayout.segments`) a chunk at a time and writes
each chunk through the stepper (`stepper.Stepper.write`), so a shard-sized tensor is never held
twice and state that lives on disk is never loaded whole.
"""

import bisect
from typing import Protocol

import torch

from ..constants import CHUNK_NUMEL


class Source(Protocol):
    def read_range(self, name, key: str, start: int, out: torch.Tensor) -> None:
        """out <- elements [start, start + len(out)) of parameter `name`'s `key` tensor, flattened."""


class TensorSource:
    """Full per-parameter tensors in memory: `{name: {key: tensor}}` (a torch optimizer's
    state_dict, keyed by parameter id, with "master" for the fp32 master weights)."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def read_range(self, name, key: str, start: int, out: torch.Tensor) -> None:
        source = self.tensors[name][key].detach().reshape(-1)[start : start + out.numel()]
        out.copy_(source)


@torch.no_grad()
def fill_shard(stepper, index: int, flat, key: str, source: Source, names: list) -> None:
    """This rank's shard of `key` for flat `index`, chunk by chunk, from `source` (padding zero).
    `names[i]` is how the source names `flat.params[i]`."""
    numel = flat.layout.shard_numel
    segments = flat.segments
    starts = [s.shard_start for s in segments]
    buffer = torch.empty(min(CHUNK_NUMEL, max(numel, 1)))  # on the CPU: file sources read into it
    for start in range(0, numel, CHUNK_NUMEL):
        end = min(start + CHUNK_NUMEL, numel)
        out = buffer[: end - start]
        out.zero_()
        j = max(bisect.bisect_right(starts, start) - 1, 0)
        for seg in segments[j:]:
            if seg.shard_start >= end:
                break
            lo, hi = max(start, seg.shard_start), min(end, seg.shard_start + seg.numel)
            if lo < hi:
                offset = seg.param_start + lo - seg.shard_start
                source.read_range(names[seg.index], key, offset, out[lo - start : hi - start])
        stepper.write(index, key, start, out)
