"""ShardedOptimizer on 2 gloo ranks against plain DDP + the local optimizer."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import spawn
from trainer_shard import ShardingError
from trainer_shard.sharding import DynamicLossScaler, ShardedOptimizer
from trainer_shard.sharding.optimizer import NotConsolidatedError

pytestmark = pytest.mark.multiproc


def make_model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.Linear(16, 33), torch.nn.Tanh(), torch.nn.Linear(33, 50)
    )
    return model.to(dtype)


def groups(model, **first):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": decay, "weight_decay": 0.1, **first}, {"params": rest, "weight_decay": 0.0}]


def batch(rank, step, micro):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randint(0, 50, (4, 6), generator=g)


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 50).float(), tokens[:, 1:].reshape(-1))


def run_steps(model, opt, rank, *, steps=4, accumulation=2, clip=0.5, sharded=False):
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(accumulation):
            loss = loss_fn(model, batch(rank, step, micro)) / accumulation
            loss.backward()
            total += loss.item()
        if clip is None:
            norm = 0.0
        elif sharded:
            norm = opt.clip_grad_norm(clip)
        else:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append((total, float(norm)))
    return losses


def check_parity(rank, world_size, stage):
    from trainer_shard.sharding import reducer

    # every bucket buffer kept for reuse ([Note: spare buckets]), not only past 32 MiB; put back
    # after: the ranks are kept for the next tests (distributed.py)
    previous, reducer.SPARE_BYTES = reducer.SPARE_BYTES, 0
    try:
        _check_parity(rank, world_size, stage)
    finally:
        reducer.SPARE_BYTES = previous


def _check_parity(rank, world_size, stage):
    reference = DDP(make_model())
    ref_opt = torch.optim.AdamW(groups(reference.module), lr=3e-2)
    ours = make_model(seed=0 if rank == 0 else 7)  # rank 0's weights must win: the constructor broadcasts them
    opt = ShardedOptimizer(groups(ours), optim=torch.optim.AdamW, stage=stage, bucket_numel=300, lr=3e-2)
    model = DDP(ours) if stage == 1 else ours
    ref_losses = run_steps(reference, ref_opt, rank)
    our_losses = run_steps(model, opt, rank, sharded=True)
    for (l1, n1), (l2, n2) in zip(ref_losses, our_losses):
        assert abs(l1 - l2) < 1e-6 and abs(n1 - n2) < 1e-5, (ref_losses, our_losses)
    if stage == 2:  # its buckets are all of different sizes: kept, none reused, none held between steps
        most = (opt.reducer.max_in_flight + 1) * max(s.bucket.padded_numel for s in opt.reducer.states) * 4
        assert 0 < opt.reducer.peak_spare_bytes <= most and opt.reducer.spare_bytes == 0
    for (name, p), q in zip(reference.module.named_parameters(), ours.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0), f"{name}: {(p - q).abs().max()}"
    # every rank ends with the same weights
    flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered)
    assert opt.shard_bytes()["master"] == 0  # fp32: the optimizer steps the parameters' own storage
    # the state of one rank is half the local optimizer's
    assert opt.shard_bytes()["optimizer_state"] <= 0.51 * sum(
        v.numel() * v.element_size() for s in ref_opt.state.values() for v in s.values() if v.dim() > 0
    )
    # consolidate -> the local optimizer's state; load it back into a fresh sharded optimizer (on
    # a copy of the model: a second optimizer on the same parameters would take them over)
    opt.consolidate_state_dict(to=0)
    if rank == 1:  # the full state is on rank 0 only; this rank's shard is not it (ZeroRedundancyOptimizer's rule)
        with pytest.raises(NotConsolidatedError, match="consolidated on rank 0"):
            opt.state_dict()
    clone = make_model()
    clone.load_state_dict(ours.state_dict())
    fresh = ShardedOptimizer(groups(clone), optim=torch.optim.AdamW, stage=stage, bucket_numel=300, lr=3e-2)
    if rank == 0:
        full = opt.state_dict()
        reference_state = ref_opt.state_dict()
        for pid, saved in reference_state["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.allclose(full["state"][pid][key], saved[key], atol=1e-7), (pid, key)
            assert float(full["state"][pid]["step"]) == float(saved["step"])
        objects = [full]
    else:
        objects = [None]
    dist.broadcast_object_list(objects, src=0)
    fresh.load_state_dict(objects[0])
    for flat, fresh_flat in zip(opt.flats, fresh.flats):
        for view, fresh_view in zip(flat.master_views, fresh_flat.master_views):
            saved, loaded = opt.optim.state[view], fresh.optim.state[fresh_view]
            assert saved.keys() == loaded.keys()
            assert all(torch.equal(saved[key], loaded[key]) for key in saved), rank
        assert torch.equal(torch.cat(flat.master_views), torch.cat(fresh_flat.master_views))


@pytest.mark.parametrize("stage", [1, 2])
def test_parity_with_ddp(stage):
    spawn(check_parity, 2, stage)


def check_gradient_views(rank, world_size):
    """ZeRO-1 steps views of the gradients DDP all-reduced: no gradient bytes of its own (DDP's
    1.0x, not 1.5x), views that share `.grad`'s storage, let go of once the step is done."""
    ours = make_model()
    opt = ShardedOptimizer(groups(ours), optim=torch.optim.AdamW, stage=1, bucket_numel=300, lr=3e-2)
    model = DDP(ours)
    loss_fn(model, batch(rank, 0, 0)).backward()
    opt.clip_grad_norm(0.5)
    assert opt.shard_bytes()["grad"] == 0
    storages = {p.grad.untyped_storage().data_ptr() for p in ours.parameters()}
    views = [v for flat in opt.flats for v in flat.master_views]
    assert views and all(v.grad.untyped_storage().data_ptr() in storages for v in views)
    assert sum(v.numel() for v in views) == sum(p.numel() for p in ours.parameters()) // world_size + (rank == 0) * (
        sum(p.numel() for p in ours.parameters()) % world_size)  # fmt: skip
    opt.step()
    model.zero_grad()
    assert all(v.grad is None for v in views)  # nothing keeps the freed `.grad`s alive into the next backward


def test_zero1_steps_views_of_ddp_gradients():
    spawn(check_gradient_views, 2)


def check_gloo_collectives(rank, world_size):
    """comm's reduce-scatter (point to point on gloo) and all-gather against torch's collectives."""
    from trainer_shard import comm

    x = torch.randn(4 * world_size * 1000, generator=torch.Generator().manual_seed(rank))
    expected = x.clone()
    dist.all_reduce(expected)
    n = x.numel() // world_size
    out = torch.empty(n)
    comm.reduce_scatter(out, x.clone())
    assert torch.equal(out, expected[rank * n : (rank + 1) * n])  # two addends: the same sum either way
    full = torch.empty(world_size * n)
    comm.all_gather(full, out)
    assert torch.equal(full, expected)
    outs = [torch.empty(n), torch.empty(n)]
    handles = [comm.reduce_scatter(o, x * k, async_op=True) for o, k in zip(outs, (1, 2))]  # two in flight
    for handle in handles:
        handle.wait()
    assert torch.equal(outs[0], out) and torch.equal(outs[1], 2 * out)


def test_gloo_point_to_point_collectives():
    spawn(check_gloo_collectives, 2)


def check_bf16(rank, world_size, stage):
    """bf16 model, fp32 masters: the same as DDP in bf16 with an fp32 master copy stepped locally."""
    reference = DDP(make_model(dtype=torch.bfloat16))
    masters = [p.detach().float().clone().requires_grad_() for p in reference.module.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=3e-2, weight_decay=0.0)
    ours = make_model(dtype=torch.bfloat16)
    opt = ShardedOptimizer(ours.parameters(), optim=torch.optim.AdamW, stage=stage, lr=3e-2, weight_decay=0.0)
    model = DDP(ours) if stage == 1 else ours
    for step in range(3):
        for m in (reference, model):
            loss_fn(m, batch(rank, step, 0)).backward()
        for master, p in zip(masters, reference.module.parameters()):
            master.grad = p.grad.float()
        ref_opt.step()
        ref_opt.zero_grad()
        reference.zero_grad()
        with torch.no_grad():
            for master, p in zip(masters, reference.module.parameters()):
                p.copy_(master)
        opt.step()
        opt.zero_grad()
    assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
    assert opt.flats[0].master.dtype == torch.float32  # 16-bit parameters: a separate fp32 master
    assert all(v.data_ptr() != p.data_ptr() for v in opt.flats[0].master_views for p in ours.parameters())
    for p, q in zip(reference.module.parameters(), ours.parameters()):
        assert torch.equal(p, q), (p.float() - q.float()).abs().max()
    # the consolidated state carries the fp32 masters of 16-bit parameters
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        saved_masters = opt.state_dict()["master_params"]
        assert all(torch.equal(saved_masters[i], m) for i, m in enumerate(masters))


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_masters(stage):
    spawn(check_bf16, 2, stage)


def check_fp16_overflow_agreed(rank, world_size):
    model = make_model()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, stage=2, lr=0.1, loss_scaler=True)
    before = [p.detach().clone() for p in model.parameters()]
    scale = opt.loss_scaler.scale
    loss = opt.loss_scaler.scale_loss(loss_fn(model, batch(rank, 0, 0)))
    if rank == 1:
        loss = loss * float("inf")  # overflow on one rank only
    loss.backward()
    opt.step()
    assert opt.step_was_skipped and opt.loss_scaler.scale == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.loss_scaler.scale_loss(loss_fn(model, batch(rank, 1, 0))).backward()
    opt.step()
    assert not opt.step_was_skipped
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_fp16_overflow_skips_on_every_rank():
    spawn(check_fp16_overflow_agreed, 2)


def check_unused_and_outside_edits(rank, world_size):
    model = make_model()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=2, bucket_numel=100, lr=1e-2)
    # a forward that skips the embedding: its bucket is flushed with zeros at the end of backward
    model[3](model[2](model[1](torch.randn(3, 16)))).sum().backward()
    opt.step()
    opt.zero_grad()
    # weights changed behind the optimizer's back are followed, not overwritten
    new = make_model(seed=5).state_dict()
    model.load_state_dict(new)
    loss_fn(model, batch(rank, 0, 0)).backward()
    opt.step()
    assert (model[0].weight - new["0.weight"]).abs().max() < 0.05  # one small step away, not the old weights


def test_unused_parameters_and_outside_edits():
    spawn(check_unused_and_outside_edits, 2)


def test_world_size_one_without_process_group():
    model = make_model()
    opt = ShardedOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, stage=2)
    loss_fn(model, batch(0, 0, 0)).backward()
    before = model[1].weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model[1].weight)


def test_refusals():
    model = make_model()
    with pytest.raises(ShardingError, match="cannot shard Adafactor: it factors"):
        ShardedOptimizer(model.parameters(), optim=torch.optim.Adafactor)
    with pytest.raises(ShardingError, match="needs the optimizer class"):
        ShardedOptimizer(model.parameters())
    with pytest.raises(ShardingError, match="stage must be 1"):
        ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, stage=4, lr=0.1)


def check_mismatch(rank, world_size):
    model = torch.nn.Linear(4 + rank, 3)
    with pytest.raises(ShardingError, match="parameters differ across ranks"):
        ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, lr=0.1)


def test_mismatched_models_refused_before_any_step():
    spawn(check_mismatch, 2)


def check_no_sync_accumulation(rank, world_size):
    """Accumulating in `.grad` under no_sync gives the same step as accumulating in the shards."""
    results = []
    for use_no_sync in (False, True):
        model = make_model()
        opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=2, bucket_numel=200, lr=1e-2)
        for step in range(2):
            for micro in range(3):
                last = micro == 2
                with opt.no_sync() if use_no_sync and not last else contextlib.nullcontext():
                    (loss_fn(model, batch(rank, step, micro)) / 3).backward()
                if use_no_sync and not last:
                    assert model[1].weight.grad is not None  # kept, not communicated
            opt.step()
            opt.zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()


def test_no_sync_matches_accumulating_in_shards():
    spawn(check_no_sync_accumulation, 2)


def check_add_param_group(rank, world_size):
    """A group added after construction is flattened, sharded and stepped like the first."""
    reference = DDP(make_model())
    ref_opt = torch.optim.SGD(reference.module[1].parameters(), lr=0.1, momentum=0.9)
    ref_opt.add_param_group({"params": reference.module[3].parameters(), "lr": 0.05})
    ours = make_model()
    opt = ShardedOptimizer(ours[1].parameters(), optim=torch.optim.SGD, stage=2, lr=0.1, momentum=0.9)
    opt.add_param_group({"params": ours[3].parameters(), "lr": 0.05})
    assert len(opt.param_groups) == 2 and opt.param_groups[1]["lr"] == 0.05
    ours[0].weight.requires_grad_(False)  # the embedding is in no group
    for step in range(3):
        for model, o in ((reference, ref_opt), (ours, opt)):
            loss_fn(model, batch(rank, step, 0)).backward()
            o.step()
            o.zero_grad()
            model.zero_grad()
    for p, q in zip(reference.module.parameters(), ours.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_add_param_group():
    spawn(check_add_param_group, 2)


def check_recreated_optimizer(rank, world_size):
    """A second optimizer on the same model (a re-created one) steps as a fresh torch optimizer
    would; the first is closed: its hooks removed, and it says why if stepped."""
    reference, ours = DDP(make_model()), make_model()
    first = ShardedOptimizer(groups(ours), optim=torch.optim.AdamW, stage=2, bucket_numel=300, lr=3e-2)
    ref_first = torch.optim.AdamW(groups(reference.module), lr=3e-2)
    run_steps(reference, ref_first, rank, steps=2)
    run_steps(ours, first, rank, steps=2, sharded=True)
    second = ShardedOptimizer(groups(ours), optim=torch.optim.AdamW, stage=2, bucket_numel=300, lr=1e-2)
    ref_second = torch.optim.AdamW(groups(reference.module), lr=1e-2)  # fresh state: what the second must match
    losses = run_steps(ours, second, rank, steps=3, sharded=True)
    ref_losses = run_steps(reference, ref_second, rank, steps=3)
    assert [v for pair in losses for v in pair] == pytest.approx([v for pair in ref_losses for v in pair], abs=1e-5)
    for p, q in zip(reference.module.parameters(), ours.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0), (p - q).abs().max()
    assert first.closed and first.reducer._handles == []
    with pytest.raises(ShardingError, match="a newer ShardedOptimizer took its parameters over"):
        first.step()


def test_recreated_optimizer_trains_as_a_fresh_one():
    spawn(check_recreated_optimizer, 2)


def check_fp16_mean_does_not_overflow(rank, world_size):
    """fp16 gradients of 40000 and 32000 on the two ranks: their sum (72000) overflows fp16, their
    mean (36000) does not. Divided by the world size before the reduction (as DDP does), the step
    is taken and equals fp32 SGD on the mean gradient; summed first, it would be skipped as inf."""
    model = torch.nn.Linear(2, 1, bias=True).half()
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, stage=2, lr=1e-5, bucket_numel=2,
                           loss_scaler=DynamicLossScaler(init_scale=1.0))  # fmt: skip
    x = torch.full((1, 2), 40000.0 if rank == 0 else 32000.0, dtype=torch.float16)
    opt.loss_scaler.scale_loss(model(x).sum()).backward()  # weight: one bucket of its own, bias: padded
    opt.step()
    assert not opt.step_was_skipped and opt.loss_scaler.scale == 1.0
    # the reference: fp32 SGD on the whole model with the mean of both ranks' gradients
    reference = torch.nn.Linear(2, 1, bias=True)
    torch.nn.init.zeros_(reference.weight)
    torch.nn.init.zeros_(reference.bias)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=1e-5)
    sum(reference(torch.full((1, 2), value)).sum() for value in (40000.0, 32000.0)).div(2).backward()
    ref_opt.step()
    assert torch.equal(model.weight, reference.weight.half()) and torch.equal(model.bias, reference.bias.half())
    flat = opt.flats[0]
    for seg in flat.segments:  # this rank's fp32 masters: the reference's fp32 weights
        expected = [reference.weight, reference.bias][seg.index].detach().reshape(-1)[seg.param_start :][: seg.numel]
        assert torch.equal(flat.master[seg.shard_start : seg.shard_start + seg.numel], expected)


def test_fp16_gradients_are_divided_before_they_are_summed():
    spawn(check_fp16_mean_does_not_overflow, 2)


UNFREEZE = {2: ([1], []), 4: ([0], [3])}  # step: (modules to unfreeze, modules to freeze)


def unfreezing_optimizer(model, make, **kwargs):
    """The embedding (0) and the first linear (1) frozen when the optimizer is built, the first
    linear's group added while frozen; only the head (3) trains at first."""
    for module in (model[0], model[1]):
        module.requires_grad_(False)
    opt = make([{"params": list(model[0].parameters()), "lr": 2e-2}, {"params": list(model[3].parameters())}], **kwargs)
    opt.add_param_group({"params": list(model[1].parameters()), "weight_decay": 0.1})
    return opt


def train_unfreezing(model, opt, rank, world_size, *, steps=6, whole=False):
    """UNFREEZE's schedule; `whole`: every rank's batch at once (the reference on the whole model),
    else this rank's batch. Returns the head as it was when it was frozen."""
    head = None
    for step in range(steps):
        unfreeze, freeze = UNFREEZE.get(step, ([], []))
        for i in unfreeze:
            model[i].requires_grad_(True)
        for i in freeze:
            model[i].requires_grad_(False)
            head = [p.detach().clone() for p in model[i].parameters()]
        ranks = range(world_size) if whole else [rank]
        (sum(loss_fn(model, batch(r, step, 0)) for r in ranks) / len(ranks)).backward()
        opt.step()
        opt.zero_grad()
    return head


def check_unfreezing(rank, world_size):
    """Progressive unfreezing as torch's optimizers do it: a parameter frozen at construction
    trains once it requires grad (its state and step count start then), a group added while
    frozen too, and one frozen later stays as it was."""
    reference, ours = make_model(), make_model()
    ref_opt = unfreezing_optimizer(reference, torch.optim.AdamW, lr=3e-2)
    opt = unfreezing_optimizer(ours, ShardedOptimizer, optim=torch.optim.AdamW, stage=2, bucket_numel=300, lr=3e-2)
    ref_head = train_unfreezing(reference, ref_opt, rank, world_size, whole=True)
    head = train_unfreezing(ours, opt, rank, world_size)
    for (name, p), q in zip(reference.named_parameters(), ours.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0), f"{name}: {(p - q).abs().max()}"
    assert all(torch.equal(a, b) for a, b in zip(head, ours[3].parameters()))  # frozen at step 4: not moved since
    assert all(torch.equal(a, b) for a, b in zip(ref_head, reference[3].parameters()))
    assert not torch.equal(ours[0].weight, make_model()[0].weight)  # unfrozen at step 4: trained


def test_parameters_unfrozen_later_are_trained_as_torch_does():
    spawn(check_unfreezing, 2)
