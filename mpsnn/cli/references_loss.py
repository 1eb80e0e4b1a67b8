"""The PyTorch reference of the split loss families of ``mpsnn check`` (``forward-loss``,
``loss-gradient``): the loss image of `ForwardLoss`, restated in float64 from the documented
formulas (the `mpsnn.ops.loss` and `mpsnn.ops.loss_split` docstrings, docs/semantics.md "The
split loss"), not from the kernels' code, with PyTorch's own functions where PyTorch has the
loss (``F.log_softmax``, ``F.binary_cross_entropy_with_logits``, ``F.huber_loss``,
``torch.xlogy``). It is differentiable in the predictions and the labels, so autograd of it is
the reference of `LossGradient` (``d <g, loss image> / d predictions`` and ``/ d labels``).

The restatement, for predictions ``y`` (N, C, H, W), labels ``t`` and weights ``w`` (their
first C channels; no weights: ones), descriptor weight ``s``:

* per element (MAE, MSE, sigmoid cross entropy, hinge, Huber, log, Kullback-Leibler):
  ``s w l(y, t)`` with ``l`` = ``|y - t|``, ``(y - t)^2``, the logistic loss of ``y`` against the
  smoothed ``(1 - ls) t + ls / 2``, ``max(0, 1 - (2 t - 1) y)``, Huber with ``delta``,
  ``-t log(y + eps) - (1 - t) log(1 - y + eps)``, ``t log t - t y``; a unit is an element;
* per pixel (softmax and categorical cross entropy, cosine distance): ``-s sum_c w_c t'_c
  log p_c`` with ``t' = (1 - ls) t + ls / K`` and ``log p`` = ``log_softmax(y)`` or
  ``log(max(y, eps))``; cosine: ``s mean_c(w) (1 - sum_c y_c t_c)``; a unit is a pixel;
* reductions per image: NONE keeps the image, SUM adds, MEAN divides by the units,
  SUM_BY_NON_ZERO_WEIGHTS by the units with a non-zero weight (at least 1); with
  ``reduce_across_batch`` the batch's value (the sum, over N times the units or the batch's
  non-zero weights) is image 0 and the other images hold 0.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from mpsnn.cnn.loss import LossType, ReductionType

__all__ = ["forward_loss", "loss_image"]

_PER_PIXEL = (LossType.SOFTMAX_CROSS_ENTROPY, LossType.CATEGORICAL_CROSS_ENTROPY,
              LossType.COSINE_DISTANCE)  # fmt: skip


def _elements(kind: LossType, y: torch.Tensor, t: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """The per-element loss ``l(y, t)`` (before the weights)."""
    ls, eps, delta = p["label_smoothing"], p["epsilon"], p["delta"]
    if kind == LossType.MEAN_ABSOLUTE_ERROR:
        return (y - t).abs()
    if kind == LossType.MEAN_SQUARED_ERROR:
        return (y - t) ** 2
    if kind == LossType.SIGMOID_CROSS_ENTROPY:
        return F.binary_cross_entropy_with_logits(y, (1 - ls) * t + ls / 2, reduction="none")
    if kind == LossType.HINGE:
        return F.relu(1 - (2 * t - 1) * y)
    if kind == LossType.HUBER:
        return F.huber_loss(y, t, reduction="none", delta=delta)
    if kind == LossType.LOG:
        return -t * torch.log(y + eps) - (1 - t) * torch.log(1 - y + eps)
    return torch.xlogy(t, t) - t * y  # KULLBACK_LEIBLER_DIVERGENCE (y: log probabilities)


def loss_image(
    y: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None, p: dict[str, Any]
) -> torch.Tensor:
    """The loss image of predictions ``y``; ``p``: ``loss_type`` and ``reduction`` (names),
    ``weight``, ``label_smoothing``, ``epsilon``, ``delta``, ``number_of_classes`` (None: C),
    ``reduce_across_batch``."""
    kind, red = LossType[p["loss_type"]], ReductionType[p["reduction"]]
    n, c, h, w = y.shape
    t = labels[:, :c]
    wt = None if weights is None else weights[:, :c]
    s = p["weight"]
    if kind in _PER_PIXEL:
        if kind == LossType.COSINE_DISTANCE:
            wbar = torch.ones(n, 1, h, w, dtype=y.dtype) if wt is None else wt.mean(1, True)
            per = s * wbar * (1 - (y * t).sum(1, keepdim=True))
            nonzero = wbar != 0
        else:
            k = c if p["number_of_classes"] is None else p["number_of_classes"]
            ls = p["label_smoothing"]
            a = s * ((1 - ls) * t + ls / k) * (1 if wt is None else wt)
            if kind == LossType.SOFTMAX_CROSS_ENTROPY:
                logp = F.log_softmax(y, 1)
            else:
                logp = torch.log(y.clamp(min=p["epsilon"]))
            per = -(a * logp).sum(1, keepdim=True)
            nonzero = (
                torch.ones(n, 1, h, w, dtype=torch.bool) if wt is None else (wt != 0).any(1, True)
            )
    else:
        per = s * _elements(kind, y, t, p) * (1 if wt is None else wt)
        nonzero = torch.ones_like(y, dtype=torch.bool) if wt is None else wt != 0
    if red == ReductionType.NONE:
        return per
    units = float(per[0].numel())
    sums = per.sum((1, 2, 3))
    if red == ReductionType.SUM:
        div = torch.ones(n, dtype=y.dtype)
    elif red == ReductionType.MEAN:
        div = torch.full((n,), units, dtype=y.dtype)
    else:
        div = nonzero.sum((1, 2, 3)).to(y.dtype)
    if p["reduce_across_batch"]:
        total = sums.sum() if red == ReductionType.SUM else sums.sum() / div.sum().clamp(min=1)
        return torch.cat([total.view(1, 1, 1, 1), torch.zeros(n - 1, 1, 1, 1, dtype=y.dtype)])
    return (sums / div.clamp(min=1)).view(n, 1, 1, 1)


_FORMS = {
    "MEAN_ABSOLUTE_ERROR": "w * (x - t).abs()",
    "MEAN_SQUARED_ERROR": "w * (x - t) ** 2",
    "SIGMOID_CROSS_ENTROPY": "w * F.binary_cross_entropy_with_logits(x, (1 - ls) * t + ls / 2)",
    "HINGE": "w * F.relu(1 - (2 * t - 1) * x)",
    "HUBER": "w * F.huber_loss(x, t, delta={delta})",
    "LOG": "w * (-t * torch.log(x + eps) - (1 - t) * torch.log(1 - x + eps))",
    "KULLBACK_LEIBLER_DIVERGENCE": "w * (torch.xlogy(t, t) - t * x)",
    "SOFTMAX_CROSS_ENTROPY": "-(w * ((1 - ls) * t + ls / K) * F.log_softmax(x, 1)).sum(1)",
    "CATEGORICAL_CROSS_ENTROPY": "-(w * ((1 - ls) * t + ls / K) * x.clamp(min=eps).log()).sum(1)",
    "COSINE_DISTANCE": "w.mean(1) * (1 - (x * t).sum(1))",
}


def forward_loss(g: Any, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, str]:
    """The loss image of ``t["x"]``, ``t["labels"]`` and ``t["weights"]`` (when given) with the
    parameters of ``g``, the run's `mpsnn.cli.references_geometry.Geometry`; autograd of it gives
    the gradients."""
    p = g.params
    out = loss_image(t["x"], t["labels"], t.get("weights"), p)
    form = _FORMS[p["loss_type"]].format(delta=p["delta"])
    across = ", the batch's value in image 0" if p["reduce_across_batch"] else ""
    weights = "weights" if "weights" in t else "1"
    return out, (
        f"{p['weight']} * {form}, {p['reduction']} per image{across} (t: labels, w: {weights}, "
        f"ls: {p['label_smoothing']}, eps: {p['epsilon']})"
    )
