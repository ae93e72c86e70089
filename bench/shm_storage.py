#!/usr/bin/env python
"""What a ZeRO-3 gather storage made anew costs against one reused: the root's, which backward
lets go each step ([Note: the root let go in backward] in trainer_shard/sharding/zero3/root.py).

    python bench/shm_storage.py            # bench/results/shm_storage.{md,json}

One process, through the transport's own calls (`ShmGroup.new_storage`, `forget`): a storage of
the size of t5-small's and t5-base's tied embedding (32128 x 512 and x 768 fp32) made and mapped
from /dev/shm, written once (its pages faulted in), written again (the cost of a reused one), and
let go (unlinked and unmapped). Medians over the repetitions. Not a test: seconds.
"""

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from _results import cpu_name, write_results  # noqa: E402

from trainer_shard.shm_comm import ShmGroup  # noqa: E402

SIZES = {"t5-small's embedding": 32128 * 512 * 4, "t5-base's embedding": 32128 * 768 * 4}


def measure(nbytes: int, repeats: int) -> dict:
    group = ShmGroup(0, 1, [os.getpid()], timeout=10.0, name=f"g{os.getpid()}x{uuid.uuid4().hex[:8]}")
    source = torch.randn(nbytes // 4)
    times = {"make": [], "first_write": [], "reused_write": [], "let_go": []}
    for _ in range(repeats):
        started = time.perf_counter()
        storage, number = group.new_storage(nbytes)
        made = time.perf_counter()
        if number < 0:
            raise SystemExit("no room in /dev/shm for the storage")
        values = torch.empty(0, dtype=torch.float32).set_(storage)
        values.copy_(source)
        first = time.perf_counter()
        values.copy_(source)
        second = time.perf_counter()
        group.forget(number)
        del values, storage
        gone = time.perf_counter()
        for key, (a, b) in zip(times, ((started, made), (made, first), (first, second), (second, gone))):
            times[key].append(b - a)
    group.close()
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "shm_storage")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = {name: measure(nbytes, args.repeats) for name, nbytes in SIZES.items()}
    lines = ["| storage | MB | make and map (ms) | first write (ms) | write into a reused one (ms) | let go (ms) | "
             "made anew, all told, less a reused write (ms) |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, t in rows.items():
        extra = t["make"] + t["first_write"] + t["let_go"] - t["reused_write"]
        lines.append(f"| {name} | {SIZES[name] / 1e6:.1f} | {1e3 * t['make']:.1f} | {1e3 * t['first_write']:.1f} | "
                     f"{1e3 * t['reused_write']:.1f} | {1e3 * t['let_go']:.1f} | {1e3 * extra:.1f} |")  # fmt: skip
    meta = {"cpu": cpu_name(), "command": " ".join(sys.argv), "repeats": args.repeats}
    text = (f"# A gather storage in /dev/shm made anew against one reused\n\nWritten by `python {' '.join(sys.argv)}` "
            f"(bench/shm_storage.py); CPU: {meta['cpu']}. One process, one thread; medians of {args.repeats} "
            f"repetitions.\n\n" + "\n".join(lines) + "\n")  # fmt: skip
    write_results(args.out, {"meta": meta, "rows": rows}, text)


if __name__ == "__main__":
    main()
