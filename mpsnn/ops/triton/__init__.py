"""CUDA fast paths written in Triton, and the one place that decides when they run.

A fast path computes the same function as the portable PyTorch path it replaces and is tested
against it (on the GPU machine, and on the CPU through Triton's interpreter at small sizes).
It runs for CUDA tensors when Triton is importable and the configuration is one it handles;
`set_enabled(False)` forces the portable paths (for comparisons and debugging).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = [
    "available",
    "dropout_apply",
    "enabled",
    "max_pool_backward",
    "pool_tiles",
    "set_enabled",
]

_enabled = True


@functools.cache
def available() -> bool:
    """True when Triton can be imported."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def set_enabled(flag: bool) -> None:
    """Turn the Triton fast paths on or off for the whole process."""
    global _enabled
    _enabled = bool(flag)


def enabled() -> bool:
    return _enabled


def _runs(*tensors: torch.Tensor) -> bool:
    return _enabled and all(t.is_cuda for t in tensors) and available()


def max_pool_backward(g: torch.Tensor, x: torch.Tensor, geom: Any) -> torch.Tensor | None:
    """The Triton max-pool gradient when it applies (non-overlapping windows, stride ==
    kernel, no dilation, inside the image; CUDA; float16/bfloat16/float32), else None."""
    if not (_runs(g, x) and pool_tiles(geom)):
        return None
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    from mpsnn.ops.triton.pooling import max_pool_backward_triton

    return max_pool_backward_triton(g, x, geom)


def pool_tiles(geom: Any) -> bool:
    """Windows of ``geom`` are disjoint and inside the image (the Triton kernel's case)."""
    for a, p in ((geom.y, geom.plan.y), (geom.x, geom.plan.x)):
        if a.stride != a.kernel or a.dilation != 1 or not p.is_view:
            return False
    return True


def dropout_apply(
    t: torch.Tensor, key: torch.Tensor, first_image: int, geom: Any
) -> torch.Tensor | None:
    """The Triton dropout for CUDA tensors in float16, bfloat16 or float32, else None (float64
    runs on the portable path)."""
    if not (_runs(t) and t.dtype in (torch.float16, torch.bfloat16, torch.float32)):
        return None
    from mpsnn.ops.triton.dropout import dropout_apply_triton

    return dropout_apply_triton(t, key, first_image, geom)
