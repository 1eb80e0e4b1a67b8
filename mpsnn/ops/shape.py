"""Shape math: HWC-order reshape, and padding with every MPS edge mode as per-axis maps.

Reshape keeps each image's elements in the HWC linear order (channel fastest, as MPS packs
texels): ``(C, H, W) -> (C', H', W')`` with ``C H W = C' H' W'``.

Padding reads, for output ``u``, source ``i = start + u`` mapped by the edge mode: ZERO and
CONSTANT read the fill value outside, CLAMP the nearest edge, MIRROR reflects without repeating
the edge (``-1 -> 1``), MIRROR_WITH_EDGE repeating it (``-1 -> 0``). Per axis this is a 0/1
matrix ``M`` (outputs x source pixels); ``y = M_y x M_x^T + fill outside`` and the gradient is
``M_y^T g M_x``: every source pixel sums the gradients of all the positions copied from it.
"""

from __future__ import annotations

import torch

from mpsnn.core.geometry import EdgeMode
from mpsnn.ops._dtypes import device_constant

__all__ = ["pad_matrix", "pad_matrix_on", "reshape_hwc"]


def _reflect(i: int, size: int, with_edge: bool) -> int:
    if size == 1:
        return 0
    if with_edge:  # ... 1 0 | 0 1 2 | 2 1 ...
        period = 2 * size
        i %= period
        return i if i < size else period - 1 - i
    period = 2 * (size - 1)  # ... 2 1 | 0 1 2 | 1 0 ...
    i %= period
    return i if i < size else period - i


def pad_matrix(start: int, count: int, size: int, mode: EdgeMode) -> torch.Tensor:
    """``(count, size)`` float64 0/1 matrix of one axis (rows of 0 read the fill value)."""
    m = torch.zeros(count, size, dtype=torch.float64)
    for u in range(count):
        i = start + u
        if 0 <= i < size:
            m[u, i] = 1.0
        elif mode is EdgeMode.CLAMP:
            m[u, min(max(i, 0), size - 1)] = 1.0
        elif mode in (EdgeMode.MIRROR, EdgeMode.MIRROR_WITH_EDGE):
            m[u, _reflect(i, size, mode is EdgeMode.MIRROR_WITH_EDGE)] = 1.0
    return m


def pad_matrix_on(
    start: int, count: int, size: int, mode: EdgeMode, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """`pad_matrix` in ``dtype`` on ``device``, built once per geometry (shared: read only)."""
    key = ("pad", start, count, size, mode)
    return device_constant(key, dtype, device, lambda: pad_matrix(start, count, size, mode))


def reshape_hwc(x: torch.Tensor, c: int, h: int, w: int) -> torch.Tensor:
    """``(N, C0, H0, W0) -> (N, c, h, w)`` in the HWC linear order of each image."""
    n = x.shape[0]
    return x.permute(0, 2, 3, 1).reshape(n, h, w, c).permute(0, 3, 1, 2)
