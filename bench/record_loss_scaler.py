#!/usr/bin/env python
"""Records DeepSpeed's own fp16 loss-scale sequences, the reference tests/test_loss_scaler.py
holds `trainer_shard.sharding.scaler.DynamicLossScaler` to.

    python3 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0 && DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install deepspeed
    /tmp/dsvenv/bin/python bench/record_loss_scaler.py   # writes tests/data/loss_scaler/deepspeed_sequences.json

It needs DeepSpeed, installed in a venv of its own (bench/.venv, the peers' venv, will do);
trainer_shard and its tests never import DeepSpeed, they read the JSON. The committed file was
recorded with DeepSpeed 0.19.8 (torch 2.13.0, CPU), in a few seconds.

Each case runs `deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler` (what DeepSpeed's ZeRO
1/2/3 optimizers build through `CreateLossScaler` for fp16 with `loss_scale` 0) over a fixed
overflow pattern, one `update_scale` per character ("x": overflow, ".": good step), and records
after every update the scale and the hysteresis budget left (`cur_hysteresis`). With
`raise_error_at_min_scale` true, `raised_at` is the index of the update that raised (DeepSpeed
raises a bare Exception before changing anything); the lists stop before it. The settings are
DeepSpeed's constructor arguments: `init_scale` (2**fp16.initial_scale_power), `scale_window`
(fp16.loss_scale_window), `min_scale` (fp16.min_loss_scale), `delayed_shift` (fp16.hysteresis),
`consecutive_hysteresis` (fp16.consecutive_hysteresis), `raise_error_at_min_scale` (never set by
DeepSpeed's engine: its default, true, applies there).

The cases: hand-written patterns (isolated overflows, two and three in a row, alternating,
overflows at the start, overflows one step before, at and after a growth) and seeded random ones,
for hysteresis 1, 2 and 3 with and without consecutive hysteresis, windows 1, 2, 3 and 5; runs
down to the minimum scale (1, 0.25, and 3 from 2**3, which halving never hits exactly), with and
without the error; and one longer run at a window of 50.

`update_scale` logs through `deepspeed.comm.get_rank()`, so the script first starts a
one-process gloo group (a file in a temporary folder, no network).
"""

import json
import random
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "loss_scaler" / "deepspeed_sequences.json"


def boundary_pattern(window: int) -> str:
    """Overflows one good step before, exactly at, and one after the step that would grow."""
    w = window
    return "." * w + "x" + "." * (w + 1) + "x" + "." * (w - 1) + "xx" + "." * (w + 2) + "x" + "." * (2 * w + 1)


def random_pattern(seed: int, length: int, p: float) -> str:
    rng = random.Random(seed)
    return "".join("x" if rng.random() < p else "." for _ in range(length))


HAND_PATTERNS = {
    "all_good": "." * 16,
    "isolated": "..x....x.......x......",
    "two_in_a_row": "...xx......xx.........",
    "three_in_a_row": "..xxx.......xxx........",
    "alternating": "x.x.x.x.x.x.x.",
    "start_with_overflows": "xx..x...xxx......",
    "four_then_good": "xxxx..........xxxx.....",
}

MIN_SCALE_PATTERNS = {
    "all_overflow": "x" * 14,
    "overflow_every_other": ".x" * 10,
    "pairs": "xx." * 8,
    "down_then_up": "x" * 8 + "." * 12 + "xxx",
}


def cases() -> list:
    """Every (name, settings, pattern)."""
    out = []
    for delayed_shift in (1, 2, 3):
        for consecutive in (False, True):
            for window in (1, 2, 3, 5):
                patterns = dict(HAND_PATTERNS, boundary=boundary_pattern(window))
                for seed in (1, 2):
                    patterns[f"random_{seed}"] = random_pattern(100 * window + seed, 40, 0.3)
                for name, pattern in patterns.items():
                    settings = dict(init_scale=2.0**8, scale_window=window, min_scale=1, delayed_shift=delayed_shift,
                                    consecutive_hysteresis=consecutive, raise_error_at_min_scale=False)  # fmt: skip
                    out.append((f"{name}/h{delayed_shift}/c{int(consecutive)}/w{window}", settings, pattern))
    for power, min_scale in ((4, 1), (2, 0.25), (3, 3)):
        for delayed_shift in (1, 2):
            for consecutive in (False, True):
                for raise_error in (False, True):
                    for name, pattern in MIN_SCALE_PATTERNS.items():
                        settings = dict(init_scale=2.0**power, scale_window=2, min_scale=min_scale,
                                        delayed_shift=delayed_shift, consecutive_hysteresis=consecutive,
                                        raise_error_at_min_scale=raise_error)  # fmt: skip
                        tag = f"p{power}/min{min_scale}/h{delayed_shift}/c{int(consecutive)}/r{int(raise_error)}"
                        out.append((f"min_scale_{name}/{tag}", settings, pattern))
    settings = dict(init_scale=2.0**16, scale_window=50, min_scale=1, delayed_shift=2, consecutive_hysteresis=False,
                    raise_error_at_min_scale=True)  # fmt: skip
    out.append(("long/h2/c0/w50", settings, random_pattern(7, 400, 0.02)))
    return out


def record(scaler_cls, name: str, settings: dict, pattern: str) -> dict:
    scaler = scaler_cls(**settings)
    scales, hysteresis, raised_at = [], [], None
    for i, char in enumerate(pattern):
        try:
            scaler.update_scale(char == "x")
        except Exception as error:  # DeepSpeed raises a bare Exception at the minimum scale
            if "minimum" not in str(error):
                raise
            raised_at = i
            break
        scales.append(scaler.cur_scale)
        hysteresis.append(scaler.cur_hysteresis)
    return {"name": name, "settings": settings, "pattern": pattern, "scales": scales,
            "cur_hysteresis": hysteresis, "raised_at": raised_at}  # fmt: skip


def main() -> None:
    import deepspeed
    import deepspeed.comm as dist
    import torch
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_distributed(dist_backend="gloo", init_method=f"file://{tmp}/init", rank=0, world_size=1,
                              auto_mpi_discovery=False)  # fmt: skip
        records = [record(DynamicLossScaler, *case) for case in cases()]
    header = {"deepspeed": deepspeed.__version__, "torch": torch.__version__,
              "source": "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler.update_scale",
              "written_by": "bench/record_loss_scaler.py", "cases": len(records)}  # fmt: skip
    OUT.parent.mkdir(parents=True, exist_ok=True)
    lines = ",\n".join(json.dumps(r) for r in records)  # one case a line: reviewable diffs
    OUT.write_text(f'{{"header": {json.dumps(header)},\n"cases": [\n{lines}\n]}}\n')
    print(f"{len(records)} cases from DeepSpeed {deepspeed.__version__} -> {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
