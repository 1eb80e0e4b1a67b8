"""Loss math of MPS's split loss (``MPSNNForwardLoss``, ``MPSNNLossGradient``): the loss
image alone, and the gradient of ``<g, loss image>`` for an incoming gradient ``g`` with
respect to the predictions or the labels.

The per-element losses, weights, label smoothing and per-image reductions are those of
`mpsnn.ops.loss` (`loss_forward_backward` computes them; notation as there: ``y``
predictions (N, C, H, W), ``t`` labels of which the first C channels take part, ``w``
per-element weights, ``weight`` the scalar weight, ``ls``, ``K``, ``eps``, ``delta``). This
module adds three things.

**The batch reduction** (``across_batch``, MPS ``reduceAcrossBatch``). With a reduction
other than NONE the loss of the whole batch is one value, ``sum_n S_n / D``, written into
image 0 of the (N, 1, 1, 1) loss image; images 1.. hold 0. ``D`` is 1 (SUM), ``N`` times the
units of one image (MEAN: ``N C H W``, or ``N H W`` for the per-pixel types), or the number of
weighting units with a non-zero weight in the whole batch (SUM_BY_NON_ZERO_WEIGHTS; ``N``
times the units without weights; 0 counts as 1, as per image). With NONE it changes nothing.

**The incoming gradient** ``g`` has the loss image's shape. The loss image's entries depend on
disjoint parts of ``y``: image ``n`` of a reduced loss on image ``n``; an element of a NONE
loss of a per-element type on that element; a pixel of a NONE loss of a per-pixel type on
that pixel's C channels. So ``d <g, L> / dy = g * dL/dy`` with ``g`` broadcast over what each
entry depends on, and ``dL/dy`` the gradient `loss_forward_backward` returns (that of the sum
of the loss image). Across the batch only image 0 depends on ``y``: ``g[0] * d(total / D)/dy``
(``g``'s other images take no part).

**Label gradients** (``dL/dt``, MPS ``computeLabelGradients``), unweighted per element, with
``r = y - t``; the weights, the divisors and ``g`` then apply as for ``dL/dy``:

* MEAN_ABSOLUTE_ERROR ``|r|``: ``-sign(r)`` (0 at ``r = 0``, as for ``y``);
* MEAN_SQUARED_ERROR ``r^2``: ``-2 r``;
* HUBER: ``-r`` inside ``delta``, ``-delta sign(r)`` outside;
* SIGMOID_CROSS_ENTROPY ``max(y, 0) - y t' + log(1 + e^-|y|)`` with ``t' = (1 - ls) t +
  ls / 2``: ``-(1 - ls) y``;
* HINGE ``max(1 - (2t - 1) y, 0)``: ``-2 y`` where the margin is positive, 0 elsewhere (the
  kink takes 0, as for ``y``);
* LOG ``-t log(y + eps) - (1 - t) log(1 - y + eps)``: ``log(1 - y + eps) - log(y + eps)``;
* SOFTMAX_CROSS_ENTROPY ``-sum_c a_c log_softmax(y)_c`` with ``a_c = weight w_c t'_c``,
  ``t'_c = (1 - ls) t_c + ls / K``: ``-weight w_c (1 - ls) log_softmax(y)_c``;
* CATEGORICAL_CROSS_ENTROPY: ``-weight w_c (1 - ls) log(max(y_c, eps))``;
* COSINE_DISTANCE ``weight w_bar (1 - sum_c y_c t_c)``: ``-weight w_bar y_c``.

KULLBACK_LEIBLER_DIVERGENCE has none: ``d(t log t)/dt = log t + 1`` is infinite at ``t = 0``,
the usual value of a label. Label channels ``>= C`` take no part: their gradient is 0. The
label gradient has the labels' shape and dtype.
"""

from __future__ import annotations

import torch

from mpsnn.ops._dtypes import acc_dtype
from mpsnn.ops.loss import (
    _PER_PIXEL,
    CATEGORICAL_CROSS_ENTROPY,
    COSINE_DISTANCE,
    HINGE,
    HUBER,
    KULLBACK_LEIBLER_DIVERGENCE,
    LOG,
    MEAN,
    MEAN_ABSOLUTE_ERROR,
    MEAN_SQUARED_ERROR,
    NONE,
    SIGMOID_CROSS_ENTROPY,
    SOFTMAX_CROSS_ENTROPY,
    SUM_BY_NON_ZERO_WEIGHTS,
    LossParams,
    loss_forward_backward,
)

__all__ = ["LABEL_GRADIENT_TYPES", "forward_loss", "label_gradient", "prediction_gradient"]

#: the loss types whose gradient with respect to the labels is defined (all but KL).
LABEL_GRADIENT_TYPES = frozenset(range(10)) - {KULLBACK_LEIBLER_DIVERGENCE}


def _unreduced(params: LossParams) -> LossParams:
    return params._replace(reduction=NONE)


def _units(kind: int, shape: tuple[int, ...]) -> int:
    _, c, h, w = shape
    return h * w if kind in _PER_PIXEL else c * h * w


def _counts(kind: int, wt: torch.Tensor) -> torch.Tensor:
    """Per image, the weighting units with a non-zero weight (``wt``: the first C channels)."""
    if kind == COSINE_DISTANCE:
        return (wt.mean(1) != 0).sum((1, 2))
    if kind in _PER_PIXEL:
        return (wt != 0).any(1).sum((1, 2))
    return (wt != 0).sum((1, 2, 3))


def _divisor(
    params: LossParams, y: torch.Tensor, wt: torch.Tensor | None, across_batch: bool
) -> float | torch.Tensor:
    """What the reduced loss is divided by: one number across the batch, else an
    (N, 1, 1, 1) tensor of per-image divisors (as `mpsnn.ops.loss` divides)."""
    kind, reduction = int(params.kind), int(params.reduction)
    n = y.shape[0]
    units = _units(kind, y.shape)
    if reduction == MEAN or (reduction == SUM_BY_NON_ZERO_WEIGHTS and wt is None):
        per_image = torch.full((n,), float(units), dtype=acc_dtype(y.dtype), device=y.device)
    elif reduction == SUM_BY_NON_ZERO_WEIGHTS and wt is not None:
        per_image = _counts(kind, wt).to(acc_dtype(y.dtype))
    else:  # SUM (NONE divides by nothing)
        per_image = torch.ones(n, dtype=acc_dtype(y.dtype), device=y.device)
    if across_batch:
        if reduction in (SUM_BY_NON_ZERO_WEIGHTS, MEAN):
            return per_image.sum().clamp(min=1)
        return 1.0
    return per_image.clamp(min=1).view(-1, 1, 1, 1)


def _weights(weights: torch.Tensor | None, c: int, acc: torch.dtype) -> torch.Tensor | None:
    return None if weights is None else weights[:, :c].to(acc)


def forward_loss(
    y: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    params: LossParams,
    across_batch: bool = False,
) -> torch.Tensor:
    """The loss image (accumulation dtype) of predictions ``y`` (N, C, H, W) and float labels
    (N, Cl >= C, H, W), optional weights of the labels' shape: that of
    `mpsnn.ops.loss.loss_forward_backward`, or with ``across_batch`` (and a reduction) the
    batch's total in image 0 (module docstring)."""
    if not across_batch or int(params.reduction) == NONE:
        return loss_forward_backward(y, labels, weights, params)[0]
    loss, _ = loss_forward_backward(y, labels, weights, _unreduced(params))
    total = loss.sum() / _divisor(params, y, _weights(weights, y.shape[1], loss.dtype), True)
    out = torch.zeros(y.shape[0], 1, 1, 1, dtype=loss.dtype, device=loss.device)
    out[0, 0, 0, 0] = total
    return out


def prediction_gradient(
    g: torch.Tensor,
    y: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    params: LossParams,
    across_batch: bool = False,
) -> torch.Tensor:
    """``d <g, loss image> / dy`` in ``y``'s dtype; ``g`` has the loss image's shape."""
    acc = acc_dtype(y.dtype)
    if not across_batch or int(params.reduction) == NONE:
        _, grad = loss_forward_backward(y, labels, weights, params)
        return (g.to(acc) * grad.to(acc)).to(y.dtype)
    _, grad = loss_forward_backward(y, labels, weights, _unreduced(params))
    d = _divisor(params, y, _weights(weights, y.shape[1], acc), True)
    return (g[0:1].to(acc) * (grad.to(acc) / d)).to(y.dtype)


def label_gradient(
    g: torch.Tensor,
    y: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    params: LossParams,
    across_batch: bool = False,
) -> torch.Tensor:
    """``d <g, loss image> / d labels`` in the labels' shape and dtype (module docstring);
    ``params.kind`` must be in `LABEL_GRADIENT_TYPES`."""
    kind, reduction = int(params.kind), int(params.reduction)
    if kind not in LABEL_GRADIENT_TYPES:
        raise ValueError(f"[loss] label gradients need a loss type other than 9, got {kind}")
    c = y.shape[1]
    acc = acc_dtype(y.dtype)
    yw, t = y.to(acc), labels[:, :c].to(acc)
    wt = _weights(weights, c, acc)
    d = _elementwise_label_gradient(kind, yw, t, wt, params)
    if reduction != NONE:
        div = _divisor(params, y, wt, across_batch)
        d = d / div
        gg = g[0:1] if across_batch else g
    else:
        gg = g
    d = gg.to(acc) * d
    out = torch.zeros(labels.shape, dtype=labels.dtype, device=labels.device)
    out[:, :c] = d.to(labels.dtype)
    return out


def _elementwise_label_gradient(
    kind: int, y: torch.Tensor, t: torch.Tensor, wt: torch.Tensor | None, p: LossParams
) -> torch.Tensor:
    """``d l_w / dt`` per element (weights included, no reduction): module docstring."""
    ls = p.label_smoothing
    if kind == COSINE_DISTANCE:
        scale = p.weight if wt is None else wt.mean(1, keepdim=True) * p.weight
        return -y * scale
    if kind == SOFTMAX_CROSS_ENTROPY:
        d = -torch.log_softmax(y, dim=1) * (1 - ls)
    elif kind == CATEGORICAL_CROSS_ENTROPY:
        d = -torch.log(y.clamp(min=p.epsilon)) * (1 - ls)
    elif kind == MEAN_ABSOLUTE_ERROR:
        r = y - t
        d = torch.where(torch.isnan(r), r, -torch.sign(r))
    elif kind == MEAN_SQUARED_ERROR:
        d = (t - y) * 2
    elif kind == HUBER:
        r = y - t
        d = torch.where(r.abs() <= p.delta, -r, -torch.sign(r) * p.delta)
        d = torch.where(torch.isnan(r), r, d)
    elif kind == SIGMOID_CROSS_ENTROPY:
        d = -y * (1 - ls)
    elif kind == HINGE:
        m = 1 - (t * 2 - 1) * y
        d = torch.where(m > 0, -2 * y, torch.where(torch.isnan(m), m, 0.0))
    elif kind == LOG:
        d = torch.log(1 - y + p.epsilon) - torch.log(y + p.epsilon)
    else:  # pragma: no cover  (KULLBACK_LEIBLER_DIVERGENCE is refused by the caller)
        raise ValueError(f"[loss] label gradients need a loss type other than 9, got {kind}")
    scale = p.weight if wt is None else wt * p.weight
    return d * scale
