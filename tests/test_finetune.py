"""The script's set-up helpers: freezing, JSON-lines splits, the loss padding rule."""

import json

import pytest
from transformers import AutoModelForSeq2SeqLM

from trainer_shard import DataError
from trainer_shard.finetune import count_parameters, freeze_params, load_pairs, parse_args


def test_freeze_encoder_and_embeds(tiny_model):
    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model)
    total, trainable = count_parameters(model)
    assert total == trainable
    freeze_params(model, encoder=True, embeds=False)
    assert not any(p.requires_grad for p in model.get_encoder().parameters())
    assert any(p.requires_grad for p in model.get_decoder().parameters())
    freeze_params(model, encoder=False, embeds=True)
    assert not model.shared.weight.requires_grad
    assert not model.decoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.requires_grad
    assert 0 < count_parameters(model)[1] < total


def test_jsonl_files_instead_of_data_dir(tmp_path):
    for split in ("train", "val"):
        lines = [{"translation": {"en": f"{split} {i}", "ro": f"{split} ro {i}"}} for i in range(5)]
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    _, data_args, training_args = parse_args(
        ["--model_name_or_path", "m", "--output_dir", str(tmp_path / "o"), "--use_cpu", "--do_train", "--do_eval",
         "--task", "translation_en_to_ro", "--train_file", str(tmp_path / "train.jsonl"),
         "--validation_file", str(tmp_path / "val.jsonl"), "--n_train", "3"]  # fmt: skip
    )
    pairs = load_pairs(data_args, training_args)
    assert pairs["train"].sources == ["train 0", "train 1", "train 2"] and len(pairs["val"]) == 5
    assert pairs["val"].targets[0] == "val ro 0"


def test_missing_split_in_data_dir_is_named(tmp_path):
    _, data_args, training_args = parse_args(
        ["--model_name_or_path", "m", "--output_dir", str(tmp_path / "o"), "--use_cpu", "--do_train",
         "--data_dir", str(tmp_path)]  # fmt: skip
    )
    with pytest.raises(DataError, match="train.source' does not exist"):
        load_pairs(data_args, training_args)
