#!/usr/bin/env python
"""ZeRO-3 side by side: plain PyTorch training loops (no Trainer) under DDP, trainer_shard ZeRO-2,
trainer_shard ZeRO-3 (`shard_model`), torch FSDP2 (`fully_shard`) and DeepSpeed ZeRO-3, at world
size 2 on gloo (CPU).

    python bench/zero3.py                                   # t5-small, all rows
    python bench/zero3.py --model t5-small t5-base --steps 6
    python bench/zero3.py --python /tmp/dsvenv/bin/python   # an existing environment with deepspeed

Not a test: it takes minutes. Every row is its own 2-rank `torch.distributed.run` in a
subprocess with a timeout (its process group killed on expiry), writing into a temporary
directory that is removed after the row; a row that cannot run is reported as skipped, with the
reason. Each row: the t5-small (or t5-base) architecture, random init (seed 0, dropout 0), the
same random token batches (batch 8 per rank, source and target length 64, a cycle of 4 batches
per rank), fused AdamW (lr 3e-4, weight decay 0.01), gradient clipping at 1.0, 2 warm-up steps then
--steps timed steps; see bench/_zero3_worker.py. Without --python it uses bench/.venv, made as
bench/sharding.py makes it (torch 2.13 CPU, this package, DeepSpeed, matplotlib).
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from _results import cpu_name, write_markdown  # bench/_results.py (these run as scripts: bench/ is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "bench" / ".venv"
RESULTS = ROOT / "bench" / "results"

ROWS = {  # row -> (name, extra environment)
    "ddp": ("DDP + fused AdamW", {}),
    "zero2": ("trainer_shard ZeRO-2 (ShardedOptimizer stage=2)", {}),
    "zero3": ("trainer_shard ZeRO-3 (ShardedOptimizer stage=3, units=[T5Block])", {}),
    "fsdp2": ("torch FSDP2 (fully_shard per T5Block + root)", {}),
    "deepspeed_zero3": ("DeepSpeed ZeRO-3 (stage 3, no offload, fp32)", {}),
    # not in the default set: FSDP2 with glibc returning freed gather buffers (DESIGN.md's fact)
    "fsdp2_mmap": ("torch FSDP2, MALLOC_MMAP_THRESHOLD_=65536", {"MALLOC_MMAP_THRESHOLD_": "65536"}),
}
DEFAULT_ROWS = ["ddp", "zero2", "zero3", "fsdp2", "deepspeed_zero3"]
BASE_ENV = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


def run(cmd, **kwargs):
    print("+", " ".join(map(str, cmd)), flush=True)
    return subprocess.run([str(c) for c in cmd], check=True, **kwargs)


def ensure_env(python: Path) -> None:
    if python != VENV / "bin" / "python" or (VENV / ".bench-installed").exists():
        return
    run([sys.executable, "-m", "venv", VENV])
    run([python, "-m", "pip", "install", "--quiet", "torch==2.13.0"])
    run([python, "-m", "pip", "install", "--quiet", "-e", ROOT, "deepspeed", "matplotlib", "torch==2.13.0"])
    (VENV / ".bench-installed").touch()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BASELINE = "zero3_baseline"  # --baseline REV: the zero3 row run from a git worktree of REV, interleaved with the rest


def add_baseline(rev: str) -> Path:
    """A worktree of `rev` (kept under /tmp between invocations) whose trainer_shard and worker
    the zero3_baseline row runs, so an older tree is timed in the same invocation as this one."""
    full = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip
    tree = Path(tempfile.gettempdir()) / f"trainer_shard-bench-{full}"
    if not (tree / "trainer_shard").is_dir():
        run(["git", "-C", ROOT, "worktree", "add", "--force", "--detach", tree, full])
    ROWS[BASELINE] = (f"trainer_shard ZeRO-3 at {full} (the baseline tree, same worker row)", {}, tree)
    return tree


def row_name(result: dict) -> str:
    return result.get("name") or ROWS[result["row"]][0]


def row_tree(row: str) -> Path:
    return ROWS[row][2] if len(ROWS[row]) > 2 else ROOT


def row_env(row: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # glibc defaults unless the row sets them
    env.update(BASE_ENV, PYTHONPATH=str(row_tree(row)), **ROWS[row][1])
    return env


def failure_reason(log: str, rc) -> str:
    lines = [line.strip() for line in log.splitlines() if "ChildFailedError" not in line]
    for marker in ("Error:", "unknown row", "Error", "error", "Killed", "Signal"):
        hits = [line for line in lines if marker in line and "error_file" not in line and "errors.html" not in line]
        if hits:
            return f"exit {rc}: {hits[-1][:400]}"
    return f"exit {rc}: {(lines or ['no output'])[-1][:400]}"


def run_row(python: Path, row: str, model: str, steps: int, timeout: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"zero3-{row}-"))
    try:
        cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", free_port(), row_tree(row) / "bench" / "_zero3_worker.py",
               "zero3" if row == BASELINE else row, model, steps, tmp / "out"]  # fmt: skip
        started = time.time()
        with (tmp / "log").open("w") as log:
            proc = subprocess.Popen([str(c) for c in cmd], env=row_env(row), stdout=log, stderr=subprocess.STDOUT,
                                    cwd=tmp, start_new_session=True)  # fmt: skip
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks: this row's own session
                proc.wait()
                return {"row": row, "skipped": f"did not finish in {timeout} s (killed)"}
        wall = time.time() - started
        ranks = [json.loads(p.read_text()) for p in sorted((tmp / "out").glob("rank*.json"))]
        if rc != 0 or len(ranks) != 2:
            text = (tmp / "log").read_text(errors="replace")
            print(text[-3000:], flush=True)
            return {"row": row, "skipped": failure_reason(text, rc)}
        r0 = ranks[0]
        return {
            "row": row,
            "name": ROWS[row][0],
            "wall_s": round(wall, 1),
            "parameters": r0["parameters"],
            "threads": r0["threads"],
            "median_step_s": median(r["median_step_s"] for r in ranks),
            "step_times_rank0": [round(t, 4) for t in r0["step_times"]],
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
            "peak_rss_loop_bytes": None if r0["peak_rss_loop_bytes"] is None else max(r["peak_rss_loop_bytes"] for r in ranks),
            "peak_rss_build_bytes": max(r["peak_rss_build_bytes"] for r in ranks),
            "param_bytes": max(r["param_bytes"]["total"] for r in ranks),
            "param_detail": r0["param_bytes"],
            "first_loss": r0["first_loss_mean"],
            "final_loss": r0["final_loss_mean"],
            "notes": r0["notes"],
        }  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def versions(python: Path) -> str:
    code = ("import torch, transformers, platform\n"
            "try:\n import deepspeed; ds = deepspeed.__version__\nexcept Exception as e: ds = f'not importable ({type(e).__name__})'\n"
            "print(f'Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, deepspeed {ds}')")  # fmt: skip
    env = dict(row_env("ddp"))
    out = subprocess.run([str(python), "-c", code], env=env, capture_output=True, text=True)
    text = out.stdout.strip().splitlines()
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "trainer_shard"], capture_output=True, text=True)
    tree = f"trainer_shard at {rev.stdout.strip()}" + (" with uncommitted changes" if dirty.stdout.strip() else "")
    return (text[-1] if text else f"versions unknown ({out.stderr.strip()[-200:]})") + f"; {tree}"


def mib(n) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.0f}"


def table(model: str, results: list, args) -> str:
    ddp = next((r for r in results if r["row"] == "ddp" and "skipped" not in r), None)
    z2 = next((r for r in results if r["row"] == "zero2" and "skipped" not in r), None)
    ran = [r for r in results if "skipped" not in r]
    params = ran[0]["parameters"] if ran else 0
    lines = [
        f"### {model} architecture ({params / 1e6:.1f} M parameters)",
        "",
        "| row | step time (s) | vs DDP | vs ZeRO-2 | samples/s | peak RSS / rank (MiB) | peak in the loop (MiB) "
        "| parameters / rank between steps (MiB) | vs DDP | loss step 1 | final loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        name = row_name(r)
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} |  |  |  |  |  |  |  |  |  |")
            continue

        def ratio(base, key):
            return f"{r[key] / base[key]:.2f}x" if base and base[key] else "-"

        lines.append(
            f"| {name} | {r['median_step_s']:.3f} | {ratio(ddp, 'median_step_s')} | {ratio(z2, 'median_step_s')} "
            f"| {2 * 8 / r['median_step_s']:.1f} | {mib(r['peak_rss_bytes'])} | {mib(r['peak_rss_loop_bytes'])} "
            f"| {mib(r['param_bytes'])} | {ratio(ddp, 'param_bytes')} | {r['first_loss']:.4f} | {r['final_loss']:.6f} |"
        )
    notes = [f"{row_name(r)}: {k}: {v}" for r in ran for k, v in r["notes"].items()]
    notes += [f"{row_name(r)}: medians of {len(r['rounds'])} interleaved rounds; each round's step time (s) and "
              f"peak RSS (MiB): {', '.join(f'{t:.3f} / {m:,}' for t, m in r['rounds'])}" for r in ran if "rounds" in r]
    base = next((r for r in ran if r["row"] == BASELINE), None)
    ours = next((r for r in ran if r["row"] == "zero3"), None)
    if base and z2 and ours:
        notes.append(f"{row_name(base)}: {base['median_step_s'] / z2['median_step_s']:.2f}x ZeRO-2 of this tree; "
                     f"this tree's ZeRO-3 {ours['median_step_s'] / base['median_step_s']:.2f}x it and peak RSS "
                     f"{(ours['peak_rss_bytes'] - base['peak_rss_bytes']) / 2**20:+,.0f} MiB against it")  # fmt: skip
    zero3 = next((r for r in ran if r["row"] == "zero3"), None)
    if zero3:
        d = zero3["param_detail"]
        notes.append(f"trainer_shard ZeRO-3 between steps: shards {mib(d['shards'])} MiB + persistent {mib(d['persistent'])} MiB "
                     f"(counted); besides, gather pool kept for reuse {mib(d['pool'])} MiB and fp32 gradient shards "
                     f"{mib(d['grad_shards'])} MiB (not counted).")  # fmt: skip
    ds = next((r for r in ran if r["row"] == "deepspeed_zero3"), None)
    if ds:
        d = ds["param_detail"]
        notes.append(f"DeepSpeed between steps: ds_tensor partitions {mib(d['ds_tensor'])} MiB + persistent parameters "
                     f"held whole {mib(d['persistent_whole'])} MiB (DeepSpeed keeps a partition of those too).")  # fmt: skip
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


def header(meta: dict, args) -> str:
    return (
        "# ZeRO-3 benchmark (plain training loops)\n\n"
        f"Command: `{meta['command']}` (wall time of the invocation: {meta['wall_s']:.0f} s)\n\n"
        + "".join(f"Rows {', '.join(m.get('rows', []))} of {', '.join(m.get('models', []))} rerun and merged by `{m['command']}` "
                  f"({m['wall_s']:.0f} s, load average {m['load']} at its start, CPU: {m.get('cpu', 'not recorded')}).\n\n"
                  for m in meta.get("merged", []))
        + f"CPU: {meta.get('cpu', 'not recorded')}. World size 2"
        f" (one `torch.distributed.run --nproc_per_node 2` per row, gloo, CPU, {meta['cpus']} cores, "
        f"load average {meta['load']} at start), {meta['versions']}. Environment of every rank: "
        f"{', '.join(f'{k}={v}' for k, v in BASE_ENV.items())}, PYTHONPATH=<repo>, no MALLOC_* variables "
        "(glibc's default allocator) unless a row says so; torch threads per rank: "
        f"{meta['threads']}. Model: the architecture, random init (seed 0), dropout 0, fp32. Data: random token "
        "batches of fixed shape (not the demo data): batch 8 per rank, source and target length 64, each rank "
        "cycling through 4 fixed batches; every row sees the same weights and batches. Fused AdamW (lr 3e-4, "
        "weight decay 0.01), gradient clipping at 1.0 (DDP, FSDP2: `torch.nn.utils.clip_grad_norm_`; ZeRO-2: "
        "`clip_grad_norm`; ZeRO-3: `clip_grad_norm_`; DeepSpeed: `gradient_clipping` in its config, with torch's "
        f"fused AdamW as the client optimizer). {meta['steps']} timed steps after 2 warm-up steps; step time: median "
        "over the timed steps (forward + backward + clip + step, after a barrier), median over the 2 ranks. "
        "Peak RSS: VmHWM, max over ranks (whole process: includes building the full model on every rank first); "
        "peak in the loop: VmHWM reset (`/proc/self/clear_refs`) just before the first step. Parameters / rank: "
        "DDP and ZeRO-2 all parameters (ZeRO-2 keeps them whole), ZeRO-3 `held_parameter_bytes()` shards + "
        "persistent, FSDP2 the local shards of the DTensor parameters, DeepSpeed `ds_tensor` partitions + "
        "persistent parameters kept whole. Losses: the mean over both ranks of the first step's and of the last "
        "timed step's training loss.\n\n"
    )


def plot(all_results: dict, path: Path) -> str:
    try:
        import matplotlib
    except ImportError as e:
        return f"no PNG: matplotlib not importable ({e})"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(all_results)
    fig, axes = plt.subplots(len(models), 2, figsize=(13, 4.2 * len(models)), squeeze=False)
    for row_axes, model in zip(axes, models):
        ran = [r for r in all_results[model] if "skipped" not in r]
        names = [r["row"] for r in ran]
        panels = [("median_step_s", f"{model}: step time (s)", 1), ("peak_rss_bytes", f"{model}: peak RSS / rank (MiB)", 2**20)]
        for ax, (key, title, scale) in zip(row_axes, panels):
            ax.bar(names, [r[key] / scale for r in ran], color="#4477aa")
            ax.set_title(title)
            ax.tick_params(axis="x", rotation=25)
    fig.suptitle("ZeRO-3 side by side, world size 2 (CPU, gloo), plain training loops")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return f"wrote {path}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["t5-small"], choices=["t5-small", "t5-base", "tiny"])
    parser.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, choices=list(ROWS))
    parser.add_argument("--steps", type=int, default=8, help="timed steps per row (after 2 warm-up steps)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per row")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every row this many times, interleaved; report medians and each round")  # fmt: skip
    parser.add_argument("--python", type=Path, default=VENV / "bin" / "python",
                        help="the interpreter for the rows and the report (default bench/.venv, made if missing)")  # fmt: skip
    parser.add_argument("--merge", action="store_true",
                        help="keep the other rows and models of the results file (measured on this CPU); replace only those run now")  # fmt: skip
    parser.add_argument("--render", action="store_true", help="only rewrite the table and plot from the results file's JSON")
    parser.add_argument("--out", default="zero3", help="results basename under bench/results (default zero3)")
    parser.add_argument("--baseline", metavar="REV",
                        help="also run the zero3 row from a git worktree of REV, interleaved (a before/after in one run)")  # fmt: skip
    args = parser.parse_args()
    if args.baseline:
        add_baseline(args.baseline)
        args.rows = [*args.rows, BASELINE]
    python = args.python if args.python.is_absolute() else (Path.cwd() / args.python)
    ensure_env(python)
    if Path(sys.prefix).resolve() != python.parent.parent.resolve() and not os.environ.get("ZERO3_BENCH_REEXEC"):
        os.environ["ZERO3_BENCH_REEXEC"] = "1"
        os.execv(str(python), [str(python), __file__, *sys.argv[1:]])  # the rest runs in the bench environment
    if args.render:
        saved = json.loads((RESULTS / f"{args.out}.json").read_text())
        return report(saved["results"], saved["meta"], args)
    started = time.time()
    meta = {"command": "python bench/zero3.py " + " ".join(sys.argv[1:]), "cpus": os.cpu_count(), "cpu": cpu_name(),
            "load": " ".join(f"{x:.2f}" for x in os.getloadavg()), "steps": args.steps,
            "rows": args.rows, "models": args.model, "versions": versions(python)}  # fmt: skip
    print(meta, flush=True)
    all_results, merged_into = {}, None
    if args.merge and (RESULTS / f"{args.out}.json").exists():
        saved = json.loads((RESULTS / f"{args.out}.json").read_text())
        if saved["meta"].get("cpu") != meta["cpu"]:  # rows of two machines in one table would be compared
            sys.exit(f"--merge: {args.out}.json was measured on {saved['meta'].get('cpu', 'a CPU not recorded')}, this "
                     f"machine is {meta['cpu']}; write a table of its own with --out NAME")  # fmt: skip
        all_results, merged_into = saved["results"], saved["meta"]
        merged_into.setdefault("merged", []).append(meta)
    for model in args.model:
        current = {r["row"]: r for r in all_results.get(model, [])}
        runs = {row: [] for row in args.rows}
        for _ in range(args.rounds):  # interleaved: every row once a round, so drifting load hits them alike
            for row in args.rows:
                result = run_row(python, row, model, args.steps, args.timeout)
                print(model, json.dumps({k: v for k, v in result.items() if k != "step_times_rank0"}), flush=True)
                runs[row].append(result)
        for row in args.rows:
            result = combine_rounds(runs[row])
            result["command"] = meta["command"]
            current[row] = result
        order = [r for r in ROWS if r in current] + [r for r in current if r not in ROWS]  # a baseline row last
        all_results[model] = [current[r] for r in order]
        # written after each model, so a long second model still leaves the first one's table
        meta["wall_s"] = time.time() - started  # this invocation's
        shown = merged_into if merged_into is not None else meta
        shown["threads"] = sorted({r["threads"] for rs in all_results.values() for r in rs if "threads" in r}) or "n/a"
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{args.out}.json").write_text(json.dumps({"meta": shown, "args": vars(args) | {"python": str(args.python)},
                                                        "results": all_results}, indent=1))  # fmt: skip
        report(all_results, shown, args)


def combine_rounds(runs: list) -> dict:
    """One row's result over its rounds: the median step time and the median peak RSS, each
    round's kept (`rounds`: [step s, peak RSS MiB] in the order run) to show the spread. A row
    skipped in any round is reported skipped."""
    skipped = next((r for r in runs if "skipped" in r), None)
    if skipped is not None or len(runs) == 1:
        return skipped or runs[0]
    result = dict(runs[len(runs) // 2])
    for key in ("median_step_s", "peak_rss_bytes", "peak_rss_loop_bytes"):
        if all(r[key] is not None for r in runs):
            result[key] = median(r[key] for r in runs)
    result["rounds"] = [[r["median_step_s"], round(r["peak_rss_bytes"] / 2**20)] for r in runs]
    return result


def report(all_results: dict, meta: dict, args) -> None:
    text = header(meta, args) + "\n".join(table(m, rs, args) for m, rs in all_results.items())
    skipped = [f"{m} {r['row']}: {r['skipped']}" for m, rs in all_results.items() for r in rs if "skipped" in r]
    for line in skipped:
        print("skipped:", line)
    write_markdown(RESULTS / f"{args.out}.md", text)
    print(plot(all_results, RESULTS / f"{args.out}.png"))
    print(text)


if __name__ == "__main__":
    main()
