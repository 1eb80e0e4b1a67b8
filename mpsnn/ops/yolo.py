"""YOLO loss math (MPS ``MPSCNNYOLOLoss``): the loss image and the gradient of its sum, in one
call, plus the two conversions a client needs (boxes to labels, predictions to boxes).

MPS fixes the channel layout and the four sub-losses and leaves the rest to YOLO9000
(arXiv:1612.08242); the decisions below follow YOLOv2's region loss as Apple's own Turi Create
states it for the same network. ``docs/yolo.md`` has the same text with a worked example.

**Layout.** Predictions ``y`` are (N, A·(5+K), H, W): ``A`` anchor boxes, ``K >= 1`` classes,
an ``H x W`` grid. Anchor ``a`` owns channels ``(5+K)·a + k``, ``k = 0..4+K``, in the order
``tx, ty, tw, th, tc, z_1..z_K``. Labels have the same layout (they may have more channels;
the extra ones take no part); per cell and anchor ``a`` they hold

* ``gx, gy``: the box centre inside its cell, in cell units (``cx·W - column``, in [0, 1));
* ``gw, gh``: the box size in grid cells (``width·W``, ``height·H``);
* ``go``: the objectness: 1 where the slot holds a box (0 elsewhere);
* ``g_1..g_K``: the class, one-hot (read only where the slot holds a box).

A slot **holds a box** when ``go > 0``, ``gw > 0`` and ``gh > 0``. The usual labelling
(`boxes_to_labels`, Turi Create's) writes a box into every anchor slot of the cell containing
its centre and lets the loss choose the responsible anchor; a client may also write a box into
the slots it chooses (e.g. one box per anchor, several boxes per cell). Anchor boxes
``(aw, ah)`` are in **grid cells**, like ``gw, gh``.

**Which anchors learn what** (``M`` masks, held constant: they are not differentiated):

* shape IoU ``s(a, b) = min(aw_b, gw_a) min(ah_b, gh_a) / (aw_b ah_b + gw_a gh_a - inter)``:
  the IoU of anchor ``b``'s box and the box in slot ``a``, centred on each other;
* slot ``a`` is **responsible** when it holds a box and its own anchor matches that box best
  among all A anchors: ``s(a, a) = max_b s(a, b)`` (ties: every tied slot is responsible);
* **object** slots ``O``: responsible, or holding a box with ``s(a, a) >
  min_iou_for_object_presence``;
* **no-object** slots ``Z``: not ``O`` and ``s(a, a) < max_iou_for_object_absence``, where
  ``s(a, a) = 0`` for a slot without a box (so, with a positive threshold, every empty slot);
  the other slots (a box nearby in shape but not responsible) are ignored by the confidence
  loss.

**Terms** (``L_*`` the sub-losses of `mpsnn.ops.loss`, each with its own descriptor weight,
label smoothing, epsilon and delta; ``w`` the optional per-element weights, channel by
channel; ``σ`` the logistic sigmoid):

* XY: ``scale_xy · O · w · L_xy(σ(tx), gx)``, and the same for y;
* WH: ``scale_wh · O · w · L_wh(tw, log(gw / aw))``, and the same for h: the raw ``tw`` is
  compared with the raw target of YOLOv2's parametrization ``predicted w = aw · exp(tw)``;
* confidence: ``λ · w · L_c(tc, τ)`` with ``λ = scale_object`` on ``O``, ``scale_no_object``
  on ``Z``, 0 elsewhere, and the target ``τ = go · IoU`` (``rescore``) or ``go`` on ``O``, 0 on
  ``Z``. ``IoU`` is that of the predicted box (centre ``(σ(tx), σ(ty))`` in the cell, size
  ``(aw e^tw, ah e^th)``, exponents clamped to ±50) and the labelled box; like the masks it is
  a constant of the target (not differentiated), as in YOLOv2;
* classes: ``scale_class · O · L_cls(z, g)``: one value per slot for the per-pixel losses
  (softmax and categorical cross entropy, cosine distance: the K class channels are its
  classes, with ``w`` as per-class weights), one per class channel for the per-element ones.

**Gradients** (per element, masks and ``τ`` fixed; ``L'`` the sub-loss's derivative with
respect to its prediction, as derived in `mpsnn.ops.loss`):

* ``d/dtx = scale_xy · O · w · L_xy'(σ(tx), gx) · σ(tx) (1 - σ(tx))`` (chain rule through the
  sigmoid, ``σ' = σ (1 - σ)``); for MSE, ``2 (σ - gx) σ (1 - σ)``;
* ``d/dtw = scale_wh · O · w · L_wh'(tw, log(gw/aw))``; for Huber ``r = tw - log(gw/aw)``
  inside ``delta``, ``delta · sign(r)`` outside;
* ``d/dtc = λ · w · L_c'(tc, τ)``; for sigmoid cross entropy ``σ(tc) - τ'`` (``τ'`` the
  smoothed target);
* ``d/dz_j = scale_class · O · dL_cls/dz_j``; for softmax cross entropy with one-hot labels
  ``softmax(z)_j - g_j`` (with weights ``softmax(z)_j Σ_c a_c - a_j``).

Every other element (a slot outside ``O`` and ``Z``, or outside ``O`` for XY, WH and classes)
gets 0.

**Reductions** act per image on the loss image, as `mpsnn.ops.loss`'s per-element ones:

* NONE: the loss image has the predictions' shape: each channel holds its term (a per-pixel
  class loss sits in the anchor's first class channel, its other class channels are 0);
* SUM: (N, 1, 1, 1), the image's sum;
* MEAN: the sum divided by ``A·(5+K)·H·W``;
* SUM_BY_NON_ZERO_WEIGHTS: the sum divided by the number of non-zero per-element weights in
  the image's A·(5+K)·H·W channels (without weights, as MEAN; none non-zero: loss and
  gradient 0).

The sub-descriptors' own reduction types are not used (MPS: one reduction for all four). The
gradient returned is the derivative of the sum of the loss image over the batch, divisors
included. Nothing is divided by the number of objects: scale the terms (e.g. ``1/B``) for that.

Computation is in the accumulation dtype (float32 for float16/bfloat16/float32, float64 for
float64); the loss image comes back in that dtype, the gradient in ``y``'s dtype. Finite inputs
give finite results (a box size must be positive to count, so the WH target is finite).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from mpsnn.ops._dtypes import acc_dtype, device_constant
from mpsnn.ops.loss import (
    _PER_PIXEL,
    MEAN,
    NONE,
    SUM_BY_NON_ZERO_WEIGHTS,
    LossParams,
    loss_forward_backward,
)

__all__ = [
    "PER_PIXEL_TYPES",
    "YOLOParams",
    "boxes_to_labels",
    "predicted_boxes",
    "shape_iou",
    "yolo_loss_forward_backward",
]

# Loss types whose value is one per pixel over the channels (classes): allowed for the class
# loss only.
PER_PIXEL_TYPES = _PER_PIXEL
_EXP_LIMIT = 50.0  # |tw|, |th| for the rescore IoU: e^100 overflows float32 to inf, not NaN


class YOLOParams(NamedTuple):
    """The descriptor's values: anchors ``((w, h), ...)`` in grid cells, the four sub-losses
    (their reductions are not used), the reduction code, ``rescore``, the five scales and the
    two IoU thresholds."""

    anchors: tuple[tuple[float, float], ...]
    xy: LossParams
    wh: LossParams
    confidence: LossParams
    classes: LossParams
    reduction: int
    rescore: bool = True
    scale_xy: float = 10.0
    scale_wh: float = 10.0
    scale_no_object: float = 5.0
    scale_object: float = 100.0
    scale_class: float = 2.0
    min_iou: float = 0.7
    max_iou: float = 0.3


def shape_iou(anchors: torch.Tensor, gw: torch.Tensor, gh: torch.Tensor) -> torch.Tensor:
    """``s[..., b]``: the IoU of anchor ``b`` (``anchors`` (B, 2)) and the boxes ``(gw, gh)``,
    centred on each other (sizes taken as ``max(size, 0)``)."""
    gw, gh = gw.clamp(min=0).unsqueeze(-1), gh.clamp(min=0).unsqueeze(-1)
    aw, ah = anchors[:, 0], anchors[:, 1]
    inter = torch.minimum(aw, gw) * torch.minimum(ah, gh)
    return inter / (aw * ah + gw * gh - inter)


def _masks(
    t: torch.Tensor, anchors: torch.Tensor, p: YOLOParams
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(holds, object, no-object) masks (N, A, H, W) from labels (N, A, 5+K, H, W)."""
    gw, gh, go = t[:, :, 2], t[:, :, 3], t[:, :, 4]
    holds = (go > 0) & (gw > 0) & (gh > 0)
    s = shape_iou(anchors, gw.movedim(1, -1), gh.movedim(1, -1))  # (N, H, W, A slot, A anchor)
    own = torch.diagonal(s, dim1=-2, dim2=-1)  # s(a, a): (N, H, W, A)
    responsible = own == s.amax(-1)
    own, responsible = own.movedim(-1, 1), responsible.movedim(-1, 1)
    own = torch.where(holds, own, 0.0)
    obj = holds & (responsible | (own > p.min_iou))
    noobj = ~obj & (own < p.max_iou)
    return holds, obj, noobj


def _box_iou(
    sx: torch.Tensor,
    sy: torch.Tensor,
    tw: torch.Tensor,
    th: torch.Tensor,
    t: torch.Tensor,
    anchors: torch.Tensor,
    holds: torch.Tensor,
) -> torch.Tensor:
    """IoU of the predicted and the labelled box of every slot (0 where no box), no gradient."""
    aw, ah = anchors[:, 0].view(1, -1, 1, 1), anchors[:, 1].view(1, -1, 1, 1)
    pw = aw * torch.exp(tw.clamp(-_EXP_LIMIT, _EXP_LIMIT))
    ph = ah * torch.exp(th.clamp(-_EXP_LIMIT, _EXP_LIMIT))
    gx, gy, gw, gh = t[:, :, 0], t[:, :, 1], t[:, :, 2], t[:, :, 3]
    ix = torch.minimum(sx + pw / 2, gx + gw / 2) - torch.maximum(sx - pw / 2, gx - gw / 2)
    iy = torch.minimum(sy + ph / 2, gy + gh / 2) - torch.maximum(sy - ph / 2, gy - gh / 2)
    inter = ix.clamp(min=0) * iy.clamp(min=0)
    iou = inter / (pw * ph + gw * gh - inter)
    return torch.where(holds, iou, 0.0)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """(N, A, k, H, W) -> (N, A·k, H, W)."""
    n, a, k, h, w = x.shape
    return x.reshape(n, a * k, h, w)


def _none(p: LossParams) -> LossParams:
    return p._replace(reduction=NONE)


def _weighted(mask: torch.Tensor, scale: float, wt: torch.Tensor | None, k: int) -> torch.Tensor:
    """Per-element weights (N, A, k, H, W): ``mask · scale`` (mask (N, A, H, W)) times the
    user's weights ``wt`` (N, A, k, H, W) when given."""
    m = (mask * scale).unsqueeze(2)
    if wt is not None:
        return m * wt
    n, a, _, h, w = m.shape
    return m.expand(n, a, k, h, w)


def yolo_loss_forward_backward(
    y: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    p: YOLOParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss image, gradient) for predictions ``y`` (N, A·(5+K), H, W): see the module
    docstring. ``labels``: float (N, Cl >= C, H, W) in the same layout; ``weights``: None or
    float with the labels' shape."""
    n, c, h, w = y.shape
    a = len(p.anchors)
    if y.dim() != 4 or c % a or c // a < 6:
        raise ValueError(
            f"[yolo] predictions must have {a}·(5 + classes) channels with classes >= 1, "
            f"got shape {tuple(y.shape)}"
        )
    if not labels.is_floating_point() or labels.dim() != 4 or labels.shape[0] != n:
        raise ValueError(
            f"[yolo] labels must be a float (N, C, H, W) tensor, got {labels.dtype} "
            f"{tuple(labels.shape)}"
        )
    if labels.shape[1] < c or labels.shape[2:] != (h, w):
        raise ValueError(f"[yolo] labels must be ({n}, >={c}, {h}, {w}), got {tuple(labels.shape)}")
    if weights is not None and weights.shape != labels.shape:
        raise ValueError(
            f"[yolo] weights must have the labels' shape {tuple(labels.shape)}, "
            f"got {tuple(weights.shape)}"
        )
    per = c // a
    k = per - 5
    acc = acc_dtype(y.dtype)
    yv = y.to(acc).reshape(n, a, per, h, w)
    t = labels[:, :c].to(acc).reshape(n, a, per, h, w)
    wt = None if weights is None else weights[:, :c].to(acc).reshape(n, a, per, h, w)
    anchors = device_constant(
        ("yolo anchors", p.anchors), acc, y.device,
        lambda: torch.tensor(p.anchors, dtype=torch.float64),
    )  # fmt: skip
    holds, obj, noobj = _masks(t, anchors, p)
    objf = obj.to(acc)

    def part(lo: int, hi: int) -> torch.Tensor | None:
        return None if wt is None else wt[:, :, lo:hi]

    # XY: through the sigmoid
    sxy = torch.sigmoid(yv[:, :, 0:2])
    loss_xy, g = loss_forward_backward(
        _flat(sxy), _flat(t[:, :, 0:2]), _flat(_weighted(objf, p.scale_xy, part(0, 2), 2)),
        _none(p.xy),
    )  # fmt: skip
    grad_xy = g.view(n, a, 2, h, w) * sxy * (1 - sxy)

    # WH: raw, against log(g / anchor) (1 where no box: a finite target the mask zeroes)
    size = anchors.view(1, a, 2, 1, 1)
    gwh = t[:, :, 2:4]
    target_wh = torch.log(torch.where(holds.unsqueeze(2), gwh, size) / size)
    loss_wh, grad_wh = loss_forward_backward(
        _flat(yv[:, :, 2:4]), _flat(target_wh), _flat(_weighted(objf, p.scale_wh, part(2, 4), 2)),
        _none(p.wh),
    )  # fmt: skip

    # Confidence: target go · IoU (rescore) or go on object slots, 0 on no-object slots
    target_c = t[:, :, 4]
    if p.rescore:
        iou = _box_iou(sxy[:, :, 0], sxy[:, :, 1], yv[:, :, 2], yv[:, :, 3], t, anchors, holds)
        target_c = target_c * iou
    target_c = torch.where(obj, target_c, 0.0)
    lam = objf * p.scale_object + noobj.to(acc) * p.scale_no_object
    wc = lam if wt is None else lam * wt[:, :, 4]
    loss_c, grad_c = loss_forward_backward(yv[:, :, 4], target_c, wc, _none(p.confidence))

    # Classes: (N·A, K, H, W), the K channels are the classes
    ycls = yv[:, :, 5:].reshape(n * a, k, h, w)
    wcls = _weighted(objf, p.scale_class, part(5, per), k).reshape(n * a, k, h, w)
    loss_cls, grad_cls = loss_forward_backward(
        ycls, t[:, :, 5:].reshape(n * a, k, h, w), wcls, _none(p.classes)
    )
    if loss_cls.shape[1] != k:  # one value per slot: into the anchor's first class channel
        loss_cls = torch.cat([loss_cls, loss_cls.new_zeros(n * a, k - 1, h, w)], 1)

    grad = torch.cat(
        [grad_xy, grad_wh.view(n, a, 2, h, w), grad_c.unsqueeze(2), grad_cls.view(n, a, k, h, w)],
        2,
    ).reshape(n, c, h, w)
    loss = torch.cat(
        [loss_xy.view(n, a, 2, h, w), loss_wh.view(n, a, 2, h, w), loss_c.unsqueeze(2),
         loss_cls.view(n, a, k, h, w)],
        2,
    ).reshape(n, c, h, w)  # fmt: skip
    if p.reduction != NONE:
        loss = loss.sum((1, 2, 3), keepdim=True)
        divisor: int | torch.Tensor = 1
        if p.reduction == MEAN or (p.reduction == SUM_BY_NON_ZERO_WEIGHTS and wt is None):
            divisor = c * h * w
        elif p.reduction == SUM_BY_NON_ZERO_WEIGHTS and weights is not None:
            count = (weights[:, :c] != 0).sum((1, 2, 3))
            divisor = count.clamp(min=1).to(acc).view(-1, 1, 1, 1)
        if not (isinstance(divisor, int) and divisor == 1):
            loss, grad = loss / divisor, grad / divisor
    return loss, grad.to(y.dtype)


# -- client-side conversions ------------------------------------------------------------------


def boxes_to_labels(
    boxes: torch.Tensor | Sequence[Sequence[float]],
    classes: torch.Tensor | Sequence[int],
    grid_width: int,
    grid_height: int,
    number_of_anchor_boxes: int,
    number_of_classes: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The labels (A·(5+K), H, W) of one image from its boxes.

    ``boxes``: (B, 4) ``(x, y, width, height)`` of each box, as fractions of the image (``x, y``
    the top-left corner); ``classes``: (B,) class indices in ``[0, K)``. Each box is written
    into every anchor slot of the grid cell containing its centre (the loss picks the
    responsible anchor): ``gx, gy`` the centre inside the cell, ``gw, gh`` the size in grid
    cells, objectness 1, the class one-hot. Boxes whose centre lies outside the image or with
    an empty size are skipped; a later box in the same cell replaces an earlier one."""
    b = torch.as_tensor(boxes, dtype=torch.float64).reshape(-1, 4)
    cls = torch.as_tensor(classes, dtype=torch.int64).reshape(-1)
    if cls.numel() != b.shape[0]:
        raise ValueError(
            f"[boxes_to_labels] classes must give one class per box ({b.shape[0]}), "
            f"got {cls.numel()}"
        )
    if cls.numel() and (int(cls.min()) < 0 or int(cls.max()) >= number_of_classes):
        raise ValueError(
            f"[boxes_to_labels] classes must lie in [0, {number_of_classes}), "
            f"got {int(cls.min())}..{int(cls.max())}"
        )
    per = 5 + number_of_classes
    out = torch.zeros(number_of_anchor_boxes, per, grid_height, grid_width, dtype=torch.float64)
    for (x, y, bw, bh), c in zip(b.tolist(), cls.tolist(), strict=True):
        cx, cy = (x + bw / 2) * grid_width, (y + bh / 2) * grid_height
        col, row = int(cx // 1), int(cy // 1)
        if bw <= 0 or bh <= 0 or not (0 <= col < grid_width and 0 <= row < grid_height):
            continue
        slot = out[:, :, row, col]
        slot.zero_()
        slot[:, 0], slot[:, 1] = cx - col, cy - row
        slot[:, 2], slot[:, 3] = bw * grid_width, bh * grid_height
        slot[:, 4] = 1.0
        slot[:, 5 + c] = 1.0
    return out.reshape(number_of_anchor_boxes * per, grid_height, grid_width).to(dtype)


def predicted_boxes(
    y: torch.Tensor, anchors: torch.Tensor | Sequence[Sequence[float]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode predictions (N, A·(5+K), H, W): ``(boxes, confidence, class probabilities)``,
    boxes (N, A, H, W, 4) ``(cx, cy, w, h)`` in grid cells (``cx = column + σ(tx)``,
    ``w = aw · e^tw``), confidence ``σ(tc)`` (N, A, H, W), probabilities ``softmax(z)``
    (N, A, K, H, W)."""
    an = torch.as_tensor(anchors, dtype=y.dtype, device=y.device).reshape(-1, 2)
    n, c, h, w = y.shape
    a = an.shape[0]
    v = y.reshape(n, a, c // a, h, w)
    col = torch.arange(w, dtype=y.dtype, device=y.device).view(1, 1, 1, w)
    row = torch.arange(h, dtype=y.dtype, device=y.device).view(1, 1, h, 1)
    cx = col + torch.sigmoid(v[:, :, 0])
    cy = row + torch.sigmoid(v[:, :, 1])
    bw = an[:, 0].view(1, a, 1, 1) * torch.exp(v[:, :, 2])
    bh = an[:, 1].view(1, a, 1, 1) * torch.exp(v[:, :, 3])
    boxes = torch.stack([cx, cy, bw, bh], -1)
    return boxes, torch.sigmoid(v[:, :, 4]), torch.softmax(v[:, :, 5:], 2)
