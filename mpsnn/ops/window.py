"""Turn the MPS window model into tensors a stride/dilation/padding operator can read.

`extract` returns ``(t, (pad_y, pad_x))`` such that an ordinary windowed operator (convolution,
pooling) with symmetric zero padding ``(pad_y, pad_x)``, the window's kernel, stride and
dilation, reading ``t`` from index 0, sees exactly the taps of the window model: output ``i``
reads ``start + stride * i + dilation * j`` of the source, where reads outside the source give
0 (`EdgeMode.ZERO`) or the nearest edge pixel (`EdgeMode.CLAMP`). The operator may produce more
outputs than ``count``; callers keep the first ``count``.

Per axis, the cheapest form is chosen:

* every tap inside the source: a view (``narrow``), no copy;
* ZERO, window starting ``p`` pixels before the image and ending at most ``p`` after it: a view
  plus the operator's own padding ``p`` (what ``F.conv2d(padding=p)`` does, no copy);
* anything else: a copy, zero-filled (ZERO) or edge-replicated (CLAMP).

`extract_adjoint` is the exact adjoint (transpose) of `extract` for a gradient ``g`` shaped like
``t``: crops become zero-embedding, zero padding is dropped, and every replicated read adds its
gradient back onto the edge pixel it copied (a deterministic sum, no atomics).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpsnn.core.geometry import AxisWindow, EdgeMode
from mpsnn.ops._dtypes import acc_dtype

__all__ = ["extract", "extract_adjoint", "insert_zeros", "pad_axis"]


def pad_axis(t: torch.Tensor, dim: int, before: int, after: int) -> torch.Tensor:
    """Zero-pad (positive) or crop (negative) dimension ``dim`` (-1 or -2) of a 4-D tensor."""
    if before == 0 and after == 0:
        return t
    size = t.shape[dim]
    if -before >= size or -after >= size:  # nothing of t survives the crop
        return _zeros_like_axis(t, dim, size + before + after)
    pads = (before, after) if dim == -1 else (0, 0, before, after)
    return F.pad(t, pads)


def _zeros_like_axis(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = length
    return t.new_zeros(shape)


def _extract_axis(
    x: torch.Tensor, dim: int, a: AxisWindow, edge: EdgeMode, allow_pad: bool
) -> tuple[torch.Tensor, int]:
    lo, hi, size = a.start, a.stop, a.size
    if lo >= 0 and hi <= size:
        return (x if lo == 0 and hi == size else x.narrow(dim, lo, hi - lo)), 0
    if allow_pad and edge is EdgeMode.ZERO and lo < 0 < hi and hi - size <= -lo:
        length = min(hi, size)
        return (x if length == size else x.narrow(dim, 0, length)), -lo
    if edge is EdgeMode.ZERO:
        if hi <= 0 or lo >= size:
            return _zeros_like_axis(x, dim, hi - lo), 0
        return pad_axis(x, dim, -lo, hi - size), 0
    # CLAMP: crop to the overlap, then replicate the edge pixels outward.
    if hi <= 0 or lo >= size:
        edge_px = x.narrow(dim, 0 if hi <= 0 else size - 1, 1)
        shape = list(x.shape)
        shape[dim] = hi - lo
        return edge_px.expand(shape), 0
    c0, c1 = max(lo, 0), min(hi, size)
    core = x.narrow(dim, c0, c1 - c0)
    before, after = c0 - lo, hi - c1
    if before == 0 and after == 0:
        return core, 0
    pads = (before, after, 0, 0) if dim == -1 else (0, 0, before, after)
    if core.dtype in (torch.float16, torch.bfloat16) and core.device.type == "cpu":
        # replication padding has no low-precision CPU kernel in every torch build
        return F.pad(core.float(), pads, mode="replicate").to(core.dtype), 0
    return F.pad(core, pads, mode="replicate"), 0


def extract(
    x: torch.Tensor, ay: AxisWindow, ax: AxisWindow, edge: EdgeMode, *, allow_pad: bool = True
) -> tuple[torch.Tensor, tuple[int, int]]:
    """Prepare ``x`` (N, C, H, W) for a windowed operator; see the module docstring.

    Args:
        allow_pad: False when the operator cannot pad by itself (then the result is padded).

    Returns:
        ``(t, (pad_y, pad_x))``.
    """
    if edge not in (EdgeMode.ZERO, EdgeMode.CLAMP):
        raise ValueError(f"[extract] edge must be ZERO or CLAMP, got {edge.name}")
    t, py = _extract_axis(x, -2, ay, edge, allow_pad)
    t, px = _extract_axis(t, -1, ax, edge, allow_pad)
    return t, (py, px)


def _adjoint_axis(
    g: torch.Tensor, dim: int, a: AxisWindow, edge: EdgeMode, pad: int
) -> torch.Tensor:
    lo, hi, size = a.start, a.stop, a.size
    if lo >= 0 and hi <= size:
        return pad_axis(g, dim, lo, size - hi)
    if pad:  # the operator padded by itself; g covers [0, min(hi, size))
        return pad_axis(g, dim, 0, size - g.shape[dim])
    if edge is EdgeMode.ZERO:
        if hi <= 0 or lo >= size:
            return _zeros_like_axis(g, dim, size)
        return pad_axis(g, dim, lo, size - hi)
    # CLAMP: interior one-to-one, overflow summed onto the edge pixels.
    out = _zeros_like_axis(g, dim, size)
    c0, c1 = max(lo, 0), min(hi, size)
    if c1 > c0:
        out.narrow(dim, c0, c1 - c0).copy_(g.narrow(dim, c0 - lo, c1 - c0))
    if lo < 0:
        n_before = min(-lo, hi - lo)
        out.narrow(dim, 0, 1).add_(
            g.narrow(dim, 0, n_before).sum(dim, keepdim=True, dtype=acc_dtype(g.dtype))
        )
    if hi > size:
        n_after = min(hi - size, hi - lo)
        tail = g.narrow(dim, g.shape[dim] - n_after, n_after)
        out.narrow(dim, size - 1, 1).add_(tail.sum(dim, keepdim=True, dtype=acc_dtype(g.dtype)))
    return out


def extract_adjoint(
    g: torch.Tensor, ay: AxisWindow, ax: AxisWindow, edge: EdgeMode, pads: tuple[int, int]
) -> torch.Tensor:
    """Adjoint of `extract`: ``g`` is shaped like ``t``; returns a tensor shaped like ``x``."""
    g = _adjoint_axis(g, -1, ax, edge, pads[1])
    return _adjoint_axis(g, -2, ay, edge, pads[0])


def insert_zeros(x: torch.Tensor, sy: int, sx: int) -> torch.Tensor:
    """``(stride - 1)`` zeros between pixels: (N, C, H, W) -> (N, C, (H-1)sy+1, (W-1)sx+1)."""
    if sy == 1 and sx == 1:
        return x
    n, c, h, w = x.shape
    out = x.new_zeros((n, c, (h - 1) * sy + 1, (w - 1) * sx + 1))
    out[:, :, ::sy, ::sx] = x
    return out
