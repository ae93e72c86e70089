"""The offload engine under ShardedOptimizer: same weights as without offload, on 1 and 2 ranks."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from distributed import spawn
from test_sharded_optimizer import groups, make_model, run_steps
from trainer_shard.offload import OffloadSpec, OffloadStoreError
from trainer_shard.sharding import DynamicLossScaler, ShardedOptimizer


def spec(kind, tmp, chunk=97, buffers=2):
    if kind == "cpu":
        return OffloadSpec("cpu", chunk_numel=chunk, buffer_count=buffers)
    return OffloadSpec("nvme", nvme_path=str(tmp), chunk_numel=chunk, buffer_count=buffers)


def train(rank, offload, *, stage=2, dtype=torch.float32, optim=torch.optim.AdamW, ddp=False, clip=0.5, **hyper):
    model = make_model(dtype=dtype)
    hyper = hyper or {"lr": 3e-2, "fused": True}
    opt = ShardedOptimizer(groups(model), optim=optim, stage=stage, bucket_numel=300, offload=offload, **hyper)
    wrapped = DDP(model) if ddp else model
    losses = run_steps(wrapped, opt, rank, steps=4, accumulation=2, clip=clip, sharded=True)
    return model, opt, losses


def max_diff(a, b):
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
@pytest.mark.parametrize("chunk,buffers", [(97, 1), (64, 2), (10_000, 4)])
@pytest.mark.parametrize("clip", [0.5, None])
def test_one_process_offload_equals_no_offload(tmp_path, kind, chunk, buffers, clip):
    """Chunks that cut through buckets and parameters, one or several buffer sets: the same step.

    Without clipping, bit for bit when chunks are a multiple of the vector width; a ragged chunk
    (97) moves a few elements from torch's vectorized loop to its scalar tail: at most an ulp
    (measured 1.5e-8). With clipping, the offloaded kernel divides by 1 / the coefficient (its
    `grad_scale`) where the reference multiplies by it: an ulp apart (measured 2.4e-7 after 4 steps).
    """
    reference, ref_opt, ref_losses = train(0, None, clip=clip)
    model, opt, losses = train(0, spec(kind, tmp_path / "store", chunk, buffers), clip=clip)
    exact = not (chunk % 16 or clip)
    # loss and clipped grad norm at every step: equal where the weights are, else as close as
    # an ulp of the weights allows (this machine's kernels: 2.4e-7 relative at step 3)
    flat, ref_flat = [v for pair in losses for v in pair], [v for pair in ref_losses for v in pair]
    assert flat == ref_flat if exact else flat == pytest.approx(ref_flat, rel=1e-6)
    assert max_diff(model, reference) <= (0.0 if exact else 1e-6)
    assert max_diff(model, make_model()) > 1e-3  # the steps moved the weights
    saved = opt.local_state_dict()
    assert sorted(saved["inner"][0]) == ["exp_avg", "exp_avg_sq", "step"]
    ref_state = [ref_opt.optim.state[v]["exp_avg_sq"] for v in ref_opt.flats[0].master_views]
    assert torch.allclose(saved["inner"][0]["exp_avg_sq"], torch.cat(ref_state), rtol=1e-5, atol=1e-12)
    assert opt.shard_bytes()["offload_device"] == ("disk" if kind == "nvme" else "cpu")
    opt.close()
    assert not (tmp_path / "store").exists()  # a disk store deletes its files


@pytest.mark.parametrize("buffers", [1, 3])
def test_disk_chunks_stepped_on_mapped_pages(tmp_path, monkeypatch, buffers):
    """Chunks of whole pages (1024 fp32) are stepped on the store files' own pages, mapped
    ([Note: stepping on mapped pages]): the same weights as without offload, bit for bit, and
    the same bits as the copies path (`TRAINER_SHARD_NO_MMAP=1`) with clipping on; the state read
    back with `pread` (a checkpoint) is the reference optimizer's; at most one chunk more than
    the buffer sets is mapped at once, and none is left mapped."""
    from trainer_shard.offload.store import DiskStore

    mapped = {"calls": 0, "now": 0, "most": 0}
    store_map, store_unmap = DiskStore.map, DiskStore.unmap

    def watched_map(self, name, start, numel):
        got = store_map(self, name, start, numel)
        mapped["calls"] += 1
        mapped["now"] += 1
        mapped["most"] = max(mapped["most"], mapped["now"])
        return got

    def watched_unmap(self, mapping):
        mapped["now"] -= 1
        store_unmap(self, mapping)

    monkeypatch.setattr(DiskStore, "map", watched_map)
    monkeypatch.setattr(DiskStore, "unmap", watched_unmap)
    reference, ref_opt, ref_losses = train(0, None, clip=None)
    model, opt, losses = train(0, spec("nvme", tmp_path / "store", 1024, buffers), clip=None)
    assert losses == ref_losses and max_diff(model, reference) == 0.0
    saved = opt.local_state_dict()
    ref_state = [ref_opt.optim.state[v]["exp_avg_sq"] for v in ref_opt.flats[0].master_views]
    assert torch.allclose(saved["inner"][0]["exp_avg_sq"], torch.cat(ref_state), rtol=1e-5, atol=1e-12)
    opt.close()
    # 3 names x 4 chunks (2978 + 83 elements) x 4 steps, every one mapped; in flight at most
    # the chunk stepped, the one read ahead and those being written back
    assert mapped["calls"] == 3 * 4 * 4 and mapped["now"] == 0 and 3 <= mapped["most"] <= 3 * (buffers + 1)
    clipped, clipped_opt, clipped_losses = train(0, spec("nvme", tmp_path / "store", 1024, buffers), clip=0.5)
    clipped_opt.close()
    monkeypatch.setenv("TRAINER_SHARD_NO_MMAP", "1")
    calls = mapped["calls"]
    copied, copied_opt, copied_losses = train(0, spec("nvme", tmp_path / "store", 1024, buffers), clip=0.5)
    copied_opt.close()
    assert mapped["calls"] == calls  # the copies path maps nothing
    assert clipped_losses == copied_losses and max_diff(clipped, copied) == 0.0
    assert max_diff(clipped, make_model()) > 1e-3


def test_offload_runs_any_elementwise_optimizer(tmp_path):
    """SGD with momentum: state made at step 1 (momentum_buffer = grad), kept in the store after."""
    hyper = {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01}
    reference, _, _ = train(0, None, optim=torch.optim.SGD, **hyper)
    model, opt, _ = train(0, spec("nvme", tmp_path), optim=torch.optim.SGD, **hyper)
    assert opt.stepper.state_names == ["momentum_buffer"]
    assert max_diff(model, reference) == 0.0


def test_offload_bf16_keeps_a_16_bit_gradient_shard_and_fp32_master(tmp_path):
    reference, _, _ = train(0, None, dtype=torch.bfloat16)
    model, opt, _ = train(0, spec("cpu", tmp_path), dtype=torch.bfloat16)
    assert opt.flats[0].grad.dtype == torch.bfloat16 and opt.flats[0].master is None
    assert opt.stepper.store.sizes["0.master"] == opt.flats[0].layout.shard_numel
    # The only difference from the bf16 run without offload: gradients accumulate in bf16 (as
    # autograd's own .grad does) instead of fp32. Measured here: at most 2 bf16 ulps after 4 steps.
    diff = max_diff(model, reference)
    assert diff < 2e-2, diff


def test_fp16_loss_scale_unscales_in_fp32(tmp_path):
    """A gradient of 1e-7, scaled by 2**10 for backward: unscaled in fp16 it would be a subnormal
    (1.19e-7, 19% off); the engine unscales each chunk in fp32, so the fp32 master moves by 1e-7."""
    model = torch.nn.Linear(4, 1, bias=False).half()
    torch.nn.init.zeros_(model.weight)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.SGD, stage=2, lr=1.0,
                           loss_scaler=DynamicLossScaler(init_scale=2.0**10), offload=spec("cpu", tmp_path))  # fmt: skip
    loss = model(torch.ones(1, 4, dtype=torch.float16)).sum() * 1e-7
    opt.loss_scaler.scale_loss(loss).backward()
    opt.step()
    master = opt.master_shard(0)[:4]
    assert torch.allclose(master, torch.full_like(master, -1e-7), rtol=1e-2), master


def test_parameters_loaded_from_outside_are_followed(tmp_path):
    model, opt, _ = train(0, spec("nvme", tmp_path), dtype=torch.bfloat16)
    fresh = make_model(seed=1, dtype=torch.bfloat16)
    model.load_state_dict(fresh.state_dict())  # as load_best_model_at_end does
    for p in model.parameters():
        p.grad = None
    opt.prepare_grads()
    opt.step()  # zero gradient: AdamW moves weights only by decay and momentum, from the *new* weights
    assert max_diff(model, fresh) < 0.05
    opt.close()


def test_disk_store_too_big_fails_before_anything_is_written(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 100, 100))
    with pytest.raises(OffloadStoreError, match=r"needs [\d,]+ bytes in .*store/rank0.* but only 100 are free"):
        train(0, spec("nvme", tmp_path / "store"))
    assert not (tmp_path / "store").exists()


def check_two_ranks(rank, world_size, kind, stage, tmp):
    reference, ref_opt, ref_losses = train(rank, None, stage=stage, ddp=stage == 1)
    model, opt, losses = train(rank, spec(kind, tmp), stage=stage, ddp=stage == 1)
    assert losses == ref_losses
    assert max_diff(model, reference) <= 1e-6
    # Checkpoint round trip: the consolidated state loads into a fresh offloaded optimizer.
    opt.consolidate_state_dict(to=0)
    full = [opt.state_dict() if rank == 0 else None]
    dist.broadcast_object_list(full, src=0)
    ref_opt.consolidate_state_dict(to=0)
    if rank == 0:
        ours, theirs = full[0], ref_opt.state_dict()
        for pid, state in theirs["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.allclose(ours["state"][pid][key], state[key], rtol=1e-5, atol=1e-9), (pid, key, (ours["state"][pid][key] - state[key]).abs().max())
    clone = make_model()
    clone.load_state_dict(model.state_dict())
    again = ShardedOptimizer(groups(clone), optim=torch.optim.AdamW, stage=stage, bucket_numel=300,
                             offload=spec(kind, f"{tmp}-again"), lr=3e-2, fused=True)  # fmt: skip
    again.load_state_dict(full[0])
    run_steps(DDP(clone) if stage == 1 else clone, again, rank, steps=1, accumulation=1, sharded=True)
    run_steps(DDP(model) if stage == 1 else model, opt, rank, steps=1, accumulation=1, sharded=True)
    assert max_diff(clone, model) == 0.0
    opt.close()
    again.close()


@pytest.mark.multiproc
@pytest.mark.parametrize("kind,stage", [("cpu", 1), ("cpu", 2), ("nvme", 2)])
def test_two_ranks_offload_equals_no_offload(tmp_path, kind, stage):
    spawn(check_two_ranks, 2, kind, stage, str(tmp_path / "store"))
    assert not (tmp_path / "store").exists()


def test_fp32_gradient_shard_makes_bf16_offload_equal_no_offload(tmp_path):
    """grad_accum_dtype fp32: accumulation (2 micro-batches here) in fp32, as without offload."""
    reference, _, _ = train(0, None, dtype=torch.bfloat16)
    model = make_model(dtype=torch.bfloat16)
    opt = ShardedOptimizer(groups(model), optim=torch.optim.AdamW, stage=2, bucket_numel=300, offload=spec("cpu", tmp_path, 64),
                           grad_dtype=torch.float32, lr=3e-2, fused=True)  # fmt: skip
    run_steps(model, opt, 0, steps=4, accumulation=2, clip=0.5, sharded=True)
    assert opt.flats[0].grad.dtype == torch.float32
    assert max_diff(model, reference) == 0.0


def test_zero_dp_2_offload_asks_for_a_pinned_store_when_cuda_is_present(monkeypatch):
    """`--sharded_ddp "zero_dp_2 offload"` (no config): the CPU store is page-locked where CUDA is,
    so chunks cross to and from the GPU asynchronously, as the README says; not without CUDA."""
    from types import SimpleNamespace

    from trainer_shard import ShardedDDPOption
    from trainer_shard.training import plan

    args = SimpleNamespace(sharded_ddp=[ShardedDDPOption("zero_dp_2"), ShardedDDPOption("offload")])
    for cuda in (True, False):
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        assert plan.plan(args, None) == (2, OffloadSpec("cpu", pin_memory=cuda))


@pytest.mark.parametrize("kind", ["cpu", "nvme"])
@pytest.mark.parametrize("buffers", [1, 2])
def test_one_staging_slot_steps_each_chunk_with_its_own_gradient(tmp_path, monkeypatch, kind, buffers):
    """CUDA's gradient staging emulated on the CPU: `fetch_grad` copies the chunk into its slot's
    staging buffer at once (a non-blocking copy that has landed before the step reads it), and
    the one-pass kernel steps from that buffer. With one slot (`buffer_count: 1`) the next chunk's
    copy used to be started before the step, so each chunk was stepped with the next one's
    gradient; now it is started after: the same weights as without offload, bit for bit."""
    from trainer_shard.offload import cpu_adam, engine

    if not cpu_adam.available():
        pytest.skip(f"the one-pass kernel is not built here: {cpu_adam.build_error()}")
    copies = []

    class StagedOnCpu(engine._DeviceLink):
        def fetch_grad(self, source, slot):
            if not hasattr(self, "stage"):
                self.stage = [torch.empty(self.chunk_numel, dtype=source.dtype) for _ in range(self.slots)]
            self.pending[slot] = self.stage[slot][: source.numel()].copy_(source)
            copies.append(slot)

    monkeypatch.setattr(engine, "_DeviceLink", StagedOnCpu)
    monkeypatch.setattr(engine.OffloadEngine, "_step_in_place", lambda *args: False)  # as on CUDA: chunk by chunk
    reference, _, ref_losses = train(0, None, clip=None)
    model, opt, losses = train(0, spec(kind, tmp_path / "store", 64, buffers), clip=None)
    opt.close()
    assert len(copies) > 4 * 2 and set(copies) == set(range(buffers))  # 4 steps, several chunks each
    assert losses == ref_losses and max_diff(model, reference) == 0.0
