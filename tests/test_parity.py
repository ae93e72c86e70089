"""With no plugin flag the trainer is a true drop-in: bit-identical weights to transformers'."""

import pytest
import torch
from transformers import (
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    set_seed,
)

from trainer_shard import ShardedSeq2SeqTrainer, ShardedSeq2SeqTrainingArguments
from trainer_shard.data import TokenizedSeq2SeqDataset, read_split
from trainer_shard.training import loss


def train(trainer_cls, args_cls, model_dir, data_dir, out_dir):
    set_seed(11)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    dataset = TokenizedSeq2SeqDataset(
        read_split(data_dir, "train", n_obs=96), tokenizer, max_source_length=32, max_target_length=32, prefix="t: "
    )
    args = args_cls(
        output_dir=str(out_dir), use_cpu=True, report_to="none", save_strategy="no", seed=11,
        per_device_train_batch_size=8, max_steps=8, learning_rate=3e-3, warmup_steps=2,
        weight_decay=0.01, max_grad_norm=0.5, disable_tqdm=True,
    )  # fmt: skip
    trainer = trainer_cls(
        model=model, args=args, train_dataset=dataset, data_collator=DataCollatorForSeq2Seq(tokenizer, model=model)
    )
    trainer.train()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, trainer.state.log_history


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
def test_bit_identical_to_seq2seq_trainer(tiny_model, tiny_data, tmp_path):
    ours, _ = train(ShardedSeq2SeqTrainer, ShardedSeq2SeqTrainingArguments, tiny_model, tiny_data, tmp_path / "a")
    theirs, _ = train(Seq2SeqTrainer, Seq2SeqTrainingArguments, tiny_model, tiny_data, tmp_path / "b")
    initial = AutoModelForSeq2SeqLM.from_pretrained(tiny_model).state_dict()
    assert ours.keys() == theirs.keys()
    assert any(not torch.equal(ours[k], initial[k]) for k in ours), "training changed nothing"
    different = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert different == []


def test_seq2seq_models_with_mean_losses_are_detected(tiny_model):
    """T5 takes **kwargs but returns a per-batch mean: what it does, seen on a forward, says so."""
    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model)
    assert loss.declared_normalization(model) is None  # **kwargs: it does not say
    observer = loss.LossKwargsObserver(model)
    with observer:
        model(input_ids=torch.ones(1, 4, dtype=torch.long), labels=torch.ones(1, 3, dtype=torch.long),
              num_items_in_batch=torch.tensor(3))  # fmt: skip
    assert observer.can_observe and not observer.normalized
    assert "_loss_function" not in model.__dict__  # put back as it was
    model.accepts_loss_kwargs = True  # a model's own declaration wins
    assert loss.declared_normalization(model) is True
