"""Print the "Every key" table of configs/README.md from the config schema, so the two cannot drift
(tests/test_config.py checks the README holds exactly this table).

    .venv/bin/python scripts/config_keys_table.py            # the table, in markdown
    .venv/bin/python scripts/config_keys_table.py --counts   # keys per decision (ZeRO-3 keys: at stage 3 too)
"""

import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer_shard.config.schema import AUTO, TOP  # noqa: E402

DECISIONS = {
    "effect": "takes effect",
    "given": "as the engine does",
    "ignored": "ignored, one warning",
    "stage3": "ZeRO-3",
    "refused": "refused",
}


def rows(spec: dict = TOP, prefix: str = ""):
    """(path, Key) for every key, depth first, in the schema's order."""
    for name, key in spec.items():
        path = f"{prefix}.{name}" if prefix else name
        yield path, key
        yield from rows(key.children, path)


def _type(key) -> str:
    kinds = {"floats": f"list of {key.length} numbers", "strs": "list of str", "memory": "`{device: size}`",
             "device_map": "strategy or `{module: device}`", "any": "any"}  # fmt: skip
    text = kinds.get(key.kind, key.kind)
    if key.kind == "choice":
        text = " \\| ".join(f"`{c}`" for c in key.choices)
    return text + (' or `"auto"`' if key.auto else "")


def _values(values) -> str:
    return " or ".join(dict.fromkeys(f"`{_json(c)}`" for c in values))


def _decision(key) -> str:
    text = DECISIONS[key.role]
    if key.role == "given":
        text += ": " + _values(key.choices)
    if key.role == "stage3" and key.at_stage3 == "ignored" and not key.stage3_given:
        text += ": ignored, one warning, at every stage"
    elif key.role == "stage3":
        text += f": at stage 3 {_at_stage3(key)}; at 0-2 ignored, one warning"
    return text


def _at_stage3(key) -> str:
    if key.kind == "object":
        return "as its keys decide"
    text = DECISIONS[key.at_stage3]
    if key.at_stage3 == "given":
        text += " (a value that contradicts the model is refused)"
    if key.stage3_given:
        values = " or ".join(f"`{json.dumps(v) if isinstance(v, str) else _json(v)}`" for v in key.stage3_given)
        text = f"{values} as the engine does, other values {text}"
    return text


def _json(value) -> str:
    if value is None or isinstance(value, bool):
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _range(key) -> str:
    parts = []
    if key.minimum is not None:
        parts.append(f"{'>' if key.exclusive_minimum else '>='} {_json(key.minimum)}")
    if key.maximum is not None:
        parts.append(f"<= {_json(key.maximum)}")
    return ", ".join(parts)


def table() -> str:
    lines = ["| key | decision | type | default | range | meaning, or why |", "|---|---|---|---|---|---|"]
    for path, key in rows():
        typed = key.role == "effect" or (key.role == "stage3" and key.kind != "any")
        default = "" if key.default is None or not typed else f"`{_json(key.default)}`"
        if key.default == AUTO:
            default = '`"auto"`'
        why = key.help + (f". At stage 3: {key.stage3_why}" if key.role == "stage3" and key.kind != "object" else "")
        lines.append(f"| `{path}` | {_decision(key)} | {_type(key) if typed else ''} | {default} | "
                     f"{_range(key)} | {why} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def counts() -> Counter:
    """Keys per decision; an object that takes effect counts through its keys, not itself."""
    return Counter(key.role for _, key in rows() if not (key.kind == "object" and key.role in ("effect", "stage3")))


def stage3_counts() -> Counter:
    """The ZeRO-3 keys per decision at stage 3 (for a value outside the ones the engine does)."""
    return Counter(key.at_stage3 for _, key in rows() if key.role == "stage3" and key.kind != "object")


if __name__ == "__main__":
    if "--counts" in sys.argv[1:]:
        for role, n in counts().most_common():
            print(f"{DECISIONS[role]}: {n}")
        for role, n in stage3_counts().most_common():
            print(f"  ZeRO-3 keys at stage 3, {DECISIONS[role]}: {n}")
    else:
        print(table(), end="")
