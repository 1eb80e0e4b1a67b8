"""Codecs of the forward kernels: every `CNNKernel`'s configuration (label, options, offset,
clip rect, edge mode, feature channel ranges, a `DefaultPadding`), and the kernels whose own
values a list of fields cannot say: a convolution's master weights (loaded into its masters
and checked against its data source's shapes) and the normalizations' gamma/beta/statistics
copies (loaded into their parameter objects). The kernels that declare their saved fields
(`mpsnn.core.saved`) are saved by `mpsnn.io.declared`; the comparison, crop-and-resize and
YOLO codecs are in `mpsnn.io.kernels_more`."""

from __future__ import annotations

from typing import Any

from mpsnn.cnn.convolution.data_source import ConvolutionDataSource
from mpsnn.cnn.convolution.descriptor import ConvolutionAccumulatorPrecisionOption
from mpsnn.cnn.convolution.kernels import Convolution, ConvolutionTranspose, FullyConnected
from mpsnn.cnn.normalization.batch_norm_forward import BatchNormalization
from mpsnn.cnn.normalization.data_sources import (
    BatchNormalizationDataSource,
    GroupNormalizationDataSource,
    InstanceNormalizationDataSource,
)
from mpsnn.cnn.normalization.group_norm import GroupNormalization, InstanceNormalization
from mpsnn.core.cnn_kernel import CNNKernel
from mpsnn.core.geometry import (
    DefaultPadding,
    EdgeMode,
    Offset,
    Origin,
    PaddingMethod,
    Region,
    Size,
)
from mpsnn.core.kernel import KernelOptions
from mpsnn.io.codec import Encoder, Fields, fail, per_class, register_codec, show

__all__ = [
    "dec_kernel_properties",
    "decode_crop_regions",
    "decode_padding",
    "decode_region",
    "enc_kernel_properties",
    "encode_padding",
    "encode_region",
]


def encode_padding(pad: Any, who: str) -> dict[str, Any]:
    """A `DefaultPadding` as JSON (method, label, whether it is TensorFlow's average-pooling
    policy); any other padding policy is code and is refused."""
    if type(pad) is not DefaultPadding:
        raise TypeError(
            f"[save] {who} must be a DefaultPadding to be saved (a custom policy is code), "
            f"got {type(pad).__name__}"
        )
    return {"method": int(pad.padding_method), "label": pad.label, "sets_clamp": pad._sets_clamp}


def decode_padding(f: Fields, name: str) -> DefaultPadding:
    """The `DefaultPadding` of field ``name`` (see `encode_padding`)."""
    pad = f.raw(name)
    if (
        type(pad) is not dict
        or set(pad) != {"method", "label", "sets_clamp"}
        or type(pad["method"]) is not int
        or not (pad["label"] is None or type(pad["label"]) is str)
        or type(pad["sets_clamp"]) is not bool
    ):
        raise fail(
            f"{f.who} field {name!r} must hold a method (int), a label (string or null) and "
            f"sets_clamp (boolean), got {show(pad)}"
        )
    padding = DefaultPadding(PaddingMethod(pad["method"]), label=pad["label"])
    padding._sets_clamp = pad["sets_clamp"]
    return padding


def encode_region(r: Region) -> list[int]:
    """A `Region` as JSON: ``[x, y, z, width, height, depth]``."""
    return [*r.origin, *r.size]


def decode_region(f: Fields, name: str) -> Region:
    """The `Region` of field ``name`` (see `encode_region`)."""
    v = f.get_ints(name, 6)
    return Region(Origin(*v[:3]), Size(*v[3:]))


def decode_crop_regions(f: Fields) -> list[tuple[float, ...]]:
    """The crop regions of field ``regions``: a non-empty list of ``[x, y, width, height]``
    numbers (a crop-and-resize kernel's or node's)."""
    return f.get_number_rows("regions", ("x", "y", "width", "height"))


def enc_kernel_properties(k: CNNKernel) -> dict[str, Any]:
    """What every `CNNKernel` can be configured with (not the destination allocator)."""
    padding = encode_padding(k.padding, f"{type(k).__name__}.padding")
    clip = k.clip_rect
    return {
        "label": k.label,
        "options": int(k.options),
        "offset": list(k.offset),
        "clip_rect": [*clip.origin, *clip.size],
        "edge_mode": k.edge_mode.name,
        "source_feature_channel_offset": k.source_feature_channel_offset,
        "source_feature_channel_max_count": k.source_feature_channel_max_count,
        "destination_feature_channel_offset": k.destination_feature_channel_offset,
        "padding": padding,
    }


def dec_kernel_properties(f: Fields, k: CNNKernel) -> None:
    k.label = f.get_str("label", optional=True)
    k.options = KernelOptions(f.get_int("options", 0))
    k.offset = Offset(*f.get_ints("offset", 3))
    clip = f.get_ints("clip_rect", 6)
    k.clip_rect = Region(Origin(*clip[:3]), Size(*clip[3:]))
    k.edge_mode = f.get_enum("edge_mode", EdgeMode)
    k.source_feature_channel_offset = f.get_int("source_feature_channel_offset", 0)
    k.source_feature_channel_max_count = f.get_int("source_feature_channel_max_count", 1)
    k.destination_feature_channel_offset = f.get_int("destination_feature_channel_offset", 0)
    k.padding = decode_padding(f, "padding")


def _enc_convolution(k: Any, enc: Encoder) -> dict[str, Any]:
    out: dict[str, Any] = {
        "data_source": enc.object(k.data_source),
        **enc_kernel_properties(k),
        "accumulator_precision_option": k.accumulator_precision_option.name,
        # the kernel's master weights: they differ from the data source's until a reload
        "weights": enc.tensor(k.weights, "weights"),
        "biases": enc.tensor(k.biases, "biases"),
    }
    if isinstance(k, ConvolutionTranspose):
        out["kernel_offset_x"] = k.kernel_offset_x
        out["kernel_offset_y"] = k.kernel_offset_y
    return out


def _dec_convolution(f: Fields, kind: type) -> Any:
    ds = f.get_object("data_source", ConvolutionDataSource)
    k = kind(f.device, ds)
    dec_kernel_properties(f, k)
    k.accumulator_precision_option = f.get_enum(
        "accumulator_precision_option", ConvolutionAccumulatorPrecisionOption
    )
    masters = k._weights
    dtype = masters.weight.dtype
    w = f.get_tensor("weights", shape=tuple(k.weights.shape), dtypes=(dtype,))
    b = f.get_tensor("biases", shape=(k.output_feature_channels,), dtypes=(dtype,), optional=True)
    masters.load_ohwi(w, b)
    if b is None:
        masters.bias = None
    if kind is ConvolutionTranspose:
        k.kernel_offset_x = f.get_int("kernel_offset_x")
        k.kernel_offset_y = f.get_int("kernel_offset_y")
    return k


def _enc_batch_normalization(k: BatchNormalization, enc: Encoder) -> dict[str, Any]:
    return {
        "data_source": enc.object(k.data_source),
        "fused_neuron_descriptor": enc.value(k.fused_neuron_descriptor),
        **enc_kernel_properties(k),
        "epsilon": k.epsilon,
        "gamma": enc.tensor(k.gamma, "gamma"),
        "beta": enc.tensor(k.beta, "beta"),
        "mean": enc.tensor(k.mean, "mean"),
        "variance": enc.tensor(k.variance, "variance"),
    }


def _dec_batch_normalization(f: Fields) -> BatchNormalization:
    ds = f.get_object("data_source", BatchNormalizationDataSource)
    k = BatchNormalization(f.device, ds, f.get_value("fused_neuron_descriptor"))
    dec_kernel_properties(f, k)
    k.epsilon = f.get_float("epsilon")
    same = {"shape": tuple(k.gamma.shape), "dtypes": (k.gamma.dtype,)}
    k._affine.load(f.get_tensor("gamma", **same), f.get_tensor("beta", **same))
    k._running.load(f.get_tensor("mean", **same), f.get_tensor("variance", **same))
    return k


def _enc_group_normalization(k: Any, enc: Encoder) -> dict[str, Any]:
    return {
        "data_source": enc.object(k.data_source),
        **enc_kernel_properties(k),
        "epsilon": k.epsilon,
        "gamma": enc.tensor(k.gamma, "gamma"),
        "beta": enc.tensor(k.beta, "beta"),
    }


def _dec_group_normalization(f: Fields, kind: type) -> Any:
    sources = {
        InstanceNormalization: InstanceNormalizationDataSource,
        GroupNormalization: GroupNormalizationDataSource,
    }
    k = kind(f.device, f.get_object("data_source", sources[kind]))
    dec_kernel_properties(f, k)
    k.epsilon = f.get_float("epsilon")
    same = {"shape": tuple(k.gamma.shape), "dtypes": (k.gamma.dtype,)}
    k._affine.load(f.get_tensor("gamma", **same), f.get_tensor("beta", **same))
    return k


for _cls, _encode, _decode in (
    (Convolution, _enc_convolution, per_class(_dec_convolution, Convolution)),
    (FullyConnected, _enc_convolution, per_class(_dec_convolution, FullyConnected)),
    (ConvolutionTranspose, _enc_convolution, per_class(_dec_convolution, ConvolutionTranspose)),
    (BatchNormalization, _enc_batch_normalization, _dec_batch_normalization),
    (
        InstanceNormalization,
        _enc_group_normalization,
        per_class(_dec_group_normalization, InstanceNormalization),
    ),
    (
        GroupNormalization,
        _enc_group_normalization,
        per_class(_dec_group_normalization, GroupNormalization),
    ),
):
    register_codec(_cls, _encode, _decode)
del _cls, _encode, _decode
