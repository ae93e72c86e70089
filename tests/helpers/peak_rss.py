"""Run finetune_trainer.main, then write this rank's peak memory to OUTPUT_DIR/peak_rss_rank{RANK}.json:
ru_maxrss (bytes) on the CPU, what `trainer-shard estimate` is checked against; on a GPU, with
PEAK_CUDA_BUDGET (bytes) set, the budget is enforced with `torch.cuda.set_per_process_memory_fraction`
and the peak is `torch.cuda.max_memory_allocated` (bench/seed_table.py)."""

import json
import os
import resource
import runpy
import sys
from pathlib import Path

import torch

cuda_budget = int(os.environ.get("PEAK_CUDA_BUDGET", "0"))
if cuda_budget and torch.cuda.is_available():
    device = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_per_process_memory_fraction(min(1.0, cuda_budget / torch.cuda.get_device_properties(device).total_memory), device)
script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "finetune_trainer.py"))
try:
    trainer, _ = script["main"](sys.argv[1:])
    if cuda_budget and torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = Path(trainer.args.output_dir) / f"peak_rss_rank{os.environ.get('RANK', '0')}.json"
    out.write_text(json.dumps({"peak_rss_bytes": peak}))
finally:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
