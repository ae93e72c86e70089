"""Evaluation on several ranks without the duplicated samples of the last batch."""

import functools


def gather_for_metrics(accelerator, args):
    """The gather the evaluation loop should use: `accelerator.gather_for_metrics`.

    Seq2SeqTrainer.evaluate/predict (transformers 5.x) switch the gather to `accelerator.gather`,
    which keeps the samples that the even-batches sharding repeats to fill the last batch, and
    the loop no longer truncates to the dataset length: with N ranks, predictions, labels, loss
    and BLEU then include duplicates. `gather_for_metrics` drops them. On one process the two are
    the same.
    """
    return functools.partial(accelerator.gather_for_metrics, use_gather_object=args.eval_use_gather_object)
