"""The DeepSpeed peer rows of bench/infinity.py, in their own process, run with the bench
environment's interpreter (bench/.venv: torch 2.13 CPU, DeepSpeed; DS_ACCELERATOR=cpu); prints one
JSON line with the fields bench/_infinity_worker.py prints.

    DS_ACCELERATOR=cpu bench/.venv/bin/python bench/_infinity_ds_worker.py ROW ARCH --steps N --work DIR

Rows (one process, world size 1 on gloo, a plain loop over DeepSpeed's engine, no Trainer; the
architecture, batch and data of bench/_infinity_worker.py: one batch of random tokens (seed 0)
every step; AdamW lr 1e-4 weight decay 0.01, `gradient_clipping` 1.0, `bf16: {enabled: true}`
(bf16 parameters, fp32 master weights); the model built as transformers builds it under
ZeRO-3: `HfDeepSpeedConfig` kept alive, `_from_config` inside `deepspeed.zero.Init`, the weights
initialised a module at a time):
- deepspeed_zero3_cpu: ZeRO-3 with `offload_param` and `offload_optimizer` on CPU;
- deepspeed_zero3_nvme: ZeRO-3 with both on disk under --work (ZeRO-Infinity); needs DeepSpeed's
  async_io op (libaio): where it cannot run, a `skipped` line with DeepSpeed's own error and
  `AsyncIOBuilder().is_compatible(verbose=True)`'s warnings.
The optimizer is DeepSpeedCPUAdam (AdamW mode; JIT-compiled on first use, timed apart with the
process group's start as op_build_seconds); if it cannot be built, or with --torch-adamw, torch's
fused AdamW as the client optimizer with `zero_force_ds_cpu_optimizer: false` (the `optimizer`
field says which). io: DeepSpeed keeps no I/O counters; the CPU row does no disk I/O (zeros), the
nvme row reports /proc/self/io's read_bytes / write_bytes a step (seconds 0: not measured).
"""

import argparse
import contextlib
import io as iolib
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from _infinity_worker import ARCHS, BATCH, config_of, peak_rss  # noqa: E402 - the same architectures and batches

ROWS = ("deepspeed_zero3_cpu", "deepspeed_zero3_nvme")
LR, WEIGHT_DECAY, CLIP = 1e-4, 0.01, 1.0


def ds_config(row: str, rows: int, work: Path, client_optimizer: bool) -> dict:
    if row == "deepspeed_zero3_cpu":
        param = {"device": "cpu", "pin_memory": False}
        optim = {"device": "cpu", "pin_memory": False}
    else:
        param = {"device": "nvme", "nvme_path": str(work / "params"), "pin_memory": False, "buffer_count": 5}
        optim = {"device": "nvme", "nvme_path": str(work / "optim"), "pin_memory": False}
    config = {
        "train_micro_batch_size_per_gpu": rows,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "offload_param": param, "offload_optimizer": optim},
        "steps_per_print": 10**9,
    }
    if client_optimizer:
        config.update(zero_force_ds_cpu_optimizer=False, zero_allow_untested_optimizer=True)
    else:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}}
    return config


def quietly(fn):
    """fn()'s value and what it printed (DeepSpeed's op builders print their warnings), ANSI codes removed."""
    out = iolib.StringIO()
    with contextlib.redirect_stdout(out):
        value = fn()
    return value, re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())


def warnings_of(text: str) -> str:
    return "; ".join(line.replace("[WARNING]", "").strip() for line in text.splitlines() if "WARNING" in line)


def disk_io() -> dict:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"read_bytes": int(fields["read_bytes"]), "write_bytes": int(fields["write_bytes"]),
            "read_seconds": 0.0, "write_seconds": 0.0}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("row", choices=ROWS)
    parser.add_argument("arch", choices=ARCHS)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--work", required=True)
    parser.add_argument("--torch-adamw", action="store_true", help="torch's fused AdamW, not DeepSpeedCPUAdam")
    parser.add_argument("--lora", type=int, default=0,
                        help="LoRA rank on q and v (PEFT's get_peft_model on the ZeRO-3 model); 0: full fine-tuning")
    args = parser.parse_args()
    import deepspeed
    from deepspeed.ops.op_builder import AsyncIOBuilder, CPUAdamBuilder
    from transformers import T5ForConditionalGeneration
    from transformers.integrations import HfDeepSpeedConfig

    work = Path(args.work)
    result = {"row": args.row, "arch": args.arch}
    if args.row == "deepspeed_zero3_nvme":
        compatible, printed = quietly(lambda: AsyncIOBuilder().is_compatible(verbose=True))
        result["async_io"] = "True" if compatible else f"False, warning: {warnings_of(printed)}"
    notes, client_optimizer = {}, args.torch_adamw
    if client_optimizer:
        notes["optimizer"] = "torch's fused AdamW as the client optimizer (--torch-adamw)"
    began = time.perf_counter()
    if not client_optimizer:
        try:
            quietly(lambda: CPUAdamBuilder().load(verbose=False))
        except Exception as e:  # noqa: BLE001 - recorded, then torch's AdamW
            client_optimizer = True
            notes["cpu_adam"] = f"DeepSpeedCPUAdam could not be built ({type(e).__name__}: {str(e)[:300]})"

    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, init_method=f"file://{work}/rendezvous",
                               rank=0, world_size=1, verbose=False)  # fmt: skip
    op_build_seconds = time.perf_counter() - began  # with the CPU accelerator's shm comm op, built on first use
    arch_config = config_of(args.arch)
    rows, tokens = BATCH[args.arch]
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(2, 32128, (rows, tokens), generator=generator)]
    config = ds_config(args.row, rows, work, client_optimizer)
    began = time.perf_counter()
    try:
        hf_config = HfDeepSpeedConfig(config)  # noqa: F841 - transformers sees ZeRO-3 while it lives
        torch.manual_seed(0)
        model = T5ForConditionalGeneration._from_config(arch_config)
        if args.lora:  # as PEFT users do it under DeepSpeed ZeRO-3 (TRL, axolotl): adapters on the partitioned model
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(task_type="SEQ_2_SEQ_LM", r=args.lora, lora_alpha=2 * args.lora,
                                                     lora_dropout=0.0, target_modules=["q", "v"]))  # fmt: skip
        trainable = [p for p in model.parameters() if p.requires_grad]
        opt = None
        if client_optimizer:
            opt = torch.optim.AdamW(trainable, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, optimizer=opt,
                                          config=config)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - the nvme row records DeepSpeed's reason; the CPU row fails
        if args.row != "deepspeed_zero3_nvme":
            raise
        traceback.print_exc()
        reason = f"{type(e).__name__}: {e}".strip()
        if "async_io" in result:
            reason += f" (AsyncIOBuilder().is_compatible(verbose=True): {result['async_io']})"
        print(json.dumps({"row": args.row, "arch": args.arch, "skipped": reason, "deepspeed": deepspeed.__version__}))
        deepspeed.comm.destroy_process_group()
        return
    build_seconds = time.perf_counter() - began
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    engine.train()
    times, losses, io = [], [], []
    for step in range(args.steps):
        ids = batches[step % len(batches)]
        before = disk_io()
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach().float()))
        after = disk_io()
        if args.row == "deepspeed_zero3_cpu":  # no disk I/O by design; page-cache noise is not its own
            io.append({k: 0 if k.endswith("bytes") else 0.0 for k in after})
        else:
            io.append({k: after[k] - before[k] for k in after})
        print(f"step {step}: {times[-1]:.2f} s, loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    result.update({"parameters": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()),
                   "build_seconds": build_seconds, "step_seconds": times, "losses": losses, "io": io,
                   "peak_rss": peak_rss(), "op_build_seconds": op_build_seconds, "threads": torch.get_num_threads(),
                   "optimizer": type(inner).__name__, "optimizer_wrapper": type(engine.optimizer).__name__,
                   "deepspeed": deepspeed.__version__, "notes": notes, "lora": args.lora,
                   "trainable": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad),
                   "full_parameters": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())})  # fmt: skip
    print(json.dumps(result), flush=True)
    deepspeed.comm.destroy_process_group()


if __name__ == "__main__":
    main()
