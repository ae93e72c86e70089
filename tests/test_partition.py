"""Partitioning is pure arithmetic: checked for world sizes 1..64 in milliseconds."""

import random

import pytest

from trainer_shard.sharding.partition import plan_layout


def owners(layout):
    """{(param, element): rank} from every rank's segments; fails on double ownership."""
    owned = {}
    for rank in range(layout.world_size):
        shard_cursor = 0
        for seg in layout.segments(rank):
            assert seg.shard_start >= shard_cursor  # shard order, no overlap
            shard_cursor = seg.shard_start + seg.numel
            for k in range(seg.numel):
                key = (seg.index, seg.param_start + k)
                assert key not in owned, f"{key} owned twice"
                owned[key] = rank
        assert shard_cursor <= layout.shard_numel
    return owned


@pytest.mark.parametrize("world_size", list(range(1, 17)) + [31, 32, 63, 64])
def test_every_element_owned_once_and_shards_equal(world_size):
    rng = random.Random(world_size)
    numels = [rng.choice([1, 3, 7, 64, 100, 1000, 4097]) for _ in range(rng.randint(1, 25))]
    layout = plan_layout(numels, world_size, bucket_numel=rng.choice([1, 50, 500, 5000]))
    owned = owners(layout)
    assert len(owned) == sum(numels)
    assert layout.shard_numel * world_size == layout.total_numel
    for bucket in layout.buckets:
        assert bucket.padded_numel - bucket.numel < world_size  # padding below one element a rank
        assert bucket.padded_numel == bucket.shard_numel * world_size


def test_buckets_hold_whole_parameters_up_to_the_size():
    layout = plan_layout([10, 10, 10, 25, 5], world_size=2, bucket_numel=20, order=range(5))
    assert [[s.index for s in b.slots] for b in layout.buckets] == [[0, 1], [2], [3], [4]]
    assert [b.padded_numel for b in layout.buckets] == [20, 10, 26, 6]
    # the slots tile the flat buffer bucket by bucket, padding between buckets
    assert [s.offset for s in layout.slots] == [0, 10, 20, 30, 56]


def test_default_order_is_reversed_like_ddp():
    layout = plan_layout([4, 4, 4], world_size=1, bucket_numel=4)
    assert [b.slots[0].index for b in layout.buckets] == [2, 1, 0]


def test_segments_of_a_split_parameter():
    layout = plan_layout([5, 3], world_size=2, bucket_numel=100, order=[0, 1])  # 8 elements, 4 a rank
    assert [(s.index, s.param_start, s.shard_start, s.numel) for s in layout.segments(0)] == [(0, 0, 0, 4)]
    assert [(s.index, s.param_start, s.shard_start, s.numel) for s in layout.segments(1)] == [(0, 4, 0, 1), (1, 0, 1, 3)]


@pytest.mark.parametrize("bad", [dict(world_size=0), dict(bucket_numel=0), dict(order=[0, 0])])
def test_bad_arguments(bad):
    kwargs = dict(world_size=2, bucket_numel=10, order=None) | bad
    with pytest.raises(ValueError):
        plan_layout([3, 4], **kwargs)
