"""Loading a checkpoint into 16-bit parameters one tensor at a time.

`from_pretrained` (transformers 5.x) memory-maps every checkpoint file for the whole load, so
loading fp32 weights into a bf16 model peaks at the fp32 file's resident pages plus the bf16
copy (6 bytes a parameter); with a bf16 file the mapped pages stay resident next to the
sharded optimizer's flat buffer. For a run whose parameters are about to be flattened and
offloaded, that load is the largest moment of the whole run.

`load_meta` leaves it there for ZeRO-3 (the Trainer reads each unit's weights a tensor at a time
and keeps each rank's slice, in RAM or in the parameter store). `load_pretrained_lean` builds the model on the meta device and fills each parameter from its
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

from .errors import ArgumentError

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

_HUB_FILES = ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json"]


def load_meta(model_class, path, config=None, dtype=None, cache_dir=None):
    """`model_class` built on the meta device (shapes, no weights; buffers real, as the model's
    constructor makes them) with the folder of its safetensors files in `META_WEIGHTS`, for
    ZeRO-3: a `ShardedTrainerMixin` Trainer at stage 3 shards it at its start, reading the files
    a tensor at a time, each unit's tensors into one buffer of which every rank keeps its slice;
    the whole model never exists in one process. `path`: a local folder, or a model name on the
    hub (its safetensors files and config are downloaded, or found in the cache). `config`:
    default the checkpoint's; `dtype`: default ("auto") the checkpoint's own, as `from_pretrained`.
    Raises ArgumentError when there are no safetensors weights (naming the conversion).

        model = load_meta(AutoModelForSeq2SeqLM, "t5-large", dtype=torch.bfloat16)
        trainer = ShardedSeq2SeqTrainer(model=model, args=args_with_zero_dp_3, ...)
    """
    from accelerate import init_empty_weights
    from transformers import AutoConfig, GenerationConfig

    folder = weights_folder(path, cache_dir)
    if config is None:
        config = AutoConfig.from_pretrained(folder)
    if dtype in (None, "auto"):  # as from_pretrained: the checkpoint's own, as its config records it
        dtype = getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    build = getattr(model_class, "from_config", None) or model_class._from_config  # an Auto class, or a model's
    with init_empty_weights(include_buffers=False):  # buffers as the constructor computes them
        model = build(config, dtype=dtype)
    model.tie_weights()  # accelerate's context made each tied assignment a parameter of its own
    _load_persistent_buffers(model, folder)
    setattr(model, META_WEIGHTS, str(folder))
    if (folder / "generation_config.json").is_file() and model.can_generate():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model


def weights_folder(path, cache_dir=None) -> Path:
    """The local folder holding `path`'s safetensors weights (a hub name: its files downloaded or
    found in the cache, weights and configs only). Raises ArgumentError, naming the conversion,
    when the checkpoint has no safetensors weights."""
    folder = Path(path)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(str(path), allow_patterns=_HUB_FILES, cache_dir=cache_dir))
        except Exception as e:  # offline, no such repository, no access: what the hub said
            raise ArgumentError(f"{str(path)!r} is neither a local folder nor a model the hub gave "
                                f"({type(e).__name__}: {e}); pass a local folder of safetensors weights") from None  # fmt: skip
    if _weight_files(folder):
        return folder
    others = sorted(p.name for p in folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack"))
    raise ArgumentError(
        f"{str(path)!r} has no safetensors weights (model.safetensors or model.safetensors.index.json)"
        f"{': it has ' + ', '.join(others[:3]) if others else ''}; ZeRO-3 reads each rank's slice from safetensors "
        "files only. Convert it once on a machine with the RAM for it: python -c \"from transformers import "
        f"AutoModel; AutoModel.from_pretrained('{path}').save_pretrained('CONVERTED')\" (any Auto class that "
        "fits the model), then pass CONVERTED"
    )


def _load_persistent_buffers(model, folder: Path) -> None:
    """A meta-built model's persistent buffers (BatchNorm's statistics and the like: small) read
    from the checkpoint where it has them; the constructor's values stand otherwise, as
    `from_pretrained` leaves them."""
    from safetensors import safe_open

    persistent = {name for name, b in model.state_dict(keep_vars=True).items()
                  if any(b is buf for buf in model.buffers())}  # fmt: skip
    if not persistent:
        return
    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in persistent & set(f.keys()):
                module_name, _, leaf = name.rpartition(".")
                module = model.get_submodule(module_name) if module_name else model
                module._buffers[leaf] = f.get_tensor(name).to(module._buffers[leaf].dtype)


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
