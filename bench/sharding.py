#!/usr/bin/env python
"""Sharding side by side: the same finetune run under DDP, --sharded_ddp simple / zero_dp_2,
torch's ZeroRedundancyOptimizer and DeepSpeed ZeRO-2, at world size 2 on gloo (CPU).

    python bench/sharding.py                 # all rows, writes bench/results/sharding.{md,png}
    python bench/sharding.py --steps 20 --rows ddp zero_dp_2

Not a test: it takes minutes. It installs its own environment in bench/.venv (torch 2.13 CPU,
this package, DeepSpeed, matplotlib) so that every row runs on the same versions; a row that
cannot run is reported as skipped, with the reason. The model is the t5-small architecture
(60.5 M parameters, random init) on the demo English-Romanian data.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

from _results import write_markdown  # bench/_results.py (these run as scripts: bench/ is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "bench" / ".venv"
PY = VENV / "bin" / "python"
WORK = ROOT / "bench" / "work"
RESULTS = ROOT / "bench" / "results"
DATA = ROOT / "data" / "demo_en_ro"
TOKENIZER = ROOT / "data" / "demo_t5"
MODEL = WORK / "t5-small-arch"

ROWS = {
    "ddp": ("DDP (transformers Trainer)", []),
    "simple": ("trainer_shard --sharded_ddp simple (ZeRO-1)", ["--sharded_ddp", "simple"]),
    "zero_dp_2": ("trainer_shard --sharded_ddp zero_dp_2 (ZeRO-2)", ["--sharded_ddp", "zero_dp_2"]),
    "torch_zero": ("torch ZeroRedundancyOptimizer (ZeRO-1)", []),
    "deepspeed_zero2": ("DeepSpeed 0.19 ZeRO-2", ["--deepspeed", str(WORK / "ds_zero2.json")]),
}

DS_CONFIG = {
    "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True},
    "zero_allow_untested_optimizer": True,  # the Trainer's own fused AdamW, as in the other rows
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}


def run(cmd, **kwargs):
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def ensure_env() -> None:
    if not (VENV / ".bench-installed").exists():
        run([sys.executable, "-m", "venv", VENV])
        run([PY, "-m", "pip", "install", "--quiet", "torch==2.13.0"])
        run([PY, "-m", "pip", "install", "--quiet", "-e", ROOT, "deepspeed", "matplotlib", "torch==2.13.0"])
        (VENV / ".bench-installed").touch()


def ensure_model() -> None:
    if not (DATA / "train.source").exists():
        run([PY, ROOT / "scripts" / "make_demo_data.py", "--out_dir", DATA])
    if not (TOKENIZER / "tokenizer.json").exists():
        run([PY, ROOT / "scripts" / "build_demo_model.py", "--data_dir", DATA, "--out_dir", TOKENIZER])
    if not (MODEL / "config.json").exists():
        code = f"""
from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration
import torch
torch.manual_seed(0)
tok = AutoTokenizer.from_pretrained({str(TOKENIZER)!r})
config = T5Config(vocab_size=32128, d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64,
                  pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
                  task_specific_params={{"translation_en_to_ro": {{"prefix": "translate English to Romanian: "}}}})
T5ForConditionalGeneration(config).save_pretrained({str(MODEL)!r})
tok.save_pretrained({str(MODEL)!r})
"""
        run([PY, "-c", code])
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "ds_zero2.json").write_text(json.dumps(DS_CONFIG, indent=1))


def train_flags(model, out, steps: int, batch: int, *, lr: str, length: int, logging_steps: int, extra=()) -> list:
    """finetune_trainer.py flags for a benchmark row: train only, fused AdamW, clipping, no saves."""
    return [
        "--model_name_or_path", model, "--data_dir", DATA, "--task", "translation_en_to_ro",
        "--output_dir", out, "--do_train", "--use_cpu", "--overwrite_output_dir",
        "--max_steps", steps, "--per_device_train_batch_size", batch, "--learning_rate", lr,
        "--weight_decay", "0.01", "--optim", "adamw_torch_fused", "--max_grad_norm", "1.0",
        "--max_source_length", length, "--max_target_length", length, "--logging_steps", logging_steps,
        "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--seed", "42", *extra,
    ]  # fmt: skip


def flags(row: str, steps: int, batch: int) -> list:
    return train_flags(MODEL, WORK / "out" / row, steps, batch, lr="3e-4", length=64, logging_steps=5, extra=ROWS[row][1])


def run_row(row: str, steps: int, batch: int, timeout: int) -> dict:
    out = RESULTS / "raw" / row
    for old in out.glob("rank*.json"):
        old.unlink()
    cmd = [VENV / "bin" / "torchrun", "--nproc_per_node", "2", ROOT / "bench" / "_sharding_worker.py", row, out, "--",
           *flags(row, steps, batch)]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_EVALUATE_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")  # fmt: skip
    log = RESULTS / "raw" / f"{row}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    try:
        with log.open("w") as f:
            proc = subprocess.run([str(c) for c in cmd], env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"row": row, "skipped": f"did not finish in {timeout} s"}
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if proc.returncode != 0 or len(ranks) != 2:
        tail = [line for line in log.read_text(errors="replace").splitlines() if "Error" in line or "error" in line]
        return {"row": row, "skipped": f"exit {proc.returncode}: {(tail or ['see ' + str(log)])[-1][:300]}"}
    return {
        "row": row,
        "wall_s": time.time() - started,
        "parameters": ranks[0]["parameters"],
        "median_step_s": median(r["median_step_s"] for r in ranks),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "optimizer_state_bytes": max(r["optimizer_state_bytes"] for r in ranks),
        "grad_bytes": None if ranks[0]["grad_bytes"] is None else max(r["grad_bytes"] for r in ranks),
        "grad_transient_peak_bytes": max(r["grad_transient_peak_bytes"] for r in ranks),
        "final_loss": ranks[0]["final_loss"],
    }


def combine(row_runs: list) -> dict:
    """Repeats of one row: the median step time; memory and loss of the first run (they repeat)."""
    ok = [r for r in row_runs if "skipped" not in r]
    if not ok:
        return row_runs[0]
    return dict(ok[0], median_step_s=median(r["median_step_s"] for r in ok), repeats=len(ok),
                step_s_runs=[round(r["median_step_s"], 4) for r in ok])  # fmt: skip


def mb(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f}"


def table(results: list, args) -> str:
    base = next((r for r in results if r["row"] == "ddp" and "skipped" not in r), None)
    ran = [r for r in results if "skipped" not in r]
    params = ran[0]["parameters"] if ran else 0
    lines = [
        f"World size 2 (gloo, CPU, {os.cpu_count()} cores), t5-small architecture ({params / 1e6:.1f} M parameters), "
        f"fp32, fused AdamW, batch {args.batch} per rank, {args.steps} steps; step time: median over {args.repeats} "
        "interleaved runs of each run's median step (after 3 warm-up steps). Ratios are to DDP in the same invocation.",
        "",
        "| run | step time (s) | vs DDP | peak RSS / rank (MB) | optimizer state / rank (MB) | vs DDP "
        "| gradients / rank (MB) | vs DDP | + transient buckets (MB) | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        name = ROWS[r["row"]][0]
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} |  |  |  |  |  |  |  |  |")
            continue

        def ratio(key):
            return f"{r[key] / base[key]:.2f}x" if base and base[key] and r[key] is not None else "-"

        lines.append(
            f"| {name} | {r['median_step_s']:.3f} | {ratio('median_step_s')} | {mb(r['peak_rss_bytes'])} "
            f"| {mb(r['optimizer_state_bytes'])} | {ratio('optimizer_state_bytes')} | {mb(r['grad_bytes'])} "
            f"| {ratio('grad_bytes')} | {mb(r['grad_transient_peak_bytes'])} | {r['final_loss']:.4f} |"
        )
    lines += [
        "",
        "Gradients / rank: bytes held when the optimizer steps (`.grad` tensors plus the gradient shard or "
        "partition the engine keeps). Transient buckets: the peak of gradient buckets alive at once during "
        "backward (ZeRO-2), not included in the gradient column. DDP's own bucket copies are not counted for DDP. "
        "DeepSpeed frees its gradient partitions inside its step, before the Trainer's hook can see them (n/a); "
        "its peak RSS includes them.",
    ]
    return "\n".join(lines) + "\n"


def plot(results: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in results if "skipped" not in r]
    names = [r["row"] for r in ran]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = [("median_step_s", "step time (s)", 1), ("optimizer_state_bytes", "optimizer state / rank (MB)", 2**20),
              ("grad_bytes", "gradients / rank (MB)", 2**20)]  # fmt: skip
    for ax, (key, title, scale) in zip(axes, panels):
        ax.bar(names, [(r[key] or 0) / scale for r in ran], color="#4477aa")
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("trainer_shard sharding, world size 2, t5-small architecture (CPU, gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="run the rows this many times, interleaved")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per row")
    parser.add_argument("--render", action="store_true", help="only rewrite the table and plot from sharding.json")
    args = parser.parse_args()
    ensure_env()
    if Path(sys.prefix).resolve() != VENV.resolve():
        os.execv(str(PY), [str(PY), __file__, *sys.argv[1:]])  # the rest runs in the bench environment
    if args.render:
        return report(json.loads((RESULTS / "sharding.json").read_text()), args)
    ensure_model()
    runs = {row: [] for row in args.rows}
    for _ in range(args.repeats):
        for row in args.rows:
            result = run_row(row, args.steps, args.batch, args.timeout)
            print(json.dumps(result), flush=True)
            runs[row].append(result)
    results = [combine(row_runs) for row_runs in runs.values()]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sharding.json").write_text(json.dumps(results, indent=1))
    report(results, args)


def report(results: list, args) -> None:
    command = " ".join(a for a in sys.argv[1:] if a != "--render")
    text = f"# Sharding benchmark\n\nCommand: `python bench/sharding.py {command}`\n\n" + table(results, args)
    write_markdown(RESULTS / "sharding.md", text)
    plot(results, RESULTS / "sharding.png")
    print(text)


if __name__ == "__main__":
    main()
