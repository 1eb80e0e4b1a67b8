"""Pooling math: max, average, L2 norm (and dilated max), forward and gradient.

Every pooling reads its windows through the MPS window model (`mpsnn.ops.window`), prepared
without operator padding so that out-of-image reads are real values: 0 for ZERO edges, the
edge pixel for CLAMP. Per output ``o`` with window taps ``T(o)``:

* max:      ``y = max_{t in T(o)} x_t``; gradient to the **first** maximum in raster order
  (rows, then columns), that of the source the gradient reads (the CPU tile path takes the
  forward's argmax when that source is the very tensor the forward read, unchanged: see
  `max_pool_forward_argmax`; else it is recomputed). A maximum that is a ZERO-edge padding
  value passes no gradient back.
* average:  ``y = sum_{t in T(o), t in image} x_t / N(o)``. ``N`` counts the taps inside a
  per-axis interval: the whole window for ZERO edges (``k_x k_y``); the image grown by
  ``zero_pad_size`` on each side for CLAMP (MPS: CLAMP shrinks the window); the image plus the
  padding the policy adds for ZERO with EXCLUDE_EDGES (Caffe). ``N = 0`` gives 0. With
  dilation the taps are the dilated ones (``c - E // 2 + d j``) and ``N`` counts those of them
  inside the interval: ZERO divides by the ``k_x k_y`` taps, not by the ``E_x E_y`` span.
* L2 norm:  ``y = sqrt(sum_{t in T(o)} x_t^2)``, computed scaled (as ``hypot`` and BLAS
  ``nrm2``): with ``m`` the window's largest ``|x_t|`` and ``p = 2^(e - 1)`` for
  ``m = f 2^e``, ``1/2 <= f < 1``, the taps are ``r_t = x_t / p`` (``1 <= max |r_t| < 2``) and
  ``y = p sqrt(sum r_t^2)``. Scaling by a power of two is exact, so ``y`` is the unscaled
  formula's value wherever that one neither overflows nor underflows, and finite and accurate
  where it would (a window of four 3e19 is 6e19 in float32, four 1e-30 are 2e-30). Gradient
  ``g x_t / y = g r_t / sqrt(sum r^2)`` (bounded by ``|g|``), and 0 where ``y = 0`` (an
  all-zero window has a zero gradient, not NaN). A window with an infinite tap has ``y = inf``
  (``p = 1``); a NaN tap gives NaN.

Average pooling without dilation uses PyTorch's pooling; dilated average pooling and L2
pooling read every window's taps with one ``unfold`` (the gradient: ``fold``, a deterministic
gather), in float32 for float16/bfloat16 data.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpsnn.core.geometry import AxisWindow, EdgeMode
from mpsnn.core.layout import channels_last_only, channels_last_preferred
from mpsnn.ops import triton as fast_paths
from mpsnn.ops._dtypes import device_constant, widen
from mpsnn.ops.plans import PoolGeometry
from mpsnn.ops.window import apply_extract, apply_extract_adjoint, plan_extract

__all__ = [
    "average_pool_backward",
    "average_pool_forward",
    "l2_pool_backward",
    "l2_pool_forward",
    "max_pool_backward",
    "max_pool_forward",
    "max_pool_forward_argmax",
    "pool_geometry",
]

_max_pool_backward = torch.ops.aten.max_pool2d_with_indices_backward.default
_max_pool_out = torch.ops.aten.max_pool2d_with_indices.out
_avg_pool_backward = torch.ops.aten.avg_pool2d_backward.default


def pool_geometry(
    y: AxisWindow,
    x: AxisWindow,
    edge: EdgeMode,
    valid_y: tuple[int, int] | None = None,
    valid_x: tuple[int, int] | None = None,
    *,
    read_edge: EdgeMode | None = None,
) -> PoolGeometry:
    """``read_edge``: how out-of-image taps are read (average pooling always reads zeros)."""
    plan = plan_extract(y, x, edge if read_edge is None else read_edge, allow_pad=False)
    counts = None
    if valid_y is not None or valid_x is not None:
        counts = (_axis_counts(y, valid_y), _axis_counts(x, valid_x))
    full = counts is None or (
        all(c == y.kernel for c in counts[0]) and all(c == x.kernel for c in counts[1])
    )
    return PoolGeometry(y, x, edge, plan, valid_y, valid_x, counts,
                        y.kernel * x.kernel if full else None)  # fmt: skip


def _axis_counts(a: AxisWindow, valid: tuple[int, int] | None) -> tuple[int, ...]:
    """Per output, the number of its taps inside ``valid`` (one axis of the divisor)."""
    if valid is None:
        return (a.kernel,) * a.count
    lo, hi = valid
    starts = (a.start + a.stride * i for i in range(a.count))
    return tuple(sum(lo <= s + a.dilation * j < hi for j in range(a.kernel)) for s in starts)


def _kernel(g: PoolGeometry) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    return (g.y.kernel, g.x.kernel), (g.y.stride, g.x.stride), (g.y.dilation, g.x.dilation)


# -- max ------------------------------------------------------------------------------------
#
# The one place that picks each max-pooling path: `max_pool_forward` and `max_pool_backward`.
# CUDA tensors may take the Triton gradient (`mpsnn.ops.triton` decides). CPU tensors whose
# windows tile the image (`_cpu_tiles`) take the tile paths below. Everything else takes the
# general path.
#
# Why the tile paths: PyTorch's CPU max pooling of NCHW data runs a scalar loop per output
# (about 5 ms for LeNet's 256x6x28x28); its channels-last kernel runs the same comparisons
# vectorized across channels. The tile paths copy each window's taps into a channels-last
# image of their own (`_window_planes`), pool that with PyTorch's kernel, and map its argmax
# back to the source. Why they are exact: both PyTorch kernels take a tap when it is strictly
# larger than the running maximum or a NaN, starting from -inf and the window's first tap, in
# raster order, and write that tap's value: the first maximum wins ties (-0.0 == +0.0), the
# last NaN wins over everything. The windows' taps are the same values in the same order.
# tests/ops/test_pooling_ops.py checks the bits (ties, signed zeros, NaN payloads, infinities).


def _cpu_tiles(x: torch.Tensor, geom: PoolGeometry) -> bool:
    """The tile paths' case: CPU float32 or float64 data, disjoint windows inside the image
    (stride == kernel, no dilation, every tap inside: `mpsnn.ops.triton.pool_tiles`).
    float16 and bfloat16 stay on the general path: PyTorch's two kernels round a NaN through
    float32 to different bits there."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.float64)
        and fast_paths.pool_tiles(geom)
    )


def max_pool_forward(x: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    """``y = max_{t in T(o)} x_t``: the first maximum's value (the last NaN if the window has
    one). The tile path and the general path give the same bits."""
    return max_pool_forward_argmax(x, geom)[0]


def max_pool_forward_argmax(
    x: torch.Tensor, geom: PoolGeometry
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(y, tap)``: `max_pool_forward`'s ``y`` and, on the CPU tile paths, each window's
    argmax (int64, ``(N, C, OH, OW)``), which the pass computes anyway: what
    `max_pool_backward` recomputes from the same ``x`` (pass it there as ``argmax`` and the
    gradient skips that pass). Its encoding is the path's own, opaque to callers: the tap
    number ``k = i kw + j`` for NCHW ``x``, PyTorch's plane index for channels-last ``x``
    (which path a given ``x`` takes is fixed by its layout). ``tap`` is None on the other
    paths."""
    t = apply_extract(x, geom.plan)
    if _cpu_tiles(x, geom):
        if channels_last_only(x):
            k, s, d = _kernel(geom)
            return F.max_pool2d(t, k, s, 0, d, return_indices=True)
        return _tile_max(t, geom)
    k, s, d = _kernel(geom)
    return F.max_pool2d(t, k, s, 0, d), None


def max_pool_backward(
    g: torch.Tensor, x: torch.Tensor, geom: PoolGeometry, argmax: torch.Tensor | None = None
) -> torch.Tensor:
    """Route each output's gradient to the first maximum of its window in ``x``.

    Paths: the Triton kernel (CUDA, `mpsnn.ops.triton.max_pool_backward`), else the tile path
    (`_tile_max_backward`), else `max_pool_backward_portable`. All give the same bits.
    ``argmax``: the ``tap`` `max_pool_forward_argmax` returned for this very ``x`` (same
    tensor, unchanged since), or None; the tile path then uses it instead of recomputing it
    (and overwrites it), the other paths ignore it."""
    fast = fast_paths.max_pool_backward(g, x, geom)
    if fast is None and _cpu_tiles(x, geom):
        if channels_last_only(x):
            fast = _channels_last_max_backward(g, apply_extract(x, geom.plan), geom, argmax)
        else:
            fast = _tile_max_backward(g, x, geom, argmax)
    return fast if fast is not None else max_pool_backward_portable(g, x, geom)


def max_pool_backward_portable(
    g: torch.Tensor, x: torch.Tensor, geom: PoolGeometry
) -> torch.Tensor:
    """The reference path: argmax via ``max_pool2d_with_indices`` (the first maximum in raster
    order wins ties, the last NaN wins over everything), then PyTorch's gather-style backward
    (``0 + g`` at the argmax, +0.0 elsewhere; deterministic), then the extraction's adjoint."""
    k, s, d = _kernel(geom)
    t = apply_extract(x, geom.plan).contiguous()
    _, idx = F.max_pool2d(t, k, s, 0, d, return_indices=True)
    dt = _max_pool_backward(g.contiguous(), t, list(k), list(s), [0, 0], list(d), False, idx)
    return apply_extract_adjoint(dt, geom.plan)


def _channels_last_max_backward(
    g: torch.Tensor, t: torch.Tensor, geom: PoolGeometry, index: torch.Tensor | None
) -> torch.Tensor:
    """`_tile_max_backward` for channels-last ``t``: ``index`` is the forward's plane index
    of each window's first maximum (PyTorch's, as `max_pool_forward_argmax` returns it for
    channels-last storage), recomputed when None."""
    k, s, d = _kernel(geom)
    if index is None:
        index = F.max_pool2d(t, k, s, 0, d, return_indices=True)[1]
    # the gradient in the source's layout (a fully connected layer's input gradient is NCHW):
    # PyTorch's kernel would otherwise convert the source, four times its size
    g = g.contiguous(memory_format=torch.channels_last)
    dt = _max_pool_backward(g, t, list(k), list(s), [0, 0], list(d), False, index)
    return apply_extract_adjoint(dt, geom.plan)


def _window_planes(t: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    """The disjoint ``kh x kw`` windows of ``t`` (read from index 0) as a channels-last batch
    ``(N, C OH OW, kh, kw)``: image ``n``, channel ``(c, p, q)`` is window ``(p, q)`` of plane
    ``(n, c)``, with tap ``(i, j)`` at pixel ``(i, j)``. One copy."""
    (kh, kw), (oh, ow) = (geom.y.kernel, geom.x.kernel), (geom.y.count, geom.x.count)
    n, c = t.shape[:2]
    taps = t[:, :, : oh * kh, : ow * kw].unflatten(3, (ow, kw)).unflatten(2, (oh, kh))
    buf = torch.empty((n, kh, kw, c, oh, ow), dtype=t.dtype)
    buf.copy_(taps.permute(0, 3, 5, 1, 2, 4))
    return buf.view(n, kh, kw, c * oh * ow).permute(0, 3, 1, 2)


def _tile_max(t: torch.Tensor, geom: PoolGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, k)``: each window's maximum (the general path's bits) and its argmax's tap number
    ``k = i kw + j`` (raster order), both new ``(N, C, OH, OW)`` tensors, from one pass of
    PyTorch's channels-last max pooling over `_window_planes`."""
    (kh, kw), (oh, ow) = (geom.y.kernel, geom.x.kernel), (geom.y.count, geom.x.count)
    n, c = t.shape[:2]
    y = torch.empty((n, c, oh, ow), dtype=t.dtype)
    k = torch.empty((n, c, oh, ow), dtype=torch.int64)
    _max_pool_out(
        _window_planes(t, geom), [kh, kw], [kh, kw], [0, 0], [1, 1], False,
        out=y.view(n, c * oh * ow, 1, 1), indices=k.view(n, c * oh * ow, 1, 1),
    )  # fmt: skip
    return y, k


def _tile_max_backward(
    g: torch.Tensor, x: torch.Tensor, geom: PoolGeometry, tap: torch.Tensor | None = None
) -> torch.Tensor:
    """The general gradient, bit for bit: `_tile_max`'s argmax ``k = i kw + j`` (``tap``, when
    the forward kept it for this ``x``; it is overwritten) becomes the index
    ``(oh kh + i) w + ow kw + j`` into the plane of ``t`` (what the general path's
    ``max_pool2d_with_indices`` returns), and PyTorch's backward runs on it as there."""
    t = apply_extract(x, geom.plan)
    (kh, kw), (oh, ow) = (geom.y.kernel, geom.x.kernel), (geom.y.count, geom.x.count)
    n, c, h, w = t.shape
    k = _tile_max(t, geom)[1] if tap is None else tap
    corner = device_constant(  # each window's first tap, (oh kh) w + ow kw
        ("pool-tile-corner", oh, ow, kh, kw, w), torch.int64, t.device,
        lambda: torch.arange(oh).view(-1, 1) * (kh * w) + torch.arange(ow) * kw,
    )  # fmt: skip
    if kw == 1:
        idx = k.mul_(w).add_(corner)  # i = k
    else:
        row = k >> (kw.bit_length() - 1) if kw & (kw - 1) == 0 else k.div(kw, rounding_mode="floor")
        idx = k.add_(row, alpha=w - kw).add_(corner)  # j + i w = k + i (w - kw)
    # the backward reads the source's size only (and the general path's source is contiguous)
    shape = t if t.is_contiguous() else torch.empty((n, c, h, w), dtype=t.dtype)
    dt = _max_pool_backward(g.contiguous(), shape, [kh, kw], [kh, kw], [0, 0], [1, 1], False, idx)
    return apply_extract_adjoint(dt, geom.plan)


# -- average --------------------------------------------------------------------------------


def _divisor(counts: tuple[tuple[int, ...], tuple[int, ...]]) -> torch.Tensor:
    cy = torch.tensor(counts[0], dtype=torch.float64)
    cx = torch.tensor(counts[1], dtype=torch.float64)
    return (cy.view(-1, 1) * cx.view(1, -1)).view(1, 1, len(counts[0]), len(counts[1]))


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _divide(total: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    """``total / N`` per output, and 0 where ``N = 0`` (a window wholly outside the count)."""
    counts = geom.counts
    # one division by the window area (on CUDA PyTorch multiplies by its reciprocal) where
    # that is the per-window division's value: no divisor per window, or one that is the area
    # everywhere (`PoolGeometry.area`) when the area is a power of two (both exact then)
    if counts is None or (geom.area is not None and _power_of_two(geom.area)):
        return total / (geom.y.kernel * geom.x.kernel)
    div = device_constant(
        ("pool-divisor", counts), total.dtype, total.device, lambda: _divisor(counts)
    )
    return torch.where(div > 0, total / div.clamp(min=1), 0.0)


def _windows(t: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    """Every window's taps, ``(N, C, ky kx, OH, OW)`` with the taps in raster order: one copy
    (``unfold``; the prepared source holds exactly the windows' span, so there are ``count``
    outputs per axis)."""
    (ky, kx), s, d = _kernel(geom)
    n, c = t.shape[:2]
    cols = F.unfold(t, (ky, kx), dilation=d, stride=s)
    return cols.view(n, c, ky * kx, geom.y.count, geom.x.count)


def _windows_adjoint(dw: torch.Tensor, shape: tuple[int, ...], geom: PoolGeometry) -> torch.Tensor:
    """Adjoint of `_windows`: each tap's value summed back onto its source pixel (``fold``)."""
    k, s, d = _kernel(geom)
    n, c, kk, oh, ow = dw.shape
    return F.fold(dw.reshape(n, c * kk, oh * ow), tuple(shape[-2:]), k, dilation=d, stride=s)


def _sum_pool(t: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    k, s, d = _kernel(geom)
    if d != (1, 1):  # PyTorch's average pooling has no dilation
        return _windows(t, geom).sum(2)
    return F.avg_pool2d(t, k, s, 0, False, True, 1)  # divisor_override=1: a sum


def _sum_pool_backward(g: torch.Tensor, t: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    """Adjoint of `_sum_pool`; reads only ``t``'s shape."""
    k, s, d = _kernel(geom)
    if d != (1, 1):
        n, c, oh, ow = g.shape
        return _windows_adjoint(g.unsqueeze(2).expand(n, c, k[0] * k[1], oh, ow), t.shape, geom)
    return _avg_pool_backward(g.contiguous(), t, list(k), list(s), [0, 0], False, True, 1)


def average_pool_forward(x: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    t = apply_extract(x, geom.plan)
    if _half_average(t, geom):
        k, s, _ = _kernel(geom)
        return F.avg_pool2d(t, k, s, 0, False, True)
    return _divide(_sum_pool(widen(t), geom), geom).to(x.dtype)


def _half_average(t: torch.Tensor, geom: PoolGeometry) -> bool:
    """Whether PyTorch's pooling of half-precision CUDA ``t`` gives the widened path's bits:
    every tap counts (`PoolGeometry.area`) and the area is a power of two (a global 4x4 pooling,
    2x2 windows), so that PyTorch's float32 sums, in the same order, divided there by the area
    and rounded once, are the widened path's value. It reads the image once, where the widened
    path writes and reads a float32 copy of it."""
    if t.dtype not in (torch.float16, torch.bfloat16) or not t.is_cuda:
        return False
    area = geom.area
    return geom.y.dilation == geom.x.dilation == 1 and area is not None and _power_of_two(area)


def average_pool_backward(g: torch.Tensor, x: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    """``dx_t = sum_{o: t in T(o)} g_o / N(o)`` over image pixels (the sum's exact adjoint).

    Windows that tile the image (stride = kernel, no dilation: a global average pooling, or
    2×2 / 2 pooling) give each pixel one window's ``g_o / N(o)`` or nothing: that value is
    rounded to ``g``'s dtype once and spread (`_spread`), which is what the float32 sum would
    give, without its two float32 images of the source's size."""
    gd = _divide(widen(g), geom)
    # The sum's backward needs only the prepared source's size, which the plan knows.
    shape = (x.shape[0], x.shape[1], geom.plan.y.length, geom.plan.x.length)
    k, s, d = _kernel(geom)
    if k == s and d == (1, 1):
        return apply_extract_adjoint(_spread(gd.to(g.dtype), k, shape), geom.plan)
    t = torch.empty(shape, dtype=gd.dtype, device=gd.device)
    return apply_extract_adjoint(_sum_pool_backward(gd, t, geom).to(g.dtype), geom.plan)


def _spread(v: torch.Tensor, k: tuple[int, int], shape: tuple[int, int, int, int]) -> torch.Tensor:
    """``(N, C, H, W)`` with ``v[n, c, i, j]`` on window ``(i, j)``'s ``ky × kx`` pixels and
    zeros on the rows and columns no window covers (one copy, in the preferred storage)."""
    n, c, oy, ox = v.shape
    ky, kx = k
    if channels_last_preferred(v.dtype, v.device):  # the storage the next kernels want
        t = v.permute(0, 2, 3, 1)[:, :, None, :, None, :].expand(n, oy, ky, ox, kx, c)
        out = t.reshape(n, oy * ky, ox * kx, c).permute(0, 3, 1, 2)
    else:
        t = v[:, :, :, None, :, None].expand(n, c, oy, ky, ox, kx)
        out = t.reshape(n, c, oy * ky, ox * kx)
    if oy * ky < shape[2] or ox * kx < shape[3]:
        out = F.pad(out, (0, shape[3] - ox * kx, 0, shape[2] - oy * ky))
    return out


# -- L2 norm --------------------------------------------------------------------------------


def _l2_terms(
    x: torch.Tensor, geom: PoolGeometry
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """``(r, q, p, shape)`` of the scaled norm (module docstring): the scaled taps ``r``
    ``(N, C, K, OH, OW)``, ``q = sqrt(sum r^2)`` and the scales ``p`` ``(N, C, OH, OW)``, and
    the prepared source's shape."""
    t = widen(apply_extract(x, geom.plan))
    taps = _windows(t, geom)
    m = taps.abs().amax(2)
    f, _ = torch.frexp(m)  # m = f 2^e, 1/2 <= f < 1
    # m / 2f = 2^(e - 1): an exact quotient, representable down to the subnormals and up to
    # the largest finite m (2^e itself would overflow there). Windows of zeros, infinities
    # or NaN keep p = 1 (0 / 0 or inf / inf in the unused branch).
    p = torch.where((m > 0) & (m < torch.inf), m / (f * 2), 1.0)
    r = taps / p.unsqueeze(2)
    q = torch.sqrt((r * r).sum(2))
    return r, q, p, tuple(t.shape)


def l2_pool_forward(x: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    """``y = p sqrt(sum r_t^2)``: the L2 norm of each window, scaled (module docstring)."""
    _, q, p, _ = _l2_terms(x, geom)
    return (p * q).to(x.dtype)


def l2_pool_backward(g: torch.Tensor, x: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    """``dx_t = sum_o g_o x_t / y_o = sum_o g_o r_t / q_o``, with ``y_o = 0`` contributing
    nothing (no NaN)."""
    r, q, _, shape = _l2_terms(x, geom)
    coef = torch.where(q > 0, widen(g) / torch.where(q > 0, q, 1.0), 0.0)
    dt = _windows_adjoint(coef.unsqueeze(2) * r, shape, geom)
    return apply_extract_adjoint(dt.to(g.dtype), geom.plan)
