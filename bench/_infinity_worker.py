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


def blocks_compute_seconds(config, rows: int, tokens: int, frozen: bool) -> dict:
    """The forward and backward compute of the model's units without any I/O: one encoder and one
    decoder T5Block in RAM (bf16, random weights; frozen: no weight gradients, as LoRA's base),
    each timed (median of 3 after a warm-up) and counted num_layers times, plus the tied
    embedding's output product."""
    import copy
    import time
    from statistics import median

    import torch
    from transformers.models.t5.modeling_t5 import T5Block

    def timed(fn):
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return median(times)

    torch.manual_seed(0)
    decoder_config = copy.deepcopy(config)
    decoder_config.is_decoder = True
    encoder, decoder = T5Block(config, has_relative_attention_bias=True), T5Block(decoder_config, True)
    for block in (encoder, decoder):
        block.to(torch.bfloat16).requires_grad_(not frozen)
    hidden = torch.randn(rows, tokens, config.d_model, dtype=torch.bfloat16)
    head = torch.randn(config.vocab_size, config.d_model, dtype=torch.bfloat16)

    def run(block, **kwargs):
        x = hidden.clone().requires_grad_(True)
        block(x, **kwargs)[0].float().sum().backward()

    enc = timed(lambda: run(encoder))
    dec = timed(lambda: run(decoder, encoder_hidden_states=hidden))

    def logits():
        x = hidden.clone().requires_grad_(True)
        (x @ head.t()).float().sum().backward()

    out = timed(logits)
    return {"encoder_block": enc, "decoder_block": dec, "logits": out,
            "total": config.num_layers * enc + config.num_decoder_layers * dec + out}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("row")
    parser.add_argument("arch", choices=ARCHS)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--work", required=True)
    parser.add_argument("--checkpoint")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank on q and v (PEFT); 0: full fine-tuning")
    parser.add_argument("--compute-bound", action="store_true",
                        help="also time one encoder and one decoder block's forward and backward in RAM")
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
    from trainer_shard.memory import map_large_blocks
    from trainer_shard.sharding import ShardedOptimizer, shard_model
    from trainer_shard.sharding.zero3_weights import checkpoint_weights
    from trainer_shard.training.stage3 import PeftNames

    work = Path(args.work)
    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous", rank=0, world_size=1)
    config = config_of(args.arch)
    rows, tokens = BATCH[args.arch]
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(2, 32128, (rows, tokens), generator=generator)]
    hyper = dict(lr=1e-4, weight_decay=0.01)
    began = time.perf_counter()
    stores, sharded, opt = [], None, None
    lora = args.lora > 0

    def peft(model):  # LoRA r on q and v, as finetune_trainer.py --use_peft --lora_target_modules q v makes it
        if not lora:
            return model
        from types import SimpleNamespace

        from trainer_shard.finetune import apply_peft

        flags = SimpleNamespace(lora_r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
                                lora_target_modules=["q", "v"], lora_modules_to_save=None)  # fmt: skip
        return apply_peft(model, flags, seed=0)

    def trainable(model):
        return [p for p in model.parameters() if p.requires_grad]

    if args.row == "plain_fp32":
        torch.manual_seed(0)
        model = peft(T5ForConditionalGeneration(config))
        opt = torch.optim.AdamW(trainable(model), fused=True, **hyper)
    elif args.row in ("zero2_disk", "zero2", "zero3"):
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        model = T5ForConditionalGeneration(config)
        torch.set_default_dtype(torch.float32)
        model = peft(model)
        model.to(torch.bfloat16)
        offload = OffloadSpec("nvme", nvme_path=str(work / "optim")) if args.row == "zero2_disk" else None
        if args.row == "zero3":
            sharded = shard_model(model, units=[T5Block])
        opt = ShardedOptimizer(trainable(model), optim=torch.optim.AdamW, stage=2 if sharded is None else 3, offload=offload,
                               **hyper)  # fmt: skip
        stores = [opt.stepper.store] if offload is not None else []
    else:
        with torch.device("meta"):
            model = T5ForConditionalGeneration(config).to(torch.bfloat16)
        model = peft(model)
        model.to(torch.bfloat16)
        weights = checkpoint_weights(args.checkpoint) if args.checkpoint else RandomT5Weights(config, torch.bfloat16)
        # t5-11b's decoder block is 268 M elements (0.5 GB in bf16): three units' buffers at most
        spec = ParamOffloadSpec("nvme", nvme_path=str(work / "params"), max_in_cpu=0,
                                buffer_count=3 if args.arch == "t5-11b" else 5, buffer_size=10**10)  # fmt: skip
        sharded = shard_model(model, units=[T5Block], weights=PeftNames(weights) if lora else weights,
                              param_offload=spec)  # fmt: skip
        if args.checkpoint:
            weights.close()
        stores = [sharded.store.disk]
        if args.row == "zero3_disk":
            opt = ShardedOptimizer(trainable(model), optim=torch.optim.AdamW, stage=3,
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
            notes["heap"] = f"C heap blocks of 1 MiB and more mapped apart: {map_large_blocks()}"  # as the Trainer does
    build_seconds = time.perf_counter() - began
    model.train()
    times, phases, losses, io = [], [], [], []
    steps = 1 if args.row == "zero3_fwd_bwd" else args.steps
    for step in range(steps):
        ids = batches[step % len(batches)]
        before = stats(stores)
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        forward_done = time.perf_counter()
        loss.backward()
        backward_done = time.perf_counter()
        if opt is not None:
            if isinstance(opt, ShardedOptimizer):
                opt.clip_grad_norm(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        phases.append({"forward": forward_done - start, "backward": backward_done - forward_done,
                       "optimizer": start + times[-1] - backward_done})  # fmt: skip
        losses.append(float(loss.detach()))
        after = stats(stores)
        io.append({k: after[k] - before[k] for k in after})
        split = ", ".join(f"{name} {seconds:.2f}" for name, seconds in phases[-1].items())
        print(f"step {step}: {times[-1]:.2f} s ({split}), loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    result = {"row": args.row, "arch": args.arch, "parameters": sum(p.numel() for p in model.parameters()),
              "build_seconds": build_seconds, "step_seconds": times, "phase_seconds": phases, "losses": losses,
              "io": io, "peak_rss": peak_rss(), "compute": compute, "notes": notes}  # fmt: skip
    if cast is not None:
        result["compute_pool_bytes"] = cast.pool_bytes()
        cast.remove()
    if sharded is not None:
        result["on_disk"] = sharded.held_parameter_bytes()["on_disk"]
    if args.compute_bound:
        result["compute_bound"] = blocks_compute_seconds(config, rows, tokens, frozen=lora)
    result["lora"] = args.lora
    from trainer_shard.sharding.zero3 import full_numel

    result["full_parameters"] = sum(full_numel(p) for p in model.parameters())
    result["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if isinstance(opt, ShardedOptimizer):
        opt.close()
    if sharded is not None:
        sharded.close()
    print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
