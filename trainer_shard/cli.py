"""The `trainer-shard` command.

    trainer-shard make-demo-data --out_dir data/demo_en_ro
    trainer-shard build-demo-model --data_dir data/demo_en_ro --out_dir data/demo_t5
"""

import importlib
import sys

COMMANDS = {
    "make-demo-data": ("trainer_shard.demo", "make_demo_data_main", "write the num2words English-Romanian data set"),
    "build-demo-model": ("trainer_shard.demo", "build_demo_model_main", "build the small T5 and its BPE tokenizer"),
}


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
