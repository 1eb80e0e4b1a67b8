"""A float64 PyTorch restatement of the loss image (written from the documented formulas: the
loss docstrings and docs/semantics.md "The split loss", not from mpsnn's code),
differentiable in the predictions and the labels, for autograd references."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import mpsnn as m

LT, RT = m.LossType, m.ReductionType
PER_PIXEL = (LT.SOFTMAX_CROSS_ENTROPY, LT.CATEGORICAL_CROSS_ENTROPY, LT.COSINE_DISTANCE)


def loss_image(
    y: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    desc: m.LossDescriptor,
    across: bool = False,
) -> torch.Tensor:
    """The loss image of ``y`` (N, C, H, W), labels (N, Cl >= C, H, W), weights or None."""
    kind, red = desc.loss_type, desc.reduction_type
    n, c, h, w = y.shape
    t = labels[:, :c]
    wt = None if weights is None else weights[:, :c]
    ls, eps, d = desc.label_smoothing, desc.epsilon, desc.delta
    k = c if desc.number_of_classes is None else desc.number_of_classes
    if kind in PER_PIXEL:
        if kind == LT.COSINE_DISTANCE:
            wbar = torch.ones(n, 1, h, w, dtype=y.dtype) if wt is None else wt.mean(1, True)
            per = desc.weight * wbar * (1 - (y * t).sum(1, keepdim=True))
            nonzero = wbar != 0
        else:
            ts = (1 - ls) * t + ls / k
            a = desc.weight * ts * (1 if wt is None else wt)
            logp = (
                F.log_softmax(y, 1)
                if kind == LT.SOFTMAX_CROSS_ENTROPY
                else torch.log(y.clamp(min=eps))
            )
            per = -(a * logp).sum(1, keepdim=True)
            nonzero = (
                torch.ones(n, 1, h, w, dtype=torch.bool) if wt is None else (wt != 0).any(1, True)
            )
        units = h * w
    else:
        r = y - t
        if kind == LT.MEAN_ABSOLUTE_ERROR:
            el = r.abs()
        elif kind == LT.MEAN_SQUARED_ERROR:
            el = r**2
        elif kind == LT.SIGMOID_CROSS_ENTROPY:
            el = F.binary_cross_entropy_with_logits(y, (1 - ls) * t + ls / 2, reduction="none")
        elif kind == LT.HINGE:
            el = F.relu(1 - (2 * t - 1) * y)
        elif kind == LT.HUBER:
            el = F.huber_loss(y, t, reduction="none", delta=d)
        elif kind == LT.LOG:
            el = -t * torch.log(y + eps) - (1 - t) * torch.log(1 - y + eps)
        else:
            el = torch.xlogy(t, t) - t * y
        per = desc.weight * el * (1 if wt is None else wt)
        nonzero = torch.ones_like(y, dtype=torch.bool) if wt is None else wt != 0
        units = c * h * w
    if red == RT.NONE:
        return per
    sums = per.sum((1, 2, 3))
    if red == RT.SUM:
        div = torch.ones(n, dtype=y.dtype)
    elif red == RT.MEAN:
        div = torch.full((n,), float(units), dtype=y.dtype)
    else:
        div = nonzero.sum((1, 2, 3)).to(y.dtype)
    if across:
        out = torch.zeros(n, 1, 1, 1, dtype=y.dtype)
        # SUM divides by 1; MEAN by N times the units; SUM_BY_NON_ZERO_WEIGHTS by the batch's
        # non-zero weights
        total = sums.sum() if red == RT.SUM else sums.sum() / div.sum().clamp(min=1)
        return torch.cat([total.view(1, 1, 1, 1), out[1:]])
    return (sums / div.clamp(min=1)).view(n, 1, 1, 1)


def inputs(
    kind: m.LossType, n: int, c: int, h: int, w: int, seed: int, extra: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Predictions in the loss's domain, labels with ``extra`` channels more, weights (some
    zero) of the labels' shape; float64."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(n, c, h, w, generator=g, dtype=torch.float64)
    if kind in (LT.LOG, LT.CATEGORICAL_CROSS_ENTROPY):
        y = torch.rand(n, c, h, w, generator=g, dtype=torch.float64) * 0.9 + 0.05
    if kind == LT.KULLBACK_LEIBLER_DIVERGENCE:
        y = F.log_softmax(y, 1)
    t = torch.rand(n, c + extra, h, w, generator=g, dtype=torch.float64)
    if kind == LT.HINGE:
        t = (t > 0.5).double()
    wt = torch.rand(n, c + extra, h, w, generator=g, dtype=torch.float64)
    wt[wt < 0.2] = 0
    return y, t, wt
