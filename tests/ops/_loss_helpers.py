"""Shared by the loss-math tests (`test_loss_ops`, `test_loss_ops_edges`): the loss types'
names and groups, a float64 reference written from the formulas (differentiable in the
predictions, so autograd gives the reference gradient), and the test data: predictions and
labels per loss type, labels in three forms, weights in four."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from mpsnn.ops import loss as L
from mpsnn.ops.loss import LossParams

NAMES = {
    L.MEAN_ABSOLUTE_ERROR: "mae",
    L.MEAN_SQUARED_ERROR: "mse",
    L.SOFTMAX_CROSS_ENTROPY: "softmax_ce",
    L.SIGMOID_CROSS_ENTROPY: "sigmoid_ce",
    L.CATEGORICAL_CROSS_ENTROPY: "categorical_ce",
    L.HINGE: "hinge",
    L.HUBER: "huber",
    L.COSINE_DISTANCE: "cosine",
    L.LOG: "log",
    L.KULLBACK_LEIBLER_DIVERGENCE: "kl",
}
REDUCTIONS = {L.NONE: "none", L.SUM: "sum", L.MEAN: "mean", L.SUM_BY_NON_ZERO_WEIGHTS: "nzw"}
CROSS_ENTROPIES = (L.SOFTMAX_CROSS_ENTROPY, L.CATEGORICAL_CROSS_ENTROPY)
SMOOTHED = (*CROSS_ENTROPIES, L.SIGMOID_CROSS_ENTROPY)
PER_PIXEL = (*CROSS_ENTROPIES, L.COSINE_DISTANCE)
DELTA = 0.7  # Huber: both pieces occur with unit-variance residuals


# -- the reference, from the formulas -------------------------------------------------------


def _elementwise_ref(kind: int, y, t, p: LossParams):
    if kind == L.MEAN_ABSOLUTE_ERROR:
        return (y - t).abs()
    if kind == L.MEAN_SQUARED_ERROR:
        return (y - t) ** 2
    if kind == L.SIGMOID_CROSS_ENTROPY:
        ts = (1 - p.label_smoothing) * t + p.label_smoothing / 2
        return torch.clamp(y, min=0) - y * ts + torch.log(1 + torch.exp(-y.abs()))
    if kind == L.HINGE:
        return F.relu(1 - (2 * t - 1) * y)  # derivative 0 at the kink
    if kind == L.HUBER:
        r, d = y - t, p.delta
        return torch.where(r.abs() <= d, 0.5 * r**2, d * (r.abs() - d / 2))
    if kind == L.LOG:
        e = p.epsilon
        return -t * torch.log(y + e) - (1 - t) * torch.log(1 - y + e)
    if kind == L.KULLBACK_LEIBLER_DIVERGENCE:
        pos = t > 0
        return torch.where(pos, t * (torch.log(torch.where(pos, t, 1.0)) - y), 0 * y)
    raise AssertionError(kind)


def reference(y, labels, weights, p: LossParams) -> torch.Tensor:
    """The loss image in float64, differentiable in ``y``; reductions written image by image."""
    n, c, h, w = y.shape
    k = c if p.number_of_classes is None else p.number_of_classes
    ls = p.label_smoothing
    if labels.dtype == torch.int64:
        t = F.one_hot(labels, c).permute(0, 3, 1, 2).double()
        if weights is None:
            wts = torch.ones_like(t)
        elif weights.dim() == 3:
            wts = weights[:, None].double().expand(n, c, h, w)
        else:
            wts = weights[:, :c].double()
    else:
        t = labels[:, :c].double()
        wts = torch.ones_like(t) if weights is None else weights[:, :c].double()
    if p.kind in CROSS_ENTROPIES:
        ts = (1 - ls) * t + ls / k
        if p.kind == L.SOFTMAX_CROSS_ENTROPY:
            logp = torch.log_softmax(y, 1)
        else:
            logp = torch.log(torch.clamp(y, min=p.epsilon))
        loss = -(wts * ts * logp).sum(1, keepdim=True)
        unit_weight = wts.ne(0).any(1, keepdim=True)  # a pixel counts if any class weight does
    elif p.kind == L.COSINE_DISTANCE:
        wbar = wts.mean(1, keepdim=True)  # one weight per pixel: the mean of its C weights
        loss = wbar * (1 - (y * t).sum(1, keepdim=True))
        unit_weight = wbar != 0
    else:
        loss = wts * _elementwise_ref(p.kind, y, t, p)
        unit_weight = wts != 0
    loss = p.weight * loss
    if p.reduction == L.NONE:
        return loss
    per_image = []
    for i in range(n):
        s = loss[i].sum()
        if p.reduction == L.MEAN:
            s = s / loss[i].numel()  # C·H·W elements, or H·W pixels for per-pixel types
        elif p.reduction == L.SUM_BY_NON_ZERO_WEIGHTS:
            count = int(unit_weight[i].sum())
            s = s / count if count else s * 0
        per_image.append(s)
    return torch.stack(per_image).view(n, 1, 1, 1)


# -- data -----------------------------------------------------------------------------------


def _predictions_and_labels(kind: int, shape, gen) -> tuple[torch.Tensor, torch.Tensor]:
    def rn():
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def ru():
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    if kind in (L.SOFTMAX_CROSS_ENTROPY, L.SIGMOID_CROSS_ENTROPY):
        return 2 * rn(), ru()  # labels not normalized: the sum_c t'_c factor matters
    if kind in (L.CATEGORICAL_CROSS_ENTROPY, L.LOG):
        return 0.05 + 0.9 * ru(), ru()
    if kind == L.HINGE:
        return 1.5 * rn(), torch.bernoulli(
            torch.full(shape, 0.5, dtype=torch.float64), generator=gen
        )
    if kind == L.KULLBACK_LEIBLER_DIVERGENCE:
        return torch.log_softmax(rn(), 1), torch.softmax(rn(), 1)
    return rn(), rn()


def _weights(shape, gen) -> torch.Tensor:
    """In [0, 2) with about a quarter exact zeros, and image 0's first pixel zero throughout."""
    w = 2 * torch.rand(*shape, generator=gen, dtype=torch.float64)
    w[torch.rand(*shape, generator=gen) < 0.25] = 0
    w[0, ..., 0, 0] = 0
    return w


def make_case(kind: int, form: str, wform: str | None, seed: int, shape=(2, 4, 3, 2)):
    """(y, labels, weights). form: "float" (Cl = C), "wide" (Cl = C + 2, the extra channels
    NaN: they must take no part), "index" (int64 class indices). wform: None, "elem" (the
    labels' shape), "pixel" ((N, H, W), index labels), "channel" ((N, C + 1, H, W), index
    labels, the extra channel NaN)."""
    gen = torch.Generator().manual_seed(seed)
    n, c, h, w = shape
    y, t = _predictions_and_labels(kind, shape, gen)
    nan2 = torch.full((n, 2, h, w), float("nan"), dtype=torch.float64)
    if form == "index":
        labels = torch.randint(0, c, (n, h, w), generator=gen)
    elif form == "wide":
        labels = torch.cat([t, nan2], 1)
    else:
        labels = t
    weights = None
    if wform == "elem":
        weights = _weights(labels.shape, gen)
        if form == "wide":
            weights[:, c:] = float("nan")
    elif wform == "pixel":
        weights = _weights((n, h, w), gen)
    elif wform == "channel":
        weights = torch.cat([_weights((n, c, h, w), gen), nan2[:, :1]], 1)
    return y, labels, weights


def _cases():
    for kind in NAMES:
        forms = ["float", "wide"] + (["index"] if kind in CROSS_ENTROPIES else [])
        for form in forms:
            wforms = [None, "pixel", "channel"] if form == "index" else [None, "elem"]
            smoothing = [0.0, 0.1] if kind in SMOOTHED else [0.0]
            for wform, ls, red, weight in itertools.product(
                wforms, smoothing, REDUCTIONS, [1.0, 0.75]
            ):
                ident = f"{NAMES[kind]}-{form}-w{wform}-ls{ls}-{REDUCTIONS[red]}-s{weight}"
                yield pytest.param(kind, form, wform, ls, red, weight, id=ident)


def _params(kind, red, weight=1.0, ls=0.0, k=None, eps=1e-7) -> LossParams:
    return LossParams(kind, red, weight, ls, k, eps, DELTA)


def _on(device: str, *tensors):
    return tuple(None if x is None else x.to(device) for x in tensors)
