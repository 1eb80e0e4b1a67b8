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

import math
from collections.abc import Sequence
from typing import Any

import torch

from mpsnn.cnn.loss import Loss, LossDescriptor, LossType, ReductionType
from mpsnn.cnn.loss_labels import LossLabels
from mpsnn.core._checks import check_enum, check_int, check_type
from mpsnn.core.cnn_kernel import CNNKernel
from mpsnn.core.descriptor import FeatureChannelFormat, ImageDescriptor, _result_format
from mpsnn.core.device import CommandBuffer, Device
from mpsnn.core.encode import Encoding
from mpsnn.core.geometry import Size
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.kernel import image_sequences, resolve_images
from mpsnn.errors import UnsupportedError
from mpsnn.ops.yolo import PER_PIXEL_TYPES, YOLOParams, yolo_loss_forward_backward

__all__ = ["YOLOLoss", "YOLOLossDescriptor"]

_SUB_LOSSES = (
    ("xy_loss_descriptor", "_xy"),
    ("wh_loss_descriptor", "_wh"),
    ("confidence_loss_descriptor", "_confidence"),
    ("classes_loss_descriptor", "_classes"),
)


def _number(who: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"[{who}] {name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"[{who}] {name} must be finite, got {value}")
    return float(value)


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

    def _set_sub(self, name: str, slot: str, value: Any) -> None:
        check_type("YOLOLossDescriptor", name, value, LossDescriptor)
        object.__setattr__(self, slot, value)

    xy_loss_descriptor = property(
        lambda self: self._xy,
        lambda self, v: self._set_sub("xy_loss_descriptor", "_xy", v),
        doc="The XY loss (on the sigmoid of X and Y), a `LossDescriptor`.",
    )
    wh_loss_descriptor = property(
        lambda self: self._wh,
        lambda self, v: self._set_sub("wh_loss_descriptor", "_wh", v),
        doc="The WH loss (on raw W and H), a `LossDescriptor`.",
    )
    confidence_loss_descriptor = property(
        lambda self: self._confidence,
        lambda self, v: self._set_sub("confidence_loss_descriptor", "_confidence", v),
        doc="The confidence loss (on raw C), a `LossDescriptor`.",
    )
    classes_loss_descriptor = property(
        lambda self: self._classes,
        lambda self, v: self._set_sub("classes_loss_descriptor", "_classes", v),
        doc="The class loss (on the raw class channels), a `LossDescriptor`.",
    )

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
            self._scales[index] = _number("YOLOLossDescriptor", name, value)

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
        self._min_iou = _number("YOLOLossDescriptor", "min_iou_for_object_presence", value)

    @property
    def max_iou_for_object_absence(self) -> float:
        return self._max_iou

    @max_iou_for_object_absence.setter
    def max_iou_for_object_absence(self, value: float) -> None:
        self._max_iou = _number("YOLOLossDescriptor", "max_iou_for_object_absence", value)

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


class YOLOLoss(CNNKernel):
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

    # -- encode ---------------------------------------------------------------------------

    def encode(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_image: Image,
        labels: LossLabels,
        destination_image: Image | None = None,
    ) -> Image:
        """The gradient image; the loss goes into ``labels`` (see the class)."""
        self._check_command_buffer(command_buffer)
        self._check_image(command_buffer, source_image, "source_image")
        lab = [self._check_state(command_buffer, labels, "labels", LossLabels)]
        return self._encode_loss(command_buffer, source_image, lab, destination_image, False)

    @image_sequences("source_images", destinations=("destination_images",))
    def encode_batch(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_images: ImageBatch,
        labels_batch: LossLabels | Sequence[LossLabels],
        destination_images: ImageBatch | None = None,
    ) -> ImageBatch:
        """Batch form: ``labels_batch`` is one `LossLabels` per image (a StateBatch), or one
        `LossLabels` holding the whole batch."""
        cb = command_buffer
        self._check_command_buffer(cb)
        src = self._check_batch(cb, source_images, "source_images")
        if isinstance(labels_batch, LossLabels):
            lab = [self._check_state(cb, labels_batch, "labels_batch", LossLabels)]
        else:
            if not isinstance(labels_batch, Sequence) or isinstance(labels_batch, str | bytes):
                raise TypeError(
                    "[YOLOLoss] labels_batch must be a LossLabels or a sequence of them, "
                    f"got {type(labels_batch).__name__}"
                )
            lab = [self._check_state(cb, s, "labels_batch", LossLabels) for s in labels_batch]
        dst = None
        if destination_images is not None:
            dst = self._check_batch(cb, destination_images, "destination_images")
        out = self._encode_loss(cb, src, lab, dst, True)
        return destination_images if destination_images is not None else ImageBatch(out)

    def _check_layout(self, c: int, h: int, w: int, labels: list[LossLabels]) -> None:
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
        none = self._desc.reduction_type is ReductionType.NONE
        lshape = (c, h, w) if none else (1, 1, 1)
        for lab in labels:
            size = lab._loss_size
            if size is not None and (size.depth, size.height, size.width) != lshape:
                raise ValueError(
                    f"[{who}] loss_image_size must be {Size(lshape[2], lshape[1], lshape[0])} "
                    f"for {self._desc.reduction_type.name}, got {size}"
                )

    def _encode_loss(
        self,
        cb: CommandBuffer,
        src: Image,
        labels: list[LossLabels],
        dst: Image | None,
        batch: bool,
    ) -> Image:
        who = "YOLOLoss"
        n, c, h, w = src._shape
        clip = self._clip
        if (
            self._offset[:2] != (0, 0)
            or clip.origin[:2] != (0, 0)
            or clip.size.width < w
            or clip.size.height < h
            or self._sco != 0
            or self._dco != 0
        ):
            raise UnsupportedError(
                f"[{who}] a loss reads whole images: offset.x/y, the clip rect's x and y range "
                "and the channel offsets must keep their defaults, got "
                f"offset={self._offset} clip_rect={clip} "
                f"channel offsets {self._sco}/{self._dco}"
            )
        if batch:
            first, dz, count = 0, 0, n
        else:  # the images the clip rect covers, as every kernel (`resolve_images`)
            dst_n = dst._shape[0] if dst is not None else max(1, n - self._offset.z)
            first, dz, count = resolve_images(who, n, dst_n, self._offset.z, clip, False)
        total = sum(lab.number_of_images for lab in labels)
        if total != count:
            covers = (
                ""
                if batch
                else f" the encode covers ({count}: images {first}..{first + count - 1} of the "
                f"{n}-image source)"
            )
            raise ValueError(
                f"[{who}] the labels must hold one image per source image"
                f"{covers or f' ({count})'}, got {total}"
            )
        self._check_layout(c, h, w, labels)
        weighted = {lab._weights is None for lab in labels}
        if len(weighted) != 1:
            raise ValueError(f"[{who}] labels must all have weights or all none, got a mix")
        if dst is not None:
            self._check_destination(cb, dst, "destination_image", src)
            if dst._shape[1:] != (c, h, w) or dst._shape[0] < dz + count:
                raise ValueError(
                    f"[{who}] the destination must be {w}x{h}x{c} like the source, got "
                    f"{dst.width}x{dst.height}x{dst.feature_channels}"
                )
        none = self._desc.reduction_type is ReductionType.NONE
        lshape = (c, h, w) if none else (1, 1, 1)
        gfmt = _result_format(src._fmt)
        images = count if batch else max(1, n - first)  # a returned destination: every kernel's
        grad_out = dst if dst is not None else ImageDescriptor._make(gfmt, w, h, c, images)
        fmt = src._fmt if src._fmt is FeatureChannelFormat.FLOAT64 else FeatureChannelFormat.FLOAT32
        loss_desc = ImageDescriptor._make(fmt, lshape[2], lshape[1], lshape[0], count)
        params = self._params
        several = len(labels) > 1
        has_weights = not weighted.pop()
        whole = first == 0 and count == n

        def run(grad: Image, loss: Image) -> None:
            y = src._read()
            if not whole:
                y = y[first : first + count]
            if several:
                t = torch.cat([lab._labels for lab in labels])
                wt = torch.cat([lab._weights for lab in labels]) if has_weights else None
            else:
                t, wt = labels[0]._labels, labels[0]._weights
            value, g = yolo_loss_forward_backward(y, t, wt, params)
            grad._write_block(g, dz, 0, 0, 0, y)
            loss._write_block(value, 0, 0, 0, 0)

        loss_image = Image._make(self._device, loss_desc)
        views = _split(loss_image, [lab.number_of_images for lab in labels])
        outs = self._apply(
            cb, Encoding(run, (grad_out, loss_image), (src, *labels), (), None, batch)
        )
        for lab, view in zip(labels, views, strict=True):
            lab._loss = view
        return outs[0]  # type: ignore[return-value]


def _split(image: Image, counts: list[int]) -> list[Image]:
    """Views of consecutive images of ``image``, ``counts[i]`` images each (one loss image per
    `LossLabels`)."""
    if len(counts) == 1:
        return [image]
    batch = ImageBatch(image)
    out, start = [], 0
    for k in counts:
        if k == 1:
            out.append(batch[start])
        else:
            view = Image.__new__(Image)
            _, c, h, w = image.shape
            Image.__init__(view, image.device, ImageDescriptor._make(image._fmt, w, h, c, k))
            view._base, view._index = image, start
            out.append(view)
        start += k
    return out
