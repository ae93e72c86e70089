"""ZeRO-3 parameter offload (`offload_param`): parameter and gradient shards in CPU RAM or on
disk, against plain AdamW on the whole model and batch, one process (test_zero3_core.py's
reference), on 1 and 2 ranks."""

import pytest
import torch
from transformers.models.t5.modeling_t5 import T5Block

from distributed import spawn
from test_zero3_core import CLIP, assert_close_states, reference
from test_zero3_optimizer import train
from trainer_shard.offload import OffloadSpec
from trainer_shard.offload.param_store import ParamOffloadSpec


def parity(rank, world_size, want, want_norms, tmp):
    for device in ("cpu", "nvme"):
        params = ParamOffloadSpec(device, nvme_path=f"{tmp}/params" if device == "nvme" else None, buffer_count=3,
                                  max_in_cpu=0)
        got, norms = train(rank, world_size, [T5Block], OffloadSpec("nvme", nvme_path=f"{tmp}/optim"), params)
        assert norms == pytest.approx(want_norms, rel=1e-5)
        assert_close_states(got, want)


@pytest.mark.multiproc
@pytest.mark.parametrize("world_size", [1, 2])
def test_param_offload_matches_plain_adamw(world_size, tmp_path):
    want, want_norms = reference(groups=True)
    spawn(parity, world_size, want, want_norms, str(tmp_path))


def held_between_units(rank, world_size, tmp):
    """One process, 128 MiB of fp32 parameters, parameters and optimizer state on disk."""
    from transformers import T5Config, T5ForConditionalGeneration

    from test_zero3_optimizer import rss
    from trainer_shard.memory import release_freed_memory
    from trainer_shard.sharding import ShardedOptimizer, shard_model
    from trainer_shard.sharding.zero3 import Unit

    config = T5Config(vocab_size=8000, d_model=512, d_kv=64, d_ff=2048, num_layers=4, num_heads=8, dropout_rate=0.0,
                      decoder_start_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    total = sum(p.numel() * 4 for p in model.parameters())
    release_freed_memory()
    before = rss()
    spec = ParamOffloadSpec("nvme", nvme_path=f"{tmp}/params", buffer_count=3, max_in_cpu=0)
    sharded = shard_model(model, units=[T5Block], param_offload=spec)
    release_freed_memory()
    held = sharded.held_parameter_bytes()
    # nothing of the sharded parameters stays in memory: RSS fell by what the engine says it let go
    assert held["shards"] == held["gathered"] == held["grad_shards"] == 0 and held["on_disk"] >= total - held["persistent"]
    expected = held["persistent"] - total
    assert abs(rss() - before - expected) <= 0.05 * total, (rss() - before, expected)

    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=3, lr=1e-3,
                           offload=OffloadSpec("nvme", nvme_path=f"{tmp}/optim", chunk_numel=2**18))  # fmt: skip
    largest = max(sum(p.numel() * 4 for p in u.params) for u in sharded.units)
    bound = spec.buffer_count * largest
    seen = []
    gather = Unit.gather

    def watched(unit):
        gather(unit)
        now = sharded.held_parameter_bytes()
        seen.append(now["gathered"] + now["pool"] + now["shards"])

    Unit.gather = watched
    try:
        ids = torch.randint(2, 8000, (2, 32))
        start = rss()
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.clip_grad_norm(1.0)
            opt.step()
            opt.zero_grad()
        release_freed_memory()
        grown = rss() - start
    finally:
        Unit.gather = gather
    assert len(seen) > 2 * len(sharded.units), "every unit gathers in forward and backward"
    assert max(seen) <= bound, f"held {max(seen) / 2**20:.1f} MiB between units, bound {bound / 2**20:.1f} MiB"
    # after the steps: what the pool keeps (at most the bound), the engine's chunk buffers and a
    # unit's reduction bucket; the gradient or parameter shards kept in memory would be 120 MiB more
    held = sharded.held_parameter_bytes()
    assert held["shards"] == held["grad_shards"] == 0 and held["pool"] <= bound
    engine = (4 * 4 + 1) * 2**18 * 4  # buffer_count sets of master, 2 moments and gradient chunks; the fp32 one
    allowed = held["pool"] + engine + largest + 0.1 * total
    assert grown <= allowed, f"RSS grew {grown / 2**20:.1f} MiB over the steps, accounted {allowed / 2**20:.1f} MiB"
    opt.close()
    sharded.close()


@pytest.mark.multiproc
def test_param_offload_holds_at_most_buffer_count_units(tmp_path):
    """Between units a rank holds at most buffer_count x the largest unit (plus the persistent
    parameters), by the engine's account, and its RSS agrees."""
    spawn(held_between_units, 1, str(tmp_path))
