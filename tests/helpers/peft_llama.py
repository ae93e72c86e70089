"""A user's own Trainer (`ShardedTrainerMixin` + `transformers.Trainer`) fine-tuning LoRA adapters
(PEFT) on a tiny Llama, launched by torchrun on gloo. Writes OUT/log.json (the Trainer's log
history) and OUT/held{RANK}.json: the bytes of the live CPU tensors of this process between
steps (found through the garbage collector, storages counted once), less those alive before the
model was built; the base model's bytes; at ZeRO-3, the largest unit's, the gather pool's (unit
buffers kept for the next step, counted in the live bytes too) and those of the base's
parameters small enough to stay whole on every rank (the persistence threshold).

    torchrun --nproc_per_node 2 tests/helpers/peft_llama.py OUT [--sharded_ddp "zero_dp_3 auto_wrap"]
"""

import gc
import json
import os
import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback

from trainer_shard import ShardedTrainerMixin, ShardedTrainingArguments


class LoraTrainer(ShardedTrainerMixin, Trainer):
    """What a user writes: the mixin first, the Trainer they already use."""


def live_bytes() -> int:
    """Bytes of every CPU storage a live tensor (or a storage object) reaches, each once; not the
    shared-memory collectives' slots (the transport's buffers, as gloo's sockets' are not counted)."""
    from trainer_shard import shm_comm

    gc.collect()
    transport = {s.data_ptr() for s in shm_comm.storages()}
    storages = {}
    for obj in gc.get_objects():
        for item in [obj, *(gc.get_referents(obj) if isinstance(obj, (list, dict)) else ())]:
            if isinstance(item, torch.Tensor) and item.device.type == "cpu" and not item.is_meta:
                storage = item.untyped_storage()
            elif isinstance(item, torch.UntypedStorage) and item.device.type == "cpu":
                storage = item
            else:
                continue
            if storage.data_ptr() in transport:
                continue
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(storages.values())


class Held(TrainerCallback):
    def __init__(self):
        self.seen = []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(live_bytes())


def main(out, sharded_ddp):
    rank = int(os.environ.get("RANK", "0"))
    before = live_bytes()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=384, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    base = LlamaForCausalLM(config)
    base_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0))  # fmt: skip
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 512, (64, 32), generator=g)]
    args = ShardedTrainingArguments(output_dir=out, use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=4,
                                    max_steps=4, learning_rate=1e-3, logging_steps=1, report_to="none",
                                    save_strategy="no", seed=0, max_grad_norm=1.0, disable_tqdm=True,
                                    sharded_ddp=sharded_ddp)  # fmt: skip
    held = Held()
    trainer = LoraTrainer(model=model, args=args, train_dataset=data, callbacks=[held])
    trainer.train()
    Path(out).mkdir(parents=True, exist_ok=True)
    if rank == 0:
        Path(out, "log.json").write_text(json.dumps(trainer.state.log_history))
    sharded = trainer.sharded_model
    units = max((u.numel * 4 for u in sharded.units), default=0) if sharded else 0
    pool = sharded.pool.free_bytes if sharded else 0
    whole = sum(p.numel() * p.element_size() for p in sharded.persistent if not p.requires_grad) if sharded else 0
    Path(out, f"held{rank}.json").write_text(json.dumps({"live": [b - before for b in held.seen], "base": base_bytes,
                                                          "largest_unit": units, "pool": pool, "whole": whole}))  # fmt: skip


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
