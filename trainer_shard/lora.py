"""LoRA as `finetune_trainer.py --use_peft` trains it and `trainer-shard estimate --use_peft`
counts it: one set of defaults (TRL's `ModelConfig` names) and one PEFT configuration."""

DEFAULTS = {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "lora_target_modules": None,
            "lora_modules_to_save": None}  # fmt: skip


def lora_config(r: int = DEFAULTS["lora_r"], alpha: int = DEFAULTS["lora_alpha"],
                dropout: float = DEFAULTS["lora_dropout"], target_modules=None, modules_to_save=None):
    """`peft.LoraConfig` for a seq2seq model (task SEQ_2_SEQ_LM, no bias); `target_modules` None:
    PEFT's for the model type; ["all-linear"] as PEFT takes the string."""
    from peft import LoraConfig

    if target_modules == ["all-linear"]:
        target_modules = "all-linear"  # a list is matched by module name
    return LoraConfig(task_type="SEQ_2_SEQ_LM", r=r, lora_alpha=alpha, lora_dropout=dropout,
                      target_modules=target_modules, bias="none", modules_to_save=modules_to_save)  # fmt: skip
