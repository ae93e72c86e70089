"""Reading data files: layouts, truncation, and an error naming the file for every bad input."""

import json

import pytest

from trainer_shard import DataError
from trainer_shard.data import TokenizedSeq2SeqDataset, read_jsonl, read_split


def write_split(folder, split, sources, targets):
    (folder / f"{split}.source").write_text("".join(s + "\n" for s in sources), encoding="utf-8")
    (folder / f"{split}.target").write_text("".join(t + "\n" for t in targets), encoding="utf-8")


def test_n_obs_truncates(tmp_path):
    write_split(tmp_path, "train", ["a", "b", "c"], ["x", "y", "z"])
    assert read_split(tmp_path, "train", n_obs=2).sources == ["a", "b"]
    assert len(read_split(tmp_path, "train", n_obs=-1)) == 3


def test_missing_file_is_named(tmp_path):
    (tmp_path / "train.source").write_text("a\n")
    with pytest.raises(DataError, match="train.target' does not exist"):
        read_split(tmp_path, "train")


def test_ragged_pair_is_named(tmp_path):
    write_split(tmp_path, "val", ["a", "b", "c"], ["x", "y"])
    with pytest.raises(DataError, match="val.source' has 3 lines but .*val.target' has 2"):
        read_split(tmp_path, "val")


def test_empty_file_is_named(tmp_path):
    (tmp_path / "test.source").write_text("")
    (tmp_path / "test.target").write_text("x\n")
    with pytest.raises(DataError, match="test.source' is empty"):
        read_split(tmp_path, "test")


def test_invalid_utf8_names_file_and_line(tmp_path):
    (tmp_path / "train.source").write_bytes(b"ok\nbad \xff byte\n")
    (tmp_path / "train.target").write_text("x\ny\n")
    with pytest.raises(DataError, match="train.source' is not valid UTF-8: byte 0xff at line 2"):
        read_split(tmp_path, "train")


def test_diacritics_and_crlf_round_trip(tmp_path):
    targets = ["două sute treizeci și patru", "Țară înșiși îngheț"]
    (tmp_path / "train.source").write_bytes(b"two hundred thirty-four\r\nland\r\n")
    (tmp_path / "train.target").write_text("\n".join(targets) + "\n", encoding="utf-8")
    pairs = read_split(tmp_path, "train")
    assert pairs.sources == ["two hundred thirty-four", "land"] and pairs.targets == targets


def test_diacritics_survive_tokenization(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    write_split(tmp_path, "train", ["x"], ["două sute și patruzeci, țară"])
    dataset = TokenizedSeq2SeqDataset(
        read_split(tmp_path, "train"), tokenizer, max_source_length=16, max_target_length=64
    )
    decoded = tokenizer.decode(dataset[0]["labels"], skip_special_tokens=True).strip()
    assert decoded == "două sute și patruzeci, țară"


def test_long_lines_are_truncated(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    write_split(tmp_path, "train", [" ".join(["one hundred"] * 500)], ["o sută"])
    dataset = TokenizedSeq2SeqDataset(
        read_split(tmp_path, "train"), tokenizer, max_source_length=12, max_target_length=8, prefix="p: "
    )
    assert len(dataset[0]["input_ids"]) == 12 and dataset[0]["input_ids"][-1] == tokenizer.eos_token_id


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def test_jsonl_layouts(tmp_path):
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [{"source": "one", "target": "unu"}, {"translation": {"en": "two", "ro": "doi"}}])
    pairs = read_jsonl(path, "translation_en_to_ro", "en", "ro")
    assert pairs.sources == ["one", "two"] and pairs.targets == ["unu", "doi"]
    write_jsonl(path, [{"text": "long text", "summary": "short"}])
    assert read_jsonl(path, "summarization").targets == ["short"]


def test_jsonl_bad_line_is_named(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text('{"source": "a", "target": "b"}\n{"src": "a"}\n')
    with pytest.raises(DataError, match="val.jsonl' line 2 has keys \\['src'\\]; expected"):
        read_jsonl(path, "translation_en_to_ro", "en", "ro")
    path.write_text('{"source": "a", "target": "b"}\nnot json\n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        read_jsonl(path, "summarization")
