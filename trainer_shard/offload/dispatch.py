"""Big-model loading for evaluation and prediction: a device map over devices, CPU RAM and disk.

    model = load_dispatched(AutoModelForSeq2SeqLM, "t5-3b", config.inference, source="eval.json")

Accelerate's big-model recipe, through its public API and transformers' `from_pretrained`:

1. the model is built empty on the meta device (`init_empty_weights`: no memory at all);
2. a device map is planned from its parameter shapes alone under `max_memory`
   (`infer_auto_device_map`: GPUs in order, then CPU RAM, then disk; never splitting a module
   of `no_split_module_classes`), or an explicit map is checked against its module names;
3. `from_pretrained(device_map=...)` loads the checkpoint one shard at a time straight into
   place. Weights planned for disk are read from the checkpoint's safetensors files in place
   when their dtype is kept (otherwise written once to `offload_folder`), and accelerate's
   hooks bring each offloaded module's weights to the execution device only around its forward.

Every problem with the plan (a module name the model does not have, parameters no entry covers,
disk needed without `offload_folder`) is a `ConfigError` naming the config key, raised before
anything is loaded.
"""

import difflib
import logging

import torch
from accelerate import init_empty_weights, infer_auto_device_map
from accelerate.utils import get_balanced_memory

from ..dtypes import DTYPES
from ..errors import ConfigError

logger = logging.getLogger(__name__)


def empty_model(model_class, config, dtype=None):
    """The model on the meta device: shapes and module names, no weights."""
    with init_empty_weights():
        model = model_class.from_config(config, **({"dtype": dtype} if dtype is not None else {}))
    model.tie_weights()
    return model


def plan_device_map(model_class, config, inference: dict, source: str = "config") -> dict:
    """{module name: device} for `config`'s model under the inference section's settings."""
    dtype = DTYPES.get(inference["dtype"]) or _checkpoint_dtype(config)
    model = empty_model(model_class, config, dtype)
    device_map = inference["device_map"]
    if isinstance(device_map, dict):
        _check_explicit(model, device_map, source)
        return dict(device_map)
    no_split = inference["no_split_module_classes"] or sorted(getattr(model, "_no_split_modules", None) or [])
    unknown = sorted(set(no_split) - {type(m).__name__ for m in model.modules()})
    if unknown:
        raise ConfigError(source, [("$.inference.no_split_module_classes", f"{unknown} are not module classes of "
                                    f"{type(model).__name__}")])  # fmt: skip
    max_memory = inference["max_memory"]
    if device_map in ("balanced", "balanced_low_0"):
        max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype,
                                         low_zero=device_map == "balanced_low_0")  # fmt: skip
    plan = dict(infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype))
    if "disk" in plan.values() and not inference["offload_folder"]:
        on_disk = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if _device_of(n, plan) == "disk")
        raise ConfigError(source, [("$.inference.offload_folder", f"{on_disk / 2**30:.2f} GiB of weights do not fit "
                                    f"max_memory {max_memory} and go to disk: name a folder for them, or raise max_memory")])  # fmt: skip
    return plan


def load_dispatched(model_class, path, inference: dict, *, config=None, source: str = "config"):
    """Load `path` across devices, CPU RAM and disk as planned; logs the plan."""
    from transformers import AutoConfig

    config = config if config is not None else AutoConfig.from_pretrained(path)
    plan = plan_device_map(model_class, config, inference, source)
    dtype = DTYPES.get(inference["dtype"]) or _checkpoint_dtype(config) or torch.float32
    placed = {}
    for name, device in plan.items():
        placed.setdefault(str(device), []).append(name or "(the whole model)")
    for device, names in placed.items():
        logger.info("device map: %d module(s) on %s: %s", len(names), device, ", ".join(names[:6]) + (" ..." if len(names) > 6 else ""))
    return model_class.from_pretrained(path, config=config, device_map=plan, dtype=dtype,
                                       offload_folder=inference["offload_folder"],
                                       offload_buffers=inference["offload_buffers"])  # fmt: skip


def _checkpoint_dtype(config):
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _device_of(param_name: str, plan: dict):
    """The device of the longest module prefix of `param_name` in `plan`."""
    parts = param_name.split(".")
    for end in range(len(parts), -1, -1):
        prefix = ".".join(parts[:end])
        if prefix in plan:
            return plan[prefix]
    return None


def _check_explicit(model, device_map: dict, source: str) -> None:
    modules = dict(model.named_modules())
    problems = []
    for name in device_map:
        if name not in modules:
            close = difflib.get_close_matches(name, [n for n in modules if n], n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            problems.append(("$.inference.device_map", f"{type(model).__name__} has no module {name!r}{hint}"))
    uncovered = [n for n, _ in model.named_parameters() if _device_of(n, device_map) is None]
    if uncovered:
        problems.append(("$.inference.device_map", f"no entry places {len(uncovered)} parameter(s), e.g. "
                         f"{uncovered[:3]}; add their modules (or \"\" for everything else)"))  # fmt: skip
    if problems:
        raise ConfigError(source, problems)
