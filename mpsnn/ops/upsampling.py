"""Upsampling math (nearest, bilinear) as separable per-axis linear maps.

Destination pixel ``u`` (counted from the clip rect's origin) samples the source at

* nearest:  ``i = offset + floor(u / s)``
* bilinear: ``p = offset + (u + 1/2) / s - 1/2`` (half-pixel centres), or with align_corners
  ``p = offset + u (S - 1) / (S s - 1)`` for a source of ``S`` pixels; taps ``floor(p)`` and
  ``floor(p) + 1`` weighted ``1 - f`` and ``f``.

A tap outside the source reads 0 (ZERO) or the edge pixel (CLAMP). With CLAMP, offset 0 and the
whole destination this is exactly ``torch.nn.functional.interpolate`` (nearest, bilinear, both
align_corners values). Per axis the map is a small matrix ``M`` (outputs x source pixels);
``y = M_y x M_x^T`` and the gradient is its exact transpose ``dx = M_y^T g M_x`` (two matrix
products: deterministic, no atomics). The standard case uses ``F.interpolate`` and a block sum.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from mpsnn.ops._dtypes import acc_dtype, device_constant

__all__ = [
    "AxisSampling",
    "UpsampleGeometry",
    "axis_matrix",
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


def axis_matrix(a: AxisSampling, bilinear: bool, align_corners: bool) -> torch.Tensor:
    """The ``(count, size)`` float64 sampling matrix of one axis."""
    m = torch.zeros(a.count, a.size, dtype=torch.float64)

    def tap(k: int, i: int, weight: float) -> None:
        if 0 <= i < a.size:
            m[k, i] += weight
        elif a.clamp:
            m[k, min(max(i, 0), a.size - 1)] += weight

    for k in range(a.count):
        u = a.first + k
        if not bilinear:
            tap(k, a.offset + u // a.scale, 1.0)
            continue
        if align_corners:
            out = a.size * a.scale
            p = a.offset + (u * (a.size - 1) / (out - 1) if out > 1 else 0.0)
        else:
            p = a.offset + (u + 0.5) / a.scale - 0.5
        i0 = math.floor(p)
        f = p - i0
        tap(k, i0, 1.0 - f)
        tap(k, i0 + 1, f)
    return m


def _matrices(geom: UpsampleGeometry, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dtype, device = acc_dtype(like.dtype), like.device
    bilinear, align = geom.bilinear, geom.align_corners

    def matrix(a: AxisSampling) -> torch.Tensor:
        key = ("upsample", a, bilinear, align)
        return device_constant(key, dtype, device, lambda: axis_matrix(a, bilinear, align))

    return matrix(geom.y), matrix(geom.x)


def upsample_forward(x: torch.Tensor, geom: UpsampleGeometry) -> torch.Tensor:
    """``(N, C, H, W) -> (N, C, y.count, x.count)``."""
    if geom.standard:
        size = (geom.y.count, geom.x.count)
        if geom.bilinear:
            return F.interpolate(x, size=size, mode="bilinear", align_corners=geom.align_corners)
        return F.interpolate(x, size=size, mode="nearest")
    my, mx = _matrices(geom, x)
    return (my @ (x.to(my.dtype) @ mx.T)).to(x.dtype)


def upsample_backward(g: torch.Tensor, geom: UpsampleGeometry) -> torch.Tensor:
    """The transpose of `upsample_forward`: ``(N, C, y.count, x.count) -> (N, C, H, W)``."""
    if geom.standard and not geom.bilinear:  # nearest: each source pixel's block sums
        n, c = g.shape[:2]
        sy, sx = geom.y.scale, geom.x.scale
        blocks = g.reshape(n, c, geom.y.size, sy, geom.x.size, sx)
        return blocks.sum((3, 5), dtype=acc_dtype(g.dtype)).to(g.dtype)
    my, mx = _matrices(geom, g)
    return (my.T @ (g.to(my.dtype) @ mx)).to(g.dtype)
