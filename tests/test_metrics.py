"""The shipped evaluate metric module and compute_metrics, offline."""

import numpy as np
import pytest
from transformers import EvalPrediction

from trainer_shard.metrics import build_compute_metrics, load_seq2seq_metric


def test_metric_module_loads_offline_and_scores():
    metric = load_seq2seq_metric("translation_en_to_ro")
    refs = ["două sute treizeci și patru de mii", "o sută cincizeci și unu de mii"]
    perfect = metric.compute(predictions=refs, references=refs)
    assert perfect["bleu"] == pytest.approx(100.0) and perfect["chrf"] == pytest.approx(100.0)
    worse = metric.compute(predictions=["două sute", "o sută"], references=refs)
    assert worse["bleu"] < 50 and worse["chrf"] < perfect["chrf"]


def test_compute_metrics_decodes_ignored_labels(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    texts = ["două sute treizeci și patru de mii", "o sută"]
    ids = tokenizer(texts, padding=True, return_tensors="np")["input_ids"]
    labels = np.where(ids == tokenizer.pad_token_id, -100, ids)
    preds = np.concatenate([np.zeros((2, 1), dtype=ids.dtype), ids], axis=1)  # decoder start + text
    metrics = build_compute_metrics(tokenizer, "translation_en_to_ro")(EvalPrediction(preds, labels))
    assert metrics["bleu"] == pytest.approx(100.0)
    expected_len = np.count_nonzero(ids != tokenizer.pad_token_id, axis=1).mean()
    assert metrics["gen_len"] == pytest.approx(expected_len)


def test_generated_lengths_stop_at_first_eos():
    from trainer_shard.metrics import generated_lengths

    # decoder start 0, text, eos 1, then beam search's eos padding or pad padding
    preds = np.array([[0, 5, 6, 1, 1, 1], [0, 5, 6, 7, 8, 1], [0, 5, 1, 0, 0, 0], [0, 5, 6, 7, 8, 9]])
    assert generated_lengths(preds, pad_id=0, eos_id=1).tolist() == [3, 5, 2, 5]


def test_summarization_adds_rouge_when_installed():
    metric = load_seq2seq_metric("summarization")
    texts = ["the cat sat on the mat today", "a dog ran in the park"]
    result = metric.compute(predictions=texts, references=texts)
    assert result["bleu"] == pytest.approx(100.0)
    try:
        import rouge_score  # noqa: F401
    except ImportError:
        assert "rouge1" not in result  # optional dependency: left out, not faked
    else:
        assert result["rouge1"] == pytest.approx(100.0) and result["rougeLsum"] == pytest.approx(100.0)
