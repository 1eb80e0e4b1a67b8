"""Codecs that a list of declared fields cannot say (`mpsnn.io.declared` saves the kernels that
declare theirs): the comparison (it refuses a graph's fused neuron), the crop-and-resize kernel
and its gradient (their constructor takes the number of regions, which the file does not hold
apart from the regions), and the YOLO loss descriptor (its four sub-loss descriptors replace
those its constructor makes).
"""

from __future__ import annotations

from typing import Any

from mpsnn.cnn.compare import Compare
from mpsnn.cnn.loss import LossDescriptor, LossType, ReductionType
from mpsnn.cnn.resize import CropAndResizeBilinear, CropAndResizeBilinearGradient
from mpsnn.cnn.yolo import YOLOLossDescriptor
from mpsnn.io.codec import Encoder, Fields, per_class, register_codec
from mpsnn.io.declared import (
    dec_gradient_properties,
    decode_declared,
    enc_gradient_properties,
    encode_declared,
)
from mpsnn.io.kernels import (
    dec_kernel_properties,
    decode_crop_regions,
    enc_kernel_properties,
)

__all__: list[str] = []  # the codecs are registered at import


def _enc_compare(k: Compare, enc: Encoder) -> dict[str, Any]:
    if k._neuron is not None:  # a graph's fused ReLU, never a user's setting
        raise TypeError(
            f"[save] Compare must have no fused neuron to be saved (a graph's own kernel), got "
            f"one at {enc.path()}"
        )
    return encode_declared(k, enc)


# ---------------------------------------------------------------------------------------------
# the crop-and-resize kernel and its gradient


def _enc_crop(k: Any) -> dict[str, Any]:
    return {
        "resize_width": k.resize_width,
        "resize_height": k.resize_height,
        "regions": [list(r) for r in k.regions],
    }


def _dec_crop(f: Fields, kind: type) -> Any:
    w, h = f.get_int("resize_width", 1), f.get_int("resize_height", 1)
    regions = decode_crop_regions(f)
    return kind(f.device, w, h, len(regions), regions)


def _enc_crop_and_resize(k: CropAndResizeBilinear, enc: Encoder) -> dict[str, Any]:
    return {**_enc_crop(k), **enc_kernel_properties(k)}


def _dec_crop_and_resize(f: Fields) -> CropAndResizeBilinear:
    k = _dec_crop(f, CropAndResizeBilinear)
    dec_kernel_properties(f, k)
    return k


def _enc_crop_gradient(k: CropAndResizeBilinearGradient, enc: Encoder) -> dict[str, Any]:
    return {**_enc_crop(k), **enc_gradient_properties(k)}


def _dec_crop_gradient(f: Fields) -> CropAndResizeBilinearGradient:
    k = _dec_crop(f, CropAndResizeBilinearGradient)
    dec_gradient_properties(f, k)
    return k


# ---------------------------------------------------------------------------------------------
# the YOLO loss descriptor, with its four sub-loss descriptors

_SUBS = (
    "xy_loss_descriptor", "wh_loss_descriptor", "confidence_loss_descriptor",
    "classes_loss_descriptor",
)  # fmt: skip
_YOLO_NUMBERS = (
    "scale_xy", "scale_wh", "scale_no_object", "scale_object", "scale_class",
    "min_iou_for_object_presence", "max_iou_for_object_absence",
)  # fmt: skip


def _enc_yolo_descriptor(d: YOLOLossDescriptor, enc: Encoder) -> dict[str, Any]:
    out: dict[str, Any] = {name: enc.object(getattr(d, name)) for name in _SUBS}
    out["reduction_type"] = d.reduction_type.name
    out["anchor_boxes"] = [list(pair) for pair in d.anchor_boxes]
    out["rescore"] = d.rescore
    out.update({name: getattr(d, name) for name in _YOLO_NUMBERS})
    return out


def _dec_yolo_descriptor(f: Fields) -> YOLOLossDescriptor:
    subs = [f.get_object(name, LossDescriptor) for name in _SUBS]
    anchors = f.get_number_rows("anchor_boxes", ("width", "height"))
    mse = LossType.MEAN_SQUARED_ERROR  # replaced by the saved sub-descriptors below
    d = YOLOLossDescriptor(
        mse, mse, mse, mse, f.get_enum("reduction_type", ReductionType),
        anchors, rescore=f.get_bool("rescore"),
    )  # fmt: skip
    for name, sub in zip(_SUBS, subs, strict=True):
        setattr(d, name, sub)  # the saved objects: shared with whoever else saved them
    for name in _YOLO_NUMBERS:
        setattr(d, name, f.get_float(name))
    return d


register_codec(Compare, _enc_compare, per_class(decode_declared, Compare))
register_codec(CropAndResizeBilinear, _enc_crop_and_resize, _dec_crop_and_resize)
register_codec(CropAndResizeBilinearGradient, _enc_crop_gradient, _dec_crop_gradient)
register_codec(YOLOLossDescriptor, _enc_yolo_descriptor, _dec_yolo_descriptor)
