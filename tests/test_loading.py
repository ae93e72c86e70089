"""`trainer_shard.load_meta`: a model built on the meta device that a ZeRO-3 Trainer shards at its
start, each rank reading its slice of the checkpoint (issue 35: the whole model never in one
process). One process here; 2 ranks through finetune_trainer.py in
tests/test_zero3_offload_param_eval.py, the RSS of a t5-large load in bench/load_rss.py."""

import json

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, Seq2SeqTrainer
from transformers import Seq2SeqTrainingArguments

from trainer_shard import ArgumentError, ShardedSeq2SeqTrainer, ShardedSeq2SeqTrainingArguments, load_meta
from trainer_shard.loading import META_WEIGHTS


def examples(tiny_model, tiny_data, n=6):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    sources = (tiny_data / "test.source").read_text(encoding="utf-8").splitlines()[:n]
    targets = (tiny_data / "test.target").read_text(encoding="utf-8").splitlines()[:n]
    rows = [dict(tokenizer(s, max_length=32, truncation=True), labels=tokenizer(text_target=t, max_length=32,
                 truncation=True)["input_ids"]) for s, t in zip(sources, targets)]  # fmt: skip
    return tokenizer, rows


def unsharded_threshold(tmp_path):
    """An --offload config at stage 3 keeping no parameter whole (the tiny model's are all below
    the default persistence threshold), nothing offloaded."""
    path = tmp_path / "zero3.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}))
    return str(path)


def test_a_users_own_script_predicts_as_the_plain_trainer_without_loading_the_model_whole(tiny_model, tiny_data, tmp_path):
    """The README's "From Python" way: `load_meta`, then a ZeRO-3 Trainer. Right after the Trainer
    is built every parameter is sharded (an empty tensor between uses; the checkpoint was read
    into the units' buffers, never into a whole model), and predict_with_generate gives the
    plain Trainer's loss and generations on the model from_pretrained loaded."""
    tokenizer, rows = examples(tiny_model, tiny_data)
    common = dict(use_cpu=True, report_to="none", predict_with_generate=True, per_device_eval_batch_size=3,
                  generation_max_length=12)  # fmt: skip

    model = load_meta(AutoModelForSeq2SeqLM, tiny_model)
    assert all(p.device.type == "meta" for p in model.parameters())  # nothing read yet
    args = ShardedSeq2SeqTrainingArguments(output_dir=str(tmp_path / "ours"), sharded_ddp="zero_dp_3 auto_wrap",
                                           offload=unsharded_threshold(tmp_path), **common)  # fmt: skip
    trainer = ShardedSeq2SeqTrainer(model=model, args=args, data_collator=DataCollatorForSeq2Seq(tokenizer, model=model))
    assert trainer.sharded_model is not None
    assert not trainer.sharded_model.persistent
    assert all(p.numel() == 0 and p.device.type == "cpu" for p in model.parameters())
    ours = trainer.predict(rows)

    reference = AutoModelForSeq2SeqLM.from_pretrained(tiny_model)
    plain = Seq2SeqTrainer(model=reference, args=Seq2SeqTrainingArguments(output_dir=str(tmp_path / "plain"), **common),
                           data_collator=DataCollatorForSeq2Seq(tokenizer, model=reference))  # fmt: skip
    want = plain.predict(rows)
    assert ours.metrics["test_loss"] == pytest.approx(want.metrics["test_loss"], rel=1e-6)
    assert ours.predictions.tolist() == want.predictions.tolist()


def test_ties_and_buffers_are_the_models(tiny_model):
    """Tied parameters stay one parameter (accelerate's empty-weights context would make two), and
    buffers are real tensors as the model's constructor computes them."""
    model = load_meta(AutoModelForSeq2SeqLM, tiny_model)
    assert model.get_input_embeddings().weight is model.encoder.embed_tokens.weight is model.decoder.embed_tokens.weight
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    assert getattr(model, META_WEIGHTS) == str(tiny_model)

    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2)  # fmt: skip
    folder = tiny_model.parent / "llama"
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    llama = load_meta(LlamaForCausalLM, folder)
    inv_freq = dict(llama.named_buffers())["model.rotary_emb.inv_freq"]
    assert inv_freq.device.type == "cpu" and torch.equal(inv_freq, LlamaForCausalLM(config).model.rotary_emb.inv_freq)


def test_a_hub_name_is_read_through_the_hub_cache_for_its_safetensors_only(tiny_model, monkeypatch):
    """A name that is not a local folder goes to huggingface_hub (the cache, or a download where
    there is a network), asking for the safetensors files and configs only."""
    import huggingface_hub

    asked = {}

    def snapshot_download(repo_id, allow_patterns=None, cache_dir=None):
        asked.update(repo_id=repo_id, patterns=allow_patterns, cache_dir=cache_dir)
        return str(tiny_model)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    model = load_meta(AutoModelForSeq2SeqLM, "someone/t5-tiny", cache_dir="/tmp/cache")
    assert asked == {"repo_id": "someone/t5-tiny", "cache_dir": "/tmp/cache",
                     "patterns": ["*.safetensors", "*.safetensors.index.json", "config.json", "generation_config.json"]}
    assert getattr(model, META_WEIGHTS) == str(tiny_model)

    def offline(repo_id, **kwargs):
        raise OSError("offline and not in the cache")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ArgumentError, match="neither a local folder nor a model the hub gave .*offline and not in the cache"):
        load_meta(AutoModelForSeq2SeqLM, "someone/t5-tiny")


def test_a_checkpoint_without_safetensors_is_refused_naming_the_conversion(tiny_model, tmp_path):
    folder = tmp_path / "bin_only"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_model / "config.json").read_text())
    torch.save(AutoModelForSeq2SeqLM.from_pretrained(tiny_model).state_dict(), folder / "pytorch_model.bin")
    with pytest.raises(ArgumentError) as raised:
        load_meta(AutoModelForSeq2SeqLM, folder)
    text = str(raised.value)
    assert "has no safetensors weights" in text and "it has pytorch_model.bin" in text
    assert ".save_pretrained('CONVERTED')" in text
    assert json.loads((folder / "config.json").read_text())  # nothing written or removed


def test_a_meta_model_under_another_strategy_is_refused(tiny_model, tmp_path):
    model = load_meta(AutoModelForSeq2SeqLM, tiny_model)
    args = ShardedSeq2SeqTrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none",
                                           sharded_ddp="zero_dp_2")  # fmt: skip
    with pytest.raises(ArgumentError, match="the model is on the meta device .*that is for ZeRO-3"):
        ShardedSeq2SeqTrainer(model=model, args=args)


@pytest.mark.slow  # a whole finetune_trainer.py run in this process (3 s)
def test_sharded_ddp_auto_chooses_before_loading_and_loads_as_its_choice_needs(tiny_model, tiny_data, tmp_path,
                                                                               monkeypatch):  # fmt: skip
    """`--sharded_ddp auto` decides from the config and a meta-device model before any weight is
    read: choosing zero_dp_3 (forced here: on a model this small DDP always fits), the model is
    built on the meta device and sharded from its checkpoint; `from_pretrained` is never called,
    and the Trainer takes the choice rather than choosing again."""
    import runpy

    from conftest import ROOT, TINY_FLAGS

    from trainer_shard import planner

    chose = []
    probe = planner.Probe(runtime=0, act_base=0, act_per_sample=0)
    monkeypatch.setattr(planner, "measure_probes", lambda *args, **kwargs: {"ddp": probe, "sharded": probe})
    monkeypatch.setattr(planner, "choose", lambda rows, budget: chose.append(rows) or next(
        r for r in rows if (r["strategy"], r["offload"]) == ("zero_dp_3", "none")))

    def whole(*args, **kwargs):
        raise AssertionError("from_pretrained loaded the whole model")

    monkeypatch.setattr(AutoModelForSeq2SeqLM, "from_pretrained", whole)
    script = runpy.run_path(str(ROOT / "scripts" / "finetune_trainer.py"))
    flags = ["--model_name_or_path", tiny_model, "--data_dir", tiny_data, "--output_dir", tmp_path / "out", *TINY_FLAGS,
             "--use_cpu", "--do_train", "--max_steps", "2", "--per_device_train_batch_size", "4",
             "--sharded_ddp", "auto", "--save_strategy", "no"]  # fmt: skip
    trainer, results = script["main"]([str(f) for f in flags])
    try:
        assert len(chose) == 1  # once, before loading; the Trainer took it
        assert trainer.sharding_stage == 3 and trainer.offload_spec is None
        assert getattr(trainer.sharded_model.model, META_WEIGHTS) == str(tiny_model)  # built on meta, read from there
        assert results["train_loss"] == results["train_loss"] > 0
    finally:
        trainer.sharded_model.close()


def test_a_bf16_model_reads_an_fp32_checkpoint_in_chunks_equal_to_from_pretrained(tiny_model, monkeypatch):
    """Each rank's slice is read straight from the file into its shard; where the dtypes differ,
    through one scratch buffer a chunk at a time (made tiny here, so chunks end inside tensors):
    the weights are from_pretrained's, cast the same way."""
    from trainer_shard.sharding import shard_model, zero3_weights
    from trainer_shard.sharding.zero3 import auto_wrap_units

    monkeypatch.setattr(zero3_weights, "SCRATCH_NUMEL", 1000)
    model = load_meta(AutoModelForSeq2SeqLM, tiny_model, dtype=torch.bfloat16)
    weights = zero3_weights.checkpoint_weights(tiny_model)
    try:
        sharded = shard_model(model, units=auto_wrap_units(model)[0], weights=weights, persistence_threshold=0)
    finally:
        weights.close()
    reference = AutoModelForSeq2SeqLM.from_pretrained(tiny_model, dtype=torch.bfloat16).state_dict()
    assert sharded.held_parameter_bytes()["grad_shards"] == 0  # none before a backward or an optimizer
    with sharded.gathered():
        got = model.state_dict()
        assert got.keys() == reference.keys()
        for name, value in reference.items():
            assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], value), name
    sharded.close()


def test_a_checkpoint_of_another_shape_is_refused_by_name(tiny_model):
    """A model whose shapes are not the checkpoint's (a config edited after saving): the first
    parameter that differs is named with both shapes, through the slice reader and the mapping."""
    from transformers import AutoConfig

    from trainer_shard import ShardingError
    from trainer_shard.sharding import shard_model, zero3_weights

    config = AutoConfig.from_pretrained(tiny_model)
    config.d_ff *= 2
    for weights in (zero3_weights.checkpoint_weights(tiny_model), None):
        model = load_meta(AutoModelForSeq2SeqLM, tiny_model, config=config)
        source = weights if weights is not None else AutoModelForSeq2SeqLM.from_pretrained(tiny_model).state_dict()
        with pytest.raises(ShardingError, match=r"weights: '.*DenseReluDense.wi.weight' has shape \(64, 32\), "
                                                r"the model's is \(128, 32\)"):  # fmt: skip
            shard_model(model, weights=source, persistence_threshold=0)
        if weights is not None:
            weights.close()
