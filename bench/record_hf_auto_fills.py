#!/usr/bin/env python
"""Records how the Hugging Face DeepSpeed integration fills `"auto"` in DeepSpeed configs, the
reference tests/test_hf_auto_fills.py holds trainer_shard's own config resolution to.

    python3 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install deepspeed transformers==5.24.0 accelerate==1.15.0
    /tmp/dsvenv/bin/python bench/record_hf_auto_fills.py   # writes tests/data/deepspeed/hf_auto_fills.json

`transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig` needs the `deepspeed` package, so
this script runs in a venv of its own; trainer_shard and its tests never import DeepSpeed, they
read the JSON. The committed file was recorded with transformers 5.24.0, accelerate 1.15.0,
DeepSpeed 0.19.8 and torch 2.13.0 (CPU), in a few seconds.

Each case builds `TrainingArguments(output_dir=<tmp>, use_cpu=True, report_to="none", **flags)`,
then runs, as the Trainer does, `HfTrainerDeepSpeedConfig(config).trainer_config_process(args)`
and `trainer_config_finalize(args, model, num_training_steps)` with
`model = SimpleNamespace(config=T5Config(d_model=hidden_size))` (T5Config maps `hidden_size` to
`d_model`), and records the filled config (`hf_config.config`), the dtype the integration chose
and `args.world_size`. Every case runs on one process, so `args.world_size` is 1 throughout:
nothing is monkeypatched. The test derives `train_batch_size` at world size 2 itself, as
micro x accumulation x 2 (DeepSpeed's rule, the one `trainer_config_process` applies).

A case the integration refuses (an explicit value that contradicts the arguments: it raises
ValueError in `trainer_config_finalize`) is recorded with `"error"` (the message) instead of
`"filled"`.

The configs: five public ones from tests/data/deepspeed (see SOURCES.md there) and one written
here with every key the integration fills from the arguments or the model set to "auto".
"""

import json
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "deepspeed"
OUT = DATA / "hf_auto_fills.json"

# Every key HfTrainerDeepSpeedConfig fills from TrainingArguments or the model's hidden size.
ALL_AUTO = {
    "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto", "offload_optimizer": {"device": "cpu"}},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                       "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "gradient_clipping": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "bf16": {"enabled": "auto"},
}  # fmt: skip

# The run's hyperparameters, away from the defaults wherever they can be.
TUNED = dict(learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.01,
             max_grad_norm=0.5, per_device_train_batch_size=4, gradient_accumulation_steps=2)  # fmt: skip

HF_DOCS, HF_TESTS = "hf_docs_zero2_auto.json", "hf_ds_config_zero2.json"
ACCELERATE, LLAMAFACTORY = "accelerate_zero_stage2_offload_config.json", "llamafactory_ds_z2_offload_config.json"
AXOLOTL, WRITTEN = "axolotl_zero2.json", None  # None: ALL_AUTO

# (name, config file in tests/data/deepspeed or WRITTEN, flags, num_training_steps, hidden size)
CASES = [
    ("hf_docs_zero2_auto-defaults", HF_DOCS, {}, 50, 48),
    ("hf_docs_zero2_auto-tuned-fp16-warmup7", HF_DOCS, dict(TUNED, fp16=True, warmup_steps=7), 200, 512),
    ("hf_docs_zero2_auto-bf16-ratio0.03", HF_DOCS, dict(bf16=True, learning_rate=2e-5, warmup_steps=0.03), 200, 48),
    ("hf_ds_config_zero2-bf16-ratio0.03", HF_TESTS, dict(bf16=True, learning_rate=2e-5, warmup_steps=0.03), 200, 512),
    ("hf_ds_config_zero2-fp32-warmup0", HF_TESTS, dict(warmup_steps=0, per_device_train_batch_size=3), 50, 48),
    ("hf_ds_config_zero2-tuned-fp16-ratio0.5", HF_TESTS, dict(TUNED, fp16=True, warmup_steps=0.5), 50, 512),
    ("accelerate_z2_offload-fp16-ratio0.5", ACCELERATE, dict(fp16=True, warmup_steps=0.5), 50, 48),
    ("accelerate_z2_offload-fp16-tuned-warmup7", ACCELERATE,
     dict(TUNED, fp16=True, gradient_accumulation_steps=1, per_device_train_batch_size=8, warmup_steps=7), 200, 512),
    ("llamafactory_z2_offload-bf16-accum4", LLAMAFACTORY,
     dict(bf16=True, per_device_train_batch_size=2, gradient_accumulation_steps=4, max_grad_norm=1.0), 200, 512),
    ("llamafactory_z2_offload-fp16-tuned", LLAMAFACTORY, dict(TUNED, fp16=True), 50, 48),
    ("axolotl_zero2-bf16-clip0.3", AXOLOTL,
     dict(bf16=True, max_grad_norm=0.3, per_device_train_batch_size=16), 200, 48),
    ("axolotl_zero2-fp32-defaults", AXOLOTL, {}, 50, 512),
    ("all_auto-bf16-warmup7", WRITTEN, dict(TUNED, bf16=True, warmup_steps=7), 50, 48),
    ("all_auto-fp32-ratio0.03", WRITTEN, dict(learning_rate=1e-4, adam_beta2=0.98, adam_epsilon=1e-8, weight_decay=0.1,
                                              per_device_train_batch_size=4, gradient_accumulation_steps=8,
                                              warmup_steps=0.03), 200, 512),
    ("all_auto-fp32-ratio0.03-50steps", WRITTEN, dict(warmup_steps=0.03), 50, 48),  # ceil(1.5) = 2
    ("all_auto-bf16-ratio0.5", WRITTEN, dict(TUNED, bf16=True, warmup_steps=0.5), 50, 512),
    ("all_auto-bf16-warmup0", WRITTEN, dict(bf16=True, warmup_steps=0, max_grad_norm=0.0), 200, 48),
    ("all_auto-fp32-defaults", WRITTEN, {}, 200, 512),
    # refused by the integration: an explicit value that contradicts the arguments
    ("accelerate_z2_offload-bf16 (file fp16 true)", ACCELERATE, dict(bf16=True), 50, 48),
    ("accelerate_z2_offload-fp32 (file fp16 true, no flag)", ACCELERATE, {}, 50, 48),
    ("accelerate_z2_offload-fp16-accum4 (file accum 1)", ACCELERATE,
     dict(fp16=True, gradient_accumulation_steps=4), 50, 48),
]  # fmt: skip


def record(name, config_file, flags, num_training_steps, hidden_size, tmp) -> dict:
    import torch
    import transformers
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    config = json.loads((DATA / config_file).read_text()) if config_file else json.loads(json.dumps(ALL_AUTO))
    args = transformers.TrainingArguments(output_dir=tmp, use_cpu=True, report_to="none", **flags)
    model = types.SimpleNamespace(config=transformers.T5Config(d_model=hidden_size))
    assert model.config.hidden_size == hidden_size
    case = {"name": name}
    case |= {"config_file": config_file} if config_file else {"config": ALL_AUTO}
    case |= {"flags": flags, "num_training_steps": num_training_steps, "hidden_size": hidden_size,
             "world_size": args.world_size}  # fmt: skip
    hf_config = HfTrainerDeepSpeedConfig(config)
    try:
        hf_config.trainer_config_process(args)
        hf_config.trainer_config_finalize(args, model, num_training_steps)
    except ValueError as e:
        case["error"] = str(e)
        return case
    case["dtype"] = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[hf_config.dtype()]
    case["filled"] = hf_config.config
    return case


def main() -> None:
    import accelerate
    import deepspeed
    import torch
    import transformers

    versions = {"transformers": transformers.__version__, "accelerate": accelerate.__version__,
                "deepspeed": deepspeed.__version__, "torch": torch.__version__}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        cases = [record(*case, tmp) for case in CASES]
    lines = ",\n".join(json.dumps(c) for c in cases)  # one case a line: reviewable diffs
    OUT.write_text(f'{{"versions": {json.dumps(versions)},\n"cases": [\n{lines}\n]}}\n')
    refused = sum("error" in c for c in cases)
    print(f"{len(cases)} cases ({refused} refused) from transformers {transformers.__version__} -> {OUT}",
          file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
