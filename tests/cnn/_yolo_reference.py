"""An independent float64 restatement of the YOLO loss (docs/yolo.md), written slot by slot for
the masks and with ``torch.nn.functional`` for the terms, so that ``torch.autograd`` gives the
reference gradient. It shares no code with mpsnn."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import mpsnn as m

LT, RT = m.LossType, m.ReductionType


@dataclass
class Config:
    """What a `YOLOLossDescriptor` holds, as plain values."""

    anchors: list[tuple[float, float]]
    xy: LT = LT.MEAN_SQUARED_ERROR
    wh: LT = LT.HUBER
    conf: LT = LT.SIGMOID_CROSS_ENTROPY
    cls: LT = LT.SOFTMAX_CROSS_ENTROPY
    reduction: RT = RT.SUM
    rescore: bool = True
    scales: tuple[float, float, float, float, float] = (10.0, 10.0, 5.0, 100.0, 2.0)
    min_iou: float = 0.7
    max_iou: float = 0.3
    weights: dict[str, float] = field(default_factory=dict)  # sub-descriptor weights
    delta: float = 1.0  # WH Huber delta
    conf_smoothing: float = 0.0
    cls_smoothing: float = 0.0

    def descriptor(self) -> m.YOLOLossDescriptor:
        d = m.YOLOLossDescriptor(
            self.xy, self.wh, self.conf, self.cls, self.reduction, self.anchors,
            len(self.anchors), rescore=self.rescore, scale_xy=self.scales[0],
            scale_wh=self.scales[1], scale_no_object=self.scales[2],
            scale_object=self.scales[3], scale_class=self.scales[4],
            min_iou_for_object_presence=self.min_iou, max_iou_for_object_absence=self.max_iou,
        )  # fmt: skip
        for name, value in self.weights.items():
            getattr(d, f"{name}_loss_descriptor").weight = value
        d.wh_loss_descriptor.delta = self.delta
        d.confidence_loss_descriptor.label_smoothing = self.conf_smoothing
        d.classes_loss_descriptor.label_smoothing = self.cls_smoothing
        return d


def centred_iou(a: tuple[float, float], b: tuple[float, float]) -> float:
    inter = min(a[0], b[0]) * min(a[1], b[1])
    return inter / (a[0] * a[1] + b[0] * b[1] - inter)


def box_iou(p: tuple[float, ...], g: tuple[float, ...]) -> float:
    """IoU of two (cx, cy, w, h) boxes."""
    ix = min(p[0] + p[2] / 2, g[0] + g[2] / 2) - max(p[0] - p[2] / 2, g[0] - g[2] / 2)
    iy = min(p[1] + p[3] / 2, g[1] + g[3] / 2) - max(p[1] - p[3] / 2, g[1] - g[3] / 2)
    inter = max(ix, 0.0) * max(iy, 0.0)
    return inter / (p[2] * p[3] + g[2] * g[3] - inter)


def masks(labels: torch.Tensor, cfg: Config) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(object, no-object) masks (N, A, H, W) and how many slots fell in each category."""
    n, _, h, w = labels.shape
    a = len(cfg.anchors)
    per = labels.shape[1] // a
    obj = torch.zeros(n, a, h, w, dtype=torch.bool)
    noobj = torch.zeros(n, a, h, w, dtype=torch.bool)
    counts = {"best": 0, "above": 0, "noobj_in_box_cell": 0, "ignored": 0, "empty": 0}
    for b in range(n):
        for i in range(h):
            for j in range(w):
                for s in range(a):
                    gw, gh, go = labels[b, s * per + 2 : s * per + 5, i, j].tolist()
                    holds = go > 0 and gw > 0 and gh > 0
                    ious = [centred_iou(anc, (gw, gh)) for anc in cfg.anchors] if holds else []
                    own = ious[s] if holds else 0.0
                    best = holds and own >= max(ious) - 1e-12
                    above = holds and own > cfg.min_iou
                    obj[b, s, i, j] = best or above
                    noobj[b, s, i, j] = not (best or above) and own < cfg.max_iou
                    if best:
                        counts["best"] += 1
                    elif above:
                        counts["above"] += 1
                    elif holds and own < cfg.max_iou:
                        counts["noobj_in_box_cell"] += 1
                    elif holds:
                        counts["ignored"] += 1
                    else:
                        counts["empty"] += 1
    return obj, noobj, counts


def _elementwise(kind: LT, pred: torch.Tensor, target: torch.Tensor, cfg: Config, ls: float):
    if kind == LT.MEAN_SQUARED_ERROR:
        return (pred - target) ** 2
    if kind == LT.MEAN_ABSOLUTE_ERROR:
        return (pred - target).abs()
    if kind == LT.HUBER:
        return F.huber_loss(pred, target, reduction="none", delta=cfg.delta)
    if kind == LT.SIGMOID_CROSS_ENTROPY:
        return F.binary_cross_entropy_with_logits(
            pred, (1 - ls) * target + ls / 2, reduction="none"
        )
    if kind == LT.LOG:
        eps = 1e-7
        return -target * torch.log(pred + eps) - (1 - target) * torch.log(1 - pred + eps)
    raise NotImplementedError(kind)


def loss_image(
    y: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None, cfg: Config
) -> torch.Tensor:
    """The reduced loss image (autograd flows to ``y``)."""
    n, c, h, w = y.shape
    a = len(cfg.anchors)
    per = c // a
    k = per - 5
    obj, noobj, _ = masks(labels, cfg)
    objf = obj.double()
    sxy, swh, snoobj, sobj, scls = cfg.scales
    wt = torch.ones_like(y) if weights is None else weights[:, :c]
    sub = {name: cfg.weights.get(name, 1.0) for name in ("xy", "wh", "confidence", "classes")}
    parts = []
    for s in range(a):
        base = s * per
        t = labels[:, base : base + per]
        ws = wt[:, base : base + per]
        aw, ah = cfg.anchors[s]
        o = objf[:, s : s + 1]
        # XY through the sigmoid
        lxy = _elementwise(cfg.xy, torch.sigmoid(y[:, base : base + 2]), t[:, 0:2], cfg, 0.0)
        lxy = lxy * sxy * sub["xy"] * o * ws[:, 0:2]
        # WH: raw against log(g / anchor); 0 target where the slot has no box (masked anyway)
        holds = (t[:, 4:5] > 0) & (t[:, 2:3] > 0) & (t[:, 3:4] > 0)
        anchor = torch.tensor([aw, ah], dtype=torch.float64).view(1, 2, 1, 1)
        tw = torch.where(holds, torch.log(t[:, 2:4].clamp(min=1e-300) / anchor), 0.0)
        lwh = _elementwise(cfg.wh, y[:, base + 2 : base + 4], tw, cfg, 0.0)
        lwh = lwh * swh * sub["wh"] * o * ws[:, 2:4]
        # confidence
        target = torch.zeros(n, 1, h, w, dtype=torch.float64)
        for b in range(n):
            for i in range(h):
                for j in range(w):
                    if not obj[b, s, i, j]:
                        continue
                    go = t[b, 4, i, j].item()
                    if cfg.rescore:
                        tx, ty, tww, thh = y[b, base : base + 4, i, j].tolist()
                        pred = (
                            1 / (1 + math.exp(-tx)), 1 / (1 + math.exp(-ty)),
                            aw * math.exp(tww), ah * math.exp(thh),
                        )  # fmt: skip
                        go *= box_iou(pred, tuple(t[b, 0:4, i, j].tolist()))
                    target[b, 0, i, j] = go
        lam = o * sobj + noobj[:, s : s + 1].double() * snoobj
        lc = _elementwise(cfg.conf, y[:, base + 4 : base + 5], target, cfg, cfg.conf_smoothing)
        lc = lc * lam * sub["confidence"] * ws[:, 4:5]
        # classes
        z, g, wc = y[:, base + 5 : base + per], t[:, 5:per], ws[:, 5:per]
        if cfg.cls == LT.SOFTMAX_CROSS_ENTROPY:
            gs = (1 - cfg.cls_smoothing) * g + cfg.cls_smoothing / k
            lcls = -(wc * gs * torch.log_softmax(z, 1)).sum(1, keepdim=True)
            lcls = torch.cat([lcls, torch.zeros(n, k - 1, h, w, dtype=torch.float64)], 1)
        else:
            lcls = _elementwise(cfg.cls, z, g, cfg, cfg.cls_smoothing) * wc
        lcls = lcls * scls * sub["classes"] * o
        parts.append(torch.cat([lxy, lwh, lc, lcls], 1))
    image = torch.cat(parts, 1)
    if cfg.reduction == RT.NONE:
        return image
    total = image.sum((1, 2, 3), keepdim=True)
    if cfg.reduction == RT.SUM:
        return total
    if cfg.reduction == RT.MEAN or weights is None:
        return total / (c * h * w)
    nonzero = (weights[:, :c] != 0).sum((1, 2, 3)).double().clamp(min=1).view(-1, 1, 1, 1)
    return total / nonzero


def random_labels(
    n: int,
    anchors: list[tuple[float, float]],
    classes: int,
    h: int,
    w: int,
    seed: int,
    *,
    every_anchor: bool = True,
    fill: float = 0.6,
) -> torch.Tensor:
    """Random labels: a box in about ``fill`` of the cells (centre in the cell, size 0.3..3.5
    cells), written into every anchor slot of its cell, or (``every_anchor=False``) into one
    random slot, with a second box in another slot of some cells. Empty slots hold zeros, and
    their class channels 1/K (as Turi Create writes them)."""
    g = torch.Generator().manual_seed(seed)
    a = len(anchors)
    per = 5 + classes
    out = torch.zeros(n, a, per, h, w, dtype=torch.float64)
    out[:, :, 5:] = 1.0 / classes

    def box() -> torch.Tensor:
        v = torch.zeros(per, dtype=torch.float64)
        v[0:2] = torch.rand(2, generator=g, dtype=torch.float64)
        v[2:4] = 0.3 + 3.2 * torch.rand(2, generator=g, dtype=torch.float64)
        v[4] = 1.0
        v[5 + int(torch.randint(classes, (1,), generator=g))] = 1.0
        return v

    for b in range(n):
        for i in range(h):
            for j in range(w):
                if torch.rand(1, generator=g).item() > fill:
                    continue
                if every_anchor:
                    out[b, :, :, i, j] = box()
                else:
                    slots = torch.randperm(a, generator=g).tolist()
                    out[b, slots[0], :, i, j] = box()
                    if a > 1 and torch.rand(1, generator=g).item() < 0.5:
                        out[b, slots[1], :, i, j] = box()
    return out.reshape(n, a * per, h, w)
