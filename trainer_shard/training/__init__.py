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
- `stage3`: ZeRO-3's model sharding (units, persistence, a meta-built model read from its files).
- `saving`: the model's files as the Trainer's `_save` writes them.
- `precision`: the compute dtype apart from the storage dtype (`--compute_dtype`).

What the mixin does, told from the user's side:

`ShardedTrainerMixin` goes first in the bases of any Trainer subclass:

    class MyTrainer(ShardedTrainerMixin, Seq2SeqTrainer): ...

With neither `--sharded_ddp` nor `--offload` it changes nothing the Trainer computes: the same
seed and data give bit-identical weights. What it always adds is the distributed guard: a run
launched on several processes that would not train together stops with a clear error.

With `--sharded_ddp simple|zero_dp_2` it swaps in `ShardedOptimizer` around the optimizer the
Trainer would have built (same class, hyperparameters and weight-decay groups):

- `simple` (ZeRO-1): the model is wrapped in DDP as usual; each rank steps its shard.
- `zero_dp_2` (ZeRO-2): no DDP; the optimizer's backward hooks reduce-scatter the gradients.
- `zero_dp_3` (ZeRO-3): no DDP; the parameters are sharded too (`sharding.zero3`), one unit per
  layer with `auto_wrap` (else the whole model is one unit), gathered for each forward and
  backward; the model is sharded when the optimizer is built, so evaluation before training
  runs on the whole model. Saving streams `model.safetensors` a unit at a time; generate()
  runs with `synced_gpus` so ranks finishing first keep step with the others.
- `--bf16` / `--fp16`: the model's parameters and gradients become 16-bit; each rank keeps fp32
  master weights for its shard. fp16 scales the loss dynamically (`ShardedGradScaler`). The
  matrix products run in `--compute_dtype` (`auto`: fp32 on a CPU without 16-bit kernels, each
  layer's parameters cast while it runs; see `precision`).
- gradient clipping and the logged grad norm use the global norm over all shards;
  checkpoints hold each rank's optimizer shard and resume at any world size (see
  [Note: sharded checkpoints]).

With `--offload CONFIG.json` (or `--sharded_ddp "zero_dp_2 offload"`, CPU offload with the
defaults) the optimizer's master weights and state go to the offload engine's store, CPU RAM
or disk, and the config's sections take effect (`config.apply`): its ZeRO stage when
`--sharded_ddp` names none, bucket sizes, `overlap_comm`, the optimizer (replacing `--optim`),
the WarmupLR/WarmupDecayLR schedule (replacing `--lr_scheduler_type`) and the fp16 loss scaler.
On one process, offload runs the ZeRO-2 path on a world of one.

At stage 3 the config's `offload_param` (device cpu or nvme) puts the parameter shards, and on
disk their gradient shards too, in a store of their own (`offload.param_store`), read ahead a
unit at a time; the optimizer must be offloaded as well (`offload_optimizer`, or the `offload` of
`--sharded_ddp "zero_dp_3 offload"`: CPU RAM). With the optimizer's state on disk, stage 3 keeps
the gradient shards on disk too, beside it (`offload.param_store.GradStore`), and on the CPU has
the C heap map large blocks apart (`plan.on_disk`). Room on disk for the stores, and their
folders free of other runs, are checked when the Trainer is built, before anything is written.
"""
