"""Saving a sharded model from its flat buffer: a standard safetensors file, no copy of the model."""

import torch
from safetensors.torch import load_file
from transformers import AutoModelForSeq2SeqLM

from trainer_shard.checkpoint import save_model, save_safetensors, unique_state_dict
from trainer_shard.sharding import ShardedOptimizer


def test_safetensors_written_from_views_load_back(tmp_path):
    flat = torch.arange(12, dtype=torch.float32)
    tensors = {"a": flat[:6].view(2, 3), "b": flat[6:].to(torch.bfloat16), "c": torch.tensor([True, False])}
    save_safetensors(tensors, tmp_path / "x.safetensors", {"format": "pt"})
    loaded = load_file(tmp_path / "x.safetensors")
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_sharded_model_saves_and_reloads_with_tied_weights(tiny_model, tmp_path):
    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model).to(torch.bfloat16)
    ShardedOptimizer(model.parameters(), optim=torch.optim.AdamW, stage=2, lr=1e-3)  # params -> one flat buffer
    state = unique_state_dict(model)
    assert "shared.weight" in state and "lm_head.weight" not in state  # tied copies dropped, as save_pretrained does
    save_model(model, tmp_path / "out")
    again = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out")
    for (name, p), q in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(p, q), name
    assert again.lm_head.weight.data_ptr() == again.shared.weight.data_ptr()
