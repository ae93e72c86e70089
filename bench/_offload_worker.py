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


def train(row: str, flags: list) -> dict:
    sys.path.insert(0, str(HERE))
    from _sharding_worker import Probe

    script = runpy.run_path(str(HERE.parent / "scripts" / "finetune_trainer.py"))
    probe = Probe()
    trainer, _ = script["main"](flags, callbacks=[probe])
    history = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    optimizer = getattr(trainer, "sharded_optimizer", None)
    return {
        "parameters": sum(p.numel() for p in trainer.model.parameters()),
        "step_times": probe.times,
        "median_step_s": median(probe.times[2:] or probe.times),
        "peak_rss_bytes": peak_rss(),
        "offload": optimizer.shard_bytes() if optimizer is not None else None,
        "final_loss": history[-1] if history else None,
    }


def adam(row: str, numel: int, repeats: int = 7) -> dict:
    """One AdamW step of an NUMEL-element shard, bf16 parameters out, median of `repeats`.

    ours_bf16: the offload engine from a bf16 gradient shard (the default: upcast per chunk);
    ours_fp32: the offload engine from an fp32 gradient shard (data_types.grad_accum_dtype fp32);
    deepspeed: DeepSpeedCPUAdam from an fp32 gradient, then the copy of the updated fp32
    weights into the bf16 parameters that ZeRO-Offload makes after it (timed apart too).
    Gradients are in place before the timer starts, as backward leaves them.
    """
    torch.manual_seed(0)
    hyper = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    params16 = torch.randn(numel).to(torch.bfloat16)
    extra = {}
    if row.startswith("ours"):
        from trainer_shard.offload import OffloadSpec
        from trainer_shard.sharding import ShardedOptimizer

        param = torch.nn.Parameter(params16)
        grad_dtype = torch.float32 if row == "ours_fp32" else torch.bfloat16
        opt = ShardedOptimizer([param], optim=torch.optim.AdamW, stage=2, offload=OffloadSpec("cpu"),
                               grad_dtype=grad_dtype, **hyper)  # fmt: skip
        grad = torch.randn(numel).to(grad_dtype)

        def prepare():
            opt.flats[0].grad.copy_(grad)  # the reduced gradient shard, as backward leaves it
            opt.flats[0].stale = set()
            opt._grads_ready = True

        def step():
            opt.step()
    else:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        param = torch.nn.Parameter(params16.float())
        param.grad = torch.randn(numel)
        opt = DeepSpeedCPUAdam([param], adamw_mode=True, **hyper)
        copies = []

        def prepare():
            pass

        def step():
            opt.step()
            started = time.perf_counter()
            params16.copy_(param.data)  # ZeRO-Offload then copies the fp32 partition into the 16-bit parameters
            copies.append(time.perf_counter() - started)

        extra = {"copy_times": copies}
    prepare()
    step()  # warm-up (first-step state, DeepSpeed's op build)
    times = []
    for _ in range(repeats):
        prepare()
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    result = {"numel": numel, "step_times": times, "median_step_s": median(times), "peak_rss_bytes": peak_rss()}
    if extra:
        result["median_copy_s"] = median(extra["copy_times"][1:])
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
