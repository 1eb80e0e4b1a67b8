"""Upsampling math (nearest, bilinear) as separable per-axis gathers.

Destination pixel ``u`` (counted from the clip rect's origin) samples the source at

* nearest:  ``i = offset + floor(u / s)``
* bilinear: ``p = offset + (u + 1/2) / s - 1/2`` (half-pixel centres), or with align_corners
  ``p = offset + u (S - 1) / (S s - 1)`` for a source of ``S`` pixels; taps ``floor(p)`` and
  ``floor(p) + 1`` weighted ``1 - f`` and ``f``.

A tap outside the source reads 0 (ZERO) or the edge pixel (CLAMP). With CLAMP, offset 0 and the
whole destination this is exactly ``torch.nn.functional.interpolate`` (nearest, bilinear, both
align_corners values), which the standard case uses.

Otherwise each axis is a gather of at most two taps per output: the taps are computed on the
host in float64, taps that land on the same pixel (CLAMP) are merged (two taps of one output
on one pixel weigh exactly 1) and taps of weight 0 are dropped. The forward is
``y[u] = w0(u) x[i0(u)] + w1(u) x[i1(u)]`` per axis (nearest: a plain gather, exact); outputs
with no tap are 0. The gradient is its exact transpose, ``dx[i] = sum of w g[u]`` over the
taps ``(u, w)`` reading ``i``, as a deterministic gather-sum (`mpsnn.ops.shape.axis_adjoint`:
no atomics, linear in the image size). Bilinear weights and every sum are in the accumulation
dtype.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from mpsnn.ops._dtypes import acc_dtype, device_constant
from mpsnn.ops.shape import AxisAdjoint, apply_axis_adjoint, axis_adjoint, fresh

__all__ = [
    "AxisSampling",
    "UpsampleGeometry",
    "upsample_backward",
    "upsample_forward",
]


class AxisSampling(NamedTuple):
    """One axis: outputs ``u = first .. first + count - 1`` (counted from the clip origin) of a
    ``size``-pixel source at scale ``s``; ``offset`` as in the formulas; CLAMP or ZERO edges."""

    offset: int
    first: int
    count: int
    size: int
    scale: int
    clamp: bool


class UpsampleGeometry(NamedTuple):
    y: AxisSampling
    x: AxisSampling
    bilinear: bool
    align_corners: bool
    standard: bool  # offset 0, whole nominal destination, CLAMP: the F.interpolate case


def _output_taps(
    a: AxisSampling, bilinear: bool, align_corners: bool, k: int
) -> list[tuple[int, float]]:
    """The taps ``(source index, weight)`` of output ``k`` (``u = first + k``), merged per
    source pixel, without zero weights, sorted by index."""
    u = a.first + k
    if not bilinear:
        raw = [(a.offset + u // a.scale, 1.0)]
    else:
        if align_corners:
            out = a.size * a.scale
            p = a.offset + (u * (a.size - 1) / (out - 1) if out > 1 else 0.0)
        else:
            p = a.offset + (u + 0.5) / a.scale - 0.5
        i0 = math.floor(p)
        f = p - i0
        raw = [(i0, 1.0 - f), (i0 + 1, f)]
    taps: dict[int, float] = {}
    for i, w in raw:
        if not 0 <= i < a.size:
            if not a.clamp:
                continue  # ZERO: reads 0
            i = min(max(i, 0), a.size - 1)
        # Both taps clamped onto one pixel: (1 - f) + f is 1, exactly (not its float sum).
        taps[i] = 1.0 if i in taps else w
    return sorted((i, w) for i, w in taps.items() if w != 0.0)


# (c, w0, w1) per phase: see `_AxisPlan`.
Phase = tuple[int, float, float]


class _AxisPlan(NamedTuple):
    """One axis of the forward. Outputs ``[lo, hi)`` have taps (the others are 0).

    ``regular`` ``(a, J, phases)``: the outputs ``a + j s + ph`` (``j < J``, scale ``s``) read
    ``w0 x[c + j] + w1 x[c + j + 1]`` with ``(c, w0, w1) = phases[ph]`` (``w1 = 0``: one tap):
    a few weighted slices per phase, no index (nearest, and bilinear with half-pixel centres,
    away from the edges). ``gathered``: the ranges of the other outputs with taps, whose taps
    ``index[t]``, ``weight[t]`` (concatenated over the ranges) go through index_select;
    ``weight`` is ``None`` when each has one tap of weight 1. ``weighted``: some weight is not
    1 (compute in the accumulation dtype). ``adjoint`` is the transpose's plan."""

    count: int
    lo: int
    hi: int
    regular: tuple[int, int, tuple[Phase, ...]] | None
    gathered: tuple[tuple[int, int], ...]
    index: tuple[tuple[int, ...], ...]
    weight: tuple[tuple[float, ...], ...] | None
    weighted: bool
    adjoint: AxisAdjoint


def _regular_run(norm: list[Phase | None], lo: int, hi: int, s: int) -> tuple[int, int] | None:
    """The longest ``[a, a + J s)`` in ``[lo, hi)`` where output ``k + s`` reads one pixel
    further than output ``k`` with the same weights; ``None`` when shorter than two periods."""

    def next_period(k: int) -> bool:
        p, q = norm[k], norm[k + s]
        # Weights equal up to float64 rounding (p(u + s) = p(u) + 1 in exact arithmetic).
        return (
            p is not None
            and q is not None
            and q[0] == p[0] + 1
            and abs(q[1] - p[1]) <= 1e-12
            and abs(q[2] - p[2]) <= 1e-12
        )

    best, start = (lo, lo), lo
    for k in range(lo, hi - s + 1):
        if k < hi - s and next_period(k):
            continue
        if k - start > best[1] - best[0]:
            best = (start, k)
        start = k + 1
    a, b = best
    periods = (b - a + s) // s  # ok on [a, b): outputs [a, b + s) are regular
    return (a, periods) if b > a and periods >= 2 else None


@functools.lru_cache(maxsize=256)
def _axis_plan(a: AxisSampling, bilinear: bool, align_corners: bool) -> _AxisPlan:
    taps = [_output_taps(a, bilinear, align_corners, k) for k in range(a.count)]
    have = [k for k, t in enumerate(taps) if t]
    # The sample position grows with u, so the outputs with no tap (ZERO, wholly outside) are
    # a prefix and a suffix.
    lo, hi = (have[0], have[-1] + 1) if have else (0, 0)
    norm: list[Phase | None] = []
    for t in taps:
        if len(t) == 1:
            norm.append((t[0][0], t[0][1], 0.0))
        elif len(t) == 2 and t[1][0] == t[0][0] + 1:
            norm.append((t[0][0], t[0][1], t[1][1]))
        else:
            norm.append(None)
    run = _regular_run(norm, lo, hi, a.scale)
    regular = None
    gathered = [(lo, hi)]
    if run is not None:
        start, periods = run
        phases = []
        for ph in range(a.scale):
            c, w0, w1 = norm[start + ph]  # type: ignore[misc]
            phases.append((c, w0, w1))
        regular = (start, periods, tuple(phases))
        gathered = [(lo, start), (start + periods * a.scale, hi)]
    gathered = [(k0, k1) for k0, k1 in gathered if k1 > k0]
    rest = [taps[k] for k0, k1 in gathered for k in range(k0, k1)]
    if all(len(t) == 1 and t[0][1] == 1.0 for t in rest):
        index: tuple[tuple[int, ...], ...] = (tuple(t[0][0] for t in rest),)
        weight = None
    else:
        # An output with one tap gets a second of weight 0 on the same pixel, as
        # F.interpolate reads at the edge.
        first = [t[0] for t in rest]
        second = [t[1] if len(t) > 1 else (t[0][0], 0.0) for t in rest]
        index = (tuple(i for i, _ in first), tuple(i for i, _ in second))
        weight = (tuple(w for _, w in first), tuple(w for _, w in second))
    weighted = weight is not None or (
        regular is not None and any((w0, w1) != (1.0, 0.0) for _, w0, w1 in regular[2])
    )
    contributions: list[list[tuple[int, float]]] = [[] for _ in range(a.size)]
    for k, t in enumerate(taps):
        for i, w in t:
            contributions[i].append((k, w))
    # Each source pixel reads a window of outputs that moves by the scale per pixel.
    adjoint = axis_adjoint(contributions, a.count, step=a.scale)
    return _AxisPlan(a.count, lo, hi, regular, tuple(gathered), index, weight, weighted, adjoint)


def _plans(geom: UpsampleGeometry) -> tuple[_AxisPlan, _AxisPlan]:
    return (
        _axis_plan(geom.y, geom.bilinear, geom.align_corners),
        _axis_plan(geom.x, geom.bilinear, geom.align_corners),
    )


def _keys(geom: UpsampleGeometry) -> tuple[tuple[object, ...], tuple[object, ...]]:
    return (
        ("upsample-axis", geom.y, geom.bilinear, geom.align_corners),
        ("upsample-axis", geom.x, geom.bilinear, geom.align_corners),
    )


def _gather_taps(x: torch.Tensor, plan: _AxisPlan, dim: int, key: object) -> torch.Tensor:
    """The gathered outputs (``plan.gathered``, concatenated) along ``dim``."""
    taps = []
    for t, index in enumerate(plan.index):
        idx = device_constant(
            (key, "tap", t), torch.int64, x.device, lambda index=index: torch.tensor(index)
        )
        taps.append(x.index_select(dim, idx))
    if plan.weight is None:
        return taps[0]
    trailing = (1,) * (x.dim() - dim - 1)
    w0, w1 = (
        device_constant(
            (key, "weight", t),
            x.dtype,
            x.device,
            lambda weight=weight: torch.tensor(weight, dtype=torch.float64),
        ).view(-1, *trailing)
        for t, weight in enumerate(plan.weight)
    )
    return taps[0].mul_(w0).addcmul_(taps[1], w1)  # w0 x[i0] + w1 x[i1], in place


def _sample_axis(x: torch.Tensor, plan: _AxisPlan, dim: int, key: object) -> torch.Tensor:
    """The forward along ``dim``: ``plan.count`` outputs, in ``x``'s dtype."""
    if plan.regular is None:  # gathers only: [lo, hi), then the zeros around
        y = _gather_taps(x, plan, dim, key) if plan.hi > plan.lo else x.narrow(dim, 0, 0)
        if plan.hi - plan.lo == plan.count:
            return y
        pads = [0, 0] * (x.dim() - dim - 1) + [plan.lo, plan.count - plan.hi]
        return F.pad(y, pads)
    start, periods, phases = plan.regular
    scale = len(phases)
    if periods * scale == plan.count and scale == 1 and phases[0][1:] == (1.0, 0.0):
        return x.narrow(dim, phases[0][0], periods)  # a shifted copy: a view
    shape = list(x.shape)
    shape[dim] = plan.count
    out = x.new_empty(shape)
    out.narrow(dim, 0, plan.lo).zero_()
    out.narrow(dim, plan.hi, plan.count - plan.hi).zero_()
    # Phase ph of the regular run: every scale-th output, weighted shifted slices of x.
    run = out.narrow(dim, start, periods * scale).unflatten(dim, (periods, scale))
    for ph, (c, w0, w1) in enumerate(phases):
        dst = run.select(dim + 1, ph)
        if w0 == 1.0 and w1 == 0.0:
            dst.copy_(x.narrow(dim, c, periods))
            continue
        torch.mul(x.narrow(dim, c, periods), w0, out=dst)
        if w1 != 0.0:
            dst.add_(x.narrow(dim, c + 1, periods), alpha=w1)
    if plan.gathered:
        y = _gather_taps(x, plan, dim, key)
        at = 0
        for k0, k1 in plan.gathered:
            out.narrow(dim, k0, k1 - k0).copy_(y.narrow(dim, at, k1 - k0))
            at += k1 - k0
    return out


def upsample_forward(x: torch.Tensor, geom: UpsampleGeometry) -> torch.Tensor:
    """``(N, C, H, W) -> (N, C, y.count, x.count)``."""
    if geom.standard:
        size = (geom.y.count, geom.x.count)
        if geom.bilinear:
            return F.interpolate(x, size=size, mode="bilinear", align_corners=geom.align_corners)
        return F.interpolate(x, size=size, mode="nearest")
    py, px = _plans(geom)
    ky, kx = _keys(geom)
    weighted = py.weighted or px.weighted
    t = x.to(acc_dtype(x.dtype)) if weighted else x  # plain copies need no widening
    t = _sample_axis(t, px, 3, kx)
    t = _sample_axis(t, py, 2, ky)
    return fresh(t.to(x.dtype), x)


def upsample_backward(g: torch.Tensor, geom: UpsampleGeometry) -> torch.Tensor:
    """The transpose of `upsample_forward`: ``(N, C, y.count, x.count) -> (N, C, H, W)``."""
    if geom.standard and not geom.bilinear:  # nearest: each source pixel's block sums
        n, c = g.shape[:2]
        sy, sx = geom.y.scale, geom.x.scale
        blocks = g.reshape(n, c, geom.y.size, sy, geom.x.size, sx)
        return blocks.sum((3, 5), dtype=acc_dtype(g.dtype)).to(g.dtype)
    py, px = _plans(geom)
    ky, kx = _keys(geom)
    t = g.to(acc_dtype(g.dtype)) if py.adjoint.sums or px.adjoint.sums else g
    # Rows first: the reduction along dim 2 reads whole rows, the faster way round.
    t = apply_axis_adjoint(t, py.adjoint, 2, ky)
    t = apply_axis_adjoint(t, px.adjoint, 3, kx)
    return fresh(t.to(g.dtype), g)
