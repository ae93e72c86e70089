"""The offload config: a DeepSpeed-compatible JSON subset, checked whole before anything runs."""

from .load import OffloadConfig, load_config, stage_problems

__all__ = ["OffloadConfig", "load_config", "stage_problems"]
