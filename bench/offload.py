#!/usr/bin/env python
"""Offload side by side, one process: plain fp32 AdamW, bf16, trainer_shard CPU and disk offload,
and DeepSpeed ZeRO-2 with CPU offload, on the same model, data and batch; plus one optimizer
step of the same shard size by trainer_shard's offload engine and by DeepSpeed's CPU Adam.

    python bench/offload.py                       # everything, writes bench/results/offload.{md,json}
    python bench/offload.py --rows fp32 disk --steps 6

Not a test: it takes about 15 minutes. It runs in bench/.venv (see bench/sharding.py). The
model is the t5-large architecture (738 M parameters: d_model 1024, d_ff 4096, 24+24 layers,
16 heads, vocabulary 32128; random init, saved in fp32 as a fine-tuning run starts from) on
the demo English-Romanian data. Run nothing else meanwhile: the DeepSpeed row peaks near 20 GB. Each row is its own process, so its peak RSS
(ru_maxrss) is its own: model load, training steps and the store, everything but the page cache.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
from infinity import disk_bandwidth  # noqa: E402
from sharding import DATA, PY, RESULTS, ROOT, VENV, WORK, ensure_env, run, train_flags  # noqa: E402
from _results import cpu_name, write_markdown  # noqa: E402

MODEL = WORK / "t5-large-arch"
# the optimizer-step rows (see _offload_worker.adam): clipped at 1.0 (the default) and unclipped
ADAM_ROWS = ("ours_bf16", "ours_fp32", "deepspeed", "ours_fp32_noclip", "deepspeed_noclip")
STORE = WORK / "offload_store"
ROW_ENV = {"disk_copies": {"TRAINER_SHARD_NO_MMAP": "1"}}  # the disk store's chunks read and written as copies
# the rows whose ratio the step-time claim rests on: run `--rounds` times, interleaved, the
# median round kept (this machine's step times drift by 30% from one minute to the next)
ROUNDED = ("fp32", "cpu", "disk")

ROWS = {
    "fp32": ("plain Trainer, fp32, fused AdamW", []),
    "bf16": ("plain Trainer, --bf16 (autocast, fp32 weights)", ["--bf16"]),
    "bf16_zero": ("trainer_shard --bf16, ZeRO-2 path, no offload", ["--bf16", "--sharded_ddp", "zero_dp_2"]),
    "cpu": ("trainer_shard --bf16 --offload (CPU RAM)", ["--bf16", "--offload", WORK / "offload_cpu.json"]),
    "cpu_fp32_grads": ("trainer_shard --bf16 --offload (CPU RAM, fp32 gradient shard)",
                       ["--bf16", "--offload", WORK / "offload_cpu_fp32_grads.json"]),
    "disk": ("trainer_shard --bf16 --offload (disk)", ["--bf16", "--offload", WORK / "offload_disk.json"]),
    "disk_copies": ("trainer_shard --bf16 --offload (disk), chunks copied (TRAINER_SHARD_NO_MMAP=1)",
                    ["--bf16", "--offload", WORK / "offload_disk.json"]),
    "deepspeed": ("DeepSpeed 0.19 ZeRO-2, CPU offload, --bf16", ["--bf16", "--deepspeed", WORK / "ds_offload.json"]),
}

CONFIGS = {
    "offload_cpu.json": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                         "bf16": {"enabled": "auto"}, "gradient_clipping": "auto"},
    "offload_cpu_fp32_grads.json": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                                    "data_types": {"grad_accum_dtype": "fp32"},
                                    "bf16": {"enabled": "auto"}, "gradient_clipping": "auto"},
    "offload_disk.json": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme",
                                                "nvme_path": str(STORE), "buffer_count": 4}},
                          "bf16": {"enabled": "auto"}, "gradient_clipping": "auto"},
    "ds_offload.json": {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                              "overlap_comm": False, "contiguous_gradients": True},
                        "bf16": {"enabled": "auto"}, "zero_allow_untested_optimizer": True,
                        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                        "gradient_clipping": "auto"},
}  # fmt: skip


def ensure_model() -> None:
    if not (DATA / "train.source").exists():  # a fresh checkout: the demo data made here, as make demo does
        run([PY, ROOT / "scripts" / "make_demo_data.py", "--out_dir", DATA])
    if not (MODEL / "config.json").exists():
        run([PY, ROOT / "scripts" / "build_demo_model.py", "--data_dir", DATA, "--out_dir", MODEL, "--d_model", "1024",
             "--d_ff", "4096", "--num_layers", "24", "--num_heads", "16", "--d_kv", "64", "--model_vocab_size", "32128"])  # fmt: skip
    WORK.mkdir(parents=True, exist_ok=True)
    for name, config in CONFIGS.items():
        (WORK / name).write_text(json.dumps(config, indent=1))


def flags(row: str, steps: int, batch: int) -> list:
    return train_flags(MODEL, WORK / "out" / row, steps, batch, lr="1e-4", length=32, logging_steps=1,
                       extra=["--n_train", "256", *ROWS[row][1]])  # fmt: skip


def worker(args: list, out: Path, timeout: int, env_extra: dict | None = None) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_EVALUATE_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(env_extra or {}))
    log = RESULTS / "raw" / f"offload_{out.stem}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    started = time.time()
    try:
        with log.open("w") as f:
            proc = subprocess.run([str(PY), str(ROOT / "bench" / "_offload_worker.py"), *map(str, args)], env=env,
                                  stdout=f, stderr=subprocess.STDOUT, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"skipped": f"did not finish in {timeout} s"}
    if proc.returncode != 0 or not out.exists():
        tail = [line for line in log.read_text(errors="replace").splitlines() if "Error" in line or "error" in line]
        return {"skipped": f"exit {proc.returncode}: {(tail or ['see ' + str(log)])[-1][:300]}"}
    return dict(json.loads(out.read_text()), wall_s=time.time() - started)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gb(n) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def disk_lines(results: dict, bandwidth: dict | None) -> list:
    """What the disk costs the step, against what the bytes it moved take at the disk's bandwidth."""
    cpu = results.get("cpu")
    rows = [row for row in ("disk", "disk_copies") if row in results and "skipped" not in results[row]]
    if not rows or not bandwidth:
        return []
    written = "an overwrite, fsync'd, as the store's steps" if bandwidth.get("overwrite") else "fsync'd, a new file"
    lines = ["", f"Disk under the store, measured in this run (bench/infinity.py's `disk_bandwidth`, "
             f"{bandwidth['bytes'] / 2**30:.0f} GiB): write {bandwidth['write'] / 1e9:.2f} GB/s ({written}), read "
             f"{bandwidth['read'] / 1e9:.2f} GB/s (page cache dropped). Bytes a step: what the process read from and "
             "wrote to storage (/proc/self/io, median over the timed steps; a page the step dirtied counts when the "
             "kernel writes it back). The disk's cost to the step: the row's step time minus the CPU-offload row's. "
             "Its fraction of the bound: that cost over bytes / bandwidth.", "",
             "| run | written / step | read / step | bytes / bandwidth | step (s) | disk's cost to the step (s) | fraction of the bound |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for row in rows:
        r = results[row]
        io = r.get("disk_io") or {}
        bound = io.get("write_bytes", 0) / bandwidth["write"] + io.get("read_bytes", 0) / bandwidth["read"]
        cost = r["median_step_s"] - cpu["median_step_s"] if cpu and "skipped" not in cpu else None
        lines.append(f"| {ROWS[row][0]} | {io.get('write_bytes', 0) / 1e9:.2f} GB | {io.get('read_bytes', 0) / 1e9:.2f} GB "
                     f"| {bound:.2f} s | {r['median_step_s']:.2f} | {'-' if cost is None else f'{cost:.2f}'} "
                     f"| {'-' if cost is None or not bound else f'{cost / bound:.2f}'} |")  # fmt: skip
    return lines


def paired_lines(results: dict) -> list:
    """Each interleaved row against plain fp32 run in the same round (the machine's drift hits both)."""
    base = (results.get("fp32") or {}).get("rounds") or []
    lines = []
    for row in ROUNDED:
        runs = (results.get(row) or {}).get("rounds") or []
        if row == "fp32" or len(runs) < 2 or len(runs) != len(base):
            continue
        ratios = [ours / plain for ours, plain in zip(runs, base)]
        lines.append(f"- {ROWS[row][0]}, against plain fp32 of the same round: "
                     f"{', '.join(f'{x:.2f}x' for x in ratios)} (median {median(ratios):.2f}x)")  # fmt: skip
    return ["", "Per round:", "", *lines] if lines else []


def table(results: dict, adam: dict, args, bandwidth: dict | None = None) -> str:
    base = results.get("fp32")
    base = base if base and "skipped" not in base else None
    ran = [r for r in results.values() if "skipped" not in r]
    params = ran[0]["parameters"] if ran else 0
    lines = [
        f"CPU: {cpu_name()}. One process, {os.cpu_count()} CPU cores, T5 of {params / 1e6:.0f} M parameters "
        f"(random init), batch "
        f"{args.batch}, source/target length 32, {args.steps} steps; step time: median of steps 3-{args.steps}. "
        "Peak RSS: the row's process (ru_maxrss), from start to end, model load included. "
        f"Rows {', '.join(ROUNDED)}: {args.rounds} runs each, interleaved, the run with the median step time "
        "shown (each run's in `rounds` in offload.json), with the spread of the runs (min-max).",
        "",
        "| run | step time (s) | spread (s) | vs fp32 | peak RSS (GiB) | vs fp32 | offloaded state | final loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row, r in results.items():
        name = ROWS[row][0]
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} |  |  |  |  |  |  |")
            continue

        def ratio(key):
            return f"{r[key] / base[key]:.2f}x" if base else "-"

        offload = r.get("offload") or {}
        where = f"{gb(offload['offload_bytes'])} GiB in {offload['offload_device']}" if "offload_bytes" in offload else "-"
        loss = "n/a" if r["final_loss"] is None else f"{r['final_loss']:.4f}"
        runs = r.get("rounds") or []
        spread = f"{min(runs):.2f}-{max(runs):.2f}" if len(runs) > 1 else "-"
        lines.append(f"| {name} | {r['median_step_s']:.2f} | {spread} | {ratio('median_step_s')} "
                     f"| {gb(r['peak_rss_bytes'])} | {ratio('peak_rss_bytes')} | {where} | {loss} |")  # fmt: skip
    lines += paired_lines(results)
    lines += disk_lines(results, bandwidth)
    if adam:
        numel = next((r["numel"] for r in adam.values() if "numel" in r), 0)
        lines += ["", f"One AdamW step of a {numel / 1e6:.0f} M-element shard, fp32 master and moments in CPU RAM, "
                  f"bf16 parameters updated (each row: median over {args.adam_rounds} interleaved processes of the median of 7 steps "
                  "after a warm-up step; gradients in place and their norm computed before the timer, on both sides). "
                  "DeepSpeed's step is what its ZeRO-2 CPU-offload step does to a partition (stage_1_and_2.py: "
                  "multiply by the clip factor, DeepSpeedCPUAdam, fp32 -> 16-bit buffer -> 16-bit parameters); "
                  "each row is compared with DeepSpeed's under the same clipping:",
                  "", "| optimizer step | gradient clipping | gradient in | step (s) | vs DeepSpeed's step | vs DeepSpeedCPUAdam alone |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        names = {"ours_bf16": ("trainer_shard offload engine (default)", "bf16 shard, upcast per chunk"),
                 "ours_fp32": ("trainer_shard offload engine, grad_accum_dtype fp32", "fp32 shard"),
                 "deepspeed": ("DeepSpeed ZeRO-2 offload step", "fp32 partition")}  # fmt: skip
        for row, r in adam.items():
            clipped = not row.endswith("_noclip")
            name, grad = names[row.removesuffix("_noclip")]
            clipping = "1.0 (default)" if clipped else "off"
            if "skipped" in r:
                lines.append(f"| {name} | {clipping} | {grad} | skipped: {r['skipped']} |  |  |")
                continue
            ds = adam.get("deepspeed" if clipped else "deepspeed_noclip")
            ds_ok = ds is not None and "skipped" not in ds
            vs = f"{r['median_step_s'] / ds['median_step_s']:.2f}x" if ds_ok else "-"
            vs_alone = f"{r['median_step_s'] / ds['median_adam_s']:.2f}x" if ds_ok else "-"
            lines.append(f"| {name} | {clipping} | {grad} | {r['median_step_s']:.3f} | {vs} | {vs_alone} |")
            if row.startswith("deepspeed"):
                lines.append(f"| (its DeepSpeedCPUAdam.step alone) | {clipping} | fp32 partition | {r['median_adam_s']:.3f} "
                             f"| {r['median_adam_s'] / r['median_step_s']:.2f}x | 1.00x |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--no_adam", action="store_true", help="skip the optimizer-step comparison")
    parser.add_argument("--adam_only", action="store_true",
                        help="rerun only the optimizer-step comparison; the training rows come from offload.json")
    parser.add_argument("--adam_rounds", type=int, default=3, help="interleaved rounds of the optimizer-step rows")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per row")
    parser.add_argument("--rounds", type=int, default=3,
                        help=f"runs of each of {', '.join(ROUNDED)}, interleaved; the median one is kept")
    args = parser.parse_args()
    ensure_env()
    if Path(sys.prefix).resolve() != VENV.resolve():
        os.execv(str(PY), [str(PY), __file__, *sys.argv[1:]])  # the rest runs in the bench environment
    ensure_model()
    raw = RESULTS / "raw"
    results = {}
    command = "python bench/offload.py " + " ".join(sys.argv[1:])
    train_command = command.strip()
    if args.adam_only:
        previous = json.loads((RESULTS / "offload.json").read_text())
        results, train_command = previous["train"], previous.get("train_command", "python bench/offload.py")
    bandwidth = None
    if not args.adam_only and any(row.startswith("disk") for row in args.rows):
        bandwidth = disk_bandwidth(WORK / "disk_bandwidth", overwrite=True)  # the disk under the store, in this invocation
        print("disk", json.dumps(bandwidth), flush=True)
    rounds = {}
    order = [] if args.adam_only else list(args.rows)
    order += [row for _ in range(args.rounds - 1) for row in args.rows if row in ROUNDED]
    for row in order:
        # DeepSpeed outside its launcher looks for MPI unless told it is rank 0 of 1
        env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(free_port())} if row == "deepspeed" else ROW_ENV.get(row)  # fmt: skip
        result = worker(["train", row, raw / f"{row}.json", "--", *flags(row, args.steps, args.batch)],
                        raw / f"{row}.json", args.timeout, env)  # fmt: skip
        print(row, json.dumps({k: v for k, v in result.items() if k != "step_times"}), flush=True)
        rounds.setdefault(row, []).append(result)
        shutil.rmtree(WORK / "out" / row, ignore_errors=True)  # the row's saved model: up to 3 GB each
    for row, runs in rounds.items():
        ok = sorted((r for r in runs if "skipped" not in r), key=lambda r: r["median_step_s"])
        times = [round(r["median_step_s"], 3) for r in runs if "skipped" not in r]  # in the order run
        results[row] = dict(ok[(len(ok) - 1) // 2], rounds=times) if ok else runs[0]
    if "disk" in results and "skipped" not in results["disk"]:
        results["disk"]["store_removed"] = not any(STORE.glob("rank*"))
    adam = {}
    if not args.no_adam:
        numel = next((r["parameters"] for r in results.values() if "parameters" in r), 737_668_096)
        runs = {row: [] for row in ADAM_ROWS}
        for _ in range(args.adam_rounds):  # interleaved: the machine's noise hits every row alike
            for row in runs:
                r = worker(["adam", row, raw / f"adam_{row}.json", numel], raw / f"adam_{row}.json", args.timeout)
                print("adam", row, json.dumps({k: v for k, v in r.items() if k != "step_times"}), flush=True)
                runs[row].append(r)
        for row, rs in runs.items():
            ok = [r for r in rs if "skipped" not in r]
            adam[row] = rs[0] if not ok else dict(
                ok[0], median_step_s=median(r["median_step_s"] for r in ok), rounds=[round(r["median_step_s"], 3) for r in ok],
                **{key: median(r[key] for r in ok) for key in ("median_copy_s", "median_adam_s") if key in ok[0]})  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.adam_only:
        bandwidth = previous.get("disk_bandwidth")
    (RESULTS / "offload.json").write_text(json.dumps({"train": results, "adam": adam, "train_command": train_command,
                                                      "adam_command": command.strip(), "disk_bandwidth": bandwidth},
                                                     indent=1))  # fmt: skip
    commands = f"`{train_command}`" if train_command == command.strip() else \
        f"`{train_command}` (training rows), then `{command.strip()}` (optimizer-step rows)"  # fmt: skip
    text = f"# Offload benchmark\n\nCommand: {commands}\n\n" + table(results, adam, args, bandwidth)
    write_markdown(RESULTS / "offload.md", text)
    print(text)


if __name__ == "__main__":
    main()
