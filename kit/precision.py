"""Names of numeric precisions and their torch dtypes: one table for training, export and estimates."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
"""A precision's name (as in `mixed_precision` and `kit export --dtype`) → its torch dtype."""


def torch_dtype(precision: str) -> torch.dtype:
    """The dtype of a precision name; `no` (no mixed precision) is fp32."""
    return DTYPES.get(precision, torch.float32)
