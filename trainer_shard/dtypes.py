"""Dtypes by name, and the run's precision: the one table every flag, config key and CLI uses.

    DTYPES["bf16"] is DTYPES["bfloat16"] is torch.bfloat16
    precision(args)        # "bf16" | "fp16" | "fp32", from --bf16 / --fp16
    half_dtype("bf16")     # torch.bfloat16; None for "fp32" (parameters stay fp32)
"""

import torch

from .constants import DTYPE_NAMES, PRECISIONS

_TORCH = (torch.float32, torch.bfloat16, torch.float16)  # in the order of PRECISIONS and DTYPE_NAMES
DTYPES = {**dict(zip(DTYPE_NAMES, _TORCH)), **dict(zip(PRECISIONS, _TORCH))}


def precision(args) -> str:
    """The precision TrainingArguments ask for: "bf16", "fp16" or "fp32"."""
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def half_dtype(precision_name: str):
    """The 16-bit dtype of a precision ("bf16", "fp16" or their torch names), None for fp32."""
    dtype = DTYPES[precision_name]
    return None if dtype == torch.float32 else dtype
