"""`trainer-shard estimate`'s zero_dp_3 rows against the measured peak RSS of ZeRO-3 training.

    python bench/planner_zero3.py                      # t5-small and t5-base, fp32 and bf16
    python bench/planner_zero3.py --models t5-small --precisions fp32 --rows zero_dp_3

For each T5 architecture (random init, no download) and precision: the planner's probe (the
subprocess `--sharded_ddp auto` runs, here with OMP_NUM_THREADS=1 as torchrun gives its ranks)
and its estimate at batch 8 per rank, source and target length 32 (what tests/test_planner.py's
runs pad to: TINY_FLAGS truncate at 32); then one `torch.distributed.run --nproc_per_node 2` (gloo)
per row, in which each rank imports what training imports (so its runtime is the probe's),
builds the model (seed 0, the config `planner.model_config` gives), shards it and trains STEPS
(8) steps on random token batches of that shape (with glibc's allocator the peak still rose over
the first 3 or 4 steps: the rows give VmHWM after each step):
- zero_dp_3: `shard_model(model, units=<the model's _no_split_modules>)` (T5Block), fused AdamW
  on `shard_parameters()`, `clip_grad_norm_(1.0)`: the plain loop of scripts/zero3_loop.py (the
  Trainer's zero_dp_3 was not wired yet);
- zero_dp_2: `ShardedOptimizer(stage=2)`, fused AdamW, `clip_grad_norm(1.0)`, a reference for
  the method: this row is checked through the Trainer by bench/planner_trainer.py.

Measured per rank: the peak RSS of the whole process (ru_maxrss, as bench/planner_trainer.py's Trainer
runs), and net of what the rank held before building the model (VmRSS then), compared with the
estimate net of the probe's runtime; the larger of the two ranks. Writes
bench/results/planner_zero3.md and .json.
"""

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from _results import write_markdown  # noqa: E402

BATCH, LENGTH, STEPS, WORLD = 8, 32, 8, 2
TOLERANCE = 0.15
ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
MiB = 2**20


# ---- one rank (under torch.distributed.run) ------------------------------------------------------


def worker(row: str, model_name: str, precision: str, length: int, batch: int, steps: int, out: Path) -> None:
    import resource

    import torch
    import torch.distributed as dist
    from transformers import AutoModelForSeq2SeqLM, Seq2SeqTrainer  # noqa: F401  (what training imports)

    from trainer_shard import finetune, metrics, planner  # noqa: F401
    from trainer_shard.dtypes import half_dtype

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        before = planner._rss()  # what the process holds before the model (the probe's runtime)
        torch.manual_seed(0)
        config = planner.model_config(model_name)
        model = AutoModelForSeq2SeqLM.from_config(config)
        if half_dtype(precision) is not None:
            model.to(half_dtype(precision))  # 16-bit parameters, fp32 masters in the shards
        model.train()
        extra = {}
        if row == "zero_dp_3":
            from trainer_shard.sharding import shard_model

            classes = set(model._no_split_modules or ())
            sharded = shard_model(model, units=[m for m in model.modules() if type(m).__name__ in classes])
            opt = torch.optim.AdamW(sharded.shard_parameters(), lr=1e-4, fused=True)

            def step(loss):
                loss.backward()
                sharded.clip_grad_norm_(1.0)
                opt.step()
                opt.zero_grad()

            def accounting():
                return {**sharded.held_parameter_bytes(), "peak_bucket_bytes": sharded.reducer.peak_bucket_bytes,
                        "pool_buffers": sharded.pool.created, "pool_bytes": sharded.pool.created_bytes}  # fmt: skip
        elif row == "zero_dp_2":
            from trainer_shard.sharding import ShardedOptimizer

            opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, fused=True, lr=1e-4)

            def step(loss):
                loss.backward()
                opt.clip_grad_norm(1.0)
                opt.step()
                opt.zero_grad()

            def accounting():
                return {k: v for k, v in opt.shard_bytes().items() if isinstance(v, int)}
        else:
            raise SystemExit(f"unknown row {row!r}")
        setup_peak = planner._peak("cpu")
        peaks = []
        for s in range(steps):
            g = torch.Generator().manual_seed(1000 * (rank + 1) + s)
            ids = torch.randint(2, config.vocab_size, (batch, length), generator=g)
            labels = torch.randint(2, config.vocab_size, (batch, length), generator=g)
            step(model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss)
            peaks.append(planner._peak("cpu"))
        extra["accounting"] = accounting()
        result = {"rank": rank, "before_model": before, "setup_peak": setup_peak, "step_peaks": peaks,
                  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, **extra}  # fmt: skip
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


# ---- the driver ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_row(row: str, model: str, precision: str, args) -> list:
    tmp = Path(tempfile.mkdtemp(prefix=f"planner-{row}-"))
    try:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD), "--master_addr",
               "127.0.0.1", "--master_port", str(free_port()), __file__, "--_worker", row, model, precision,
               str(args.length), str(args.batch), str(args.steps), str(tmp / "out")]  # fmt: skip
        env = {**os.environ, **ENV, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=tmp)
        ranks = [json.loads(p.read_text()) for p in sorted((tmp / "out").glob("rank*.json"))]
        if proc.returncode or len(ranks) != WORLD:
            raise RuntimeError(f"{row} {model} {precision} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
        return ranks
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def measure(model: str, precision: str, rows: list, args) -> list:
    from trainer_shard import planner

    os.environ.update(ENV)  # the probe's process: as training's ranks are started
    started = time.time()
    probes = planner.measure_probes(model, precision, args.length, args.length)
    probe_s = time.time() - started
    config = planner.model_config(model)
    estimates = planner.estimate(config, world_size=WORLD, precision=precision, batch_size=args.batch,
                                 source_length=args.length, target_length=args.length, probes=probes)  # fmt: skip
    total, trainable = planner.count_parameters(config)
    units = planner.zero3_units(config, WORLD)
    results = []
    for row in rows:
        estimate = next(r for r in estimates if (r["strategy"], r["offload"]) == (row, "none"))
        probe = probes["sharded"]
        parts = planner.strategy_bytes(row, None, total, trainable, WORLD, precision, units)["device"]
        started = time.time()
        ranks = run_row(row, model, precision, args)
        worst = max(ranks, key=lambda r: r["peak"])
        results.append({
            "model": model, "precision": precision, "row": row, "parameters": total,
            "wall_s": round(time.time() - started, 1), "probe_s": round(probe_s, 1), "runtime": probe.runtime,
            "activations": probe.activations(args.batch), "state": parts, "estimate": estimate["per_rank"],
            "measured": worst["peak"], "estimate_net": estimate["per_rank"] - probe.runtime,
            "measured_net": worst["peak"] - worst["before_model"], "before_model": worst["before_model"],
            "setup_peak": worst["setup_peak"], "step_peaks": worst["step_peaks"], "accounting": worst["accounting"],
        })  # fmt: skip
        r = results[-1]
        print(f"{model} {precision} {row}: estimate {r['estimate'] / MiB:,.0f} MiB, measured "
              f"{r['measured'] / MiB:,.0f} MiB ({r['estimate'] / r['measured'] - 1:+.1%}); net of the runtime "
              f"{r['estimate_net'] / MiB:,.0f} vs {r['measured_net'] / MiB:,.0f} MiB "
              f"({r['estimate_net'] / r['measured_net'] - 1:+.1%}); {r['wall_s']} s", flush=True)  # fmt: skip
    return results


def table(results: list) -> str:
    lines = ["| model | precision | row | estimate (MiB) | measured peak (MiB) | error | estimate net of the runtime "
             "(MiB) | measured net (MiB) | error | estimate: state + gathered / activations / runtime (MiB) "
             "| measured: before the model / after setup (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        cells = [r["model"], r["precision"], r["row"], f"{r['estimate'] / MiB:,.0f}", f"{r['measured'] / MiB:,.0f}",
                 f"{r['estimate'] / r['measured'] - 1:+.1%}", f"{r['estimate_net'] / MiB:,.0f}",
                 f"{r['measured_net'] / MiB:,.0f}", f"{r['estimate_net'] / r['measured_net'] - 1:+.1%}",
                 f"{r['state'] / MiB:,.0f} / {r['activations'] / MiB:,.0f} / {r['runtime'] / MiB:,.0f}",
                 f"{r['before_model'] / MiB:,.0f} / {r['setup_peak'] / MiB:,.0f}"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def notes(results: list) -> str:
    out = []
    for r in results:
        a = r["accounting"]
        if r["row"] == "zero_dp_3":
            out.append(f"- {r['model']} {r['precision']} zero_dp_3, by the engine's accounting (MiB): shards "
                       f"{a['shards'] / MiB:,.0f}, fp32 gradient shards {a['grad_shards'] / MiB:,.0f}, masters "
                       f"{a['masters'] / MiB:,.0f}, persistent {a['persistent'] / MiB:,.1f}, gather pool "
                       f"{a['pool_bytes'] / MiB:,.0f} in {a['pool_buffers']} buffers, peak reduce buckets "
                       f"{a['peak_bucket_bytes'] / MiB:,.0f}; VmHWM after each step "
                       f"{[round(p / MiB) for p in r['step_peaks']]}")  # fmt: skip
    return "\n".join(out)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_worker":
        row, model, precision, length, batch, steps, out = sys.argv[2:9]
        return worker(row, model, precision, int(length), int(batch), int(steps), Path(out))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["t5-small", "t5-base"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--rows", nargs="+", default=["zero_dp_3", "zero_dp_2"])
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--length", type=int, default=LENGTH)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "planner_zero3")
    args = parser.parse_args()
    started = time.time()
    results = [r for m in args.models for p in args.precisions for r in measure(m, p, args.rows, args)]
    worst = max(abs(r["estimate_net"] / r["measured_net"] - 1) for r in results)
    command = "python bench/planner_zero3.py " + " ".join(sys.argv[1:])
    text = (f"# Planner: zero_dp_3 estimates against measured peaks\n\nCommand: `{command.strip()}` "
            f"({time.time() - started:.0f} s; load average at the end {os.getloadavg()[0]:.2f})\n\n"
            f"2 gloo ranks on the CPU, batch {args.batch} per rank, source and target length {args.length}, "
            f"{args.steps} steps; see the docstring of bench/planner_zero3.py for the method. Largest error net "
            f"of the runtime: {worst:.1%} (tolerance {TOLERANCE:.0%}).\n\n{table(results)}\n\n"
            f"{notes(results)}\n")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_markdown(args.out.with_suffix(".md"), text)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    print(text)


if __name__ == "__main__":
    main()
