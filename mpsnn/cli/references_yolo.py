"""The PyTorch reference of the ``yolo-loss`` family of ``mpsnn check``: the loss image of
`YOLOLoss`, restated in float64 from the documented rules (docs/yolo.md, the `mpsnn.ops.yolo`
docstring), not from the kernel's code: the object and no-object slots are decided slot by slot
in plain Python, the terms are PyTorch's own functions (``F.mse_loss``-style squares,
``F.huber_loss``, ``F.binary_cross_entropy_with_logits``, ``torch.log_softmax``). It is
differentiable in the predictions, with the masks and the rescore target held constant (as
the kernel's gradient holds them), so autograd of it is the reference of the kernel's gradient.

For predictions ``y`` (N, A·(5+K), H, W), labels ``t`` in the same layout (per anchor slot:
``gx, gy, gw, gh, go, g_1..g_K``) and weights ``w`` (none: ones), per slot ``a`` of a cell:

* the slot holds a box when ``go > 0``, ``gw > 0``, ``gh > 0``; ``s(a, b)``, the IoU of anchor
  ``b`` and the box of slot ``a`` centred on each other; the slot is an object slot (``O``)
  when ``s(a, a)`` is the largest over the anchors or exceeds ``min_iou_for_object_presence``,
  a no-object slot (``Z``) when not ``O`` and ``s(a, a)`` (0 without a box) is below
  ``max_iou_for_object_absence``;
* XY: ``scale_xy · O · w · s_xy · (σ(tx) - gx)^2`` (and y); WH: ``scale_wh · O · w · s_wh ·
  huber(tw - log(gw / aw))`` (and h); confidence: ``λ · w · s_c · bce_logits(tc, τ)``, ``λ`` =
  ``scale_object`` on ``O``, ``scale_no_object`` on ``Z``, 0 elsewhere, ``τ = go`` (times the
  IoU of the predicted box ``(σ(tx), σ(ty), aw e^tw, ah e^th)`` and the labelled one with
  rescore) on ``O``, 0 elsewhere; classes: ``scale_class · O · s_cls · -sum_k w_k g_k
  log_softmax(z)_k`` in the slot's first class channel (``s_*`` the sub-descriptors' weights;
  label smoothing and delta as they set them);
* reductions per image: NONE keeps the image, SUM adds, MEAN divides by ``A·(5+K)·H·W``,
  SUM_BY_NON_ZERO_WEIGHTS by the number of non-zero weights (at least 1; no weights: as MEAN).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["yolo_loss", "yolo_loss_image"]


def _centred_iou(a: tuple[float, float], b: tuple[float, float]) -> float:
    inter = min(a[0], b[0]) * min(a[1], b[1])
    return inter / (a[0] * a[1] + b[0] * b[1] - inter)


def _box_iou(p: tuple[float, ...], g: tuple[float, ...]) -> float:
    """IoU of two (cx, cy, w, h) boxes."""
    ix = min(p[0] + p[2] / 2, g[0] + g[2] / 2) - max(p[0] - p[2] / 2, g[0] - g[2] / 2)
    iy = min(p[1] + p[3] / 2, g[1] + g[3] / 2) - max(p[1] - p[3] / 2, g[1] - g[3] / 2)
    inter = max(ix, 0.0) * max(iy, 0.0)
    return inter / (p[2] * p[3] + g[2] * g[3] - inter)


def _slots(labels: torch.Tensor, p: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The object and no-object masks (N, A, H, W), decided slot by slot."""
    anchors = [tuple(a) for a in p["anchors"]]
    n, _, h, w = labels.shape
    a = len(anchors)
    per = 5 + p["classes"]
    obj = torch.zeros(n, a, h, w, dtype=torch.bool)
    noobj = torch.zeros(n, a, h, w, dtype=torch.bool)
    for b in range(n):
        for i in range(h):
            for j in range(w):
                for s in range(a):
                    gw, gh, go = labels[b, s * per + 2 : s * per + 5, i, j].tolist()
                    holds = go > 0 and gw > 0 and gh > 0
                    ious = [_centred_iou(anc, (gw, gh)) for anc in anchors] if holds else [0.0]
                    own = ious[s] if holds else 0.0
                    is_obj = holds and (own >= max(ious) or own > p["min_iou"])
                    obj[b, s, i, j] = is_obj
                    noobj[b, s, i, j] = not is_obj and own < p["max_iou"]
    return obj, noobj


def _term(sub: dict[str, Any], pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A per-element sub-loss (before its weights and scale)."""
    kind, ls = sub["loss_type"], sub["label_smoothing"]
    if kind == "MEAN_SQUARED_ERROR":
        return (pred - target) ** 2
    if kind == "MEAN_ABSOLUTE_ERROR":
        return (pred - target).abs()
    if kind == "HUBER":
        return F.huber_loss(pred, target, reduction="none", delta=sub["delta"])
    if kind == "SIGMOID_CROSS_ENTROPY":
        smoothed = (1 - ls) * target + ls / 2
        return F.binary_cross_entropy_with_logits(pred, smoothed, reduction="none")
    raise ValueError(f"[yolo-loss] the reference restates MSE, MAE, Huber and sigmoid cross "
                     f"entropy sub-losses, got {kind}")  # fmt: skip


def _confidence_target(
    y: torch.Tensor, t: torch.Tensor, obj: torch.Tensor, anchor: tuple[float, float], rescore: bool
) -> torch.Tensor:
    """``τ`` of one anchor's slots (N, 1, H, W), a constant (computed from plain floats)."""
    n, _, h, w = t.shape
    target = torch.zeros(n, 1, h, w, dtype=torch.float64)
    for b in range(n):
        for i in range(h):
            for j in range(w):
                if not obj[b, i, j]:
                    continue
                go = t[b, 4, i, j].item()
                if rescore:
                    tx, ty, tw, th = y[b, 0:4, i, j].tolist()
                    pred = (
                        1 / (1 + math.exp(-tx)), 1 / (1 + math.exp(-ty)),
                        anchor[0] * math.exp(min(max(tw, -50.0), 50.0)),
                        anchor[1] * math.exp(min(max(th, -50.0), 50.0)),
                    )  # fmt: skip
                    go *= _box_iou(pred, tuple(t[b, 0:4, i, j].tolist()))
                target[b, 0, i, j] = go
    return target


def yolo_loss_image(
    y: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None, p: dict[str, Any]
) -> torch.Tensor:
    """The loss image of predictions ``y`` (see the module docstring); ``p``: ``anchors``,
    ``classes``, ``rescore``, ``reduction`` (a name), ``scales`` (xy, wh, no object, object,
    class), ``min_iou``, ``max_iou`` and ``xy``, ``wh``, ``confidence``, ``classes_loss`` (each
    ``loss_type`` by name, ``weight``, ``label_smoothing``, ``delta``)."""
    n, c, h, w = y.shape
    anchors = [tuple(a) for a in p["anchors"]]
    k = p["classes"]
    per = 5 + k
    obj, noobj = _slots(labels, p)
    sxy, swh, snoobj, sobj, scls = p["scales"]
    wt = torch.ones_like(y) if weights is None else weights[:, :c]
    cls = p["classes_loss"]
    parts = []
    for s, anchor in enumerate(anchors):
        base = s * per
        t, ws = labels[:, base : base + per], wt[:, base : base + per]
        o = obj[:, s : s + 1].double()
        lxy = _term(p["xy"], torch.sigmoid(y[:, base : base + 2]), t[:, 0:2])
        lxy = lxy * sxy * p["xy"]["weight"] * o * ws[:, 0:2]
        holds = (t[:, 4:5] > 0) & (t[:, 2:3] > 0) & (t[:, 3:4] > 0)
        size = torch.tensor(anchor, dtype=torch.float64).view(1, 2, 1, 1)
        twh = torch.where(holds, torch.log(t[:, 2:4].clamp(min=1e-300) / size), 0.0)
        lwh = _term(p["wh"], y[:, base + 2 : base + 4], twh)
        lwh = lwh * swh * p["wh"]["weight"] * o * ws[:, 2:4]
        target = _confidence_target(y[:, base : base + 4], t, obj[:, s], anchor, p["rescore"])
        lam = o * sobj + noobj[:, s : s + 1].double() * snoobj
        lc = _term(p["confidence"], y[:, base + 4 : base + 5], target)
        lc = lc * lam * p["confidence"]["weight"] * ws[:, 4:5]
        z, g, wc = y[:, base + 5 : base + per], t[:, 5:per], ws[:, 5:per]
        if cls["loss_type"] == "SOFTMAX_CROSS_ENTROPY":
            smoothed = (1 - cls["label_smoothing"]) * g + cls["label_smoothing"] / k
            lcls = -(wc * smoothed * torch.log_softmax(z, 1)).sum(1, keepdim=True)
            lcls = torch.cat([lcls, torch.zeros(n, k - 1, h, w, dtype=torch.float64)], 1)
        else:
            lcls = _term(cls, z, g) * wc
        parts.append(torch.cat([lxy, lwh, lc, lcls * scls * cls["weight"] * o], 1))
    image = torch.cat(parts, 1)
    if p["reduction"] == "NONE":
        return image
    total = image.sum((1, 2, 3), keepdim=True)
    if p["reduction"] == "SUM":
        return total
    if p["reduction"] == "MEAN" or weights is None:
        return total / (c * h * w)
    nonzero = (weights[:, :c] != 0).sum((1, 2, 3)).double().clamp(min=1).view(-1, 1, 1, 1)
    return total / nonzero


def yolo_loss(g: Any, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, str]:
    """The loss image of ``t["x"]`` with ``t["labels"]`` and ``t["weights"]`` (when given) and
    the parameters of ``g``, the run's `mpsnn.cli.references_geometry.Geometry`; autograd of it
    gives the gradient."""
    p = g.params
    out = yolo_loss_image(t["x"], t["labels"], t.get("weights"), p)
    sxy, swh, snoobj, sobj, scls = p["scales"]
    weights = "weights" if "weights" in t else "1"
    target = "go · IoU(predicted, labelled box)" if p["rescore"] else "go"
    return out, (
        f"per anchor slot, O/Z the object/no-object slots decided slot by slot: "
        f"{sxy}·O·w·(σ(tx) - gx)² + {swh}·O·w·F.huber_loss(tw, log(gw / aw)) (and y, h) + "
        f"({sobj}·O + {snoobj}·Z)·w·F.binary_cross_entropy_with_logits(tc, τ = {target} on O) "
        f"+ {scls}·O·-(w·g·torch.log_softmax(z)).sum(), {p['reduction']} per image "
        f"(anchors {[tuple(a) for a in p['anchors']]}, w: {weights})"
    )
