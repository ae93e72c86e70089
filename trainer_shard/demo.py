"""Embedded default data set and model for ``trainer_shard`` (no network needed).

The demo task is English-to-Romanian translation of number phrases, e.g.::

    source: two hundred and thirty-four
    target: două sute treizeci și patru

:func:`make_demo_data` writes the data set in the classic seq2seq layout
(``{train,val,test}.{source,target}``) and :func:`build_demo_model` trains a
byte-level BPE tokenizer on it and saves a small, randomly initialised
``T5ForConditionalGeneration`` next to it.  Both are deterministic for fixed
arguments and never touch the Hugging Face hub.  Source lines are stored
without the task prefix; the prefix lives in the model config under
``task_specific_params["translation_en_to_ro"]["prefix"]`` like in t5-small.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import random
from pathlib import Path
from typing import Sequence

from .data import read_lines
from .finetune import count_parameters

DEFAULT_MAX_NUMBER = 999_999
SPLITS = ("train", "val", "test")
TASK = "translation_en_to_ro"
PREFIX = "translate English to Romanian: "
SPECIAL_TOKENS = ("<pad>", "</s>", "<unk>")  # ids 0, 1, 2
GENERATION_MAX_LENGTH = 64


# --------------------------------------------------------------------------- data


def _number_pair(n: int) -> tuple[str, str]:
    """Return the (English, Romanian) phrases for the integer ``n``."""
    from num2words import num2words

    source = num2words(n, lang="en")
    target = num2words(n, lang="ro")
    for line in (source, target):
        if "\n" in line or "\r" in line:
            raise RuntimeError(f"num2words produced a line break for {n}: {line!r}")
    return source, target


def _sample_numbers(total: int, max_number: int, seed: int) -> list[int]:
    """Sample ``total`` distinct integers from ``[0, max_number]`` deterministically."""
    population = max_number + 1
    if total > population:
        raise ValueError(
            f"requested {total} examples (train + val + test) but only {population} "
            f"distinct numbers exist in [0, {max_number}]; lower the split sizes or "
            f"raise max_number"
        )
    return random.Random(seed).sample(range(population), total)


def _write_lines(path: Path, lines: Sequence[str]) -> None:
    """Write ``lines`` as UTF-8, one per line with '\\n' endings."""
    path.write_bytes("".join(line + "\n" for line in lines).encode("utf-8"))


def make_demo_data(
    out_dir: str | Path,
    n_train: int = 20000,
    n_val: int = 500,
    n_test: int = 1000,
    seed: int = 0,
    max_number: int | None = None,
) -> Path:
    """Write the English->Romanian number data set to ``out_dir`` and return it.

    Numbers are drawn without replacement from ``[0, max_number]`` (default
    ``999_999``) with ``random.Random(seed)``, so train/val/test are disjoint.
    Raises ``ValueError`` if the sizes are negative or do not fit the range.
    """
    sizes = {"train": n_train, "val": n_val, "test": n_test}
    for name, size in sizes.items():
        if size < 0:
            raise ValueError(f"n_{name} must be >= 0, got {size}")
    max_number = DEFAULT_MAX_NUMBER if max_number is None else max_number
    if max_number < 0:
        raise ValueError(f"max_number must be >= 0, got {max_number}")
    numbers = _sample_numbers(sum(sizes.values()), max_number, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = 0
    for split in SPLITS:
        pairs = [_number_pair(n) for n in numbers[start : start + sizes[split]]]
        start += sizes[split]
        _write_lines(out / f"{split}.source", [src for src, _ in pairs])
        _write_lines(out / f"{split}.target", [tgt for _, tgt in pairs])
    return out


# -------------------------------------------------------------------------- model


def build_demo_tokenizer(data_dir: str | Path, vocab_size: int = 2000):
    """Train a byte-level BPE tokenizer on ``train.source`` + ``train.target``.

    Source lines are seen with the task prefix prepended (as the model sees
    them), so the constant prefix becomes a handful of tokens.  Returns a
    ``PreTrainedTokenizerFast`` with ``<pad>``=0, ``</s>``=1, ``<unk>``=2 that
    appends ``</s>`` to every sequence (like T5).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    data = Path(data_dir)
    sources = [PREFIX + line for line in read_lines(data / "train.source")]
    texts = sources + read_lines(data / "train.target")
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer, length=len(texts))
    eos_id = backend.token_to_id("</s>")
    backend.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", eos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def _check_tokenizer(tokenizer) -> None:
    """Fail loudly if special ids or the diacritics round trip are wrong."""
    expected = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    actual = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in SPECIAL_TOKENS}
    if actual != expected:
        raise RuntimeError(f"unexpected special token ids {actual}, want {expected}")
    for text in ("două sute treizeci și patru", "Țară, înșiși"):
        ids = tokenizer(text).input_ids
        decoded = tokenizer.decode(ids, skip_special_tokens=True).strip()
        if ids[-1] != expected["</s>"] or decoded != text:
            raise RuntimeError(f"tokenizer round trip failed: {text!r} -> {decoded!r}")


def _t5_config(vocab_size: int, **sizes):
    """Build the ``T5Config`` of the demo model."""
    from transformers import T5Config

    return T5Config(
        vocab_size=vocab_size,
        feed_forward_proj="relu",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        task_specific_params={
            TASK: {"prefix": PREFIX, "max_length": GENERATION_MAX_LENGTH, "num_beams": 4}
        },
        **sizes,
    )


def build_demo_model(
    data_dir: str | Path,
    out_dir: str | Path,
    *,
    vocab_size: int = 2000,
    d_model: int = 128,
    d_ff: int = 512,
    num_layers: int = 2,
    num_decoder_layers: int | None = None,
    num_heads: int = 4,
    d_kv: int = 32,
    dropout_rate: float = 0.0,
    seed: int = 0,
    model_vocab_size: int | None = None,
    dtype: str = "float32",
    streaming: bool = False,
) -> Path:
    """Train the tokenizer, build a fresh small T5 and save both to ``out_dir``.

    ``vocab_size`` is the BPE target size; the model's vocabulary is
    ``len(tokenizer)`` (the number-word corpus may saturate below the target),
    or ``model_vocab_size`` when larger (to match a published architecture's
    embedding size). ``dtype`` is the weights' dtype, at build and on disk.
    The result loads offline with ``AutoTokenizer``/``AutoModelForSeq2SeqLM``.
    Example, the t5-3b architecture (2.85 B parameters, 5.7 GB in bf16):
    ``d_model=1024, d_ff=16384, num_layers=24, num_heads=32, d_kv=128,
    model_vocab_size=32128, dtype="bfloat16"``. ``streaming`` writes the weights a tensor at a
    time without building the model in memory (``write_random_t5``): for architectures bigger
    than RAM (t5-11b: ``d_ff=65536, num_heads=128``, the rest as t5-3b).
    """
    import torch
    from transformers import T5ForConditionalGeneration

    tokenizer = build_demo_tokenizer(data_dir, vocab_size=vocab_size)
    _check_tokenizer(tokenizer)
    config = _t5_config(
        max(len(tokenizer), model_vocab_size or 0),
        d_model=d_model,
        d_ff=d_ff,
        d_kv=d_kv,
        num_layers=num_layers,
        num_decoder_layers=num_decoder_layers,
        num_heads=num_heads,
        dropout_rate=dropout_rate,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    if streaming:
        write_random_t5(config, out, getattr(torch, dtype), seed)
        return out
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # initialize in the target dtype: no fp32 copy
    try:
        model = T5ForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.max_length = GENERATION_MAX_LENGTH
    model.save_pretrained(out)
    return out


def _t5_init(name: str, config) -> tuple[str, float]:
    """("normal", std) or ("constant", value): what ``T5PreTrainedModel._init_weights`` gives
    parameter ``name`` (transformers 5), by its name."""
    f, d_model, d_kv, heads = config.initializer_factor, config.d_model, config.d_kv, config.num_heads
    leaf = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
    if name.endswith("layer_norm.weight"):
        return "constant", f * 1.0
    if name in ("shared.weight", "lm_head.weight") or name.endswith("embed_tokens.weight"):
        return "normal", f * 1.0
    if ".DenseReluDense." in name:
        return "normal", f * (config.d_ff**-0.5 if leaf == "wo" else d_model**-0.5)
    if name.endswith("relative_attention_bias.weight"):
        return "normal", f * d_model**-0.5
    stds = {"q": (d_model * d_kv) ** -0.5, "k": d_model**-0.5, "v": d_model**-0.5, "o": (heads * d_kv) ** -0.5}
    if leaf in stds and ("Attention." in name):
        return "normal", f * stds[leaf]
    raise ValueError(f"no T5 initialization rule for parameter {name!r}")


class RandomT5Weights:
    """The weights of a randomly initialized ``T5ForConditionalGeneration`` of ``config`` as a
    mapping name -> tensor, each tensor made when it is read (what ``write_random_t5`` writes,
    value for value): ``shard_model(meta_model, weights=RandomT5Weights(config, torch.bfloat16))``
    builds a model bigger than RAM straight into the parameter store."""

    def __init__(self, config, dtype, seed: int = 0, chunk_numel: int = 2**24):
        import torch
        from transformers import T5ForConditionalGeneration

        with torch.device("meta"):
            model = T5ForConditionalGeneration(config)
        self.dtype, self.seed, self.chunk_numel = dtype, seed, chunk_numel
        self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        self.rules = {name: (index, *_t5_init(name, config)) for index, name in enumerate(self.shapes)}

    def __contains__(self, name) -> bool:
        return name in self.shapes

    def keys(self):
        return self.shapes.keys()

    def fill(self, name: str, start: int, out):
        """Elements [start, start + len(out)) of tensor ``name``, flattened; ``start`` a multiple
        of ``chunk_numel``: a chunk's values depend only on the seed, the tensor and the chunk."""
        import torch

        index, kind, value = self.rules[name]
        if kind == "constant":
            return out.fill_(value)
        for offset in range(0, out.numel(), self.chunk_numel):
            piece = out[offset : offset + self.chunk_numel]
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index * 65_537 + start + offset)
            piece.normal_(0.0, value, generator=generator)
        return out

    def __getitem__(self, name):
        import torch

        shape = self.shapes[name]
        out = torch.empty(shape, dtype=self.dtype)
        self.fill(name, 0, out.view(-1))
        return out


def write_random_t5(config, out_dir, dtype, seed: int = 0, max_shard_size: int = 5 * 2**30) -> Path:
    """A randomly initialized ``T5ForConditionalGeneration`` of ``config`` saved to ``out_dir``
    (safetensors files and config.json, as ``save_pretrained`` writes them) without the model
    ever in memory: built on the meta device, each tensor generated and written a chunk at a time
    (16 M elements), with T5's initialization (``_t5_init``); a chunk's values depend only on
    ``seed``, the tensor and the chunk. For architectures bigger than RAM (t5-11b: 21 GiB in bf16)."""
    import torch
    from transformers import GenerationConfig, T5ForConditionalGeneration

    from .checkpoint import Chunked, save_sharded

    weights = RandomT5Weights(config, dtype, seed)
    tensors = {name: Chunked(dtype, shape, functools.partial(weights.fill, name), chunk_numel=weights.chunk_numel)
               for name, shape in weights.shapes.items()}  # fmt: skip
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_sharded(tensors, out, max_shard_size)
    config.dtype = dtype
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    return out


# ---------------------------------------------------------------------------- CLI


def _defaults(func) -> dict[str, object]:
    """Default values of ``func``'s keyword parameters (single source of truth)."""
    params = inspect.signature(func).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def make_demo_data_main(argv: Sequence[str] | None = None) -> int:
    """CLI for :func:`make_demo_data`."""
    d = _defaults(make_demo_data)
    parser = argparse.ArgumentParser(description=make_demo_data.__doc__.splitlines()[0])
    parser.add_argument("--out_dir", required=True, help="directory to write the splits to")
    for name in ("n_train", "n_val", "n_test", "seed"):
        parser.add_argument(f"--{name}", type=int, default=d[name], help=f"default {d[name]}")
    parser.add_argument(
        "--max_number", type=int, default=None, help=f"default {DEFAULT_MAX_NUMBER}"
    )
    args = parser.parse_args(argv)
    out = make_demo_data(**vars(args))
    print(
        f"wrote demo data to {out}: train={args.n_train} val={args.n_val} "
        f"test={args.n_test} (seed={args.seed})"
    )
    return 0


def build_demo_model_main(argv: Sequence[str] | None = None) -> int:
    """CLI for :func:`build_demo_model`."""
    d = _defaults(build_demo_model)
    parser = argparse.ArgumentParser(description=build_demo_model.__doc__.splitlines()[0])
    parser.add_argument("--data_dir", required=True, help="output of make_demo_data")
    parser.add_argument("--out_dir", required=True, help="directory to save the model to")
    for name in ("vocab_size", "d_model", "d_ff", "num_layers", "num_heads", "d_kv", "seed"):
        parser.add_argument(f"--{name}", type=int, default=d[name], help=f"default {d[name]}")
    parser.add_argument("--model_vocab_size", type=int, default=None,
                        help="embedding rows, if more than the tokenizer's (t5-3b: 32128)")  # fmt: skip
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=d["dtype"],
                        help="weights' dtype at build and on disk")  # fmt: skip
    parser.add_argument(
        "--num_decoder_layers", type=int, default=None, help="default: same as --num_layers"
    )
    parser.add_argument(
        "--dropout_rate", type=float, default=d["dropout_rate"],
        help=f"default {d['dropout_rate']}",
    )
    parser.add_argument("--streaming", action="store_true",
                        help="write the weights a tensor at a time, never building the model in memory "
                             "(architectures bigger than RAM)")  # fmt: skip
    args = parser.parse_args(argv)
    kwargs = vars(args)
    data_dir, out_dir = kwargs.pop("data_dir"), kwargs.pop("out_dir")
    out = build_demo_model(data_dir, out_dir, **kwargs)

    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    import torch

    config = AutoConfig.from_pretrained(out)
    with torch.device("meta"):  # count without allocating
        n_params, _ = count_parameters(AutoModelForSeq2SeqLM.from_config(config))
    print(
        f"saved demo model to {out} (data {data_dir}): vocab={config.vocab_size} "
        f"d_model={config.d_model} layers={config.num_layers}/{config.num_decoder_layers} "
        f"params={n_params:,}"
    )
    return 0
