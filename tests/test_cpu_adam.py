"""The one-pass CPU Adam kernel (trainer_shard/offload/cpu_adam.py): bit for bit torch's fused
CPU Adam/AdamW, used by the offload engine wherever a compiler exists, and a fallback with the
same results where it does not (TRAINER_SHARD_NO_CPU_ADAM=1, or a failed build).

The first run on a machine builds the kernel (about a minute); later runs load it from torch's
extension cache.
"""

import configparser
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.utils import cpp_extension

from conftest import ROOT
from test_offload import max_diff, spec, train
from trainer_shard.offload import cpu_adam

COMPILER = bool((shutil.which("c++") or shutil.which("g++")) and shutil.which("ninja"))


@pytest.fixture(scope="module")
def kernel():
    """The built kernel. Where a compiler and ninja exist a failed build fails the test, with the
    compiler's message: a silent fallback would let every other test here pass on torch's path."""
    if not COMPILER:
        pytest.skip("no C++ compiler or ninja: the engine uses torch's path (test_fallback_* cover it)")
    if cpu_adam.disabled():
        pytest.skip(f"{cpu_adam.DISABLE_ENV} is set")
    assert cpu_adam.available(), f"the CPU Adam kernel did not build: {cpu_adam.build_error()}"
    return cpu_adam


def torch_steps(n_steps, p0, grads, *, decoupled, amsgrad, grad_scales, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                weight_decay=0.0, maximize=False, chunk=None):
    """The offload engine's old path: each gradient upcast, torch's fused kernel, per chunk."""
    n = p0.numel()
    p, m, v, x = p0.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    chunk = chunk or n
    step = torch.zeros(())
    for i in range(n_steps):
        step += 1
        g32 = grads[i].to(torch.float32, copy=True)  # torch writes the divided gradient back
        scale = None if grad_scales[i] is None else torch.tensor(grad_scales[i], dtype=torch.float32)
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            fused([p[s:e]], [g32[s:e]], [m[s:e]], [v[s:e]], [x[s:e]] if amsgrad else [], [step.clone()],
                  amsgrad=amsgrad, lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, eps=eps,
                  maximize=maximize, grad_scale=scale)  # fmt: skip
    return p, m, v, x


def kernel_steps(n_steps, p0, grads, out_dtype, *, decoupled, amsgrad, grad_scales, lr=1e-3, betas=(0.9, 0.999),
                 eps=1e-8, weight_decay=0.0, maximize=False, chunk=0, pieces=None):
    n = p0.numel()
    garbage = float("nan")  # step 1 must not read the moments
    p, m, v, x = p0.clone(), torch.full((n,), garbage), torch.full((n,), garbage), torch.full((n,), garbage)
    out = torch.empty(n, dtype=out_dtype)
    for i in range(n_steps):
        scale = None if grad_scales[i] is None else float(torch.tensor(grad_scales[i], dtype=torch.float32))
        cpu_adam.step(p, m, v, grads[i].clone(), out=pieces or out, max_exp_avg_sq=x if amsgrad else None,
                      step=i + 1, lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, eps=eps,
                      amsgrad=amsgrad, maximize=maximize, decoupled=decoupled, grad_scale=scale, fresh=i == 0,
                      segment=chunk)  # fmt: skip
    out = torch.cat([t for _, t in pieces]) if pieces else out
    return p, m, v, x, out


def assert_equal(a, b, what):
    assert torch.equal(a, b), f"{what}: {(a != b).sum().item()} of {a.numel()} differ, max {(a - b).abs().max().item()}"


CASES = {
    "adamw": dict(decoupled=True, weight_decay=0.01),
    "adam_l2": dict(decoupled=False, weight_decay=0.01),
    "adamw_no_decay": dict(decoupled=True, weight_decay=0.0),
    "amsgrad_maximize": dict(decoupled=True, weight_decay=0.1, amsgrad=True, maximize=True),
    "adam_amsgrad": dict(decoupled=False, weight_decay=0.0, amsgrad=True),
    "large_lerp_weight": dict(decoupled=True, weight_decay=0.01, betas=(0.3, 0.99)),  # torch's other lerp branch
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("grad_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                                  (torch.float16, torch.float16), (torch.float32, torch.float32)])
def test_bit_for_bit_torchs_fused_kernel(kernel, case, grad_dtype, out_dtype):
    """Three steps with clipping factors (one step unclipped); sizes with a scalar tail."""
    hyper = {"amsgrad": False, **CASES[case]}
    torch.manual_seed(0)
    for n in (5, 16, 1000 + 7, 3 * 16384 + 11):
        p0 = torch.randn(n)
        grads = [torch.randn(n).to(grad_dtype) for _ in range(3)]
        scales = [1.7, None, 0.37]
        p, m, v, x = torch_steps(3, p0, grads, grad_scales=scales, **hyper)
        q, mq, vq, xq, out = kernel_steps(3, p0, grads, out_dtype, grad_scales=scales, **hyper)
        for a, b, what in ((p, q, "master"), (m, mq, "exp_avg"), (v, vq, "exp_avg_sq"), (p.to(out_dtype), out, "out")):
            assert_equal(a, b, f"{what}, n={n}")
        if hyper["amsgrad"]:
            assert_equal(x, xq, f"max_exp_avg_sq, n={n}")


def test_pieces_and_segments_are_the_engines_chunks(kernel):
    """One call over a shard with `segment` = the chunk size steps it as one torch call a chunk
    would (a ragged chunk has a scalar tail each), and writes the weights into pieces that cut
    through vectors anywhere (this rank's slices of a flat buffer)."""
    torch.manual_seed(1)
    n, chunk = 5000, 97
    p0, grads = torch.randn(n), [torch.randn(n).to(torch.bfloat16) for _ in range(2)]
    cuts = [0, 3, 700, 701, 2048, 4999, n]
    storage = torch.empty(n + 64, dtype=torch.bfloat16)
    pieces = [(a, storage[a + 5 + i : b + 5 + i]) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
    hyper = dict(decoupled=True, weight_decay=0.01, amsgrad=False, grad_scales=[2.5, 2.5])
    p, m, v, _ = torch_steps(2, p0, grads, chunk=chunk, **hyper)
    q, mq, vq, _, out = kernel_steps(2, p0, grads, torch.bfloat16, chunk=chunk, pieces=pieces, **hyper)
    for a, b, what in ((p, q, "master"), (m, mq, "exp_avg"), (v, vq, "exp_avg_sq"), (p.bfloat16(), out, "out")):
        assert_equal(a, b, what)


def test_fp32_gradient_is_left_divided_as_torchs_kernel_leaves_it(kernel):
    torch.manual_seed(2)
    n = 333
    grad = torch.randn(n)
    theirs, ours = grad.clone(), grad.clone()
    torch._fused_adamw_([torch.zeros(n)], [theirs], [torch.zeros(n)], [torch.zeros(n)], [], [torch.ones(())], amsgrad=False,
                        lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, maximize=False,
                        grad_scale=torch.tensor(3.0))  # fmt: skip
    cpu_adam.step(torch.zeros(n), torch.zeros(n), torch.zeros(n), ours, step=1, lr=1e-3, beta1=0.9, beta2=0.999,
                  weight_decay=0.0, eps=1e-8, grad_scale=3.0, fresh=True, write_grad=True)  # fmt: skip
    assert_equal(theirs, ours, "gradient")
    assert not torch.equal(ours, grad)


def test_equals_torch_optim_adamw_fused(kernel):
    """What a user's `torch.optim.AdamW(fused=True)` computes, over 4 steps."""
    torch.manual_seed(3)
    param = torch.nn.Parameter(torch.randn(4099))
    reference = torch.optim.AdamW([param], lr=3e-3, weight_decay=0.05, fused=True)
    master, m, v = param.detach().clone(), torch.empty(4099), torch.empty(4099)
    for i in range(4):
        param.grad = torch.randn(4099)
        cpu_adam.step(master, m, v, param.grad.clone(), step=i + 1, lr=3e-3, beta1=0.9, beta2=0.999, weight_decay=0.05,
                      eps=1e-8, fresh=i == 0)  # fmt: skip
        reference.step()
    assert_equal(param.detach(), master, "weights")
    assert_equal(reference.state[param]["exp_avg_sq"], v, "exp_avg_sq")


def count_calls(monkeypatch) -> list:
    calls = []
    real = cpu_adam.step
    monkeypatch.setattr(cpu_adam, "step", lambda *a, **k: calls.append(a[0].numel()) or real(*a, **k))
    return calls


@pytest.mark.parametrize("kind,chunk,buffers", [("cpu", 97, 2), ("nvme", 64, 1), ("nvme", 97, 2)])
@pytest.mark.parametrize("dtype,grad_dtype", [(torch.bfloat16, None), (torch.bfloat16, torch.float32), (torch.float32, None)])
def test_the_engine_uses_the_kernel_with_the_fallbacks_results(tmp_path, monkeypatch, kernel, kind, chunk, buffers,
                                                               dtype, grad_dtype):  # fmt: skip
    """ShardedOptimizer with offload, clipping on: the one-pass kernel steps (a CPU store: the whole
    shard in one call) and ends where the forced fallback (torch's three passes) ends, bit for bit:
    weights, master, moments and losses."""
    extra = {} if grad_dtype is None else {"grad_dtype": grad_dtype}

    def run(one_pass: bool):
        if one_pass:
            monkeypatch.delenv(cpu_adam.DISABLE_ENV, raising=False)
        else:
            monkeypatch.setenv(cpu_adam.DISABLE_ENV, "1")
        calls = count_calls(monkeypatch)
        model, opt, losses = train(0, spec(kind, tmp_path / f"store{one_pass}", chunk, buffers), dtype=dtype,
                                   clip=0.5, lr=3e-2, fused=True, **extra)  # fmt: skip
        state = opt.local_state_dict()["inner"]
        masters = [opt.master_shard(i) for i in range(len(opt.flats))]  # None for fp32: the parameters are
        opt.close()
        return model, state, masters, losses, calls

    model, state, masters, losses, calls = run(True)
    ref_model, ref_state, ref_masters, ref_losses, ref_calls = run(False)
    assert calls and not ref_calls
    if kind == "cpu":
        assert len(calls) == 4 * len(masters)  # one call a flat group a step: no chunk loop
    assert losses == ref_losses
    assert max_diff(model, ref_model) == 0.0
    for ours, theirs in zip(masters, ref_masters):
        if ours is not None:
            assert_equal(ours, theirs, "master")
    for group, ref_group in zip(state, ref_state):
        for name in ("exp_avg", "exp_avg_sq"):
            assert_equal(group[name], ref_group[name], name)


def test_fallback_when_the_build_fails(tmp_path, monkeypatch, caplog):
    """No compiler (here: a build that raises): `available()` is False, one warning says why, the
    engine steps with torch's kernel, the same weights as the forced fallback."""
    monkeypatch.delenv(cpu_adam.DISABLE_ENV, raising=False)
    monkeypatch.setattr(cpu_adam, "_state", {"tried": False, "module": None, "error": None})

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpu_adam, "_build", no_compiler)
    with caplog.at_level(logging.WARNING, logger=cpu_adam.__name__):
        assert not cpu_adam.available() and not cpu_adam.available()
        model, opt, losses = train(0, spec("cpu", tmp_path), dtype=torch.bfloat16)
    warnings = [r for r in caplog.records if r.name == cpu_adam.__name__]
    assert len(warnings) == 1 and "Ninja is required" in warnings[0].getMessage()
    assert "Ninja is required" in cpu_adam.build_error()
    monkeypatch.setenv(cpu_adam.DISABLE_ENV, "1")
    ref_model, ref_opt, ref_losses = train(0, spec("cpu", tmp_path / "ref"), dtype=torch.bfloat16)
    assert losses == ref_losses and max_diff(model, ref_model) == 0.0


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setenv(cpu_adam.DISABLE_ENV, "1")
    assert cpu_adam.disabled() and not cpu_adam.available()
    monkeypatch.setenv(cpu_adam.DISABLE_ENV, "0")
    assert not cpu_adam.disabled()


# ---- the build lock: [Note: the build lock] in cpu_adam.py -----------------------------------

# The module alone, from its file (argv[1]): importing the package (transformers...) takes 10 s more a process.
MODULE = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("trainer_shard.offload.cpu_adam", sys.argv[1])
cpu_adam = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_adam)
"""

KILLED_BUILDER = MODULE + """
import os, signal
import torch.utils.cpp_extension as ext

def killed(**kwargs):  # the compiler running, torch's lock taken, when the OOM killer strikes
    os.kill(os.getpid(), signal.SIGKILL)

ext._write_ninja_file_and_build_library = killed
cpu_adam.available()
"""

NEXT_RUN = MODULE + """
import json, logging, time
import torch.utils.cpp_extension as ext

def no_build(**kwargs):  # where the build itself is not what is tested
    raise RuntimeError("the build ran")

records = []
handler = logging.Handler()
handler.emit = records.append
logging.getLogger(cpu_adam.__name__).addHandler(handler)
logging.getLogger(cpu_adam.__name__).setLevel(logging.INFO)
cpu_adam.BUILD_TIMEOUT_S = float(sys.argv[2])
if sys.argv[3] == "no-build":
    ext.load_inline = no_build
started = time.monotonic()
available = cpu_adam.available()
print(json.dumps({"available": available, "error": cpu_adam.build_error(), "seconds": time.monotonic() - started,
                  "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING]}))
"""


def run_python(code: str, env: dict, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    """`code` in a fresh process; the test fails, naming the hang, where it runs past `timeout`."""
    try:
        return subprocess.run([sys.executable, "-c", code, cpu_adam.__file__, *args], env=env, capture_output=True,
                              text=True, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s: the build waits on a lock nobody will release")


def next_run(env: dict, timeout_s: float, mode: str) -> dict:
    done = run_python(NEXT_RUN, env, str(timeout_s), mode, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture
def extensions(tmp_path, monkeypatch) -> dict:
    """The environment of a run whose torch extension folder is `tmp_path` (and this process's too)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv(cpu_adam.DISABLE_ENV, raising=False)
    return dict(os.environ)


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
def test_a_build_killed_mid_way_does_not_hang_the_next_run(tmp_path, extensions):
    """A builder SIGKILLed mid-build leaves torch's `<folder>/lock`: the next run falls back to
    torch's path at once, with one warning naming the lock, and removes it (so the run after
    builds). Before: the next run waited on that lock for ever."""
    killed = run_python(KILLED_BUILDER, extensions)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    (baton,) = tmp_path.glob("*/lock")
    got = next_run(extensions, 600, "build")
    assert not got["available"] and got["seconds"] < 30
    assert len(got["warnings"]) == 1 and str(baton) in got["warnings"][0] and "killed" in got["warnings"][0]
    assert "BuildLockError" in got["error"] and not baton.exists()


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
def test_a_live_builder_is_waited_for_a_bounded_time(extensions):
    """Another process holds the build lock (a rank building): the next waits for it, at most
    `BUILD_TIMEOUT_S`, then falls back with one warning; it never reaches torch's lock."""
    with open(cpu_adam.build_folder() / cpu_adam.OWNER_LOCK, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        got = next_run(extensions, 2, "no-build")
    assert not got["available"] and 2 <= got["seconds"] < 30
    assert len(got["warnings"]) == 1 and "another process has been building" in got["warnings"][0]


@pytest.mark.parametrize("age", [30, 3600])
def test_a_lock_made_outside_ours_is_not_waited_on(tmp_path, extensions, age):
    """torch's lock with no builder written down in ours (another version of the package made
    it): the run falls back without waiting; a lock older than a build takes is removed, a
    younger one left to its builder."""
    baton = cpu_adam.build_folder() / "lock"
    baton.touch()
    os.utime(baton, (time.time() - age,) * 2)
    got = next_run(extensions, 600, "build")
    assert not got["available"] and got["seconds"] < 30 and len(got["warnings"]) == 1
    assert baton.exists() == (age < 600), got["warnings"]


def test_the_build_is_logged_with_its_folder_and_compiles_the_cpp_file(tmp_path, extensions, monkeypatch, caplog):
    """"building the CPU Adam kernel in PATH" before the build, PATH torch's build folder; the
    source is cpu_adam.cpp, shipped with the package (setup.cfg's package_data)."""
    built = {}
    monkeypatch.setattr(cpp_extension, "load_inline", lambda **kwargs: built.update(kwargs) or "module")
    with caplog.at_level(logging.INFO, logger=cpu_adam.__name__):
        assert cpu_adam._build() == "module"
    (folder,) = tmp_path.iterdir()
    assert f"building the CPU Adam kernel in {folder}" in caplog.text
    assert built["build_directory"] == str(folder)
    assert built["cpp_sources"] == [cpu_adam.SOURCE_FILE.read_text()] and "void adam_step(" in built["cpp_sources"][0]
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    assert "*.cpp" in setup["options.package_data"]["trainer_shard.offload"]
