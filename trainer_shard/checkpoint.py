"""Saving the model of a sharded run without a second copy of it in memory.

The sharded optimizer keeps every parameter as a view of one flat buffer. `save_pretrained`
sees tensors that share storage and clones each of them before writing (safetensors does not
allow aliasing): a full copy of the model at every save, 5.7 GB for t5-3b in bf16. Here the
safetensors file is written tensor by tensor straight from the views:

    save_model(model, "output/")   # model.safetensors, config.json, generation_config.json

The file is the standard format (8-byte header length, JSON header, raw little-endian bytes),
loaded by `from_pretrained` and `safetensors.torch.load_file` as any other.
"""

import json
import os
import re
import struct
from pathlib import Path

import torch

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}  # fmt: skip


def unique_state_dict(model) -> dict:
    """`model.state_dict()` without tied duplicates, keeping the names `from_pretrained` expects."""
    state = model.state_dict()
    tied = _tied_patterns(model)
    groups = {}
    for name, tensor in state.items():
        key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        groups.setdefault(key, []).append(name)
    keep = {}
    for names in groups.values():
        untied = [n for n in names if not any(re.search(p, n) for p in tied)]
        name = (untied or sorted(names))[0]
        keep[name] = state[name]
    return {name: keep[name] for name in state if name in keep}


def _tied_patterns(model) -> list:
    keys = getattr(model, "_tied_weights_keys", None) or []
    return list(keys.keys() if isinstance(keys, dict) else keys)


def save_safetensors(tensors: dict, path, metadata: dict | None = None) -> None:
    """Write `tensors` to `path` in safetensors format, one tensor at a time, copying none of
    them (a CPU tensor is written from its own memory; others are moved one at a time)."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPES:
            raise TypeError(f"{name}: dtype {tensor.dtype} cannot be saved in safetensors")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = metadata
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for tensor in tensors.values():
            data = tensor.detach()
            if data.device.type != "cpu" or not data.is_contiguous():
                data = data.to("cpu").contiguous()
            if data.numel():
                f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a save that fails half-way leaves the previous file in place


def save_model(model, output_dir) -> None:
    """The weights (model.safetensors) and the configuration files `from_pretrained` reads."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(output_dir)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(output_dir)
    save_safetensors(unique_state_dict(model), output_dir / "model.safetensors", {"format": "pt"})
