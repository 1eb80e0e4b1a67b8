"""Pooling math: max, average, L2 norm (and dilated max), forward and gradient.

Every pooling reads its windows through the MPS window model (`mpsnn.ops.window`), prepared
without operator padding so that out-of-image reads are real values: 0 for ZERO edges, the
edge pixel for CLAMP. Per output ``o`` with window taps ``T(o)``:

* max:      ``y = max_{t in T(o)} x_t``; gradient to the **first** maximum in raster order
  (rows, then columns), recomputed from the source (no index tensor is kept between forward
  and gradient). A maximum that is a ZERO-edge padding value passes no gradient back.
* average:  ``y = sum_{t in T(o), t in image} x_t / N(o)``. ``N`` counts the taps inside a
  per-axis interval: the whole window for ZERO edges (``k_x k_y``); the image grown by
  ``zero_pad_size`` on each side for CLAMP (MPS: CLAMP shrinks the window); the image plus the
  padding the policy adds for ZERO with EXCLUDE_EDGES (Caffe). ``N = 0`` gives 0.
* L2 norm:  ``y = sqrt(sum_{t in T(o)} x_t^2)``; gradient ``g x_t / y``, and 0 where ``y = 0``
  (an all-zero window has a zero gradient, not NaN).

Sums and norms of float16/bfloat16 data are computed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpsnn.core.geometry import AxisWindow, EdgeMode
from mpsnn.ops import triton as fast_paths
from mpsnn.ops._dtypes import device_constant, widen
from mpsnn.ops.plans import PoolGeometry
from mpsnn.ops.window import apply_extract, apply_extract_adjoint, plan_extract

__all__ = [
    "PoolGeometry",
    "average_pool_backward",
    "average_pool_forward",
    "l2_pool_backward",
    "l2_pool_forward",
    "max_pool_backward",
    "max_pool_forward",
    "pool_geometry",
]

_max_pool_backward = torch.ops.aten.max_pool2d_with_indices_backward.default
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
    return PoolGeometry(y, x, edge, plan, valid_y, valid_x, counts)


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


def max_pool_forward(x: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    k, s, d = _kernel(geom)
    return F.max_pool2d(apply_extract(x, geom.plan), k, s, 0, d)


def max_pool_backward(g: torch.Tensor, x: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    """Route each output's gradient to the first maximum of its window (recomputed from ``x``)."""
    fast = fast_paths.max_pool_backward(g, x, geom)
    return fast if fast is not None else max_pool_backward_portable(g, x, geom)


def max_pool_backward_portable(
    g: torch.Tensor, x: torch.Tensor, geom: PoolGeometry
) -> torch.Tensor:
    """The reference path: argmax via ``max_pool2d_with_indices`` (first maximum wins ties),
    then PyTorch's gather-style backward (deterministic), then the extraction's adjoint."""
    k, s, d = _kernel(geom)
    t = apply_extract(x, geom.plan).contiguous()
    _, idx = F.max_pool2d(t, k, s, 0, d, return_indices=True)
    dt = _max_pool_backward(g.contiguous(), t, list(k), list(s), [0, 0], list(d), False, idx)
    return apply_extract_adjoint(dt, geom.plan)


# -- average --------------------------------------------------------------------------------


def _divisor(counts: tuple[tuple[int, ...], tuple[int, ...]]) -> torch.Tensor:
    cy = torch.tensor(counts[0], dtype=torch.float64)
    cx = torch.tensor(counts[1], dtype=torch.float64)
    return (cy.view(-1, 1) * cx.view(1, -1)).view(1, 1, len(counts[0]), len(counts[1]))


def _divide(total: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    """``total / N`` per output, and 0 where ``N = 0`` (a window wholly outside the count)."""
    if geom.counts is None:
        return total / (geom.y.kernel * geom.x.kernel)
    counts = geom.counts
    div = device_constant(
        ("pool-divisor", counts), total.dtype, total.device, lambda: _divisor(counts)
    )
    return torch.where(div > 0, total / div.clamp(min=1), 0.0)


def _sum_pool(t: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    k, s, _ = _kernel(geom)
    return F.avg_pool2d(t, k, s, 0, False, True, 1)  # divisor_override=1: a sum


def _sum_pool_backward(g: torch.Tensor, t: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    k, s, _ = _kernel(geom)
    return _avg_pool_backward(g.contiguous(), t, list(k), list(s), [0, 0], False, True, 1)


def average_pool_forward(x: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    t = widen(apply_extract(x, geom.plan))
    return _divide(_sum_pool(t, geom), geom).to(x.dtype)


def average_pool_backward(g: torch.Tensor, x: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    """``dx_t = sum_{o: t in T(o)} g_o / N(o)`` over image pixels (the sum's exact adjoint)."""
    gd = _divide(widen(g), geom)
    # The sum's backward needs only the prepared source's size, which the plan knows.
    shape = (x.shape[0], x.shape[1], geom.plan.y.length, geom.plan.x.length)
    t = torch.empty(shape, dtype=gd.dtype, device=gd.device)
    return apply_extract_adjoint(_sum_pool_backward(gd, t, geom).to(g.dtype), geom.plan)


# -- L2 norm --------------------------------------------------------------------------------


def l2_pool_forward(x: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    t = widen(apply_extract(x, geom.plan))
    return torch.sqrt(_sum_pool(t * t, geom)).to(x.dtype)


def l2_pool_backward(g: torch.Tensor, x: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    """``dx_t = sum_o g_o x_t / y_o``, with ``y_o = 0`` contributing nothing (no NaN)."""
    t = widen(apply_extract(x, geom.plan))
    y = torch.sqrt(_sum_pool(t * t, geom))
    gy = torch.where(y > 0, widen(g) / torch.where(y > 0, y, 1.0), 0.0)
    dt = _sum_pool_backward(gy, t, geom) * t
    return apply_extract_adjoint(dt.to(g.dtype), geom.plan)
