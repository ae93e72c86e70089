"""Evaluation and generation with models placed across CPU RAM and disk by a device map: the
"inference" section of the --offload config, checked; generations equal to the whole model's."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer

from conftest import ROOT, TINY_FLAGS, assert_ok, run_script
from trainer_shard.checkpoint import save_model
from trainer_shard.config import load_config
from trainer_shard.errors import ConfigError
from trainer_shard.offload.dispatch import load_dispatched, plan_device_map


def write(tmp_path, config, name="inference.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return path


def model_bytes(path) -> int:
    return sum(p.numel() * p.element_size() for p in AutoModelForSeq2SeqLM.from_pretrained(path).parameters())


def split_config(tmp_path, model, fraction=0.85):
    """CPU RAM for `fraction` of the model (accelerate keeps room for the largest module, here the
    embedding: below about 0.8 all of this tiny model goes to disk); the rest goes to disk."""
    cap = int(model_bytes(model) * fraction)
    return {"inference": {"max_memory": {"cpu": cap}, "offload_folder": str(tmp_path / "offload")}}


def test_bad_inference_sections_are_reported_together(tmp_path):
    bad = {"inference": {"device_map": {"encoder": "disk", "decoder": "gpu"}, "max_memory": {"cpu": "lots", "tpu": 1},
                         "dtype": "int8", "no_split_module_classes": [], "offload_buffers": "yes"}}  # fmt: skip
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, bad))
    paths = [p for p, _ in e.value.problems]
    assert paths == ["$.inference.device_map", "$.inference.max_memory", "$.inference.dtype",
                     "$.inference.no_split_module_classes", "$.inference.offload_buffers"]  # fmt: skip
    assert "'decoder': value \"gpu\" is not a device" in str(e.value)
    with pytest.raises(ConfigError, match=r"offload_folder: the device_map sends modules to disk"):
        load_config(write(tmp_path, {"inference": {"device_map": {"": "disk"}}}))
    with pytest.raises(ConfigError, match=r"run it on one process, not 2"):
        load_config(write(tmp_path, {"inference": {"device_map": "auto"}}), world_size=2)
    config = load_config(write(tmp_path, {"inference": {"max_memory": {"cpu": "2GiB", "cuda:1": "1.5GB"}}}))
    assert config.inference["max_memory"] == {"cpu": 2 * 2**30, 1: 1_500_000_000}
    assert config.inference["device_map"] == "auto"  # the section alone plans a map


def test_device_maps_the_model_cannot_take_are_refused(tiny_model, tmp_path):
    config = AutoConfig.from_pretrained(tiny_model)
    section = load_config(write(tmp_path, {"inference": {"device_map": {"encoder.blok": "cpu", "": "cpu"}}})).inference
    with pytest.raises(ConfigError, match=r"has no module 'encoder.blok' \(did you mean encoder.block"):
        plan_device_map(AutoModelForSeq2SeqLM, config, section, "x.json")
    section = load_config(write(tmp_path, {"inference": {"device_map": {"encoder": "cpu"}}})).inference
    with pytest.raises(ConfigError, match=r"no entry places .* parameter"):
        plan_device_map(AutoModelForSeq2SeqLM, config, section, "x.json")
    section = {"max_memory": split_config(tmp_path, tiny_model)["inference"]["max_memory"]}
    section = load_config(write(tmp_path, {"inference": section})).inference
    with pytest.raises(ConfigError, match=r"GiB of weights do not fit max_memory .* go to disk: name a folder"):
        plan_device_map(AutoModelForSeq2SeqLM, config, section, "x.json")


@pytest.mark.parametrize("num_beams", [1, 4])
def test_cpu_and_disk_split_generates_what_the_whole_model_does(tiny_model, tmp_path, num_beams):
    section = load_config(write(tmp_path, split_config(tmp_path, tiny_model))).inference
    split = load_dispatched(AutoModelForSeq2SeqLM, tiny_model, section)
    assert {"cpu", "disk"} <= set(split.hf_device_map.values()), split.hf_device_map
    assert any(p.device.type == "meta" for p in split.parameters())  # offloaded weights are not in memory
    whole = AutoModelForSeq2SeqLM.from_pretrained(tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    batch = tokenizer(["one hundred and two", "seven thousand and one", "ninety"], return_tensors="pt", padding=True)
    with torch.no_grad():
        expected = whole.generate(**batch, num_beams=num_beams, max_length=20, do_sample=False)
        got = split.generate(**batch, num_beams=num_beams, max_length=20, do_sample=False)
    assert torch.equal(expected, got)


def test_a_sharded_checkpoint_loads_across_cpu_and_disk(tiny_model, tmp_path):
    whole = AutoModelForSeq2SeqLM.from_pretrained(tiny_model)
    sharded = tmp_path / "sharded"
    files = save_model(whole, sharded, max_shard_size=20_000)
    assert len(files) > 2 and (sharded / "model.safetensors.index.json").is_file()
    section = load_config(write(tmp_path, split_config(tmp_path, tiny_model))).inference
    split = load_dispatched(AutoModelForSeq2SeqLM, sharded, section)
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(sharded)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), reloaded.state_dict().values()))
    x = torch.tensor([[5, 6, 7, 1]])
    with torch.no_grad():
        assert torch.equal(whole.generate(x, max_length=12), split.generate(x, max_length=12))


@pytest.mark.slow
def test_predict_and_generate_script_with_offloaded_parameters(tiny_model, tiny_data, tmp_path):
    flags = ["--model_name_or_path", tiny_model, "--data_dir", tiny_data, *TINY_FLAGS, "--do_predict",
             "--predict_with_generate", "--eval_beams", "3"]  # fmt: skip
    config = write(tmp_path, split_config(tmp_path, tiny_model))
    assert_ok(run_script([*flags, "--output_dir", tmp_path / "whole"]))
    assert_ok(run_script([*flags, "--output_dir", tmp_path / "split", "--offload", config]))
    whole, split = (tmp_path / d / "test_generations.txt" for d in ("whole", "split"))
    assert whole.read_text() == split.read_text()
    scores = [json.loads((tmp_path / d / "test_results.json").read_text())["test_bleu"] for d in ("whole", "split")]
    assert scores[0] == scores[1]
    source = (tiny_data / "test.source").read_text()
    proc = run_script(["--model_name_or_path", tiny_model, "--offload", config, "--num_beams", "3", "--max_length", "32",
                       "--input", tiny_data / "test.source", "--max_source_length", "32"],
                      script=ROOT / "scripts" / "generate.py")  # fmt: skip
    assert_ok(proc)
    assert proc.stdout == whole.read_text() and len(proc.stdout.splitlines()) == len(source.splitlines())
    assert "s a token" in proc.stderr
    training = run_script([*flags, "--output_dir", tmp_path / "train", "--do_train", "--offload", config])
    assert training.returncode == 2 and "$.inference: applies to evaluation and prediction without --do_train" in training.stderr
    assert not (tmp_path / "train").exists()
    missing = run_script(["--model_name_or_path", tiny_model, "--input", tmp_path / "nope.txt"], script=ROOT / "scripts" / "generate.py")
    assert missing.returncode == 2 and "nope.txt' does not exist" in missing.stderr
