"""Where every parameter element lives: pure arithmetic on sizes, no torch.distributed.

The parameters of one flat group are laid end to end in a flat buffer, cut into buckets of
whole parameters (about `bucket_numel` elements each; a larger parameter gets a bucket of its
own). Each bucket is padded to a multiple of the world size and split evenly: rank r owns
the r-th slice of every bucket. A rank's shard is the concatenation of its slices, so it is one
contiguous tensor of `shard_numel` elements, the same size on every rank.

    flat buffer:  | bucket 0: r0 r1 | bucket 1: r0 r1 | ...      (each bucket padded)
    rank 0 shard: | b0.r0 | b1.r0 | ...

Bucket-wise slicing is what lets ZeRO-2 reduce-scatter a bucket as soon as its gradients are
ready: a bucket's reduce-scatter fills every rank's slice of it, with equal chunk sizes.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    """One parameter in the flat buffer."""

    index: int  # the parameter's position in its group
    offset: int  # first element in the flat buffer
    numel: int


@dataclass(frozen=True)
class Bucket:
    index: int
    offset: int  # first element in the flat buffer
    numel: int  # elements of its parameters
    padded_numel: int  # numel rounded up to a multiple of the world size
    shard_numel: int  # padded_numel // world_size: each rank's slice
    shard_offset: int  # where this bucket's slice starts in every rank's shard
    slots: tuple  # the Slots in it, in flat order

    def slice_range(self, rank: int) -> tuple:
        """[start, end) of `rank`'s slice, in flat-buffer coordinates."""
        start = self.offset + rank * self.shard_numel
        return start, start + self.shard_numel


@dataclass(frozen=True)
class Segment:
    """A run of one parameter's elements inside one rank's shard."""

    index: int  # parameter position in its group
    param_start: int  # first element within the (flattened) parameter
    shard_start: int  # first element within the rank's shard
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    world_size: int
    slots: tuple  # by parameter index
    buckets: tuple
    total_numel: int  # flat buffer size, padding included
    shard_numel: int  # every rank's shard size

    def segments(self, rank: int) -> list:
        """The pieces of parameters that make up `rank`'s shard, in shard order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        out = []
        for bucket in self.buckets:
            out += bucket_segments(bucket, rank)
        return out


def bucket_segments(bucket: Bucket, rank: int) -> list:
    lo, hi = bucket.slice_range(rank)
    out = []
    for slot in bucket.slots:
        start, end = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if start < end:
            out.append(Segment(slot.index, start - slot.offset, bucket.shard_offset + start - lo, end - start))
    return out


def plan_layout(numels, world_size: int, bucket_numel: int, order=None) -> FlatLayout:
    """Lay out parameters of sizes `numels` for `world_size` ranks.

    `order` is the order in the flat buffer (default: reversed, so that buckets fill in the
    order backward produces gradients, as DDP does).
    """
    numels = [int(n) for n in numels]
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be at least 1 element, got {bucket_numel}")
    if any(n < 1 for n in numels):
        raise ValueError("every parameter needs at least one element")
    order = list(reversed(range(len(numels)))) if order is None else list(order)
    if sorted(order) != list(range(len(numels))):
        raise ValueError("order must be a permutation of the parameter indices")
    groups = _group_into_buckets([numels[i] for i in order], bucket_numel)
    slots, buckets, offset, shard_offset, position = {}, [], 0, 0, 0
    for bucket_index, sizes in enumerate(groups):
        bucket_slots, cursor = [], offset
        for size in sizes:
            slot = Slot(order[position], cursor, size)
            slots[slot.index] = slot
            bucket_slots.append(slot)
            cursor += size
            position += 1
        numel = cursor - offset
        padded = -(-numel // world_size) * world_size
        buckets.append(Bucket(bucket_index, offset, numel, padded, padded // world_size, shard_offset, tuple(bucket_slots)))
        offset += padded
        shard_offset += padded // world_size
    return FlatLayout(world_size, tuple(slots[i] for i in range(len(numels))), tuple(buckets), offset, shard_offset)


def _group_into_buckets(sizes, bucket_numel: int) -> list:
    groups, current, filled = [], [], 0
    for size in sizes:
        if current and filled + size > bucket_numel:
            groups.append(current)
            current, filled = [], 0
        current.append(size)
        filled += size
    if current:
        groups.append(current)
    return groups
