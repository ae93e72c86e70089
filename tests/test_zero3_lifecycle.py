"""ZeRO-3 where users step off the paths of a plain layer stack: parameters read outside their own
unit, frozen parameters, a backward that raises, a read ahead across a step, reentrant
checkpointing with a shared parameter, state_dict/load_state_dict, buffers, conversions. Each
against plain PyTorch on the whole model (an independent reference), in a plain loop."""

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from distributed import spawn
from trainer_shard import ShardingError
from trainer_shard.offload import OffloadSpec
from trainer_shard.offload.param_store import ParamOffloadSpec
from trainer_shard.sharding import ShardedOptimizer, shard_model
from trainer_shard.sharding.zero3 import UnitState

D, STEPS, LR = 16, 3, 1e-2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        return self.norm(torch.tanh(self.linear(x)) + x)


class ReadsChild(nn.Module):
    """Reads its child unit's weight after the child ran (the child is released by then)."""

    def __init__(self):
        super().__init__()
        self.inner = Block()

    def forward(self, x):
        return self.inner(x) + x @ self.inner.linear.weight.t()


class BiasOut(nn.Module):
    """Megatron's pattern: returns its bias for the caller to add."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D, D, bias=False)
        self.bias = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return self.linear(x), self.bias


class Net(nn.Module):
    def __init__(self, n=3, skip=None, extras=True):
        super().__init__()
        self.extras = extras  # the two modules above, after the blocks
        self.embed = nn.Linear(8, D)
        self.blocks = nn.ModuleList(Block() for _ in range(n))
        self.reads = ReadsChild()
        self.bias_out = BiasOut()
        self.head = nn.Linear(D, 4)
        self.register_buffer("scale", torch.ones(D))
        self.skip = skip  # {step: block indices} a LayerDrop: those blocks do not run then
        self.step = 0

    def forward(self, x):
        h = self.embed(x) * self.scale
        for i, block in enumerate(self.blocks):
            if self.skip is None or i not in self.skip.get(self.step, ()):
                h = block(h)
        if not self.extras:
            return self.head(h)
        h = self.reads(h)
        y, bias = self.bias_out(h)
        return self.head(y + bias)


UNITS = [Block, ReadsChild, BiasOut]


def make(seed=0, **kwargs):
    torch.manual_seed(seed)
    return Net(**kwargs)


def data(step, rows=8):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 4, (rows,), generator=g)


def reference(steps=STEPS, freeze=None, **kwargs) -> dict:
    model = make(**kwargs)
    if freeze:
        freeze(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    for step in range(steps):
        model.step = step
        x, y = data(step)
        F.cross_entropy(model(x), y).backward()
        for p in model.parameters():  # a flat buffer's optimizer steps every element: unused ones with 0
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train(rank=0, world_size=1, steps=STEPS, freeze=None, threshold=0, offload=None, params=None, on_step=None,
          **kwargs):  # fmt: skip
    model = make(**kwargs)
    if freeze:
        freeze(model)
    sharded = shard_model(model, units=UNITS, persistence_threshold=threshold, param_offload=params)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if offload is None and params is None:
        opt = torch.optim.AdamW(sharded.shard_parameters(), lr=LR)
    else:
        opt = ShardedOptimizer(trainable, optim=torch.optim.AdamW, stage=3, lr=LR, offload=offload)
    rows = 8 // world_size
    for step in range(steps):
        model.step = step
        x, y = data(step)
        mine = slice(rank * rows, (rank + 1) * rows)
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        if on_step:
            on_step(step, sharded)
        # nothing gathered after backward (a read ahead from disk may stay: the step drops it if it writes the shard)
        assert all(u.state in (UnitState.SHARDED, UnitState.LOADED) for u in sharded.units)
        opt.step()
        opt.zero_grad()
    return model, sharded


def assert_close(got: dict, want: dict, atol=1e-6):
    assert got.keys() == want.keys()
    worst = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
    assert worst <= atol, f"largest difference {worst:.3g}"


# ---- 1 and 2: parameters read outside their unit; state_dict, load_state_dict --------------------


def test_parameters_read_by_a_parent_or_returned_to_the_caller_train_as_plain_adamw():
    """A parent reading its child unit's weight after the child ran (it was `setStorage ... out of
    bounds` reading freed memory) and a module returning its bias for the caller to add (both
    ranks died of SIGSEGV): the unit is gathered for the module running (DeepSpeed's external
    parameter), for its forward and backward, and the run equals plain AdamW."""
    model, sharded = train()
    assert_close(model.state_dict(), reference())
    assert all(unit.state is UnitState.SHARDED for unit in sharded.units)


def test_state_dict_and_load_state_dict_work_on_the_sharded_model():
    """model.state_dict() on the sharded model gives whole copies (it read freed memory: a
    segfault); load_state_dict() writes into the shards, and the next steps train from them,
    as the plain model loaded with the same weights does."""
    model, sharded = train()
    state = model.state_dict()
    assert_close(state, reference())
    assert all(v.numel() > 0 for v in state.values()) and sharded.held_parameter_bytes()["gathered"] == 0
    fresh = make(seed=5).state_dict()
    model.load_state_dict(fresh)
    assert_close(model.state_dict(), fresh)
    assert not any(unit.attached for unit in sharded.units)
    assert model.blocks[0].linear.weight.numel() == 0 and model.blocks[0].linear.weight.ds_shape == (D, D)
    assert model.state_dict(keep_vars=True)["blocks.0.linear.weight"] is model.blocks[0].linear.weight  # no gather


# ---- 3: frozen parameters sharded and freed after their backward ----------------------------------


def freeze_linears(model):
    """LoRA's shape: the big matrices frozen, the norms and biases trained."""
    for name, p in model.named_parameters():
        if name.endswith("linear.weight") or name.startswith("embed"):
            p.requires_grad_(False)


def frozen_run(rank, world_size, extras=True):
    most = []

    def count(module, grad_in, grad_out):  # the units gathered while each block's backward runs
        most.append(sum(u.state is UnitState.GATHERED for u in sharded_box[0].units))

    sharded_box = []
    model = make(n=6, extras=extras)
    freeze_linears(model)
    sharded = shard_model(model, units=UNITS, persistence_threshold=0)
    sharded_box.append(sharded)
    for block in model.blocks:
        block.register_full_backward_hook(count)
    frozen = [part for part in sharded.parts if not part.trainable]
    assert frozen, "frozen parameters were kept whole"
    frozen_numel = sum(part.layout.total_numel for part in frozen)
    assert sum(part.shard_bytes for part in frozen) <= (frozen_numel // world_size + 1) * 4
    assert all(part.grad_bytes == 0 and part.shard_param is None for part in frozen)
    opt = torch.optim.AdamW(sharded.shard_parameters(), lr=LR)
    rows = 8 // world_size
    for step in range(STEPS):
        x, y = data(step)
        mine = slice(rank * rows, (rank + 1) * rows)
        F.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
    # 6 frozen blocks + 2 others + the root: at most the running one, the prefetched one, the root
    assert max(most) <= 4, most
    assert_close(model.state_dict(), reference(freeze=freeze_linears, n=6, extras=extras))


def test_frozen_parameters_are_sharded_and_freed_after_their_backward():
    """LoRA's shape (big matrices frozen): the frozen parameters sharded like the others (kept
    whole, they made ZeRO-3 save nothing), and each frozen unit freed after its backward (they
    stayed gathered to the end of backward); trained as plain AdamW. With the external and
    returned parameters too: test_two_ranks."""
    frozen_run(0, 1, extras=False)


def test_the_root_stays_gathered_from_its_forward_into_its_backward():
    """The root (embed and head here) is gathered once a training step, not again for backward
    (its backward starts where its forward ends, as FSDP2's root); a forward without grad releases
    it, and after backward nothing is gathered. The weights: every other test of this file."""
    model = make(extras=False)
    sharded = shard_model(model, units=UNITS, persistence_threshold=0)
    root, started = sharded.root, []
    for part in root.parts:
        start = part.start_gather
        part.start_gather = lambda start=start, part=part: (started.append(part.state is UnitState.SHARDED), start())[1]
    x, y = data(0)
    loss = F.cross_entropy(model(x), y)
    assert root.state is UnitState.GATHERED
    loss.backward()
    assert sum(started) == len(root.parts), "the root was gathered again for its backward"
    assert sharded.held_parameter_bytes()["gathered"] == 0
    with torch.no_grad():
        model(x)
    assert root.state is UnitState.SHARDED


class Tied(nn.Module):
    """A language model's shape: the embedding tied to the output projection, both in the root."""

    def __init__(self, vocab=512):  # the root larger than the blocks' buffers together
        super().__init__()
        self.embed = nn.Embedding(vocab, D)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(D, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_the_root_is_let_go_in_backward_once_backward_has_read_it():
    """[Note: the root let go in backward] The head's backward reads the tied weight, the
    embedding's does not: by the first block's backward the root is released and its memory let
    go (not pooled), and the tied weight's gradient, which arrives last (both uses added), goes
    into the released parameter. Trained as plain AdamW, with a second backward through a retained
    graph (it reads the root's saved view after the release: gathered again) and a micro-batch
    accumulated in `.grad` (`no_sync`: the gradient stays on the released parameter between
    backwards)."""
    torch.manual_seed(0)
    plain = Tied()
    model = copy.deepcopy(plain)
    sharded = shard_model(model, units=[Block], persistence_threshold=0)
    root, pool = sharded.root, sharded.pool
    opt = ShardedOptimizer(list(model.parameters()), optim=torch.optim.AdamW, stage=3, lr=LR)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    seen = []

    def at_the_first_block(module, args, output):
        if torch.is_grad_enabled():
            output.register_hook(lambda grad: seen.append((root.state, pool.dropped_bytes)))

    model.blocks[0].register_forward_hook(at_the_first_block)
    root_bytes = sum(part.nbytes for part in root.parts)
    for step in range(STEPS):
        ids = torch.randint(0, 512, (4, 6), generator=torch.Generator().manual_seed(step))
        targets = torch.randint(0, 512, (4, 6), generator=torch.Generator().manual_seed(100 + step))
        for net in (model, plain):
            loss = lambda: F.cross_entropy(net(ids).flatten(0, 1), targets.flatten())  # noqa: E731
            if step == 0:  # twice through one graph
                graph = loss()
                graph.backward(retain_graph=True)
                graph.backward()
            elif step == 1 and net is model:  # two micro-batches, the first kept in `.grad`
                with opt.no_sync():
                    loss().backward()
                loss().backward()
            else:
                loss().backward()
                if step == 1:
                    loss().backward()
        for o in (opt, plain_opt):
            o.step()
            o.zero_grad()
        assert root.state is UnitState.SHARDED and pool.free_bytes < root_bytes, "the pool kept the root's memory"
    # the second backward through the retained graph gathers the root again, for the rest of it
    want = [UnitState.SHARDED, UnitState.GATHERED, *[UnitState.SHARDED] * 3]
    assert [state for state, _ in seen] == want, "the root was gathered at the first block's backward"
    assert seen[-1][1] - seen[0][1] >= 3 * root_bytes, "the root's memory went back to the pool, not let go"
    assert_close(model.state_dict(), {k: v.detach() for k, v in plain.state_dict().items()})
    # the root's parameter between uses is the empty tensor again, not the accumulation's stand-in
    assert model.embed.weight.numel() == 0 and model.embed.weight.grad is None


# ---- 4: a backward that raises --------------------------------------------------------------------


def test_a_backward_that_raised_leaves_nothing_behind():
    """The second step's backward raises halfway (after some units reduced); the loop zeroes the
    gradients and goes on. The per-iteration state is reset at the next forward: the run equals
    plain AdamW without that step (it was off by up to 93 from half-filled buckets)."""
    model = make()
    sharded = shard_model(model, units=UNITS, persistence_threshold=0)
    opt = torch.optim.AdamW(sharded.shard_parameters(), lr=LR)

    def boom(grad):
        raise RuntimeError("boom")

    plain = make()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LR)
    for step in range(STEPS + 1):
        x, y = data(step)
        if step == 1:
            hook = model.blocks[0].register_forward_hook(lambda m, i, out: [out.register_hook(boom)] and None)
            with pytest.raises(RuntimeError, match="boom"):
                F.cross_entropy(model(x), y).backward()
            hook.remove()
            opt.zero_grad()
            continue
        F.cross_entropy(model(x), y).backward()
        F.cross_entropy(plain(x), y).backward()
        for o in (opt, plain_opt):
            o.step()
            o.zero_grad()
        assert sharded.held_parameter_bytes()["gathered"] == 0
    assert_close(model.state_dict(), {k: v.detach() for k, v in plain.state_dict().items()})


def test_auto_find_batch_size_is_refused_at_stage_3(tmp_path):
    from trainer_shard import ArgumentError, ShardedSeq2SeqTrainingArguments
    from trainer_shard.training import plan

    args = ShardedSeq2SeqTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                           sharded_ddp="zero_dp_3", auto_find_batch_size=True)  # fmt: skip
    with pytest.raises(ArgumentError, match="--auto_find_batch_size .* ZeRO-3 cannot take"):
        plan.plan(args, None)


@pytest.mark.parametrize("case", ["zero2", "zero3", "zero3-params-on-disk"])
def test_a_model_and_optimizer_dropped_without_close_are_collected(case, tmp_path):
    """Dropped without close(), after steps and a forward whose backward never ran (an exception
    between them), the model, its ShardedModel and the optimizer are garbage collected, and the
    next run in the process opens its disk stores at the same paths (a hyperparameter search, a
    notebook). Their gradient hooks and the saved tensors of that forward held them for the life
    of the process: the next run raised "in use by another store of this process"."""
    stage = 2 if case == "zero2" else 3
    params = ParamOffloadSpec("nvme", nvme_path=str(tmp_path / "params"), buffer_count=3) if "disk" in case else None

    def run():
        model = make()
        sharded = shard_model(model, units=UNITS, persistence_threshold=0, param_offload=params) if stage == 3 else None
        opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=stage, lr=LR,
                               offload=OffloadSpec("nvme", nvme_path=str(tmp_path / "optim")))  # fmt: skip
        for step in range(2):
            x, y = data(step)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        F.cross_entropy(model(x), y)  # its backward never comes
        return [weakref.ref(o) for o in (model, sharded, opt) if o is not None]

    dropped = run()
    gc.collect()
    assert [r() for r in dropped] == [None] * len(dropped)
    run()


# ---- 5: a read ahead across a step ---------------------------------------------------------------


def test_a_unit_read_ahead_but_not_run_reads_the_stepped_weights(tmp_path):
    """Parameters on disk, LayerDrop: in step 1 the last two blocks do not run, the last having
    been read ahead (two units past the running one: no prefetch gathers it); the step rewrites
    its shard, and step 2 must gather the new weights, not the read ahead (0.0123 off), as plain
    AdamW with the same drops."""
    skip = {1: (2, 3)}
    params = ParamOffloadSpec("nvme", nvme_path=str(tmp_path / "params"), buffer_count=4, max_in_cpu=0)
    optim = OffloadSpec("nvme", nvme_path=str(tmp_path / "optim"))
    model, sharded = train(skip=skip, params=params, offload=optim, n=4, extras=False)
    assert_close(sharded.full_state_dict(), reference(skip=skip, n=4, extras=False))
    sharded.close()


# ---- 6: reentrant checkpointing with a parameter used in two segments -----------------------------


class Shared(nn.Module):
    """Three checkpointed segments, each using the root's `shared` linear, each ending in a tanh
    (which saves its output: the segment's recompute runs before its block's pre-backward)."""

    def __init__(self, reentrant):
        super().__init__()
        self.shared = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(D, 4)
        self.reentrant = reentrant

    def forward(self, x):
        h = x
        for block in self.blocks:
            h = checkpoint(lambda t, b=block: torch.tanh(b(self.shared(t))), h, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_segments_sharing_a_parameter(reentrant, monkeypatch):
    """The root's parameter gets a gradient in each segment's backward: the reducer adds them (the
    second overwrote the first: 5.64 off), and each bucket is reduced once a backward (it was
    reduced at each segment's end: 49 reductions for 7 buckets). The recompute reads the root in
    backward, before the block's pre-backward, where the root's saved views are all read: it keeps
    the root to the end of backward ([Note: the root let go in backward]; let go there, the
    recomputed segment read the released buffer)."""
    from trainer_shard import comm

    torch.manual_seed(0)
    plain = Shared(reentrant)
    model = copy.deepcopy(plain)
    sharded = shard_model(model, units=[Block], persistence_threshold=0)
    opt, plain_opt = torch.optim.AdamW(sharded.shard_parameters(), lr=LR), torch.optim.AdamW(plain.parameters(), lr=LR)
    calls = []
    real = comm.reduce_scatter
    monkeypatch.setattr(comm, "reduce_scatter", lambda *a, **k: calls.append(1) or real(*a, **k))
    for step in range(STEPS):
        x = torch.randn(8, D, generator=torch.Generator().manual_seed(step), requires_grad=True)
        y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(step))
        calls.clear()
        F.cross_entropy(model(x), y).backward()
        assert len(calls) == len(sharded.reducer.states), (len(calls), len(sharded.reducer.states))
        F.cross_entropy(plain(x), y).backward()
        for o in (opt, plain_opt):
            o.step()
            o.zero_grad()
    assert_close(model.state_dict(), {k: v.detach() for k, v in plain.state_dict().items()})


# ---- 7: the smaller ones ---------------------------------------------------------------------------


def test_clip_grad_norm_counts_offloaded_gradients(tmp_path):
    """With the optimizer offloaded the gradient shards are not the shard parameters' `.grad`:
    ShardedModel.clip_grad_norm_ still takes them (it returned 1194.9 where the optimizer said
    2229.3), and clips them."""
    norms = []

    def clip(step, sharded):
        norms.append(float(sharded.clip_grad_norm_(1e9)))

    model = make()
    model.step = 0
    x, y = data(0)
    F.cross_entropy(model(x), y).backward()
    want = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    train(steps=1, offload=OffloadSpec("cpu"), on_step=clip)
    assert norms[0] == pytest.approx(want, rel=1e-5)


def test_conversions_after_sharding_are_refused_or_pass():
    model = make()
    shard_model(model, units=UNITS, persistence_threshold=0)
    model.to("cpu").float()  # no change: fine
    with pytest.raises(ShardingError, match="converting them to torch.bfloat16 on cpu is not supported: cast or move "
                                            "the model before shard_model"):  # fmt: skip
        model.to(torch.bfloat16)


def test_unit_classes_that_match_nothing_are_refused():
    class Missing(nn.Module):
        pass

    with pytest.raises(ShardingError, match=r"units: no module of the model is a Missing; name classes the model "
                                            r"uses \(its layers are Block\)"):  # fmt: skip
        shard_model(make(), units=[Missing])


def two_ranks(rank, world_size):
    model = make()
    if rank == 1:
        model.scale.fill_(7.0)
    shard_model(model, units=UNITS, persistence_threshold=0)
    assert torch.equal(model.scale, torch.ones(D)), "buffers are broadcast from rank 0, as DDP does"
    model, sharded = train(rank, world_size)
    assert_close(model.state_dict(), reference())
    frozen_run(rank, world_size)


@pytest.mark.multiproc
def test_two_ranks():
    """2 ranks: buffers broadcast from rank 0; external and returned parameters; frozen ones sharded."""
    spawn(two_ranks, 2)


def test_a_meta_built_model_is_sharded_onto_the_trainers_device(monkeypatch):
    """`device=` reaches shard_model from the Trainer's wiring (a meta-built model went to the CPU
    under CUDA): the Trainer's device, checked by what shard_model is called with."""
    from types import SimpleNamespace

    from trainer_shard.training import stage3

    seen = {}
    monkeypatch.setattr(stage3, "shard_model", lambda model, **kwargs: seen.update(kwargs) or SimpleNamespace(
        persistent=[], units=[]))  # fmt: skip
    args = SimpleNamespace(sharded_ddp=["zero_dp_3"], process_index=1, device=torch.device("cuda", 1))
    stage3.shard_for_stage3(make(), args, None, [])
    assert seen["device"] == torch.device("cuda", 1)


def test_the_planner_and_the_trainer_take_their_units_from_one_rule(monkeypatch):
    """The planner's zero3_units and the Trainer's shard_for_stage3 pick the same modules: both call
    zero3.auto_wrap_units (they were written three times, and the planner's knew only
    _no_split_modules); its fallbacks: the ModuleLists' children, then modules by size."""
    from types import SimpleNamespace

    from transformers import T5Config

    from trainer_shard import planner
    from trainer_shard.sharding import zero3
    from trainer_shard.training import stage3

    config = T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=3, num_decoder_layers=2, num_heads=2, d_kv=8)
    chosen = []
    real = zero3.auto_wrap_units
    monkeypatch.setattr(zero3, "auto_wrap_units", lambda model: chosen.append(real(model)[0]) or real(model))
    monkeypatch.setattr(stage3, "auto_wrap_units", zero3.auto_wrap_units)
    units = planner.zero3_units(config, world_size=2, persistence_threshold=0)
    assert [type(m).__name__ for m in chosen[0]] == ["T5Block"] * 5 and len(units.inner) == 5
    seen = {}
    monkeypatch.setattr(stage3, "shard_model", lambda model, **kwargs: seen.update(kwargs) or SimpleNamespace(
        persistent=[], units=[]))  # fmt: skip
    args = SimpleNamespace(sharded_ddp=["zero_dp_3", "auto_wrap"], process_index=1, device=torch.device("cpu"))
    from transformers import T5ForConditionalGeneration

    stage3.shard_for_stage3(T5ForConditionalGeneration(config), args, None, [])
    assert [type(m).__name__ for m in seen["units"]] == ["T5Block"] * 5 and len(chosen) == 2

    class Layers(nn.Module):  # no _no_split_modules: the layers of its ModuleList
        def __init__(self):
            super().__init__()
            self.embed, self.layers = nn.Linear(4, 4), nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    model = Layers()
    assert real(model)[0] == list(model.layers)
    monkeypatch.setattr("trainer_shard.sharding.zero3.selection.SIZE_BASED_UNIT_NUMEL", 20)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(2, 2))  # neither: modules of at least the size
    assert real(plain)[0] == [plain[0]]
