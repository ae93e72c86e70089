"""`ShardedOptimizer(stage=3)` over a model `shard_model` sharded, against plain AdamW on the
whole model and batch, one process (the reference of test_zero3_core.py)."""

import pytest
import torch
from transformers.models.t5.modeling_t5 import T5Block

from distributed import spawn
from test_zero3_core import BATCH, CLIP, DECAY, LR, STEPS, assert_close_states, batch, make_t5, no_decay, reference
from trainer_shard import ShardingError
from trainer_shard.offload import OffloadSpec
from trainer_shard.sharding import ShardedOptimizer, shard_model

THRESHOLD = 100  # the layer norms (32 elements) stay whole: a stage-1 flat beside the units' flats


def train(rank, world_size, units, offload=None, param_offload=None):
    """STEPS steps, each of `micro` micro-batches per rank (the loss divided by `micro`, as the
    Trainer does under gradient accumulation); returns (full state dict, clipped norms)."""
    model = make_t5()
    sharded = shard_model(model, units=units, persistence_threshold=THRESHOLD, group_fn=no_decay,
                          param_offload=param_offload)
    names = dict(model.named_parameters())
    groups = [{"params": [p for n, p in names.items() if no_decay(n, p) == key], **DECAY[key]} for key in DECAY]
    opt = ShardedOptimizer(groups, optim=torch.optim.AdamW, stage=3, offload=offload, lr=LR, weight_decay=0.01)
    assert opt.sharded_model is sharded
    assert {id(f) for f in opt.flats} > {id(f) for f in sharded.parts}  # and stage-1 flats of the persistent ones
    assert {p for f in opt.flats for p in f.params} == set(model.parameters())
    micro = BATCH // world_size
    rows = 1
    norms = []
    for step in range(STEPS):
        inputs, labels = batch(step)
        for m in range(micro):
            mine = slice((rank * micro + m) * rows, (rank * micro + m + 1) * rows)
            (model(input_ids=inputs[mine], labels=labels[mine]).loss / micro).backward()
        norms.append(float(opt.clip_grad_norm(CLIP)))
        opt.step()
        opt.zero_grad()
        held = sharded.held_parameter_bytes()
        assert held["gathered"] == 0
        if param_offload is not None and param_offload.device == "nvme":  # max_in_cpu 0 here: nothing in memory
            assert held["shards"] == held["grad_shards"] == 0 and held["on_disk"] > 0
            assert sharded.store.disk.stats["read_bytes"] > 0 and sharded.store.disk.stats["write_bytes"] > 0
        elif offload is not None and offload.device == "nvme":  # the gradient shards on disk beside the state
            assert held["grad_shards"] == 0 and held["on_disk"] > 0
            stats = sharded.grad_store.disk.stats
            assert stats["write_bytes"] >= held["on_disk"] and stats["read_bytes"] >= held["on_disk"]
    return sharded.full_state_dict(), norms


def parity(rank, world_size, want, want_norms, tmp):
    cases = [([T5Block], None), ([T5Block], OffloadSpec("nvme", nvme_path=tmp))]
    if world_size == 2:  # the whole model as one unit, and CPU offload: on 2 ranks only (the suite's time)
        cases += [(None, None), ([T5Block], OffloadSpec("cpu"))]
    for units, offload in cases:
        got, norms = train(rank, world_size, units, offload)
        assert norms == pytest.approx(want_norms, rel=1e-5)
        assert_close_states(got, want)


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [2, 3])
def test_stage3_optimizer_matches_plain_adamw(world_size, tmp_path):
    """Weight-decay groups, gradient accumulation (one row a micro-batch: 3 of them on 2 ranks,
    2 on 3), clipping; units T5Block or the whole model; on the device, CPU offload and disk
    offload of the optimizer state."""
    want, want_norms = reference(groups=True)
    spawn(parity, world_size, want, want_norms, str(tmp_path))


def test_stage3_needs_a_sharded_model():
    model = make_t5()
    with pytest.raises(ShardingError, match="shard the model first"):
        ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=3)


def test_a_flat_buffer_may_not_span_two_param_groups():
    model = make_t5()
    shard_model(model, units=[T5Block], persistence_threshold=0)  # no group_fn: one flat per unit
    names = dict(model.named_parameters())
    groups = [{"params": [p for n, p in names.items() if no_decay(n, p) == key], **DECAY[key]} for key in DECAY]
    with pytest.raises(ShardingError, match="group_fn"):
        ShardedOptimizer(groups, optim=torch.optim.AdamW, stage=3)


def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def big_t5():
    """128 MiB of fp32 parameters (a T5 of d_model 512, 4+4 layers), built: (model, its bytes),
    the freed heap handed back to the OS first, so RSS measured next starts from it."""
    from transformers import T5Config, T5ForConditionalGeneration

    from trainer_shard.memory import release_freed_memory

    config = T5Config(vocab_size=8000, d_model=512, d_kv=64, d_ff=2048, num_layers=4, num_heads=8, dropout_rate=0.0,
                      decoder_start_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    release_freed_memory()
    return model, sum(p.numel() * 4 for p in model.parameters())


def bytes_freed_by_sharding(rank, world_size):
    from trainer_shard.memory import release_freed_memory

    model, total = big_t5()
    before = rss()
    sharded = shard_model(model, units=[T5Block])
    release_freed_memory()
    grown = rss() - before
    held = sharded.held_parameter_bytes()
    sharded_numel = sum(u.numel for u in sharded.units)  # the parameters themselves are empty between uses
    padding = len(sharded.parts) * world_size  # at most one element short of a multiple of N per flat
    assert held["shards"] <= (-(-sharded_numel // world_size) + padding) * 4  # ceil(P / N) of the dtype
    assert held["persistent"] == (total // 4 - sharded_numel) * 4 and held["gathered"] == held["pool"] == 0
    # the engine's account against the process's: the whole parameters went, the shards, the
    # persistent ones and the new fp32 gradient shards came (a kept copy would be 64 MiB more)
    expected = held["shards"] + held["persistent"] + held["grad_shards"] - total
    assert abs(grown - expected) <= 0.05 * total, (f"RSS changed by {grown / 2**20:.1f} MiB, the engine's account "
                                                   f"by {expected / 2**20:.1f} MiB")  # fmt: skip


@pytest.mark.multiproc
def test_sharding_frees_what_the_engine_says_it_does():
    """2 ranks, 128 MiB of fp32 parameters: a rank keeps at most ceil(P/2) of the sharded ones
    plus the persistent ones, and its RSS changes by what the engine's accounting says."""
    spawn(bytes_freed_by_sharding, 2, fresh=True)  # it measures its processes' RSS
