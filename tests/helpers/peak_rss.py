"""Run finetune_trainer.main, then write this rank's peak RSS (ru_maxrss, bytes) to
OUTPUT_DIR/peak_rss_rank{RANK}.json: what `trainer-shard estimate` is checked against."""

import json
import os
import resource
import runpy
import sys
from pathlib import Path

script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "finetune_trainer.py"))
try:
    trainer, _ = script["main"](sys.argv[1:])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = Path(trainer.args.output_dir) / f"peak_rss_rank{os.environ.get('RANK', '0')}.json"
    out.write_text(json.dumps({"peak_rss_bytes": peak}))
finally:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
