"""ZeRO-3 core (sharding/zero3.py) in a plain loop against plain AdamW on one process."""

import functools
import math
import re

import pytest
import torch
import torch.distributed as dist
from transformers import T5Config, T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Block, T5LayerFF, T5Stack

from distributed import spawn
from trainer_shard import ShardingError, shm_comm
from trainer_shard.sharding.zero3 import GatherPool, shard_model

STEPS, BATCH, LR, CLIP, THRESHOLD = 3, 6, 1e-3, 0.5, 100


def make_t5(seed=0):
    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
                      eos_token_id=1)  # fmt: skip
    torch.manual_seed(seed)
    return T5ForConditionalGeneration(config)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(2, 64, (BATCH, 7), generator=g), torch.randint(2, 64, (BATCH, 5), generator=g)


def optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def no_decay(name, param):
    """The Trainer's rule, roughly: no weight decay for norms (and biases; T5 has none)."""
    return "no_decay" if "layer_norm" in name or name.endswith("bias") else "decay"


DECAY = {"decay": {"weight_decay": 0.1}, "no_decay": {"weight_decay": 0.0}}


def grouped(named_params):
    found = {}
    for name, p in named_params:
        found.setdefault(no_decay(name, p), []).append(p)
    return [{"params": ps, **DECAY[key]} for key, ps in found.items()]


@functools.lru_cache
def reference(steps=STEPS, groups=False, checkpointing=None) -> tuple:
    """Plain AdamW on the whole batch, one process: (final state dict, grad norm of each step).
    `checkpointing`: None for none, else `use_reentrant` for transformers' gradient checkpointing,
    on this unsharded model too, so that both sides run the same ops (see the checkpointing test)."""
    model = make_t5()
    if checkpointing is not None:
        model.gradient_checkpointing_enable({"use_reentrant": checkpointing})
        model.train()
    opt = optimizer(grouped(model.named_parameters()) if groups else model.parameters())
    norms = []
    for step in range(steps):
        inputs, labels = batch(step)
        model(input_ids=inputs, labels=labels).loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def train_sharded(rank, world_size, units, steps=STEPS, group=None, groups=False):
    model = make_t5()
    if groups:  # everything sharded, norms included: a no_decay flat buffer in each unit
        sharded = shard_model(model, units=units, group=group, persistence_threshold=0, group_fn=no_decay)
        opt = optimizer(sharded.param_groups(DECAY))
    else:
        sharded = shard_model(model, units=units, group=group, persistence_threshold=THRESHOLD)
        opt = optimizer(sharded.shard_parameters())
    rows, norms = BATCH // world_size, []
    for step in range(steps):
        inputs, labels = batch(step)
        mine = slice(rank * rows, (rank + 1) * rows)
        model(input_ids=inputs[mine], labels=labels[mine]).loss.backward()
        assert sharded.held_parameter_bytes()["gathered"] == 0, "a unit stayed gathered after backward"
        norms.append(float(sharded.clip_grad_norm_(CLIP)))
        opt.step()
        opt.zero_grad()
        if step == 1:  # the first forward records the order, prefetch starts in the second
            made, let_go = sharded.pool.created_bytes, sharded.pool.dropped_bytes
    # after the second step a gather makes only what the root let go in each backward ([Note: the
    # root let go in backward]; a root buffer may have had another unit's storage, up to twice
    # its size): the pool neither grows nor allocates for the other units
    made, let_go = sharded.pool.created_bytes - made, sharded.pool.dropped_bytes - let_go
    assert made == let_go <= (steps - 2) * 2 * sum(part.nbytes for part in sharded.root.parts), (made, let_go)
    if world_size > 1:  # the ranks' gathered buffers were one memory: [Note: gathered in shared memory]
        assert shm_comm.for_group(group).zero_copy_gathers >= len(sharded.units) * steps
        # the gather counts of the storages let go (a root's each step) go with them
        assert set(sharded.pool.uses) <= {token[1] for slots in sharded.pool.free.values() for token in slots}
    return model, sharded, norms


def assert_close_states(got: dict, want: dict, atol=1e-6):
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    assert worst <= atol, f"largest difference {worst:.3g}"


def check_parity(rank, world_size, configs, refs, full=True, group=None):
    """For each (units, groups) config: trained weights and grad norms as the reference's; with
    `full`, also the bytes held, eval under no_grad and generate()."""
    for units, groups in configs:
        want, want_norms = refs[groups]
        model, sharded, norms = train_sharded(rank, world_size, units, group=group, groups=groups)
        # Adam is blind to a gradient's scale (and clipping hides it): the norms are not
        assert norms == pytest.approx(want_norms, rel=1e-5)
        assert_close_states(sharded.full_state_dict(), want)
        if full:
            if not groups:
                check_bytes(sharded, world_size)
            check_eval_and_generate(model, sharded, want)


def check_bytes(sharded, world_size):
    held = sharded.held_parameter_bytes()
    sharded_numel = sum(u.numel for u in sharded.units)  # the parameters themselves are empty between uses
    persistent_numel = sum(p.numel() for p in sharded.persistent)
    # one padding per unit at most: sum of ceil(unit / N) <= ceil(P / N) + units
    assert held["shards"] <= (math.ceil(sharded_numel / world_size) + len(sharded.units)) * 4
    assert held["shards"] * world_size >= sharded_numel * 4
    assert held["persistent"] == persistent_numel * 4
    assert held["grad_shards"] == held["shards"]  # fp32 parameters: one fp32 gradient element each
    assert held["masters"] == 0 and held["gathered"] == 0
    if sharded.pool.pooled:  # kept for the next step: a few units' worth, not the model
        kept = sharded.pool.created_bytes - sharded.pool.dropped_bytes
        assert 0 < held["pool"] == kept <= 4 * max(u.nbytes for u in sharded.parts)


@torch.no_grad()
def check_eval_and_generate(model, sharded, want):
    plain = make_t5(seed=1)
    plain.load_state_dict(want)
    model.eval(), plain.eval()
    inputs, labels = batch(99)
    got = model(input_ids=inputs, labels=labels)
    assert sharded.held_parameter_bytes()["gathered"] == 0
    ref = plain(input_ids=inputs, labels=labels)
    assert (got.logits - ref.logits).abs().max().item() < 1e-5
    gen = model.generate(input_ids=inputs[:2], max_new_tokens=4, do_sample=False)
    assert sharded.held_parameter_bytes()["gathered"] == 0
    assert torch.equal(gen, plain.generate(input_ids=inputs[:2], max_new_tokens=4, do_sample=False))


def train_checking_norms(model, sharded, want_norms):
    """STEPS steps of the plain loop: each step's clipped norm as the reference's, nothing left
    gathered between backward and step."""
    opt = optimizer(sharded.shard_parameters())
    for step in range(STEPS):
        inputs, labels = batch(step)
        model(input_ids=inputs, labels=labels).loss.backward()
        assert float(sharded.clip_grad_norm_(CLIP)) == pytest.approx(want_norms[step], rel=1e-5)
        assert sharded.held_parameter_bytes()["gathered"] == 0
        opt.step()
        opt.zero_grad()


def test_one_process_matches_plain_adamw():
    """World size 1 (no process group): the hooks, gather/free and the step still hold."""
    check_parity(0, 1, [([T5Block], False), (None, False), ([T5Block], True)], refs())


def test_without_the_pool_buffers_are_resized(monkeypatch):
    """The fallback where `UntypedStorage._swap_data_ptr_` is missing (or gather_pool=False):
    resize to full and to 0."""
    monkeypatch.setattr(GatherPool, "pooled", False)
    check_parity(0, 1, [([T5Block], False)], refs())
    monkeypatch.undo()
    sharded = shard_model(make_t5(), units=[T5Block], gather_pool=False)
    assert not sharded.pool.pooled and GatherPool.pooled


def test_tied_embedding_stays_one_parameter_in_the_root_unit():
    model = make_t5()
    assert model.lm_head.weight is model.shared.weight is model.encoder.embed_tokens.weight
    sharded = shard_model(model, units=[T5Block], persistence_threshold=THRESHOLD)
    root = sharded.units[-1]
    assert root.module is model and any(p is model.shared.weight for p in root.params)
    assert model.lm_head.weight is model.shared.weight
    assert len(sharded.units) == 5  # 4 blocks + root
    assert all(p.numel() <= THRESHOLD for p in sharded.persistent)


def refs() -> dict:
    return {False: reference(), True: reference(groups=True)}


def three_ranks_then_two(rank, world_size, refs):
    check_parity(rank, world_size, [([T5Block], False)], refs, full=False)
    group = dist.new_group([1, 2])  # every rank creates it; rank 0 then sits out
    if rank in (1, 2):
        configs = [([T5Block], False), (None, False), ([T5Block], True)]
        check_parity(rank - 1, 2, configs, refs, group=group)


@pytest.mark.multiproc
def test_three_ranks_then_two_match_plain_adamw():
    """One spawn (the children's imports are most of the time): 3 ranks, units = T5Block
    (padding on every unit); then 2 ranks in a process group that leaves rank 0 out (group
    ranks are not global ranks): units = T5Block, the whole model as one unit, weight-decay
    groups; with bytes held, eval under no_grad and generate()."""
    spawn(three_ranks_then_two, 3, refs())


def test_only_running_units_are_gathered():
    """During forward and backward: the root, the running block and at most one prefetched one."""
    model = make_t5()
    sharded = shard_model(model, units=[T5Block], persistence_threshold=THRESHOLD)
    blocks = sharded.units[:-1]  # the root is last
    seen = []

    def record(*_):
        seen.append(sum(u.gathered for u in blocks))

    for unit in blocks:
        unit.module.register_forward_pre_hook(record)
        unit.module.register_forward_hook(record)
        for p in unit.params:
            p.register_post_accumulate_grad_hook(record)
    inputs, labels = batch(0)
    for _ in range(2):  # the first forward records the order, the second prefetches
        seen.clear()
        model(input_ids=inputs, labels=labels).loss.backward()
        assert max(seen) <= 2 and sharded.held_parameter_bytes()["gathered"] == 0
    assert len(sharded._order) == 4 and any(n == 2 for n in seen)  # prefetch did happen


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("unit_class", [T5Block, T5LayerFF], ids=["blocks", "ff-inside-blocks"])
def test_gradient_checkpointing_matches_plain_adamw(reentrant, unit_class):
    """Checkpointed blocks re-run forward inside backward: units inside a block get their forward
    hooks again there (transformers 5 checkpoints a block's `forward`, inside its hooks), so are
    gathered again and not freed under autograd.

    The reference is the unsharded model with the same checkpointing, so both sides run the same
    ops: checkpointing alone moves plain AdamW's weights by up to 1.2e-6 from the unchecked run
    (rounding: T5 on SDPA since transformers 5.15, its position-bias mask made contiguous in 5.20;
    Adam's eps term turns an ulp on a near-zero gradient into ~1e-6 of weight), while ZeRO-3 stays
    within 1.2e-7 of it, its floor without checkpointing too."""
    want, want_norms = reference(checkpointing=reentrant)
    model = make_t5()
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})  # False: transformers 5's default
    model.train()
    sharded = shard_model(model, units=[unit_class], persistence_threshold=THRESHOLD)
    runs = []
    for module in model.modules():
        if isinstance(module, T5LayerFF):
            module.register_forward_pre_hook(lambda *_: runs.append(1))
    train_checking_norms(model, sharded, want_norms)
    assert len(runs) == STEPS * 4 * 2  # every feed-forward ran again in backward
    assert_close_states(sharded.full_state_dict(), want)


def test_bf16_steps_an_fp32_master_and_casts_it_at_the_next_gather():
    model = make_t5().to(torch.bfloat16)
    sharded = shard_model(model, units=[T5Block], persistence_threshold=THRESHOLD)
    opt = optimizer(sharded.shard_parameters())
    assert all(p.dtype == torch.float32 for p in sharded.shard_parameters()[: len(sharded.units)])
    before = sharded.full_state_dict()
    inputs, labels = batch(0)
    model(input_ids=inputs, labels=labels).loss.float().backward()
    sharded.clip_grad_norm_(CLIP)
    opt.step()
    opt.zero_grad()
    held = sharded.held_parameter_bytes()
    assert held["masters"] == 2 * held["shards"] and held["gathered"] == 0
    after = sharded.full_state_dict()
    assert after["shared.weight"].dtype == torch.bfloat16
    changed = ("shared.weight", "decoder.block.1.layer.2.DenseReluDense.wi.weight")
    assert all(not torch.equal(before[k], after[k]) for k in changed)


def test_gradient_accumulation_sums_micro_batches():
    """Two backward passes before a step (half the batch each, loss halved) as one on the whole
    batch; zero_grad(set_to_none=False) too."""
    want, want_norms = reference()
    model = make_t5()
    sharded = shard_model(model, units=[T5Block], persistence_threshold=THRESHOLD)
    opt = optimizer(sharded.shard_parameters())
    for step in range(STEPS):
        inputs, labels = batch(step)
        for half in (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)):
            (model(input_ids=inputs[half], labels=labels[half]).loss / 2).backward()
        assert float(sharded.clip_grad_norm_(CLIP)) == pytest.approx(want_norms[step], rel=1e-5)
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    assert_close_states(sharded.full_state_dict(), want)


def test_load_full_state_dict_round_trips_and_trains_on():
    """Weights loaded after sharding (resume, best model) reach the shards and the bf16 masters."""
    want, _ = reference()
    for dtype in (torch.float32, torch.bfloat16):
        model = make_t5(seed=5).to(dtype)
        sharded = shard_model(model, units=[T5Block], persistence_threshold=THRESHOLD)
        opt = optimizer(sharded.shard_parameters())
        loaded = {k: v.to(dtype) for k, v in want.items()}
        sharded.load_full_state_dict(loaded)
        assert_close_states(sharded.full_state_dict(), loaded, atol=0)
        inputs, labels = batch(0)
        model(input_ids=inputs, labels=labels).loss.backward()
        opt.step()  # from the loaded weights, not the seed-5 ones
        after = sharded.full_state_dict()
        assert max((after[k].float() - loaded[k].float()).abs().max().item() for k in loaded) < 0.05
    with pytest.raises(ShardingError, match="keys missing"):
        sharded.load_full_state_dict({})


@pytest.mark.parametrize("units", ["stacks-and-blocks", "instances"])
def test_nested_units_and_module_instances(units):
    """Units inside units (T5Stack around its T5Blocks), or single module instances; every
    parameter sharded (threshold 0), so the stacks' own norms are a unit of their own."""
    want, want_norms = reference()
    model = make_t5()
    chosen = [T5Stack, T5Block] if units == "stacks-and-blocks" else [model.encoder.block[1], model.decoder]
    sharded = shard_model(model, units=chosen, persistence_threshold=0)
    assert not sharded.persistent
    train_checking_norms(model, sharded, want_norms)
    assert_close_states(sharded.full_state_dict(), want)


def test_a_module_shared_by_two_units_goes_to_their_common_unit():
    class Pair(torch.nn.Module):
        def __init__(self, shared):
            super().__init__()
            self.a, self.shared = torch.nn.Linear(4, 4), shared

        def forward(self, x):
            return self.shared(self.a(x))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            shared = torch.nn.Linear(4, 4)
            self.first, self.second = Pair(shared), Pair(shared)
            self.inner_tied = Pair(torch.nn.Linear(4, 4))
            self.inner_tied.a.weight = self.inner_tied.shared.weight  # tied inside one unit

        def forward(self, x):
            return self.inner_tied(self.second(self.first(x)))

    torch.manual_seed(0)
    model, x = Model(), torch.randn(3, 4)
    want = model(x)
    sharded = shard_model(model, units=[Pair], persistence_threshold=0)
    by_module = {u.module: u for u in sharded.units}
    assert any(p is model.first.shared.weight for p in by_module[model].params)
    assert any(p is model.inner_tied.a.weight for p in by_module[model.inner_tied].params)
    assert len(by_module[model.inner_tied].params) == 3  # the tied weight once, two biases
    assert torch.allclose(model(x), want)
    model(x).sum().backward()
    assert all(p.grad is not None for p in sharded.shard_parameters())


def test_bad_arguments_are_refused():
    model = make_t5()
    with pytest.raises(ShardingError, match="not submodules"):
        shard_model(model, units=[torch.nn.Linear(2, 2)])
    with pytest.raises(ShardingError, match="persistence_threshold"):
        shard_model(model, persistence_threshold=-1)


def diverging_calls(rank, world_size):
    model = make_t5()
    shard_model(model, units=[T5Block], persistence_threshold=THRESHOLD)
    inputs, labels = batch(0)
    model(input_ids=inputs, labels=labels).loss.backward()
    with pytest.raises(ShardingError) as e:  # rank 1 at its extra call, rank 0 at the forward it pairs with
        if rank == 1:  # a module run on this rank only: its gather would pair with rank 0's next one
            with torch.no_grad():
                model.encoder.block[1](torch.zeros(1, 3, 32))
        model(input_ids=inputs, labels=labels)
    message = str(e.value)
    assert re.search(r"ran different modules.*\(rank 0: 'the model' \(gather (\d+)\); rank 1: 'encoder\.block\.1' "
                     r"\(gather \1\)\)", message), message  # fmt: skip


def diverging_mid_forward(rank, world_size):
    """Two iterations, then one in which rank 1 runs an encoder block again in the middle of the
    forward: past the first iteration the ranks announce their gathers a gather ahead instead of
    meeting before each, and the rank that changes course must still pair with the others."""
    model = make_t5()
    sharded = shard_model(model, units=[T5Block], persistence_threshold=THRESHOLD)
    inputs, labels = batch(0)
    for _ in range(2):
        model(input_ids=inputs, labels=labels).loss.backward()
    assert sharded._gathered_last and sharded._posted is None  # the second iteration guessed right to its end
    exchanges = []
    original = sharded._exchange
    sharded._exchange = lambda unit, changed=False: (exchanges.append(unit.index), original(unit, changed))[1]
    model(input_ids=inputs, labels=labels).loss.backward()
    assert len(exchanges) == 1, exchanges  # the first gather of the iteration only: the others were announced

    def again(module, args, output):
        with torch.no_grad():
            model.encoder.block[0](args[0])

    if rank == 1:
        model.encoder.block[1].register_forward_hook(again)
    with pytest.raises(ShardingError) as e:
        model(input_ids=inputs, labels=labels).loss.backward()
    message = str(e.value)
    assert "ran different modules" in message and "rank 1: 'encoder.block.0'" in message, message
    assert "instead of the one announced" in message, message


@pytest.mark.multiproc
def test_ranks_calling_different_modules_are_named_not_hung():
    """Every rank raises the same error, naming what each was about to gather: between
    iterations, and in the middle of a forward once the ranks announce their gathers ahead."""
    spawn(diverging_calls, 2)
    spawn(diverging_mid_forward, 2)
