"""Loading a checkpoint into 16-bit parameters one tensor at a time.

`from_pretrained` (transformers 5.x) memory-maps every checkpoint file for the whole load, so
loading fp32 weights into a bf16 model peaks at the fp32 file's resident pages plus the bf16
copy (6 bytes a parameter); with a bf16 file the mapped pages stay resident next to the
sharded optimizer's flat buffer. For a run whose parameters are about to be flattened and
offloaded, that load is the largest moment of the whole run.

`load_meta` leaves it there for ZeRO-3 with parameter offload (the Trainer reads the weights
straight into the parameter store). `load_pretrained_lean` builds the model on the meta device and fills each parameter from its
own short-lived mapping (open, copy one tensor in the target dtype, close), so the load costs
the 16-bit parameters plus one tensor. It covers the plain case: a local folder of safetensors
files whose names match the model's state dict exactly, no buffer missing. Anything else
(hub names, `.bin` files, renamed or missing weights) returns None, and the caller uses
`from_pretrained`.
"""

import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def _weight_files(folder: Path):
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else None


def load_pretrained_lean(model_class, path, config, dtype):
    """The model `model_class.from_pretrained(path, config=config, dtype=dtype)` returns, loaded
    a tensor at a time; None where this loader does not apply (see the module docstring)."""
    from safetensors import safe_open
    from transformers import GenerationConfig

    folder = Path(path)
    files = _weight_files(folder) if folder.is_dir() else None
    if not files:
        return None
    with torch.device("meta"):
        model = model_class.from_config(config, dtype=dtype)
    expected = dict(model.state_dict(keep_vars=True))
    names = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update({name: file for name in f.keys()})
    tied = {k for k in expected if _is_tied_alias(model, k)}
    if set(names) - set(expected) or set(expected) - set(names) - tied:
        logger.info("lean loading skipped: checkpoint names differ from the model's; using from_pretrained")
        return None
    for name, file in names.items():
        with safe_open(str(file), framework="pt") as f:  # one mapping per tensor: unmapped right after
            value = f.get_tensor(name)
        target = expected[name]
        _assign(model, name, value.to(target.dtype), isinstance(target, torch.nn.Parameter))
        del value
    model.tie_weights()
    leftover = [n for n, t in model.state_dict().items() if t.is_meta]
    if leftover or any(b.is_meta for b in model.buffers()):
        logger.info("lean loading skipped: %s not in the checkpoint; using from_pretrained", leftover[:3])
        return None
    if (folder / "generation_config.json").is_file() and model.can_generate():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    model.eval()
    return model


META_WEIGHTS = "_trainer_shard_weights_folder"
"""The attribute a meta-device model from `load_meta` carries: the folder its weights are read from."""


def load_meta(model_class, path, config, dtype):
    """The model built on the meta device (shapes, no weights) with the folder of its safetensors
    files in `META_WEIGHTS`, for ZeRO-3 with parameter offload: the Trainer shards it reading the
    files a tensor at a time straight into the parameter store (`zero3.shard_model(weights=...)`),
    so the weights are never whole in memory. None when `path` is not a local folder of
    safetensors files (the caller loads with `from_pretrained`)."""
    from transformers import GenerationConfig

    folder = Path(path)
    if not (folder.is_dir() and _weight_files(folder)):
        return None
    if dtype in (None, "auto"):  # as from_pretrained: the checkpoint's own, as its config records it
        dtype = getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = model_class.from_config(config, dtype=dtype)
    setattr(model, META_WEIGHTS, str(folder))
    if (folder / "generation_config.json").is_file() and model.can_generate():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model


def _is_tied_alias(model, name: str) -> bool:
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return name in keys


def _assign(model, name: str, value: torch.Tensor, parameter: bool) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name) if module_name else model
    if parameter:
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=module._parameters[leaf].requires_grad)
    else:
        module._buffers[leaf] = value
