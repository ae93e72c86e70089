#!/usr/bin/env python
"""How far bf16 training with offload lands from bf16 training without it, next to how far two
bf16 runs without offload land from each other when only the seed (data order, dropout) changes.

    .venv/bin/python bench/bf16_tolerance.py   # writes bench/results/bf16_tolerance.{md,json}

The demo model and data (make demo builds them), one process, --bf16, ZeRO-2 path (16-bit
parameters, fp32 master weights): no offload with seeds 42 and 43, CPU offload and disk offload
with seed 42. Reported: final training loss, eval loss on 200 validation pairs, and the largest
weight difference from the seed-42 run without offload.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from _results import write_markdown  # bench/_results.py (these run as scripts: bench/ is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
PY = ROOT / ".venv" / "bin" / "python"
WORK = ROOT / "bench" / "work" / "bf16_tolerance"
RESULTS = ROOT / "bench" / "results"

GA = ["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "4"]
RUNS = {
    "no offload, seed 42": ["--seed", "42"],
    "no offload, seed 43": ["--seed", "43"],
    "CPU offload, seed 42": ["--seed", "42", "--offload", str(ROOT / "configs" / "offload_cpu.json")],
    "disk offload, seed 42": ["--seed", "42", "--offload", str(WORK / "offload_disk.json")],
    # accumulation over 4 micro-batches: the one place the offloaded bf16 gradient shard differs
    "accumulating 4 x 8, no offload, seed 42": ["--seed", "42", *GA],
    "accumulating 4 x 8, no offload, seed 43": ["--seed", "43", *GA],
    "accumulating 4 x 8, CPU offload, seed 42": ["--seed", "42", *GA, "--offload", str(ROOT / "configs" / "offload_cpu.json")],
}
BASE = {name: "accumulating 4 x 8, no offload, seed 42" if name.startswith("accumulating") else "no offload, seed 42"
        for name in RUNS}  # fmt: skip


def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    disk = json.loads((ROOT / "configs" / "offload_disk.json").read_text())
    disk["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(WORK / "store")
    (WORK / "offload_disk.json").write_text(json.dumps(disk))
    results = {}
    for i, (name, extra) in enumerate(RUNS.items()):
        out = WORK / f"run{i}"
        cmd = [PY, ROOT / "scripts" / "finetune_trainer.py", "--model_name_or_path", ROOT / "data" / "demo_t5",
               "--data_dir", ROOT / "data" / "demo_en_ro", "--task", "translation_en_to_ro", "--output_dir", out,
               "--overwrite_output_dir", "--do_train", "--do_eval", "--n_val", "200", "--use_cpu", "--bf16",
               "--sharded_ddp", "zero_dp_2", "--max_steps", "300", "--per_device_train_batch_size", "32",
               "--learning_rate", "2e-3", "--warmup_steps", "30", "--weight_decay", "0.01", "--max_grad_norm", "1.0",
               "--max_source_length", "64", "--max_target_length", "64", "--logging_steps", "50",
               "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", *extra]  # fmt: skip
        print("+", name, flush=True)
        subprocess.run([str(c) for c in cmd], check=True, capture_output=True, env=dict(os.environ, HF_HUB_OFFLINE="1", HF_EVALUATE_OFFLINE="1"))
        metrics = json.loads((out / "all_results.json").read_text())
        results[name] = {"train_loss": metrics["train_loss"], "eval_loss": metrics["val_loss"],
                         "weights": str(out / "model.safetensors")}  # fmt: skip
    weights = {name: load_file(r.pop("weights")) for name, r in results.items()}
    for name, r in results.items():
        base, other = weights[BASE[name]], weights[name]
        r["max_weight_diff"] = max((other[k].float() - base[k].float()).abs().max().item() for k in base)
        r["mean_weight_diff"] = sum((other[k].float() - base[k].float()).abs().mean().item() for k in base) / len(base)
        r["eval_loss_vs_base"] = r["eval_loss"] - results[BASE[name]]["eval_loss"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bf16_tolerance.json").write_text(json.dumps(results, indent=1))
    lines = ["# bf16: offload against the run-to-run spread", "", "Command: `.venv/bin/python bench/bf16_tolerance.py`", "",
             "Demo model (0.97 M parameters) and data, one process, --bf16 (ZeRO-2 path: 16-bit parameters, fp32 "
             "masters), 300 steps of 32 examples, lr 2e-3. Differences are to the seed-42 run without offload of the "
             "same batch layout.", "",
             "| run | train loss | eval loss | eval loss difference | max weight diff | mean weight diff |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in results.items():
        lines.append(f"| {name} | {r['train_loss']:.4f} | {r['eval_loss']:.4f} | {r['eval_loss_vs_base']:+.4f} "
                     f"| {r['max_weight_diff']:.3g} | {r['mean_weight_diff']:.3g} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    write_markdown(RESULTS / "bf16_tolerance.md", text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
