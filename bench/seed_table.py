#!/usr/bin/env python
"""The classic table, reproduced: the largest batch that fits a memory budget per rank, for
DDP, bf16, ZeRO-1, ZeRO-2, ZeRO-2 + CPU offload and DeepSpeed ZeRO-2 (with and without offload).

    python bench/seed_table.py                        # writes bench/results/seed_table.{md,json,png}
    python bench/seed_table.py --budget 2.4GiB --samples 2048 --rows ddp zero_dp_2_offload

One invocation, the same model and data for every row: the t5-small architecture (60.5 M
parameters, random init, bench/sharding.py builds it) on the demo English-Romanian task, 2
processes on gloo (CPU). For each row:

1. the largest batch size per rank whose measured peak RSS (every rank's ru_maxrss, 2 training
   steps) stays within `--budget`: doubling from 4, then bisection to within 1/8;
2. train time for `--samples` training samples and eval time (greedy generation, `--n_val`
   samples), and the final BLEU, all rows at the same batch size (the baseline's largest), so
   that time and BLEU compare like with like.

Every row fine-tunes the same checkpoint, as the classic table fine-tuned a pretrained t5-small:
the bench pre-trains it once (plain DDP, --bf16, `--pretrain_samples`, dropout 0) and keeps it
in bench/work. From random init the rows' BLEU after a few thousand samples is on the steep part
of the learning curve, where two runs of the same algorithm differ by several points (measured:
DDP fp32 and ZeRO-1 fp32, 2,048 samples, 500 validation sentences: 21.60 and 19.46), so BLEU
could not tell a sound strategy from a broken one. The fine-tuning learning rate (`--lr`,
3e-5) is low enough that rounding does not decide BLEU: at 1e-4, 128 steps at batch 8 per
rank, DDP fp32 ended at 64.47 with torch's fused AdamW and 64.19 with its foreach AdamW (the
same algorithm), ZeRO-1 fp32 at 62.23, after gradient-norm spikes of up to 188 that the three
runs met at different steps; at 3e-5, DDP 64.91 (fused) and 64.14 (foreach), ZeRO-1 65.08.

On a CUDA machine the same command enforces the budget on the GPU instead, with
`torch.cuda.set_per_process_memory_fraction` (budget / the GPU's memory) and measures
`torch.cuda.max_memory_allocated`; here, without a GPU, that path is skipped, and the budget
is CPU RAM per rank, where offloading to "CPU" moves nothing out of that memory: the CPU-offload
rows gain from the 16-bit parameters and gradient shard they keep, not from the move.
Runs in bench/.venv (DeepSpeed for the peer rows); about 65 minutes on 2 cores, the
pre-training included (19 of them, once; later runs reuse it and take about 46).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sharding import DATA, MODEL, PY, RESULTS, ROOT, VENV, WORK, ensure_env, ensure_model  # noqa: E402
from _results import write_markdown  # noqa: E402

ROWS = {
    "ddp": ("baseline: DDP, fp32", []),
    "bf16": ("DDP --bf16", ["--bf16"]),
    "simple": ("--sharded_ddp simple", ["--sharded_ddp", "simple"]),
    "simple_bf16": ("--sharded_ddp simple --bf16", ["--sharded_ddp", "simple", "--bf16"]),
    "zero_dp_2": ("--sharded_ddp zero_dp_2", ["--sharded_ddp", "zero_dp_2"]),
    "zero_dp_2_offload": ("--sharded_ddp 'zero_dp_2 offload' --bf16 (CPU offload)", ["--sharded_ddp", "zero_dp_2 offload", "--bf16"]),
    "deepspeed": ("DeepSpeed ZeRO-2", ["--deepspeed", str(WORK / "ds_zero2.json")]),
    "deepspeed_offload": ("DeepSpeed ZeRO-2 + CPU offload --bf16", ["--bf16", "--deepspeed", str(WORK / "ds_offload.json")]),
}  # fmt: skip
DS = {"zero_allow_untested_optimizer": True, "train_micro_batch_size_per_gpu": "auto",
      "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"}}  # fmt: skip
DS_CONFIGS = {
    "ds_zero2.json": {**DS, "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True}},
    "ds_offload.json": {**DS, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                                    "overlap_comm": False, "contiguous_gradients": True}},
}  # fmt: skip
CUDA = False  # set in main(): a GPU enforces the budget on itself (see the module docstring)
ENV = dict(os.environ, HF_HUB_OFFLINE="1", HF_EVALUATE_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
           GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")  # fmt: skip
PEAK = ROOT / "tests" / "helpers" / "peak_rss.py"


PRETRAINED = WORK / "t5-small-pretrained"


def ensure_pretrained(samples: int, lr: str) -> dict:
    """The checkpoint every row fine-tunes: MODEL with dropout 0, trained once with plain DDP --bf16."""
    recipe = {"samples": samples, "batch_per_rank": 16, "lr": lr, "warmup_steps": 100, "dropout_rate": 0.0,
              "seed": 1234, "strategy": "DDP (transformers Trainer), --bf16"}  # fmt: skip
    record = PRETRAINED / "pretrain.json"
    done = json.loads(record.read_text()) if record.exists() else {}
    if done.get("recipe") == recipe:
        return done
    start = WORK / "t5-small-nodropout"
    start.mkdir(parents=True, exist_ok=True)
    for item in MODEL.iterdir():
        if item.name != "config.json" and not (start / item.name).exists():
            (start / item.name).symlink_to(item)
    config = json.loads((MODEL / "config.json").read_text())
    (start / "config.json").write_text(json.dumps({**config, "dropout_rate": 0.0}, indent=1))
    batch = recipe["batch_per_rank"]
    steps = max(1, samples // (2 * batch))
    print(f"pre-training the checkpoint the rows fine-tune: {samples} samples, plain DDP --bf16", flush=True)
    flags = ["--do_train", "--do_eval", "--predict_with_generate", "--max_steps", str(steps), "--n_val", "200",
             "--per_device_train_batch_size", str(batch), "--per_device_eval_batch_size", "32", "--eval_beams", "1",
             "--learning_rate", recipe["lr"], "--warmup_steps", str(recipe["warmup_steps"]), "--logging_steps", "50",
             "--bf16", "--seed", str(recipe["seed"])]  # fmt: skip
    ok, seconds, _ = launch("ddp", PRETRAINED, flags, timeout=4 * 3600, model=start)
    if not ok:
        raise SystemExit(f"pre-training failed: see {PRETRAINED / 'failed.log'}")
    results = json.loads((PRETRAINED / "all_results.json").read_text())
    done = {"recipe": recipe, "seconds": round(seconds), "val_bleu_200": results["val_bleu"], "train_loss": results["train_loss"]}
    record.write_text(json.dumps(done, indent=1))
    return done


def launch(row: str, out: Path, flags: list, timeout: int, model: Path = PRETRAINED) -> tuple:
    """One 2-rank run of finetune_trainer.py through the peak-RSS helper: (ok, seconds, peak)."""
    for old in out.glob("peak_rss_rank*.json"):
        old.unlink()
    cmd = [VENV / "bin" / "torchrun", "--standalone", "--nproc_per_node", "2", PEAK, "--model_name_or_path", model,
           "--data_dir", DATA, "--task", "translation_en_to_ro", "--output_dir", out, "--overwrite_output_dir",
           *([] if CUDA else ["--use_cpu"]), "--report_to", "none", "--disable_tqdm", "true", "--save_strategy", "no",
           "--optim", "adamw_torch_fused", "--max_source_length", "64", "--max_target_length", "64",
           "--val_max_target_length", "64", "--seed", "42", *flags, *ROWS[row][1]]  # fmt: skip
    started = time.time()
    try:
        proc = subprocess.run([str(c) for c in cmd], env=ENV, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, timeout, None
    peaks = [json.loads(p.read_text())["peak_rss_bytes"] for p in out.glob("peak_rss_rank*.json")]
    if proc.returncode or len(peaks) != 2:
        (out / "failed.log").write_text(proc.stdout[-5000:] + proc.stderr[-20000:])
        return False, time.time() - started, None
    return True, time.time() - started, max(peaks)


def fits(row: str, batch: int, budget: int, log: list) -> bool:
    out = WORK / "seed" / row / f"b{batch}"
    flags = ["--do_train", "--max_steps", "2", "--per_device_train_batch_size", str(batch), "--n_train", str(4 * batch)]
    ok, seconds, peak = launch(row, out, flags, timeout=900)
    if not ok:  # once more: a gloo process can die at exit ("terminate called without an active exception")
        ok, seconds, peak = launch(row, out, flags, timeout=900)
    for saved in out.glob("*.safetensors"):  # the probe's final model: 240 MB a probe, about 60 probes a table
        saved.unlink()
    log.append({"batch": batch, "ok": ok, "peak_rss_bytes": peak, "seconds": round(seconds, 1)})
    print(f"  {row} batch {batch}: {'peak %.2f GiB' % (peak / 2**30) if ok else 'failed (OOM or error)'}", flush=True)
    return ok and peak <= budget


def largest_batch(row: str, budget: int, limit: int = 512) -> tuple:
    """Doubling from 4, then bisection until the step is under 1/8 of the batch."""
    log, lo, hi = [], 0, None
    batch = 4
    while batch <= limit:
        if fits(row, batch, budget, log):
            lo, batch = batch, batch * 2
        else:
            hi = batch
            break
    if lo == 0:
        lo_try = 1
        while lo_try < (hi or 4) and fits(row, lo_try, budget, log):
            lo = lo_try
            lo_try += 1
        return lo, log
    hi = hi or lo
    while hi - lo > max(1, lo // 8):
        mid = (lo + hi) // 2
        if fits(row, mid, budget, log):
            lo = mid
        else:
            hi = mid
    return lo, log


def train_and_eval(row: str, batch: int, samples: int, n_val: int, lr: str) -> dict:
    out = WORK / "seed" / row / "train"
    steps = max(1, samples // (2 * batch))
    flags = ["--do_train", "--do_eval", "--predict_with_generate", "--max_steps", str(steps), "--n_val", str(n_val),
             "--per_device_train_batch_size", str(batch), "--per_device_eval_batch_size", "32", "--eval_beams", "1",
             "--learning_rate", lr, "--warmup_steps", str(max(1, steps // 10)), "--logging_steps", "10"]  # fmt: skip
    ok, seconds, peak = launch(row, out, flags, timeout=3600)
    if not ok:
        return {"skipped": f"training failed: see {out / 'failed.log'}"}
    results = json.loads((out / "all_results.json").read_text())
    return {"steps": steps, "train_s": results["train_runtime"], "eval_s": results["val_runtime"],
            "bleu": results["val_bleu"], "train_loss": results["train_loss"], "peak_rss_bytes": peak}  # fmt: skip


def write(results: dict, args, pretrained: dict) -> str:
    gib = 2**30
    base = results.get("ddp", {})
    lines = [
        "# The classic table, reproduced", "",
        f"Command: `python bench/seed_table.py {' '.join(sys.argv[1:])}`".replace("  ", " "), "",
        f"2 processes ({'NCCL, GPU' if CUDA else 'gloo, CPU'}, {os.cpu_count()} cores), t5-small architecture (60.5 M parameters), demo "
        f"English-Romanian data. Budget: {args.budget} of peak {'GPU memory' if CUDA else 'RSS'} per rank (every "
        f"rank's {'max_memory_allocated' if CUDA else 'ru_maxrss'} over 2 training steps). Train time: {args.samples} samples at the baseline's largest batch for every row; eval: greedy "
        f"generation on {args.n_val} validation samples; BLEU on them.", "",
        f"Every row fine-tunes (learning rate {args.lr}) the same checkpoint, as the classic table fine-tuned a "
        f"pretrained t5-small: pre-trained once by the bench with plain DDP --bf16 on the same data, "
        f"{pretrained['recipe']['samples']} samples, dropout 0, learning rate {pretrained['recipe']['lr']} "
        f"({pretrained['seconds']} s; its BLEU on 200 validation sentences: {pretrained['val_bleu_200']:.2f}).", "",
        "| run | largest batch / rank | vs baseline | peak RSS at it (GiB) | train time (s) | eval time (s) | BLEU |",
        "|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for row, r in results.items():
        name = ROWS[row][0]
        if "largest_batch" not in r:
            lines.append(f"| {name} | skipped: {r.get('skipped')} |  |  |  |  |  |")
            continue
        peak = next((p["peak_rss_bytes"] for p in r["search"] if p["batch"] == r["largest_batch"]), None)
        ratio = f"{r['largest_batch'] / base['largest_batch']:.2f}x" if base.get("largest_batch") else "-"
        t = r.get("train", {})
        cells = [f"{t['train_s']:.0f}", f"{t['eval_s']:.0f}", f"{t['bleu']:.2f}"] if "bleu" in t else [t.get("skipped", "-"), "", ""]
        lines.append(f"| {name} | {r['largest_batch']} | {ratio} | {peak / gib if peak else 0:.2f} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    write_markdown(RESULTS / "seed_table.md", text)
    (RESULTS / "seed_table.json").write_text(json.dumps({"args": vars(args), "pretrained": pretrained, "rows": results}, indent=1))
    chart(results)
    return text


def chart(results: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in results if "largest_batch" in results[r]]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.barh([ROWS[r][0] for r in rows], [results[r]["largest_batch"] for r in rows], color="#4c72b0")
    ax.set_xlabel("largest batch per rank within the budget")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(RESULTS / "seed_table.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--budget", default="2.2GiB", help="peak RSS per rank")
    parser.add_argument("--samples", type=int, default=2048, help="training samples of the timed run")
    parser.add_argument("--n_val", type=int, default=500)
    parser.add_argument("--lr", default="3e-5", help="learning rate of the rows' fine-tuning")
    parser.add_argument("--pretrain_samples", type=int, default=32768, help="samples of the one pre-training run")
    parser.add_argument("--pretrain_lr", default="1e-3", help="learning rate of the pre-training run")
    args = parser.parse_args()
    ensure_env()
    if Path(sys.prefix).resolve() != VENV.resolve():
        os.execv(str(PY), [str(PY), __file__, *sys.argv[1:]])  # the rest runs in the bench environment
    ensure_model()
    pretrained = ensure_pretrained(args.pretrain_samples, args.pretrain_lr)
    for name, config in DS_CONFIGS.items():
        (WORK / name).write_text(json.dumps(config, indent=1))
    from trainer_shard.config.load import parse_size

    budget = parse_size(args.budget)
    global CUDA
    import torch

    CUDA = torch.cuda.is_available()
    if CUDA:
        ENV["PEAK_CUDA_BUDGET"] = str(budget)  # tests/helpers/peak_rss.py: set_per_process_memory_fraction
        print(f"CUDA: the budget {args.budget} is enforced on each GPU; peak = torch.cuda.max_memory_allocated")
    else:
        print(f"no CUDA device: the budget {args.budget} is CPU RAM per rank (peak RSS); the GPU path "
              "(set_per_process_memory_fraction) is skipped")  # fmt: skip
    results = {}
    for row in args.rows:
        print(f"{row}: searching the largest batch within {args.budget}", flush=True)
        batch, log = largest_batch(row, budget)
        results[row] = {"largest_batch": batch, "search": log} if batch else {"skipped": "batch 1 does not fit", "search": log}
    common = results.get("ddp", {}).get("largest_batch") or 8
    for row in args.rows:
        if results[row].get("largest_batch"):
            print(f"{row}: training {args.samples} samples at batch {common}", flush=True)
            results[row]["train"] = train_and_eval(row, common, args.samples, args.n_val, args.lr)
        write(results, args, pretrained)
    print(write(results, args, pretrained))


if __name__ == "__main__":
    main()
