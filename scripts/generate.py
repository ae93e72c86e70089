#!/usr/bin/env python
"""Translate (or summarize) lines with a seq2seq model, even one that does not fit in memory.

    echo "one hundred and twelve" | python scripts/generate.py --model_name_or_path output/demo
    python scripts/generate.py --model_name_or_path t5-3b --input test.source --output out.txt \
        --offload configs/inference_disk.json --num_beams 4

With `--offload CONFIG.json` and its "inference" section the model is built empty, placed by a
device map over GPUs, CPU RAM and disk under `max_memory`, and loaded a shard at a time
(trainer_shard.offload.dispatch); the generations are the same as with the model loaded whole.
One line in, one line out. Prints seconds per generated token on stderr.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer

from trainer_shard.config import load_config
from trainer_shard.errors import ConfigError, DataError, TrainerShardError
from trainer_shard.finetune import source_prefix
from trainer_shard.metrics import decode
from trainer_shard.offload.dispatch import load_dispatched


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", required=True)
    parser.add_argument("--input", help="a text file, one source a line (default: stdin)")
    parser.add_argument("--output", help="where the generations go, one a line (default: stdout)")
    parser.add_argument("--offload", help='a JSON config with an "inference" section (device map, max_memory...)')
    parser.add_argument("--source_prefix", default=None, help="text put before every line (default: the config's "
                        "prefix for --task)")  # fmt: skip
    parser.add_argument("--task", default="translation_en_to_ro")
    parser.add_argument("--num_beams", type=int, default=1)
    parser.add_argument("--max_length", type=int, default=64, help="longest generation, the start token included")
    parser.add_argument("--min_length", type=int, default=0, help="shortest generation (no end token before it)")
    parser.add_argument("--max_source_length", type=int, default=128)
    parser.add_argument("--batch_size", type=int, default=8)
    return parser.parse_args(argv)


def load(args):
    config = AutoConfig.from_pretrained(args.model_name_or_path)
    if args.offload:
        inference = load_config(args.offload).inference
        if inference is None:
            raise ConfigError(args.offload, [("$.inference", 'missing: generate.py reads the "inference" section '
                                              "(see configs/README.md)")])  # fmt: skip
        return config, load_dispatched(AutoModelForSeq2SeqLM, args.model_name_or_path, inference, config=config,
                                       source=args.offload)  # fmt: skip
    return config, AutoModelForSeq2SeqLM.from_pretrained(args.model_name_or_path, config=config)


def read_lines(path) -> list:
    if path is None:
        return sys.stdin.read().splitlines()
    if not Path(path).is_file():
        raise DataError(f"--input {path!r} does not exist; pass a text file with one source a line")
    try:
        return Path(path).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DataError(f"--input {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None


@torch.no_grad()
def generate(model, tokenizer, lines: list, args, prefix: str) -> tuple:
    """The generations, in order, and the number of tokens generated."""
    out, tokens = [], 0
    for start in range(0, len(lines), args.batch_size):
        batch = tokenizer([prefix + line for line in lines[start : start + args.batch_size]], return_tensors="pt",
                          padding=True, truncation=True, max_length=args.max_source_length)  # fmt: skip
        ids = model.generate(**batch, num_beams=args.num_beams, max_length=args.max_length, min_length=args.min_length)
        tokens += int((ids[:, 1:] != tokenizer.pad_token_id).sum())
        out += decode(tokenizer, ids)
    return out, tokens


def main(argv=None) -> int:
    args = parse(argv)
    try:
        lines = read_lines(args.input)
        config, model = load(args)
    except TrainerShardError as e:
        print(f"generate.py: error: {e}", file=sys.stderr)
        return 2
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    prefix = source_prefix(args, config)
    started = time.perf_counter()
    generations, tokens = generate(model, tokenizer, lines, args, prefix)
    seconds = time.perf_counter() - started
    text = "".join(g + "\n" for g in generations)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    print(f"generate.py: {len(lines)} lines, {tokens} tokens in {seconds:.1f} s ({seconds / max(tokens, 1):.3f} s a token)",
          file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
