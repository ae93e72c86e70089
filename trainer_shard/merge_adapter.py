"""`trainer-shard consolidate ADAPTER OUT --merge_adapter`: a LoRA adapter (PEFT's files) merged
into its base model, written as a plain model folder one tensor at a time.

    trainer-shard consolidate output/lora output/lora-merged --merge_adapter [--base data/t5-large]

For every weight of the base's safetensors files that the adapter targets, W + (alpha / r) B A
(alpha / sqrt(r) with rsLoRA), computed in fp32 for that tensor alone; a `modules_to_save`
module's weights come from the adapter; every other tensor is copied. The base is read a tensor
at a time (never whole in memory), so a base bigger than RAM merges on the machine that trained
it. The base is `--base`, else the adapter's `base_model_name_or_path` (a local folder). A
`modules_to_save` copy of a weight the base saves only through a tie (T5's lm_head) is written
on its own, with `tie_word_embeddings` false in the merged config.
"""

import json
import math
from pathlib import Path

import torch

from .checkpoint import Chunked, save_sharded
from .dtypes import DTYPES
from .errors import CheckpointError

PREFIX = "base_model.model."


def _adapter(folder: Path) -> tuple:
    config_path, weights_path = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not (config_path.is_file() and weights_path.is_file()):
        raise CheckpointError(f"{str(folder)!r} has no adapter_config.json and adapter_model.safetensors: "
                              "--merge_adapter reads the files a --use_peft run saves")  # fmt: skip
    config = json.loads(config_path.read_text())
    if (config.get("peft_type", "LORA") != "LORA" or config.get("use_dora") or config.get("fan_in_fan_out")
            or config.get("rank_pattern") or config.get("alpha_pattern")):  # fmt: skip
        raise CheckpointError(f"{str(folder)!r}: only plain LoRA adapters merge here (peft_type LORA, one rank and "
                              "alpha, no DoRA, no fan_in_fan_out); merge others with PEFT's merge_and_unload")  # fmt: skip
    from safetensors.torch import load_file

    return config, load_file(weights_path)  # an adapter is small: read whole


def _scaling(config: dict) -> float:
    rank, alpha = config["r"], config["lora_alpha"]
    return alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


def merge_adapter(adapter, out, base=None, dtype: str | None = None, max_shard_size="5GB") -> Path:
    """Write `out`, the base model with the adapter of folder `adapter` merged in (module docstring).
    `dtype`: the output's (default: the base's own per tensor)."""
    from .consolidate import _copy_side_files, _ModelFiles, parse_size

    adapter, out = Path(adapter), Path(out)
    config, weights = _adapter(adapter)
    base = Path(base or config.get("base_model_name_or_path") or "")
    if not base.is_dir():
        raise CheckpointError(f"the base model {str(base)!r} is not a local folder: pass --base FOLDER")
    if out.resolve() in (adapter.resolve(), base.resolve()):
        raise CheckpointError("OUT must be another folder than the adapter's and the base's")
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    deltas, replaced = {}, {}
    for key in weights:
        name = key.removeprefix(PREFIX)
        for part in (".lora_A.weight", ".lora_B.weight"):
            if name.endswith(part):
                deltas.setdefault(name.removesuffix(part) + ".weight", {})[part[1:7]] = key
                break
        else:
            replaced[name.replace(".modules_to_save", "")] = key  # a module trained whole
    model = _ModelFiles(base)
    try:
        missing = sorted(set(deltas) - set(model.weight_map))
        if missing:
            raise CheckpointError(f"the adapter targets weights the base {str(base)!r} does not have: {missing[:3]}")
        tensors = {name: _merged(name, model, config, weights, deltas, replaced, dtype) for name in model.weight_map}
        # a module trained whole whose weight the base saves only through a tie (T5's lm_head is its
        # shared embedding): written on its own, and the tie undone so that it is read
        untied = sorted(set(replaced) - set(model.weight_map))
        for name in untied:
            value = weights[replaced[name]]
            tensors[name] = value.to(DTYPES[dtype]) if dtype else value
        out.mkdir(parents=True, exist_ok=True)
        save_sharded(tensors, out, parse_size(max_shard_size))
        _copy_side_files(base, out, DTYPES[dtype] if dtype else None)
        if untied:
            path = out / "config.json"
            values = json.loads(path.read_text())
            values["tie_word_embeddings"] = False
            path.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
    finally:
        model.close()
    return out


def _merged(name, model, config, weights, deltas, replaced, dtype) -> Chunked:
    saved = model.file(name)
    shape, saved_dtype = saved.shape(name), saved.dtype(name)
    target = DTYPES[dtype] if dtype and saved_dtype.is_floating_point else saved_dtype
    whole = {}  # this tensor, built at its first chunk and dropped at its last

    def value() -> torch.Tensor:
        if "t" not in whole:
            if name in replaced:
                tensor = weights[replaced[name]].float()
            else:
                tensor = torch.empty(shape, dtype=saved_dtype)
                saved.read(name, 0, tensor.numel(), tensor.view(-1))
                if name in deltas:
                    a, b = weights[deltas[name]["lora_A"]].float(), weights[deltas[name]["lora_B"]].float()
                    tensor = tensor.float().addmm_(b, a, alpha=_scaling(config))
            whole["t"] = tensor.reshape(-1)
        return whole["t"]

    def read(start, out_chunk):
        flat = value()
        out_chunk.copy_(flat[start : start + out_chunk.numel()])
        if start + out_chunk.numel() >= flat.numel():
            whole.clear()

    return Chunked(target, shape, read)
