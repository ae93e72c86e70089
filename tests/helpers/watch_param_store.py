"""Run finetune_trainer.main, watching ZeRO-3's parameter store through each evaluation loop
(evaluate, predict); then write what it saw to OUTPUT_DIR/store{RANK}.json:

    {"val": {"folder": ..., "files": [...], "read_bytes": N, "held": {...}}, "test": {...}}

`files`: the store's files as the loop began; `read_bytes`: what the loop read from them (both
absent without a parameter store); `held`: `ShardedModel.held_parameter_bytes()` as it ended;
`model_bytes`: the whole model's parameters. Shows that evaluation and generate() read the
parameters from disk (or from this rank's shards), and left nothing gathered.
"""

import json
import os
import runpy
import sys
from pathlib import Path

from trainer_shard.sharding.zero3 import full_numel
from trainer_shard.trainer import ShardedTrainerMixin

seen = {}
evaluation_loop = ShardedTrainerMixin.evaluation_loop


def watched(self, *args, metric_key_prefix="eval", **kwargs):
    sharded = self.sharded_model
    disk = sharded.store.disk if sharded.store is not None else None
    if disk is not None:
        files, before = sorted(p.name for p in disk.folder.iterdir()), disk.stats["read_bytes"]
    output = evaluation_loop(self, *args, metric_key_prefix=metric_key_prefix, **kwargs)
    seen[metric_key_prefix] = {"held": sharded.held_parameter_bytes(),
                               "model_bytes": sum(full_numel(p) * p.element_size() for p in sharded.model.parameters())}
    if disk is not None:
        seen[metric_key_prefix].update(folder=str(disk.folder), files=files,
                                       read_bytes=disk.stats["read_bytes"] - before)  # fmt: skip
    return output


ShardedTrainerMixin.evaluation_loop = watched
script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "finetune_trainer.py"))
try:
    trainer, _ = script["main"](sys.argv[1:])
    (Path(trainer.args.output_dir) / f"store{os.environ.get('RANK', '0')}.json").write_text(json.dumps(seen))
finally:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
