"""Gram matrix math (MPS ``MPSNNGramMatrixCalculation`` and its gradient) on tensors.

For each image ``b`` of a block ``x`` of shape ``(N, C, H, W)`` (pixels ``p = (y, x)``)::

    G[b, i, j] = alpha * sum_p x[b, i, p] * x[b, j, p]

stored as MPS stores it: a ``C`` wide, 1 high image with ``C`` feature channels, channel ``i``
and x-coordinate ``j`` holding ``G[b, i, j]`` (the matrix is symmetric, so the transposed
reading is the same). The gradient with respect to ``x`` for an incoming gradient ``dG`` (the
same layout) is::

    dx[b, k, p] = alpha * sum_j (dG[b, k, j] + dG[b, j, k]) * x[b, j, p]

because ``d G[i, j] / d x[k, p] = alpha (delta_ik x[j, p] + x[i, p] delta_jk)``. Products are
accumulated in at least float32 (float64 stays float64); float32 products on CUDA follow
`mpsnn.set_float32_matmul_precision`.
"""

from __future__ import annotations

import torch

from mpsnn.core.precision import float32_call
from mpsnn.ops._dtypes import acc_dtype

__all__ = ["gram_backward", "gram_forward"]


def _pixels(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``(N, C, H*W)`` in its accumulation dtype."""
    n, c, h, w = x.shape
    return x.reshape(n, c, h * w).to(acc_dtype(x.dtype))


def gram_forward(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha * x x^T`` per image, as an ``(N, C, 1, C)`` block in ``x``'s dtype."""
    f = _pixels(x)
    g = float32_call(torch.bmm, f, f, f.transpose(1, 2))
    if alpha != 1.0:
        g = g * alpha
    return g.unsqueeze(2).to(x.dtype)


def gram_backward(grad: torch.Tensor, x: torch.Tensor, alpha: float) -> torch.Tensor:
    """``alpha (dG + dG^T) x`` per image: ``grad`` is ``(N, C, 1, C)``, ``x`` the forward block
    ``(N, C, H, W)``; the result has ``x``'s shape, in the wider of the two dtypes."""
    n, c, h, w = x.shape
    f = _pixels(x)
    dg = grad[:, :, 0, :].to(f.dtype)
    sym = dg + dg.transpose(1, 2)
    dx = float32_call(torch.bmm, f, sym, f)
    if alpha != 1.0:
        dx = dx * alpha
    return dx.reshape(n, c, h, w).to(torch.promote_types(grad.dtype, x.dtype))
