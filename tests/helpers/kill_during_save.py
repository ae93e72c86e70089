"""Run finetune_trainer.main, but SIGKILL this process in the middle of saving checkpoint-K.

K comes from KILL_AT_STEP, the rank from KILL_RANK (default 0). The process dies after the model
and the optimizer shards of that checkpoint are written and before its RNG states and trainer
state are: a save cut short, as by the OOM killer or a preempted node.
"""

import os
import runpy
import signal
import sys
from pathlib import Path

from trainer_shard.trainer import ShardedTrainerMixin



def _save_rng_state(self, output_dir):
    if self.state.global_step == int(os.environ["KILL_AT_STEP"]) and self.args.process_index == int(
        os.environ.get("KILL_RANK", "0")
    ):
        os.kill(os.getpid(), signal.SIGKILL)
    return super(ShardedTrainerMixin, self)._save_rng_state(output_dir)


ShardedTrainerMixin._save_rng_state = _save_rng_state
script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "finetune_trainer.py"))
script["main"](sys.argv[1:])
