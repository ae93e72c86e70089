#!/usr/bin/env python
"""LoRA on a frozen base bigger than RAM: one process, plain training loops, the t5-large and
t5-11b architectures (bench/_infinity_worker.py `--lora 16`: PEFT LoRA r=16, alpha 32, on q and
v, initialised as finetune_trainer.py --use_peft does), with the disk's bandwidth measured in the
same run.

    python bench/peft_lora.py                         # all rows, bench/results/peft_lora.{md,json}
    python bench/peft_lora.py --rows large            # the t5-large rows only
    python bench/peft_lora.py --large-arch tiny --rows large --steps 2   # a smoke test

Rows (each its own process, its work folder removed after it):
- large (t5-large, 738 M, batch 4 x 64 tokens, `--steps` steps, the first a warm-up): the plain fp32
  full fine-tune (the reference for RSS), then LoRA: fp32 with torch's fused AdamW on the adapters;
  bf16 with ShardedOptimizer ZeRO-2; bf16 with the model sharded ZeRO-3 (`shard_model`, one unit per
  T5Block, in RAM); and ZeRO-3 with the base built on the meta device and read into the
  parameter store on disk (`offload_param` nvme, max_in_cpu 0), the adapters' optimizer state on
  disk too; then the peer, DeepSpeed ZeRO-3 with PEFT's LoRA on the same model, parameters and optimizer
  state offloaded to CPU (bench/_infinity_ds_worker.py --lora 16, in bench/.venv).
- 11b (t5-11b, 11.3 B, 21 GiB in bf16, batch 1 x 32 tokens, `--steps11b` steps): LoRA with the base
  on disk, its weights generated a tensor at a time into the store; beside each step its two
  bounds measured in the same run: reading the base twice (forward and backward) at the disk's
  measured read bandwidth, and the units' forward and backward compute alone (one encoder and
  one decoder block timed in RAM, times the layers).
Not a test: it takes long and fills the disk (t5-11b: 21 GB). Run nothing else meanwhile.
(Not named peft.py: a script's folder comes first on sys.path, and its workers import the peft package.)
"""

import argparse
import json
import os
import sys
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import cpu_name, write_markdown  # noqa: E402
from infinity import BENCH_PY, DS_EXTRA, DS_WORKER, GIB, deepspeed_env, disk_bandwidth, run_row, summarize  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
LARGE = [("plain_fp32", 0), ("plain_fp32", 16), ("zero2", 16), ("zero3", 16), ("zero3_disk", 16)]
NAMES = {("plain_fp32", 0): "plain fp32, full fine-tune (the reference)",
         ("plain_fp32", 16): "LoRA, fp32, fused AdamW on the adapters",
         ("zero2", 16): "LoRA, bf16, ZeRO-2", ("zero3", 16): "LoRA, bf16, ZeRO-3 in RAM",
         ("zero3_disk", 16): "LoRA, bf16, ZeRO-3, the base on disk",
         ("deepspeed_zero3_cpu", 16): "DeepSpeed ZeRO-3 + PEFT LoRA, bf16, parameters and optimizer offloaded to CPU"}  # fmt: skip


def table(results: list, reference: dict | None) -> str:
    lines = ["| architecture | row | trainable | peak RSS | vs full fp32 | step (median) | disk read / step | losses |",
             "|---|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in results:
        name = NAMES.get((r["row"], r.get("lora", 0)), r["row"])
        if "skipped" in r:
            lines.append(f"| {r['arch']} | {name} | | | | | | skipped: {r['skipped']} |")
            continue
        ratio = f"{r['peak_rss'] / reference['peak_rss']:.3f}x" if reference and r["arch"] == reference["arch"] else "-"
        lines.append(f"| {r['arch']} | {name} | {r['trainable']:,} | {r['peak_rss'] / GIB:.2f} GiB | {ratio} "
                     f"| {r['step']:.2f} s | {r['io_step']['read_bytes'] / GIB:.2f} GiB "
                     f"| {', '.join(f'{x:.3f}' for x in r['losses'])} |")  # fmt: skip
    return "\n".join(lines)


def bounds_table(r: dict, bandwidth: dict) -> str:
    base = r["full_parameters"] * 2  # bf16 bytes of the base (the adapters are a rounding error)
    read = 2 * base / bandwidth["read"]
    compute = r["compute_bound"]["total"]
    lines = ["| step | time (s) | disk read (GiB) | read bound: 2 x base / bandwidth (s) | compute bound (s) "
             "| time / larger bound |", "|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for i, (t, io) in enumerate(zip(r["step_seconds"], r["io"])):
        lines.append(f"| {i} | {t:.1f} | {io['read_bytes'] / GIB:.2f} | {read:.1f} | {compute:.1f} "
                     f"| {t / max(read, compute):.2f} |")  # fmt: skip
    c = r["compute_bound"]
    return "\n".join(lines) + (f"\n\nCompute bound: encoder block {c['encoder_block']:.3f} s, decoder block "
                               f"{c['decoder_block']:.3f} s (forward and backward, frozen weights, timed in RAM), "
                               f"output product {c['logits']:.3f} s; base {base / GIB:.2f} GiB in bf16.")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=["large", "11b"], choices=["large", "11b"])
    parser.add_argument("--large-arch", default="t5-large", choices=["t5-large", "tiny"])
    parser.add_argument("--steps", type=int, default=4, help="t5-large steps a row (the first is warm-up)")
    parser.add_argument("--steps11b", type=int, default=10)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/trainer_shard_peft"))
    parser.add_argument("--timeout", type=int, default=5400)
    parser.add_argument("--bandwidth-gib", type=float, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "peft_lora")
    parser.add_argument("--large-rows", nargs="*", default=[f"{r}:{n}" for r, n in LARGE],
                        help="of the large set, as ROW:LORA_RANK (default all)")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave out DeepSpeed ZeRO-3 + PEFT (the peer)")
    parser.add_argument("--python", type=Path, default=BENCH_PY,
                        help="the interpreter of the DeepSpeed row (default bench/.venv, made if missing)")  # fmt: skip
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    bandwidth = disk_bandwidth(args.folder, int(args.bandwidth_gib * GIB))
    print(f"disk: write {bandwidth['write'] / GIB:.2f} GiB/s, read {bandwidth['read'] / GIB:.2f} GiB/s", flush=True)
    results = []
    if "large" in args.rows:
        for row, lora in (tuple(x.split(":")) for x in args.large_rows):
            lora = int(lora)
            extra = ["--lora", str(lora)] if lora else []
            results.append(summarize({**run_row(row, args.large_arch, args.steps, args.folder, args.timeout,
                                                extra=extra), "lora": lora}, bandwidth))  # fmt: skip
            print(table(results, results[0] if "skipped" not in results[0] else None), flush=True)
        if not args.no_deepspeed:  # the peer: DeepSpeed ZeRO-3 + PEFT, parameters and optimizer offloaded to CPU
            why = deepspeed_env(args.python)
            result = {"row": "deepspeed_zero3_cpu", "arch": args.large_arch, "skipped": why} if why else run_row(
                "deepspeed_zero3_cpu", args.large_arch, args.steps, args.folder, args.timeout, python=args.python,
                worker=DS_WORKER, env=DS_EXTRA, extra=["--lora", "16"])  # fmt: skip
            results.append(summarize({**result, "lora": 16}, bandwidth))
    big = None
    if "11b" in args.rows:
        big = summarize({**run_row("zero3_disk", "t5-11b", args.steps11b, args.folder, args.timeout,
                                   extra=["--lora", "16", "--compute-bound"]), "lora": 16}, bandwidth)  # fmt: skip
        results.append(big)
    reference = results[0] if results and results[0].get("lora") == 0 and "skipped" not in results[0] else None
    meta = {"bandwidth": bandwidth, "cpu": cpu_name(), "cpus": os.cpu_count(), "command": " ".join(sys.argv)}
    Path(f"{args.out}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    text = (f"# LoRA on a frozen base bigger than RAM (plain loops, one process)\n\nWritten by `python "
            f"{' '.join(sys.argv)}`; CPU: {meta['cpu']}, {os.cpu_count()} cores. Disk under {args.folder}: "
            f"sequential write {bandwidth['write'] / GIB:.2f} GiB/s (fsync'd), read {bandwidth['read'] / GIB:.2f} "
            f"GiB/s (page cache dropped).\n\n{table(results, reference)}\n")  # fmt: skip
    if big is not None and "skipped" not in big:
        text += (f"\n## t5-11b, LoRA with the base on disk, every step and its bounds\n\n{bounds_table(big, bandwidth)}"
                 f"\n\nMedian step after the first: {median(big['step_seconds'][1:] or big['step_seconds']):.1f} s.\n")  # fmt: skip
    write_markdown(Path(f"{args.out}.md"), text)
    print(text)


if __name__ == "__main__":
    main()
