"""Reduction and local-correlation math (MPS ``MPSNNReduce*`` and ``MPSNNLocalCorrelation``)
on tensors. The kernels (`mpsnn.cnn.reduce`, `mpsnn.cnn.correlation`) cut the blocks out of
their images; these functions see ``(N, C, H, W)`` blocks and keep the reduced axis with
size 1.

* `reduce_block`: min, max, mean, sum, and the first index of the minimum or maximum (as a
  float) along the rows (x: ``dim 3``), the columns (y: ``dim 2``) or the feature channels
  (``dim 1``). Sums and means accumulate in at least float32; min, max and the indices are
  exact in every dtype. Ties give the first index, as `torch.argmax` does (and as mpsnn's max
  pooling does).
* `weighted_channels`: ``sum_c x[c] * w[c]``, divided by the channel count (mean) or by the
  number of non-zero weights (0 where every weight is 0).
* `spatial_mean`: the mean over ``y`` and ``x`` of each image's channels, ``(N, C, 1, 1)``;
  `spatial_mean_backward`, its adjoint: the incoming gradient divided by the ``H·W`` values
  averaged, on every pixel of the region the forward read, 0 elsewhere.
* `local_correlation`: ``O[k(m, n)] = sum_c A[c, y, x] * B[c, y + N[n], x + M[m]]`` with
  ``M[m] = (m - wx) * sx``, ``N[n] = (n - wy) * sy`` and ``k(m, n) = n * (2 wx + 1) + m``;
  taps of ``B`` outside its block read 0.
"""

from __future__ import annotations

import torch

from mpsnn.ops._dtypes import acc_dtype

__all__ = [
    "REDUCE_OPS",
    "local_correlation",
    "reduce_block",
    "spatial_mean",
    "spatial_mean_backward",
    "weighted_channels",
]

#: the operations `reduce_block` knows
REDUCE_OPS = ("min", "max", "mean", "sum", "argmin", "argmax")


def reduce_block(x: torch.Tensor, op: str, dim: int, weight: float = 1.0) -> torch.Tensor:
    """``op`` of ``x`` along ``dim``, keeping it (size 1). ``weight`` multiplies the values
    before a sum (MPS ``MPSNNReduceFeatureChannelsSum.weight``). Sums and means come back in
    the accumulation dtype (`acc_dtype`), indices as floats of that dtype, min and max in
    ``x``'s dtype."""
    if op == "min":
        return x.amin(dim, keepdim=True)
    if op == "max":
        return x.amax(dim, keepdim=True)
    acc = acc_dtype(x.dtype)
    if op == "argmin":
        return x.argmin(dim, keepdim=True).to(acc)
    if op == "argmax":
        return x.argmax(dim, keepdim=True).to(acc)
    s = x.sum(dim, keepdim=True, dtype=acc)
    if op == "mean":
        return s / x.shape[dim]
    return s if weight == 1.0 else s * weight


def spatial_mean(x: torch.Tensor) -> torch.Tensor:
    """``mean_{y, x} x[n, c, y, x]``: ``(N, C, 1, 1)`` in the accumulation dtype."""
    acc = acc_dtype(x.dtype)
    return x.sum((2, 3), keepdim=True, dtype=acc) / (x.shape[2] * x.shape[3])


def spatial_mean_backward(
    grad: torch.Tensor, x: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int]
) -> torch.Tensor:
    """The adjoint of `spatial_mean` of the block ``x[:, :, y0 : y0 + h, x0 : x0 + w]`` of the
    forward source ``x`` (``rows = (y0, h)``, ``cols = (x0, w)``): ``grad`` ``(N, C, 1, 1)``
    divided by ``h·w`` on that block, 0 on the rest of ``x``'s ``(N, C, H, W)``; in the wider
    of the two dtypes (``x`` is read for its shape and dtype only)."""
    (y0, h), (x0, w) = rows, cols
    dtype = torch.promote_types(grad.dtype, x.dtype)
    share = (grad.to(dtype) / (h * w)).expand(-1, -1, h, w)
    if (y0, x0, h, w) == (0, 0, *x.shape[2:]):
        return share.contiguous()
    dx = x.new_zeros(x.shape, dtype=dtype)
    dx[:, :, y0 : y0 + h, x0 : x0 + w] = share
    return dx


def weighted_channels(x: torch.Tensor, w: torch.Tensor, mode: str) -> torch.Tensor:
    """``sum_c x[c] w[c]`` per pixel, ``(N, 1, H, W)`` in the accumulation dtype.

    ``w`` broadcasts against ``x`` (a ``(N or 1, C, 1, 1)`` block: one weight per channel).
    ``mode``: ``"sum"``; ``"mean"`` divides by the channel count; ``"non_zero"`` divides by
    the number of non-zero weights, and gives 0 where there is none.
    """
    acc = acc_dtype(torch.promote_types(x.dtype, w.dtype))
    s = (x.to(acc) * w.to(acc)).sum(1, keepdim=True)
    if mode == "mean":
        return s / x.shape[1]
    if mode == "non_zero":
        count = (w != 0).sum(1, keepdim=True).to(acc)
        return torch.where(count > 0, s / count.clamp_min(1), torch.zeros_like(s))
    return s


def local_correlation(
    a: torch.Tensor, b: torch.Tensor, window: tuple[int, int], stride: tuple[int, int]
) -> torch.Tensor:
    """The local correlation of blocks ``a`` ``(N, C, H, W)`` and ``b`` ``(N or 1, C, Hb,
    Wb)``; ``window = (wx, wy)``, ``stride = (sx, sy)``. Returns ``(N, (2wx+1)(2wy+1), H, W)``
    in the accumulation dtype. Offsets run over x fastest (see the module docstring)."""
    wx, wy = window
    sx, sy = stride
    acc = acc_dtype(torch.promote_types(a.dtype, b.dtype))
    n, c, h, w = a.shape
    px, py = wx * sx, wy * sy
    # b on a zero canvas: each offset reads one shifted view of it (taps outside b read 0)
    canvas = a.new_zeros((b.shape[0], c, h + 2 * py, w + 2 * px), dtype=acc)
    hb, wb = min(h + py, b.shape[2]), min(w + px, b.shape[3])
    canvas[:, :, py : py + hb, px : px + wb] = b[:, :, :hb, :wb]
    af = a.to(acc)
    out = af.new_empty((n, (2 * wx + 1) * (2 * wy + 1), h, w))
    k = 0
    for j in range(2 * wy + 1):
        y0 = py + (j - wy) * sy
        for i in range(2 * wx + 1):
            x0 = px + (i - wx) * sx
            out[:, k] = (af * canvas[:, :, y0 : y0 + h, x0 : x0 + w]).sum(1)
            k += 1
    return out
