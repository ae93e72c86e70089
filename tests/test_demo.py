"""Tests for the embedded demo data set and model (``trainer_shard.demo``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainer_shard.demo import (
    SPLITS,
    build_demo_model,
    build_demo_model_main,
    make_demo_data,
    make_demo_data_main,
)

SIZES = {"train": 300, "val": 20, "test": 30}
FILES = [f"{split}.{side}" for split in SPLITS for side in ("source", "target")]
SMALL_MODEL = dict(vocab_size=300, d_model=32, d_ff=64, num_layers=1, num_heads=2, d_kv=16)
DIACRITIC_TEXTS = ["două sute treizeci și patru", "Țară, înșiși"]


def _make(out: Path, **kwargs) -> Path:
    return make_demo_data(
        out, n_train=SIZES["train"], n_val=SIZES["val"], n_test=SIZES["test"], **kwargs
    )


def _lines(path: Path) -> list[str]:
    return path.read_bytes().decode("utf-8").split("\n")[:-1]


@pytest.fixture(scope="module")
def demo_dirs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("demo")
    data = _make(root / "data")
    model = build_demo_model(data, root / "model", **SMALL_MODEL)
    return data, model


def test_data_is_deterministic(tmp_path: Path) -> None:
    first, second = _make(tmp_path / "a", seed=3), _make(tmp_path / "b", seed=3)
    for name in FILES:
        assert (first / name).read_bytes() == (second / name).read_bytes()
    other = _make(tmp_path / "c", seed=4)
    assert (other / "train.source").read_bytes() != (first / "train.source").read_bytes()


def test_split_sizes_and_disjoint(demo_dirs) -> None:
    data, _ = demo_dirs
    sources = {}
    for split in SPLITS:
        raw_src = (data / f"{split}.source").read_bytes()
        raw_tgt = (data / f"{split}.target").read_bytes()
        for raw in (raw_src, raw_tgt):
            assert raw.endswith(b"\n") and not raw.endswith(b"\n\n")
            assert b"\r" not in raw
        src, tgt = _lines(data / f"{split}.source"), _lines(data / f"{split}.target")
        assert len(src) == len(tgt) == SIZES[split]
        assert all(line.strip() for line in src + tgt)
        sources[split] = set(src)
        assert len(sources[split]) == SIZES[split]
    assert not sources["train"] & sources["val"]
    assert not sources["train"] & sources["test"]
    assert not sources["val"] & sources["test"]


def test_targets_are_romanian_with_diacritics(demo_dirs) -> None:
    data, _ = demo_dirs
    targets = (data / "train.target").read_bytes().decode("utf-8")  # strict UTF-8
    assert any(ch in targets for ch in "ășțî")
    assert "și" in targets
    assert "thousand" in (data / "train.source").read_text(encoding="utf-8")


def test_impossible_size_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="distinct numbers"):
        make_demo_data(tmp_path, n_train=90, n_val=10, n_test=5, max_number=99)
    with pytest.raises(ValueError):
        make_demo_data(tmp_path, n_train=-1)
    # the whole range fits exactly
    make_demo_data(tmp_path, n_train=90, n_val=5, n_test=5, max_number=99)


def test_tokenizer_roundtrip_after_reload(demo_dirs) -> None:
    from transformers import AutoTokenizer

    _, model_dir = demo_dirs
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    for text in DIACRITIC_TEXTS:
        ids = tok(text).input_ids
        assert ids[-1] == tok.eos_token_id and ids.count(tok.eos_token_id) == 1
        assert tok.decode(ids, skip_special_tokens=True).strip() == text


def test_tokenizer_reload_gives_identical_ids(demo_dirs, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    data, model_dir = demo_dirs
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    texts = _lines(data / "val.target") + _lines(data / "val.source") + DIACRITIC_TEXTS
    assert tok(texts).input_ids == again(texts).input_ids


def test_model_reload_and_loss(demo_dirs) -> None:
    import torch
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    data, model_dir = demo_dirs
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    config = model.config
    assert config.vocab_size == len(tok) and config.d_model == SMALL_MODEL["d_model"]
    assert (config.pad_token_id, config.eos_token_id, config.decoder_start_token_id) == (0, 1, 0)
    params = config.task_specific_params["translation_en_to_ro"]
    assert params["prefix"] == "translate English to Romanian: "

    again = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    state, state2 = model.state_dict(), again.state_dict()
    assert state.keys() == state2.keys()
    assert all(torch.equal(state[k], state2[k]) for k in state)

    sources = [params["prefix"] + s for s in _lines(data / "val.source")[:4]]
    batch = tok(sources, text_target=_lines(data / "val.target")[:4], padding=True,
                return_tensors="pt")
    batch["labels"][batch["labels"] == tok.pad_token_id] = -100
    loss = model(**batch).loss
    assert torch.isfinite(loss) and loss.item() > 0


def test_model_build_is_deterministic(demo_dirs, tmp_path: Path) -> None:
    data, model_dir = demo_dirs
    again = build_demo_model(data, tmp_path, **SMALL_MODEL)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes()


def test_cli(tmp_path: Path, capsys) -> None:
    data, model = tmp_path / "data", tmp_path / "model"
    assert make_demo_data_main(
        ["--out_dir", str(data), "--n_train", "50", "--n_val", "5", "--n_test", "5"]
    ) == 0
    assert len(_lines(data / "val.target")) == 5
    flags = [f"--{k}={v}" for k, v in SMALL_MODEL.items()]
    assert build_demo_model_main(
        ["--data_dir", str(data), "--out_dir", str(model), *flags, "--num_decoder_layers", "2"]
    ) == 0
    assert "params=" in capsys.readouterr().out
    assert (model / "model.safetensors").is_file() and (model / "tokenizer.json").is_file()
