"""Codecs of the Gram matrix, comparison, reduction, local correlation, resize, YOLO loss and
split loss kernels (`mpsnn.io.kernels` has the other kernels and what every `CNNKernel` saves).

A `BinaryKernel` saves what it is configured with: each source's offset, edge mode, strides and
channel range, the shared clip rect, destination channel offset and padding, label and options.
The gradient kernels saved here (the Gram matrix's, the spatial mean's and the resizes') keep
their arguments and the geometry properties set on them by hand: what they report from their
last forward is not theirs (a loaded kernel reports again after its next encode).
"""

from __future__ import annotations

from typing import Any

import mpsnn.cnn.reduce as red
from mpsnn.cnn.compare import Compare, ComparisonType
from mpsnn.cnn.correlation import LocalCorrelation
from mpsnn.cnn.gram import GramMatrixCalculation, GramMatrixCalculationGradient
from mpsnn.cnn.loss import LossDescriptor, LossType, ReductionType
from mpsnn.cnn.loss_split import ForwardLoss, InitialGradient, LossGradient
from mpsnn.cnn.reduce_spatial import ReduceSpatialMean, ReduceSpatialMeanGradient
from mpsnn.cnn.resize import (
    CropAndResizeBilinear,
    CropAndResizeBilinearGradient,
    ResizeBilinear,
    ResizeBilinearGradient,
)
from mpsnn.cnn.yolo import YOLOLoss, YOLOLossDescriptor
from mpsnn.core.binary import BinaryKernel, GradientKernel
from mpsnn.core.geometry import EdgeMode, Offset
from mpsnn.core.kernel import KernelOptions
from mpsnn.io.codec import Encoder, Fields, fail, per_class, register_codec, show
from mpsnn.io.kernels import (
    dec_kernel_properties,
    decode_crop_regions,
    decode_padding,
    decode_region,
    enc_kernel_properties,
    encode_padding,
    encode_region,
)

__all__: list[str] = []  # the codecs are registered at import

# ---------------------------------------------------------------------------------------------
# two-source kernels: the comparison, the binary reductions, the local correlation

_OFFSETS = ("primary_offset", "secondary_offset")
_EDGES = ("primary_edge_mode", "secondary_edge_mode")
_BINARY_INTS = (
    "primary_stride_in_pixels_x", "primary_stride_in_pixels_y",
    "secondary_stride_in_pixels_x", "secondary_stride_in_pixels_y",
    "primary_source_feature_channel_offset", "secondary_source_feature_channel_offset",
    "primary_source_feature_channel_max_count", "secondary_source_feature_channel_max_count",
)  # fmt: skip
_GRADIENT_INTS = ("kernel_offset_x", "kernel_offset_y")


def _enc_geometry_value(name: str, value: Any) -> Any:
    if name in _OFFSETS:
        return list(value)
    if name in _EDGES:
        return EdgeMode(value).name
    return value


def _set_geometry(f: Fields, k: BinaryKernel, name: str, raw: Any, where: str) -> None:
    """Set geometry property ``name`` from its JSON (``where`` names it in errors)."""
    if name in _OFFSETS:
        ok = type(raw) is list and len(raw) == 3 and all(type(v) is int for v in raw)
        value: Any = Offset(*raw) if ok else None
        want = "a list of 3 ints"
    elif name in _EDGES:
        ok = type(raw) is str and raw in EdgeMode.__members__
        value = EdgeMode[raw] if ok else None
        want = f"one of the EdgeMode names ({', '.join(EdgeMode.__members__)})"
    else:
        ok, value, want = type(raw) is int, raw, "an int"
    if not ok:
        raise fail(f"{f.who} field {where} must be {want}, got {show(raw)}")
    setattr(k, name, value)


def _enc_shared(k: Any) -> dict[str, Any]:
    """What a `BinaryKernel` shares between its sources (and the kernel's label, options)."""
    return {
        "label": k.label,
        "options": int(k.options),
        "clip_rect": encode_region(k.clip_rect),
        "destination_feature_channel_offset": k.destination_feature_channel_offset,
        "padding": encode_padding(k.padding, f"{type(k).__name__}.padding"),
    }


def _dec_shared(f: Fields, k: Any) -> None:
    k.label = f.get_str("label", optional=True)
    k.options = KernelOptions(f.get_int("options", 0))
    k.clip_rect = decode_region(f, "clip_rect")
    k.destination_feature_channel_offset = f.get_int("destination_feature_channel_offset", 0)
    k.padding = decode_padding(f, "padding")


def _enc_binary_properties(k: BinaryKernel) -> dict[str, Any]:
    """What every forward `BinaryKernel` can be configured with (not the allocator)."""
    out = _enc_shared(k)
    for name in (*_OFFSETS, *_EDGES, *_BINARY_INTS):
        out[name] = _enc_geometry_value(name, getattr(k, name))
    return out


def _dec_binary_properties(f: Fields, k: BinaryKernel) -> None:
    _dec_shared(f, k)
    for name in (*_OFFSETS, *_EDGES, *_BINARY_INTS):
        _set_geometry(f, k, name, f.raw(name), repr(name))


def _enc_compare(k: Compare, enc: Encoder) -> dict[str, Any]:
    if k._neuron is not None:  # a graph's fused ReLU, never a user's setting
        raise TypeError(
            f"[save] Compare must have no fused neuron to be saved (a graph's own kernel), got "
            f"one at {enc.path()}"
        )
    return {
        **_enc_binary_properties(k),
        "primary_scale": k.primary_scale,
        "secondary_scale": k.secondary_scale,
        "bias": k.bias,
        "minimum_value": k.minimum_value,
        "maximum_value": k.maximum_value,
        "primary_stride_in_feature_channels": k.primary_stride_in_feature_channels,
        "secondary_stride_in_feature_channels": k.secondary_stride_in_feature_channels,
        "comparison_type": k.comparison_type.name,
        "threshold": k.threshold,
    }


def _dec_compare(f: Fields) -> Compare:
    k = Compare(f.device)
    _dec_binary_properties(f, k)
    for name in ("primary_scale", "secondary_scale", "bias", "minimum_value", "maximum_value"):
        setattr(k, name, f.get_float(name))
    for name in ("primary_stride_in_feature_channels", "secondary_stride_in_feature_channels"):
        setattr(k, name, f.get_int(name, 0))
    k.comparison_type = f.get_enum("comparison_type", ComparisonType)
    k.threshold = f.get_float("threshold")
    return k


_CORRELATION = ("window_in_x", "window_in_y", "stride_in_x", "stride_in_y")


def _enc_reduce_binary(k: Any, enc: Encoder) -> dict[str, Any]:
    out: dict[str, Any] = {
        **_enc_binary_properties(k),
        "primary_source_clip_rect": encode_region(k.primary_source_clip_rect),
        "secondary_source_clip_rect": encode_region(k.secondary_source_clip_rect),
    }
    if isinstance(k, red.ReduceFeatureChannelsAndWeightsSum):
        out["do_weighted_sum_by_non_zero_weights"] = k.do_weighted_sum_by_non_zero_weights
    if isinstance(k, LocalCorrelation):
        out.update({name: getattr(k, name) for name in _CORRELATION})
    return out


def _dec_reduce_binary(f: Fields, kind: type) -> Any:
    if kind is red.ReduceFeatureChannelsAndWeightsSum:
        k = kind(f.device, f.get_bool("do_weighted_sum_by_non_zero_weights"))
    elif kind is LocalCorrelation:
        k = kind(f.device, *(f.get_int(name) for name in _CORRELATION))
    else:
        k = kind(f.device)
    _dec_binary_properties(f, k)
    k.primary_source_clip_rect = decode_region(f, "primary_source_clip_rect")
    k.secondary_source_clip_rect = decode_region(f, "secondary_source_clip_rect")
    return k


# ---------------------------------------------------------------------------------------------
# one-source kernels: the Gram matrix, the unary reductions, the resizes


def _enc_gram(k: GramMatrixCalculation, enc: Encoder) -> dict[str, Any]:
    return {**enc_kernel_properties(k), "alpha": k.alpha}


def _dec_gram(f: Fields) -> GramMatrixCalculation:
    k = GramMatrixCalculation(f.device, f.get_float("alpha"))
    dec_kernel_properties(f, k)
    return k


def _enc_reduce_unary(k: Any, enc: Encoder) -> dict[str, Any]:
    out = {**enc_kernel_properties(k), "clip_rect_source": encode_region(k.clip_rect_source)}
    if isinstance(k, red.ReduceFeatureChannelsSum):
        out["weight"] = k.weight
    return out


def _dec_reduce_unary(f: Fields, kind: type) -> Any:
    k = kind(f.device)
    dec_kernel_properties(f, k)
    k.clip_rect_source = decode_region(f, "clip_rect_source")
    if kind is red.ReduceFeatureChannelsSum:
        k.weight = f.get_float("weight")
    return k


def _enc_resize_args(k: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"resize_width": k.resize_width, "resize_height": k.resize_height}
    if isinstance(k, ResizeBilinear | ResizeBilinearGradient):
        out["align_corners"] = k.align_corners
    else:
        out["regions"] = [list(r) for r in k.regions]
    return out


def _dec_resize_args(f: Fields, kind: type) -> Any:
    w, h = f.get_int("resize_width", 1), f.get_int("resize_height", 1)
    if kind in (ResizeBilinear, ResizeBilinearGradient):
        return kind(f.device, w, h, f.get_bool("align_corners"))
    regions = decode_crop_regions(f)
    return kind(f.device, w, h, len(regions), regions)


def _enc_resize(k: Any, enc: Encoder) -> dict[str, Any]:
    return {**_enc_resize_args(k), **enc_kernel_properties(k)}


def _dec_resize(f: Fields, kind: type) -> Any:
    k = _dec_resize_args(f, kind)
    dec_kernel_properties(f, k)
    return k


# ---------------------------------------------------------------------------------------------
# gradient kernels: their arguments, the shared properties, the geometry set by hand


def _enc_gradient_kernel(k: GradientKernel, enc: Encoder) -> dict[str, Any]:
    out = _enc_shared(k)
    if isinstance(k, GramMatrixCalculationGradient):
        out["alpha"] = k.alpha
    elif not isinstance(k, ReduceSpatialMeanGradient):  # the spatial mean's takes no argument
        out.update(_enc_resize_args(k))
    # the properties set by hand (the others report the last forward: not the kernel's own)
    out["geometry"] = {n: _enc_geometry_value(n, getattr(k, "_" + n)) for n in sorted(k._explicit)}
    return out


_GEOMETRY_NAMES = {*_OFFSETS, *_EDGES, *_BINARY_INTS, *_GRADIENT_INTS}


def _dec_gradient_kernel(f: Fields, kind: type) -> Any:
    if kind is GramMatrixCalculationGradient:
        k = kind(f.device, f.get_float("alpha"))
    elif kind is ReduceSpatialMeanGradient:
        k = kind(f.device)
    else:
        k = _dec_resize_args(f, kind)
    _dec_shared(f, k)
    raw = f.raw("geometry")
    if type(raw) is not dict or not set(raw) <= _GEOMETRY_NAMES:
        raise fail(
            f"{f.who} field 'geometry' must map some of {sorted(_GEOMETRY_NAMES)} to values, "
            f"got {show(raw)}"
        )
    for name, value in raw.items():
        _set_geometry(f, k, name, value, f"'geometry.{name}'")
    return k


_REDUCE_UNARY = (
    red.ReduceRowMin, red.ReduceRowMax, red.ReduceRowMean, red.ReduceRowSum,
    red.ReduceColumnMin, red.ReduceColumnMax, red.ReduceColumnMean, red.ReduceColumnSum,
    red.ReduceFeatureChannelsMin, red.ReduceFeatureChannelsMax, red.ReduceFeatureChannelsMean,
    red.ReduceFeatureChannelsSum, red.ReduceFeatureChannelsArgumentMin,
    red.ReduceFeatureChannelsArgumentMax, ReduceSpatialMean,
)  # fmt: skip
_REDUCE_BINARY = (
    red.ReduceFeatureChannelsAndWeightsMean, red.ReduceFeatureChannelsAndWeightsSum,
    LocalCorrelation,
)  # fmt: skip
_GRADIENT_KERNELS = (
    GramMatrixCalculationGradient, ReduceSpatialMeanGradient, ResizeBilinearGradient,
    CropAndResizeBilinearGradient,
)  # fmt: skip
_FAMILIES: tuple[tuple[tuple[type, ...], Any, Any], ...] = (
    (_REDUCE_UNARY, _enc_reduce_unary, _dec_reduce_unary),
    (_REDUCE_BINARY, _enc_reduce_binary, _dec_reduce_binary),
    ((ResizeBilinear, CropAndResizeBilinear), _enc_resize, _dec_resize),
    (
        _GRADIENT_KERNELS,
        _enc_gradient_kernel,
        _dec_gradient_kernel,
    ),
)


# ---------------------------------------------------------------------------------------------
# the YOLO loss: its descriptor (with its four sub-loss descriptors) and the kernel

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


def _enc_yolo(k: YOLOLoss, enc: Encoder) -> dict[str, Any]:
    return {"loss_descriptor": enc.object(k._desc), **enc_kernel_properties(k)}


def _dec_yolo(f: Fields) -> YOLOLoss:
    k = YOLOLoss(f.device, f.get_object("loss_descriptor", YOLOLossDescriptor))
    dec_kernel_properties(f, k)
    return k


# ---------------------------------------------------------------------------------------------
# the split loss: the descriptor holds the settable weight, label smoothing, epsilon and delta
# (the kernel's own copy); the geometry is every kernel's (the loss kernels refuse all but the
# defaults at encode, as a fresh kernel would)


def _enc_forward_loss(k: ForwardLoss, enc: Encoder) -> dict[str, Any]:
    return {
        "loss_descriptor": enc.object(k._desc),
        "reduce_across_batch": k.reduce_across_batch,
        **enc_kernel_properties(k),
    }


def _dec_forward_loss(f: Fields) -> ForwardLoss:
    desc = f.get_object("loss_descriptor", LossDescriptor)
    k = ForwardLoss(f.device, desc, reduce_across_batch=f.get_bool("reduce_across_batch"))
    dec_kernel_properties(f, k)
    return k


def _enc_loss_gradient(k: LossGradient, enc: Encoder) -> dict[str, Any]:
    return {
        "loss_descriptor": enc.object(k._desc),
        "reduce_across_batch": k.reduce_across_batch,
        "compute_label_gradients": k.compute_label_gradients,
        **_enc_binary_properties(k),
    }


def _dec_loss_gradient(f: Fields) -> LossGradient:
    desc = f.get_object("loss_descriptor", LossDescriptor)
    k = LossGradient(
        f.device,
        desc,
        reduce_across_batch=f.get_bool("reduce_across_batch"),
        compute_label_gradients=f.get_bool("compute_label_gradients"),
    )
    _dec_binary_properties(f, k)
    return k


def _enc_initial_gradient(k: InitialGradient, enc: Encoder) -> dict[str, Any]:
    return enc_kernel_properties(k)


def _dec_initial_gradient(f: Fields) -> InitialGradient:
    k = InitialGradient(f.device)
    dec_kernel_properties(f, k)
    return k


register_codec(Compare, _enc_compare, _dec_compare)
register_codec(ForwardLoss, _enc_forward_loss, _dec_forward_loss)
register_codec(LossGradient, _enc_loss_gradient, _dec_loss_gradient)
register_codec(InitialGradient, _enc_initial_gradient, _dec_initial_gradient)
register_codec(GramMatrixCalculation, _enc_gram, _dec_gram)
register_codec(YOLOLossDescriptor, _enc_yolo_descriptor, _dec_yolo_descriptor)
register_codec(YOLOLoss, _enc_yolo, _dec_yolo)
for _classes, _encode, _decode in _FAMILIES:
    for _cls in _classes:
        register_codec(_cls, _encode, per_class(_decode, _cls))
del _cls, _classes, _encode, _decode
