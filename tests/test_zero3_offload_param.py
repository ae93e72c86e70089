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
    from test_zero3_optimizer import big_t5, rss
    from trainer_shard.memory import release_freed_memory
    from trainer_shard.sharding import ShardedOptimizer, shard_model
    from trainer_shard.sharding.zero3 import Unit

    model, total = big_t5()
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
    largest = max(u.numel * 4 for u in sharded.units)
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
    # after the steps: what the pool keeps (at most the bound), the engine's chunk buffers and two
    # units' gradients (the reducer's bucket, and the one being written); the gradient or parameter
    # shards kept in memory would be 120 MiB more
    held = sharded.held_parameter_bytes()
    assert held["shards"] == held["grad_shards"] == 0 and held["pool"] <= bound
    engine = (4 * 4 + 1) * 2**18 * 4  # buffer_count sets of master, 2 moments and gradient chunks; the fp32 one
    allowed = held["pool"] + engine + 2 * largest + 0.1 * total
    assert grown <= allowed, f"RSS grew {grown / 2**20:.1f} MiB over the steps, accounted {allowed / 2**20:.1f} MiB"
    opt.close()
    sharded.close()


@pytest.mark.multiproc
def test_param_offload_holds_at_most_buffer_count_units(tmp_path):
    """Between units a rank holds at most buffer_count x the largest unit (plus the persistent
    parameters), by the engine's account, and its RSS agrees."""
    spawn(held_between_units, 1, str(tmp_path), fresh=True)  # it measures its process's RSS


def test_meta_model_loads_a_tensor_at_a_time_into_the_store(tmp_path):
    """A checkpoint written without the model in memory (write_random_t5), read into a model
    built on the meta device with its parameters on disk, is the model `from_pretrained` loads;
    and T5's initialization is what the builder wrote."""
    from transformers import AutoModelForSeq2SeqLM, T5Config, T5ForConditionalGeneration

    from trainer_shard.demo import write_random_t5
    from trainer_shard.sharding import shard_model
    from trainer_shard.sharding.zero3_weights import checkpoint_weights

    config = T5Config(vocab_size=300, d_model=64, d_kv=16, d_ff=256, num_layers=2, num_heads=4, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    write_random_t5(config, tmp_path / "model", torch.bfloat16, seed=1)
    want = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "model")
    assert want.dtype == torch.bfloat16 and want.lm_head.weight is want.shared.weight
    stds = {n: float(p.float().std()) for n, p in want.named_parameters()}
    assert stds["shared.weight"] == pytest.approx(1.0, rel=0.05)
    assert stds["encoder.block.0.layer.1.DenseReluDense.wo.weight"] == pytest.approx(256**-0.5, rel=0.05)
    assert float(want.encoder.final_layer_norm.weight.float().min()) == 1.0

    with torch.device("meta"):
        model = T5ForConditionalGeneration(config).to(torch.bfloat16)
    weights = checkpoint_weights(tmp_path / "model")
    spec = ParamOffloadSpec("nvme", nvme_path=str(tmp_path / "params"), max_in_cpu=0)
    sharded = shard_model(model, units=[T5Block], weights=weights, param_offload=spec)
    weights.close()
    assert sharded.held_parameter_bytes()["shards"] == 0 and model.lm_head.weight is model.shared.weight
    got = sharded.full_state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.state_dict().items())
    ids = torch.randint(2, 300, (2, 8))
    want.train()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, labels=ids).logits, want(input_ids=ids, labels=ids).logits)
    sharded.close()
    assert not (tmp_path / "params" / "zero3_params" / "rank0").exists()


def test_meta_model_without_weights_is_refused():
    from transformers import T5Config, T5ForConditionalGeneration

    from trainer_shard import ShardingError
    from trainer_shard.sharding import shard_model

    with torch.device("meta"):
        model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                    num_heads=4))  # fmt: skip
    with pytest.raises(ShardingError, match="meta device.*weights="):
        shard_model(model, units=[T5Block])
    with pytest.raises(ShardingError, match="not there, e.g."):
        shard_model(model, units=[T5Block], weights={"shared.weight": torch.zeros(64, 32)})


def test_eval_and_generate_stream_from_disk(tmp_path):
    """Evaluation (no_grad) and generate() with the parameters on disk give what the unsharded
    model gives, and leave nothing gathered."""
    from test_zero3_core import make_t5
    from trainer_shard.sharding import shard_model

    want = make_t5().eval()
    model = make_t5().eval()
    spec = ParamOffloadSpec("nvme", nvme_path=str(tmp_path / "params"), max_in_cpu=0, buffer_count=2)
    sharded = shard_model(model, units=[T5Block], persistence_threshold=0, param_offload=spec)
    ids = torch.randint(2, 64, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, labels=ids).logits, want(input_ids=ids, labels=ids).logits)
        for _ in range(2):  # the second time, read ahead in the recorded order
            got = model.generate(input_ids=ids, max_new_tokens=6, num_beams=2, do_sample=False)
            assert torch.equal(got, want.generate(input_ids=ids, max_new_tokens=6, num_beams=2, do_sample=False))
    held = sharded.held_parameter_bytes()
    assert held["gathered"] == held["shards"] == 0 and sharded.store.disk.stats["read_bytes"] > 0
    sharded.close()


def test_meta_model_without_parameter_offload_trains_as_the_eager_one():
    """Built on the meta device, read from `weights`, parameters kept in memory (no offload): two
    AdamW steps end where plain AdamW on the eager model does. The tied embedding (big enough to
    be sharded, in the root unit) is gathered again in backward; its parameter must not share the buffer's version counter."""
    from transformers import T5Config, T5ForConditionalGeneration

    from trainer_shard.sharding import ShardedOptimizer, shard_model

    config = T5Config(vocab_size=32128, d_model=64, d_kv=16, d_ff=256, num_layers=2, num_heads=4, dropout_rate=0.0,
                      decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    eager = T5ForConditionalGeneration(config)
    weights = {k: v.clone() for k, v in eager.state_dict().items()}
    ref_opt = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    with torch.device("meta"):
        model = T5ForConditionalGeneration(config)
    sharded = shard_model(model, units=[T5Block], weights=weights)
    assert model.lm_head.weight is model.shared.weight
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=3, lr=1e-3)
    ids = torch.randint(2, 300, (2, 8), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        for m, o in ((eager, ref_opt), (model, opt)):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    got = sharded.full_state_dict()
    for k, v in eager.state_dict().items():
        assert torch.allclose(got[k], v, atol=1e-6, rtol=0), k
    opt.close()
    sharded.close()
