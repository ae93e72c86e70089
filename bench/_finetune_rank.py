"""Run finetune_trainer.py's `main` inside a torchrun rank of a benchmark, then record what it
measured (bench/load_rss.py, bench/trainer_speed.py)."""

import gc
import runpy
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "finetune_trainer.py"


def run_finetune(argv: list, record, prepare=None) -> None:
    """finetune_trainer.main(argv) in this rank: `prepare()` first, once the script's modules are
    imported, then `record(trainer)`. The Trainer is freed before the process group is destroyed:
    a DDP Reducer freed after it hangs in gloo's destructor (it joins a gloo thread that waits for
    the GIL the destructor holds)."""
    script = runpy.run_path(str(SCRIPT))
    if prepare is not None:
        prepare()
    trainer, _ = script["main"](argv)
    record(trainer)
    del trainer, script
    gc.collect()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
