#!/usr/bin/env python
"""Speed through the Trainer, the way users run it: finetune_trainer.py on 2 gloo ranks, DDP,
`--sharded_ddp simple`, `zero_dp_2` and `"zero_dp_3 auto_wrap"`, the t5-small and t5-base
architectures (random init, seed 0), fp32, batch 8 a rank, 64 source and 64 target tokens.

    python bench/trainer_speed.py                          # bench/results/trainer_speed.{md,json}
    python bench/trainer_speed.py --models small --steps 10 --rounds 1   # a smoke test

Rounds are interleaved (every model and strategy once a round, in the same order), and the table
gives each run's median `train_runtime` over the rounds with its spread (min-max), the ratios
zero_dp_2 / DDP and zero_dp_3 / zero_dp_2 within the same rounds, each rank's peak RSS (the larger
of the two, median) and how many times the run handed the heap back to the OS after the Trainer
was built (`trainer_shard.memory.release_freed_memory`, glibc's malloc_trim), counted in each
rank, inside the training steps and in all. Issue 36 asks zero_dp_3 <= 1.05x zero_dp_2 and
zero_dp_2 <= 1.02x DDP, ZeRO-3's peak below ZeRO-2's and no trim call in the steps. Not a test:
minutes. Run nothing else meanwhile.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _finetune_rank import run_finetune  # noqa: E402
from _results import cpu_name, write_results  # noqa: E402

ARCHS = {"small": dict(d_model=512, d_ff=2048, num_layers=6, num_heads=8, d_kv=64, model_vocab_size=32128),
         "base": dict(d_model=768, d_ff=3072, num_layers=12, num_heads=12, d_kv=64, model_vocab_size=32128),
         "tiny": dict(d_model=64, d_ff=256, num_layers=2, num_heads=2, d_kv=32, model_vocab_size=2000)}  # fmt: skip
STRATEGIES = {"ddp": [], "simple": ["--sharded_ddp", "simple"], "zero_dp_2": ["--sharded_ddp", "zero_dp_2"],
              "zero_dp_3": ["--sharded_ddp", "zero_dp_3 auto_wrap"]}  # fmt: skip
GIB = 2**30


def as_rank(argv: list) -> None:
    """finetune_trainer.main(argv) with every `release_freed_memory` call after the Trainer is
    built counted (the load's are not training's), and apart those inside the training steps
    (from the first step's forward to the last step's optimizer step: none is asked there; the
    rest come while the optimizer builds its flat buffers or closes); writes {"trim_calls",
    "trim_calls_in_steps", "peak_rss"} to OUTPUT_DIR/speed_rank<R>.json."""
    from trainer_shard import memory

    calls = [0]
    release = memory.release_freed_memory

    def counted() -> None:
        calls[0] += 1
        release()

    import trainer_shard.trainer as trainer_module

    at_start = [0]
    init = trainer_module.ShardedTrainerMixin.__init__

    def recorded(self, *args, **kwargs):  # calls up to here are the load's (a meta model read a unit at a time)
        init(self, *args, **kwargs)
        at_start[0] = calls[0]

    trainer_module.ShardedTrainerMixin.__init__ = recorded

    import transformers

    steps = {}  # calls at the first step's start and at the last step's end
    training_step = transformers.Trainer.training_step

    def first_step(self, *args, **kwargs):
        steps.setdefault("first", calls[0])
        return training_step(self, *args, **kwargs)

    on_step_end = transformers.trainer_callback.CallbackHandler.on_step_end

    def step_end(self, *args, **kwargs):  # after the optimizer's step
        steps["last"] = calls[0]
        return on_step_end(self, *args, **kwargs)

    transformers.Trainer.training_step = first_step
    transformers.trainer_callback.CallbackHandler.on_step_end = step_end

    def count() -> None:  # every module that imported it by name, the package's own too
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("trainer_shard") and getattr(
                    module, "release_freed_memory", None) is release:  # fmt: skip
                module.release_freed_memory = counted

    def record(trainer) -> None:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        (Path(trainer.args.output_dir) / f"speed_rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(
            {"trim_calls": calls[0] - at_start[0], "trim_calls_in_steps": steps["last"] - steps["first"],
             "peak_rss": peak}))  # fmt: skip

    run_finetune(argv, record, prepare=count)


def build(folder: Path, models: list) -> dict:
    from trainer_shard.demo import build_demo_model, make_demo_data

    data = folder / "data"
    if not (data / "train.source").is_file():
        make_demo_data(data, n_train=1024, n_val=8, n_test=8, seed=0)
    paths = {"data": data}
    for name in models:
        out = folder / name
        if not (out / "config.json").is_file():
            build_demo_model(data, out, **ARCHS[name])
        paths[name] = out
    return paths


def run(paths: dict, model: str, strategy: str, steps: int, out: Path, timeout: int) -> dict:
    flags = ["--model_name_or_path", paths[model], "--data_dir", paths["data"], "--output_dir", out,
             "--task", "translation_en_to_ro", "--max_source_length", "64", "--max_target_length", "64",
             "--do_train", "--max_steps", str(steps), "--per_device_train_batch_size", "8", "--logging_steps", "1000",
             "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--overwrite_output_dir",
             "--seed", "0", *STRATEGIES[strategy]]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--as-rank", *map(str, flags)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT))  # fmt: skip
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise SystemExit(f"{model} {strategy}: exit {proc.returncode}\n{(proc.stdout + proc.stderr)[-4000:]}")
    ranks = [json.loads((out / f"speed_rank{r}.json").read_text()) for r in (0, 1)]
    metrics = json.loads((out / "train_results.json").read_text())
    return {"model": model, "strategy": strategy, "train_runtime": metrics["train_runtime"],
            "train_loss": metrics["train_loss"], "wall": time.perf_counter() - started,
            "peak_rss": max(r["peak_rss"] for r in ranks), "trim_calls": max(r["trim_calls"] for r in ranks),
            "trim_calls_in_steps": max(r["trim_calls_in_steps"] for r in ranks)}  # fmt: skip


def table(runs: list, models: list) -> str:
    lines = ["| model | run | train_runtime median (s) | spread (min-max) | vs DDP | vs zero_dp_2 | peak RSS / rank "
             "(median) | trim calls / rank: in the steps, in all | train loss |",
             "|---|---|---:|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for model in models:
        med = {}
        for strategy in STRATEGIES:
            mine = [r for r in runs if r["model"] == model and r["strategy"] == strategy]
            if mine:
                med[strategy] = statistics.median(r["train_runtime"] for r in mine)
        for strategy, time_s in med.items():
            mine = [r for r in runs if r["model"] == model and r["strategy"] == strategy]
            times = [r["train_runtime"] for r in mine]
            vs_ddp = f"{time_s / med['ddp']:.3f}x" if "ddp" in med else "-"
            vs_z2 = f"{time_s / med['zero_dp_2']:.3f}x" if strategy == "zero_dp_3" and "zero_dp_2" in med else "-"
            peak = statistics.median(r["peak_rss"] for r in mine) / GIB
            losses = ", ".join(sorted({f"{r['train_loss']:.4f}" for r in mine}))
            lines.append(f"| t5-{model} | {strategy} | {time_s:.2f} | {min(times):.2f}-{max(times):.2f} | {vs_ddp} | "
                         f"{vs_z2} | {peak:.2f} GiB | {max(r['trim_calls_in_steps'] for r in mine)}, "
                         f"{max(r['trim_calls'] for r in mine)} | {losses} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["small", "base"], choices=list(ARCHS))
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/trainer_shard_speed"))
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "trainer_speed")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    paths = build(args.folder, args.models)
    runs = []
    for round_index in range(args.rounds):
        for model in args.models:
            for strategy in args.strategies:
                result = run(paths, model, strategy, args.steps, args.folder / f"out_{model}_{strategy}", args.timeout)
                runs.append({**result, "round": round_index})
                print(f"round {round_index} t5-{model} {strategy}: {result['train_runtime']:.2f} s, peak "
                      f"{result['peak_rss'] / GIB:.2f} GiB, trims {result['trim_calls_in_steps']} in the steps, "
                      f"{result['trim_calls']} in all", flush=True)  # fmt: skip
    meta = {"cpu": cpu_name(), "cpus": os.cpu_count(), "command": " ".join(sys.argv), "steps": args.steps}
    text = (f"# Speed through the Trainer (finetune_trainer.py, 2 ranks on gloo; the sharded runs' all-gathers and "
            f"reduce-scatters through shared memory, DDP's all-reduce gloo's)\n\nWritten by `python "
            f"{' '.join(sys.argv)}` (bench/trainer_speed.py); CPU: {meta['cpu']}, {os.cpu_count()} cores. fp32, batch 8 "
            f"a rank, 64 + 64 tokens, {args.steps} steps a run, {args.rounds} interleaved rounds; train_runtime is the "
            f"Trainer's.\n\n{table(runs, args.models)}\n")  # fmt: skip
    write_results(args.out, {"meta": meta, "runs": runs}, text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--as-rank":
        as_rank(sys.argv[2:])
    else:
        main()
