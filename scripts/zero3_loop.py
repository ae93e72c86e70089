"""ZeRO-3 in a plain training loop, without the Trainer: each rank keeps 1/N of the parameters.

    torchrun --nproc_per_node 2 scripts/zero3_loop.py --model_name_or_path data/demo_t5 \
        --data_dir data/demo_en_ro --output_dir output/zero3_loop --max_steps 100 --persistence_threshold 1000

`trainer_shard.sharding.shard_model` wraps the model in place: one unit per T5Block (and the rest
of the model as the root unit), each unit's parameters gathered only while it runs forward or
backward; the optimizer steps each rank's fp32 shards. Logs the loss and the parameter bytes this
rank holds between steps, and saves the trained model (gathered a unit at a time) on rank 0.
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
from transformers.models.t5.modeling_t5 import T5Block

from trainer_shard.sharding import shard_model


def batches(data_dir: Path, tokenizer, batch_size: int, rank: int, world_size: int):
    """This rank's share of train.source/train.target, a batch at a time, for ever."""
    sources = (data_dir / "train.source").read_text().splitlines()
    targets = (data_dir / "train.target").read_text().splitlines()
    while True:
        for start in range(rank * batch_size, len(sources) - batch_size + 1, world_size * batch_size):
            batch = tokenizer(sources[start : start + batch_size], text_target=targets[start : start + batch_size],
                              max_length=64, truncation=True, padding=True, return_tensors="pt")  # fmt: skip
            batch["labels"][batch["labels"] == tokenizer.pad_token_id] = -100
            yield batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--data_dir", type=Path, required=True)
    parser.add_argument("--output_dir", type=Path, required=True)
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=2e-3)
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--persistence_threshold", type=int, default=100_000,
                        help="parameters with fewer elements stay whole on every rank (DeepSpeed's default)")
    args = parser.parse_args()

    dist.init_process_group("gloo")  # NCCL on GPUs
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # every rank starts from the same weights
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(args.model_name_or_path)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())

    sharded = shard_model(model, units=[T5Block], persistence_threshold=args.persistence_threshold)
    optimizer = torch.optim.AdamW(sharded.shard_parameters(), lr=args.learning_rate, fused=True)
    model.train()
    data = batches(args.data_dir, tokenizer, args.per_device_train_batch_size, rank, world_size)
    for step in range(1, args.max_steps + 1):
        loss = model(**next(data)).loss
        loss.backward()
        norm = sharded.clip_grad_norm_(args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.max_steps):
            held = sharded.held_parameter_bytes()
            print(f"step {step}: loss {loss.item():.4f}, grad norm {norm.item():.3f}, parameter bytes on this rank "
                  f"{held['shards'] + held['persistent']:,} of {whole:,}", flush=True)  # fmt: skip

    state = sharded.full_state_dict()  # collective: every rank gathers, unit by unit
    if rank == 0:
        model.save_pretrained(args.output_dir, state_dict=state)
        tokenizer.save_pretrained(args.output_dir)
        print(f"saved {args.output_dir}", flush=True)
    sharded.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
