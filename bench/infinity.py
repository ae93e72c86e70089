#!/usr/bin/env python
"""Models bigger than RAM, one process: ZeRO-3 with the parameters, gradients and optimizer state on
disk (`offload_param` + `offload_optimizer` nvme) against plain fp32 training and ZeRO-2 with the
optimizer state on disk, with the disk's sequential bandwidth measured in the same run.

    python bench/infinity.py                       # everything (about an hour), bench/results/infinity.{md,json}
    python bench/infinity.py --rows large --steps 4
    python bench/infinity.py --folder /mnt/nvme/x  # the disk to measure and store on
    python bench/infinity.py --rows large --large-rows deepspeed_zero3_cpu --large-arch tiny  # a smoke test

Rows (bench/_infinity_worker.py; each its own process, its work folder removed after it):
- large: the t5-large architecture (738 M parameters): plain fp32, ZeRO-2 disk, ZeRO-3 disk, then
  the peer, DeepSpeed ZeRO-3 (bench/_infinity_ds_worker.py, run by --python: bench/.venv with
  DeepSpeed, made as bench/zero3.py makes it, DS_ACCELERATOR=cpu): bf16 with fp32 master weights,
  DeepSpeedCPUAdam, `offload_param` and `offload_optimizer` on CPU, then both on nvme (needs
  libaio: where DeepSpeed cannot load its async_io op, the row is skipped with DeepSpeed's error);
- 3b: the t5-3b architecture (2.85 B): its bf16 checkpoint written a tensor at a time
  (write_random_t5), then `--steps3b` steps of ZeRO-3 with everything on disk, loading from it;
- 11b: the t5-11b architecture (11.3 B, 21 GiB in bf16): built in bf16 straight into the
  parameter store, one forward and backward (its Adam state, 135 GB, has no room on this disk).
Not a test: it takes long and fills the disk (t5-11b: 45 GB). Run nothing else meanwhile.
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
from _results import cpu_name, write_markdown  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PY = ROOT / ".venv" / "bin" / "python"
WORKER = ROOT / "bench" / "_infinity_worker.py"
DS_WORKER = ROOT / "bench" / "_infinity_ds_worker.py"
BENCH_PY = ROOT / "bench" / ".venv" / "bin" / "python"  # bench/zero3.py's environment, with DeepSpeed
DS_EXTRA = {"DS_ACCELERATOR": "cpu"}  # one process: torch's default threads, as the other rows
DS_ENV = {**os.environ, **DS_EXTRA}
LARGE_ROWS = ["plain_fp32", "zero2_disk", "zero3_disk", "deepspeed_zero3_cpu", "deepspeed_zero3_nvme"]
GIB = 2**30


def disk_bandwidth(folder: Path, size: int = 4 * GIB, block: int = 16 * 2**20, overwrite: bool = False) -> dict:
    """Sequential write (then fsync) and read of a `size`-byte file in `folder`, in `block`-byte
    pwrite/pread calls; the read after dropping the file's pages from the page cache
    (posix_fadvise DONTNEED, after the fsync), and once more from the page cache. `overwrite`:
    the file is written (and fsync'd) once before the timed write, which then overwrites blocks
    the disk has allocated, as a store's steps after its first do (by hand, 2026-12-03: this
    machine's virtual disk wrote a new 2 GiB file at 0.26 GB/s and rewrote it at 1.86 GB/s)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bandwidth.bin"
    data = os.urandom(block)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for _ in range(2 if overwrite else 1):
            start = time.perf_counter()
            for offset in range(0, size, block):
                os.pwrite(fd, data, offset)
            os.fsync(fd)
        write = size / (time.perf_counter() - start)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        reads = {}
        for kind in ("disk", "page_cache"):
            start = time.perf_counter()
            for offset in range(0, size, block):
                os.pread(fd, block, offset)
            reads[kind] = size / (time.perf_counter() - start)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return {"write": write, "read": reads["disk"], "read_cached": reads["page_cache"], "bytes": size, "overwrite": overwrite}


def run_row(row: str, arch: str, steps: int, folder: Path, timeout: int, checkpoint: Path | None = None,
            python: Path = PY, worker: Path = WORKER, env: dict | None = None,
            compute: str | None = None, extra: list | None = None) -> dict:  # fmt: skip
    work = folder / f"{row}-{arch}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cmd = [str(python), str(worker), row, arch, "--steps", str(steps), "--work", str(work)]
    if checkpoint is not None:
        cmd += ["--checkpoint", str(checkpoint)]
    if compute is not None:
        cmd += ["--compute_dtype", compute]
    cmd += extra or []
    print("+", " ".join(cmd), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"row": row, "arch": arch, "skipped": f"timed out after {timeout} s"}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sys.stderr.write(done.stderr[-3000:])
    if done.returncode != 0:
        return {"row": row, "arch": arch, "skipped": f"exit {done.returncode}: {done.stderr.strip()[-400:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(result: dict, bandwidth: dict) -> dict:
    """Median step (the first, warm-up, left out when there are more), I/O a step, and the
    store's I/O time against bytes moved over the measured disk bandwidth."""
    if "skipped" in result:
        return result
    times = result["step_seconds"][1:] or result["step_seconds"]
    io = result["io"][1:] or result["io"]
    per = {k: median(step[k] for step in io) for k in io[0]}
    bound = per["read_bytes"] / bandwidth["read"] + per["write_bytes"] / bandwidth["write"]
    seconds = per["read_seconds"] + per["write_seconds"]
    return {**result, "step": median(times), "io_step": per, "io_bound_seconds": bound,
            "io_fraction": (seconds / bound) if bound else None}  # fmt: skip


NAMES = {
    "plain_fp32": "plain fp32, fused AdamW, all in RAM",
    "zero2_disk": "ZeRO-2, bf16 parameters, optimizer state on disk",
    "zero3_disk": "ZeRO-3, bf16 parameters, gradients and optimizer state on disk",
    "zero3_fwd_bwd": "ZeRO-3, bf16 parameters and gradients on disk: forward + backward",
    "deepspeed_zero3_cpu": "DeepSpeed ZeRO-3, bf16 parameters, parameters and optimizer state offloaded to CPU",
    "deepspeed_zero3_nvme": "DeepSpeed ZeRO-3 (Infinity), bf16 parameters, parameters and optimizer state on disk",
}


def deepspeed_env(python: Path) -> str | None:
    """None where `python` can run the DeepSpeed rows (bench/.venv is made if missing, as bench/zero3.py
    makes it), else why not."""
    from zero3 import ensure_env  # bench/zero3.py; DeepSpeed itself is never imported here

    try:
        ensure_env(python)
    except Exception as e:  # noqa: BLE001 - the rows are skipped with the reason
        return f"no DeepSpeed environment at {python}: {type(e).__name__}: {e}"
    done = subprocess.run([str(python), "-c", "import deepspeed"], capture_output=True, text=True, env=DS_ENV)
    if done.returncode != 0:
        return f"deepspeed not importable by {python}: {(done.stderr.strip().splitlines() or ['?'])[-1][:300]}"
    return None


def deepspeed_version(python: Path) -> str:
    code = "import deepspeed, torch; print(f'deepspeed {deepspeed.__version__}, torch {torch.__version__}')"
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=DS_ENV)
    lines = done.stdout.strip().splitlines()
    return lines[-1] if done.returncode == 0 and lines else f"unknown ({done.stderr.strip()[-200:]})"


def name_of(r: dict) -> str:
    compute = f", compute {r['compute']}" if r.get("compute") and r["row"] != "plain_fp32" else ""
    if r.get("asked") and r["asked"] != r.get("compute"):
        compute += f" ({r['asked']})"
    return NAMES.get(r["row"], r["row"]) + compute + (f", {r['optimizer']}" if "optimizer" in r else "")


def table(results: list) -> str:
    lines = ["| architecture | row | parameters | peak RSS | step (median) | disk read / step | disk written / step "
             "| I/O time / (bytes / bandwidth) | losses |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['arch']} | {name_of(r)} | | | | | | | skipped: {r['skipped']} |")
            continue
        io = r["io_step"]
        frac = f"{r['io_fraction']:.2f}" if r["io_fraction"] else "-"
        lines.append(f"| {r['arch']} | {name_of(r)} | {r['parameters'] / 1e9:.2f} B | {r['peak_rss'] / GIB:.2f} GiB "
                     f"| {r['step']:.2f} s | {io['read_bytes'] / GIB:.2f} GiB | {io['write_bytes'] / GIB:.2f} GiB | {frac} "
                     f"| {', '.join(f'{x:.3f}' for x in r['losses'])} |")  # fmt: skip
    notes = [f"{name_of(r)}: {v}" for r in results for v in r.get("notes", {}).values()]
    return "\n".join(lines + ([""] + [f"- {n}" for n in notes] if notes else []))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=["large", "3b", "11b"], choices=["large", "3b", "11b"])
    parser.add_argument("--large-rows", nargs="+", default=LARGE_ROWS, choices=LARGE_ROWS, help="of the large set")
    parser.add_argument("--large-arch", default="t5-large", choices=["t5-large", "tiny"], help="tiny: a smoke test")
    parser.add_argument("--steps", type=int, default=4, help="t5-large steps a row (the first is warm-up)")
    parser.add_argument("--steps3b", type=int, default=5)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/trainer_shard_infinity"))
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--out", type=Path, default=RESULTS / "infinity")
    parser.add_argument("--bandwidth-gib", type=float, default=4, help="size of the disk bandwidth test file")
    parser.add_argument("--compute", nargs="+", default=["auto"], choices=["auto", "bf16", "fp32"],
                        help="compute dtypes of the large set's bf16 rows (zero2_disk, zero3_disk), each a row")  # fmt: skip
    parser.add_argument("--isa", default=None,
                        help="ONEDNN_MAX_CPU_ISA for every row: AVX2 makes a CPU with bf16 kernels one without "
                        "(as torch sees it), to measure that kind of CPU on this one")  # fmt: skip
    parser.add_argument("--python", type=Path, default=BENCH_PY,
                        help="the interpreter for the DeepSpeed rows (default bench/.venv, made if missing)")  # fmt: skip
    args = parser.parse_args()
    if args.isa:
        os.environ["ONEDNN_MAX_CPU_ISA"] = args.isa  # the rows' environment (run_row passes os.environ on)
    python = args.python if args.python.is_absolute() else (Path.cwd() / args.python)
    args.folder.mkdir(parents=True, exist_ok=True)
    bandwidth = disk_bandwidth(args.folder, int(args.bandwidth_gib * GIB))
    print(f"disk: write {bandwidth['write'] / GIB:.2f} GiB/s, read {bandwidth['read'] / GIB:.2f} GiB/s "
          f"(page cache {bandwidth['read_cached'] / GIB:.2f} GiB/s)", flush=True)  # fmt: skip
    results, meta = [], {}
    if "large" in args.rows:
        large = [row for row in LARGE_ROWS if row in args.large_rows]
        for row in (r for r in large if not r.startswith("deepspeed")):
            for compute in args.compute if row != "plain_fp32" else [None]:
                result = run_row(row, args.large_arch, args.steps, args.folder, args.timeout, compute=compute)
                results.append(summarize({**result, "asked": compute}, bandwidth))
        if any(r.startswith("deepspeed") for r in large):
            why = deepspeed_env(python)
            meta["deepspeed"] = {"python": str(python), "env": DS_EXTRA,
                                 "versions": why or deepspeed_version(python)}  # fmt: skip
            for row in (r for r in large if r.startswith("deepspeed")):
                result = {"row": row, "arch": args.large_arch, "skipped": why} if why else run_row(
                    row, args.large_arch, args.steps, args.folder, args.timeout, python=python, worker=DS_WORKER,
                    env=DS_EXTRA)  # fmt: skip
                results.append(summarize(result, bandwidth))
    if "3b" in args.rows:
        checkpoint = args.folder / "t5-3b-bf16"
        began = time.perf_counter()
        subprocess.run([str(PY), "-c", "import sys, torch; sys.path.insert(0, 'bench'); from _infinity_worker import "
                        "config_of; from trainer_shard.demo import write_random_t5; "
                        f"write_random_t5(config_of('t5-3b'), {str(checkpoint)!r}, torch.bfloat16)"],
                       check=True, cwd=ROOT)  # fmt: skip
        written = time.perf_counter() - began
        result = summarize(run_row("zero3_disk", "t5-3b", args.steps3b, args.folder, args.timeout, checkpoint),
                           bandwidth)  # fmt: skip
        result["checkpoint_write_seconds"] = written
        shutil.rmtree(checkpoint, ignore_errors=True)
        results.append(result)
    if "11b" in args.rows:
        results.append(summarize(run_row("zero3_fwd_bwd", "t5-11b", 1, args.folder, args.timeout), bandwidth))
    cpu = cpu_name() + (f"; rows run with ONEDNN_MAX_CPU_ISA={args.isa} (each row's notes say what torch saw)"
                        if args.isa else "")  # fmt: skip
    meta = {"bandwidth": bandwidth, "cpus": os.cpu_count(), "cpu": cpu, "command": " ".join(sys.argv), **meta}
    peer = (f"DeepSpeed rows: {meta['deepspeed']['versions']} ({meta['deepspeed']['python']}, DS_ACCELERATOR=cpu, "
            "world size 1 on gloo), bf16 with fp32 master weights, gradient clipping 1.0.\n\n") if "deepspeed" in meta else ""  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(table(results))
    text = (f"# Models bigger than RAM: parameters, gradients and optimizer state on disk\n\n"
            f"Written by `python {' '.join(sys.argv)}` (bench/infinity.py), {os.cpu_count()} CPUs, one process. "
            f"CPU: {meta['cpu']}.\n\n"
            f"Disk under {args.folder}: sequential write {bandwidth['write'] / GIB:.2f} GiB/s (fsync'd), read "
            f"{bandwidth['read'] / GIB:.2f} GiB/s (page cache dropped), {bandwidth['read_cached'] / GIB:.2f} GiB/s "
            f"from the page cache.\n\n{peer}{table(results)}\n")  # fmt: skip
    write_markdown(Path(f"{args.out}.md"), text)


if __name__ == "__main__":
    main()
