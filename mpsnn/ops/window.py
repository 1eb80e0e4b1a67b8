"""Turn the MPS window model into tensors a stride/dilation/padding operator can read.

`extract` returns ``(t, (pad_y, pad_x))`` such that an ordinary windowed operator (convolution,
pooling) with symmetric zero padding ``(pad_y, pad_x)``, the window's kernel, stride and
dilation, reading ``t`` from index 0, sees exactly the taps of the window model: output ``i``
reads ``start + stride * i + dilation * j`` of the source, where reads outside the source give
0 (`EdgeMode.ZERO`) or the nearest edge pixel (`EdgeMode.CLAMP`). The operator may produce more
outputs than ``count``; callers keep the first ``count``.

Per axis, the cheapest form is chosen (once per geometry: `plan_extract`):

* every tap inside the source: a view (``narrow``), no copy;
* ZERO, window starting ``p`` pixels before the image and ending at most ``p`` after it: a view
  plus the operator's own padding ``p`` (what ``F.conv2d(padding=p)`` does, no copy);
* anything else: a copy, zero-filled (ZERO) or edge-replicated (CLAMP).

`extract_adjoint` is the exact adjoint (transpose) of `extract` for a gradient ``g`` shaped like
``t``: crops become zero-embedding, zero padding is dropped, and every replicated read adds its
gradient back onto the edge pixel it copied (a deterministic sum, no atomics).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from mpsnn.core.geometry import AxisWindow, EdgeMode
from mpsnn.ops._dtypes import acc_dtype

__all__ = [
    "ExtractPlan",
    "apply_extract",
    "apply_extract_adjoint",
    "extract",
    "extract_adjoint",
    "insert_zeros",
    "pad_axis",
    "plan_extract",
]

_VIEW, _OPERATOR_PAD, _ZERO_COPY, _CLAMP_COPY = range(4)


class AxisPlan(NamedTuple):
    """How one axis is prepared: ``mode``, the source span ``[lo, hi)`` of ``size`` pixels,
    the operator padding ``pad`` and the prepared length ``length``."""

    mode: int
    lo: int
    hi: int
    size: int
    pad: int
    length: int

    @property
    def is_view(self) -> bool:
        """Every tap lies inside the source: the axis is a view, no copy, no padding."""
        return self.mode == _VIEW


class ExtractPlan(NamedTuple):
    y: AxisPlan
    x: AxisPlan
    pads: tuple[int, int]
    identity: bool  # the source is used as it is (no view, no copy)


def _plan_axis(a: AxisWindow, edge: EdgeMode, allow_pad: bool, whole_tail: bool) -> AxisPlan:
    lo, hi, size = a.start, a.stop, a.size
    if lo >= 0 and hi <= size:
        if whole_tail and lo == 0 and _same_outputs(a, hi, size, 0):
            hi = size  # the taps start at 0, and the unread tail makes no further output
        return AxisPlan(_VIEW, lo, hi, size, 0, hi - lo)
    if allow_pad and edge is EdgeMode.ZERO and lo < 0 < hi and hi - size <= -lo:
        end = min(hi, size)
        if whole_tail and _same_outputs(a, end, size, -lo):
            end = size
        return AxisPlan(_OPERATOR_PAD, 0, end, size, -lo, end)
    mode = _ZERO_COPY if edge is EdgeMode.ZERO else _CLAMP_COPY
    return AxisPlan(mode, lo, hi, size, 0, hi - lo)


def _same_outputs(a: AxisWindow, length: int, size: int, pad: int) -> bool:
    """Whether an operator padding ``pad`` on both sides makes as many outputs from ``size``
    pixels as from the first ``length`` (so reading the whole axis costs no extra output)."""
    return (size + 2 * pad - a.extent) // a.stride == (length + 2 * pad - a.extent) // a.stride


def plan_extract(
    ay: AxisWindow,
    ax: AxisWindow,
    edge: EdgeMode,
    *,
    allow_pad: bool = True,
    whole_tail: bool = False,
) -> ExtractPlan:
    """Decide, once per geometry, how `apply_extract` prepares each axis.

    Args:
        allow_pad: False when the operator cannot pad by itself (then the result is padded).
        whole_tail: the operator may read the source past the window's last tap (a strided
            convolution): an axis whose taps start at the image's first pixel keeps the whole
            image instead of a cropped view when that makes no further output. A cropped
            view of a channels-last image is not channels-last contiguous, so the operator
            would copy it, and its gradient would be embedded back by another copy (a 1x1
            stride-2 convolution on an even size reads all but the last row and column).
    """
    if edge not in (EdgeMode.ZERO, EdgeMode.CLAMP):
        raise ValueError(f"[extract] edge must be ZERO or CLAMP, got {edge.name}")
    py = _plan_axis(ay, edge, allow_pad, whole_tail)
    px = _plan_axis(ax, edge, allow_pad, whole_tail)
    identity = all(
        p.mode in (_VIEW, _OPERATOR_PAD) and p.lo == 0 and p.hi == p.size for p in (py, px)
    )
    return ExtractPlan(py, px, (py.pad, px.pad), identity)


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


def _apply_axis(x: torch.Tensor, dim: int, p: AxisPlan) -> torch.Tensor:
    mode, lo, hi, size = p.mode, p.lo, p.hi, p.size
    if mode in (_VIEW, _OPERATOR_PAD):
        return x if (lo == 0 and hi == size) else x.narrow(dim, lo, hi - lo)
    if mode == _ZERO_COPY:
        if hi <= 0 or lo >= size:
            return _zeros_like_axis(x, dim, hi - lo)
        return pad_axis(x, dim, -lo, hi - size)
    # CLAMP: crop to the overlap, then replicate the edge pixels outward.
    if hi <= 0 or lo >= size:
        edge_px = x.narrow(dim, 0 if hi <= 0 else size - 1, 1)
        shape = list(x.shape)
        shape[dim] = hi - lo
        return edge_px.expand(shape)
    c0, c1 = max(lo, 0), min(hi, size)
    core = x.narrow(dim, c0, c1 - c0)
    before, after = c0 - lo, hi - c1
    if before == 0 and after == 0:
        return core
    pads = (before, after, 0, 0) if dim == -1 else (0, 0, before, after)
    out = F.pad(core, pads)
    _replicate_border(out, pads)
    return out


def _overlap(p: AxisPlan) -> tuple[int, int]:
    """The part of the source an axis reads directly: ``[c0, c1)``."""
    if p.mode in (_VIEW, _OPERATOR_PAD):
        return p.lo, p.hi
    return max(p.lo, 0), min(p.hi, p.size)


def apply_extract(x: torch.Tensor, plan: ExtractPlan) -> torch.Tensor:
    """Prepare ``x`` (N, C, H, W) as ``plan`` says; pad by ``plan.pads`` in the operator."""
    if plan.identity:
        return x
    py, px = plan.y, plan.x
    (y0, y1), (x0, x1) = _overlap(py), _overlap(px)
    copies = py.mode >= _ZERO_COPY or px.mode >= _ZERO_COPY
    if not copies or y1 <= y0 or x1 <= x0:  # views only, or a window wholly off the image
        return _apply_axis(_apply_axis(x, -2, py), -1, px)
    # One pass for both axes: crop to the overlap (views), then pad every side at once.
    core = x[:, :, y0:y1, x0:x1]
    pads: tuple[int, ...] = (x0 - px.lo, px.hi - x1, y0 - py.lo, py.hi - y1)
    pads = tuple(
        p if m >= _ZERO_COPY else 0
        for p, m in zip(pads, (px.mode,) * 2 + (py.mode,) * 2, strict=True)
    )
    if max(pads) == 0:
        return core
    out = F.pad(core, pads)  # one bandwidth-bound pass; CLAMP then fills the border
    if py.mode == _CLAMP_COPY or px.mode == _CLAMP_COPY:
        _replicate_border(out, pads)
    return out


def _replicate_border(out: torch.Tensor, pads: tuple[int, ...]) -> None:
    """Fill the padded border of ``out`` with its edge pixels, in place (rows, then columns,
    so the corners take the corner pixel). Much faster than torch's replication_pad kernel,
    and the border is all it touches."""
    left, right, top, bottom = pads
    h, w = out.shape[-2:]
    if top:
        out[:, :, :top, left : w - right] = out[:, :, top : top + 1, left : w - right]
    if bottom:
        out[:, :, h - bottom :, left : w - right] = out[
            :, :, h - bottom - 1 : h - bottom, left : w - right
        ]
    if left:
        out[:, :, :, :left] = out[:, :, :, left : left + 1]
    if right:
        out[:, :, :, w - right :] = out[:, :, :, w - right - 1 : w - right]


def extract(
    x: torch.Tensor, ay: AxisWindow, ax: AxisWindow, edge: EdgeMode, *, allow_pad: bool = True
) -> tuple[torch.Tensor, tuple[int, int]]:
    """`plan_extract` and `apply_extract` in one call: returns ``(t, (pad_y, pad_x))``."""
    plan = plan_extract(ay, ax, edge, allow_pad=allow_pad)
    return apply_extract(x, plan), plan.pads


def _adjoint_axis(g: torch.Tensor, dim: int, p: AxisPlan) -> torch.Tensor:
    mode, lo, hi, size = p.mode, p.lo, p.hi, p.size
    if mode in (_VIEW, _OPERATOR_PAD):
        return pad_axis(g, dim, lo, size - hi)
    if mode == _ZERO_COPY:
        if hi <= 0 or lo >= size:
            return _zeros_like_axis(g, dim, size)
        return pad_axis(g, dim, lo, size - hi)
    # CLAMP: interior one-to-one (one pass), then each overflow summed onto its edge pixel.
    # The sums read only the overflow, in a fixed order (deterministic, no atomics).
    c0, c1 = max(lo, 0), min(hi, size)
    acc = acc_dtype(g.dtype)
    if c1 <= c0:  # every tap reads one edge pixel
        total = g.sum(dim, keepdim=True, dtype=acc).to(g.dtype)
        return pad_axis(total, dim, 0 if hi <= 0 else size - 1, size - 1 if hi <= 0 else 0)
    inner = g.narrow(dim, c0 - lo, c1 - c0)
    out = pad_axis(inner, dim, c0, size - c1) if (c0 or c1 < size) else inner.clone()
    if lo < 0:
        out.narrow(dim, 0, 1).add_(g.narrow(dim, 0, -lo).sum(dim, keepdim=True, dtype=acc))
    if hi > size:
        tail = g.narrow(dim, g.shape[dim] - (hi - size), hi - size)
        out.narrow(dim, size - 1, 1).add_(tail.sum(dim, keepdim=True, dtype=acc))
    return out


def apply_extract_adjoint(g: torch.Tensor, plan: ExtractPlan) -> torch.Tensor:
    """Adjoint of `apply_extract`: ``g`` is shaped like its result; returns the source shape."""
    if plan.identity:
        return g
    py, px = plan.y, plan.x
    if py.mode != _CLAMP_COPY and px.mode != _CLAMP_COPY:
        # Crops and zero padding only: one pad (zero-embedding) per side, in one call.
        pads = (px.lo, px.size - px.hi, py.lo, py.size - py.hi)
        if px.mode == _ZERO_COPY and (px.hi <= 0 or px.lo >= px.size):
            return _adjoint_axis(_adjoint_axis(g, -1, px), -2, py)
        if py.mode == _ZERO_COPY and (py.hi <= 0 or py.lo >= py.size):
            return _adjoint_axis(_adjoint_axis(g, -1, px), -2, py)
        if max(abs(p) for p in pads) == 0:
            return g
        return F.pad(g, pads)
    return _adjoint_axis(_adjoint_axis(g, -1, px), -2, py)


def extract_adjoint(
    g: torch.Tensor, ay: AxisWindow, ax: AxisWindow, edge: EdgeMode, *, allow_pad: bool = True
) -> torch.Tensor:
    """Adjoint of `extract` (same windows and edge mode)."""
    return apply_extract_adjoint(g, plan_extract(ay, ax, edge, allow_pad=allow_pad))


def insert_zeros(x: torch.Tensor, sy: int, sx: int) -> torch.Tensor:
    """``(stride - 1)`` zeros between pixels: (N, C, H, W) -> (N, C, (H-1)sy+1, (W-1)sx+1)."""
    if sy == 1 and sx == 1:
        return x
    n, c, h, w = x.shape
    out = x.new_zeros((n, c, (h - 1) * sy + 1, (w - 1) * sx + 1))
    out[:, :, ::sy, ::sx] = x
    return out
