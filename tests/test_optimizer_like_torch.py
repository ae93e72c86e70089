"""ShardedOptimizer on one process, where torch users expect what torch's optimizers do: a
re-created optimizer, micro-batches summed in 16 bits, parameters that change trainability, the
param groups and `state_dict` conventions of torch and ZeroRedundancyOptimizer, a loaded "step"
placed as torch places it. References: a plain torch optimizer on the whole model, the plain
Trainer."""

import logging
import pytest
import torch

from test_sharded_optimizer import batch, groups, loss_fn, make_model, run_steps, train_unfreezing, unfreezing_optimizer
from trainer_shard import ShardingError
from trainer_shard.offload import OffloadSpec
from trainer_shard.sharding import ShardedOptimizer
from trainer_shard.sharding.optimizer import NotConsolidatedError


def train(model, opt, steps, start=0):
    for step in range(start, start + steps):
        loss_fn(model, batch(0, step, 0)).backward()
        opt.step()
        opt.zero_grad()


def max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


# ---- a re-created optimizer ------------------------------------------------------------------


@pytest.mark.parametrize("offload", [None, "nvme"])
def test_second_optimizer_on_the_same_model_trains_as_a_fresh_one(tmp_path, offload):
    """Two ZeRO-2 optimizers one after the other on one model: the second steps exactly as a fresh
    torch optimizer would. The first is closed by it (hooks removed; a disk store deleted before
    the second opens one at the same path) and says why if stepped."""
    spec = OffloadSpec("nvme", nvme_path=str(tmp_path / "store")) if offload else None
    reference, ours = make_model(), make_model()
    first = ShardedOptimizer(groups(ours), optim=torch.optim.AdamW, stage=2, bucket_numel=300, offload=spec, lr=3e-2)
    train(reference, torch.optim.AdamW(groups(reference), lr=3e-2), 2)
    train(ours, first, 2)
    second = ShardedOptimizer(groups(ours), optim=torch.optim.AdamW, stage=2, bucket_numel=300, offload=spec, lr=1e-2)
    train(reference, torch.optim.AdamW(groups(reference), lr=1e-2), 3, start=2)
    train(ours, second, 3, start=2)
    assert max_diff(reference, ours) <= 1e-6
    assert first.closed and first.reducer._handles == []
    with pytest.raises(ShardingError, match="closed .a newer ShardedOptimizer took its parameters over"):
        first.step()
    second.close()
    assert not (tmp_path / "store").exists()


def test_closed_optimizer_leaves_the_gradients_to_another():
    """close() removes the hooks: backward fills `.grad` again, and a plain torch optimizer then
    trains the model exactly as if the sharded one had never been there."""
    reference, ours = make_model(), make_model()
    ShardedOptimizer(ours.parameters(), optim=torch.optim.SGD, stage=2, lr=0.1).close()
    train(reference, torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), 3)
    train(ours, torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9), 3)
    assert max_diff(reference, ours) == 0.0


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
def test_trainer_with_a_re_created_optimizer_trains_like_the_plain_trainer(tiny_model, tiny_data, tmp_path):
    """`trainer.optimizer = None; trainer.create_optimizer()` under --sharded_ddp zero_dp_2: the
    second ShardedOptimizer takes the model over and the run ends where the plain Trainer's does."""
    plain = _trainer(tiny_model, tiny_data, tmp_path / "plain", None)
    plain.train()
    trainer = _trainer(tiny_model, tiny_data, tmp_path / "sharded", "zero_dp_2")
    first = trainer.create_optimizer()
    trainer.optimizer = None
    second = trainer.create_optimizer()
    trainer.train()
    assert first.closed and trainer.sharded_optimizer is second and not second.closed
    assert max_diff(plain.model, _trainer(tiny_model, tiny_data, tmp_path / "untrained", None).model) > 1e-4
    worst = max_diff(plain.model, trainer.model)
    assert worst < 1e-6, worst  # the tolerance of test_sharded_trainer's one-rank ZeRO-2 parity


def _trainer(model_dir, data_dir, out, sharded_ddp):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, set_seed

    from trainer_shard import ShardedSeq2SeqTrainer, ShardedSeq2SeqTrainingArguments
    from trainer_shard.data import TokenizedSeq2SeqDataset, read_split

    set_seed(11)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    dataset = TokenizedSeq2SeqDataset(read_split(data_dir, "train", n_obs=32), tokenizer, max_source_length=32,
                                      max_target_length=32, prefix="t: ")  # fmt: skip
    args = ShardedSeq2SeqTrainingArguments(
        output_dir=str(out), use_cpu=True, report_to="none", save_strategy="no", seed=11, per_device_train_batch_size=8,
        max_steps=4, learning_rate=3e-3, weight_decay=0.01, max_grad_norm=0.5, disable_tqdm=True,
        **({"sharded_ddp": sharded_ddp} if sharded_ddp else {}),
    )  # fmt: skip
    return ShardedSeq2SeqTrainer(model=model, args=args, train_dataset=dataset,
                                 data_collator=DataCollatorForSeq2Seq(tokenizer, model=model))  # fmt: skip


# ---- 16-bit gradients --------------------------------------------------------------------------


def test_bf16_buckets_over_more_than_8_ranks_are_summed_in_fp32(monkeypatch):
    """A ring reduction rounds once per rank it passes. Simulated here on one process: N ranks with
    this rank's bf16 gradient each, summed hop by hop in the bucket's dtype. Over 16 ranks the
    buckets are fp32 and the shard is the exact mean; over 8 they stay bf16 (as DDP)."""
    for world_size, wire in ((16, torch.float32), (8, torch.bfloat16)):
        with monkeypatch.context() as patch:
            _check_wire(patch, world_size, wire)


def _check_wire(monkeypatch, world_size, wire):
    from trainer_shard import comm

    wires = []

    def ring(output, input, group=None, async_op=False):
        wires.append(input.dtype)
        total = input.clone()
        for _ in range(world_size - 1):
            total = total + input  # one rounding to the bucket's dtype per hop
        output.copy_(total[: output.numel()])
        return comm._Done()

    monkeypatch.setattr(comm, "rank_and_size", lambda group=None: (0, world_size))
    monkeypatch.setattr(comm, "reduce_scatter", ring)
    reference, ours = make_model(dtype=torch.bfloat16), make_model(dtype=torch.bfloat16)
    opt = ShardedOptimizer(ours.parameters(), optim=torch.optim.SGD, stage=2, bucket_numel=300, lr=0.1)
    for model in (reference, ours):
        loss_fn(model, batch(0, 0, 0)).backward()
    assert set(wires) == {wire}
    flat = opt.flats[0]
    params = list(reference.parameters())
    exact = torch.cat([params[s.index].grad.reshape(-1)[s.param_start :][: s.numel].float() for s in flat.segments])
    mine = torch.cat([flat.grad[s.shard_start :][: s.numel] for s in flat.segments])
    if wire == torch.float32:
        assert torch.equal(mine, exact)  # the mean of equal gradients is the gradient
    else:
        assert 0 < (mine - exact).abs().max() < 2e-2  # bf16 hops: a few roundings away


def test_micro_batches_summed_in_16_bits_are_logged_once(caplog):
    """The 16-bit gradient shard of an offloaded bf16 run (the default there: half the memory)
    trades accuracy for memory once micro-batches add up in it: said once, with the measured cost
    and the fix; a single micro-batch a step loses nothing and says nothing."""
    model = make_model(dtype=torch.bfloat16)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=2, lr=1e-2, offload=OffloadSpec("cpu"))
    with caplog.at_level(logging.WARNING, logger="trainer_shard.sharding.optimizer"):
        run_steps(model, opt, 0, steps=1, accumulation=1, clip=None, sharded=True)
        assert not caplog.records
        run_steps(model, opt, 0, steps=3, accumulation=2, clip=None, sharded=True)
    assert len(caplog.records) == 1 and "sums the micro-batches in the torch.bfloat16 gradient shard" in caplog.text
    assert "grad_accum_dtype fp32" in caplog.text


# ---- parameters that change trainability ------------------------------------------------------


@pytest.mark.parametrize("stage,offload", [(2, None), (2, "cpu"), (1, None)])
def test_parameters_unfrozen_later_are_trained_as_torch_does(stage, offload):
    """Progressive unfreezing on one process (see check_unfreezing for two ranks): the sharded
    optimizer, on the device or offloaded, ends with torch's AdamW's weights."""
    spec = OffloadSpec("cpu", chunk_numel=64) if offload else None
    reference, ours = make_model(), make_model()
    ref_opt = unfreezing_optimizer(reference, torch.optim.AdamW, lr=3e-2)
    opt = unfreezing_optimizer(ours, ShardedOptimizer, optim=torch.optim.AdamW, stage=stage, bucket_numel=300,
                               offload=spec, lr=3e-2)  # fmt: skip
    train_unfreezing(reference, ref_opt, 0, 1)
    head = train_unfreezing(ours, opt, 0, 1)
    assert max_diff(reference, ours) <= 1e-6
    assert all(torch.equal(a, b) for a, b in zip(head, ours[3].parameters()))
    assert len(opt.flats) == 3  # the head, then each group as it was unfrozen


def test_an_optimizer_with_every_parameter_frozen_is_accepted():
    model = make_model()
    model.requires_grad_(False)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, stage=2, lr=0.1)
    opt.step()  # nothing to step, as torch's
    assert opt.grad_norm() == 0.0 and opt.flats == []


# ---- the conventions of torch's optimizers and ZeroRedundancyOptimizer -----------------------


@pytest.mark.parametrize("optim,kwargs", [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    (torch.optim.AdamW, {"lr": 1e-2}),
    (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}),
])  # fmt: skip
def test_param_groups_and_state_dict_as_torch_fills_them(optim, kwargs):
    """Every default in param_groups, defaults and the consolidated state_dict, as torch's own
    optimizer has them; state_dict() unconsolidated raises (a RuntimeError, as
    ZeroRedundancyOptimizer's), except before the first step, where the empty state is whole."""
    reference, ours = make_model(), make_model()
    ref_opt = optim(groups(reference), **kwargs)
    opt = ShardedOptimizer(groups(ours), optim=optim, stage=2, **kwargs)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in ref_opt.param_groups]
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == hyper
    assert opt.defaults == ref_opt.defaults
    assert opt.param_groups[0]["weight_decay"] == 0.1 and "maximize" in opt.param_groups[1]
    assert opt.state_dict() == ref_opt.state_dict()  # nothing stepped: the empty state, on any rank
    train(reference, ref_opt, 2)
    train(ours, opt, 2)
    with pytest.raises(RuntimeError, match=r"not consolidated here: call consolidate_state_dict\(to=0\)"):
        opt.state_dict()
    opt.consolidate_state_dict(to=0)
    full, expected = opt.state_dict(), ref_opt.state_dict()
    assert full["param_groups"] == expected["param_groups"]
    assert full["state"].keys() == expected["state"].keys()
    for pid, state in expected["state"].items():
        assert full["state"][pid].keys() == state.keys()
        for key, value in state.items():
            assert torch.allclose(full["state"][pid][key], value, atol=1e-7), (pid, key)
    train(ours, opt, 1, start=2)
    with pytest.raises(NotConsolidatedError):  # stepped since: the consolidated state is stale, and gone
        opt.state_dict()


def test_accelerate_round_trip_reads_no_state(tmp_path, monkeypatch):
    """accelerate's prepare() does state_dict() -> move to the device -> load_state_dict() on the
    optimizer it wraps (AcceleratedOptimizer): on a fresh offloaded optimizer that reads and
    writes nothing of the store, and the optimizer still trains like torch's (AdamW's default
    weight decay included: offloaded, a default missing from the group once read as 0)."""
    from accelerate.optimizer import move_to_device

    reference, ours = make_model(), make_model()
    opt = ShardedOptimizer(ours.parameters(), optim=torch.optim.AdamW, stage=2, lr=1e-2,
                           offload=OffloadSpec("nvme", nvme_path=str(tmp_path)))  # fmt: skip
    touched = []
    for name in ("read", "write", "refresh_master"):
        monkeypatch.setattr(opt.stepper, name, lambda *args, name=name: touched.append(name))
    opt.load_state_dict(move_to_device(opt.state_dict(), torch.device("cpu")))
    assert touched == []
    monkeypatch.undo()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train(reference, ref_opt, 2)
    train(ours, opt, 2)
    assert max_diff(reference, ours) <= 1e-6
    opt.close()


def test_subclass_that_keeps_the_step_is_sharded():
    """A subclass of AdamW that only changes its defaults runs AdamW's update: accepted, and steps as
    itself unsharded. One with a step of its own, or another library's class that only shares a
    name, is refused (stepping flat shards might change its results)."""

    class WarmAdamW(torch.optim.AdamW):
        def __init__(self, params, lr=2e-2, **kwargs):
            super().__init__(params, lr=lr, weight_decay=0.05, **kwargs)

    class SignSGD(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad.sign(), alpha=-group["lr"])

    reference, ours = make_model(), make_model()
    ref_opt = WarmAdamW(reference.parameters())
    opt = ShardedOptimizer(ours.parameters(), optim=WarmAdamW, stage=2)
    train(reference, ref_opt, 2)
    train(ours, opt, 2)
    assert max_diff(reference, ours) <= 1e-6 and opt.param_groups[0]["weight_decay"] == 0.05
    with pytest.raises(ShardingError, match="cannot shard SignSGD: it replaces the step of SGD, its base"):
        ShardedOptimizer(make_model().parameters(), optim=SignSGD, lr=0.1)

    class AdamW(torch.optim.Optimizer):  # another library's, sharing only the name
        def __init__(self, params, lr=1e-3):
            super().__init__(params, {"lr": lr})

    with pytest.raises(ShardingError, match="cannot shard AdamW: it is not known"):
        ShardedOptimizer(make_model().parameters(), optim=AdamW)
    ShardedOptimizer(make_model().parameters(), optim=SignSGD, assume_elementwise=True, lr=0.1)  # on the user's word


# ---- a loaded "step", placed as torch places it ------------------------------------------------


def test_a_loaded_step_goes_where_torch_puts_it():
    """A resumed "step" (read from the checkpoint on the CPU, fp64 here) goes where torch's own
    load_state_dict puts it: for fused AdamW, fp32 on the parameters' device, where the fused CUDA
    kernel reads it; otherwise a CPU counter. The meta device stands in for a GPU."""
    for fused in (True, False):
        _check_loaded_step(fused)


def _check_loaded_step(fused):
    from trainer_shard.sharding.flat import FlatGroup
    from trainer_shard.sharding.on_device import OnDevice
    from trainer_shard.sharding.partition import plan_layout

    params = list(torch.nn.Linear(8, 4, device="meta").parameters())
    flat = FlatGroup(params, plan_layout([p.numel() for p in params], 1, 16), 0)
    stepper = OnDevice(torch.optim.AdamW, {"lr": 1e-3, "fused": fused})
    stepper.add(flat, {"lr": 1e-3, "fused": fused})
    stepper.set_scalar_state(0, {"step": torch.tensor(3.0, dtype=torch.float64)})
    steps = [stepper.optim.state[view]["step"] for view in flat.master_views]
    assert len(steps) == 2 and steps[0] is not steps[1]  # each bucket counts on its own copy
    for step in steps:
        assert (step.device.type, step.dtype) == (("meta", torch.float32) if fused else ("cpu", torch.float64))
