"""One row of bench/infinity.py, in its own process (its peak RSS is its own); prints one JSON line.

    python bench/_infinity_worker.py ROW ARCH --steps N --work DIR [--checkpoint DIR] [--compute_dtype auto|bf16|fp32]

Rows (one process, a plain training loop, no Trainer; one batch of random tokens every step, so
the loss falls as the model fits it; fused AdamW lr 1e-4 weight decay 0.01, gradient clipping at 1.0):
- plain_fp32: the model in fp32, torch.optim.AdamW(fused=True) on the whole model;
- zero2_disk: the model in bf16, ShardedOptimizer(stage=2) with fp32 master weights and moments
  on disk (offload_optimizer nvme): today's best before parameter offload;
- zero3_disk: built on the meta device, shard_model(units=[T5Block]) with the bf16 parameters and
  gradients on disk (offload_param nvme, max_in_cpu 0, buffer_count 5), weights from --checkpoint
  a tensor at a time (else generated a tensor at a time, RandomT5Weights), and
  ShardedOptimizer(stage=3) with master weights and moments on disk;
- zero3_fwd_bwd: as zero3_disk without an optimizer: one forward and backward, the gradients
  written to the parameter store (for architectures whose Adam state has no room on disk).
The bf16 rows compute in --compute_dtype as the Trainer does (`compute.ComputeCast`, one T5Block
cast to fp32 while it runs, where fp32 is chosen).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARCHS = {  # the published architectures' sizes (vocabulary 32128)
    "t5-large": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16, d_kv=64),
    "t5-3b": dict(d_model=1024, d_ff=16384, num_layers=24, num_heads=32, d_kv=128),
    "t5-11b": dict(d_model=1024, d_ff=65536, num_layers=24, num_heads=128, d_kv=128),
    "tiny": dict(d_model=64, d_ff=256, num_layers=2, num_heads=4, d_kv=16),  # a smoke test of the script
}
BATCH = {"t5-large": (4, 64), "t5-3b": (2, 32), "t5-11b": (1, 32), "tiny": (2, 16)}  # (rows, tokens) a step


def config_of(arch: str):
    from transformers import T5Config

    return T5Config(vocab_size=32128, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                    **ARCHS[arch])  # fmt: skip


def peak_rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def stats(stores) -> dict:
    out = {"read_bytes": 0, "write_bytes": 0, "read_seconds": 0.0, "write_seconds": 0.0}
    for store in stores:
        for k in out:
            out[k] += store.stats[k]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("row")
    parser.add_argument("arch", choices=ARCHS)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--work", required=True)
    parser.add_argument("--checkpoint")
    parser.add_argument("--compute_dtype", default="auto", choices=["auto", "bf16", "fp32"],
                        help="the bf16 rows' matrix products, as the Trainer's flag "
                        "(auto: fp32 on a CPU without bf16 kernels)")  # fmt: skip
    args = parser.parse_args()
    from transformers import T5ForConditionalGeneration
    from transformers.models.t5.modeling_t5 import T5Block

    from trainer_shard.compute import ComputeCast, choose_compute_dtype, dtype_name
    from trainer_shard.demo import RandomT5Weights
    from trainer_shard.offload import OffloadSpec
    from trainer_shard.offload.param_store import ParamOffloadSpec
    from trainer_shard.sharding import ShardedOptimizer, shard_model
    from trainer_shard.sharding.zero3_weights import checkpoint_weights

    work = Path(args.work)
    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous", rank=0, world_size=1)
    config = config_of(args.arch)
    rows, tokens = BATCH[args.arch]
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(2, 32128, (rows, tokens), generator=generator)]
    hyper = dict(lr=1e-4, weight_decay=0.01)
    began = time.perf_counter()
    stores, sharded, opt = [], None, None
    if args.row == "plain_fp32":
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(config)
        opt = torch.optim.AdamW(model.parameters(), fused=True, **hyper)
    elif args.row == "zero2_disk":
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        model = T5ForConditionalGeneration(config)
        torch.set_default_dtype(torch.float32)
        opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=2,
                               offload=OffloadSpec("nvme", nvme_path=str(work / "optim")), **hyper)  # fmt: skip
        stores = [opt.stepper.store]
    else:
        with torch.device("meta"):
            model = T5ForConditionalGeneration(config).to(torch.bfloat16)
        weights = checkpoint_weights(args.checkpoint) if args.checkpoint else RandomT5Weights(config, torch.bfloat16)
        # t5-11b's decoder block is 268 M elements (0.5 GB in bf16): three units' buffers at most
        spec = ParamOffloadSpec("nvme", nvme_path=str(work / "params"), max_in_cpu=0,
                                buffer_count=3 if args.arch == "t5-11b" else 5, buffer_size=10**10)  # fmt: skip
        sharded = shard_model(model, units=[T5Block], weights=weights, param_offload=spec)
        if args.checkpoint:
            weights.close()
        stores = [sharded.store.disk]
        if args.row == "zero3_disk":
            opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=3,
                                   offload=OffloadSpec("nvme", nvme_path=str(work / "optim")), **hyper)  # fmt: skip
            stores.append(opt.stepper.store)
        else:
            for part in sharded.parts:
                part.configure(offloaded=True)  # the gradients go to the parameter store
    compute, cast, notes = "fp32", None, {"kernels": f"bf16 kernels: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}"
                                          + (f" (ONEDNN_MAX_CPU_ISA={os.environ['ONEDNN_MAX_CPU_ISA']})"
                                             if os.environ.get("ONEDNN_MAX_CPU_ISA") else "")}  # fmt: skip
    if args.row != "plain_fp32":  # bf16 parameters: computed as the Trainer would (compute.ComputeCast)
        dtype, line = choose_compute_dtype(args.compute_dtype, torch.bfloat16, "cpu")
        compute, notes["compute"] = dtype_name(dtype), line
        print(line, file=sys.stderr, flush=True)
        if dtype == torch.float32:
            units = [m for m in model.modules() if isinstance(m, T5Block)]
            cast = ComputeCast(model, dtype, units=units,
                               ensure_ready=sharded.gather_for_backward if sharded is not None else None)  # fmt: skip
    build_seconds = time.perf_counter() - began
    model.train()
    times, losses, io = [], [], []
    steps = 1 if args.row == "zero3_fwd_bwd" else args.steps
    for step in range(steps):
        ids = batches[step % len(batches)]
        before = stats(stores)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if opt is not None:
            if isinstance(opt, ShardedOptimizer):
                opt.clip_grad_norm(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
        after = stats(stores)
        io.append({k: after[k] - before[k] for k in after})
        print(f"step {step}: {times[-1]:.2f} s, loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    result = {"row": args.row, "arch": args.arch, "parameters": sum(p.numel() for p in model.parameters()),
              "build_seconds": build_seconds, "step_seconds": times, "losses": losses, "io": io,
              "peak_rss": peak_rss(), "compute": compute, "notes": notes}  # fmt: skip
    if cast is not None:
        result["compute_pool_bytes"] = cast.pool_bytes()
        cast.remove()
    if sharded is not None:
        result["on_disk"] = sharded.held_parameter_bytes()["on_disk"]
    if isinstance(opt, ShardedOptimizer):
        opt.close()
    if sharded is not None:
        sharded.close()
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
