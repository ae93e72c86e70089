"""Every config shipped in configs/ passes the check its users run (`trainer-shard validate-config`)
at the world size configs/README.md gives it, and every one is documented there; "auto" is a value
of its own where a key takes it as one (an inference device map, the checkpoint's dtype)."""

import json
import re

import pytest

from conftest import ROOT
from trainer_shard import cli
from trainer_shard.config import load_config
from trainer_shard.errors import ConfigError
from trainer_shard.finetune import apply_json_defaults, build_parser

CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.json"))


def documented() -> dict:
    """{file: the command configs/README.md's table "The configs here" gives for it}."""
    text = (ROOT / "configs" / "README.md").read_text()
    section = text.split("## The configs here", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| `([^`]+\.json)` \|[^|]*\| (.*) \|$", section, re.M)}


def world_size(command: str) -> int:
    """The ranks the documented command runs on: torchrun's --nproc_per_node, else one."""
    match = re.search(r"torchrun (?:--standalone )?--nproc_per_node (\d+)", command)
    return int(match.group(1)) if match else 1


def test_every_config_is_documented_with_its_command():
    table = documented()
    assert sorted(table) == CONFIGS, "configs/ and the table in configs/README.md list different files"


@pytest.mark.parametrize("name", CONFIGS)
def test_every_shipped_config_passes_its_check(name, capsys):
    command = documented()[name]
    path = f"configs/{name}"
    if f"--offload {path}" not in command:  # a file of script arguments (configs/demo.json)
        apply_json_defaults(build_parser(), ROOT / path)  # every key a flag of the script
        offload = json.loads((ROOT / path).read_text()).get("offload")
        assert offload in [f"configs/{c}" for c in CONFIGS], f"{path} names {offload!r}, not a shipped config"
        path = offload
    rc = cli.main(["validate-config", str(ROOT / path), "--world_size", str(world_size(command))])
    out, err = capsys.readouterr()
    assert rc == 0 and ": valid on " in out, f"trainer-shard validate-config {path}: exit {rc}\n{err}"


def test_inference_auto_values_are_the_keys_own(tmp_path):
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"inference": {"device_map": "auto", "dtype": "auto", "max_memory": {"cpu": "1GiB"}}}))
    inference = load_config(path).inference
    assert (inference["device_map"], inference["dtype"]) == ("auto", "auto")
    # "auto" stays refused where it means nothing, and a misspelt strategy is still named
    path.write_text(json.dumps({"inference": {"offload_folder": "auto", "max_memory": "auto", "dtype": "Auto"}}))
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    text = str(raised.value)
    assert '$.inference.offload_folder: "auto" is not allowed here' in text
    assert '$.inference.max_memory: "auto" is not allowed here' in text
    assert "$.inference.dtype: must be one of auto, " in text


def test_the_shipped_inference_config_plans_a_device_map(tiny_model):
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    from trainer_shard.offload.dispatch import plan_device_map

    inference = load_config(ROOT / "configs" / "inference_disk.json").inference
    plan = plan_device_map(AutoModelForSeq2SeqLM, AutoConfig.from_pretrained(tiny_model), inference)
    assert set(plan.values()) == {"cpu"}  # the demo model fits the 2 GiB of max_memory
