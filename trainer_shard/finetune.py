"""The pieces of `scripts/finetune_trainer.py`: its arguments, their checks, data and model set-up.

The script itself reads top to bottom; what it calls lives here so that it is unit-tested.
Every check runs before the Trainer exists, so a mistake stops the run before anything is written.
"""

import json
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser
from transformers.trainer_utils import get_last_checkpoint

from .args import ShardedSeq2SeqTrainingArguments
from .data import TokenizedSeq2SeqDataset, read_jsonl, read_split
from .errors import ArgumentError
from .lora import DEFAULTS as LORA
from .lora import lora_config

logger = logging.getLogger(__name__)

_SPLITS = ("train", "val", "test")
_PHASE_FLAG = {"train": "--do_train", "val": "--do_eval", "test": "--do_predict"}
_FILE_FLAG = {"train": "--train_file", "val": "--validation_file", "test": "--test_file"}

_TRANSLATION_TASK = re.compile(r"^translation_([A-Za-z0-9-]+)_to_([A-Za-z0-9-]+)$")


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "A local model folder or a model name on the hub."})
    config_name: str | None = field(default=None, metadata={"help": "Config name or path, if not the model's."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer name or path, if not the model's."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where to keep models downloaded from the hub."})
    freeze_encoder: bool = field(default=False, metadata={"help": "Train no encoder parameter."})
    freeze_embeds: bool = field(default=False, metadata={"help": "Train no token or position embedding."})
    # LoRA through PEFT, named as TRL's ModelConfig names them
    use_peft: bool = field(default=False, metadata={"help": "Train LoRA adapters (PEFT) on a frozen base model."})
    lora_r: int = field(default=LORA["lora_r"], metadata={"help": "LoRA rank (with --use_peft)."})
    lora_alpha: int = field(default=LORA["lora_alpha"], metadata={"help": "LoRA alpha: the adapters' scale, alpha/r."})
    lora_dropout: float = field(default=LORA["lora_dropout"], metadata={"help": "Dropout on the adapters' input."})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={"help": "Names of the modules given adapters (e.g. q v), or all-linear; default: PEFT's for the "
                  "model type (q and v for T5)."},
    )
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Modules trained whole and saved with the adapters (e.g. lm_head)."}
    )


@dataclass
class DataTrainingArguments:
    data_dir: str | None = field(
        default=None, metadata={"help": "Folder of train/val/test .source and .target files, one example a line."}
    )
    train_file: str | None = field(default=None, metadata={"help": "JSON-lines training file (instead of data_dir)."})
    validation_file: str | None = field(default=None, metadata={"help": "JSON-lines validation file."})
    test_file: str | None = field(default=None, metadata={"help": "JSON-lines test file."})
    task: str = field(
        default="summarization", metadata={"help": "'summarization' or 'translation_xx_to_yy' (e.g. translation_en_to_ro)."}
    )
    source_prefix: str | None = field(
        default=None,
        metadata={"help": "Text put before every source; default: the model config's prefix for --task, if any."},
    )
    max_source_length: int = field(default=1024, metadata={"help": "Source tokens kept; longer texts are truncated."})
    max_target_length: int = field(default=128, metadata={"help": "Target tokens kept in training."})
    val_max_target_length: int = field(default=142, metadata={"help": "Target and generation length on val."})
    test_max_target_length: int = field(default=142, metadata={"help": "Target and generation length on test."})
    n_train: int = field(default=-1, metadata={"help": "Use only the first n training examples; -1: all."})
    n_val: int = field(default=-1, metadata={"help": "Use only the first n validation examples; -1: all."})
    n_test: int = field(default=-1, metadata={"help": "Use only the first n test examples; -1: all."})
    src_lang: str | None = field(default=None, metadata={"help": "Source language code (default: from --task)."})
    tgt_lang: str | None = field(default=None, metadata={"help": "Target language code (default: from --task)."})
    eval_beams: int | None = field(default=None, metadata={"help": "Beams for generation in eval and predict."})
    ignore_pad_token_for_loss: bool = field(
        default=True, metadata={"help": "Leave padded label positions out of the loss."}
    )
    label_smoothing: float = field(
        default=0.0, metadata={"help": "Label smoothing epsilon (same as --label_smoothing_factor)."}
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Train even if output_dir already holds checkpoints (they may be overwritten)."},
    )


def build_parser() -> HfArgumentParser:
    return HfArgumentParser((ModelArguments, DataTrainingArguments, ShardedSeq2SeqTrainingArguments))


def parse_args(argv=None):
    """(model_args, data_args, training_args) from the command line.

    A first argument ending in `.json` is a file of arguments; flags after it override it.
    """
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0].endswith(".json"):
        apply_json_defaults(parser, argv.pop(0))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    check_peft_args(model_args, training_args)
    check_data_args(data_args, training_args)
    apply_script_flags(data_args, training_args)
    return model_args, data_args, training_args


def apply_json_defaults(parser, path) -> None:
    """Make the keys of a JSON file the parser's defaults, so that later flags override them."""
    path = Path(path)
    if not path.is_file():
        raise ArgumentError(f"arguments file {str(path)!r} does not exist")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArgumentError(f"arguments file {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(values, dict):
        raise ArgumentError(f"arguments file {str(path)!r} must hold one JSON object of flag names and values")
    actions = {}
    for action in parser._actions:
        actions.setdefault(action.dest, []).append(action)
    unknown = sorted(set(values) - set(actions) - {"help"})
    if unknown:
        raise ArgumentError(
            f"arguments file {str(path)!r}: unknown key(s) {', '.join(map(repr, unknown))}; "
            "keys are the script's flag names without the leading dashes (see --help)"
        )
    for key, value in values.items():
        for action in actions[key]:
            action.default = value
            action.required = False


def task_languages(task: str):
    """`translation_en_to_ro` -> ("en", "ro"); `summarization` -> (None, None)."""
    match = _TRANSLATION_TASK.match(task)
    return (match.group(1), match.group(2)) if match else (None, None)


def check_data_args(data_args, training_args) -> None:
    """Collect every problem with the script's own flags and raise them together."""
    problems = []
    is_translation = _TRANSLATION_TASK.match(data_args.task) is not None
    if not is_translation and not data_args.task.startswith("summarization"):
        problems.append(
            f"--task {data_args.task!r} is unknown; use 'summarization' or 'translation_xx_to_yy' "
            "(e.g. translation_en_to_ro)"
        )
    if is_translation:
        src, tgt = task_languages(data_args.task)
        data_args.src_lang = data_args.src_lang or src
        data_args.tgt_lang = data_args.tgt_lang or tgt
    wanted = _wanted_splits(training_args)
    for split in wanted:
        if data_args.data_dir is None and _split_file(data_args, split) is None:
            problems.append(f"{_PHASE_FLAG[split]} needs data: pass --data_dir DIR or {_FILE_FLAG[split]} FILE")
    if not wanted:
        problems.append("nothing to do: pass at least one of --do_train, --do_eval, --do_predict")
    for name in ("max_source_length", "max_target_length", "val_max_target_length", "test_max_target_length"):
        if getattr(data_args, name) < 1:
            problems.append(f"--{name} must be at least 1, got {getattr(data_args, name)}")
    if data_args.eval_beams is not None and data_args.eval_beams < 1:
        problems.append(f"--eval_beams must be at least 1, got {data_args.eval_beams}")
    if not 0.0 <= data_args.label_smoothing < 1.0:
        problems.append(f"--label_smoothing must be in [0, 1), got {data_args.label_smoothing}")
    problems += _conflicts(data_args, training_args)
    if problems:
        raise ArgumentError(problems)


def _wanted_splits(training_args) -> list:
    phases = (training_args.do_train, training_args.do_eval, training_args.do_predict)
    return [split for split, wanted in zip(_SPLITS, phases) if wanted]


def _split_file(data_args, split: str):
    return {"train": data_args.train_file, "val": data_args.validation_file, "test": data_args.test_file}[split]


def _conflicts(data_args, training_args) -> list:
    problems = []
    smoothing = training_args.label_smoothing_factor
    if data_args.label_smoothing and smoothing and smoothing != data_args.label_smoothing:
        problems.append(
            f"--label_smoothing {data_args.label_smoothing} and --label_smoothing_factor {smoothing} disagree; "
            "pass only one of them"
        )
    beams = training_args.generation_num_beams
    if data_args.eval_beams and beams and beams != data_args.eval_beams:
        problems.append(f"--eval_beams {data_args.eval_beams} and --generation_num_beams {beams} disagree; pass one")
    return problems


def apply_script_flags(data_args, training_args) -> None:
    """The classic flags that are TrainingArguments under another name."""
    if data_args.label_smoothing:
        training_args.label_smoothing_factor = data_args.label_smoothing
    if data_args.eval_beams is None:
        data_args.eval_beams = training_args.generation_num_beams


def load_pairs(data_args, training_args) -> dict:
    """Read every split the run needs, up front: {"train"|"val"|"test": Pairs}. Raises DataError."""
    limits = {"train": data_args.n_train, "val": data_args.n_val, "test": data_args.n_test}
    pairs = {}
    for split in _wanted_splits(training_args):
        file = _split_file(data_args, split)
        if file is not None:
            pairs[split] = read_jsonl(file, data_args.task, data_args.src_lang, data_args.tgt_lang, n_obs=limits[split])
        else:
            pairs[split] = read_split(data_args.data_dir, split, n_obs=limits[split])
    return pairs


def resolve_checkpoint(data_args, training_args) -> str | None:
    """The checkpoint to resume from, or None; refuses to train over existing checkpoints silently."""
    value = training_args.resume_from_checkpoint
    output_dir = Path(training_args.output_dir)
    if value is None:
        if training_args.do_train and output_dir.is_dir() and not data_args.overwrite_output_dir:
            last = get_last_checkpoint(str(output_dir))
            if last is not None:
                raise ArgumentError(
                    f"output_dir {str(output_dir)!r} already holds checkpoints (newest: {Path(last).name}); pass "
                    "--resume_from_checkpoint latest to continue, --overwrite_output_dir to start over, "
                    "or another --output_dir"
                )
        return None
    if str(value).lower() in ("latest", "true"):
        last = get_last_checkpoint(str(output_dir)) if output_dir.is_dir() else None
        if last is None:
            raise ArgumentError(f"--resume_from_checkpoint {value}: no checkpoint-* folder in {str(output_dir)!r}")
        return last
    checkpoint = Path(value)
    if not (checkpoint / "trainer_state.json").is_file():
        raise ArgumentError(
            f"--resume_from_checkpoint {str(checkpoint)!r}: not a Trainer checkpoint "
            "(no trainer_state.json in it); pass a checkpoint-* folder or 'latest'"
        )
    return str(checkpoint)


def source_prefix(data_args, config) -> str:
    """--source_prefix, else the config's prefix for the task (T5: 'translate English to Romanian: ')."""
    if data_args.source_prefix is not None:
        return data_args.source_prefix
    task_params = (getattr(config, "task_specific_params", None) or {}).get(data_args.task, {})
    return task_params.get("prefix") or getattr(config, "prefix", None) or ""


def check_peft_args(model_args, training_args) -> None:
    """--lora_* flags without --use_peft would do nothing: refused, as are values LoRA cannot take
    and the combinations not built yet, before anything is written."""
    given = [f"--{k}" for k, v in LORA.items() if getattr(model_args, k) != v]
    if not model_args.use_peft:
        if given:
            raise ArgumentError(f"{', '.join(given)} configure LoRA, which only --use_peft turns on; add --use_peft "
                                "or drop them")  # fmt: skip
        return
    if model_args.lora_r < 1 or model_args.lora_alpha <= 0 or not 0 <= model_args.lora_dropout < 1:
        raise ArgumentError(f"--lora_r {model_args.lora_r}, --lora_alpha {model_args.lora_alpha}, --lora_dropout "
                            f"{model_args.lora_dropout}: the rank must be at least 1, alpha above 0 and the dropout "
                            "in [0, 1)")  # fmt: skip
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ArgumentError("--use_peft needs the peft package: pip install peft (make install does)") from None


def apply_peft(model, model_args, seed: int):
    """`model` with LoRA adapters (`peft.get_peft_model`, task SEQ_2_SEQ_LM): the base frozen, the
    adapters trainable; the configuration TRL's `get_peft_config` would make of the same flags.
    A base on the meta device (parameter offload: its weights are read into the store when the
    Trainer shards it) gets its adapters made in CPU RAM. The adapters are initialised from
    `seed` in module order (A as PEFT does, B zero), so they are the same whichever way the base
    was built."""
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    config = lora_config(model_args.lora_r, model_args.lora_alpha, model_args.lora_dropout,
                         model_args.lora_target_modules, model_args.lora_modules_to_save)  # fmt: skip
    try:
        model = get_peft_model(model, config)
    except ValueError as e:  # a target module that the model does not have
        raise ArgumentError(f"--use_peft: {e}; name modules of this model in --lora_target_modules "
                            "(or all-linear)") from None
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for layer in layers:
            for adapters in (layer.lora_A, layer.lora_B):
                for adapter in adapters.values():
                    if any(p.device.type == "meta" for p in adapter.parameters()):
                        adapter.to_empty(device="cpu")
            for name in layer.lora_A:
                layer.reset_lora_parameters(name, True)
    return model


def freeze_params(model, *, encoder: bool, embeds: bool) -> None:
    if embeds:
        for module in _embedding_modules(model):
            for p in module.parameters():
                p.requires_grad = False
    if encoder:
        for p in model.get_encoder().parameters():
            p.requires_grad = False


def _embedding_modules(model):
    import torch.nn as nn

    return [m for m in model.modules() if isinstance(m, nn.Embedding)]


_TARGET_FLAG = {"train": "max_target_length", "val": "val_max_target_length", "test": "test_max_target_length"}


def tokenize_splits(pairs: dict, tokenizer, data_args, prefix: str) -> dict:
    """{split: TokenizedSeq2SeqDataset}; a warning (rank 0) for each split whose texts reached the limits."""
    datasets = {
        split: TokenizedSeq2SeqDataset(
            split_pairs,
            tokenizer,
            max_source_length=data_args.max_source_length,
            max_target_length=getattr(data_args, _TARGET_FLAG[split]),
            prefix=prefix,
        )
        for split, split_pairs in pairs.items()
    }
    for split, dataset in datasets.items():
        _warn_truncation(split, dataset)
    return datasets


def _warn_truncation(split: str, dataset) -> None:
    sources, targets = dataset.at_limit()
    if (sources or targets) and os.environ.get("RANK", "0") == "0":  # every rank reads the same data
        logger.warning(
            "%s of %s %s sources reached --max_source_length %s tokens and %s targets --%s %s; longer texts were cut "
            "there (raise the flag to keep more of them)",
            sources, len(dataset), split, dataset.max_source_length, targets, _TARGET_FLAG[split],
            dataset.max_target_length,
        )  # fmt: skip


def write_generations(path, texts) -> None:
    Path(path).write_text("".join(t + "\n" for t in texts), encoding="utf-8")


def count_parameters(model) -> tuple:
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return total, trainable

