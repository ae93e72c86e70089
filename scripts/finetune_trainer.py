#!/usr/bin/env python
"""Fine-tune a seq2seq model (translation or summarization) with the Hugging Face Trainer.

One process:
    python scripts/finetune_trainer.py --model_name_or_path data/demo_t5 --data_dir data/demo_en_ro \
        --task translation_en_to_ro --output_dir output/demo --do_train --do_eval --do_predict \
        --predict_with_generate --use_cpu

Several processes, data parallel (gloo on CPU; NCCL on GPUs):
    torchrun --nproc_per_node 2 scripts/finetune_trainer.py ...same flags...
    accelerate launch --cpu --num_processes 2 scripts/finetune_trainer.py ...same flags...
(accelerate starts that one as a single process: the script starts its ranks with torchrun's
launcher, see relaunch_under_torchrun.)

A JSON file of arguments, flags after it overriding it (`make demo` runs this):
    python scripts/finetune_trainer.py configs/demo.json --num_train_epochs 1

Every Seq2SeqTrainingArguments flag works, plus trainer_shard's --sharded_ddp and --offload, and
LoRA through PEFT with TRL's flag names (--use_peft, --lora_r, --lora_target_modules...).
Writes train_results.json, val_results.json, test_results.json, all_results.json and
test_generations.txt to --output_dir.
"""

import logging
import os
import sys

import torch
import torch.distributed as dist
import transformers
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, DataCollatorForSeq2Seq, set_seed

from trainer_shard import ShardedDDPOption, ShardedSeq2SeqTrainer
from trainer_shard.dtypes import half_dtype, precision
from trainer_shard.errors import TrainerShardError
from trainer_shard.faults import EXIT_PEER_FAILED, PeerFailedError, TrainingInterrupted
from trainer_shard.loading import load_meta, load_pretrained_lean
from trainer_shard.offload.dispatch import load_dispatched
from trainer_shard.planner import lora_settings
from trainer_shard.training import plan
from trainer_shard.training.guard import accelerate_cpu_launch, launcher_argv
from trainer_shard.finetune import (
    apply_peft,
    count_parameters,
    freeze_params,
    load_pairs,
    parse_args,
    resolve_checkpoint,
    source_prefix,
    tokenize_splits,
    write_generations,
)
from trainer_shard.metrics import build_compute_metrics, decode

logger = logging.getLogger("finetune_trainer")


def main(argv=None, **trainer_kwargs):
    """Parse, check, build, train, evaluate, predict, write results. Returns (trainer, metrics).

    `trainer_kwargs` (callbacks, optimizer_cls_and_kwargs...) go to the trainer as they are.
    """
    # parse and check everything before anything is written
    model_args, data_args, training_args = parse_args(argv)
    setup_logging(training_args)
    pairs = load_pairs(data_args, training_args)
    checkpoint = resolve_checkpoint(data_args, training_args)
    set_seed(training_args.seed)

    # build
    config = AutoConfig.from_pretrained(model_args.config_name or model_args.model_name_or_path, cache_dir=model_args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(
        model_args.tokenizer_name or model_args.model_name_or_path, cache_dir=model_args.cache_dir
    )
    datasets = tokenize_splits(pairs, tokenizer, data_args, source_prefix(data_args, config))
    stage = plan.plan(training_args, training_args.offload_config)[0]
    if ShardedDDPOption.AUTO in training_args.sharded_ddp and "train" in datasets:  # chosen before loading
        lora = lora_settings(model_args.lora_r, model_args.lora_target_modules,
                             model_args.lora_modules_to_save) if model_args.use_peft else None  # fmt: skip
        stage = plan.choose_before_loading(training_args, training_args.offload_config, config, datasets["train"], lora)
    model = load_model(model_args, config, load_dtype(training_args, stage), training_args.offload_config,
                       training_args.offload, stage=stage)  # fmt: skip
    if model_args.use_peft:
        model = apply_peft(model, model_args, training_args.seed)
    freeze_params(model, encoder=model_args.freeze_encoder, embeds=model_args.freeze_embeds)
    total, trainable = count_parameters(model)
    logger.info("model: %s parameters, %s trainable", f"{total:,}", f"{trainable:,}")
    pad_label = -100 if data_args.ignore_pad_token_for_loss else tokenizer.pad_token_id
    trainer = ShardedSeq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=datasets.get("train"),
        eval_dataset=datasets.get("val"),
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=pad_label),
        processing_class=tokenizer,
        compute_metrics=build_compute_metrics(tokenizer, data_args.task) if training_args.predict_with_generate else None,
        **trainer_kwargs,
    )

    results = {}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=checkpoint)
        trainer.save_model()
        metrics = dict(train_result.metrics, train_n_objs=len(datasets["train"]))
        save_metrics(trainer, "train", metrics, results)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate(
            metric_key_prefix="val", max_length=data_args.val_max_target_length, num_beams=data_args.eval_beams
        )
        save_metrics(trainer, "val", dict(metrics, val_n_objs=len(datasets["val"])), results)

    if training_args.do_predict:
        output = trainer.predict(
            datasets["test"],
            metric_key_prefix="test",
            max_length=data_args.test_max_target_length,
            num_beams=data_args.eval_beams,
        )
        save_metrics(trainer, "test", dict(output.metrics, test_n_objs=len(datasets["test"])), results)
        if training_args.predict_with_generate and trainer.is_world_process_zero():
            ids = output.predictions[0] if isinstance(output.predictions, tuple) else output.predictions
            write_generations(f"{training_args.output_dir}/test_generations.txt", decode(tokenizer, ids))

    if trainer.is_world_process_zero():
        print_summary(results, training_args.output_dir)
    return trainer, results


def load_model(model_args, config, dtype, offload_config=None, source="--offload", stage=None):
    """With the --offload config's "inference" section (evaluation and prediction only): built
    empty, placed by a device map over devices, CPU RAM and disk, loaded a shard at a time
    (trainer_shard.offload.dispatch). At ZeRO-3 (`stage` 3, in any form): built on the meta device
    (`trainer_shard.loading.load_meta`), the Trainer reading each unit's weights a tensor at a time
    and keeping each rank's slice, so the whole model never exists on a rank, before training or
    evaluation alike. 16-bit parameters for the other sharded runs load a tensor at a time when
    the checkpoint allows (trainer_shard.loading): no moment with the whole checkpoint mapped next
    to them."""
    if offload_config is not None and offload_config.inference is not None:
        return load_dispatched(AutoModelForSeq2SeqLM, model_args.model_name_or_path, offload_config.inference,
                               config=config, source=str(source))  # fmt: skip
    if stage == 3:  # weights read when the Trainer shards it
        return load_meta(AutoModelForSeq2SeqLM, model_args.model_name_or_path, config, dtype, model_args.cache_dir)
    if dtype in (torch.bfloat16, torch.float16):
        model = load_pretrained_lean(AutoModelForSeq2SeqLM, model_args.model_name_or_path, config, dtype)
        if model is not None:
            return model
    return AutoModelForSeq2SeqLM.from_pretrained(
        model_args.model_name_or_path, config=config, cache_dir=model_args.cache_dir, dtype=dtype
    )


def load_dtype(training_args, stage=None):
    """Sharded or offloaded mixed precision keeps 16-bit parameters (fp32 masters live in the
    optimizer's shards): load them in 16 bits, never holding an fp32 copy of a big model.
    `--sharded_ddp auto`: once it chose a sharded `stage` (it may choose DDP)."""
    sharded = training_args.sharding_enabled and ("auto" not in training_args.sharded_ddp or stage is not None)
    half = half_dtype(precision(training_args))
    return half if sharded and half is not None else "auto"


def setup_logging(training_args) -> None:
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", datefmt="%H:%M:%S", handlers=[logging.StreamHandler(sys.stdout)]
    )
    level = training_args.get_process_log_level()
    logger.setLevel(level)
    transformers.utils.logging.set_verbosity(level)
    logging.getLogger("trainer_shard").setLevel(level)
    logger.info("process rank %s of %s, device %s", training_args.process_index, training_args.world_size, training_args.device)


def save_metrics(trainer, split: str, metrics: dict, results: dict) -> None:
    trainer.log_metrics(split, metrics)
    trainer.save_metrics(split, metrics)  # {split}_results.json and all_results.json
    results.update(metrics)


def print_summary(results: dict, output_dir: str) -> None:
    keys = ["train_loss", "train_runtime", "val_loss", "val_bleu", "val_chrf", "test_loss", "test_bleu", "test_chrf", "test_gen_len"]
    shown = [(k, results[k]) for k in keys if k in results]
    width = max((len(k) for k, _ in shown), default=0)
    print(f"\n***** results (all in {output_dir}/all_results.json) *****")
    for key, value in shown:
        print(f"  {key:<{width}} = {value:.4f}" if isinstance(value, float) else f"  {key:<{width}} = {value}")


def run(argv=None, **trainer_kwargs) -> int:
    """Exit status: 0; 2 for a mistake in the arguments, config or data (nothing written);
    3 when another rank failed (the message names it); 128 + N after signal N (SIGINT: 130,
    SIGTERM: 143), with a checkpoint under --save_on_interrupt."""
    try:
        main(argv, **trainer_kwargs)
    except TrainerShardError as e:
        print(f"finetune_trainer.py: error: {e}", file=sys.stderr)
        return 2
    except PeerFailedError as e:
        print(f"finetune_trainer.py: error: {e}", file=sys.stderr)
        return EXIT_PEER_FAILED
    except TrainingInterrupted as e:
        print(f"finetune_trainer.py: {e}", file=sys.stderr)
        return e.exit_code
    finally:
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


def relaunch_under_torchrun() -> None:
    """`accelerate launch --cpu --num_processes N` runs this script as one process, with no RANK or
    WORLD_SIZE (see guard.accelerate_cpu_launch): start its N ranks here with torchrun's launcher, on
    the MASTER_ADDR and MASTER_PORT accelerate set, as `torchrun --nproc_per_node N` would; exits
    with torchrun's status. Does nothing under any other launcher, or on a rank."""
    launch = accelerate_cpu_launch(launcher_argv(), sys.argv[0])
    if launch is None:
        return
    if (launch.num_machines or 1) > 1:
        print(f"finetune_trainer.py: error: `accelerate launch --cpu --num_machines {launch.num_machines}` starts "
              "one process a machine; run `torchrun --nnodes ... --nproc_per_node ...` on each machine instead",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    from torch.distributed.run import main as torchrun

    port = os.environ.get("MASTER_PORT", "29500")
    rendezvous = ["--standalone"] if port == "0" else ["--master_addr", os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                                        "--master_port", port]  # fmt: skip
    torchrun(["--nproc_per_node", str(launch.num_processes), *rendezvous, sys.argv[0], *sys.argv[1:]])
    sys.exit(0)  # a failed rank raises ChildFailedError: exit status 1, as torchrun's


if __name__ == "__main__":
    relaunch_under_torchrun()
    sys.exit(run())
