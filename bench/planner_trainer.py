"""`--sharded_ddp auto`'s estimates for ddp, simple and zero_dp_2 against the measured peak RSS of
Trainer runs (finetune_trainer.py) on 2 gloo ranks.

    python bench/planner_trainer.py            # about 1-2 minutes on 2 cores

Moved here from tests/test_planner.py (`test_predictions_within_tolerance_of_measured_peaks`,
67 s of `make test`): a measurement, not a check of logic. What stays in the tests: the state
arithmetic of every row against the bytes real ranks hold (`test_state_bytes_are_what_the_optimizer_holds`,
ddp and simple included), and `--sharded_ddp auto` choosing zero_dp_2 within 1.5 GiB on the same
model (`auto_run`, `test_sharded_ddp_auto_chooses_what_fits_and_trains`). zero_dp_3's rows
(and zero_dp_2's, in a plain loop): bench/planner_zero3.py.

The model: the t5-small architecture (60.5 M parameters, random init, seed 0), big enough that
the state, not the runtime, decides the peak, on the tests' tiny demo data (256 training pairs,
TINY_FLAGS: lengths truncated at 32). Each run: 2 steps at batch 8 per rank, fused AdamW (the
second step runs forward and backward with the optimizer's state in place, so its peak is the
run's), under tests/helpers/peak_rss.py (ru_maxrss of each rank; the larger is the run's peak),
OMP_NUM_THREADS=1 as the tests run it:
- zero_dp_2: `--sharded_ddp auto` with `max_memory` 1.5 GiB: it chooses zero_dp_2, and the
  estimates it prints (its own probe, on the training set's lengths, 2 decimals of GiB) are the
  predictions for every row;
- ddp: no --sharded_ddp; simple: `--sharded_ddp simple`.
Passes when every estimate is within 15% of its measured peak and zero_dp_2 measures below DDP
(exit 1 otherwise). Writes bench/results/planner_trainer.md and .json.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from _results import write_markdown  # noqa: E402
from conftest import TINY_FLAGS, free_port, script_env  # noqa: E402  (the tests' flags and environment)

PEAK = ROOT / "tests" / "helpers" / "peak_rss.py"
TOLERANCE = 0.15
BUDGET_GIB = 1.5
GiB = 2**30


def run_flags(model, data, out, *extra):
    return ["--model_name_or_path", model, "--data_dir", data, "--output_dir", out, *TINY_FLAGS, "--do_train",
            "--max_steps", "2", "--per_device_train_batch_size", "8", "--optim", "adamw_torch_fused", *extra]  # fmt: skip


def run(args, timeout) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(PEAK), *map(str, args)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise SystemExit(f"exit {proc.returncode}: {' '.join(map(str, args))}\n{(proc.stdout + proc.stderr)[-4000:]}")
    return proc


def measured_peak(out: Path) -> int:
    return max(json.loads(p.read_text())["peak_rss_bytes"] for p in out.glob("peak_rss_rank*.json"))


def measure(work: Path, timeout: int) -> dict:
    from trainer_shard import planner
    from trainer_shard.demo import build_demo_model, make_demo_data

    data = make_demo_data(work / "data", n_train=256, n_val=24, n_test=20, seed=3)  # tests/conftest.py's tiny_data
    model = build_demo_model(data, work / "small", d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64,
                             model_vocab_size=32128)  # fmt: skip
    budget = work / "budget.json"
    budget.write_text(json.dumps({"max_memory": {"cpu": f"{BUDGET_GIB}GiB"}}))
    started = time.time()
    proc = run(run_flags(model, data, work / "auto", "--sharded_ddp", "auto", "--offload", budget), timeout)
    walls = {"zero_dp_2": time.time() - started}
    chose = re.search(r"--sharded_ddp auto: chose (\S+):", proc.stdout)
    listed = re.search(r"estimates, GiB per rank: ([^)]*)\)", proc.stdout).group(1)
    estimates = {(name, offload or "none"): float(gib)
                 for name, offload, gib in re.findall(r"(\w+)(?: \+ (\w+) offload)? (\d+\.\d+)", listed)}  # fmt: skip
    assert set(estimates) == {(s, o or "none") for s, o in planner.AUTO_ORDER}, listed
    assert chose and chose.group(1) == "zero_dp_2", proc.stdout[-2000:]  # the auto run is the zero_dp_2 row
    report = {"zero_dp_2": (estimates[("zero_dp_2", "none")], measured_peak(work / "auto") / GiB)}
    for strategy, extra in (("ddp", []), ("simple", ["--sharded_ddp", "simple"])):
        started = time.time()
        run(run_flags(model, data, work / strategy, *extra), timeout)
        walls[strategy] = time.time() - started
        report[strategy] = (estimates[(strategy, "none")], measured_peak(work / strategy) / GiB)
    return {s: {"estimate_gib": p, "measured_gib": round(m, 4), "error": round(p / m - 1, 4),
                "wall_s": round(walls[s], 1)} for s, (p, m) in report.items()}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "planner_trainer")
    args = parser.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="planner-trainer-") as work:
        rows = measure(Path(work), args.timeout)
    ok = all(abs(r["error"]) <= TOLERANCE for r in rows.values()) and (
        rows["zero_dp_2"]["measured_gib"] < rows["ddp"]["measured_gib"])
    lines = ["| row | estimate (GiB per rank) | measured peak (GiB) | error | wall (s) |", "|---|---|---|---|---|"]
    lines += [f"| {s} | {r['estimate_gib']:.2f} | {r['measured_gib']:.3f} | {r['error']:+.1%} | {r['wall_s']} |"
              for s, r in rows.items()]  # fmt: skip
    text = (f"# Planner: Trainer runs' measured peaks against `--sharded_ddp auto`'s estimates\n\n"
            f"Command: `python bench/planner_trainer.py` ({time.time() - started:.0f} s; load average at the end "
            f"{os.getloadavg()[0]:.2f})\n\nt5-small architecture, 2 gloo ranks on the CPU, batch 8 per rank, lengths "
            f"32, 2 steps of fused AdamW through finetune_trainer.py; see the docstring of bench/planner_trainer.py. "
            f"Tolerance {TOLERANCE:.0%}; zero_dp_2 must measure below DDP: "
            f"{'passed' if ok else 'FAILED'}.\n\n" + "\n".join(lines) + "\n")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_markdown(args.out.with_suffix(".md"), text)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
