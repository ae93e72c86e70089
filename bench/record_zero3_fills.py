#!/usr/bin/env python
"""Records what the Hugging Face DeepSpeed integration and DeepSpeed itself make of the ZeRO-3
keys, the reference tests/test_hf_auto_fills.py holds `config.apply.zero3_kwargs` to.

    /tmp/dsvenv/bin/python bench/record_zero3_fills.py   # writes tests/data/deepspeed/hf_auto_fills_zero3.json

In the venv of bench/record_hf_auto_fills.py (transformers, accelerate and DeepSpeed installed;
see there). Each case runs, as the Trainer does, `HfTrainerDeepSpeedConfig(config)
.trainer_config_process(args)` and `.trainer_config_finalize(args, model, num_training_steps)`
with `model = SimpleNamespace(config=T5Config(d_model=hidden_size))`, then builds DeepSpeed's own
`DeepSpeedZeroConfig(**filled["zero_optimization"])` (where "auto" left unfilled is dropped: the
default) and records the settings it resolved: `prefetch_bucket_size`,
`param_persistence_threshold`, `max_live_parameters`, `model_persistence_threshold`,
`gather_16bit_weights_on_model_save`; a config DeepSpeed refuses is recorded with "error".

Only the file's `zero_optimization` section is passed: the integration fills the stage-3 sizes
from the model alone, and the other sections would only be checked against the flags. `aio`,
which transformers' NVMe example writes inside `zero_optimization` (DeepSpeed refuses it there,
and so does trainer_shard), is left out of it: DeepSpeed reads it at the top level.

The configs: the stage-3 files of this folder (SOURCES.md), and written ones for the other
names, "auto" under them, a max_live_parameters below the prefetch, and two names together.
"""

import json
import sys
import tempfile
import types
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "deepspeed"
OUT = DATA / "hf_auto_fills_zero3.json"
FILES = ["accelerate_zero_stage3_config.json", "accelerate_zero_stage3_offload_config.json",
         "fastchat_deepspeed_config_s3.json", "hf_docs_zero3_auto.json", "hf_docs_zero3_manual.json",
         "hf_docs_zero3_nvme.json", "hf_ds_config_zero3.json", "llamafactory_ds_z3_config.json"]  # fmt: skip
WRITTEN = {
    "other names": {"stage": 3, "prefetch_bucket_size": 1234, "param_persistence_threshold": 77,
                    "max_live_parameters": 5000, "gather_16bit_weights_on_model_save": False},
    "auto under the other names": {"stage": 3, "prefetch_bucket_size": "auto", "param_persistence_threshold": "auto",
                                   "reduce_bucket_size": "auto"},
    "max_live below the prefetch": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
                                    "stage3_max_live_parameters": 1000, "model_persistence_threshold": 10**6},
    "old name of gather": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True, "sub_group_size": "auto",
                           "stage3_max_live_parameters": "auto", "stage3_max_reuse_distance": "auto"},
    "nothing written": {"stage": 3},
    "two names of one setting": {"stage": 3, "stage3_prefetch_bucket_size": 10, "prefetch_bucket_size": 10},
}  # fmt: skip
RESOLVED = ("prefetch_bucket_size", "param_persistence_threshold", "max_live_parameters", "model_persistence_threshold",
            "gather_16bit_weights_on_model_save")  # fmt: skip


def record(name, config, hidden_size, tmp) -> dict:
    import transformers
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    zero = json.loads((DATA / config).read_text())["zero_optimization"] if isinstance(config, str) else config
    args = transformers.TrainingArguments(output_dir=tmp, use_cpu=True, report_to="none")
    model = types.SimpleNamespace(config=transformers.T5Config(d_model=hidden_size))
    case = {"name": name, "hidden_size": hidden_size}
    case |= {"config_file": config} if isinstance(config, str) else {"config": config}
    if "aio" in zero:  # transformers' NVMe example puts it here; DeepSpeed reads it at the top level only
        zero = {k: v for k, v in zero.items() if k != "aio"}
        case["moved"] = "aio, to the top level"
    hf_config = HfTrainerDeepSpeedConfig({"zero_optimization": zero})  # its other sections fill nothing here
    hf_config.trainer_config_process(args)
    hf_config.trainer_config_finalize(args, model, 100)
    zero = hf_config.config["zero_optimization"]
    case["filled"] = zero
    try:
        resolved = DeepSpeedZeroConfig(**zero)
    except Exception as e:  # pydantic's ValidationError, or DeepSpeed's assert on two names
        case["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return case
    case["resolved"] = {key: getattr(resolved, key) for key in RESOLVED}
    return case


def main() -> None:
    import deepspeed
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        cases = [record(f"{f} h{h}", f, h, tmp) for f in FILES for h in (48, 512)]
        cases += [record(name, config, 64, tmp) for name, config in WRITTEN.items()]
    versions = {"transformers": transformers.__version__, "deepspeed": deepspeed.__version__}
    lines = ",\n".join(json.dumps(c) for c in cases)
    OUT.write_text(f'{{"versions": {json.dumps(versions)},\n"cases": [\n{lines}\n]}}\n')
    print(f"{len(cases)} cases -> {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
