"""Seq2seq data: the classic `{split}.source` / `{split}.target` layout, or JSON-lines files.

    data_dir/train.source   one source text per line (UTF-8)
    data_dir/train.target   its target on the same line number
    (and val.*, test.*)

JSON lines, one object a line: {"source": ..., "target": ...}; for translation also
{"translation": {"en": ..., "ro": ...}} (keys from --src_lang/--tgt_lang); for summarization
also {"text"|"document"|"article": ..., "summary"|"highlights": ...}.

Every file is checked when read: a missing, empty or non-UTF-8 file, a source/target pair of
different lengths, or a JSON line without the expected keys raises `DataError` naming the file,
the line and the fix. Texts longer than max_source_length / max_target_length tokens are
truncated, as in the classic script (documented in the README): the end-of-sequence token is
kept, and `finetune.tokenize_splits` logs a warning with how many texts of each split reached
the limit, so a cut that drops most of the data does not go unnoticed.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from torch.utils.data import Dataset

from .errors import DataError

SPLITS = ("train", "val", "test")
_SUMMARY_SOURCE_KEYS = ("text", "document", "article")
_SUMMARY_TARGET_KEYS = ("summary", "highlights")


@dataclass
class Pairs:
    """Parallel lists of source and target texts, with where they came from."""

    sources: list
    targets: list
    origin: str

    def __len__(self):
        return len(self.sources)


def read_lines(path) -> list:
    """The lines of a UTF-8 text file, without their line endings."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {str(path)!r} does not exist; check --data_dir (or the --*_file flags)")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DataError(
            f"data file {str(path)!r} is not valid UTF-8: byte 0x{raw[e.start]:02x} at line {line} "
            f"(byte offset {e.start}); re-encode the file as UTF-8"
        ) from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise DataError(f"data file {str(path)!r} is empty; it needs one example per line")
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_split(data_dir, split: str, n_obs: int | None = None) -> Pairs:
    """`{split}.source` and `{split}.target` of `data_dir`, the first `n_obs` pairs."""
    data_dir = Path(data_dir)
    source_path, target_path = data_dir / f"{split}.source", data_dir / f"{split}.target"
    sources, targets = read_lines(source_path), read_lines(target_path)
    if len(sources) != len(targets):
        longer, shorter = (source_path, "target") if len(sources) > len(targets) else (target_path, "source")
        raise DataError(
            f"{str(source_path)!r} has {len(sources)} lines but {str(target_path)!r} has {len(targets)}: "
            f"line {min(len(sources), len(targets)) + 1} of {longer.name} has no {shorter}; each source line needs "
            "its target on the same line number"
        )
    return _truncate(Pairs(sources, targets, str(source_path)), n_obs)


def read_jsonl(path, task: str, src_lang: str | None = None, tgt_lang: str | None = None, n_obs=None) -> Pairs:
    """A JSON-lines file of examples; see the module docstring for the accepted keys."""
    sources, targets = [], []
    for number, line in enumerate(read_lines(path), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{str(path)!r} line {number} is not valid JSON ({e.msg}); one JSON object a line") from None
        except (ValueError, RecursionError):  # an integer of more than 4,300 digits; lists nested too deep
            raise DataError(f"{str(path)!r} line {number} holds a number too long or lists nested too deep to read; "
                            "one JSON object a line") from None  # fmt: skip
        source, target = _pair_from_record(record, task, src_lang, tgt_lang)
        if source is None:
            raise DataError(
                f"{str(path)!r} line {number} has {_keys(record)}; expected {_expected_keys(task, src_lang, tgt_lang)}"
            )
        sources.append(source)
        targets.append(target)
    if not sources:
        raise DataError(f"data file {str(path)!r} holds no examples")
    return _truncate(Pairs(sources, targets, str(path)), n_obs)


def _pair_from_record(record, task, src_lang, tgt_lang):
    if not isinstance(record, dict):
        return None, None
    if isinstance(record.get("source"), str) and isinstance(record.get("target"), str):
        return record["source"], record["target"]
    translation = record.get("translation")
    if isinstance(translation, dict) and src_lang and tgt_lang:
        source, target = translation.get(src_lang), translation.get(tgt_lang)
        if isinstance(source, str) and isinstance(target, str):
            return source, target
    if task.startswith("summarization"):
        source = next((record[k] for k in _SUMMARY_SOURCE_KEYS if isinstance(record.get(k), str)), None)
        target = next((record[k] for k in _SUMMARY_TARGET_KEYS if isinstance(record.get(k), str)), None)
        if source is not None and target is not None:
            return source, target
    return None, None


def _keys(record) -> str:
    """`keys ['src', 'tgt']`, at most five, each cut to 30 characters; or what the line holds instead."""
    if not isinstance(record, dict):
        kind = {str: "string", list: "list", bool: "true/false", type(None): "null"}.get(type(record), "number")
        return f"a JSON {kind}, not an object"
    keys = [key if len(key) <= 30 else key[:27] + "..." for key in sorted(record)[:5]]
    return f"keys {keys}" + (f" and {len(record) - 5} more" if len(record) > 5 else "")


def _expected_keys(task, src_lang, tgt_lang) -> str:
    options = ['{"source": ..., "target": ...}']
    if src_lang and tgt_lang:
        options.append(f'{{"translation": {{"{src_lang}": ..., "{tgt_lang}": ...}}}}')
    if task.startswith("summarization"):
        options.append('{"text": ..., "summary": ...}')
    return " or ".join(options)


def _truncate(pairs: Pairs, n_obs) -> Pairs:
    if n_obs is None or n_obs < 0:
        return pairs
    return Pairs(pairs.sources[:n_obs], pairs.targets[:n_obs], pairs.origin)


class TokenizedSeq2SeqDataset(Dataset):
    """Pairs tokenized once up front: items are `{"input_ids": [...], "labels": [...]}`.

    Padding and `decoder_input_ids` are the collator's job (`DataCollatorForSeq2Seq`).
    """

    def __init__(self, pairs: Pairs, tokenizer, *, max_source_length: int, max_target_length: int, prefix: str = ""):
        self.pairs = pairs
        self.max_source_length, self.max_target_length = max_source_length, max_target_length
        sources = [prefix + s for s in pairs.sources]
        self.input_ids = tokenizer(sources, max_length=max_source_length, truncation=True)["input_ids"]
        self.labels = tokenizer(text_target=pairs.targets, max_length=max_target_length, truncation=True)["input_ids"]

    def at_limit(self) -> tuple[int, int]:
        """(sources, targets) whose tokens reached max_source_length / max_target_length.

        Every longer text was cut there; one exactly that long is counted too (it cannot be told
        apart after tokenization)."""
        sources = sum(len(ids) >= self.max_source_length for ids in self.input_ids)
        targets = sum(len(ids) >= self.max_target_length for ids in self.labels)
        return sources, targets

    def __len__(self):
        return len(self.input_ids)

    def __getitem__(self, i):
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}
