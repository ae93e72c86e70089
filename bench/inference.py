#!/usr/bin/env python
"""Generation with a model 4x bigger than the CPU RAM it is given: peak RSS and seconds a token.

    .venv/bin/python bench/inference.py [--model /work/big/t5_3b]   # writes bench/results/inference.{md,json}

The model: the t5-3b architecture (2.85 B parameters, random init, bf16), saved sharded in 1 GB
files (trainer_shard.checkpoint.save_model). `scripts/generate.py` translates 4 demo lines with
an "inference" config whose `max_memory.cpu` is a quarter of the model's size, so most weights
stay on disk (read from the checkpoint's safetensors files in place) and come into memory
module by module; then the same with the model loaded whole. Each run is its own process,
measured by its own ru_maxrss. Runs in the project's .venv; about 10 minutes.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from _results import write_markdown  # bench/_results.py (these run as scripts: bench/ is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DATA = ROOT / "data" / "demo_en_ro" / "test.source"
ENV = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
PROBE = ("import resource, runpy, sys; sys.argv = ['generate.py', *sys.argv[1:]]; "
         "g = runpy.run_path('scripts/generate.py'); code = g['main'](sys.argv[1:]); "
         "print('PEAK', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, file=sys.stderr); sys.exit(code)")  # fmt: skip


def ensure_sharded(model: Path, sharded: Path) -> None:
    if (sharded / "model.safetensors.index.json").is_file():
        return
    code = ("import sys, torch; from transformers import AutoModelForSeq2SeqLM; from trainer_shard.checkpoint import save_model; "
            "m = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16); save_model(m, sys.argv[2], 10**9)")  # fmt: skip
    subprocess.run([sys.executable, "-c", code, str(model), str(sharded)], check=True, env=ENV, cwd=ROOT)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (sharded / name).write_bytes((model / name).read_bytes())


def generate(model: Path, out: Path, extra: list) -> dict:
    cmd = [sys.executable, "-c", PROBE, "--model_name_or_path", str(model), "--input", str(out.parent / "in.txt"),
           "--output", str(out), "--max_length", "17", "--min_length", "17", "--batch_size", "1", *extra]  # fmt: skip
    proc = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    peak = int(next(line.split()[1] for line in proc.stderr.splitlines() if line.startswith("PEAK")))
    summary = next(line for line in proc.stderr.splitlines() if line.startswith("generate.py:"))
    tokens, seconds = int(summary.split(" tokens")[0].split()[-1]), float(summary.split(" in ")[1].split(" s")[0])
    return {"peak_rss_bytes": peak, "tokens": tokens, "seconds": seconds, "s_per_token": seconds / tokens}


def same_ids(model: Path, config: Path, lines: Path) -> bool:
    """Greedy token ids of the offloaded and the whole model, compared (a random-init model's
    ids mostly fall outside the demo tokenizer's vocabulary, so its texts are empty)."""
    code = ("import sys, torch; from transformers import AutoModelForSeq2SeqLM, AutoTokenizer; "
            "from trainer_shard.config import load_config; from trainer_shard.offload.dispatch import load_dispatched; "
            "tok = AutoTokenizer.from_pretrained(sys.argv[1]); x = tok(open(sys.argv[3]).read().splitlines(), "
            "return_tensors='pt', padding=True); kw = dict(max_length=17, min_length=17); "
            "a = load_dispatched(AutoModelForSeq2SeqLM, sys.argv[1], load_config(sys.argv[2]).inference).generate(**x, **kw); "
            "b = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1]).generate(**x, **kw); "
            "print('SAME' if torch.equal(a, b) else 'DIFFERENT', tuple(a.shape))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code, str(model), str(config), str(lines)], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, check=True)  # fmt: skip
    return "SAME" in proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/work/big/t5_3b", help="a model folder (bf16 t5-3b architecture)")
    parser.add_argument("--work", default=str(ROOT / "bench" / "work" / "inference"))
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sharded = work / "model_sharded"
    ensure_sharded(Path(args.model), sharded)
    size = sum(p.stat().st_size for p in sharded.glob("model-*.safetensors"))
    cap = size // 4
    (work / "in.txt").write_text("\n".join(DATA.read_text(encoding="utf-8").splitlines()[:4]) + "\n", encoding="utf-8")
    config = work / "quarter.json"
    config.write_text(json.dumps({"inference": {"max_memory": {"cpu": cap}, "offload_folder": str(work / "offload")}}))
    offloaded = generate(sharded, work / "offloaded.txt", ["--offload", str(config)])
    whole = generate(sharded, work / "whole.txt", [])
    same = same_ids(sharded, config, work / "in.txt")
    files = len(list(sharded.glob("model-*.safetensors")))
    result = {"model_bytes": size, "files": files, "max_memory_cpu": cap, "offloaded": offloaded, "whole": whole,
              "same_generations": same}  # fmt: skip
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "inference.json").write_text(json.dumps(result, indent=1))
    gib = 2**30
    text = (
        "# Generation with offloaded parameters\n\nCommand: `.venv/bin/python bench/inference.py`\n\n"
        f"t5-3b architecture, 2.85 B parameters, random init, bf16: {size / gib:.2f} GiB in {files} safetensors files. "
        f"4 demo lines one at a time, greedy, 16 new tokens each (min_length = max_length), 2 CPU cores; "
        "s / token: the generation time over the tokens generated, encoder passes included.\n\n"
        "| run | max_memory cpu | peak RSS (GiB) | peak RSS / model | s / generated token |\n|---|---|---|---|---|\n"
        f"| device map, rest on disk | {cap / gib:.2f} GiB (1/4 of the model) | {offloaded['peak_rss_bytes'] / gib:.2f} | "
        f"{offloaded['peak_rss_bytes'] / size:.2f}x | {offloaded['s_per_token']:.2f} |\n"
        f"| loaded whole | - | {whole['peak_rss_bytes'] / gib:.2f} | {whole['peak_rss_bytes'] / size:.2f}x | "
        f"{whole['s_per_token']:.2f} |\n\nGreedy token ids of the two identical (checked in a third process): {same}.\n"
    )  # fmt: skip
    write_markdown(RESULTS / "inference.md", text)
    print(text)


if __name__ == "__main__":
    main()
