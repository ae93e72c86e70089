#!/usr/bin/env python
"""Where fp32 compute of bf16 parameters spends its RSS: one process, the t5-large architecture
sharded by `shard_model(units=[T5Block])` (world of one, parameters in RAM), batch 4 x 64 tokens,
three forward + backward steps each row; bf16 compute against fp32 compute (`compute.ComputeCast`),
with glibc's default allocator and with `MALLOC_MMAP_THRESHOLD_` fixed (large freed blocks go back
to the OS at once instead of staying in the heap).

    .venv/bin/python bench/compute_rss.py            # bench/results/compute_rss.md

Per row: the step time and the rise of peak RSS (VmHWM, reset before each step) over the RSS at
the step's start, medians of steps 2 and 3 (step 1 allocates the gradients' first buffers).
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import cpu_name, write_markdown  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ROWS = [("bf16", None), ("fp32", None), ("bf16", "65536"), ("fp32", "65536"), ("fp32", "1048576")]


def worker(compute: str, rendezvous: str) -> None:
    import time

    import torch
    import torch.distributed as dist
    from transformers import T5ForConditionalGeneration
    from transformers.models.t5.modeling_t5 import T5Block

    from _infinity_worker import config_of
    from trainer_shard.compute import ComputeCast
    from trainer_shard.sharding import shard_model

    def status(key):
        return int(open("/proc/self/status").read().split(f"{key}:")[1].split()[0]) * 1024

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = T5ForConditionalGeneration(config_of("t5-large"))
    torch.set_default_dtype(torch.float32)
    sharded = shard_model(model, units=[T5Block])
    if compute == "fp32":
        ComputeCast(model, torch.float32, units=[m for m in model.modules() if isinstance(m, T5Block)],
                    ensure_ready=sharded.gather_for_backward)  # fmt: skip
    ids = torch.randint(2, 32128, (4, 64), generator=torch.Generator().manual_seed(0))
    steps = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        base = status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        steps.append((time.perf_counter() - start, status("VmHWM") - base))
    print(json.dumps({"steps": steps}))
    dist.destroy_process_group()


def main() -> None:
    results = []
    for compute, threshold in ROWS:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        env["PYTHONPATH"] = str(ROOT)
        if threshold:
            env["MALLOC_MMAP_THRESHOLD_"] = threshold
        with tempfile.TemporaryDirectory() as tmp:
            done = subprocess.run([sys.executable, __file__, "--worker", compute, f"{tmp}/rendezvous"], env=env,
                                  capture_output=True, text=True, check=True)  # fmt: skip
        steps = json.loads(done.stdout.strip().splitlines()[-1])["steps"][1:]
        results.append({"compute": compute, "threshold": threshold, "step": median(t for t, _ in steps),
                        "peak_rise": median(r for _, r in steps)})  # fmt: skip
        print(results[-1], flush=True)
    lines = ["| compute | MALLOC_MMAP_THRESHOLD_ | step (s) | peak RSS rise a step (MiB) |", "|---|---|---:|---:|"]
    lines += [f"| {r['compute']} | {r['threshold'] or 'glibc default'} | {r['step']:.2f} | {r['peak_rise'] / 2**20:,.0f} |"
              for r in results]  # fmt: skip
    text = (f"# RSS of fp32 compute over bf16 parameters (ZeRO-3, t5-large, one process)\n\nWritten by "
            f"`{Path(sys.executable).name} bench/compute_rss.py`; CPU: {cpu_name()}, {os.cpu_count()} cores.\n\n"
            + "\n".join(lines) + "\n")  # fmt: skip
    write_markdown(ROOT / "bench" / "results" / "compute_rss.md", text)
    print(text)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
