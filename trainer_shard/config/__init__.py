"""The offload config: DeepSpeed's config schema, a decision for every key, checked whole before
anything runs."""

from .load import OffloadConfig, load_config, stage_notes, stage_problems

__all__ = ["OffloadConfig", "load_config", "stage_notes", "stage_problems"]
