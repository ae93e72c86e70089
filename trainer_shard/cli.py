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
    """The same check `--offload` runs at start, from the shell: exit 0 and the effective settings,
    then each key ignored or taken as what the engine does, one line each; or exit 2 and every
    problem. Without the training arguments, "auto" stays unresolved: it is filled at start."""
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
    print(f"{args.config}: valid on {args.world_size} rank{'s' if args.world_size != 1 else ''}")
    for line in effective_settings(config, args.world_size):
        print(f"  {line}")
    for key, why in config.ignored:
        print(f"ignored: {key}: {why}")
    for key, why in config.given:
        print(f"as the engine does: {key}: {why}")
    return 0


def effective_settings(config, world_size: int) -> list:
    """What a run of `config` does, a setting a line ("auto": filled from the flags at start)."""
    from .config import apply as config_apply
    from .config.load import run_stage
    from .config.schema import OPTIMIZER_PARAMS, SCHEDULER_PARAMS

    def value(v, auto_from):
        return f"auto ({auto_from})" if v in ("auto", None) else v

    stage = run_stage(config, None, world_size)
    names = {None: "none (plain DDP)", 1: "1 (simple)", 2: "2 (zero_dp_2)", 3: "3 (zero_dp_3)"}
    offload = config.offload_device + (f" at {config.nvme_path}/rank<R>" if config.nvme_path else "")
    lines = [f"stage: {names[stage]}", f"optimizer offload: {offload}",
             f"precision: {'from --fp16/--bf16' if config.precision == 'auto' else config.precision}"]  # fmt: skip
    if config.optimizer is not None:
        params = {k: v for k, v in config.optimizer["params"].items() if v is not None and OPTIMIZER_PARAMS[k].role == "effect"}
        lines.append(f"optimizer: {config.optimizer['type']} {params}")
    else:
        lines.append("optimizer: the Trainer's --optim")
    if config.scheduler is not None:
        params = {k: v for k, v in config.scheduler["params"].items() if v is not None and SCHEDULER_PARAMS[k].role == "effect"}
        lines.append(f"scheduler: {config.scheduler['type']} {params}")
    else:
        lines.append("scheduler: the Trainer's --lr_scheduler_type")
    lines.append(f"gradient clipping: {value(config.gradient_clipping, '--max_grad_norm')}")
    if stage == 3:
        lines += config_apply.zero3_settings(config)
    elif stage is not None:
        bucket = config.reduce_bucket_size if stage == 2 else config.allgather_bucket_size
        lines.append(f"bucket: {'auto (hidden size squared)' if bucket is None else f'{bucket:,}'} elements")
        lines.append(f"overlap_comm: {str(config.overlap_comm).lower()}")
    if config.precision in ("fp16", "auto"):
        scale = (f"static {config.loss_scale:g}" if config.loss_scale > 0 else
                 f"dynamic from 2**{config.initial_scale_power}, window {config.loss_scale_window}, hysteresis "
                 f"{config.hysteresis}{' (consecutive)' if config.consecutive_hysteresis else ''}, min "
                 f"{config.min_loss_scale:g}")  # fmt: skip
        lines.append(f"fp16 loss scale: {scale}")
    lines.append(f"batch: micro {value(config.micro_batch_size, '--per_device_train_batch_size')}, accumulation "
                 f"{value(config.gradient_accumulation_steps, '--gradient_accumulation_steps')}, total "
                 f"{value(config.train_batch_size, 'micro x accumulation x world size')}")  # fmt: skip
    return lines


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
