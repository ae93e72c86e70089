"""Run finetune_trainer.main, then save this rank's final weights to OUTPUT_DIR/rank{RANK}.pt.

Lets a test compare what every rank ends with, which the script itself saves only on rank 0.
"""

import json
import os
import runpy
import sys
from pathlib import Path

import torch

script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "finetune_trainer.py"))
try:
    trainer, _ = script["main"](sys.argv[1:])
    model = trainer.accelerator.unwrap_model(trainer.model)
    if trainer.sharded_model is not None:  # ZeRO-3: gathered unit by unit (collective)
        state = trainer.sharded_model.full_state_dict()
        from trainer_shard.sharding.zero3 import full_numel

        held = dict(trainer.sharded_model.held_parameter_bytes(), total=sum(full_numel(v) * v.element_size()
                    for v in model.parameters()))  # fmt: skip
        (Path(trainer.args.output_dir) / f"held{os.environ.get('RANK', '0')}.json").write_text(json.dumps(held))
    else:
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(state, Path(trainer.args.output_dir) / f"rank{os.environ.get('RANK', '0')}.pt")
finally:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
