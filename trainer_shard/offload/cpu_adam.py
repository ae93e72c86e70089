"""A fused CPU Adam/AdamW step for the offload engine: one pass over master, moments, 16-bit
gradient and 16-bit parameter, compiled at first use.

    from trainer_shard.offload import cpu_adam
    if cpu_adam.available():
        cpu_adam.step(master, exp_avg, exp_avg_sq, grad, out=param16, step=3.0, lr=1e-3, ...)

The offload engine's step of a chunk used to be three passes over memory: upcast the 16-bit
gradient into an fp32 buffer, torch's fused AdamW (`torch._fused_adamw_`) over master, moments
and that buffer, then cast the master into the 16-bit parameters. This kernel does it in one:
for each vector of elements it reads the gradient in its own dtype, divides it by `grad_scale`
(1 / the product of the clipping and loss-scale factors), updates the moments and the fp32
master, and writes the parameter in its own dtype, all in registers. It moves only the bytes
the step must move: 28 an element with bf16 (read master, two moments and the gradient; write
the three and the parameter). What keeps it at the memory bound (bench/limits.py; measured on
2 cores, 200 M elements: 0.91-0.94 of the bound, against 0.81 without the first point):

- the four read streams are prefetched 512 elements ahead (the out-of-order window alone does
  not hide the memory behind the two divisions and the square root an element);
- the parameters are written with streaming stores (they are not read here, so their cache
  lines are not fetched first);
- the work goes out in blocks of 16 K elements to whichever thread of torch's pool
  (`at::parallel_for`) is free, and one call can cover a whole shard (`segment`): a static
  split in one call per chunk ran at half the speed while other processes shared the cores.

Numerics are torch's: the arithmetic is that of ATen's fused CPU Adam kernel
(aten/src/ATen/native/cpu/FusedAdamKernel.cpp, the fp32 path), operation for operation, built
for the same vector ISA torch's kernel runs on here (its `fused_adam_stub` has no AVX512
build: AVX2 on AVX2 and AVX512 machines), so the result equals upcast + `_fused_adamw_` +
cast bit for bit (tests/test_cpu_adam.py checks it). That includes dividing the gradient by
`grad_scale` rather than multiplying by its inverse, and writing the divided gradient back
when the gradient is fp32 (`write_grad`), as torch's kernel does.

No compile step at install: the C++ source, `cpu_adam.cpp` beside this file, is built by
`torch.utils.cpp_extension.load_inline` the first time it is needed (about a minute, once per
machine; cached in torch's extension folder, `TORCH_EXTENSIONS_DIR` or ~/.cache/torch_extensions),
under a lock that a killed build cannot leave behind ([Note: the build lock]). Where it cannot
be built (no compiler, no ninja, a failed build, a build killed earlier, another process building
for more than `BUILD_TIMEOUT_S`) `available()` is False, the reason is logged once as a warning,
and the engine takes the three-pass path, with the same results.
`TRAINER_SHARD_NO_CPU_ADAM=1` forces that path.
"""

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "TRAINER_SHARD_NO_CPU_ADAM"
_VERSION = 1  # bump with any change to the interface of adam_step in SOURCE_FILE
SOURCE_FILE = Path(__file__).with_name("cpu_adam.cpp")  # the kernel, built at first use
OWNER_LOCK = "trainer_shard_build.lock"  # our flock, next to torch's `lock`: [Note: the build lock]
BUILD_TIMEOUT_S = 600  # the longest a build may take (measured: 65 s on 2 busy cores); never waited past

_lock = threading.Lock()
_state = {"tried": False, "module": None, "error": None}


def _isa_flags() -> tuple:
    """(tag, compiler flags) for the vector ISA torch's own fused Adam runs on here: ATen registers
    `fused_adam_stub` for AVX2 and not for AVX512, so an AVX512 machine runs the AVX2 build."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        return "avx2", ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return "default", ["-DCPU_CAPABILITY=DEFAULT"]


def _build(extra_flags=(), tag: str = ""):
    """The extension, compiled from `SOURCE_FILE` in torch's extension folder (or loaded from it),
    under the build lock: see [Note: the build lock]."""
    from torch.utils.cpp_extension import load_inline

    isa, flags = _isa_flags()
    name = _name(isa, tag)
    folder = build_folder(name)
    with _build_lock(folder):
        logger.info("building the CPU Adam kernel in %s (about a minute the first time; later runs find it built)",
                    folder)  # fmt: skip
        return load_inline(
            name=name,
            cpp_sources=[SOURCE_FILE.read_text()],
            functions=["adam_step"],
            extra_cflags=["-O3", "-fopenmp", *flags, *extra_flags],
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )


def _name(isa: str, tag: str = "") -> str:
    # one build a torch installation: two environments sharing the cache folder do not rebuild over each other
    where = hashlib.sha256(f"{torch.__version__} {Path(torch.__file__).resolve().parent}".encode()).hexdigest()[:8]
    return f"trainer_shard_cpu_adam_{isa}_{where}_v{_VERSION}{tag}"


def build_folder(name: str | None = None) -> Path:
    """torch's extension folder for the kernel (`TORCH_EXTENSIONS_DIR` or ~/.cache/torch_extensions/
    ...), made if missing: where it is built, and where torch's `lock` and ours are."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name or _name(_isa_flags()[0]), False))


class BuildLockError(RuntimeError):
    """The build lock could not be taken in time, or a killed build left torch's: the engine falls back."""


@contextlib.contextmanager
def _build_lock(folder: Path):
    """[Note: the build lock] torch's `load_inline` builds under a lock file, `<folder>/lock`, made
    with O_EXCL and removed when the build ends; whoever finds it waits, for ever, until it is
    gone. A builder killed mid-build (SIGKILL, the OOM killer, the fault handler's hard exit)
    never removes it, and every later run would hang at its first offload step. So a build here
    first takes our own lock, a `flock` on `<folder>/OWNER_LOCK`, which the kernel releases when
    its holder dies, whatever kills it, and writes in that file who builds until the build ends:

    - our lock held by a live process (another rank building): wait for it, at most
      `BUILD_TIMEOUT_S`, then fall back;
    - taken, with torch's `lock` there and a builder written down: that builder died mid-build
      (it would still hold our lock). Its lock is removed, and this run falls back (what killed
      the build, the OOM killer say, may kill it again); the next run builds;
    - torch's `lock` there and no builder written down: it was made outside our lock (another
      version of this package, or a file system without flock). Older than `BUILD_TIMEOUT_S`, it
      is removed; younger, it is left to its builder. Either way this run falls back.
    Falling back: `BuildLockError`, one warning (`module`), and torch's three-pass path; no run
    ever waits on torch's lock."""
    with open(folder / OWNER_LOCK, "a+") as handle:
        locked = _acquire(handle, folder)
        handle.seek(0)
        _check_baton(folder / "lock", handle.read().strip() if locked else "")
        _write_owner(handle, f"pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}")
        try:
            yield
        finally:
            _write_owner(handle, "")  # the build ended, and torch removed its lock
            if locked:
                fcntl.flock(handle, fcntl.LOCK_UN)


def _write_owner(handle, owner: str) -> None:
    handle.seek(0)
    handle.truncate()
    handle.write(owner)
    handle.flush()


def _acquire(handle, folder: Path) -> bool:
    """Take the flock on `handle` within `BUILD_TIMEOUT_S`: True; False where the file system has
    none. Raises BuildLockError when another process holds it that long."""
    deadline, told = time.monotonic() + BUILD_TIMEOUT_S, False
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError:  # no flock on this file system (some network file systems)
            return False
        if time.monotonic() > deadline:
            raise BuildLockError(f"another process has been building the kernel in {folder} for over "
                                 f"{BUILD_TIMEOUT_S} s")  # fmt: skip
        if not told:
            logger.info("waiting for another process building the CPU Adam kernel in %s", folder)
            told = True
        time.sleep(0.2)


def _check_baton(baton: Path, owner: str) -> None:
    """Raise BuildLockError where torch's build lock `baton` is there, removing it where it is
    stale; `owner`: the builder written down in our lock, "" for none. See [Note: the build lock]."""
    try:
        age = time.time() - baton.stat().st_mtime
    except FileNotFoundError:
        return
    if owner:
        why = f"a build ({owner}) was killed before it finished and left {baton}"
    elif age > BUILD_TIMEOUT_S:
        why = f"{baton} is {age:.0f} s old, more than a build takes (BUILD_TIMEOUT_S = {BUILD_TIMEOUT_S})"
    else:
        raise BuildLockError(f"{baton} ({age:.0f} s old) is held by a build outside this package's lock (another "
                             "version of it, or a file system without flock); not waiting on it")  # fmt: skip
    baton.unlink(missing_ok=True)
    raise BuildLockError(f"{why}; removed it, so the next run builds the kernel")


def disabled() -> bool:
    """True when `TRAINER_SHARD_NO_CPU_ADAM` asks for torch's three-pass path."""
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def module():
    """The compiled extension, built (or loaded from the cache) on the first call; None where it
    cannot be built or is disabled. Never raises: the reason is in `build_error()` and the log."""
    if disabled():
        return None
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            started = time.perf_counter()
            try:
                _state["module"] = _build()
            except Exception as e:  # noqa: BLE001 - no compiler, no ninja, a failed build: all mean the fallback
                lines = str(e).strip().splitlines()
                _state["error"] = f"{type(e).__name__}: {lines[-1] if lines else ''}"
                logger.warning("the fused CPU Adam kernel could not be built (%s); the offload engine steps with "
                               "torch's fused AdamW in three passes instead: same results, slower", _state["error"])
            else:
                logger.info("fused CPU Adam kernel ready in %.1f s (built once, then cached in torch's extension "
                            "folder)", time.perf_counter() - started)
    return _state["module"]


def available() -> bool:
    """Whether `step` can run: the kernel is built (building it now if not tried yet) and not disabled."""
    return module() is not None


def build_error() -> str | None:
    """Why the kernel could not be built, or None (built, not yet tried, or disabled)."""
    return _state["error"]


def step(master, exp_avg, exp_avg_sq, grad, *, out=None, max_exp_avg_sq=None, step: float, lr: float, beta1: float,
         beta2: float, weight_decay: float, eps: float, amsgrad: bool = False, maximize: bool = False,
         decoupled: bool = True, grad_scale: float | None = None, fresh: bool = False, write_grad: bool = False,
         segment: int = 0) -> None:
    """One Adam (`decoupled=False`) or AdamW step of fp32 `master`, `exp_avg`, `exp_avg_sq` (and
    `max_exp_avg_sq` with amsgrad) from `grad` (fp32, bf16 or fp16), in place, as torch's
    `_fused_adam(w)_` on them (with `grad` upcast) would step them, bit for bit.

    `out`: where the updated master also goes, cast: a tensor of its size, or (offset, tensor)
    pieces that cover it in order (this rank's slices of a flat buffer), all of one dtype (fp32,
    bf16 or fp16); None for nowhere. All contiguous CPU tensors. `step`: the step count after its
    increment, as torch passes it. The gradient is divided by `grad_scale` when given (and, when
    fp32 and `write_grad`, written back divided, as torch's kernel does). `fresh`: the moments
    start from zero, whatever they hold (they are not read). `segment`: the result is that of one
    torch call per `segment` elements (the engine's chunks), not one for all; 0 for all.
    Call only when `available()`."""
    if out is None:
        pieces = []
    elif torch.is_tensor(out):
        pieces = [(0, out)]
    else:
        pieces = list(out)
    module().adam_step(master, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, [t for _, t in pieces], [o for o, _ in pieces],
                       float(step), float(lr), float(beta1), float(beta2), float(weight_decay), float(eps),
                       bool(amsgrad), bool(maximize), bool(decoupled), None if grad_scale is None else float(grad_scale),
                       bool(fresh), bool(write_grad), int(segment))  # fmt: skip
