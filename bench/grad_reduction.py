#!/usr/bin/env python
"""16-bit gradient reduction: how far the reduced gradient lands from the exact one, and where fp16
overflows, for each way of summing N ranks' gradients; and how far weights drift when
micro-batches are summed in bf16 instead of fp32.

    .venv/bin/python bench/grad_reduction.py   # writes bench/results/grad_reduction.{md,json}

The N ranks are simulated in one process: only the numerics of the sum matter. A ring reduction
(NCCL's and gloo's) passes each chunk from rank to rank, adding one rank's values at each hop
and rounding to the wire dtype: `ring_sum` does exactly that, hop by hop. The gradients are
synthetic (seeded): each element has its own scale (log-normal, sigma 2: gradients of one model
span several orders of magnitude), a signal shared by the ranks and per-rank noise of the same
size (each rank sees other data).

1. Error of the reduced mean against the exact (fp64) mean of the ranks' 16-bit gradients,
   relative RMS: sum then divide (this project before issue 17), divide then sum (DDP,
   DeepSpeed), sum in fp32, and rounding the exact mean once (the floor of any 16-bit result).
2. fp16: the largest per-rank gradient that reduces without inf, and the error of the unscaled
   mean at the largest power-of-two loss scale each way allows (a dynamic scaler settles there):
   summing first forces a scale N times lower; dividing first in fp16 shifts the smallest
   gradients toward fp16's subnormals; an fp32 bucket does neither.
3. Micro-batches summed in a bf16 gradient shard against an fp32 one: the gradient's error, and
   the weights after 20 AdamW steps of a bf16 MLP (ShardedOptimizer, CPU offload, fp32 masters),
   their difference as a share of how far training moved them.
"""

import json
from pathlib import Path

import torch

from _results import write_markdown  # bench/_results.py (these run as scripts: bench/ is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
COMMAND = ".venv/bin/python bench/grad_reduction.py"
NUMEL = 2**16
WORLDS = (2, 3, 8, 16, 64, 512)
FP16_MAX = torch.finfo(torch.float16).max


def rank_gradients(world: int, seed: int = 0, spread: float = 2.0) -> torch.Tensor:
    """[world, NUMEL] fp32 gradients: per-element scale (log-normal, sigma `spread`) x (shared
    signal + per-rank noise)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(spread * torch.randn(NUMEL, generator=g)) * 1e-3
    signal = torch.randn(NUMEL, generator=g)
    return scale * (signal + torch.randn(world, NUMEL, generator=g))


def ring_sum(parts: torch.Tensor, dtype) -> torch.Tensor:
    """Sum of the rows, hop by hop, rounding to `dtype` after each addition."""
    total = parts[0].to(dtype)
    for row in parts[1:]:
        total = (total + row.to(dtype)).to(dtype)
    return total


def reduce(grads16: torch.Tensor, method: str) -> torch.Tensor:
    """The mean of the rows of 16-bit `grads16`, as `method` computes it, in fp64."""
    world, dtype = grads16.shape[0], grads16.dtype
    if method == "sum, then divide":
        return ring_sum(grads16, dtype).double() / world
    if method == "divide, then sum":
        return ring_sum(grads16 / world, dtype).double()
    if method == "sum in fp32":
        return ring_sum(grads16.float() / world, torch.float32).double()
    return grads16.double().mean(0).to(dtype).double()  # "one rounding"


METHODS = ("sum, then divide", "divide, then sum", "sum in fp32", "one rounding")


def relative_error(value: torch.Tensor, exact: torch.Tensor) -> float:
    finite = torch.isfinite(value)
    if not bool(finite.all()):
        return float("inf")
    return float((value - exact).norm() / exact.norm())


def reduction_errors() -> list:
    rows = []
    for dtype, loss_scale in ((torch.bfloat16, 1.0), (torch.float16, 2.0**10)):
        for world in WORLDS:
            grads16 = (rank_gradients(world) * loss_scale).to(dtype)
            exact = grads16.double().mean(0)
            rows.append({"dtype": str(dtype).removeprefix("torch."), "world": world,
                         **{m: relative_error(reduce(grads16, m), exact) for m in METHODS}})  # fmt: skip
    return rows


def largest_finite(world: int, method: str) -> float:
    """The largest fp16 gradient, the same on every rank, whose reduction stays finite."""
    lo, hi = 1.0, FP16_MAX
    for _ in range(60):
        mid = (lo + hi) / 2
        parts = torch.full((world, 1), mid).half()
        if bool(torch.isfinite(reduce(parts, method)).all()):
            lo = mid
        else:
            hi = mid
    return lo


def usable_scale(grads: torch.Tensor, method: str) -> float:
    """The largest power-of-two loss scale at which `method` reduces `grads` without inf (down to
    2^-4; a dynamic scaler's min_loss_scale is 1: below it every step is skipped)."""
    scale = 2.0**24
    while scale > 2.0**-4 and not bool(torch.isfinite(reduce((grads * scale).half(), method)).all()):
        scale /= 2
    return scale


def fp16_overflow() -> list:
    """At the usable scale: the relative RMS error of the mean (the large gradients dominate it),
    the mean relative error of the smaller half of the elements, and the share flushed to zero."""
    rows = []
    for world in WORLDS:
        grads = rank_gradients(world, seed=1, spread=3.0)
        exact = grads.double().mean(0)
        small = exact.abs() < exact.abs().median()
        row = {"world": world}
        for method in METHODS[:3]:
            scale = usable_scale(grads, method)
            mean = reduce((grads * scale).half(), method) / scale
            row[method] = {"largest": largest_finite(world, method), "scale": scale,
                           "error": relative_error(mean, exact),
                           "small": float(((mean - exact).abs() / exact.abs())[small].mean()),
                           "zeros": float((mean == 0).double().mean())}  # fmt: skip
        rows.append(row)
    return rows


def accumulation_gradient_error() -> list:
    rows = []
    for micro in (2, 4, 8, 16, 64):
        parts = rank_gradients(micro, seed=2).bfloat16()  # each micro-batch's (reduced) bf16 gradient
        exact = parts.double().sum(0)
        rows.append({"micro": micro, "bf16": relative_error(ring_sum(parts, torch.bfloat16).double(), exact),
                     "fp32": relative_error(ring_sum(parts, torch.float32).double(), exact),
                     "once": relative_error(exact.bfloat16().double(), exact)})  # fmt: skip
    return rows


def train_mlp(micro: int, grad_dtype, steps: int = 20) -> list:
    from trainer_shard.offload import OffloadSpec
    from trainer_shard.sharding import ShardedOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).bfloat16()
    opt = ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=2, lr=1e-3, fused=True,
                           offload=OffloadSpec("cpu"), grad_dtype=grad_dtype)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    target = torch.randn(64, 64, generator=g)
    for _ in range(steps):
        for _ in range(micro):
            x = torch.randn(16, 64, generator=g)
            (torch.nn.functional.mse_loss(model(x.bfloat16()).float(), x @ target) / micro).backward()
        opt.step()
        opt.zero_grad()
    weights = [p.detach().float().clone() for p in model.parameters()]
    opt.close()
    return weights


def accumulation_drift() -> list:
    torch.manual_seed(0)
    start = [p.detach().float() for p in torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).bfloat16().parameters()]  # fmt: skip
    rows = []
    for micro in (1, 4, 16):
        exact, rounded = train_mlp(micro, torch.float32), train_mlp(micro, torch.bfloat16)
        moved = torch.cat([(w - s).abs().reshape(-1) for w, s in zip(exact, start)])
        drift = torch.cat([(a - b).abs().reshape(-1) for a, b in zip(rounded, exact)])
        rows.append({"micro": micro, "moved_mean": float(moved.mean()), "drift_mean": float(drift.mean()),
                     "drift_max": float(drift.max()), "share": float(drift.mean() / moved.mean())})  # fmt: skip
    return rows


def markdown(results: dict) -> str:
    lines = ["# 16-bit gradient reduction", "", f"Command: `{COMMAND}`", "",
             f"Simulated ranks in one process, {NUMEL:,} synthetic gradient elements (see the script's docstring).",
             "", "## 1. Error of the reduced mean (relative RMS, against the exact mean of the 16-bit gradients)", "",
             "| dtype | ranks | " + " | ".join(METHODS) + " |", "|---|---|" + "---|" * len(METHODS)]  # fmt: skip
    for row in results["reduction"]:
        lines.append(f"| {row['dtype']} | {row['world']} | " + " | ".join(f"{row[m]:.2e}" for m in METHODS) + " |")
    lines += ["", "## 2. fp16 overflow", "",
              "Largest per-rank gradient (the same on every rank) whose reduction stays finite. Then, for "
              "gradients of a wider spread (sigma 3), the largest power-of-two loss scale at which the reduction "
              "has no inf (where a dynamic scaler settles; below 2^0 every step is skipped), and at that scale "
              "the unscaled mean's relative RMS error, the mean relative error of the smaller half of its "
              "elements, and the share flushed to zero.", ""]  # fmt: skip
    for method in METHODS[:3]:
        lines += [f"{method}:", "", "| ranks | largest finite | loss scale | RMS error | smaller half | zeros |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for row in results["fp16"]:
            cell = row[method]
            lines.append(f"| {row['world']} | {cell['largest']:.0f} | 2^{int(torch.tensor(cell['scale']).log2())} | "
                         f"{cell['error']:.2e} | {cell['small']:.2e} | {cell['zeros']:.2%} |")  # fmt: skip
        lines.append("")
    lines += ["", "## 3. Micro-batches summed in a bf16 gradient shard", "",
              "Relative RMS error of the sum of the micro-batches' bf16 gradients:", "",
              "| micro-batches | summed in bf16 | summed in fp32 | exact sum rounded once to bf16 |",
              "|---|---|---|---|"]  # fmt: skip
    for row in results["accumulation"]:
        lines.append(f"| {row['micro']} | {row['bf16']:.2e} | {row['fp32']:.2e} | {row['once']:.2e} |")
    lines += ["", "Weights of a bf16 MLP (64-256-64) after 20 AdamW steps (lr 1e-3, fp32 masters, CPU offload), "
              "bf16 against fp32 gradient shard:", "",
              "| micro-batches | mean distance moved | mean drift | largest drift | drift / moved |",
              "|---|---|---|---|---|"]  # fmt: skip
    for row in results["drift"]:
        lines.append(f"| {row['micro']} | {row['moved_mean']:.2e} | {row['drift_mean']:.2e} | {row['drift_max']:.2e} | "
                     f"{row['share']:.1%} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    torch.set_num_threads(1)
    results = {"reduction": reduction_errors(), "fp16": fp16_overflow(),
               "accumulation": accumulation_gradient_error(), "drift": accumulation_drift()}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "grad_reduction.json").write_text(json.dumps(results, indent=1))
    write_markdown(RESULTS / "grad_reduction.md", markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
