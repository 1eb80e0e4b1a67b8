"""Shape math: HWC-order reshape, padding with every MPS edge mode, and the deterministic
gather-sum that both padding and upsampling use for their gradients.

Reshape keeps each image's elements in the HWC linear order (channel fastest, as MPS packs
texels): ``(C, H, W) -> (C', H', W')`` with ``C H W = C' H' W'``.

Padding reads, per axis, for output ``u`` the source coordinate ``i = start + u`` mapped by the
edge mode into a source index ``m(u)``: ZERO and CONSTANT have none outside (the output takes
0 / the fill value), CLAMP takes the nearest edge, MIRROR reflects without repeating the edge
(``-1 -> 1``), MIRROR_WITH_EDGE repeating it (``-1 -> 0``). The forward is a gather,
``y[u, v] = x[m_y(u), m_x(v)]``, and the gradient its exact adjoint, per axis
``dx[i] = sum over {u : m(u) = i} of g[u]``.

The adjoint of a per-axis gather with weights (`AxisAdjoint`, `axis_adjoint`) is computed
without atomics: runs of targets that receive exactly one unweighted value are slices of the
gradient; a regular run of targets reading windows that move by a fixed step (the interior of
an upsampling) sums an unfolded view of the gradient; every other target sums a row of a table
of at most K sources (K the largest multiplicity of its group, rows padded with an index to an
appended zero slot), gathered and then summed over K in a fixed order. The results are
bit-identical from run to run, exact up to the rounding of the sums themselves, and the work is
linear in the number of contributions (targets are grouped by multiplicity, and windows kept
narrow, so that padding never more than doubles it).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch

from mpsnn.core.geometry import EdgeMode
from mpsnn.ops._dtypes import acc_dtype, device_constant

__all__ = [
    "AxisAdjoint",
    "PadAxis",
    "apply_axis_adjoint",
    "axis_adjoint",
    "pad_axis",
    "pad_backward",
    "pad_forward",
    "reshape_hwc",
]


def reshape_hwc(x: torch.Tensor, c: int, h: int, w: int) -> torch.Tensor:
    """``(N, C0, H0, W0) -> (N, c, h, w)`` in the HWC linear order of each image."""
    n = x.shape[0]
    return x.permute(0, 2, 3, 1).reshape(n, h, w, c).permute(0, 3, 1, 2)


# ---------------------------------------------------------------------------------------------
# The deterministic adjoint of a per-axis gather
# ---------------------------------------------------------------------------------------------

# Kinds of the pieces that assemble an adjoint along its axis.
_ZEROS, _SLICE, _SUMMED, _WINDOW = range(4)
# Beyond this many pieces, one index_select assembles the result instead.
_MAX_PIECES = 16

# (first target, rows, base, step, width, weights): see `AxisAdjoint`.
Window = tuple[int, int, int, int, int, tuple[float, ...] | None]


class AxisAdjoint(NamedTuple):
    """Host plan of ``r[i] = sum_k w_ik t[u_ik]`` along one axis of a tensor ``t`` (``count``
    positions) for targets ``i in [0, size)`` (terms summed in increasing ``u``).

    * ``window`` ``(first, rows, base, step, width, weights)``: targets ``first + j`` for
      ``j < rows`` sum the ``width`` consecutive positions from ``base + j step`` (an unfolded
      view: no index at all), weighted by the ``rows x width`` ``weights`` (0 on the positions
      a target does not read, so a non-finite value there gives NaN, as in the backward of
      ``F.interpolate``; ``None`` when all are 1). Used for the regular interior of an
      upsampling; ``None`` otherwise.
    * ``groups`` hold the other summed targets: per group ``(rows, width, index, weights)``,
      ``index`` a flattened ``rows x width`` table into ``gather`` (the positions of ``t`` the
      tables read, ``None`` for all of ``t`` in order), extended when ``padded`` by one zero
      slot (index ``len(gather)``) that pads the short rows; ``weights`` alike (0 on the
      padding), or ``None`` when every weight is 1. Stacking the groups' sums gives ``S``.
    * The result is made of ``pieces`` ``(kind, begin, length)`` in target order: zeros, a
      slice of ``t`` (targets that receive one unweighted value, from consecutive positions),
      a slice of ``S``, or the window; or, when there would be too many pieces (``pieces`` is
      ``None``), ``select`` picks a row of ``S`` (or the zero row ``len(S)``) per target.
    * ``sums``: some target adds or scales values, so the caller should accumulate in
      `acc_dtype`.
    """

    size: int
    count: int  # type: ignore[assignment]  # a NamedTuple field named like a tuple method
    window: Window | None
    gather: tuple[int, ...] | None
    padded: bool
    groups: tuple[tuple[int, int, tuple[int, ...], tuple[float, ...] | None], ...]
    pieces: tuple[tuple[int, int, int], ...] | None
    select: tuple[int, ...] | None
    sums: bool


def axis_adjoint(
    contributions: Sequence[Sequence[tuple[int, float]]], count: int, *, step: int | None = None
) -> AxisAdjoint:
    """The plan of ``r[i] = sum of w * t[u] over (u, w) in contributions[i]`` for a ``t`` of
    ``count`` positions (each list sorted by ``u``; zero weights should be left out).

    ``step``: the targets are expected to read windows that move by ``step`` positions per
    target (an upsampling by ``step``): the longest regular run of them becomes the plan's
    ``window`` when a window at most twice as wide as their reads covers it."""
    window = _find_window(contributions, count, step) if step else None
    plan = _plan_adjoint(contributions, count, window, direct=True)
    if plan.pieces is None:  # fragmented: sum everything, the single values as width-1 rows
        plan = _plan_adjoint(contributions, count, None, direct=False)
    return plan


def _find_window(
    contributions: Sequence[Sequence[tuple[int, float]]], count: int, step: int
) -> Window | None:
    size = len(contributions)
    mult = [len(c) for c in contributions]
    busy = sorted(m for m in mult if m)
    if len(busy) < 2:
        return None
    # Targets that collect far more than the typical one (CLAMP piles at the edges) stay out.
    limit = 2 * busy[len(busy) // 2]
    a = b = start = 0
    for i in range(size + 1):
        if i < size and 0 < mult[i] <= limit:
            continue
        if i - start > b - a:
            a, b = start, i
        start = i + 1
    base = width = 0
    trimmed = [0, 0]
    for _ in range(32):
        if b - a < 2:
            return None
        los = [contributions[i][0][0] - (i - a) * step for i in range(a, b)]
        his = [contributions[i][-1][0] - (i - a) * step for i in range(a, b)]
        base = min(los)
        width = max(his) - base + 1
        # An end row that alone widens every window (an edge that reads a few more
        # positions) is cheaper as a table row: up to 4 from each end.
        if trimmed[0] < 4 and (los[0] < min(los[1:]) or his[0] > max(his[1:])):
            a, trimmed[0] = a + 1, trimmed[0] + 1
            continue
        if trimmed[1] < 4 and (los[-1] < min(los[:-1]) or his[-1] > max(his[:-1])):
            b, trimmed[1] = b - 1, trimmed[1] + 1
            continue
        # Then the end rows whose window would leave t.
        na, nb = a, b
        while na < nb and base + (na - a) * step < 0:
            na += 1
        while nb > na and base + (nb - 1 - a) * step + width > count:
            nb -= 1
        if (na, nb) == (a, b):
            break
        a, b = na, nb
    else:
        return None
    if (b - a) * width > 2 * sum(mult[a:b]):
        return None  # too irregular: the window would more than double the work
    weights = [0.0] * ((b - a) * width)
    for j, i in enumerate(range(a, b)):
        for u, w in contributions[i]:
            weights[j * width + u - base - j * step] = w
    unweighted = all(w == 1.0 for w in weights)
    return (a, b - a, base, step, width, None if unweighted else tuple(weights))


def _plan_adjoint(
    contributions: Sequence[Sequence[tuple[int, float]]],
    count: int,
    window: Window | None,
    *,
    direct: bool,
) -> AxisAdjoint:
    size = len(contributions)
    in_window = range(window[0], window[0] + window[1]) if window else range(0)
    kinds = []
    for i, c in enumerate(contributions):
        if i in in_window:
            kinds.append(_WINDOW)
        elif not c:
            kinds.append(_ZEROS)
        elif direct and len(c) == 1 and c[0][1] == 1.0:
            kinds.append(_SLICE)
        else:
            kinds.append(_SUMMED)
    # Group the summed targets by multiplicity (1, 2, 3-4, 5-8, ...): a table as wide as its
    # group's largest row at most doubles the work, even when a few targets collect many values
    # (CLAMP edges) and the rest one or two.
    buckets: dict[int, list[int]] = {}
    for i, kind in enumerate(kinds):
        if kind == _SUMMED:
            buckets.setdefault((len(contributions[i]) - 1).bit_length(), []).append(i)
    order = [i for b in sorted(buckets) for i in buckets[b]]
    row = {i: r for r, i in enumerate(order)}
    used = sorted({u for i in order for u, _ in contributions[i]})
    slot = {u: k for k, u in enumerate(used)}
    zero = len(used)
    weighted = any(w != 1.0 for i in order for _, w in contributions[i])
    groups = []
    padded = False
    for b in sorted(buckets):
        rows = buckets[b]
        width = max(len(contributions[i]) for i in rows)
        index: list[int] = []
        weights: list[float] = []
        for i in rows:
            pad = width - len(contributions[i])
            padded = padded or pad > 0
            index += [slot[u] for u, _ in contributions[i]] + [zero] * pad
            weights += [w for _, w in contributions[i]] + [0.0] * pad
        groups.append((len(rows), width, tuple(index), tuple(weights) if weighted else None))

    pieces: list[tuple[int, int, int]] = []
    for i, kind in enumerate(kinds):
        begin = contributions[i][0][0] if kind == _SLICE else row.get(i, 0)
        if pieces:
            k, b, n = pieces[-1]
            if k == kind and (kind in (_ZEROS, _WINDOW) or b + n == begin):
                pieces[-1] = (k, b, n + 1)
                continue
        pieces.append((kind, begin, 1))
    select = None
    if len(pieces) > _MAX_PIECES:
        select = tuple(row.get(i, len(order)) for i in range(size))
    window_sums = window is not None and (window[4] > 1 or window[5] is not None)
    return AxisAdjoint(
        size=size,
        count=count,
        window=window,
        gather=None if used == list(range(count)) else tuple(used),
        padded=padded,
        groups=tuple(groups),
        pieces=None if select is not None else tuple(pieces),
        select=select,
        sums=weighted or window_sums or any(width > 1 for _, width, _, _ in groups),
    )


def _zeros_along(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = length
    return t.new_zeros(shape)


def _index_tensor(values: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _weight_tensor(values: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _window_sum(
    t: torch.Tensor, window: Window, dim: int, key: Hashable, out: torch.Tensor | None
) -> torch.Tensor:
    """The window's rows along ``dim`` (into ``out`` when given)."""
    _, rows, base, step, width, weights = window
    if width == 1 and step == 1 and weights is None:  # one value each: a slice
        v = t.narrow(dim, base, rows)
        return v if out is None else out.copy_(v)
    v = t.narrow(dim, base, (rows - 1) * step + width).unfold(dim, width, step)
    cols = [v[..., k] for k in range(width)]  # column k: position base + j step + k of row j
    # Accumulate column by column, in a fixed order (deterministic): elementwise passes over
    # strided views run much faster than a reduction over a short innermost dimension.
    if weights is None:
        if width == 1:
            return cols[0].clone() if out is None else out.copy_(cols[0])
        r = torch.add(cols[0], cols[1], out=out)
        for c in cols[2:]:
            r.add_(c)
        return r

    def build() -> torch.Tensor:  # stored column-major: each column's weights contiguous
        return _weight_tensor(weights).view(rows, width).t().contiguous()

    w = device_constant((key, "window"), t.dtype, t.device, build)
    shape = (rows, *(1,) * (t.dim() - dim - 1))
    r = torch.mul(cols[0], w[0].view(shape), out=out)
    for k in range(1, width):
        r.addcmul_(cols[k], w[k].view(shape))
    return r


def apply_axis_adjoint(t: torch.Tensor, plan: AxisAdjoint, dim: int, key: Hashable) -> torch.Tensor:
    """Run ``plan`` along ``dim`` of ``t`` (``plan.count`` long there): the result is
    ``plan.size`` long along ``dim``, in ``t``'s dtype (weights are applied in it too).
    ``key`` names the plan's geometry: its index and weight tensors are kept on the device
    under it (`device_constant`). The result may be a view of ``t``."""
    device = t.device
    s = None
    if plan.groups:
        src = t
        if plan.gather is not None:
            gather = plan.gather
            idx = device_constant(
                (key, "gather"), torch.int64, device, lambda: _index_tensor(gather)
            )
            src = t.index_select(dim, idx)
        if plan.padded:
            src = torch.cat([src, _zeros_along(src, dim, 1)], dim)  # the zero slot
        trailing = (1,) * (t.dim() - dim - 1)
        parts = []
        for k, (rows, width, index, weights) in enumerate(plan.groups):
            idx = device_constant(
                (key, "index", k), torch.int64, device, functools.partial(_index_tensor, index)
            )
            v = src.index_select(dim, idx).unflatten(dim, (rows, width))
            if weights is not None:
                w = device_constant(
                    (key, "weights", k),
                    t.dtype,
                    device,
                    functools.partial(_weight_tensor, weights),
                )
                v = v * w.view(rows, width, *trailing)
            parts.append(v.sum(dim + 1))  # over the row, in table order: deterministic
        s = parts[0] if len(parts) == 1 else torch.cat(parts, dim)
    if plan.pieces is None:
        select = plan.select
        # without pieces the plan selects rows of the group sums (`axis_adjoint`)
        idx = device_constant(
            (key, "select"),
            torch.int64,
            device,
            lambda: _index_tensor(select),  # type: ignore[arg-type]
        )
        return torch.cat([s, _zeros_along(s, dim, 1)], dim).index_select(dim, idx)  # type: ignore[list-item, arg-type]
    if len(plan.pieces) == 1:
        kind, begin, length = plan.pieces[0]
        if kind == _SLICE:
            return t.narrow(dim, begin, length)
        if kind == _SUMMED:
            return s  # type: ignore[return-value]  # a piece of this kind exists only with its part of the plan
        if kind == _WINDOW:
            return _window_sum(t, plan.window, dim, key, None)  # type: ignore[arg-type]  # a piece of this kind exists only with its part of the plan
        return _zeros_along(t, dim, length)
    # Each piece is written once into its part of the result.
    shape = list(t.shape)
    shape[dim] = plan.size
    out = t.new_empty(shape)
    at = 0
    for kind, begin, length in plan.pieces:
        part = out.narrow(dim, at, length)
        if kind == _SLICE:
            part.copy_(t.narrow(dim, begin, length))
        elif kind == _SUMMED:
            part.copy_(s.narrow(dim, begin, length))  # type: ignore[union-attr]  # a piece of this kind exists only with its part of the plan
        elif kind == _WINDOW:
            _window_sum(t, plan.window, dim, key, part)  # type: ignore[arg-type]  # a piece of this kind exists only with its part of the plan
        else:
            part.zero_()
        at += length
    return out


def fresh(t: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous tensor of its own: copied when it is (a view of) ``source``'s
    storage, which the caller may overwrite."""
    if t.untyped_storage().data_ptr() == source.untyped_storage().data_ptr():
        return t.clone(memory_format=torch.contiguous_format)
    return t.contiguous()


# ---------------------------------------------------------------------------------------------
# Padding
# ---------------------------------------------------------------------------------------------


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


def _source(i: int, size: int, mode: EdgeMode) -> int:
    """The source index read at coordinate ``i``, or -1 for none (the fill value)."""
    if 0 <= i < size:
        return i
    if mode is EdgeMode.CLAMP:
        return min(max(i, 0), size - 1)
    if mode in (EdgeMode.MIRROR, EdgeMode.MIRROR_WITH_EDGE):
        return _reflect(i, size, mode is EdgeMode.MIRROR_WITH_EDGE)
    return -1  # ZERO, CONSTANT


class PadAxis(NamedTuple):
    """One padded axis (geometry only, built on the host; hashable): output ``u`` in
    ``[0, count)`` reads ``source[u]`` of a ``size``-pixel source, -1 for none. The outputs
    with a source are exactly ``[lo, hi)``; ``identity``: there ``source[u] = start + u``
    (the forward is a slice). ``adjoint`` is the plan of the gradient along the axis."""

    start: int
    count: int  # type: ignore[assignment]  # a NamedTuple field named like a tuple method
    size: int
    mode: EdgeMode
    source: tuple[int, ...]
    lo: int
    hi: int
    identity: bool
    adjoint: AxisAdjoint


@functools.lru_cache(maxsize=512)
def pad_axis(start: int, count: int, size: int, mode: EdgeMode) -> PadAxis:
    """The `PadAxis` of outputs ``u in [0, count)`` reading coordinate ``start + u`` of a
    ``size``-pixel source under edge mode ``mode`` (any padding amount, any crop)."""
    source = tuple(_source(start + u, size, mode) for u in range(count))
    have = [u for u, i in enumerate(source) if i >= 0]
    # Sources exist on one contiguous range: all outputs (CLAMP, MIRROR*), or the inside.
    lo, hi = (have[0], have[-1] + 1) if have else (0, 0)
    contributions: list[list[tuple[int, float]]] = [[] for _ in range(size)]
    for u, i in enumerate(source):
        if i >= 0:
            contributions[i].append((u, 1.0))
    return PadAxis(
        start=start,
        count=count,
        size=size,
        mode=mode,
        source=source,
        lo=lo,
        hi=hi,
        identity=all(source[u] == start + u for u in range(lo, hi)),
        adjoint=axis_adjoint(contributions, count),
    )


def _axis_key(a: PadAxis) -> tuple[Hashable, ...]:
    # (start, count, size, mode) determine the axis; cheaper to hash than its tables.
    return ("pad-axis", a.start, a.count, a.size, a.mode)


def _gather_axis(x: torch.Tensor, a: PadAxis, dim: int) -> torch.Tensor:
    """Outputs ``[lo, hi)`` of the axis along ``dim``: a slice, or an index_select."""
    if a.hi == a.lo:
        return x.narrow(dim, 0, 0)
    if a.identity:
        return x.narrow(dim, a.start + a.lo, a.hi - a.lo)
    source = a.source[a.lo : a.hi]
    idx = device_constant(
        (_axis_key(a), "source"), torch.int64, x.device, lambda: _index_tensor(source)
    )
    return x.index_select(dim, idx)


@functools.lru_cache(maxsize=256)
def _rounded_fill(fill: float, dtype: torch.dtype) -> float:
    # The fill value as the dtype holds it, rounded through the accumulation dtype first (as
    # a value computed in that dtype and then stored).
    t = torch.tensor(fill, dtype=torch.float64).to(acc_dtype(dtype)).to(dtype)
    return float(t.item())


def pad_forward(
    x: torch.Tensor,
    ay: PadAxis,
    ax: PadAxis,
    *,
    channel_before: int,
    out_channels: int,
    fill: float | torch.Tensor,
    constant_outside: bool,
) -> torch.Tensor:
    """Pad ``x`` ``(N, C, H, W)`` (``H = ay.size``, ``W = ax.size``) into
    ``(N, out_channels, ay.count, ax.count)`` in ``x``'s dtype.

    Channels ``[channel_before, channel_before + C)`` hold ``x[m_y(u), m_x(v)]`` where both
    axes have a source; the positions without one take the channel's fill value when
    ``constant_outside`` (CONSTANT), else 0 (ZERO). The other channels hold their fill value.
    ``fill`` is a number, or a float64 CPU tensor of ``out_channels`` values (copied to the
    device once per set of values); either is rounded to the accumulation dtype, then to
    ``x``'s dtype. The values of ``x`` are copied, never rounded.
    """
    n, c = x.shape[0], x.shape[1]
    body = _gather_axis(_gather_axis(x, ay, 2), ax, 3)
    out = x.new_empty((n, out_channels, ay.count, ax.count))
    cb, ce = channel_before, channel_before + c
    f_before: torch.Tensor | float
    f_mid: torch.Tensor | float
    f_after: torch.Tensor | float
    if isinstance(fill, torch.Tensor):
        values = fill
        wide = acc_dtype(x.dtype)
        f = device_constant(
            ("pad-fill-values", *values.tolist()),
            x.dtype,
            x.device,
            lambda: values.to(torch.float64).to(wide),
        ).view(1, -1, 1, 1)
        f_before, f_mid, f_after = f[:, :cb], f[:, cb:ce], f[:, ce:]
    else:
        f_before = f_mid = f_after = _rounded_fill(float(fill), x.dtype)
    if cb > 0:
        out[:, :cb] = f_before
    if ce < out_channels:
        out[:, ce:] = f_after
    mid = out[:, cb:ce]
    frame = f_mid if constant_outside else 0.0
    y0, y1, x0, x1 = ay.lo, ay.hi, ax.lo, ax.hi
    # The positions without a source form a frame around [y0, y1) x [x0, x1): write each
    # position once.
    if y0 > 0:
        mid[:, :, :y0] = frame
    if y1 < ay.count:
        mid[:, :, y1:] = frame
    if x0 > 0:
        mid[:, :, y0:y1, :x0] = frame
    if x1 < ax.count:
        mid[:, :, y0:y1, x1:] = frame
    mid[:, :, y0:y1, x0:x1] = body
    return out


def pad_backward(
    g: torch.Tensor, ay: PadAxis, ax: PadAxis, *, channel_before: int, channels: int
) -> torch.Tensor:
    """The adjoint of `pad_forward` with respect to its source: ``g`` is
    ``(N, out_channels, ay.count, ax.count)``; returns ``(N, channels, ay.size, ax.size)``
    where ``dx[i, j] = sum of g[u, v] over {(u, v) : m_y(u) = i, m_x(v) = j}`` in channels
    ``[channel_before, channel_before + channels)`` of ``g``. Fill positions and padded
    channels pass nothing back. Sums accumulate in `acc_dtype`; the result is in ``g``'s dtype.
    """
    t = g[:, channel_before : channel_before + channels]
    if ay.adjoint.sums or ax.adjoint.sums:
        t = t.to(acc_dtype(g.dtype))  # both axes' sums in the wide dtype: one rounding at the end
    t = apply_axis_adjoint(t, ax.adjoint, 3, _axis_key(ax))
    t = apply_axis_adjoint(t, ay.adjoint, 2, _axis_key(ay))
    return fresh(t.to(g.dtype), g)
