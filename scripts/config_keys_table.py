"""Print the "Every key" table of configs/README.md from the config schema, so the two cannot drift
(tests/test_config.py checks the README holds exactly this table).

    .venv/bin/python scripts/config_keys_table.py            # the table, in markdown
    .venv/bin/python scripts/config_keys_table.py --counts   # keys per decision
"""

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer_shard.config.schema import AUTO, TOP  # noqa: E402

DECISIONS = {
    "effect": "takes effect",
    "given": "as the engine does",
    "ignored": "ignored, one warning",
    "stage3": "ZeRO-3: refused at stage 3 (not in this release), ignored with a warning at 0-2",
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


def _decision(key) -> str:
    text = DECISIONS[key.role]
    if key.role == "given":
        text += ": " + " or ".join(dict.fromkeys(f"`{_json(c)}`" for c in key.choices))
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
        default = "" if key.default is None or key.role != "effect" else f"`{_json(key.default)}`"
        if key.default == AUTO:
            default = '`"auto"`'
        lines.append(f"| `{path}` | {_decision(key)} | {_type(key) if key.role == 'effect' else ''} | {default} | "
                     f"{_range(key)} | {key.help} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def counts() -> Counter:
    """Keys per decision; an object that takes effect counts through its keys, not itself."""
    return Counter(key.role for _, key in rows() if not (key.kind == "object" and key.role == "effect"))


if __name__ == "__main__":
    if "--counts" in sys.argv[1:]:
        for role, n in counts().most_common():
            print(f"{DECISIONS[role].split(':')[0]}: {n}")
    else:
        print(table(), end="")
