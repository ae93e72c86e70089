"""One row of `bench/offload.py`, in its own process (peak RSS is the process's own).

    python bench/_offload_worker.py train ROW RESULT.json -- FINETUNE_FLAGS...
    python bench/_offload_worker.py adam ROW RESULT.json NUMEL

`train` runs finetune_trainer.main with a step-timing callback. `adam` times one optimizer
step of an NUMEL-element shard (see `adam`).
"""

import json
import resource
import runpy
import sys
import time
from pathlib import Path
from statistics import median

import torch

HERE = Path(__file__).resolve().parent


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def process_io() -> dict:
    """This process's bytes read from and written to storage so far (/proc/self/io: read_bytes,
    write_bytes; a dirtied page counts for the process that dirtied it, when the kernel writes it
    back included), {} where there is no such file."""
    try:
        fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    except OSError:
        return {}
    return {"read_bytes": int(fields["read_bytes"]), "write_bytes": int(fields["write_bytes"])}


def train(row: str, flags: list) -> dict:
    sys.path.insert(0, str(HERE))
    from transformers import TrainerCallback

    from _sharding_worker import Probe

    class IoProbe(TrainerCallback):
        """/proc/self/io at the start and the end of every step."""

        def __init__(self):
            self.steps = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begun = process_io()

        def on_step_end(self, args, state, control, **kwargs):
            end = process_io()
            self.steps.append({k: end[k] - self.begun[k] for k in end})

    script = runpy.run_path(str(HERE.parent / "scripts" / "finetune_trainer.py"))
    probe, io = Probe(), IoProbe()
    trainer, _ = script["main"](flags, callbacks=[probe, io])
    history = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    optimizer = getattr(trainer, "sharded_optimizer", None)
    return {
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "step_times": probe.times,
        "median_step_s": median(probe.times[2:] or probe.times),
        "peak_rss_bytes": peak_rss(),
        "offload": optimizer.shard_bytes() if optimizer is not None else None,
        "final_loss": history[-1] if history else None,
        # bytes this process read from and wrote to storage a step: medians over the steps timed
        "disk_io": {k: median(step[k] for step in io.steps[2:] or io.steps) for k in io.steps[0]}
        if io.steps and io.steps[0] else None,
    }


def adam(row: str, numel: int, repeats: int = 7) -> dict:
    """One AdamW step of an NUMEL-element shard, bf16 parameters out, median of `repeats`.

    ours_bf16: the offload engine from a bf16 gradient shard (the default: upcast per chunk);
    ours_fp32: the offload engine from an fp32 gradient shard (data_types.grad_accum_dtype fp32);
    deepspeed: what DeepSpeed 0.19's ZeRO-1/2 step does to a CPU-offloaded partition
    (runtime/zero/stage_1_and_2.py, `step`, the `cpu_offload` branch): `unscale_and_clip_grads`
    multiplies the fp32 gradient partition by 1 / (clip * loss scale), DeepSpeedCPUAdam steps, the
    fp32 partition is copied into a 16-bit buffer and that buffer into the 16-bit parameters (the
    copies are timed apart too).
    A row ending in `_noclip` runs without gradient clipping (max_grad_norm 0 / gradient_clipping
    0); the others clip at 1.0, the Trainer's default, which a config's "gradient_clipping": "auto"
    passes to DeepSpeed. With clipping on, DeepSpeed makes its multiplication every step (its
    clip factor is clamped at 1, never skipped); trainer_shard applies a coefficient below 1 inside
    the fused kernel (its grad_scale). The gradient norm itself is computed before the timer on
    both sides (trainer_shard's `clip_grad_norm`, DeepSpeed's `scaled_global_norm`).
    Gradients are in place before the timer starts, as backward leaves them.
    """
    torch.manual_seed(0)
    hyper = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    clip = 0.0 if row.endswith("_noclip") else 1.0
    params16 = torch.randn(numel).to(torch.bfloat16)
    extra = {}
    if row.startswith("ours"):
        from trainer_shard.offload import OffloadSpec
        from trainer_shard.sharding import ShardedOptimizer

        param = torch.nn.Parameter(params16)
        grad_dtype = torch.float32 if row.startswith("ours_fp32") else torch.bfloat16
        opt = ShardedOptimizer([param], optim=torch.optim.AdamW, stage=2, offload=OffloadSpec("cpu"),
                               grad_dtype=grad_dtype, **hyper)  # fmt: skip
        grad = torch.randn(numel).to(grad_dtype)

        def prepare():
            opt.flats[0].grad.copy_(grad)  # the reduced gradient shard, as backward leaves it
            opt.flats[0].stale = set()
            opt._grads_ready = True
            if clip:
                opt.clip_grad_norm(clip)  # the norm, as the Trainer computes it before the step

        def step():
            opt.step()
    else:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        param = torch.nn.Parameter(params16.float())
        grad = torch.randn(numel)
        param.grad = grad.clone()
        buffer16 = torch.zeros(numel, dtype=torch.bfloat16)
        opt = DeepSpeedCPUAdam([param], adamw_mode=True, **hyper)
        norm = float(torch.linalg.vector_norm(grad, dtype=torch.float64))
        combined_scale = max((norm + 1e-6) / clip, 1.0) if clip else 1.0  # loss scale 1 (bf16)
        copies, adams = [], []

        def prepare():
            param.grad.copy_(grad)

        def step():
            if clip:  # unscale_and_clip_grads returns early only when clip_grad == 0 and loss_scale == 1
                param.grad.mul_(1.0 / combined_scale)
            started = time.perf_counter()
            opt.step()
            adams.append(time.perf_counter() - started)
            started = time.perf_counter()
            buffer16.copy_(param.data)  # fp32 partition -> the 16-bit CPU buffer
            params16.copy_(buffer16)  # -> the 16-bit parameter partition
            copies.append(time.perf_counter() - started)

        extra = {"copy_times": copies, "adam_times": adams}
    prepare()
    step()  # warm-up (first-step state, DeepSpeed's op build)
    times = []
    for _ in range(repeats):
        prepare()
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    result = {"numel": numel, "clip": clip, "step_times": times, "median_step_s": median(times), "peak_rss_bytes": peak_rss()}
    if extra:
        result["median_copy_s"] = median(extra["copy_times"][1:])
        result["median_adam_s"] = median(extra["adam_times"][1:])
    return result


def main() -> None:
    kind, row, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    try:
        if kind == "train":
            result = train(row, sys.argv[sys.argv.index("--") + 1 :])
        else:
            result = adam(row, int(sys.argv[4]))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"row": row, **result}, indent=1))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
