"""Upsampling math (nearest, bilinear) as separable per-axis slices and gathers.

Destination pixel ``u`` (counted from the clip rect's origin) samples the source at

* nearest:  ``i = offset + floor(u / s)``
* bilinear: ``p = offset + (u + 1/2) / s - 1/2`` (half-pixel centres), or with align_corners
  ``p = offset + u (S - 1) / (S s - 1)`` for a source of ``S`` pixels; taps ``floor(p)`` and
  ``floor(p) + 1`` weighted ``1 - f`` and ``f``.

A tap outside the source reads 0 (ZERO) or the edge pixel (CLAMP). With CLAMP, offset 0 and the
whole destination this is exactly ``torch.nn.functional.interpolate`` (nearest, bilinear, both
align_corners values), which the standard case uses.

Otherwise each axis samples at most two taps per output: the taps are computed on the host in
float64, taps that land on the same pixel (CLAMP) are merged (two taps of one output on one
pixel weigh exactly 1) and taps of weight 0 are dropped. The forward is
``y[u] = w0(u) x[i0(u)] + w1(u) x[i1(u)]`` per axis (nearest: a copy, exact); outputs with no
tap are 0. Where outputs ``u`` and ``u + s`` read one pixel apart with the same weights
(nearest, and half-pixel bilinear away from the edges), each of the ``s`` phases is made from
shifted slices of ``x``; the other outputs (align_corners, the edges) go through index_select.
The gradient is the exact transpose, ``dx[i] = sum of w g[u]`` over the taps ``(u, w)`` reading
``i``, as a deterministic gather-sum (`mpsnn.ops.shape.axis_adjoint`: no atomics, linear in the
image size; the interior sums windows of ``g`` that move by ``s`` per pixel). Weights and sums
are in the accumulation dtype; no matrix product is involved, so TF32 settings do not matter.
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
    count: int  # type: ignore[assignment]  # a NamedTuple field named like a tuple method
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
    """One axis of the forward. Outputs ``[lo, hi)`` have taps (the others are 0): output
    ``lo + k`` reads ``weight[0][k] x[index[0][k]] + weight[1][k] x[index[1][k]]`` (one tap
    per output, ``weight`` ``None``, when every output reads one pixel with weight 1).

    ``regular`` ``(a, J, phases)``: the outputs ``a + j s + ph`` (``j < J``, scale ``s``) read
    ``w0 x[c + j] + w1 x[c + j + 1]`` with ``(c, w0, w1) = phases[ph]`` (``w1 = 0``: one tap),
    so they can be made from shifted slices of ``x``, without an index (nearest, and bilinear
    with half-pixel centres, away from the edges); ``None`` when no such run is two periods
    long. ``weighted``: some weight is not 1 (compute in the accumulation dtype). ``adjoint``
    is the transpose's plan."""

    count: int  # type: ignore[assignment]  # a NamedTuple field named like a tuple method
    lo: int
    hi: int
    index: tuple[tuple[int, ...], ...]  # type: ignore[assignment]  # a NamedTuple field named like a tuple method
    weight: tuple[tuple[float, ...], ...] | None
    regular: tuple[int, int, tuple[Phase, ...]] | None
    adjoint: AxisAdjoint

    @property
    def weighted(self) -> bool:
        return self.weight is not None


def _regular_run(norm: list[Phase | None], lo: int, hi: int, s: int) -> tuple[int, int] | None:
    """The longest ``[a, a + J s)`` in ``[lo, hi)`` where output ``k + s`` reads one pixel
    further than output ``k`` with the same weights, as ``(a, J)``; ``None`` when ``J < 2``."""

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
    periods = (b - a + s) // s  # next_period holds on [a, b): outputs [a, b + s) are regular
    return (a, periods) if b > a and periods >= 2 else None


@functools.lru_cache(maxsize=256)
def _axis_plan(a: AxisSampling, bilinear: bool, align_corners: bool) -> _AxisPlan:
    taps = [_output_taps(a, bilinear, align_corners, k) for k in range(a.count)]
    have = [k for k, t in enumerate(taps) if t]
    # The sample position grows with u, so the outputs with no tap (ZERO, wholly outside) are
    # a prefix and a suffix.
    lo, hi = (have[0], have[-1] + 1) if have else (0, 0)
    inner = taps[lo:hi]
    if all(len(t) == 1 and t[0][1] == 1.0 for t in inner):
        index: tuple[tuple[int, ...], ...] = (tuple(t[0][0] for t in inner),)
        weight = None
    else:
        # An output with one tap gets a second of weight 0 on the same pixel, as
        # F.interpolate reads at the edge.
        first = [t[0] for t in inner]
        second = [t[1] if len(t) > 1 else (t[0][0], 0.0) for t in inner]
        index = (tuple(i for i, _ in first), tuple(i for i, _ in second))
        weight = (tuple(w for _, w in first), tuple(w for _, w in second))
    norm: list[Phase | None] = []
    for t in taps:
        if len(t) == 1:
            norm.append((t[0][0], t[0][1], 0.0))
        elif len(t) == 2 and t[1][0] == t[0][0] + 1:
            norm.append((t[0][0], t[0][1], t[1][1]))
        else:
            norm.append(None)
    run = _regular_run(norm, lo, hi, a.scale)
    regular: tuple[int, int, tuple[Phase, ...]] | None = None
    if run is not None:
        start, periods = run
        phases = tuple(norm[start + ph] for ph in range(a.scale))
        regular = (start, periods, phases)  # type: ignore[assignment]  # a run has no None phase
    contributions: list[list[tuple[int, float]]] = [[] for _ in range(a.size)]
    for k, t in enumerate(taps):
        for i, w in t:
            contributions[i].append((k, w))
    # Each source pixel reads a window of outputs that moves by the scale per pixel.
    adjoint = axis_adjoint(contributions, a.count, step=a.scale)
    return _AxisPlan(a.count, lo, hi, index, weight, regular, adjoint)


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


def _gather_taps(
    x: torch.Tensor, plan: _AxisPlan, dim: int, key: object, k0: int, k1: int
) -> torch.Tensor:
    """Outputs ``[k0, k1)`` (within ``[lo, hi)``) along ``dim`` through index_select."""
    at, n = k0 - plan.lo, k1 - k0
    taps = []
    for t, index in enumerate(plan.index):
        idx = device_constant(
            (key, "tap", t), torch.int64, x.device, functools.partial(torch.tensor, index)
        )
        taps.append(x.index_select(dim, idx.narrow(0, at, n)))
    if plan.weight is None:
        return taps[0]
    trailing = (1,) * (x.dim() - dim - 1)
    w0, w1 = (
        device_constant(
            (key, "weight", t),
            x.dtype,
            x.device,
            functools.partial(torch.tensor, weight, dtype=torch.float64),
        )
        .narrow(0, at, n)
        .view(-1, *trailing)
        for t, weight in enumerate(plan.weight)
    )
    return taps[0].mul_(w0).addcmul_(taps[1], w1)  # w0 x[i0] + w1 x[i1], in place


def _sample_axis(
    x: torch.Tensor, plan: _AxisPlan, dim: int, key: object, *, slices: bool
) -> torch.Tensor:
    """The forward along ``dim``: ``plan.count`` outputs, in ``x``'s dtype. ``slices``: make
    the regular run from shifted slices (fast along rows; along the innermost dimension the
    strided writes lose to index_select)."""
    regular = plan.regular if slices else None
    if regular is None:  # [lo, hi) gathered, then the zeros around
        y = _gather_taps(x, plan, dim, key, plan.lo, plan.hi)
        if plan.hi - plan.lo == plan.count:
            return y
        pads = [0, 0] * (x.dim() - dim - 1) + [plan.lo, plan.count - plan.hi]
        return F.pad(y, pads)
    start, periods, phases = regular
    scale = len(phases)
    stop = start + periods * scale
    if scale == 1 and (start, stop) == (0, plan.count) and phases[0][1:] == (1.0, 0.0):
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
    for k0, k1 in ((plan.lo, start), (stop, plan.hi)):  # the edges, through index_select
        if k1 > k0:
            out.narrow(dim, k0, k1 - k0).copy_(_gather_taps(x, plan, dim, key, k0, k1))
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
    # Columns by index_select (strided writes of slices lose there), then rows by slices.
    t = _sample_axis(t, px, 3, kx, slices=False)
    t = _sample_axis(t, py, 2, ky, slices=True)
    return fresh(t.to(x.dtype), x)


def upsample_backward(g: torch.Tensor, geom: UpsampleGeometry) -> torch.Tensor:
    """The transpose of `upsample_forward`: ``(N, C, y.count, x.count) -> (N, C, H, W)``."""
    # The standard case too: for nearest its windows are the blocks, summed column by column
    # (faster than one reduction over the two block dimensions).
    py, px = _plans(geom)
    ky, kx = _keys(geom)
    t = g.to(acc_dtype(g.dtype)) if py.adjoint.sums or px.adjoint.sums else g
    # Rows first: the reduction along dim 2 reads whole rows, the faster way round.
    t = apply_axis_adjoint(t, py.adjoint, 2, ky)
    t = apply_axis_adjoint(t, px.adjoint, 3, kx)
    return fresh(t.to(g.dtype), g)
