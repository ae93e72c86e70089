"""`trainer-shard consolidate ADAPTER OUT --merge_adapter` (issue 34): a LoRA adapter merged into its
base a tensor at a time equals PEFT's own `merge_and_unload` (the independent reference), loads
with `from_pretrained`, and the refusals name the fix."""

import subprocess
import sys

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file

from conftest import ROOT
from trainer_shard.errors import CheckpointError
from trainer_shard.merge_adapter import merge_adapter


def base_and_adapter(tmp_path, **lora):
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=64, d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
                                   decoder_start_token_id=0, pad_token_id=0)  # fmt: skip
    base = transformers.T5ForConditionalGeneration(config)
    base.save_pretrained(tmp_path / "base")
    settings = dict(r=4, lora_alpha=8, target_modules=["q", "v", "wo"], task_type="SEQ_2_SEQ_LM") | lora
    model = get_peft_model(transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "base"),
                           LoraConfig(**settings))  # fmt: skip
    with torch.no_grad():  # B is zero at init: give the adapter something to merge
        for name, p in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "adapter")
    return model


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
@pytest.mark.parametrize("lora", [{}, {"use_rslora": True, "modules_to_save": ["lm_head"]}], ids=["lora", "rslora"])
def test_the_merged_model_equals_peft_merge_and_unload(tmp_path, lora):
    model = base_and_adapter(tmp_path, **lora)
    reference = model.merge_and_unload().state_dict()
    proc = subprocess.run([sys.executable, "-m", "trainer_shard.cli", "consolidate", tmp_path / "adapter",
                           tmp_path / "merged", "--merge_adapter", "--base", tmp_path / "base"],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    base = load_file(tmp_path / "base" / "model.safetensors")
    assert set(merged) == set(base) | ({"lm_head.weight"} if "modules_to_save" in lora else set())
    changed = 0
    for name, value in merged.items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-6, msg=name)
        changed += name not in base or not torch.equal(value, base[name])
    assert changed >= 12  # q, v and wo of every block moved (and lm_head's copy with modules_to_save)
    again = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path / "merged")
    ids = torch.tensor([[5, 6, 7]])
    torch.testing.assert_close(again(input_ids=ids, labels=ids).logits, model(input_ids=ids, labels=ids).logits)


@pytest.mark.slow  # a process of its own, or seconds of work: make test, not test-fast
def test_refusals_name_the_fix(tmp_path):
    base_and_adapter(tmp_path)
    with pytest.raises(CheckpointError, match="has no adapter_config.json"):
        merge_adapter(tmp_path / "base", tmp_path / "out")
    with pytest.raises(CheckpointError, match="pass --base FOLDER"):
        merge_adapter(tmp_path / "adapter", tmp_path / "out", base=tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="another folder"):
        merge_adapter(tmp_path / "adapter", tmp_path / "base", base=tmp_path / "base")
    proc = subprocess.run([sys.executable, "-m", "trainer_shard.cli", "consolidate", tmp_path / "adapter",
                           tmp_path / "out", "--base", tmp_path / "base"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "add --merge_adapter" in proc.stderr
    assert not (tmp_path / "out").exists()
