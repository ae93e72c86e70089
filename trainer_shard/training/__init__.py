"""What `trainer.ShardedTrainerMixin` is made of, one concern a module; each is usable and
testable without building a Trainer, and `trainer.py` keeps only the Trainer overrides that call
them.

- `guard`: the distributed guard (every process torchrun started trains in one group).
- `loss`: whether a model's loss honours the Trainer's `num_items_in_batch`.
- `evaluation`: the metrics gather that drops the samples even batches repeat.
- `plan`: the ZeRO stage and offload of a run (flags, config, `--sharded_ddp auto`), and the
  room it needs on disk, decided before anything is built.
- `build`: the `ShardedOptimizer` the plan asks for, around the optimizer the Trainer builds.
- `checkpoints`: staged checkpoint saves, the optimizer shards and the LR schedule in them.
- `supervision`: the fault watch and interrupts around `train()`.
"""
