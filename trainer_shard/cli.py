"""The `trainer-shard` command.

    trainer-shard make-demo-data --out_dir data/demo_en_ro
    trainer-shard build-demo-model --data_dir data/demo_en_ro --out_dir data/demo_t5
    trainer-shard validate-config configs/offload_cpu.json [--world_size 2]
    trainer-shard consolidate output/checkpoint-500 t5-final [--dtype bfloat16] [--max_shard_size 2GB]
    trainer-shard estimate --model t5-3b --world_size 2 --precision bf16 --batch_size 8 --max_memory 24GiB
"""

import importlib
import sys

COMMANDS = {
    "make-demo-data": ("trainer_shard.demo", "make_demo_data_main", "write the num2words English-Romanian data set"),
    "build-demo-model": ("trainer_shard.demo", "build_demo_model_main", "build the small T5 and its BPE tokenizer"),
    "validate-config": ("trainer_shard.cli", "validate_config_main", "check an --offload JSON config, every problem at once"),
    "consolidate": ("trainer_shard.consolidate", "consolidate_main", "a sharded checkpoint -> a plain model folder"),
    "estimate": ("trainer_shard.planner", "estimate_main", "memory per rank of every strategy, before training"),
}


def validate_config_main(argv=None) -> int:
    """The same check `--offload` runs at start, from the shell (without TrainingArguments,
    "auto" stays unresolved: it is filled at start)."""
    import argparse

    from .config import load_config
    from .errors import ConfigError

    parser = argparse.ArgumentParser(prog="trainer-shard validate-config", description=validate_config_main.__doc__)
    parser.add_argument("config", help="path of the JSON config")
    parser.add_argument("--world_size", type=int, default=1, help="number of ranks it will run on (default 1)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, world_size=args.world_size)
    except ConfigError as e:
        print(f"trainer-shard: {e}", file=sys.stderr)
        return 2
    print(
        f"{args.config}: valid: stage {config.stage}, optimizer offload {config.offload_device}"
        f"{' at ' + config.nvme_path if config.nvme_path else ''}, precision {config.precision}"
    )
    return 0


def usage() -> str:
    lines = ["usage: trainer-shard COMMAND [--help] [ARGS...]", "", "commands:"]
    lines += [f"  {name:<18} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"trainer-shard: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, function_name, _ = COMMANDS[name]
    module = importlib.import_module(module_name)
    return getattr(module, function_name)(rest)


if __name__ == "__main__":
    sys.exit(main())
