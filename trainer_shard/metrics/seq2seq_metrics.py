"""BLEU and chrF (sacrebleu), plus ROUGE for summarization, as a local `evaluate` metric module.

`evaluate.load("sacrebleu")` fetches its script from the hub and fails offline; this file is
loaded by path instead (`trainer_shard.metrics.load_seq2seq_metric`), so it works anywhere.

    >>> metric = evaluate.load("path/to/seq2seq_metrics.py", "translation")
    >>> metric.compute(predictions=["o sută"], references=["o sută"])
    {'bleu': ..., 'chrf': ...}
"""

import datasets
import evaluate
import sacrebleu

_CITATION = """\
@inproceedings{post-2018-call,
  title = "A Call for Clarity in Reporting {BLEU} Scores",
  author = "Post, Matt",
  booktitle = "Proceedings of the Third Conference on Machine Translation",
  year = "2018",
}
"""

_DESCRIPTION = """\
Corpus BLEU and chrF computed with sacrebleu (default tokenizer 13a, one reference per
prediction). With the "summarization" configuration, ROUGE-1/2/L/Lsum F-measures are added
when the optional `rouge_score` package is installed.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: list of generated strings.
    references: list of reference strings, one per prediction.
Returns:
    bleu: corpus BLEU (0-100); chrf: corpus chrF (0-100);
    rouge1, rouge2, rougeL, rougeLsum (0-100): summarization only, when rouge_score is installed.
"""

CONFIGS = ("translation", "summarization")


def rouge_available() -> bool:
    try:
        import rouge_score  # noqa: F401
    except ImportError:
        return False
    return True


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Seq2SeqMetrics(evaluate.Metric):
    def _info(self):
        if self.config_name not in CONFIGS:
            raise ValueError(f"unknown configuration {self.config_name!r}: choose one of {', '.join(CONFIGS)}")
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
            reference_urls=["https://github.com/mjpost/sacrebleu"],
        )

    def _compute(self, predictions, references):
        if len(predictions) != len(references):
            raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
        result = {
            "bleu": sacrebleu.corpus_bleu(predictions, [references]).score,
            "chrf": sacrebleu.corpus_chrf(predictions, [references]).score,
        }
        if self.config_name == "summarization" and rouge_available():
            result.update(_rouge(predictions, references))
        return result


def _rouge(predictions, references):
    from rouge_score import rouge_scorer, scoring

    keys = ["rouge1", "rouge2", "rougeL", "rougeLsum"]
    scorer = rouge_scorer.RougeScorer(keys, use_stemmer=True)
    aggregator = scoring.BootstrapAggregator(n_samples=1000)
    for pred, ref in zip(predictions, references):
        # rougeLsum splits summaries on newlines
        aggregator.add_scores(scorer.score(ref.replace(" . ", " .\n"), pred.replace(" . ", " .\n")))
    agg = aggregator.aggregate()
    return {k: agg[k].mid.fmeasure * 100 for k in keys}
