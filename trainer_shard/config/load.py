"""Read, check and resolve an offload config: every problem collected, then one ConfigError.

    config = load_config("configs/offload_cpu.json", training_args=args, world_size=2)

Checks, in one pass: JSON syntax (with line and column), unknown keys (with close names),
types, ranges, "auto" where it is not allowed, each key's decision (schema.py: a value that
contradicts what the engine does, or a setting that cannot be honoured, is a problem; ignored
keys are collected for one warning line each), cross-field rules (nvme needs nvme_path, offload
needs stage >= 1 or one process, one ZeRO-3 setting under one name...), and, given
TrainingArguments, "auto" filled from them as the Hugging Face DeepSpeed integration fills it and
every explicit value that contradicts them, reported with both values. What a key does at the
run's ZeRO stage (the ZeRO-3 keys above all) is decided once the stage is known: `stage_problems`
and `stage_notes`.

Hostile input gets the same treatment (tests/faults/test_input_fuzz.py): whatever the bytes, the
only exception is ConfigError, and every value, key and number in its message is abbreviated, so
a 400-digit integer or a megabyte of string is named in a line, never pasted in whole.
"""

import difflib
import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ConfigError
from .schema import AUTO, OFFLOAD_PARAM, PARAM_STORE, STAGE3_ALIASES, TOP, Key


@dataclass(frozen=True)
class OffloadConfig:
    """The resolved config, flat: what the engine and the Trainer integration read."""

    stage: int
    offload_device: str  # none | cpu | nvme
    nvme_path: str | None
    pin_memory: bool
    buffer_count: int
    reduce_bucket_size: int | None  # None: "auto", hidden size squared once the model is known (apply.py)
    allgather_bucket_size: int | None  # None: "auto", the reduce bucket's size
    overlap_comm: bool
    optimizer: dict | None  # {"type": ..., "params": {...}} or None: the Trainer's --optim
    scheduler: dict | None
    gradient_clipping: float | None
    precision: str  # fp32 | fp16 | bf16 | auto (not resolved: no TrainingArguments given)
    loss_scale: float
    initial_scale_power: int
    loss_scale_window: int
    min_loss_scale: float
    grad_accum_dtype: str | None  # fp32 | bf16 | fp16 | None (the default for the run)
    micro_batch_size: int | None
    gradient_accumulation_steps: int | None
    train_batch_size: int | None
    raw: dict
    # the "inference" section, resolved (device_map, max_memory in bytes with accelerate's
    # device keys, offload_folder, dtype, no_split_module_classes, offload_buffers), or None
    inference: dict | None = None
    max_memory: dict | None = None  # the budget of --sharded_ddp auto, {device: bytes}
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    communication_data_type: str | None = None  # fp32 | bf16 | fp16 | None (the reducer's default)
    # keys accepted but unused: ((json path, why), ...), each named in one warning line at start
    ignored: tuple = ()
    # keys accepted as what the engine does anyway: ((json path, what it does), ...)
    given: tuple = ()
    # ZeRO-3 keys present, ((json path, what they mean), ...): decided at the run's stage (stage_notes)
    stage3_keys: tuple = ()
    # `offload_param` resolved ("auto": DeepSpeed's defaults; `cpu_offload_param: true` is device
    # cpu): {device, nvme_path, buffer_count, buffer_size, max_in_cpu, pin_memory}; it takes effect
    # at stage 3 only (config/apply.py `param_offload_kwargs`)
    param_offload: dict | None = None

    def with_notes(self, notes: list) -> "OffloadConfig":
        """This config with more (role, path, why) notes, each path once: a path noted "ignored"
        leaves "given", and the other way round (a key that does nothing at the run's stage)."""
        new = {role: {path: why for r, path, why in notes if r == role} for role in ("ignored", "given", "stage3")}

        def merged(role, old, other=None):
            moved = new[other] if other else {}
            return tuple(({path: why for path, why in old if path not in moved} | new[role]).items())

        ignored, given = merged("ignored", self.ignored, "given"), merged("given", self.given, "ignored")
        return replace(self, ignored=ignored, given=given, stage3_keys=merged("stage3", self.stage3_keys))


def load_config(path, training_args=None, world_size: int = 1, flag_offload: bool = False) -> OffloadConfig:
    """Load `path`; raise ConfigError listing every problem. See the module docstring.
    `flag_offload`: the run's --sharded_ddp has `offload` (the optimizer state goes to CPU RAM
    when the config offloads none of it)."""
    source = str(path)
    data = _read_json(Path(path), source)
    problems, notes = [], []
    data = _old_forms(data, problems)
    tree = _check_object(data, TOP, "$", problems, notes)
    _precision_from_flags(tree, data)
    bad = {path for path, _ in problems}
    combination = []
    _cross_field(tree, world_size, combination)
    _stage3_names(data, combination)
    if tree["zero_optimization"]["stage"] == 3:  # the file's own stage: refused stage-3 keys are told at once
        stage3 = [path for role, path, _ in notes if role == "stage3"]
        combination += _stage3_refusals(_stage3_present(stage3, data))
        combination += param_offload_problems(_param_settings(tree), _optimizer_device(tree),
                                              data.get("zero_optimization"), flag_offload)  # fmt: skip
    if isinstance(data, dict) and "inference" in data:
        _inference_rules(tree["inference"], world_size, combination)
    # a rule over a key that is already wrong would only repeat it (its default stood in)
    problems += [(path, message) for path, message in combination if not _under(path, bad)]
    if not problems and training_args is not None:
        _against_training_args(tree, training_args, world_size, problems)
        if "inference" in data and getattr(training_args, "do_train", False):
            problems.append(("$.inference", "applies to evaluation and prediction without --do_train (the model is "
                             "loaded across devices and disk); train without it, then evaluate with it"))  # fmt: skip
    if problems:
        raise ConfigError(source, problems)
    notes += _fp16_notes(tree, data)
    config = _build(tree, data).with_notes(notes)
    if training_args is None:  # alone: its own stage; with the arguments, args.py checks the run's stage
        problems = stage_problems(config, None, world_size, flag_offload)
        if problems:
            raise ConfigError(source, problems)
        config = config.with_notes(stage_notes(config, None, world_size))
    return config


def _old_forms(data, problems: list):
    """DeepSpeed's older spellings, read as the current ones: `"zero_optimization": true|false`
    (stage 1 or 0) and a `bfloat16` section (`bf16`)."""
    if not isinstance(data, dict):
        return data
    data = dict(data)
    if isinstance(data.get("zero_optimization"), bool):
        data["zero_optimization"] = {"stage": int(data["zero_optimization"])}
        if "allgather_size" in data:
            data["zero_optimization"]["allgather_bucket_size"] = data.pop("allgather_size")
    elif "allgather_size" in data:
        problems.append(("$.allgather_size", "is the old form of zero_optimization.allgather_bucket_size, read only with "
                         '"zero_optimization": true; write allgather_bucket_size there'))  # fmt: skip
    if "bfloat16" in data:
        if "bf16" in data:
            problems.append(("$.bfloat16", "is the old name of bf16, and bf16 is there too; keep bf16"))
        else:
            data["bf16"] = data.pop("bfloat16")
    return data


def _precision_from_flags(tree: dict, data) -> None:
    """No fp16 or bf16 section: the precision is the flags' (--fp16, --bf16), as with the Hugging
    Face DeepSpeed integration, and never a conflict with a key the file does not have."""
    for name in ("fp16", "bf16"):
        if not isinstance(data, dict) or name not in data:
            tree[name]["enabled"] = AUTO


def _under(path: str, bad: set) -> bool:
    return any(path == b or path.startswith(b + ".") for b in bad)


MAX_FILE_BYTES = 2**20  # an offload config is a few hundred bytes
MAX_DIGITS = 4000  # Python refuses to convert longer integers (sys.get_int_max_str_digits())
INT_LIMIT = 2**63 - 1  # no count or size here goes beyond a 64-bit integer
MAX_UNKNOWN = 5  # unknown keys in one object named one by one; more are summed up in one problem


def _read_json(path: Path, source: str):
    if path.is_dir():
        raise ConfigError(source, [("$", "is a folder; pass the path of a JSON config file (see configs/README.md)")])
    if not path.is_file():
        raise ConfigError(source, [("$", "file not found; pass the path of a JSON config (see configs/README.md)")])
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ConfigError(source, [("$", f"is {size:,} bytes; an offload config is a few hundred: pass the JSON "
                                    "config, not a data or weights file")])  # fmt: skip
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark, as some editors write, is fine
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ConfigError(source, [("$", f"not UTF-8 text (byte 0x{raw[e.start]:02x} at line {line}, byte offset "
                                    f"{e.start}); save the file as UTF-8")])  # fmt: skip
    duplicates, constants = [], []
    try:
        data = json.loads(text, parse_constant=lambda name: _constant(name, constants), parse_int=_parse_int,
                          object_pairs_hook=lambda pairs: _object(pairs, duplicates))  # fmt: skip
    except json.JSONDecodeError as e:
        raise ConfigError(source, [("$", f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}")]) from None
    except RecursionError:
        raise ConfigError(source, [("$", "nests lists or objects too deeply to read; an offload config is at most "
                                    "four levels deep")]) from None  # fmt: skip
    except ValueError as e:
        raise ConfigError(source, [("$", str(e))]) from None
    problems = _non_finite(data) if constants else []
    if duplicates:
        keys = ", ".join(_describe(k, 40) for k in dict.fromkeys(duplicates[:5]))
        problems.insert(0, ("$", f"key {keys} written twice in one object, and JSON would keep only the last "
                            "silently; write each key once"))  # fmt: skip
    if problems:
        raise ConfigError(source, problems)
    return data


@dataclass(frozen=True)
class _Constant:
    """NaN, Infinity or -Infinity as read (json's parse_constant), kept where it stands to be named at its key."""

    name: str


def _constant(name: str, seen: list) -> _Constant:
    seen.append(_Constant(name))
    return seen[-1]


def _non_finite(data) -> list:
    """(path, message) for each NaN, Infinity or -Infinity in `data`, at its key: the first
    MAX_UNKNOWN one by one, the others counted. Not recursive: the file may nest as deep as json reads."""
    found, stack = [], [("$", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _Constant):
            found.append((path, f"{value.name} is not a number JSON allows; write a finite number"))
        elif isinstance(value, dict):
            stack += [(_child(path, key), item) for key, item in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value)))]
    if len(found) > MAX_UNKNOWN:
        found[MAX_UNKNOWN:] = [("$", f"holds {len(found) - MAX_UNKNOWN} more NaN or Infinity values (those named "
                                     "above are the first); write finite numbers")]  # fmt: skip
    return found


def _parse_int(text: str) -> int:
    if len(text) > MAX_DIGITS:
        raise ValueError(f"holds an integer of {len(text):,} digits ({text[:12]}...); no setting takes a number that "
                         "large: write the value you mean")  # fmt: skip
    return int(text)


def _object(pairs: list, duplicates: list) -> dict:
    """json's object_pairs_hook: a dict, remembering keys written twice (json keeps the last)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        duplicates += [key for key, _ in pairs if key in seen or seen.add(key)]
    return out


# ---- per-key checks --------------------------------------------------------------------------


def _check_object(value, spec: dict, path: str, problems: list, notes: list | None = None) -> dict:
    """Checked values with defaults filled in; problems appended as (path, message), and the keys
    accepted without effect as (role, path, why) to `notes` (see schema.py)."""
    notes = [] if notes is None else notes
    if not isinstance(value, dict):
        problems.append((path, f"must be an object {{...}}, got {_describe(value)}"))
        return _check_object({}, spec, path, [])  # its defaults stand in
    out = {}
    unknown = [key for key in value if not isinstance(key, str) or key not in spec]
    if len(unknown) > MAX_UNKNOWN:
        names = ", ".join(_describe(key, 30) for key in unknown[:MAX_UNKNOWN])
        problems.append((path, f"has {len(unknown)} unknown keys ({names}, ...); remove them; {_allowed(spec)}"))
    else:
        problems += [(_child(path, key), _unknown(key, spec)) for key in unknown]
    for key, key_spec in spec.items():
        child = f"{path}.{key}"
        if key not in value:
            out[key] = _check_object({}, key_spec.children, child, problems) if key_spec.kind == "object" else key_spec.default
            continue
        out[key] = _check_value(value[key], key_spec, child, problems, notes)
    return out


def _allowed(spec: dict) -> str:
    if len(spec) <= 12:
        return f"allowed here: {', '.join(spec)}"
    return "every key is listed in configs/README.md"


def _unknown(key, spec: dict) -> str:
    """`unknown key; did you mean ...?`: close names here, or where the name belongs elsewhere."""
    message = "unknown key"
    if isinstance(key, str) and len(key) <= 80:
        close = difflib.get_close_matches(key, list(spec), n=3, cutoff=0.75)
        if close:
            message += f" (did you mean {' or '.join(close)}?)"
        elsewhere = [p for p in _PATHS_BY_NAME.get(key, ()) if p.rsplit(".", 1)[0] != ""]
        if elsewhere and not close:
            message += f" here ({key} belongs at {' or '.join(f'$.{p}' for p in elsewhere[:3])})"
    return f"{message}; {_allowed(spec)}"


def _paths_by_name(spec: dict, prefix: str = "") -> dict:
    out = {}
    for key, key_spec in spec.items():
        path = f"{prefix}.{key}" if prefix else key
        out.setdefault(key, []).append(path)
        for name, paths in _paths_by_name(key_spec.children, path).items():
            out.setdefault(name, []).extend(paths)
    return out


_PATHS_BY_NAME = _paths_by_name(TOP)


def _child(path: str, key) -> str:
    """`$.stage`, or `$["odd key"]` for a key that is long or not a plain name."""
    if isinstance(key, str) and _NAME.fullmatch(key):
        return f"{path}.{key}"
    return f"{path}[{_describe(key, 40)}]"


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")


def _check_value(value, spec: Key, path: str, problems: list, notes: list):
    if spec.role == "ignored":
        notes.append((spec.role, path, spec.help))
        return value
    if spec.role == "stage3":  # checked as DeepSpeed checks it; what it does depends on the stage (stage_notes)
        notes.append((spec.role, path, spec.help))
        return value if spec.kind == "any" else _check_value(value, replace(spec, role="effect"), path, problems, notes)
    if spec.role == "refused":
        problems.append((path, spec.help))
        return None
    if spec.role == "given":
        return _check_given(value, spec, path, problems, notes)
    if spec.kind == "object":  # "auto" included: an object's defaults stand in, never None
        return _check_object(value, spec.children, path, problems, notes)
    if value == AUTO and isinstance(value, str) and not spec.auto_is_a_value:
        if spec.auto:
            return AUTO
        problems.append((path, '"auto" is not allowed here; write a value'))
        return spec.default
    checker = {"bool": _as_bool, "int": _as_int, "float": _as_float, "str": _as_str, "choice": _as_choice,
               "floats": _as_floats, "strs": _as_strs, "memory": _as_memory, "device_map": _as_device_map,
               "any": _as_any}[spec.kind]  # fmt: skip
    try:
        checked = checker(value, spec)
    except ValueError as e:
        problems.append((path, str(e)))
        return spec.default
    if spec.choices and spec.kind != "choice" and checked not in spec.choices:
        problems.append((path, f"must be {' or '.join(json.dumps(c) for c in spec.choices)}, got {_describe(value)}"))
    return checked


def _check_given(value, spec: Key, path: str, problems: list, notes: list):
    """A key accepted as what the engine does: any of `spec.choices`, else refused with the reason."""
    if spec.kind != "any":
        before = len(problems)
        value = _check_value(value, replace(spec, role="effect", choices=()), path, problems, notes)
        if len(problems) > before:
            return spec.default
    if _one_of(value, spec.choices):
        notes.append(("given", path, spec.help))
        return value
    allowed = " or ".join(json.dumps(c) for c in spec.choices)
    problems.append((path, f"must be {allowed}: {spec.help} (got {_describe(value)}); remove it or write {allowed}"))
    return spec.default


def _one_of(value, choices) -> bool:
    """`value in choices`, where true is not 1 (JSON's booleans are not numbers)."""
    return any(value == c and isinstance(value, bool) == isinstance(c, bool) for c in choices)


def _describe(value, width: int = 60) -> str:
    """`value` as JSON, cut to `width` characters: whatever its size or depth, only the start is read."""
    text = ""
    for piece in _pieces(value):
        text += piece
        if len(text) > width:
            text = text[: width - 3] + "..."
            break
    # a lone surrogate (JSON "\ud800") would make printing the message fail
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _pieces(value):
    """JSON text of `value` piece by piece, lazily (see _describe)."""
    if isinstance(value, dict):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield (", " if i else "") + _scalar(key) + ": "
            yield from _pieces(item)
        yield "}"
    elif isinstance(value, (list, tuple)):
        yield "["
        for i, item in enumerate(value):
            yield ", " if i else ""
            yield from _pieces(item)
        yield "]"
    else:
        yield _scalar(value)


def _scalar(value) -> str:
    if isinstance(value, str):
        return json.dumps(value[:80], ensure_ascii=False)[:-1] + ('..."' if len(value) > 80 else '"')
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return _big_int(value)
    if value is None or isinstance(value, (bool, int, float)):
        return json.dumps(value)
    return repr(value)[:80]


def _big_int(value: int) -> str:
    """`100000... (401 digits)`: the number is never printed whole."""
    if value.bit_length() > 13_000:  # str() refuses integers of more than 4,300 digits
        return f"an integer of about {int(value.bit_length() * 0.30103):,} digits"
    text = str(abs(value))
    return f"{'-' if value < 0 else ''}{text[:6]}... ({len(text):,} digits)"


def _as_any(value, spec):
    return value


def _as_bool(value, spec):
    if isinstance(value, bool):
        return value
    raise ValueError(f"must be true or false, got {_describe(value)}")


def _number(value, spec, integer: bool):
    # compared, never converted, until known to be in range: float(10**400) overflows
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be {'an integer' if integer else 'a number'}, got {_describe(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"must be finite, got {_describe(value)}")
    if integer and isinstance(value, float) and value != int(value):
        raise ValueError(f"must be an integer, got {_describe(value)}")
    if spec.minimum is not None and (value < spec.minimum or (spec.exclusive_minimum and value == spec.minimum)):
        raise ValueError(f"must be {'>' if spec.exclusive_minimum else '>='} {spec.minimum}, got {_describe(value)}")
    if spec.maximum is not None and value > spec.maximum:
        raise ValueError(f"must be <= {spec.maximum}, got {_describe(value)}")
    if (integer or isinstance(value, int)) and abs(value) > INT_LIMIT:
        raise ValueError(f"must be at most {INT_LIMIT:,} (2**63 - 1), got {_describe(value)}; write the value you "
                         "mean")  # fmt: skip
    return int(value) if integer else float(value)


def _as_int(value, spec):
    return _number(value, spec, integer=True)


def _as_float(value, spec):
    return _number(value, spec, integer=False)


def _as_str(value, spec):
    if isinstance(value, str) and value:
        return value
    raise ValueError(f"must be a non-empty string, got {_describe(value)}")


def _as_choice(value, spec):
    if isinstance(value, str) and value in spec.choices:
        return value
    raise ValueError(f"must be one of {', '.join(map(str, spec.choices))}, got {_describe(value)}")


def _as_floats(value, spec):
    if not isinstance(value, list) or len(value) != spec.length:
        raise ValueError(f"must be a list of {spec.length} numbers, got {_describe(value)}")
    return [_number(v, spec, integer=False) for v in value]


def _as_strs(value, spec):
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise ValueError(f"must be a non-empty list of non-empty strings, got {_describe(value)}")


_SIZE = re.compile(r"\s*([0-9]{1,30}(?:\.[0-9]{1,30})?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
SIZE_UNITS = "B; KB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: powers of 1024"


def parse_size(text) -> int:
    """Bytes from 5GB, 500MB, 2GiB (powers of 1000 and 1024) or a plain number of bytes.

    At most 2**63 - 1 bytes; ValueError, with the value abbreviated, for anything else."""
    if isinstance(text, int) and not isinstance(text, bool) and 0 <= text <= INT_LIMIT:
        return text
    match = _SIZE.fullmatch(text) if isinstance(text, str) else None
    if not match:
        raise ValueError(f"must be a size such as 2GiB, 500MB or a number of bytes (units: {SIZE_UNITS}), got "
                         f"{_describe(text)}")  # fmt: skip
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    power = "BKMGT".index(unit[0])
    size = number * (1024 if "I" in unit else 1000) ** power
    if size > INT_LIMIT:
        raise ValueError(f"{_describe(text)} is more than 2**63 - 1 bytes; write a size such as 24GiB")
    return int(size)


_GPU = re.compile(r"(?:cuda:)?([0-9]{1,4})")


def _device(key, path_hint: str):
    """accelerate's name for a device: "cpu", "disk", "mps", or a GPU index (from 0, "0", "cuda:0")."""
    if isinstance(key, int) and not isinstance(key, bool) and 0 <= key < 10_000:
        return key
    if isinstance(key, str):
        match = _GPU.fullmatch(key)  # ASCII digits only: "²".isdigit() is true, int("²") fails
        if match:
            return int(match.group(1))
        if key in ("cpu", "disk", "mps"):
            return key
    raise ValueError(f"{path_hint} {_describe(key, 40)} is not a device: use cpu, disk, mps or a GPU index "
                     "(0, cuda:0)")  # fmt: skip


def _as_memory(value, spec):
    if not isinstance(value, dict) or not value:
        raise ValueError(f'must be an object of sizes per device, e.g. {{"cpu": "2GiB"}}, got {_describe(value)}')
    budget, spelled = {}, {}
    for key, size in value.items():
        device = _device(key, "key")
        if device in budget:
            raise ValueError(f"names device {device} twice ({_describe(spelled[device], 20)} and "
                             f"{_describe(key, 20)}); keep one")  # fmt: skip
        spelled[device] = key
        try:
            budget[device] = parse_size(size)
        except ValueError as e:
            raise ValueError(f"{_describe(key, 20)}: {e}") from None
    return budget


def _as_device_map(value, spec):
    if isinstance(value, str):
        if value in DEVICE_MAP_STRATEGIES:
            return value
        raise ValueError(f"must be one of {', '.join(DEVICE_MAP_STRATEGIES)} or an object "
                         f'{{"module.name": device}}, got {_describe(value)}')  # fmt: skip
    if isinstance(value, dict) and value:
        return {str(k): _device(v, f"module {k[:40]!r}{'...' if len(k) > 40 else ''}: value") for k, v in value.items()}
    raise ValueError(f'must be a strategy (auto...) or an object {{"module.name": device}}, got {_describe(value)}')


DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def _inference_rules(inference: dict, world_size: int, problems: list) -> None:
    device_map = inference["device_map"]
    to_disk = isinstance(device_map, dict) and "disk" in device_map.values()
    if to_disk and not inference["offload_folder"]:
        problems.append(("$.inference.offload_folder", "the device_map sends modules to disk: name the folder for "
                         "their weights"))  # fmt: skip
    if isinstance(device_map, dict) and inference["max_memory"] is not None:
        problems.append(("$.inference.max_memory", "is used to plan a device map; an explicit device_map is already "
                         "planned: remove one of them"))  # fmt: skip
    if world_size > 1:
        problems.append(("$.inference", f"loads one model across this process's devices; run it on one process, not "
                         f"{world_size}"))  # fmt: skip


# ---- rules across keys ------------------------------------------------------------------------


def _cross_field(tree: dict, world_size: int, problems: list) -> None:
    zero = tree["zero_optimization"]
    offload = zero["offload_optimizer"]
    if zero["cpu_offload"] and offload["device"] not in ("none", "cpu"):
        problems.append(("$.zero_optimization.cpu_offload", f'contradicts offload_optimizer.device = "{offload["device"]}"; keep one'))
    if offload["device"] == "nvme" and not offload["nvme_path"]:
        problems.append(("$.zero_optimization.offload_optimizer.nvme_path",
                         'device "nvme" needs nvme_path: the folder for the disk store'))  # fmt: skip
    if offload["nvme_path"] and offload["device"] != "nvme":
        problems.append(("$.zero_optimization.offload_optimizer.nvme_path",
                         f'is only used with device "nvme" (device is "{offload["device"]}"); remove it or set device'))  # fmt: skip
    if zero["reduce_bucket_size"] == 0 and zero["stage"] != 3:  # DeepSpeed takes 0 at stage 3, which ignores it
        problems.append(("$.zero_optimization.reduce_bucket_size", "is 0: a bucket holds at least 1 element at stages "
                         '1 and 2 (only stage 3 ignores it); write a size, "auto", or remove it'))  # fmt: skip
    if tree["fp16"]["enabled"] is True and tree["bf16"]["enabled"] is True:
        problems.append(("$.fp16.enabled", "fp16 and bf16 are both enabled; enable one"))
    scheduler = tree["scheduler"]
    written = [k for k, v in scheduler["params"].items() if v != TOP["scheduler"].children["params"].children[k].default]
    if scheduler["type"] is None and written:
        problems.append(("$.scheduler.type", "params without a type; name WarmupLR or WarmupDecayLR"))
    if scheduler["type"] in ("WarmupCosineLR", "OneCycle", "LRRangeTest"):
        problems.append(("$.scheduler.type", f"DeepSpeed's {scheduler['type']} is not here; use the Trainer's "
                         "--lr_scheduler_type (cosine, linear, constant_with_warmup...) and remove the scheduler "
                         "section"))  # fmt: skip
    optimizer = tree["optimizer"]
    params = optimizer["params"]
    adam_only = [k for k in ("betas", "eps", "adam_w_mode", "amsgrad") if params.get(k) is not None]
    sgd_only = [k for k in ("momentum", "nesterov", "dampening") if params.get(k) is not None]
    if optimizer["type"] == "SGD" and adam_only:
        problems.append(("$.optimizer.params", f"{', '.join(adam_only)}: Adam arguments; SGD takes lr, momentum, "
                         "nesterov, dampening, weight_decay"))  # fmt: skip
    if optimizer["type"] != "SGD" and sgd_only:
        problems.append((f"$.optimizer.params.{sgd_only[0]}", f"is an SGD argument; {optimizer['type']} takes betas"))
    if optimizer["type"] == "AdamW" and params.get("adam_w_mode") is False:
        problems.append(("$.optimizer.params.adam_w_mode", 'false means L2 weight decay, which AdamW is not; use type "Adam"'))


def _stage3_names(data, problems: list) -> None:
    """Two names of one ZeRO-3 setting (`stage3_prefetch_bucket_size` and `prefetch_bucket_size`)
    in one file: DeepSpeed refuses them together too, whatever the values."""
    written = data.get("zero_optimization") if isinstance(data, dict) else None
    if not isinstance(written, dict):
        return
    for name, others in STAGE3_ALIASES.items():
        present = [n for n in (name, *others) if n in written]
        problems += [(f"$.zero_optimization.{n}", f"and {present[0]} name one setting; keep one (DeepSpeed refuses "
                      "the two together too)") for n in present[1:]]  # fmt: skip


def run_stage(config: "OffloadConfig", stage, world_size: int = 1):
    """The ZeRO stage a run of `config` has: `stage` (from `--sharded_ddp`) when given, else the
    config's own (offload on one process runs stage 2); None without sharding."""
    if stage is None:
        stage = config.stage or (2 if config.offload_device != "none" and world_size == 1 else None)
    return stage


def stage_problems(config: "OffloadConfig", stage, world_size: int = 1, flag_offload: bool = False) -> list:
    """What the run's ZeRO stage cannot do with this config. `stage` as for `run_stage`;
    `flag_offload` as for `load_config`."""
    stage = run_stage(config, stage, world_size)
    if stage is None and config.offload_device != "none":
        return [("$.zero_optimization.stage", f"offload with {world_size} ranks needs stage 1, 2 or 3 (or "
                 "--sharded_ddp simple|zero_dp_2|zero_dp_3), so that each rank offloads its own shard")]  # fmt: skip
    if stage != 3:
        return []
    zero = config.raw.get("zero_optimization") if isinstance(config.raw, dict) else None
    params = getattr(config, "param_offload", None)
    return (_stage3_refusals(_stage3_present([path for path, _ in config.stage3_keys], config.raw))
            + param_offload_problems(params, config.offload_device, zero, flag_offload))  # fmt: skip


_PARAM = "$.zero_optimization.offload_param"


def _param_settings(tree: dict) -> dict:
    """`offload_param` as checked ("auto" and bad values: DeepSpeed's defaults), with
    `cpu_offload_param: true` read as device cpu where offload_param names no device."""
    zero = tree["zero_optimization"]
    out = {key: OFFLOAD_PARAM[key].default if value == AUTO else value for key, value in zero["offload_param"].items()}
    if zero["cpu_offload_param"] is True and out["device"] == "none":
        out["device"] = "cpu"
    return out


def _optimizer_device(tree: dict) -> str:
    """offload_optimizer's device, `cpu_offload: true` read as cpu."""
    zero = tree["zero_optimization"]
    offload = zero["offload_optimizer"]
    return "cpu" if zero["cpu_offload"] is True and offload["device"] == "none" else offload["device"]


def param_offload_problems(settings: dict | None, optimizer_device: str, zero, flag_offload: bool = False) -> list:
    """The rules across `offload_param`'s keys, and with the optimizer's offload, at stage 3:
    (path, message) each. `settings` as `_param_settings` resolves them; `zero` the file's
    zero_optimization object as written (which keys it names)."""
    if not settings:
        return []
    zero = zero if isinstance(zero, dict) else {}
    section = zero.get("offload_param") if isinstance(zero.get("offload_param"), dict) else {}
    device, problems = settings["device"], []
    old_form = zero.get("cpu_offload_param") is True and section.get("device", "none") in ("none", AUTO)
    if zero.get("cpu_offload_param") is True and section.get("device") == "nvme":
        problems.append(("$.zero_optimization.cpu_offload_param", 'is the old form of offload_param.device = cpu, and '
                         'offload_param.device is "nvme"; keep one (DeepSpeed refuses the two together too)'))  # fmt: skip
    if device == "nvme" and not settings["nvme_path"]:
        problems.append((f"{_PARAM}.nvme_path", 'device "nvme" needs nvme_path: the folder for the parameter store '
                         f"(its files go under {PARAM_STORE}; the optimizer's nvme_path will do); add it, or use "
                         'device "cpu"'))  # fmt: skip
    if section.get("nvme_path") not in (None, AUTO) and device != "nvme":
        problems.append((f"{_PARAM}.nvme_path", f'is only used with device "nvme" (device is "{device}"); remove it, '
                         'or set offload_param.device to "nvme"'))  # fmt: skip
    if device == "none":
        return problems
    if settings["buffer_count"] < 2:
        problems.append((f"{_PARAM}.buffer_count", f"is {settings['buffer_count']}, and parameter offload needs at "
                         "least 2 gather buffers alive at once (the running unit's and the model's root unit's, "
                         "whose parameters are used around the others); write 2 or more (DeepSpeed's default: 5)"))  # fmt: skip
    if optimizer_device == "none" and not flag_offload:
        where = "$.zero_optimization.cpu_offload_param" if old_form else f"{_PARAM}.device"
        problems.append((where, f'puts the parameter shards in {"CPU RAM" if device == "cpu" else "files"}, but the '
                         "optimizer is not offloaded: its fp32 master weights and moments (12 bytes a parameter with "
                         "Adam, 3 to 6 times the parameters' own) and its gradient shard would stay in this process's "
                         "memory, which is what parameter offload frees, and the engine cannot step them there; set "
                         'zero_optimization.offload_optimizer.device to "cpu" or "nvme" (with its nvme_path), or add '
                         'offload to --sharded_ddp ("zero_dp_3 offload": the optimizer state in CPU RAM)'))  # fmt: skip
    return problems


def _stage3_refusals(present) -> list:
    return [(path, key.stage3_why) for path, key, value in present
            if key.at_stage3 == "refused" and not _one_of(value, key.stage3_given)]  # fmt: skip


def _stage3_present(paths: list, raw) -> list:
    """(path, Key, value) of each ZeRO-3 key at `paths` (`$.a.b`) in the file `raw`: its value as
    written, or "auto" as DeepSpeed reads it (its default; the sizes the Hugging Face integration
    fills from the model take effect either way)."""
    out = []
    for path in paths:
        key, value = TOP, raw
        for name in path.split(".")[1:]:
            key, value = (key.children if isinstance(key, Key) else key)[name], value[name]
        out.append((path, key, key.default if value == AUTO and isinstance(value, str) else value))
    return out


# stage 1-2 keys that do nothing at stage 3: what the engine does there instead
_NOT_AT_STAGE3 = {
    "reduce_bucket_size": "at stage 3 each unit's gradients are reduced as one bucket (the unit's flat buffer) once "
                          "its backward is done",
    "allgather_bucket_size": "at stage 3 each unit is gathered whole (its flat buffer) before its use, and ahead of it "
                             "as stage3_prefetch_bucket_size allows",
    "allgather_partitions": "a stage 1-2 setting: at stage 3 nothing is all-gathered after the step (each unit is "
                            "gathered before its use)",
}  # fmt: skip


def _stage3_notes(config: "OffloadConfig") -> list:
    """What each ZeRO-3 key, and each stage 1-2 key, does at stage 3: (role, path, why) notes."""
    notes = []
    for path, key, value in _stage3_present([path for path, _ in config.stage3_keys], config.raw):
        if key.kind == "object":  # offload_param: its keys decide
            continue
        if _one_of(value, key.stage3_given):
            refusing = key.at_stage3 == "refused"  # its why is the refusal: say what this value is
            notes.append(("given", path, f"{key.help}: {_describe(value)} is what the engine does" if refusing
                          else key.stage3_why))  # fmt: skip
        elif key.at_stage3 in ("ignored", "given"):
            notes.append((key.at_stage3, path, key.stage3_why))
    zero = config.raw.get("zero_optimization", {}) if isinstance(config.raw, dict) else {}
    notes += _param_offload_notes(getattr(config, "param_offload", None), zero)
    notes += [("ignored", f"$.zero_optimization.{key}", why) for key, why in _NOT_AT_STAGE3.items() if key in zero]
    if zero.get("overlap_comm") is False:
        notes.append(("ignored", "$.zero_optimization.overlap_comm", "false applies to stage 2; at stage 3 each unit's "
                      "gradients are reduced as soon as its backward is done"))  # fmt: skip
    if "disable_allgather" in config.raw:
        notes.append(("ignored", "$.disable_allgather", "a stage 1-2 setting: at stage 3 nothing is all-gathered after "
                      "the step"))  # fmt: skip
    return notes


def _param_offload_notes(settings: dict | None, zero: dict) -> list:
    """The `offload_param` keys its device leaves unused at stage 3, ignored with a warning: all of
    them with device none, max_in_cpu with device cpu (nvme_path is a problem: param_offload_problems)."""
    section = zero.get("offload_param") if isinstance(zero.get("offload_param"), dict) else {}
    device = (settings or {}).get("device", "none")
    if device == "none":
        why = "offload_param.device is none: the parameter shards stay in this process's memory"
        return [("ignored", f"{_PARAM}.{key}", why) for key in section if key not in ("device", "nvme_path")]
    if device == "cpu" and "max_in_cpu" in section:
        return [("ignored", f"{_PARAM}.max_in_cpu", "device cpu keeps every parameter shard in CPU RAM")]
    return []


def stage_notes(config: "OffloadConfig", stage, world_size: int = 1, precision: str | None = None) -> list:
    """Keys that mean something only at other ZeRO stages: (role, path, why) notes, ignored with a
    warning, as DeepSpeed ignores them. `stage` as for `run_stage`; `precision` the run's, if known."""
    stage = run_stage(config, stage, world_size)
    if stage == 3:
        return _stage3_notes(config)
    zero = config.raw.get("zero_optimization", {}) if isinstance(config.raw, dict) else {}
    at = f"stage {stage}" if stage else "a run without sharding (stage 0, no offload)"
    sections = [path for path, _ in config.stage3_keys]  # a section's keys go in its own line
    notes = [("ignored", path, f"{why}; not used in {at}") for path, why in config.stage3_keys
             if not any(path.startswith(f"{other}.") for other in sections)]  # fmt: skip
    if stage is None:
        for key in ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm"):
            if key in zero:
                notes.append(("ignored", f"$.zero_optimization.{key}", f"applies to sharding; not used in {at}"))
    if stage == 1 and zero.get("overlap_comm") is False:
        notes.append(("ignored", "$.zero_optimization.overlap_comm", "false applies to stage 2; at stage 1 DDP "
                      "reduces the gradients and always overlaps"))  # fmt: skip
    gather, reduce = zero.get("allgather_bucket_size"), zero.get("reduce_bucket_size")
    if stage == 2 and _explicit(gather) and gather != reduce:
        notes.append(("ignored", "$.zero_optimization.allgather_bucket_size", "stage 2 all-gathers the buckets it "
                      "reduced, of reduce_bucket_size elements"))  # fmt: skip
    fp16 = [k for k in TOP["fp16"].children if k != "enabled" and k in config.raw.get("fp16", {})]
    if stage is None and fp16 and (precision == "fp16" or config.precision == "fp16"):
        notes.append(("ignored", "$.fp16", f"{', '.join(fp16)}: DeepSpeed's loss scaling is the sharded optimizer's; "
                      f"in {at} the Trainer's GradScaler scales the loss (torch's defaults)"))  # fmt: skip
    return notes


def _explicit(value) -> bool:
    return value is not None and value != AUTO


def _fp16_notes(tree: dict, data) -> list:
    """A fp16 section whose settings go unused: fp16 is off (written so, or "auto" in a run
    without --fp16)."""
    section = data.get("fp16") if isinstance(data, dict) else None
    settings = [k for k in (section or {}) if k != "enabled" and k in TOP["fp16"].children]
    if tree["fp16"]["enabled"] is False and settings:
        return [("ignored", "$.fp16", f"{', '.join(settings)}: loss-scale settings, and fp16 is off in this run")]
    return []


def _against_training_args(tree: dict, args, world_size: int, problems: list) -> None:
    """Fill "auto" from the TrainingArguments; report explicit values that contradict them."""
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    pairs = [
        ("$.train_micro_batch_size_per_gpu", tree, "train_micro_batch_size_per_gpu", micro, "--per_device_train_batch_size"),
        ("$.gradient_accumulation_steps", tree, "gradient_accumulation_steps", accumulation, "--gradient_accumulation_steps"),
        ("$.train_batch_size", tree, "train_batch_size", micro * accumulation * world_size,
         "--per_device_train_batch_size x --gradient_accumulation_steps x world size"),
        ("$.gradient_clipping", tree, "gradient_clipping", args.max_grad_norm, "--max_grad_norm"),
        ("$.fp16.enabled", tree["fp16"], "enabled", bool(args.fp16), "--fp16"),
        ("$.bf16.enabled", tree["bf16"], "enabled", bool(args.bf16), "--bf16"),
        ("$.optimizer.params.lr", tree["optimizer"]["params"], "lr", args.learning_rate, "--learning_rate"),
        ("$.optimizer.params.betas", tree["optimizer"]["params"], "betas", [args.adam_beta1, args.adam_beta2],
         "--adam_beta1/--adam_beta2"),
        ("$.optimizer.params.eps", tree["optimizer"]["params"], "eps", args.adam_epsilon, "--adam_epsilon"),
        ("$.optimizer.params.weight_decay", tree["optimizer"]["params"], "weight_decay", args.weight_decay, "--weight_decay"),
        ("$.scheduler.params.warmup_max_lr", tree["scheduler"]["params"], "warmup_max_lr", args.learning_rate, "--learning_rate"),
        ("$.checkpoint.use_node_local_storage", tree["checkpoint"], "use_node_local_storage",
         bool(getattr(args, "save_on_each_node", False)), "--save_on_each_node"),
    ]  # fmt: skip
    # "auto", and any value against a ratio of the training steps, are resolved when the steps are known (apply.py)
    if not warmup_is_ratio(args) and tree["scheduler"]["params"]["warmup_num_steps"] != AUTO:
        pairs.append(("$.scheduler.params.warmup_num_steps", tree["scheduler"]["params"], "warmup_num_steps",
                      int(args.warmup_steps), "--warmup_steps"))  # fmt: skip
    for path, holder, key, theirs, flag in pairs:
        mine = holder[key]
        if mine == AUTO:
            holder[key] = theirs
        elif mine is not None and _differs(mine, theirs) and not _unset_flag(flag, theirs):
            problems.append((path, f"is {_describe(mine)} but {flag} is {_describe(theirs)}; make them agree, or write \"auto\""))
    if tree["fp16"]["enabled"] is True and tree["bf16"]["enabled"] is True:  # one from the file, one from a flag
        written = "fp16" if tree["bf16"]["enabled"] is True and args.bf16 else "bf16"
        problems.append((f"$.{written}.enabled", f"is true but the run asks for --{'bf16' if written == 'fp16' else 'fp16'}; "
                         f"enable one: drop the flag, or set {written}.enabled to \"auto\""))  # fmt: skip
    if tree["scheduler"]["params"]["warmup_min_lr"] == AUTO:
        tree["scheduler"]["params"]["warmup_min_lr"] = 0.0


def warmup_is_ratio(args) -> bool:
    """Whether the run's warmup is a ratio of its training steps: `--warmup_steps` below 1 (as in
    transformers 5), or `--warmup_ratio` where the TrainingArguments still have it."""
    steps = getattr(args, "warmup_steps", 0) or 0
    return 0 < steps < 1 or (steps == 0 and (getattr(args, "warmup_ratio", 0) or 0) > 0)


def _differs(a, b) -> bool:
    if isinstance(a, list) or isinstance(b, list):
        return any(_differs(x, y) for x, y in zip(a, b))
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return not math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a != b


def _unset_flag(flag: str, theirs) -> bool:
    """A precision flag left off does not contradict a config that turns the precision on."""
    return flag in ("--fp16", "--bf16") and theirs is False


def _build(tree: dict, raw: dict) -> OffloadConfig:
    zero, offload, fp16 = tree["zero_optimization"], tree["zero_optimization"]["offload_optimizer"], tree["fp16"]
    device, param = _optimizer_device(tree), _param_settings(tree)
    precision = "fp16" if fp16["enabled"] is True else "bf16" if tree["bf16"]["enabled"] is True else "fp32"
    if precision == "fp32" and AUTO in (fp16["enabled"], tree["bf16"]["enabled"]):
        precision = AUTO  # from --fp16/--bf16 at start
    sections = {name: tree[name] if name in raw else None for name in ("optimizer", "scheduler")}

    def concrete(value):
        return None if value == AUTO else value

    def bucket(key):
        return None if zero[key] == AUTO else zero[key]

    return OffloadConfig(
        stage=zero["stage"], offload_device=device, nvme_path=_folder(offload["nvme_path"]),
        pin_memory=offload["pin_memory"], buffer_count=offload["buffer_count"],
        reduce_bucket_size=bucket("reduce_bucket_size"), allgather_bucket_size=bucket("allgather_bucket_size"),
        overlap_comm=zero["overlap_comm"],
        optimizer=sections["optimizer"], scheduler=sections["scheduler"],
        gradient_clipping=concrete(tree["gradient_clipping"]), precision=precision,
        loss_scale=fp16["loss_scale"], initial_scale_power=fp16["initial_scale_power"],
        loss_scale_window=fp16["loss_scale_window"], min_loss_scale=fp16["min_loss_scale"],
        grad_accum_dtype=tree["data_types"]["grad_accum_dtype"],
        micro_batch_size=concrete(tree["train_micro_batch_size_per_gpu"]),
        gradient_accumulation_steps=concrete(tree["gradient_accumulation_steps"]),
        train_batch_size=concrete(tree["train_batch_size"]), raw=raw,
        inference=dict(tree["inference"]) if isinstance(raw, dict) and "inference" in raw else None,
        max_memory=tree["max_memory"], hysteresis=fp16["hysteresis"],
        consecutive_hysteresis=fp16["consecutive_hysteresis"], communication_data_type=tree["communication_data_type"],
        param_offload={**param, "nvme_path": _folder(param["nvme_path"])},
    )  # fmt: skip


def _folder(path: str | None) -> str | None:
    """A folder named in the config as an absolute path, resolved once, here: `~` expanded, and a
    relative path taken from the working folder of the validation, whatever folder a rank or the
    store is in when it opens the files (validate-config shows the result)."""
    return None if path is None else os.path.abspath(os.path.expanduser(path))
