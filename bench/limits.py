#!/usr/bin/env python
"""The machine's bounds for the offloaded step, and each engine's fraction of them, in one process.

    python bench/limits.py                                   # writes bench/results/limits.{md,json}
    python bench/limits.py --numel 200000000 --out /tmp/limits --folder /scratch/x

1. Memory: a streaming kernel with exactly the offloaded Adam step's traffic per element (read
   the fp32 master, exp_avg, exp_avg_sq and a bf16 gradient; write the three back and a bf16
   parameter: 28 bytes, 30 counting the cache lines of the parameter a plain store reads before
   it writes them), next to no arithmetic, on all cores (`torch.get_num_threads()` threads, which
   take blocks of 16 K elements in turn, as the kernel measured against it does), over the
   engine's own arrays (`--numel` elements, far beyond the cache). Built with the system C
   compiler at start (under a second); two variants, plain and streaming (non-temporal) stores
   for the 16-bit output, and the faster one is the bound.
2. Disk: sequential write then read of one file under `--folder`, with O_DIRECT where the
   filesystem takes it, else buffered with fsync and the page cache dropped
   (posix_fadvise DONTNEED); which one is said. `disk_bandwidth` is for other benchmarks too.
3. The offload engine's AdamW step of a `--numel`-element shard through
   `ShardedOptimizer(stage=2, offload=OffloadSpec("cpu"))`: bf16 parameters and gradient shard,
   gradient clipping at 1.0 (the norm computed before the timer), weight decay 0.01; the
   one-pass kernel (trainer_shard/offload/cpu_adam.py) and the three-pass path it replaces
   (`TRAINER_SHARD_NO_CPU_ADAM=1`), interleaved with the bound, round by round.
4. DeepSpeed's ZeRO-2 CPU-offload step on a partition of the same size, where `deepspeed`
   imports (bench/.venv: this script moves there when that environment is complete, as
   bench/offload.py does; it never installs it), measured as bench/_offload_worker.py does, with
   the bound measured again over its arrays.

Fractions are bound seconds / measured seconds (1.0: at the bound), each from medians of
`--steps` rounds after a warm-up, in this one process: the machine's noise (other jobs) moves the
bound and the steps alike. Not a test; about two minutes on 2 cores at 738 M elements (12 GB of
RAM for ours, then 15 GB for DeepSpeed's), plus the first build of each kernel (about a minute).
"""

import argparse
import ctypes
import gc
import hashlib
import json
import mmap
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import write_markdown  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / "bench" / ".venv"
RESULTS = ROOT / "bench" / "results"
NUMEL = 737_668_096  # the t5-large architecture's parameters, as bench/offload.py's step rows
BYTES_MOVED = 28  # an element of the bf16 step: 3 x 4 + 2 read, 3 x 4 + 2 written
HYPER = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
CLIP = 1.0

STREAM_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

static inline float from_bf16(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t to_bf16(float f) { uint32_t u; memcpy(&u, &f, 4); return (uint16_t)(u >> 16); }

/* The offloaded Adam step's memory traffic with next to no arithmetic: p, m, v (fp32) read and
   written in place, g (bf16) read, out (bf16) written. With s = 0 nothing changes but out. */
void stream_step(float* restrict p, float* restrict m, float* restrict v, const uint16_t* restrict g,
                 uint16_t* restrict out, int64_t n, float s) {
  for (int64_t i = 0; i < n; i++) {
    float x = s * from_bf16(g[i]);
    float a = p[i] + x;
    p[i] = a;
    m[i] = m[i] + x;
    v[i] = v[i] + x;
    out[i] = to_bf16(a);
  }
}

/* The same, the 16-bit output written with streaming stores (no read of its cache lines). */
void stream_step_nt(float* restrict p, float* restrict m, float* restrict v, const uint16_t* restrict g,
                    uint16_t* restrict out, int64_t n, float s) {
  int64_t i = 0;
  while (i < n && ((uintptr_t)(out + i) & 63)) {
    stream_step(p + i, m + i, v + i, g + i, out + i, 1, s);
    i++;
  }
  for (; i + 32 <= n; i += 32) {
    uint16_t block[32] __attribute__((aligned(64)));
    for (int k = 0; k < 32; k++) {
      float x = s * from_bf16(g[i + k]);
      float a = p[i + k] + x;
      p[i + k] = a;
      m[i + k] = m[i + k] + x;
      v[i + k] = v[i + k] + x;
      block[k] = to_bf16(a);
    }
#if defined(__AVX512F__)
    _mm512_stream_si512((void*)(out + i), _mm512_load_si512((const void*)block));
#elif defined(__AVX__)
    _mm256_stream_si256((__m256i*)(out + i), _mm256_load_si256((const __m256i*)block));
    _mm256_stream_si256((__m256i*)(out + i + 16), _mm256_load_si256((const __m256i*)(block + 16)));
#else
    memcpy(out + i, block, sizeof(block));
#endif
  }
  if (i < n) stream_step(p + i, m + i, v + i, g + i, out + i, n - i, s);
  _mm_sfence();
}

/* One of several threads over all n elements: blocks of `block` taken in turn from *next, as
   trainer_shard's kernel hands them out (a thread slowed down by another process takes fewer). */
void stream_run(float* p, float* m, float* v, const uint16_t* g, uint16_t* out, int64_t n, float s,
                int64_t* next, int64_t block, int streaming) {
  for (int64_t b = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED); b * block < n;
       b = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED)) {
    int64_t i = b * block, k = n - i < block ? n - i : block;
    (streaming ? stream_step_nt : stream_step)(p + i, m + i, v + i, g + i, out + i, k, s);
  }
}
"""


# ---- memory ------------------------------------------------------------------------------------


class StreamKernel:
    """`STREAM_SOURCE` built with the system C compiler (-O3 -march=native) and called through
    ctypes from `threads` Python threads (ctypes lets go of the GIL), which take blocks of
    `block` elements in turn, as trainer_shard's kernel's threads do."""

    VARIANTS = {"stream_step": 0, "stream_step_nt": 1}

    def __init__(self, threads: int, block: int = 16384):
        self.threads, self.block = threads, block
        digest = hashlib.sha256(STREAM_SOURCE.encode()).hexdigest()[:12]
        folder = Path(tempfile.gettempdir()) / f"trainer_shard_limits_kernel_{os.getuid()}"
        folder.mkdir(exist_ok=True)
        library = folder / f"stream_{digest}.so"
        if not library.exists():
            source = folder / f"stream_{digest}.c"
            source.write_text(STREAM_SOURCE)
            partial = library.with_suffix(f".{os.getpid()}.tmp")
            subprocess.run([os.environ.get("CC", "cc"), "-O3", "-march=native", "-shared", "-fPIC", "-o", str(partial),
                            str(source)], check=True)  # fmt: skip
            partial.rename(library)
        self.function = ctypes.CDLL(str(library)).stream_run
        self.function.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                                                          ctypes.c_int64, ctypes.c_int]  # fmt: skip
        self.function.restype = None

    def run(self, name: str, p, m, v, g, out) -> float:
        """Seconds for one pass over the arrays (p, m, v fp32; g, out 16-bit; all of one size)."""
        import torch

        n = p.numel()
        assert all(t.numel() == n and t.is_contiguous() for t in (m, v, g, out))
        assert p.dtype == m.dtype == v.dtype == torch.float32 and g.element_size() == out.element_size() == 2
        counter = ctypes.c_int64(0)
        args = (p.data_ptr(), m.data_ptr(), v.data_ptr(), g.data_ptr(), out.data_ptr(), n, 0.0,
                ctypes.addressof(counter), self.block, self.VARIANTS[name])  # fmt: skip
        workers = [threading.Thread(target=self.function, args=args) for _ in range(self.threads)]
        started = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - started


# ---- disk --------------------------------------------------------------------------------------


def disk_bandwidth(folder, nbytes: int = 2 * 2**30, block_bytes: int = 64 * 2**20, repeats: int = 2) -> dict:
    """Sequential write, then read, of one `nbytes` file under `folder` in `block_bytes` requests:
    O_DIRECT where the filesystem takes it; otherwise buffered, the write timed to the end of its
    fsync and the file's cached pages dropped (posix_fadvise DONTNEED) before the read. Best of
    `repeats` each (GB/s are 1e9 bytes a second); `method` says which was measured. The file is
    deleted, and `folder` too if this made it."""
    folder = Path(folder)
    made = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"limits-{os.getpid()}.bin"
    nbytes = max(block_bytes, nbytes // block_bytes * block_bytes)
    buffer = mmap.mmap(-1, block_bytes)  # page-aligned, as O_DIRECT wants
    pattern = os.urandom(2**20)  # incompressible, whatever the storage does
    for offset in range(0, block_bytes, len(pattern)):
        buffer[offset : offset + len(pattern)] = pattern[: block_bytes - offset]
    direct = getattr(os, "O_DIRECT", 0)
    try:
        writes, reads = [], []
        for _ in range(repeats):
            seconds, direct = _write_file(path, buffer, nbytes, direct)
            writes.append(seconds)
            reads.append(_read_file(path, buffer, nbytes, direct))
    finally:
        path.unlink(missing_ok=True)
        if made:
            try:
                folder.rmdir()
            except OSError:
                pass
    method = "O_DIRECT" if direct else "buffered; write timed through fsync; page cache dropped (posix_fadvise DONTNEED) before the read"
    return {"folder": str(folder), "filesystem": _filesystem(folder), "method": method, "bytes": nbytes,
            "block_bytes": block_bytes, "write_s": writes, "read_s": reads,
            "write_gbps": nbytes / min(writes) / 1e9, "read_gbps": nbytes / min(reads) / 1e9}  # fmt: skip


def _write_file(path: Path, buffer, nbytes: int, direct: int) -> tuple:
    """(seconds, the O_DIRECT flag actually used: 0 when the filesystem refused it)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | direct)
    except OSError:  # EINVAL: no O_DIRECT here (tmpfs, some overlays)
        direct, fd = 0, os.open(path, flags)
    try:
        started = time.perf_counter()
        for offset in range(0, nbytes, len(buffer)):
            try:
                done = os.pwrite(fd, buffer, offset)
            except OSError:
                if not direct or offset:
                    raise
                os.close(fd)  # O_DIRECT accepted at open, refused at the first write
                return _write_file(path, buffer, nbytes, 0)
            assert done == len(buffer), done
        os.fsync(fd)
        seconds = time.perf_counter() - started
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return seconds, direct
    finally:
        os.close(fd)


def _read_file(path: Path, buffer, nbytes: int, direct: int) -> float:
    fd = os.open(path, os.O_RDONLY | direct)
    try:
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        view = memoryview(buffer)
        started = time.perf_counter()
        for offset in range(0, nbytes, len(buffer)):
            done = os.preadv(fd, [view], offset)
            assert done == len(buffer), done
        return time.perf_counter() - started
    finally:
        os.close(fd)


def _filesystem(folder: Path) -> str:
    """The type and device of the mount `folder` is on (from /proc/mounts), or '?'."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return "?"
    real = str(folder.resolve())
    best = max((m for m in mounts if real == m[1] or real.startswith(m[1].rstrip("/") + "/")), key=lambda m: len(m[1]),
               default=None)  # fmt: skip
    return f"{best[2]} on {best[0]}" if best else "?"


# ---- the engines -------------------------------------------------------------------------------


def measure_ours(numel: int, steps: int, kernel: StreamKernel) -> dict:
    """The offload engine's step, one pass and three passes, interleaved with the bound over its arrays."""
    import torch

    from trainer_shard.offload import OffloadSpec, cpu_adam
    from trainer_shard.sharding import ShardedOptimizer

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(numel).to(torch.bfloat16))
    opt = ShardedOptimizer([param], optim=torch.optim.AdamW, stage=2, offload=OffloadSpec("cpu"), grad_dtype=torch.bfloat16,
                           **HYPER)  # fmt: skip
    flat, store = opt.flats[0], opt.stepper.store
    torch.manual_seed(1)
    for start in range(0, flat.grad.numel(), 2**24):  # the reduced gradient shard, as backward leaves it
        piece = flat.grad[start : start + 2**24]
        piece.copy_(torch.randn(piece.numel()))
    shard = flat.grad.numel()
    arrays = [store.view(f"0.{name}", 0, shard) for name in ("master", "exp_avg", "exp_avg_sq")] + [flat.grad, flat.buffer]
    assert flat.buffer.numel() == shard  # one rank: the shard is the whole flat buffer

    def step(one_pass: bool) -> float:
        if one_pass:
            os.environ.pop(cpu_adam.DISABLE_ENV, None)
        else:
            os.environ[cpu_adam.DISABLE_ENV] = "1"
        flat.stale = set()  # a bf16 gradient shard is left as it is by the step: no need to write it again
        opt._grads_ready = True
        opt.clip_grad_norm(CLIP)  # the norm, as the Trainer computes it before the step
        started = time.perf_counter()
        opt.step()
        return time.perf_counter() - started

    rows = {"three_pass": lambda: step(False), "one_pass": lambda: step(True)}
    out = interleave(rows, arrays, kernel, steps)
    if not cpu_adam.available():
        out["one_pass"]["skipped"] = f"the kernel could not be built: {cpu_adam.build_error()}"
    os.environ.pop(cpu_adam.DISABLE_ENV, None)
    opt.close()
    del opt, flat, store, arrays, param
    gc.collect()
    return out


def measure_deepspeed(numel: int, steps: int, kernel: StreamKernel) -> dict:
    """DeepSpeed 0.19's ZeRO-2 CPU-offload step on a partition (bench/_offload_worker.py's `adam`):
    multiply the fp32 gradient by the clip factor, DeepSpeedCPUAdam, fp32 -> 16-bit buffer ->
    16-bit parameters; DeepSpeedCPUAdam.step alone is timed apart."""
    import torch

    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # noqa: BLE001 - not installed, or its op fails to build: the peer is skipped
        return {"skipped": f"deepspeed does not import in {sys.prefix}: {type(e).__name__}: {e}"[:300]}
    torch.manual_seed(0)
    params16 = torch.randn(numel).to(torch.bfloat16)
    param = torch.nn.Parameter(params16.float())
    grad = torch.randn(numel)
    param.grad = grad
    buffer16 = torch.zeros(numel, dtype=torch.bfloat16)
    opt = DeepSpeedCPUAdam([param], adamw_mode=True, **HYPER)
    norm = float(torch.linalg.vector_norm(grad, dtype=torch.float64))
    combined_scale = max((norm + 1e-6) / CLIP, 1.0)  # loss scale 1 (bf16): stage_1_and_2.py's unscale_and_clip_grads
    adam_times = []

    def step() -> float:
        started = time.perf_counter()
        param.grad.mul_(1.0 / combined_scale)
        began = time.perf_counter()
        opt.step()
        adam_times.append(time.perf_counter() - began)
        buffer16.copy_(param.data)  # fp32 partition -> the 16-bit CPU buffer
        params16.copy_(buffer16)  # -> the 16-bit parameter partition
        seconds = time.perf_counter() - started
        param.grad.mul_(combined_scale)  # untimed: the next step's gradient as large as this one's (no subnormals)
        return seconds

    step()  # its state, before the bound can run over it
    state = opt.state[param]
    arrays = [param.data, state["exp_avg"], state["exp_avg_sq"], buffer16, params16]
    out = interleave({"deepspeed": step}, arrays, kernel, steps, warm=False)
    out["deepspeed_adam"] = {"times": adam_times[-steps:], "median_s": median(adam_times[-steps:]),
                             "bounds": out["deepspeed"]["bounds"]}  # fmt: skip
    del opt, param, grad, buffer16, params16, arrays, state
    gc.collect()
    return out


def interleave(rows: dict, arrays: list, kernel: StreamKernel, steps: int, warm: bool = True) -> dict:
    """Round by round, each row right after the two bound kernels over `arrays` (so that each
    step has a bound measured seconds before it: `bounds`, the faster variant's time); medians
    after a warm-up."""
    variants = {"bound_plain": "stream_step", "bound_streaming": "stream_step_nt"}
    times = {name: [] for name in (*variants, *rows)}
    bounds = {name: [] for name in rows}
    for function in variants.values():
        kernel.run(function, *arrays)  # warm-up: first-touch page faults and the like
    if warm:
        for run in rows.values():
            run()
    for _ in range(steps):
        for name, run in rows.items():
            for variant, function in variants.items():
                times[variant].append(kernel.run(function, *arrays))
            bounds[name].append(min(times[variant][-1] for variant in variants))
            times[name].append(run())
        print("  round:", {k: round(v[-1], 3) for k, v in times.items()}, flush=True)
    out = {name: {"times": t, "median_s": median(t)} for name, t in times.items()}
    for name in rows:
        out[name]["bounds"] = bounds[name]
    return out


# ---- report ------------------------------------------------------------------------------------


def machine() -> dict:
    import torch

    info = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "capability": torch.backends.cpu.get_cpu_capability(), "python": sys.prefix}  # fmt: skip
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        info.update({k.strip(): v.strip() for k, v in (l.split(":", 1) for l in lscpu.splitlines() if ":" in l)
                     if k.strip() in ("Model name", "L2 cache", "L3 cache")})  # fmt: skip
    except OSError:
        pass
    with open("/proc/meminfo") as f:
        info["mem_total_gib"] = round(int(f.readline().split()[1]) / 2**20, 1)
    info["load_before"] = load_average()
    return info


def load_average() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def room_for(nbytes: int) -> str | None:
    """None if `nbytes` more fit in RAM with 1 GiB to spare, else why not (a phase skipped, not the machine swapping)."""
    free = available_bytes()
    if nbytes + 2**30 <= free:
        return None
    return f"needs {nbytes / 2**30:.1f} GiB of RAM, {free / 2**30:.1f} GiB available (use --numel)"


def fractions(section: dict) -> dict:
    """{row: the median over rounds of (the bound measured just before it) / (its time)}."""
    return {name: median(b / t for b, t in zip(row["bounds"], row["times"]))
            for name, row in section.items() if "bounds" in row and "skipped" not in row}  # fmt: skip


def table(results: dict, command: str) -> str:
    m, numel = results["machine"], results["numel"]
    gb = numel * BYTES_MOVED / 1e9
    lines = [
        "# The machine's bounds and the offloaded step's fraction of them",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {m.get('Model name', '?')}, {m['cpus']} cores ({m['torch_threads']} torch threads), L2 "
        f"{m.get('L2 cache', '?')}, L3 {m.get('L3 cache', '?')} (lscpu), {m['mem_total_gib']} GiB RAM; torch "
        f"{m['torch']} (CPU capability {m['capability']}); load average {m['load_before']} before, "
        f"{results.get('load_after', '?')} after (other jobs on the machine). All in one process: medians of "
        f"{results['steps']} rounds after a warm-up, each round the bound kernels before each step, so the machine's noise "
        "moves them alike. Fraction of the bound: the median over rounds of bound seconds / step seconds, "
        "the bound (the faster variant) measured right before each step.",
        "",
        f"## Memory: an AdamW step of {numel / 1e6:.0f} M elements, bf16 parameters, clipping on",
        "",
        f"Bound: a streaming kernel with the step's traffic ({BYTES_MOVED} bytes an element: read fp32 master, "
        "exp_avg, exp_avg_sq and the bf16 gradient, write them back and the bf16 parameter; "
        f"{gb:.1f} GB a step, {gb * 1e9 / _l3_bytes(m):.0f}x the L3), next to no arithmetic, on all cores, over "
        "the measured step's own arrays; the faster of plain and streaming stores for the 16-bit output.",
        "",
        "| kernel or step | median (s) | GB/s at 28 B/element | fraction of the bound |",
        "|---|---|---|---|",
    ]  # fmt: skip
    names = {
        "bound_plain": "bound: streaming kernel, plain stores",
        "bound_streaming": "bound: streaming kernel, streaming stores for the 16-bit output",
        "three_pass": "trainer_shard offload engine, three passes (TRAINER_SHARD_NO_CPU_ADAM=1: upcast, torch._fused_adamw_, cast)",
        "one_pass": "trainer_shard offload engine, one pass (cpu_adam, the default)",
        "deepspeed": "DeepSpeed 0.19 ZeRO-2 offload step (clip multiply, DeepSpeedCPUAdam, fp32 -> bf16 buffer -> bf16 parameters)",
        "deepspeed_adam": "DeepSpeedCPUAdam.step alone (its part of the row above; writes no bf16 parameter)",
        "ours": "trainer_shard offload engine",
    }  # fmt: skip
    for key, whose in (("ours", "trainer_shard's"), ("deepspeed", "DeepSpeed's")):
        section = results.get(key) or {}
        if "skipped" in section:
            lines.append(f"| {names[key]} | skipped: {section['skipped']} |  |  |")
            continue
        ratio = fractions(section) if section else {}
        for name, row in section.items():
            label = f"{names[name]} (over {whose} arrays)" if name.startswith("bound") else names[name]
            if "skipped" in row:
                lines.append(f"| {label} | skipped: {row['skipped']} |  |  |")
                continue
            fraction = f"**{ratio[name]:.2f}**" if name in ratio else "-"
            lines.append(f"| {label} | {row['median_s']:.3f} | {gb / row['median_s']:.1f} | {fraction} |")
    summary = [f"{label} {results['fractions'][key][name]:.2f}" for key, name, label in (
        ("ours", "one_pass", "the one-pass step"), ("ours", "three_pass", "the three-pass step it replaces"),
        ("deepspeed", "deepspeed", "DeepSpeed's step"), ("deepspeed", "deepspeed_adam", "DeepSpeedCPUAdam alone"))
        if name in results["fractions"].get(key, {})]  # fmt: skip
    if summary:
        lines += ["", "Fractions of the memory bound: " + "; ".join(summary) + "."]
    disk = results.get("disk")
    if disk:
        lines += ["", "## Disk", ""]
        if "skipped" in disk:
            lines.append(f"Skipped: {disk['skipped']}")
        else:
            lines += [f"Sequential, one {disk['bytes'] / 2**30:.1f} GiB file in {disk['block_bytes'] / 2**20:.0f} MiB "
                      f"requests under `{disk['folder']}` ({disk['filesystem']}); {disk['method']}; best of "
                      f"{len(disk['write_s'])}.", "", "| write (GB/s) | read (GB/s) |", "|---|---|",
                      f"| {disk['write_gbps']:.2f} | {disk['read_gbps']:.2f} |"]  # fmt: skip
    return "\n".join(lines) + "\n"


def _l3_bytes(m: dict) -> float:
    text = m.get("L3 cache", "")
    try:
        number, unit = text.split()[:2]
        return float(number) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
    except (ValueError, KeyError):
        return float("nan")


def _move_to_bench_env() -> None:
    """Where deepspeed does not import here but bench/.venv is complete, run there (it has this
    package, editable, and DeepSpeed). It is never installed from here: bench/sharding.py does."""
    try:
        import deepspeed  # noqa: F401

        return
    except Exception:  # noqa: BLE001
        pass
    python = VENV / "bin" / "python"
    if (VENV / ".bench-installed").exists() and Path(sys.prefix).resolve() != VENV.resolve() and python.exists():
        print(f"moving to {VENV} (deepspeed imports there)", flush=True)
        os.execv(str(python), [str(python), __file__, *sys.argv[1:]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=NUMEL, help="elements of the shard (at least 700 M for the record)")
    parser.add_argument("--steps", type=int, default=7, help="measured rounds after the warm-up")
    parser.add_argument("--folder", default=os.path.join(tempfile.gettempdir(), "trainer_shard_limits"),
                        help="where the disk is measured (the offload store's folder)")  # fmt: skip
    parser.add_argument("--disk_gib", type=float, default=2.0, help="size of the disk test file")
    parser.add_argument("--no_disk", action="store_true")
    parser.add_argument("--no_peer", action="store_true", help="skip DeepSpeed")
    parser.add_argument("--out", default=str(RESULTS / "limits"), help="writes OUT.md and OUT.json")
    args = parser.parse_args()
    if not args.no_peer:
        _move_to_bench_env()
    import torch

    command = "python bench/limits.py " + " ".join(sys.argv[1:])
    results = {"machine": machine(), "numel": args.numel, "steps": args.steps}
    print(json.dumps(results["machine"]), flush=True)
    if not args.no_disk:
        print(f"disk: {args.disk_gib} GiB under {args.folder}", flush=True)
        results["disk"] = disk_bandwidth(args.folder, int(args.disk_gib * 2**30))
        print(json.dumps(results["disk"]), flush=True)
    kernel = StreamKernel(torch.get_num_threads())
    print(f"memory: {args.numel:,} elements, trainer_shard's step", flush=True)
    short = room_for(16 * args.numel)  # bf16 parameters and gradients, fp32 master and moments
    results["ours"] = {"skipped": short} if short else measure_ours(args.numel, args.steps, kernel)
    print(json.dumps(results["ours"] if short else fractions(results["ours"])), flush=True)
    if args.no_peer:
        results["deepspeed"] = {"skipped": "--no_peer"}
    elif room_for(20 * args.numel):  # fp32 parameters, gradients and moments, two bf16 copies
        results["deepspeed"] = {"skipped": room_for(20 * args.numel)}
    else:
        print("memory: DeepSpeed's step", flush=True)
        results["deepspeed"] = measure_deepspeed(args.numel, args.steps, kernel)
        if "skipped" not in results["deepspeed"]:
            print(json.dumps(fractions(results["deepspeed"])), flush=True)
        else:
            print("DeepSpeed skipped:", results["deepspeed"]["skipped"], flush=True)
    results["load_after"] = load_average()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results["fractions"] = {k: fractions(results[k]) for k in ("ours", "deepspeed") if "skipped" not in results[k]}
    out.with_suffix(".json").write_text(json.dumps(dict(results, command=command.strip()), indent=1))
    text = table(results, command.strip())
    write_markdown(out.with_suffix(".md"), text)
    print(text)


if __name__ == "__main__":
    main()
