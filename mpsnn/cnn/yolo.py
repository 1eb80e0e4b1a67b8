"""The YOLO loss (MPS ``MPSCNNYOLOLoss``, ``MPSCNNYOLOLossDescriptor``).

As `mpsnn.cnn.loss.Loss`, one encode does the forward and the backward: the **destination is
the gradient** of the loss with respect to the predictions, and the loss goes into the labels
(a `LossLabels`, ``loss_image()``). The layout, the choice of the responsible anchors, the
four terms and the derivation of every gradient are in `mpsnn.ops.yolo` (and
``docs/yolo.md``). In short, per grid cell and anchor ``a`` (channels ``(5+K)·a ..``, in the
order X, Y, W, H, C, classes):

* XY goes through a sigmoid, then the XY loss against the box centre inside the cell;
* WH (raw) takes the WH loss against ``log(box size / anchor size)`` (YOLOv2's
  ``w = anchor_w · exp(tw)``), anchors and box sizes in grid cells;
* C takes the confidence loss: target 1 (``rescore``: the IoU of the predicted and labelled
  boxes) for the object anchors (the anchor whose shape matches the box best, and any whose
  shape IoU exceeds ``min_iou_for_object_presence``), 0 for the anchors whose shape IoU is
  below ``max_iou_for_object_absence`` (every anchor of a cell without a box), ignored between;
* the classes take the class loss on the object anchors.

The labels have the predictions' layout (per cell and anchor: ``x, y, w, h, objectness,
class one-hot``); `mpsnn.ops.yolo.boxes_to_labels` makes them from boxes.
"""

from __future__ import annotations

from typing import Any

import torch

from mpsnn.cnn.loss import (
    Loss,
    LossDescriptor,
    LossType,
    ReductionType,
    _check_loss_size,
    _Compute,
    _finite,
    _LabelsLoss,
)
from mpsnn.cnn.loss_labels import LossLabels
from mpsnn.core._checks import check_enum, check_int, check_type
from mpsnn.core.device import Device
from mpsnn.core.saved import Field
from mpsnn.ops.yolo import PER_PIXEL_TYPES, YOLOParams, yolo_loss_forward_backward

__all__ = [
    "YOLOLoss",
    "YOLOLossDescriptor",
]

_SUB_LOSSES = (
    ("xy_loss_descriptor", "_xy"),
    ("wh_loss_descriptor", "_wh"),
    ("confidence_loss_descriptor", "_confidence"),
    ("classes_loss_descriptor", "_classes"),
)


def _anchors(who: str, value: Any) -> tuple[tuple[float, float], ...]:
    """``(w, h)`` pairs from pairs, a flat sequence of 2n numbers, or an (n, 2) / (2n,) array."""
    try:
        t = torch.as_tensor(value, dtype=torch.float64).reshape(-1)
    except Exception as exc:  # ragged, strings, ...
        raise TypeError(
            f"[{who}] anchor_boxes must be (width, height) pairs of numbers, "
            f"got {type(value).__name__}"
        ) from exc
    if t.numel() == 0 or t.numel() % 2:
        raise ValueError(
            f"[{who}] anchor_boxes must hold one or more (width, height) pairs, "
            f"got {t.numel()} numbers"
        )
    if not bool(torch.isfinite(t).all()) or not bool((t > 0).all()):
        raise ValueError(
            f"[{who}] anchor box widths and heights must be finite and > 0, got {t.tolist()}"
        )
    pairs = t.view(-1, 2).tolist()
    return tuple((float(w), float(h)) for w, h in pairs)


class YOLOLossDescriptor:
    """What a `YOLOLoss` computes (MPS ``MPSCNNYOLOLossDescriptor``).

    The constructor is MPS's ``+cnnLossDescriptorWithXYLossType:WHLossType:
    confidenceLossType:classesLossType:reductionType:anchorBoxes:numberOfAnchorBoxes:`` (also
    `cnn_loss_descriptor`): each sub-loss gets ``LossDescriptor(type, reduction_type)``; set a
    sub-descriptor (or its fields: ``weight``, ``delta``, ``label_smoothing``, ...) to change it.

    Args:
        xy_loss_type, wh_loss_type, confidence_loss_type: per-element `LossType` s (not
            SOFTMAX_CROSS_ENTROPY, CATEGORICAL_CROSS_ENTROPY or COSINE_DISTANCE, which sum over
            channels); usually MEAN_SQUARED_ERROR, HUBER and SIGMOID_CROSS_ENTROPY.
        classes_loss_type: any `LossType`; usually SOFTMAX_CROSS_ENTROPY.
        reduction_type: the one reduction of all four terms (the sub-descriptors' own are not
            used).
        anchor_boxes: ``(width, height)`` of each anchor box **in grid cells**: pairs, or a
            flat sequence / array of 2n numbers (MPS: an NSData of float pairs); each > 0.
        number_of_anchor_boxes: None, or the number of pairs (checked).
        rescore: the confidence target of an object anchor is multiplied by the IoU of its
            predicted box and the labelled box.
        scale_xy, scale_wh, scale_no_object, scale_object, scale_class: the terms' scales
            (MPS defaults 10, 10, 5, 100, 2); any finite numbers.
        min_iou_for_object_presence: a slot holding a box whose anchor's shape IoU with the box
            exceeds this is an object anchor even if not the best (0.7; >= 1 turns it off).
        max_iou_for_object_absence: an anchor that is not an object anchor and whose shape IoU
            is below this gets the no-object confidence term (0.3; <= 0 turns it off).

    Attributes are read-write as in MPS and checked when set; ``number_of_anchor_boxes`` is
    read-only (the number of pairs in ``anchor_boxes``).
    """

    __slots__ = (
        "_anchors",
        "_classes",
        "_confidence",
        "_max_iou",
        "_min_iou",
        "_reduction",
        "_rescore",
        "_scales",
        "_wh",
        "_xy",
    )

    def __init__(
        self,
        xy_loss_type: LossType,
        wh_loss_type: LossType,
        confidence_loss_type: LossType,
        classes_loss_type: LossType,
        reduction_type: ReductionType,
        anchor_boxes: Any,
        number_of_anchor_boxes: int | None = None,
        *,
        rescore: bool = True,
        scale_xy: float = 10.0,
        scale_wh: float = 10.0,
        scale_no_object: float = 5.0,
        scale_object: float = 100.0,
        scale_class: float = 2.0,
        min_iou_for_object_presence: float = 0.7,
        max_iou_for_object_absence: float = 0.3,
    ) -> None:
        who = "YOLOLossDescriptor"
        self.reduction_type = reduction_type
        types = (xy_loss_type, wh_loss_type, confidence_loss_type, classes_loss_type)
        names = ("xy_loss_type", "wh_loss_type", "confidence_loss_type", "classes_loss_type")
        for (_, slot), kind, name in zip(_SUB_LOSSES, types, names, strict=True):
            check_enum(who, name, kind, LossType)
            if slot != "_classes" and kind in PER_PIXEL_TYPES:
                raise ValueError(
                    f"[{who}] {name} must be a per-element loss type (not "
                    f"SOFTMAX_CROSS_ENTROPY, CATEGORICAL_CROSS_ENTROPY or COSINE_DISTANCE), "
                    f"got {kind.name}"
                )
            object.__setattr__(self, slot, LossDescriptor(kind, self._reduction))
        self.anchor_boxes = anchor_boxes
        if number_of_anchor_boxes is not None:
            count = check_int(who, "number_of_anchor_boxes", number_of_anchor_boxes, 1)
            if count != len(self._anchors):
                raise ValueError(
                    f"[{who}] number_of_anchor_boxes must equal the number of (width, height) "
                    f"pairs in anchor_boxes ({len(self._anchors)}), got {count}"
                )
        self.rescore = rescore
        self._scales = [0.0] * 5
        self.scale_xy = scale_xy
        self.scale_wh = scale_wh
        self.scale_no_object = scale_no_object
        self.scale_object = scale_object
        self.scale_class = scale_class
        self.min_iou_for_object_presence = min_iou_for_object_presence
        self.max_iou_for_object_absence = max_iou_for_object_absence

    @classmethod
    def cnn_loss_descriptor(
        cls,
        xy_loss_type: LossType,
        wh_loss_type: LossType,
        confidence_loss_type: LossType,
        classes_loss_type: LossType,
        reduction_type: ReductionType,
        anchor_boxes: Any,
        number_of_anchor_boxes: int | None = None,
    ) -> YOLOLossDescriptor:
        """MPS ``+cnnLossDescriptorWithXYLossType:...``: the constructor, MPS defaults for the
        rest."""
        return cls(
            xy_loss_type, wh_loss_type, confidence_loss_type, classes_loss_type, reduction_type,
            anchor_boxes, number_of_anchor_boxes,
        )  # fmt: skip

    # -- sub-losses (retained, as MPS: changing their fields changes this descriptor) ------

    def _get_sub(self, slot: str) -> LossDescriptor:
        return getattr(self, slot)  # type: ignore[no-any-return]

    def _sub(name: str, slot: str, doc: str) -> property:  # type: ignore[misc]
        def put(self: YOLOLossDescriptor, value: LossDescriptor) -> None:
            check_type("YOLOLossDescriptor", name, value, LossDescriptor)
            object.__setattr__(self, slot, value)

        return property(lambda self: getattr(self, slot), put, doc=doc)

    xy_loss_descriptor = _sub(
        "xy_loss_descriptor", "_xy", "The XY loss (on the sigmoid of X and Y), a `LossDescriptor`."
    )
    wh_loss_descriptor = _sub(
        "wh_loss_descriptor", "_wh", "The WH loss (on raw W and H), a `LossDescriptor`."
    )
    confidence_loss_descriptor = _sub(
        "confidence_loss_descriptor", "_confidence",
        "The confidence loss (on raw C), a `LossDescriptor`.",
    )  # fmt: skip
    classes_loss_descriptor = _sub(
        "classes_loss_descriptor", "_classes",
        "The class loss (on the raw class channels), a `LossDescriptor`.",
    )  # fmt: skip
    del _sub

    # -- the other fields ----------------------------------------------------------------

    @property
    def reduction_type(self) -> ReductionType:
        return self._reduction

    @reduction_type.setter
    def reduction_type(self, value: ReductionType) -> None:
        self._reduction = check_enum("YOLOLossDescriptor", "reduction_type", value, ReductionType)

    @property
    def rescore(self) -> bool:
        return self._rescore

    @rescore.setter
    def rescore(self, value: bool) -> None:
        self._rescore = check_type("YOLOLossDescriptor", "rescore", value, bool)

    @property
    def anchor_boxes(self) -> tuple[tuple[float, float], ...]:
        """``((width, height), ...)`` in grid cells."""
        return self._anchors

    @anchor_boxes.setter
    def anchor_boxes(self, value: Any) -> None:
        self._anchors = _anchors("YOLOLossDescriptor", value)

    @property
    def number_of_anchor_boxes(self) -> int:
        return len(self._anchors)

    def _scale(index: int, name: str) -> property:  # type: ignore[misc]
        def get(self: YOLOLossDescriptor) -> float:
            return self._scales[index]

        def put(self: YOLOLossDescriptor, value: float) -> None:
            self._scales[index] = _finite("YOLOLossDescriptor", name, value)

        return property(get, put)

    scale_xy = _scale(0, "scale_xy")
    scale_wh = _scale(1, "scale_wh")
    scale_no_object = _scale(2, "scale_no_object")
    scale_object = _scale(3, "scale_object")
    scale_class = _scale(4, "scale_class")
    del _scale

    @property
    def min_iou_for_object_presence(self) -> float:
        return self._min_iou

    @min_iou_for_object_presence.setter
    def min_iou_for_object_presence(self, value: float) -> None:
        self._min_iou = _finite("YOLOLossDescriptor", "min_iou_for_object_presence", value)

    @property
    def max_iou_for_object_absence(self) -> float:
        return self._max_iou

    @max_iou_for_object_absence.setter
    def max_iou_for_object_absence(self, value: float) -> None:
        self._max_iou = _finite("YOLOLossDescriptor", "max_iou_for_object_absence", value)

    # -- copies and parameters -----------------------------------------------------------

    def copy(self) -> YOLOLossDescriptor:
        """A deep copy (the sub-descriptors copied, and checked: `LossDescriptor.copy`)."""
        out = YOLOLossDescriptor.__new__(YOLOLossDescriptor)
        for _, slot in _SUB_LOSSES:
            object.__setattr__(out, slot, self._get_sub(slot).copy())
        out._reduction, out._rescore, out._anchors = self._reduction, self._rescore, self._anchors
        out._scales = list(self._scales)
        out._min_iou, out._max_iou = self._min_iou, self._max_iou
        return out

    def _params(self, who: str) -> YOLOParams:
        """The kernel's parameters; checks the sub-losses' types (they may have been changed
        since they were set)."""
        for name, slot in _SUB_LOSSES[:3]:
            kind = self._get_sub(slot).loss_type
            if kind in PER_PIXEL_TYPES:
                raise ValueError(
                    f"[{who}] {name} must have a per-element loss type (not "
                    f"SOFTMAX_CROSS_ENTROPY, CATEGORICAL_CROSS_ENTROPY or COSINE_DISTANCE), "
                    f"got {LossType(kind).name}"
                )
        xy, wh, conf, cls = (self._get_sub(slot)._params() for _, slot in _SUB_LOSSES)
        s = self._scales
        return YOLOParams(
            self._anchors, xy, wh, conf, cls, int(self._reduction), self._rescore,
            s[0], s[1], s[2], s[3], s[4], self._min_iou, self._max_iou,
        )  # fmt: skip

    def __repr__(self) -> str:
        s = self._scales
        return (
            f"YOLOLossDescriptor(xy={self._xy.loss_type.name}, wh={self._wh.loss_type.name}, "
            f"confidence={self._confidence.loss_type.name}, "
            f"classes={self._classes.loss_type.name}, {self._reduction.name}, "
            f"anchor_boxes={list(self._anchors)}, rescore={self._rescore}, scale_xy={s[0]}, "
            f"scale_wh={s[1]}, scale_no_object={s[2]}, scale_object={s[3]}, "
            f"scale_class={s[4]}, min_iou_for_object_presence={self._min_iou}, "
            f"max_iou_for_object_absence={self._max_iou})"
        )


def _read_only(name: str) -> property:
    """The kernel's copy of a descriptor field, read-only (MPS)."""
    return property(lambda self: getattr(self._desc, name), doc=f"The descriptor's ``{name}``.")


class YOLOLoss(_LabelsLoss):
    """The YOLO loss and its gradient in one encode (MPS ``MPSCNNYOLOLoss``).

    Args:
        device: the kernel's device.
        loss_descriptor: a `YOLOLossDescriptor` (copied; its sub-losses' types are checked).

    ``encode(command_buffer, source_image, labels, destination_image=None)`` returns the
    gradient of the loss with respect to ``source_image`` (the raw predictions,
    ``number_of_anchor_boxes · (5 + classes)`` channels, ``classes >= 1``) and writes the loss
    into ``labels``: a `LossLabels` of float labels in the predictions' layout (at least their
    channels, the same width and height), optionally with per-element weights of the labels'
    shape. Its ``loss_image_size``, when given, must be ``Size(1, 1, 1)``, or the predictions'
    size for ReductionType.NONE. The loss reads whole images; images, batches and one
    `LossLabels` per image or per batch work as for `mpsnn.cnn.loss.Loss`.

    ``loss_xy``, ``loss_wh``, ``loss_confidence``, ``loss_classes`` are `Loss` kernels of the
    four sub-descriptors (MPS's ``lossXY``, ...); the descriptor's other fields are read-only
    properties.
    """

    _who = "YOLOLoss"
    saved_fields = (Field("loss_descriptor", YOLOLossDescriptor, attr="_desc"),)

    def __init__(self, device: Device, loss_descriptor: YOLOLossDescriptor) -> None:
        super().__init__(device)
        check_type("YOLOLoss", "loss_descriptor", loss_descriptor, YOLOLossDescriptor)
        self._desc = loss_descriptor.copy()
        self._params = self._desc._params("YOLOLoss")
        d = self._desc
        self._subs = tuple(Loss(device, d._get_sub(slot)) for _, slot in _SUB_LOSSES)

    # -- read-only copies of the descriptor (MPS) ------------------------------------------

    @property
    def loss_xy(self) -> Loss:
        return self._subs[0]

    @property
    def loss_wh(self) -> Loss:
        return self._subs[1]

    @property
    def loss_confidence(self) -> Loss:
        return self._subs[2]

    @property
    def loss_classes(self) -> Loss:
        return self._subs[3]

    reduction_type = _read_only("reduction_type")
    rescore = _read_only("rescore")
    scale_xy = _read_only("scale_xy")
    scale_wh = _read_only("scale_wh")
    scale_no_object = _read_only("scale_no_object")
    scale_object = _read_only("scale_object")
    scale_class = _read_only("scale_class")
    min_iou_for_object_presence = _read_only("min_iou_for_object_presence")
    max_iou_for_object_absence = _read_only("max_iou_for_object_absence")
    number_of_anchor_boxes = _read_only("number_of_anchor_boxes")
    anchor_boxes = _read_only("anchor_boxes")

    # -- encode (`_LabelsLoss`) ------------------------------------------------------------

    def _prepare(
        self, c: int, h: int, w: int, labels: list[LossLabels]
    ) -> tuple[tuple[int, int, int], _Compute, None]:
        who = "YOLOLoss"
        a = self._desc.number_of_anchor_boxes
        if c % a or c // a < 6:
            raise ValueError(
                f"[{who}] the predictions must have number_of_anchor_boxes · (5 + classes) = "
                f"{a} · (5 + classes) channels with classes >= 1, got {c}"
            )
        for lab in labels:
            t = lab._labels
            if lab._index:
                raise ValueError(
                    f"[{who}] labels must be float labels in the predictions' layout, got class "
                    "indices"
                )
            if t.shape[1] < c or t.shape[2:] != (h, w):
                raise ValueError(
                    f"[{who}] labels must be {w}x{h} with at least the predictions' {c} "
                    f"channels, got {t.shape[3]}x{t.shape[2]}x{t.shape[1]}"
                )
        reduction = self._desc.reduction_type
        lshape = (c, h, w) if reduction is ReductionType.NONE else (1, 1, 1)
        _check_loss_size(who, labels, lshape, reduction)
        if len({lab._weights is None for lab in labels}) != 1:
            raise ValueError(f"[{who}] labels must all have weights or all none, got a mix")
        params = self._params
        return lshape, lambda y, t, wt: yolo_loss_forward_backward(y, t, wt, params), None
