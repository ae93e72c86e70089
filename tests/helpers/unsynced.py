"""Under torchrun: a ShardedSeq2SeqTrainer given plain TrainingArguments without --use_cpu.

The transformers Trainer would let each rank train alone; the mixin must refuse.
"""

import sys

import torch
from transformers import Seq2SeqTrainingArguments, T5Config, T5ForConditionalGeneration

from trainer_shard import DistributedSetupError, ShardedSeq2SeqTrainer

kwargs = dict(output_dir=sys.argv[1], report_to="none")
if len(sys.argv) > 2:
    kwargs["ddp_backend"] = sys.argv[2]
model = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=8, d_ff=16, num_layers=1, num_heads=1, d_kv=8))
try:
    ShardedSeq2SeqTrainer(model=model, args=Seq2SeqTrainingArguments(**kwargs))
except DistributedSetupError as e:
    print(f"refused: {e}", file=sys.stderr)
    sys.exit(3)
finally:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
print("trained unsynchronised")
