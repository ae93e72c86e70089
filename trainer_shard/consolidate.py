"""`trainer-shard consolidate CHECKPOINT OUT`: a sharded checkpoint -> a plain model folder.

    trainer-shard consolidate output/checkpoint-500 t5-final                  # fp32, from the masters
    trainer-shard consolidate output/checkpoint-500 t5-bf16 --dtype bfloat16 --max_shard_size 2GB
    trainer-shard consolidate output/checkpoint-500 t5-full --optimizer       # + optimizer.safetensors
    trainer-shard consolidate output/lora t5-merged --merge_adapter           # a LoRA adapter merged into its base

The weights come from the fp32 master shards of `optimizer_shards/` (the trainable parameters,
at full precision even when the run trained in bf16) and from the checkpoint's own model file
(buffers and frozen parameters). Output: safetensors, split into `max_shard_size` files with a
`model.safetensors.index.json` when bigger, and the checkpoint's config and tokenizer files:
`AutoModelForSeq2SeqLM.from_pretrained(OUT)` loads it.

It streams: every output tensor is assembled a chunk of 4 M elements at a time from the ranks'
files (read with `pread`, nothing memory-mapped), so peak memory is a few chunk buffers, not the
model. `--optimizer` writes the full, unsharded optimizer state the same way to
`optimizer.safetensors`: `state.{parameter}.{key}` tensors (exp_avg...), the scalars (step) and
the param groups, by parameter name, in its metadata.
"""

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch

from .config.load import parse_size as config_parse_size
from .checkpoint import MANIFEST, Chunked, SafetensorsFile, save_safetensors, save_sharded
from .constants import CHUNK_NUMEL
from .dtypes import DTYPES
from .errors import CheckpointError
from .sharding import state_io

_NOT_COPIED = re.compile(
    r"^(model.*\.safetensors(\.index\.json)?|pytorch_model.*\.bin(\.index\.json)?|optimizer.*|scheduler\.pt|"
    r"rng_state.*\.pth|trainer_state\.json|training_args\.bin|scaler\.pt|" + re.escape(MANIFEST) + r")$"
)


def parse_size(text) -> int:
    try:
        return config_parse_size(text)
    except ValueError:
        raise CheckpointError(f"--max_shard_size {text!r}: give a size such as 5GB, 500MB or 2GiB") from None


class _ModelFiles:
    """The checkpoint's own model weights: one safetensors file or an index of several."""

    def __init__(self, folder: Path):
        self.folder, self.files = folder, {}
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            self.weight_map = json.loads(index.read_text())["weight_map"]
        elif (folder / "model.safetensors").is_file():
            # kept open in self.files for the reads to come, closed by close() with the others
            single = self.files["model.safetensors"] = SafetensorsFile(folder / "model.safetensors")
            self.weight_map = dict.fromkeys(single.keys(), "model.safetensors")
        else:
            raise CheckpointError(f"{str(folder)!r} has no model.safetensors (or index): not a checkpoint of this trainer")

    def file(self, name: str) -> SafetensorsFile:
        filename = self.weight_map[name]
        if filename not in self.files:
            self.files[filename] = SafetensorsFile(self.folder / filename)
        return self.files[filename]

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files = {}


def consolidate(checkpoint, out, dtype: str = "float32", max_shard_size="5GB", optimizer: bool = False) -> Path:
    """Write the plain model folder `out` from `checkpoint`. See the module docstring."""
    checkpoint, out = Path(checkpoint), Path(out)
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    limit = parse_size(max_shard_size)
    shards = checkpoint / state_io.FOLDER
    if not shards.is_dir():
        raise CheckpointError(f"{str(checkpoint)!r} has no {state_io.FOLDER}/: consolidate reads the checkpoints of "
                              "sharded or offloaded runs (a plain run's checkpoint is already a model folder)")  # fmt: skip
    if out.resolve() == checkpoint.resolve():
        raise CheckpointError("OUT must be another folder than CHECKPOINT")
    index = state_io.read_index(shards)
    state_io.verify_files(shards, index)
    target = DTYPES[dtype]
    model, sources = _ModelFiles(checkpoint), None
    try:
        sources = state_io.ShardSources(shards, index)
        unmatched = sorted(set(sources.where) - set(model.weight_map))
        if unmatched:  # their masters would be left out: refuse rather than write lower-precision copies
            raise CheckpointError(f"the optimizer shards hold parameters the model file does not name: {unmatched[:5]}")
        tensors = {name: _source(name, model, sources, target) for name in model.weight_map}
        out.mkdir(parents=True, exist_ok=True)
        save_sharded(tensors, out, limit)
        _copy_side_files(checkpoint, out, target)
        if optimizer:
            _write_optimizer(sources, index, out)
    finally:
        if sources is not None:
            sources.close()
        model.close()
    return out


def _source(name: str, model: _ModelFiles, sources, target) -> Chunked:
    """One output tensor, read a chunk at a time: masters for trainable parameters, else the model file."""
    saved = model.file(name)
    shape, saved_dtype = saved.shape(name), saved.dtype(name)
    dtype = target if saved_dtype.is_floating_point else saved_dtype
    if name in sources.where:
        if tuple(sources.where[name][1]) != tuple(shape):
            raise CheckpointError(f"{name!r}: the optimizer shards say {sources.where[name][1]}, the model file {shape}")

        def read(start, out_chunk, name=name):
            fp32 = _scratch(out_chunk.numel())
            sources.read_range(name, "master", start, fp32)
            out_chunk.copy_(fp32)
    else:

        def read(start, out_chunk, name=name, file=saved):
            raw = _scratch(out_chunk.numel(), saved_dtype)
            file.read(name, start, start + out_chunk.numel(), raw)
            out_chunk.copy_(raw)

    return Chunked(dtype, shape, read, CHUNK_NUMEL)


_SCRATCH = {}


def _scratch(numel: int, dtype=torch.float32) -> torch.Tensor:
    """A reused buffer: one per dtype, the size of a chunk."""
    buffer = _SCRATCH.get(dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = _SCRATCH[dtype] = torch.empty(max(numel, CHUNK_NUMEL), dtype=dtype)
    return buffer[:numel]


def _copy_side_files(checkpoint: Path, out: Path, dtype) -> None:
    """config.json (its dtype set to the output's), generation config, tokenizer files; each
    copied to a temporary name and renamed over the one in `out` (a failed copy leaves it)."""
    for path in checkpoint.iterdir():
        if path.is_file() and not _NOT_COPIED.match(path.name):
            tmp = out / f"{path.name}.tmp"
            try:
                shutil.copy2(path, tmp)
                if path.name == "config.json" and dtype is not None:  # None: the source's own
                    _set_dtype(tmp, dtype)
                os.replace(tmp, out / path.name)
            finally:
                tmp.unlink(missing_ok=True)


def _set_dtype(config: Path, dtype) -> None:
    values = json.loads(config.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in values:
            values[key] = str(dtype).removeprefix("torch.")
    config.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def _write_optimizer(sources, index: dict, out: Path) -> None:
    """optimizer.safetensors: the full state by parameter name, streamed like the weights."""
    if index["fresh"]:
        raise CheckpointError("--optimizer: this checkpoint was saved before the first optimizer step; it has no state")
    tensors, scalars = {}, {}
    for name, (flat, shape, _) in sources.where.items():
        for key in sources.keys(name):
            if key == "master":
                continue

            def read(start, out_chunk, name=name, key=key):
                sources.read_range(name, key, start, out_chunk)

            tensors[f"state.{name}.{key}"] = Chunked(torch.float32, shape, read, CHUNK_NUMEL)
        scalars[name] = {k: (v.item() if torch.is_tensor(v) else v) for k, v in sources.scalars(flat).items()}
    metadata = {"format": "trainer_shard.optimizer/1", "optimizer": index["optimizer"],
                "param_groups": json.dumps(index["param_groups"]), "scalars": json.dumps(scalars)}  # fmt: skip
    save_safetensors(tensors, out / "optimizer.safetensors", metadata)


def consolidate_main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="trainer-shard consolidate", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint-N folder of a sharded or offloaded run")
    parser.add_argument("out", help="the model folder to write")
    parser.add_argument("--dtype", default=None, help="float32 (the default; merging: the base's own), bfloat16 "
                        "or float16")  # fmt: skip
    parser.add_argument("--max_shard_size", default="5GB", help="largest weights file (default 5GB)")
    parser.add_argument("--optimizer", action="store_true", help="also write the full optimizer state")
    parser.add_argument("--merge_adapter", action="store_true",
                        help="CHECKPOINT is a LoRA run's folder (adapter_model.safetensors): write its base with the "
                        "adapter merged in, a tensor at a time")  # fmt: skip
    parser.add_argument("--base", default=None, help="with --merge_adapter: the base model's folder (default: the "
                        "adapter config's base_model_name_or_path)")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        if args.merge_adapter:
            if args.optimizer:
                raise CheckpointError("--optimizer writes a sharded run's optimizer state; a merged adapter has none")
            from .merge_adapter import merge_adapter

            out = merge_adapter(args.checkpoint, args.out, args.base, args.dtype, args.max_shard_size)
        elif args.base is not None:
            raise CheckpointError("--base names the base model of --merge_adapter: add --merge_adapter")
        else:
            out = consolidate(args.checkpoint, args.out, args.dtype or "float32", args.max_shard_size, args.optimizer)
    except CheckpointError as e:
        print(f"trainer-shard: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
