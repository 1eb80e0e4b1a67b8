"""Codecs of the forward node recipe: `ImageNode`, what every forward filter node saves, and
the forward nodes whose saved form is not a list of fields.

A filter node is saved as its constructor's arguments (sources, data source, sizes,
descriptors) and the attributes that can be set after construction (``label``,
``padding_policy``, ``trainable``, and each family's own), with the attributes of its result
image (``handle``, ``format``, ``export_from_graph``, ``stop_gradient``) and of its result
state. Sources are references to `ImageNode` objects: a graph input (its handle and flags), or
the result image of a node saved earlier. Nodes reached several times (a training graph and
an inference graph built on one recipe) are saved once and load as one node.

Most node classes declare their own fields where they are defined (``saved_fields``, see
`mpsnn.core.saved`) and are saved by `mpsnn.io.declared_nodes` with the common helpers of this
module (`forward_encoder`, `finish`, `read_source`). The codecs here are those of the nodes
whose saved form a field list cannot say: the convolution transpose (its pairing with a
convolution node's state), the neurons (a named neuron node is rebuilt from its descriptor),
reshape and pad (constructor arguments kept together, a fill value of several forms), the
concatenation and arithmetic nodes (a list of sources; ``properties``), the local
normalizations (a size of one or two ints, a dict of parameters) and the loss nodes (their
labels state). The comparison and crop-and-resize nodes are in `mpsnn.io.graph_nodes_more`.

What is code is refused at save time: a custom padding policy, an image allocator, a handle
that is not a JSON-like value. The gradient nodes are not saved here: see
`mpsnn.io.graph_training`. The YOLO loss node is saved as `LossNode` is.
"""

from __future__ import annotations

from typing import Any

import mpsnn.nodes as nodes
import mpsnn.nodes.neuron as neuron_nodes
from mpsnn.cnn.convolution.data_source import ConvolutionDataSource
from mpsnn.cnn.convolution.descriptor import ConvolutionAccumulatorPrecisionOption
from mpsnn.cnn.loss import LossDescriptor
from mpsnn.cnn.neuron_descriptor import NeuronDescriptor
from mpsnn.cnn.yolo import YOLOLossDescriptor
from mpsnn.core.descriptor import FeatureChannelFormat
from mpsnn.core.geometry import EdgeMode, ImageCoordinate
from mpsnn.graph.nodes import FilterNode, ImageNode, StateNode
from mpsnn.io.codec import Encoder, Fields, fail, per_class, register_codec, show
from mpsnn.io.kernels import decode_padding, encode_padding
from mpsnn.nodes.yolo import YOLOLossNode

__all__ = [
    "ARITHMETIC",
    "attr",
    "dec_arithmetic",
    "dec_common",
    "enc_arithmetic",
    "enc_common",
    "finish",
    "forward_encoder",
    "image_ref",
    "read_source",
    "set_properties",
]

_IMAGE_KEYS = {"handle", "format", "export_from_graph", "stop_gradient"}
_STATE_KEYS = {"handle", "export_from_graph"}

# ---------------------------------------------------------------------------------------------
# image nodes, handles, the attributes every filter node has


def _check_handle(h: Any, where: str) -> None:
    """A handle must be a JSON-like value: what it names cannot be saved otherwise."""
    t = type(h)
    if h is None or t in (bool, int, float, str):
        return
    if t in (list, tuple):
        for i, x in enumerate(h):
            _check_handle(x, f"{where}.{i}")
        return
    if t is dict and all(type(k) is str for k in h):
        for k, x in h.items():
            _check_handle(x, f"{where}.{k}")
        return
    raise TypeError(
        f"[save] {where} must be a JSON-like value to be saved (None, bool, int, float, str, "
        f"or lists, tuples and dicts with str keys of them), got {t.__name__}"
    )


def _enc_image(img: ImageNode, enc: Encoder, who: str) -> dict[str, Any]:
    """An image node's own attributes (its producer saves itself)."""
    if img.image_allocator is not None:
        raise TypeError(
            f"[save] {who}.image_allocator must be None to be saved (an allocator is code), "
            f"got {type(img.image_allocator).__name__} at {enc.path()}"
        )
    _check_handle(img.handle, f"{who}.handle at {enc.path()}")
    return {
        "handle": enc.value(img.handle),
        "format": None if img.format is None else FeatureChannelFormat(img.format).name,
        "export_from_graph": bool(img.export_from_graph),
        "stop_gradient": bool(img.stop_gradient),
    }


def _dec_image(f: Fields, name: str, img: ImageNode) -> None:
    raw = f.raw(name)
    if (
        type(raw) is not dict
        or set(raw) != _IMAGE_KEYS
        or not (raw["format"] is None or raw["format"] in FeatureChannelFormat.__members__)
        or type(raw["export_from_graph"]) is not bool
        or type(raw["stop_gradient"]) is not bool
    ):
        raise fail(
            f"{f.who} field {name!r} must hold a handle, a format (a FeatureChannelFormat name "
            f"or null), export_from_graph and stop_gradient (booleans), got {show(raw)}"
        )
    img.handle = f.resolve_value(raw["handle"], f"'{name}.handle'")
    img.format = None if raw["format"] is None else FeatureChannelFormat[raw["format"]]
    img.export_from_graph = raw["export_from_graph"]
    img.stop_gradient = raw["stop_gradient"]


def _enc_state(st: StateNode | None, enc: Encoder, who: str) -> Any:
    if st is None:
        return None
    _check_handle(st.handle, f"{who}.handle at {enc.path()}")
    return {"handle": enc.value(st.handle), "export_from_graph": bool(st.export_from_graph)}


def _dec_state(f: Fields, name: str, st: StateNode | None) -> None:
    raw = f.raw(name)
    if raw is None and st is None:
        return
    if st is None or type(raw) is not dict or set(raw) != _STATE_KEYS:
        want = "null (the node makes no state)" if st is None else "a handle and export_from_graph"
        raise fail(f"{f.who} field {name!r} must be {want}, got {show(raw)}")
    if type(raw["export_from_graph"]) is not bool:
        raise fail(f"{f.who} field '{name}.export_from_graph' must be a boolean, got {show(raw)}")
    st.handle = f.resolve_value(raw["handle"], f"'{name}.handle'")
    st.export_from_graph = raw["export_from_graph"]


def attr(obj: Any, name: str, kinds: tuple[type, ...], enc: Encoder) -> Any:
    """``obj.name``, refused unless of one of ``kinds`` (exactly): a node attribute is a plain
    Python attribute, and a file must hold what load accepts."""
    v = getattr(obj, name)
    if type(v) not in kinds:
        want = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
        raise TypeError(
            f"[save] {type(obj).__name__}.{name} must be {want} to be saved, got "
            f"{type(v).__name__} at {enc.path()}"
        )
    return v


def image_ref(f: Fields, raw: Any, where: str) -> ImageNode:
    """The `ImageNode` a reference inside a field names."""
    return f.resolve_object(raw, where, ImageNode)


def _enc_image_node(img: ImageNode, enc: Encoder) -> dict[str, Any]:
    if img.producer is not None:  # a result image: its producer saves its attributes
        return {"producer": enc.object(img.producer)}
    return {"producer": None, "image": _enc_image(img, enc, "ImageNode")}


def _dec_image_node(f: Fields) -> ImageNode:
    producer = f.get_object("producer", FilterNode, optional=True)
    if producer is not None:
        return producer.result_image
    img = ImageNode()
    _dec_image(f, "image", img)
    return img


def enc_common(node: FilterNode, enc: Encoder) -> dict[str, Any]:
    """What every filter node has: label, padding policy, result image and state."""
    who = type(node).__name__
    pad = node.padding_policy
    return {
        "label": attr(node, "label", (str, type(None)), enc),
        "padding_policy": None if pad is None else encode_padding(pad, f"{who}.padding_policy"),
        "result_image": _enc_image(node.result_image, enc, f"{who}.result_image"),
        "result_state": _enc_state(node.result_state, enc, f"{who}.result_state"),
    }


def dec_common(f: Fields, node: FilterNode) -> None:
    node.label = f.get_str("label", optional=True)
    if f.raw("padding_policy") is not None:  # None: every new node's
        node.padding_policy = decode_padding(f, "padding_policy")
    _dec_image(f, "result_image", node.result_image)
    _dec_state(f, "result_state", node.result_state)


def forward_encoder(encode: Any) -> Any:
    """A forward node's encode: its own fields, then ``trainable`` and the common ones."""

    def enc(node: FilterNode, e: Encoder) -> dict[str, Any]:
        out = encode(node, e)
        out["trainable"] = node.trainable
        out.update(enc_common(node, e))
        return out

    return enc


def finish(f: Fields, node: FilterNode) -> FilterNode:
    """A forward node's decode ends here: ``trainable`` and the common attributes."""
    if not f.get_bool("trainable"):  # True is every node's default
        node.trainable = False
    dec_common(f, node)
    return node


def read_source(f: Fields) -> ImageNode:
    """The node's one source (field ``source``)."""
    return f.get_object("source", ImageNode)


# ---------------------------------------------------------------------------------------------
# the convolution transpose (its pairing), neurons, reshape, pad, concatenation


def _enc_transpose(node: nodes.ConvolutionTransposeNode, enc: Encoder) -> dict[str, Any]:
    out: dict[str, Any] = {"source": enc.object(node.source_images[0])}
    pair = node._pair
    if pair is not None and (pair.producer is None or pair.producer.result_state is not pair):
        raise TypeError(
            "[save] ConvolutionTransposeNode's convolution_gradient_state must be the "
            f"result_state of a convolution node to be saved, got {pair!r} at {enc.path()}"
        )
    out["convolution_gradient_state"] = None if pair is None else enc.object(pair.producer)
    out["data_source"] = enc.object(node.data_source)
    precision = node.accumulator_precision
    out["accumulator_precision"] = None if precision is None else precision.name
    return out


def _dec_transpose(f: Fields) -> nodes.ConvolutionTransposeNode:
    source = read_source(f)
    conv = f.get_object("convolution_gradient_state", nodes.ConvolutionNode, optional=True)
    pair = None if conv is None else conv.result_state
    ds = f.get_object("data_source", ConvolutionDataSource)
    node = nodes.ConvolutionTransposeNode(source, pair, ds)
    if f.raw("accumulator_precision") is not None:
        node.accumulator_precision = f.get_enum(
            "accumulator_precision", ConvolutionAccumulatorPrecisionOption
        )
    return finish(f, node)


def _enc_neuron(node: Any, enc: Encoder) -> dict[str, Any]:
    return {"source": enc.object(node.source_images[0]), "descriptor": enc.object(node.descriptor)}


def _dec_neuron(f: Fields, kind: type) -> Any:
    source = read_source(f)
    node = kind.__new__(kind)  # a named neuron node's constructor only builds the descriptor
    neuron_nodes.NeuronNode.__init__(node, source, f.get_object("descriptor", NeuronDescriptor))
    return finish(f, node)


_RESHAPE = ("result_width", "result_height", "result_feature_channels")


def _enc_reshape(node: nodes.ReshapeNode, enc: Encoder) -> dict[str, Any]:
    out: dict[str, Any] = {"source": enc.object(node.source_images[0])}
    out.update(zip(_RESHAPE, node._shape, strict=True))
    return out


def _dec_reshape(f: Fields) -> nodes.ReshapeNode:
    source = read_source(f)
    return finish(f, nodes.ReshapeNode(source, *(f.get_int(name, 1) for name in _RESHAPE)))


def _enc_pad(node: nodes.PadNode, enc: Encoder) -> dict[str, Any]:
    before, after, fill = node._args
    return {
        "source": enc.object(node.source_images[0]),
        "padding_size_before": None if before is None else list(before),
        "padding_size_after": None if after is None else list(after),
        "edge_mode": EdgeMode(node.edge_mode).name,
        "fill_value": enc.value(fill),
    }


def _dec_pad(f: Fields) -> nodes.PadNode:
    source = read_source(f)
    sizes = [
        None if f.raw(name) is None else ImageCoordinate(*f.get_ints(name, 3))
        for name in ("padding_size_before", "padding_size_after")
    ]
    edge = f.get_enum("edge_mode", EdgeMode)
    return finish(f, nodes.PadNode(source, sizes[0], sizes[1], edge, f.get_value("fill_value")))


def _enc_concatenation(node: nodes.ConcatenationNode, enc: Encoder) -> dict[str, Any]:
    return {"sources": [enc.object(s) for s in node.source_images]}


def _dec_concatenation(f: Fields) -> nodes.ConcatenationNode:
    raw = f.raw("sources")
    if type(raw) is not list or not raw:
        raise fail(f"{f.who} field 'sources' must be a non-empty list, got {show(raw)}")
    sources = [image_ref(f, r, f"'sources.{i}'") for i, r in enumerate(raw)]
    return finish(f, nodes.ConcatenationNode(sources))


# ---------------------------------------------------------------------------------------------
# arithmetic (registered by mpsnn.io.graph_training: an addition may be a training graph's)

ARITHMETIC = (
    nodes.AdditionNode,
    nodes.SubtractionNode,
    nodes.MultiplicationNode,
    nodes.DivisionNode,
)


def enc_arithmetic(node: Any, enc: Encoder) -> dict[str, Any]:
    """An arithmetic node's own fields: its sources and ``properties``."""
    left, right = node.source_images
    return {
        "sources": [enc.object(left), enc.object(right)],
        "properties": enc.value(dict(node.properties)),
    }


def dec_arithmetic(f: Fields, kind: type) -> Any:
    raw = f.raw("sources")
    if type(raw) is not list or len(raw) != 2:
        raise fail(f"{f.who} field 'sources' must be a list of 2 image nodes, got {show(raw)}")
    node = kind(*(image_ref(f, r, f"'sources.{i}'") for i, r in enumerate(raw)))
    set_properties(f, node)
    return finish(f, node)


def set_properties(f: Fields, node: Any) -> None:
    props = f.get_value("properties")
    allowed = type(node)._properties
    if type(props) is not dict or not set(props) <= set(allowed):
        raise fail(
            f"{f.who} field 'properties' must map some of {list(allowed)} to values, "
            f"got {show(f.raw('properties'))}"
        )
    for name, value in props.items():
        setattr(node, name, value)


# ---------------------------------------------------------------------------------------------
# local normalizations, loss

_LOCALS = (
    nodes.SpatialNormalizationNode,
    nodes.LocalContrastNormalizationNode,
    nodes.CrossChannelNormalizationNode,
)


def _enc_local(node: Any, enc: Encoder) -> dict[str, Any]:
    params = {name: getattr(node, name) for name in node._parameters}
    return {
        "source": enc.object(node.source_images[0]),
        "size": list(node._size),
        "parameters": enc.value(params),
    }


def _dec_local(f: Fields, kind: type) -> Any:
    source = read_source(f)
    count = 1 if kind is nodes.CrossChannelNormalizationNode else 2
    size = f.get_ints("size", count)
    params = f.get_value("parameters")
    if type(params) is not dict or set(params) != set(kind._parameters):
        raise fail(
            f"{f.who} field 'parameters' must map exactly {list(kind._parameters)} to numbers, "
            f"got {show(f.raw('parameters'))}"
        )
    return finish(f, kind(source, *size, **params))


_LOSS_DESCRIPTORS = {nodes.LossNode: LossDescriptor, YOLOLossNode: YOLOLossDescriptor}


def _enc_loss(node: nodes.LossNode, enc: Encoder) -> dict[str, Any]:
    who = f"{type(node).__name__}.input_labels"
    return {
        "source": enc.object(node.source_images[0]),
        "loss_descriptor": enc.object(node.descriptor),
        "input_labels": _enc_state(node.input_labels, enc, who),
    }


def _dec_loss(f: Fields, kind: type) -> nodes.LossNode:
    source = read_source(f)
    node = kind(source, f.get_object("loss_descriptor", _LOSS_DESCRIPTORS[kind]))
    _dec_state(f, "input_labels", node.input_labels)
    return finish(f, node)


# ---------------------------------------------------------------------------------------------
# the table


def _register() -> None:
    register_codec(ImageNode, _enc_image_node, _dec_image_node)
    families: list[tuple[tuple[type, ...], Any, Any]] = [
        ((neuron_nodes.NeuronNode,), _enc_neuron, _dec_neuron),
        (ARITHMETIC[1:], enc_arithmetic, dec_arithmetic),
        (_LOCALS, _enc_local, _dec_local),
        (tuple(_LOSS_DESCRIPTORS), _enc_loss, _dec_loss),
    ]
    single: list[tuple[type, Any, Any]] = [
        (nodes.ConvolutionTransposeNode, _enc_transpose, _dec_transpose),
        (nodes.ReshapeNode, _enc_reshape, _dec_reshape),
        (nodes.PadNode, _enc_pad, _dec_pad),
        (nodes.ConcatenationNode, _enc_concatenation, _dec_concatenation),
    ]
    neurons = [getattr(neuron_nodes, name) for name in neuron_nodes.__all__]
    neurons = [cls for cls in neurons if issubclass(cls, neuron_nodes.NeuronNode)]
    for classes, encode, decode in families:
        for cls in neurons if classes == (neuron_nodes.NeuronNode,) else classes:
            register_codec(cls, forward_encoder(encode), per_class(decode, cls))
    for cls, encode, decode in single:
        register_codec(cls, forward_encoder(encode), decode)


_register()
