"""Resampling math of the resize and scale families: per-axis sampling taps, applied as sparse
axis operators.

Every operation here is separable: destination pixel ``(v, u)`` is
``sum_ij Ay[v, i] Ax[u, j] x[i, j]``, where each axis's taps ``A[u] = [(i, w), ...]`` are made on
the host in float64 from the geometry. Per axis, for a source of ``S`` pixels, with ``u`` the
destination position counted from the clip rect's origin and ``p`` the sampled source position
(pixel centres at integers):

* resize (`ResizeAxis`, ``R`` = the resize size): ``p = offset + (u + 1/2) S / R - 1/2``
  (half-pixel centres), or with align_corners ``p = offset + u (S - 1) / (R - 1)``
  (``p = offset`` when ``R = 1``); taps ``floor(p)`` and ``floor(p) + 1`` weighted ``1 - f`` and
  ``f``; a tap outside the source reads the edge pixel (CLAMP) or 0 (ZERO). With CLAMP, offset 0
  and the whole ``R``-pixel destination this is ``F.interpolate(size=..., mode="bilinear")``.
* crop (`CropAxis`, a region ``[a, a + s]`` in normalized coordinates, ``R`` outputs): TensorFlow's
  ``crop_and_resize`` sampling, ``p = a (S - 1) + u s (S - 1) / (R - 1)`` (``R = 1``:
  ``p = (a + s / 2) (S - 1)``); taps ``floor(p)``, ``ceil(p)``; a ``p`` outside ``[0, S - 1]``
  samples nothing, so that row or column of the crop is the extrapolation value 0. Positions
  within 1e-9 pixel of an edge count as on it (the rounding of ``a + s = 1``).
* scale (`ScaleAxis`, MPS ``MPSScaleTransform`` scale ``k`` and translation ``t``, in
  destination pixels): ``p = (u + 1/2 - t) / k - 1/2``. Bilinear: the resize taps. Lanczos
  (a = 3): the taps ``i`` with ``|i - p| < 3 m``, ``m = max(1, 1 / k)`` (the kernel is stretched
  by the reduction when downscaling, so it also low-passes), weights ``L((i - p) / m)`` with
  ``L(x) = sinc(x) sinc(x / 3)``, divided by their sum (a constant image stays constant); then
  CLAMP or ZERO as above (the weights are normalized over all taps, before the edge rule).

Taps that land on one pixel (CLAMP) are merged; zero weights are dropped. The forward applies
the x axis then the y axis, each as one deterministic gather-sum
(`mpsnn.ops.shape.apply_axis_adjoint`); the gradient applies the transposes in reverse order
(no atomics, so the sums are deterministic on every device). The crop stacks its regions along
each axis: the columns of every region are made in one pass, then each region's rows read its
own block of them, and the crops land region-major along channels (channel ``r C + c``).
Everything is computed in the accumulation dtype; no matrix product is involved, so TF32
settings do not matter.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from mpsnn.ops._dtypes import acc_dtype
from mpsnn.ops.shape import AxisAdjoint, apply_axis_adjoint, axis_adjoint, fresh

__all__ = [
    "CropAxis",
    "ResizeAxis",
    "ScaleAxis",
    "crop_backward",
    "crop_forward",
    "lanczos3",
    "resample_backward",
    "resample_forward",
]

Taps = tuple[tuple[tuple[int, float], ...], ...]  # per output: ((source index, weight), ...)
_EDGE_SNAP = 1e-9  # pixels: a crop position this close to an edge is on it


class ResizeAxis(NamedTuple):
    """One axis of `ResizeBilinear`: outputs ``u = first .. first + count - 1`` of an ``R``-pixel
    resize (``resize``) of a ``size``-pixel source; ``offset`` shifts the sampled positions."""

    offset: int
    first: int
    count: int  # type: ignore[assignment]  # a NamedTuple field named like a tuple method
    size: int
    resize: int
    align_corners: bool
    clamp: bool


class CropAxis(NamedTuple):
    """One axis of `CropAndResizeBilinear`: per region ``(start, extent)`` in normalized
    coordinates; outputs ``first .. first + count - 1`` of each ``resize``-pixel crop of a
    ``size``-pixel source. ``stacked``: region ``r`` reads its own copy of the source, at
    positions ``r size ..`` (the axis applied second); otherwise every region reads the same
    ``size`` positions."""

    regions: tuple[tuple[float, float], ...]
    first: int
    count: int  # type: ignore[assignment]  # a NamedTuple field named like a tuple method
    size: int
    resize: int
    stacked: bool


class ScaleAxis(NamedTuple):
    """One axis of an image scale: outputs ``first .. first + count - 1`` (counted from the
    transform's origin) of a ``size``-pixel source under ``dst = src * scale + translate``."""

    first: int
    count: int  # type: ignore[assignment]  # a NamedTuple field named like a tuple method
    size: int
    scale: float
    translate: float
    lanczos: bool
    clamp: bool


def lanczos3(x: float) -> float:
    """The Lanczos kernel with a = 3: ``sinc(x) sinc(x / 3)`` on ``|x| < 3``, else 0."""
    if x == 0.0:
        return 1.0
    if abs(x) >= 3.0:
        return 0.0
    px = math.pi * x
    return 3.0 * math.sin(px) * math.sin(px / 3.0) / (px * px)


def _edge(raw: list[tuple[int, float]], size: int, clamp: bool) -> tuple[tuple[int, float], ...]:
    """Apply the edge rule to ``raw`` taps, merge taps on one pixel, drop zero weights."""
    taps: dict[int, float] = {}
    for i, w in raw:
        if not 0 <= i < size:
            if not clamp:
                continue  # ZERO: reads 0
            i = min(max(i, 0), size - 1)
        taps[i] = taps.get(i, 0.0) + w
    return tuple(sorted((i, w) for i, w in taps.items() if w != 0.0))


def _linear(p: float, size: int, clamp: bool) -> tuple[tuple[int, float], ...]:
    i0 = math.floor(p)
    f = p - i0
    raw = [(i0, 1.0 - f), (i0 + 1, f)]
    taps = _edge(raw, size, clamp)
    if clamp and len(taps) == 1 and f != 0.0:
        # Both taps clamped onto one pixel: (1 - f) + f is 1, exactly (not its float sum).
        return ((taps[0][0], 1.0),)
    return taps


def _resize_taps(a: ResizeAxis) -> Taps:
    out = []
    for u in range(a.first, a.first + a.count):
        if a.align_corners:
            p = a.offset + (u * (a.size - 1) / (a.resize - 1) if a.resize > 1 else 0.0)
        else:
            p = a.offset + (u + 0.5) * a.size / a.resize - 0.5
        out.append(_linear(p, a.size, a.clamp))
    return tuple(out)


def _crop_position(start: float, extent: float, u: int, size: int, resize: int) -> float:
    if resize > 1:
        return start * (size - 1) + u * (extent * (size - 1) / (resize - 1))
    return (start + 0.5 * extent) * (size - 1)


def _crop_taps(a: CropAxis) -> Taps:
    """Region ``r``'s output ``k`` is target ``r count + k``; it reads positions ``r size + i``
    (stacked) or ``i``."""
    out: list[tuple[tuple[int, float], ...]] = []
    last = a.size - 1
    for r, (start, extent) in enumerate(a.regions):
        base = r * a.size if a.stacked else 0
        for u in range(a.first, a.first + a.count):
            p = _crop_position(start, extent, u, a.size, a.resize)
            if -_EDGE_SNAP < p < 0.0:
                p = 0.0
            elif last < p < last + _EDGE_SNAP:
                p = float(last)
            if not 0.0 <= p <= last:
                out.append(())  # extrapolated: the value 0
                continue
            i0 = math.floor(p)
            f = p - i0
            taps = [(base + i0, 1.0)] if f == 0.0 else [(base + i0, 1.0 - f), (base + i0 + 1, f)]
            out.append(tuple(taps))
    return tuple(out)


def _scale_taps(a: ScaleAxis) -> Taps:
    out = []
    for u in range(a.first, a.first + a.count):
        p = (u + 0.5 - a.translate) / a.scale - 0.5
        if not a.lanczos:
            out.append(_linear(p, a.size, a.clamp))
            continue
        m = max(1.0, 1.0 / a.scale)
        support = 3.0 * m
        lo, hi = math.floor(p - support) + 1, math.ceil(p + support) - 1
        raw = [(i, lanczos3((i - p) / m)) for i in range(lo, hi + 1)]
        total = math.fsum(w for _, w in raw)
        out.append(_edge([(i, w / total) for i, w in raw], a.size, a.clamp))
    return tuple(out)


class _Operator(NamedTuple):
    """One axis as a sparse operator: ``forward`` maps ``positions`` source positions to
    ``targets`` outputs; ``adjoint`` is its transpose."""

    forward: AxisAdjoint
    adjoint: AxisAdjoint


@functools.lru_cache(maxsize=256)
def _operator(spec: ResizeAxis | CropAxis | ScaleAxis) -> _Operator:
    if isinstance(spec, ResizeAxis):
        taps, positions = _resize_taps(spec), spec.size
    elif isinstance(spec, CropAxis):
        taps = _crop_taps(spec)
        positions = spec.size * len(spec.regions) if spec.stacked else spec.size
    else:
        taps, positions = _scale_taps(spec), spec.size
    contributions: list[list[tuple[int, float]]] = [[] for _ in range(positions)]
    for u, t in enumerate(taps):
        for i, w in t:
            contributions[i].append((u, w))
    return _Operator(axis_adjoint(taps, positions), axis_adjoint(contributions, len(taps)))


def _apply(
    t: torch.Tensor, spec: ResizeAxis | CropAxis | ScaleAxis, dim: int, adjoint: bool
) -> torch.Tensor:
    op = _operator(spec)
    plan = op.adjoint if adjoint else op.forward
    return apply_axis_adjoint(t, plan, dim, ("resample-axis", spec, adjoint))


def _standard(a: ResizeAxis | ScaleAxis) -> bool:
    """Whether a resize axis is ``F.interpolate``'s: offset 0, the whole destination, CLAMP."""
    return (
        isinstance(a, ResizeAxis) and a.clamp and a.offset == a.first == 0 and a.count == a.resize
    )


def resample_forward(
    x: torch.Tensor, ay: ResizeAxis | ScaleAxis, ax: ResizeAxis | ScaleAxis
) -> torch.Tensor:
    """``(N, C, H, W) -> (N, C, ay.count, ax.count)``, in ``x``'s dtype."""
    if isinstance(ay, ResizeAxis) and _standard(ay) and _standard(ax):
        size = (ay.count, ax.count)
        return F.interpolate(x, size=size, mode="bilinear", align_corners=ay.align_corners)
    t = x.to(acc_dtype(x.dtype))
    t = _apply(t, ax, 3, adjoint=False)
    t = _apply(t, ay, 2, adjoint=False)
    return fresh(t.to(x.dtype), x)


def resample_backward(
    g: torch.Tensor, ay: ResizeAxis | ScaleAxis, ax: ResizeAxis | ScaleAxis
) -> torch.Tensor:
    """The transpose of `resample_forward`: ``(N, C, ay.count, ax.count) -> (N, C, H, W)``."""
    t = g.to(acc_dtype(g.dtype))
    t = _apply(t, ay, 2, adjoint=True)
    t = _apply(t, ax, 3, adjoint=True)
    return fresh(t.to(g.dtype), g)


def crop_forward(x: torch.Tensor, ay: CropAxis, ax: CropAxis) -> torch.Tensor:
    """``(N, C, H, W) -> (N, R C, ay.count, ax.count)`` for ``R`` regions, region-major along
    channels (crop ``r`` of channel ``c`` is channel ``r C + c``)."""
    n, c, h, _ = x.shape
    r = len(ay.regions)
    t = _apply(x.to(acc_dtype(x.dtype)), ax, 3, adjoint=False)  # (N, C, H, R * cx)
    # Region r's rows read region r's columns: stack the regions' copies of the rows.
    t = t.view(n, c, h, r, ax.count).permute(0, 1, 3, 2, 4).reshape(n, c, r * h, ax.count)
    t = _apply(t, ay, 2, adjoint=False)  # (N, C, R * cy, cx)
    t = t.view(n, c, r, ay.count, ax.count).transpose(1, 2).reshape(n, r * c, ay.count, ax.count)
    return fresh(t.to(x.dtype), x)


def crop_backward(g: torch.Tensor, ay: CropAxis, ax: CropAxis) -> torch.Tensor:
    """The transpose of `crop_forward`: ``(N, R C, ay.count, ax.count) -> (N, C, H, W)``."""
    n, rc = g.shape[:2]
    r = len(ay.regions)
    c = rc // r
    t = g.to(acc_dtype(g.dtype)).view(n, r, c, ay.count, ax.count).transpose(1, 2)
    t = _apply(t.reshape(n, c, r * ay.count, ax.count), ay, 2, adjoint=True)  # (N, C, R H, cx)
    h = ay.size
    t = t.view(n, c, r, h, ax.count).permute(0, 1, 3, 2, 4).reshape(n, c, h, r * ax.count)
    t = _apply(t, ax, 3, adjoint=True)  # (N, C, H, W)
    return fresh(t.to(g.dtype), g)
