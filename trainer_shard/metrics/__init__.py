"""Generation metrics for the seq2seq script: BLEU/chrF (sacrebleu), ROUGE, gen_len."""

from pathlib import Path

import numpy as np

METRIC_MODULE = Path(__file__).with_name("seq2seq_metrics.py")


def metric_config_for_task(task: str) -> str:
    return "summarization" if task.startswith("summarization") else "translation"


def load_seq2seq_metric(task: str = "translation"):
    """The shipped `evaluate` module, loaded by path (no hub access), kept in memory.

    In memory, so ranks that compute the metric at the same time share no cache file.
    """
    import evaluate

    return evaluate.load(str(METRIC_MODULE), metric_config_for_task(task), keep_in_memory=True)


def build_compute_metrics(tokenizer, task: str):
    """`compute_metrics` for `Seq2SeqTrainer(predict_with_generate=True)`.

    Decodes generated ids and labels (-100 restored to the pad id), and returns the metric
    module's scores plus `gen_len`, the mean count of non-pad generated tokens.
    """
    metric = load_seq2seq_metric(task)
    pad_id = tokenizer.pad_token_id

    def compute_metrics(eval_pred):
        preds, labels = eval_pred.predictions, eval_pred.label_ids
        if isinstance(preds, tuple):
            preds = preds[0]
        preds = np.where(preds < 0, pad_id, preds)
        pred_str, label_str = decode(tokenizer, preds), decode(tokenizer, labels)
        result = metric.compute(predictions=pred_str, references=label_str)
        result["gen_len"] = float(np.mean(generated_lengths(preds, pad_id, tokenizer.eos_token_id)))
        return {k: round(float(v), 4) for k, v in result.items()}

    return compute_metrics


def generated_lengths(preds, pad_id: int, eos_id: int | None) -> np.ndarray:
    """Tokens each row generated: after the decoder start token, up to and including the first eos.

    Beam search pads finished rows with eos, not pad, so counting non-pad tokens would give
    every row of a batch the longest row's length.
    """
    body = np.asarray(preds)[:, 1:]
    keep = body != pad_id
    if eos_id is not None:
        is_eos = body == eos_id
        after_first_eos = np.cumsum(is_eos, axis=1) - is_eos > 0
        keep &= ~after_first_eos
    return keep.sum(axis=1)


def decode(tokenizer, ids) -> list:
    """Token ids -> whitespace-normalised texts; -100 (ignored labels, gather padding) reads as pad."""
    ids = np.where(np.asarray(ids) < 0, tokenizer.pad_token_id, ids)
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return [" ".join(t.split()) for t in texts]
