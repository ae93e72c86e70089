#!/usr/bin/env python
"""Host RAM at load under ZeRO-3: 2 ranks of finetune_trainer.py on the t5-large architecture in
fp32 (a checkpoint of random weights, 2.9 GB, made once), each rank's peak RSS against the
process's baseline (the same command on the 1-layer model of the same widths) plus 0.6x the
weights' bytes, and the node's summed RSS (both ranks, sampled every 20 ms).

    python bench/load_rss.py                          # all rows: bench/results/load_rss.{md,json}
    python bench/load_rss.py --arch tiny --rows predict   # a smoke test

Rows (each a torchrun of 2 ranks on gloo; its baseline run right before it):
- predict: `--sharded_ddp "zero_dp_3 auto_wrap" --do_predict --predict_with_generate` only.
- train: one training step, `"zero_dp_3 auto_wrap"` with the optimizer state on disk
  (an --offload config: offload_optimizer nvme, and the stage-3 sizes "auto" as in Hugging Face's
  documented ZeRO-3 config); the gradient shards go to disk beside the optimizer's state.
- train_bf16: the same step with `--bf16` (the fp32 checkpoint read into bf16 parameters, fp32
  masters and moments on disk, gradient shards in bf16).
- train_params_disk: the same step with the parameter and gradient shards on disk too
  (offload_param nvme, max_in_cpu 0: DeepSpeed's default keeps 1e9 elements in RAM): what a rank
  holds in RAM is then the units at work.
- auto: `--sharded_ddp auto` and one step, with a max_memory that only zero_dp_3 fits (below
  every other strategy's row of the planner, above a zero_dp_3 row; meta-device estimate): the
  run must choose zero_dp_3 before loading, and so load no rank's model whole.
Each rank records its peak RSS (VmHWM) right after the Trainer is built (the load) and at the
end. Not a test: minutes, and 6 GB of disk. Run nothing else meanwhile.
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _finetune_rank import run_finetune  # noqa: E402
from _results import cpu_name, write_results  # noqa: E402

GIB = 2**30
ARCHS = {"t5-large": dict(d_model=1024, d_ff=4096, num_layers=24, num_heads=16, d_kv=64, model_vocab_size=32128),
         "tiny": dict(d_model=64, d_ff=256, num_layers=2, num_heads=2, d_kv=32, model_vocab_size=2000)}  # fmt: skip
ROWS = ["predict", "train", "train_bf16", "train_params_disk", "auto"]
BOUND = 0.6  # of the weights' bytes, above the baseline
COMMON = ["--task", "translation_en_to_ro", "--max_source_length", "32", "--max_target_length", "16",
          "--val_max_target_length", "8", "--test_max_target_length", "8", "--n_test", "4",
          "--per_device_eval_batch_size", "2", "--per_device_train_batch_size", "2", "--n_train", "8",
          "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--overwrite_output_dir"]  # fmt: skip


def vm_kib(pid, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# ---- inside each rank --------------------------------------------------------------------------


def as_rank(argv: list) -> None:
    """finetune_trainer.main(argv), writing {"load": VmHWM after the Trainer is built, "end": at the
    end} to OUTPUT_DIR/rss_rank<R>.json (bytes)."""
    import trainer_shard.trainer as trainer_module

    seen = {}
    mixin = trainer_module.ShardedTrainerMixin
    init = mixin.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen["load"] = vm_kib("self", "VmHWM") * 1024
        seen["stage"] = self.sharding_stage

    mixin.__init__ = recorded

    def record(trainer) -> None:
        seen["end"] = vm_kib("self", "VmHWM") * 1024
        (Path(trainer.args.output_dir) / f"rss_rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(seen))

    run_finetune(argv, record)


# ---- the runs ----------------------------------------------------------------------------------


def build(folder: Path, arch: str) -> dict:
    """{"data", "model", "baseline"}: the demo data, the architecture's checkpoint and its 1-layer
    twin, made once under `folder` (random weights, seeded; safetensors, fp32)."""
    from trainer_shard.demo import build_demo_model, make_demo_data

    data = folder / "data"
    if not (data / "train.source").is_file():
        make_demo_data(data, n_train=64, n_val=8, n_test=8, seed=0)
    paths = {"data": data}
    for name, layers in (("model", ARCHS[arch]["num_layers"]), ("baseline", 1)):
        out = folder / f"{arch}-{layers}"
        if not (out / "config.json").is_file():
            build_demo_model(data, out, **{**ARCHS[arch], "num_layers": layers})
        paths[name] = out
    return paths


def weights_bytes(model: Path) -> int:
    return sum(p.stat().st_size for p in model.glob("*.safetensors"))


def torchrun(flags: list, out: Path, timeout: int) -> dict:
    """Run 2 ranks; {"ranks": [{"load", "end", "stage"}, ...], "node_peak": bytes, "seconds", "log"}."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--as-rank", *map(str, flags), "--output_dir", str(out)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(ROOT))  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
            try:
                pids = children.read_text().split()
            except OSError:
                pids = []
            peak[0] = max(peak[0], sum(vm_kib(p, "VmRSS") for p in pids) * 1024)
            time.sleep(0.02)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    log, _ = proc.communicate(timeout=timeout)
    done.set()
    thread.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{log[-4000:]}")
    ranks = [json.loads((out / f"rss_rank{r}.json").read_text()) for r in (0, 1)]
    return {"ranks": ranks, "node_peak": peak[0], "seconds": time.perf_counter() - start, "log": log}


def row_flags(row: str, paths: dict, folder: Path, model: Path) -> list:
    flags = ["--model_name_or_path", model, "--data_dir", paths["data"], *COMMON]
    if row == "predict":
        return [*flags, "--sharded_ddp", "zero_dp_3 auto_wrap", "--do_predict", "--predict_with_generate"]
    if row in ("train", "train_bf16", "train_params_disk"):
        # the stage-3 keys Hugging Face's documented ZeRO-3 config sets to "auto" (the Trainer fills
        # them from the hidden size: 0.9 h^2 elements prefetched, layers of at most 10 h kept whole)
        zero = {"stage": 3, "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                "offload_optimizer": {"device": "nvme", "nvme_path": str(folder / "store")}}  # fmt: skip
        if row == "train_params_disk":
            zero["offload_param"] = {"device": "nvme", "nvme_path": str(folder / "store"), "max_in_cpu": 0}
        config = folder / f"{row}.json"
        config.write_text(json.dumps({"zero_optimization": zero}))
        sharded = "zero_dp_3 auto_wrap offload" if row == "train_params_disk" else "zero_dp_3 auto_wrap"
        bf16 = ["--bf16"] if row == "train_bf16" else []
        return [*flags, "--sharded_ddp", sharded, "--offload", config, "--do_train", "--max_steps", "1", *bf16]
    config = folder / "budget.json"  # auto: written by main before the run
    return [*flags, "--sharded_ddp", "auto", "--offload", config, "--do_train", "--max_steps", "1"]


def auto_budget(model: Path, folder: Path) -> tuple:
    """A max_memory a rank that only zero_dp_3 fits, by the planner's rows for this model (2 ranks,
    fp32, batch 2, 32 / 16 tokens, meta-device activations): halfway between the smallest row of
    any other strategy and the largest zero_dp_3 row below it; written to budget.json. Returns
    (budget, (that zero_dp_3 row, its bytes), (that other row, its bytes))."""
    from transformers import AutoConfig

    from trainer_shard import planner

    rows = planner.estimate(AutoConfig.from_pretrained(model), world_size=2, precision="fp32", batch_size=2,
                            source_length=32, target_length=16)  # fmt: skip
    per = {f"{r['strategy']}" + ("" if r["offload"] == "none" else f" + {r['offload']} offload"): r["per_rank"]
           for r in rows}  # fmt: skip
    other = min((v, k) for k, v in per.items() if not k.startswith("zero_dp_3"))
    fits = max((v, k) for k, v in per.items() if k.startswith("zero_dp_3") and v < other[0])
    budget = (fits[0] + other[0]) // 2
    (folder / "budget.json").write_text(json.dumps({"max_memory": {"cpu": str(budget)}}))
    return budget, fits[::-1], other[::-1]


def table(results: list) -> str:
    lines = ["| row | weights | baseline peak / rank | load peak / rank (after the Trainer is built) | peak / rank "
             "(whole run) | bound: baseline + 0.6 x weights | within | node peak (both ranks) | stage |",
             "|---|---:|---:|---:|---:|---:|---|---:|---|"]  # fmt: skip
    for r in results:
        peak = max(x["end"] for x in r["run"]["ranks"])
        load = max(x["load"] for x in r["run"]["ranks"])
        base = max(x["end"] for x in r["baseline"]["ranks"])
        bound = base + BOUND * r["weights"]
        lines.append(f"| {r['row']} | {r['weights'] / GIB:.2f} GiB | {base / GIB:.2f} GiB | {load / GIB:.2f} GiB "
                     f"| {peak / GIB:.2f} GiB | {bound / GIB:.2f} GiB | {'yes' if peak <= bound else 'NO'} "
                     f"| {r['run']['node_peak'] / GIB:.2f} GiB | {r['run']['ranks'][0]['stage']} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=ROWS, choices=ROWS)
    parser.add_argument("--arch", default="t5-large", choices=list(ARCHS))
    parser.add_argument("--folder", type=Path, default=Path("/tmp/trainer_shard_load_rss"))
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "load_rss")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    paths = build(args.folder, args.arch)
    weights = weights_bytes(paths["model"])
    results, notes = [], []
    for row in args.rows:
        if row == "auto":
            budget, fits, other = auto_budget(paths["model"], args.folder)
            notes.append(f"auto: max_memory {budget / GIB:.2f} GiB a rank, between the planner's {fits[0]} "
                         f"({fits[1] / GIB:.2f} GiB) and {other[0]} ({other[1] / GIB:.2f} GiB, the smallest row "
                         "of a strategy other than zero_dp_3) rows: only zero_dp_3 fits")  # fmt: skip
        runs = {}
        for kind, model in (("baseline", paths["baseline"]), ("run", paths["model"])):
            out = args.folder / f"out_{row}_{kind}"
            runs[kind] = torchrun(row_flags(row, paths, args.folder, model), out, args.timeout)
            print(f"{row} {kind}: {[{k: round(v / GIB, 3) if k != 'stage' else v for k, v in r.items()} for r in runs[kind]['ranks']]}"
                  f" node {runs[kind]['node_peak'] / GIB:.2f} GiB, {runs[kind]['seconds']:.0f} s", flush=True)  # fmt: skip
        if row == "auto":
            chose = next((line for line in runs["run"]["log"].splitlines() if "--sharded_ddp auto: " in line), "?")
            notes.append(f"auto printed: {chose.strip()}")
        results.append({"row": row, "weights": weights, **{k: {**v, "log": v["log"][-2000:]} for k, v in runs.items()}})
        print(table(results), flush=True)
    meta = {"cpu": cpu_name(), "cpus": os.cpu_count(), "arch": args.arch, "command": " ".join(sys.argv)}
    text = (f"# Host RAM at load under ZeRO-3 (2 ranks, {args.arch} in fp32)\n\nWritten by `python "
            f"{' '.join(sys.argv)}` (bench/load_rss.py); CPU: {meta['cpu']}, {os.cpu_count()} cores. Peak RSS is "
            "each rank's VmHWM; the baseline is the same command on the 1-layer model of the same widths; the node "
            f"peak is both ranks' RSS summed, sampled every 20 ms.\n\n{table(results)}\n\n"
            + "".join(f"- {n}\n" for n in notes))  # fmt: skip
    write_results(args.out, {"meta": meta, "results": results}, text)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--as-rank":
        as_rank(sys.argv[2:])
    else:
        main()
