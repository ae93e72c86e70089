"""One rank of one `bench/sharding.py` row: finetune_trainer.main with a measuring callback.

    torchrun --nproc_per_node 2 bench/_sharding_worker.py ROW RESULT_DIR -- FINETUNE_FLAGS...

ROW is ddp | simple | zero_dp_2 | torch_zero | deepspeed_zero2 (the flags already select it,
except torch_zero, whose optimizer is passed to the trainer here). Writes RESULT_DIR/rankR.json.
"""

import json
import os
import resource
import runpy
import sys
import time
from pathlib import Path
from statistics import median

import torch
from transformers import TrainerCallback

HERE = Path(__file__).resolve().parent


class Probe(TrainerCallback):
    """Step times, and the gradient bytes held when the optimizer steps."""

    def __init__(self):
        self.times, self.grad_bytes, self.started = [], 0, None

    def on_step_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kwargs):
        held = tensor_bytes([p.grad for p in model.parameters()]) + engine_grad_bytes(optimizer)
        self.grad_bytes = max(self.grad_bytes, held)

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.started)


def tensor_bytes(tensors) -> int:
    """Bytes of the tensors in a (possibly nested, possibly None-holding) collection."""
    if tensors is None:
        return 0
    if torch.is_tensor(tensors):
        return tensors.numel() * tensors.element_size() if tensors.dim() > 0 else 0
    if isinstance(tensors, dict):
        tensors = tensors.values()
    return sum(tensor_bytes(t) for t in tensors)


def unwrapped(opt):
    """The chain of wrappers (accelerate, DeepSpeed, ZeRO, ours) down to the innermost optimizer."""
    seen = set()
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        yield opt
        opt = getattr(opt, "optim", None) or getattr(opt, "optimizer", None)


def inner_optimizer(opt):
    """The innermost torch optimizer: the one holding the state."""
    return [o for o in unwrapped(opt) if hasattr(o, "state")][-1]


def optimizer_state_bytes(opt) -> int:
    return sum(tensor_bytes(s.values()) for s in inner_optimizer(opt).state.values())


def engine_grad_bytes(optimizer) -> int:
    """Gradients an engine keeps outside `.grad`: our fp32 shard, DeepSpeed's averaged partitions."""
    for opt in unwrapped(optimizer):
        if hasattr(opt, "shard_bytes"):  # ShardedOptimizer
            return opt.shard_bytes()["grad"]
        if hasattr(opt, "single_partition_of_fp32_groups"):  # DeepSpeed ZeRO-1/2
            partitions = tensor_bytes([p.grad for p in opt.single_partition_of_fp32_groups])
            return max(partitions, tensor_bytes(getattr(opt, "averaged_gradients", None)))
    return 0


def transient_bucket_bytes(trainer) -> int:
    sharded = getattr(trainer, "sharded_optimizer", None)
    reducer = getattr(sharded, "reducer", None)
    return reducer.peak_bucket_bytes if reducer is not None else 0


def use_torch_zero() -> None:
    """Seq2SeqTrainer takes no `optimizer_cls_and_kwargs`: set it as the optimizer is created."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from trainer_shard import ShardedSeq2SeqTrainer

    create = ShardedSeq2SeqTrainer.create_optimizer

    def create_optimizer(self, model=None):
        kwargs = {"optimizer_class": torch.optim.AdamW, "lr": self.args.learning_rate, "fused": True}
        self.optimizer_cls_and_kwargs = (ZeroRedundancyOptimizer, kwargs)
        # accelerate's device placement round-trips state_dict(), which ZeRO refuses unconsolidated
        self.accelerator.device_placement = False
        return create(self, model)

    ShardedSeq2SeqTrainer.create_optimizer = create_optimizer


def main() -> None:
    row, result_dir = sys.argv[1], Path(sys.argv[2])
    flags = sys.argv[sys.argv.index("--") + 1 :]
    script = runpy.run_path(str(HERE.parent / "scripts" / "finetune_trainer.py"))
    probe = Probe()
    extra = {"callbacks": [probe]}
    if row == "torch_zero":
        use_torch_zero()
    try:
        trainer, _ = script["main"](flags, **extra)
        history = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        rank = int(os.environ.get("RANK", "0"))
        result = {
            "row": row,
            "rank": rank,
            "parameters": sum(p.numel() for p in trainer.model.parameters()),
            "step_times": probe.times,
            "median_step_s": median(probe.times[3:] or probe.times),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "optimizer_state_bytes": optimizer_state_bytes(trainer.optimizer),
            # DeepSpeed steps inside accelerate's backward and frees its gradient partitions before
            # the Trainer's pre-step hook: not observable from here
            "grad_bytes": None if row == "deepspeed_zero2" else probe.grad_bytes,
            "grad_transient_peak_bytes": transient_bucket_bytes(trainer),
            "final_loss": history[-1] if history else None,
        }
        result_dir.mkdir(parents=True, exist_ok=True)
        (result_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
