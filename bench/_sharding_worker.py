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

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        held = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
        self.grad_bytes = max(self.grad_bytes, held)

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.started)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t) and t.dim() > 0)


def inner_optimizer(opt):
    """Unwrap accelerate / DeepSpeed / ZeRO wrappers down to the torch optimizer holding the state."""
    seen = set()
    while id(opt) not in seen:
        seen.add(id(opt))
        for name in ("optim", "optimizer"):
            inner = getattr(opt, name, None)
            if isinstance(inner, torch.optim.Optimizer) or hasattr(inner, "state"):
                opt = inner
                break
        else:
            break
    return opt


def optimizer_state_bytes(opt) -> int:
    return sum(tensor_bytes(s.values()) for s in inner_optimizer(opt).state.values())


def sharded_grad_bytes(trainer) -> tuple:
    """(persistent, transient peak) gradient bytes beyond `.grad`, for the rows that keep their own."""
    sharded = getattr(trainer, "sharded_optimizer", None)
    if sharded is not None:
        reducer = sharded.reducer
        return sharded.shard_bytes()["grad"], reducer.peak_bucket_bytes if reducer is not None else 0
    ds = getattr(trainer, "deepspeed", None)
    ds_opt = getattr(ds, "optimizer", None)
    if ds_opt is not None and hasattr(ds_opt, "single_partition_of_fp32_groups"):
        # ZeRO-2 keeps fp32 gradient partitions on its fp32 weight partitions, and fills ipg buckets
        partitions = tensor_bytes(p.grad for p in ds_opt.single_partition_of_fp32_groups if p.grad is not None)
        averaged = sum(tensor_bytes(g) for g in getattr(ds_opt, "averaged_gradients", {}).values())
        ipg = tensor_bytes(getattr(ds_opt, "ipg_buffer", None) or [])
        return max(partitions, averaged), ipg
    return 0, 0


def main() -> None:
    row, result_dir = sys.argv[1], Path(sys.argv[2])
    flags = sys.argv[sys.argv.index("--") + 1 :]
    script = runpy.run_path(str(HERE.parent / "scripts" / "finetune_trainer.py"))
    probe = Probe()
    extra = {"callbacks": [probe]}
    if row == "torch_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        extra["optimizer_cls_and_kwargs"] = (
            ZeroRedundancyOptimizer,
            {"optimizer_class": torch.optim.AdamW, "lr": 3e-4, "weight_decay": 0.01, "fused": True},
        )
    try:
        trainer, _ = script["main"](flags, **extra)
        history = [e["loss"] for e in trainer.state.log_history if "loss" in e]
        persistent, transient = sharded_grad_bytes(trainer)
        rank = int(os.environ.get("RANK", "0"))
        result = {
            "row": row,
            "rank": rank,
            "parameters": sum(p.numel() for p in trainer.model.parameters()),
            "step_times": probe.times,
            "median_step_s": median(probe.times[3:] or probe.times),
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "optimizer_state_bytes": optimizer_state_bytes(trainer.optimizer),
            "grad_bytes": probe.grad_bytes + persistent,
            "grad_transient_peak_bytes": transient,
            "final_loss": history[-1] if history else None,
        }
        result_dir.mkdir(parents=True, exist_ok=True)
        (result_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
