"""Accumulation precision (SPEC §1.4)."""

from __future__ import annotations

import torch

__all__ = ["acc_dtype"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for reductions and accumulations: at least float32 (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
