"""Accumulation precision (at least float32) and the small host-built constants the ops
reuse."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch

__all__ = ["acc_dtype", "device_constant", "widen"]


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype for reductions and accumulations: at least float32 (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def widen(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its accumulation dtype (`acc_dtype`); float32 and float64 come back as they are."""
    return t.to(acc_dtype(t.dtype))


_CONSTANTS: OrderedDict[tuple[Hashable, torch.dtype, torch.device], torch.Tensor] = OrderedDict()
_MAX_CONSTANTS = 256


def device_constant(
    key: Hashable, dtype: torch.dtype, device: torch.device, build: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """``build()`` (a small tensor made on the host from geometry: a sampling matrix, a divisor)
    converted to ``dtype`` on ``device``, made once per ``key`` and kept (least recently used
    out first). Rebuilding it for every run would copy from the host each time, and on CUDA a
    copy from pageable memory waits for the stream. ``key`` must determine ``build()``'s value;
    the tensor returned is shared and must not be written."""
    full_key = (key, dtype, torch.device(device))
    t = _CONSTANTS.get(full_key)
    if t is None:
        t = build().to(device=device, dtype=dtype)
        _CONSTANTS[full_key] = t
        if len(_CONSTANTS) > _MAX_CONSTANTS:
            _CONSTANTS.popitem(last=False)
    else:
        _CONSTANTS.move_to_end(full_key)
    return t
