#!/usr/bin/env python
"""Peak memory of `trainer-shard consolidate` against the size of the checkpoint it reads.

    .venv/bin/python bench/consolidate.py            # writes bench/results/consolidate.{md,json}

Trains the t5-large architecture (738 M parameters, bench/work/t5-large-arch, built by
bench/offload.py) for 2 steps on 2 processes with `--sharded_ddp zero_dp_2 --bf16` and CPU
offload, saving a checkpoint (bf16 model + fp32 master and Adam moments in 2 rank shards),
then consolidates it to fp32 safetensors split at 2 GB, in a process of its own whose peak
RSS (ru_maxrss) is measured. Also resumes that checkpoint on one process (2 -> 1), one step.
Runs in the project's .venv (no peer needed); about 5 minutes.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _results import write_markdown  # bench/_results.py (these run as scripts: bench/ is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / "work"
MODEL = WORK / "t5-large-arch"
RESULTS = ROOT / "bench" / "results"
DATA = ROOT / "data" / "demo_en_ro"
OUT = WORK / "consolidate"
BIN = Path(sys.executable).parent
ENV = dict(os.environ, HF_HUB_OFFLINE="1", HF_EVALUATE_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def train(nproc: int, steps: int, *extra) -> None:
    launcher = [BIN / "torchrun", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else [sys.executable]
    cmd = [*launcher, ROOT / "scripts" / "finetune_trainer.py", "--model_name_or_path", MODEL, "--data_dir", DATA,
           "--task", "translation_en_to_ro", "--output_dir", OUT / "run", "--do_train", "--use_cpu",
           "--max_steps", str(steps), "--per_device_train_batch_size", "2", "--max_source_length", "16",
           "--max_target_length", "16", "--n_train", "64", "--bf16", "--sharded_ddp", "zero_dp_2 offload",
           "--save_strategy", "steps", "--save_steps", "2", "--report_to", "none", "--disable_tqdm", "true", *extra]  # fmt: skip
    subprocess.run([str(c) for c in cmd], check=True, env=ENV)


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    if not (MODEL / "config.json").is_file():
        sys.exit(f"{MODEL} is missing: run bench/offload.py once (it builds the model)")
    subprocess.run(["rm", "-rf", str(OUT)], check=True)
    train(2, 2)
    checkpoint = OUT / "run" / "checkpoint-2"
    size = du(checkpoint)
    cmd = [BIN / "trainer-shard", "consolidate", checkpoint, OUT / "plain", "--max_shard_size", "2GB"]
    # the command's own process reports its peak (RUSAGE_CHILDREN would count the training runs)
    probe = ("import resource, sys; from trainer_shard.cli import main; code = main(sys.argv[1:]); "
             "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024); sys.exit(code)")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", probe, *map(str, cmd[1:])], check=True, env=ENV, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    peak = int(next(line.split()[1] for line in proc.stdout.splitlines() if line.startswith("PEAK")))

    out_size = du(OUT / "plain")
    train(1, 3, "--resume_from_checkpoint", str(checkpoint))  # 2 ranks -> 1 rank
    state = json.loads((OUT / "run" / "trainer_state.json").read_text())
    result = {"checkpoint_bytes": size, "consolidated_bytes": out_size, "peak_rss_bytes": peak,
              "ratio": peak / size, "seconds": seconds, "resumed_2_to_1_global_step": state["global_step"],
              "command": " ".join(str(c) for c in cmd)}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "consolidate.json").write_text(json.dumps(result, indent=1))
    text = (f"# Consolidation\n\nCommand: `.venv/bin/python bench/consolidate.py`\n\n"
            f"738 M-parameter checkpoint of a 2-rank `zero_dp_2 --bf16` CPU-offload run: {size / 2**30:.2f} GiB "
            f"(bf16 model, fp32 master + Adam moments in 2 shards). `trainer-shard consolidate` -> fp32 safetensors, "
            f"2 GB files ({out_size / 2**30:.2f} GiB): peak RSS {peak / 2**20:.0f} MiB = {peak / size:.3f}x the checkpoint, "
            f"{seconds:.1f} s. The checkpoint then resumed on 1 process (2 -> 1) to step {state['global_step']}.\n")  # fmt: skip
    write_markdown(RESULTS / "consolidate.md", text)
    print(text)
    subprocess.run(["rm", "-rf", str(OUT)], check=True)


if __name__ == "__main__":
    main()
