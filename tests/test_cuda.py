"""The CUDA paths: run where a GPU is present (NCCL with two), skipped cleanly elsewhere."""

from types import SimpleNamespace

import pytest
import torch

from trainer_shard.sharding import ShardedOptimizer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def make(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).cuda().to(dtype)


@cuda
@pytest.mark.parametrize("stage", [1, 2])
def test_one_gpu_matches_the_local_optimizer(stage):
    reference, ours = make(torch.float32), make(torch.float32)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    opt = ShardedOptimizer(ours.parameters(), optim=torch.optim.AdamW, stage=stage, bucket_numel=1000, lr=1e-2)
    for _ in range(3):
        x = torch.randn(16, 32, device="cuda")
        for model, o in ((reference, ref_opt), (ours, opt)):
            model(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert all(flat.grad.is_cuda for flat in opt.flats)
    for p, q in zip(reference.parameters(), ours.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


@cuda
def test_bf16_on_gpu_keeps_fp32_masters():
    model = make(torch.bfloat16)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=2, lr=1e-2)
    model(torch.randn(4, 32, device="cuda", dtype=torch.bfloat16)).float().square().mean().backward()
    opt.step()
    assert opt.flats[0].master.dtype == torch.float32 and opt.flats[0].master.is_cuda


@cuda
@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offload_from_gpu_matches_no_offload(tmp_path, device, dtype):
    """Parameters and gradient shard on the GPU, master and moments in pinned RAM or on disk:
    chunks cross on the side stream (small chunks and 2 slots, so copies and steps interleave)."""
    from trainer_shard.offload import OffloadSpec

    spec = OffloadSpec(device, nvme_path=str(tmp_path) if device == "nvme" else None, pin_memory=True,
                       buffer_count=2, chunk_numel=300)  # fmt: skip
    reference, ours = make(dtype), make(dtype)
    ref_opt = ShardedOptimizer(reference.parameters(), optim=torch.optim.AdamW, stage=2, lr=1e-2)
    opt = ShardedOptimizer(ours.parameters(), optim=torch.optim.AdamW, stage=2, lr=1e-2, offload=spec)
    assert opt.stepper.store.__class__.__name__ != "CpuStore" or opt.stepper.store.pinned
    for _ in range(3):
        x = torch.randn(16, 32, device="cuda", dtype=dtype)
        for model, o in ((reference, ref_opt), (ours, opt)):
            model(x).float().square().mean().backward()
            o.clip_grad_norm(0.5)
            o.step()
            o.zero_grad()
    assert opt.flats[0].grad.is_cuda and opt.flats[0].buffer.is_cuda
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2  # bf16: the gradient shard accumulates in bf16
    for p, q in zip(reference.parameters(), ours.parameters()):
        assert torch.allclose(p.float(), q.float(), atol=tolerance)
    opt.close()


def _steps(model, opt, xs):
    for x in xs:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


@cuda
@pytest.mark.parametrize("fused", [True, False])
def test_resume_keeps_step_where_torch_keeps_it(tmp_path, fused):
    """Resumed from optimizer shards (the Trainer's checkpoints, read on the CPU), AdamW finds its
    "step" where torch's load_state_dict puts it: on the GPU for the fused kernel (which fails on
    a CPU step), a CPU counter otherwise; the resumed run ends where the uninterrupted one does."""
    from trainer_shard.sharding import state_io

    torch.manual_seed(1)
    xs = [torch.randn(16, 32, device="cuda") for _ in range(4)]
    straight = make(torch.float32)
    opt = ShardedOptimizer(straight.parameters(), optim=torch.optim.AdamW, stage=2, lr=1e-2, fused=fused)
    _steps(straight, opt, xs[:2])
    state_io.save_shards(opt, tmp_path / "shards", state_io.param_names(straight))
    resumed = make(torch.float32)  # step-0 weights: the shards' masters replace them
    again = ShardedOptimizer(resumed.parameters(), optim=torch.optim.AdamW, stage=2, lr=1e-2, fused=fused)
    state_io.load_shards(again, tmp_path / "shards", state_io.param_names(resumed))
    steps = [again.optim.state[v]["step"] for v in again.flats[0].master_views]
    assert all(s.device.type == ("cuda" if fused else "cpu") for s in steps)
    _steps(resumed, again, xs[2:])
    _steps(straight, opt, xs[2:])
    for p, q in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


@cuda
def test_zero_dp_2_offload_pins_its_cpu_store():
    """`--sharded_ddp "zero_dp_2 offload"` on a GPU: the CPU store is page-locked, as the README says."""
    from trainer_shard import ShardedDDPOption
    from trainer_shard.training import plan

    args = SimpleNamespace(sharded_ddp=[ShardedDDPOption("zero_dp_2"), ShardedDDPOption("offload")])
    stage, spec = plan.plan(args, None)
    model = make(torch.bfloat16)
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=stage, lr=1e-2, offload=spec)
    assert opt.stepper.store.pinned and all(t.is_pinned() for t in opt.stepper.store._tensors.values())
    _steps(model, opt, [torch.randn(4, 32, device="cuda", dtype=torch.bfloat16)])
    opt.close()
