"""One rank of one `bench/zero3.py` row: a plain PyTorch training loop (no Trainer).

    python -m torch.distributed.run --nproc_per_node 2 bench/_zero3_worker.py ROW MODEL STEPS RESULT_DIR

ROW is ddp | zero2 | zero3 | fsdp2 | fsdp2_mmap | deepspeed_zero3; MODEL is t5-small | t5-base (the
architecture, random init, seed 0, dropout 0). Every row sees the same batches: random token
ids of a fixed shape (batch 8 per rank, source and target length 64), rank r at step s drawing
from a generator seeded with (r, s % CYCLE), so the loss falls as the model learns the cycle.
Writes RESULT_DIR/rankR.json.
"""

import json
import resource
import sys
import time
from pathlib import Path
from statistics import median

import torch
import torch.distributed as dist

WARMUP = 2
BATCH, LENGTH, CYCLE = 8, 64, 4
LR, WEIGHT_DECAY, CLIP = 3e-4, 0.01, 1.0

ARCH = {  # the t5-small / t5-base architectures (Raffel et al., the hub configs), vocab 32128
    "t5-small": dict(d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64),
    "t5-base": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12, d_kv=64),
    "tiny": dict(d_model=64, d_ff=128, num_layers=2, num_heads=2, d_kv=32),  # smoke tests of the bench itself
}


def clipped_step(model, opt):
    """backward, clip by the global norm (torch's), step, zero: the DDP and FSDP2 rows' step."""

    def step(loss):
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()

    return step

def status_bytes(key: str) -> int:
    """VmHWM / VmRSS from /proc/self/status, in bytes (ru_maxrss where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux: `5` into clear_refs), so a later VmHWM is the
    peak of what ran after this point; False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def build_model(name: str):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=32128, dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                      **ARCH[name])  # fmt: skip
    return T5ForConditionalGeneration(config)


def batch(rank: int, step: int, vocab: int) -> dict:
    g = torch.Generator().manual_seed(1000 * (rank + 1) + step % CYCLE)
    source = torch.randint(2, vocab, (BATCH, LENGTH), generator=g)
    labels = torch.randint(2, vocab, (BATCH, LENGTH), generator=g)
    return {"input_ids": source, "attention_mask": torch.ones_like(source), "labels": labels}


def nbytes(t) -> int:
    return t.numel() * t.element_size()


def setup(row: str, model):
    """(module to call, step function(loss), parameter bytes function, notes) for the row."""
    from transformers.models.t5.modeling_t5 import T5Block

    notes = {}
    if row == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        module = DDP(model)
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)

        step = clipped_step(model, opt)

        def param_bytes():
            return {"total": sum(nbytes(p) for p in model.parameters())}

        return module, step, param_bytes, notes
    if row in ("zero2", "zero3"):  # zero3: what the Trainer's --sharded_ddp "zero_dp_3 auto_wrap" builds
        from trainer_shard.sharding import ShardedOptimizer, shard_model

        sharded = shard_model(model, units=[T5Block]) if row == "zero3" else None
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2 if sharded is None else 3, fused=True, lr=LR,
                               weight_decay=WEIGHT_DECAY)  # fmt: skip

        def step(loss):
            loss.backward()
            opt.clip_grad_norm(CLIP)
            opt.step()
            opt.zero_grad()

        def param_bytes():
            if sharded is not None:
                held = sharded.held_parameter_bytes()
                return {"total": held["shards"] + held["masters"] + held["persistent"], **held}
            shards = opt.shard_bytes()
            return {"total": sum(nbytes(p) for p in model.parameters()),
                    **{f"engine_{k}": v for k, v in shards.items() if isinstance(v, int)}}  # fmt: skip

        return model, step, param_bytes, notes
    if row in ("fsdp2", "fsdp2_mmap"):  # fsdp2_mmap: the same, the driver sets MALLOC_MMAP_THRESHOLD_
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for m in model.modules():
            if isinstance(m, T5Block):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        except Exception as e:  # noqa: BLE001 - recorded, then the default implementation
            notes["optimizer"] = f"fused AdamW refused ({type(e).__name__}: {e}); default AdamW"
            opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

        step = clipped_step(model, opt)

        def param_bytes():
            return {"total": sum(nbytes(p.to_local() if hasattr(p, "to_local") else p) for p in model.parameters())}

        return model, step, param_bytes, notes
    if row == "deepspeed_zero3":
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP,
            "zero_optimization": {"stage": 3},  # no offload; fp32 (no bf16/fp16 section)
            "zero_allow_untested_optimizer": True,  # torch's fused AdamW, as in the other rows
            "steps_per_print": 10**9,
        }
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        notes["optimizer"] = type(engine.optimizer).__name__ + " around " + type(getattr(engine.optimizer, "optimizer", opt)).__name__

        def step(loss):
            engine.backward(loss)
            engine.step()

        def param_bytes():
            shards = sum(nbytes(p.ds_tensor) for p in model.parameters() if hasattr(p, "ds_tensor"))
            persistent = sum(nbytes(p) for p in model.parameters() if getattr(p, "ds_persist", False))
            return {"total": shards + persistent, "ds_tensor": shards, "persistent_whole": persistent}

        return engine, step, param_bytes, notes
    raise SystemExit(f"unknown row {row!r}")


def main() -> None:
    row, model_name, steps, result_dir = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    if row == "deepspeed_zero3":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        model = build_model(model_name)
        n_params = sum(p.numel() for p in model.parameters())
        vocab = model.config.vocab_size
        peak_setup = status_bytes("VmHWM")
        module, step, param_bytes, notes = setup(row, model)
        peak_after_setup = status_bytes("VmHWM")
        dist.barrier()
        reset_ok = reset_peak()
        times, losses = [], []
        for s in range(WARMUP + steps):
            b = batch(rank, s, vocab)
            dist.barrier()
            started = time.perf_counter()
            loss = module(**b).loss
            step(loss)
            times.append(time.perf_counter() - started)
            losses.append(loss.item())
        held = param_bytes()
        last = torch.tensor([losses[-1], losses[0]], dtype=torch.float64)
        dist.all_reduce(last)
        last /= dist.get_world_size()
        result = {
            "row": row,
            "rank": rank,
            "model": model_name,
            "parameters": n_params,
            "threads": torch.get_num_threads(),
            "step_times": times,
            "median_step_s": median(times[WARMUP:]),
            "peak_rss_bytes": max(status_bytes("VmHWM"), peak_after_setup),
            "peak_rss_loop_bytes": status_bytes("VmHWM") if reset_ok else None,
            "peak_rss_build_bytes": peak_setup,
            "rss_end_bytes": status_bytes("VmRSS"),
            "param_bytes": held,
            "losses": losses,
            "first_loss_mean": float(last[1]),
            "final_loss_mean": float(last[0]),
            "notes": notes,
        }
        result_dir.mkdir(parents=True, exist_ok=True)
        (result_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
