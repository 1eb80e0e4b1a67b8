"""Codecs of the Gram matrix, comparison, reduction, resize, scale and split loss nodes (see
`mpsnn.io.graph_nodes` for what every forward node saves: sources, label, padding policy,
``trainable``, its result image's and state's attributes).

Each node is saved as its constructor's arguments and the attributes set on it afterwards: a
Gram matrix node's ``alpha``; a comparison node's ``properties`` (the arithmetic ones,
``comparison_type`` by name, ``threshold``); a reduction node's ``clip_rect_source`` (and the
feature-channel sum's ``weight``); a resize node's size, ``align_corners`` or regions; a scale
node's ``output_size`` (its result image's ``stop_gradient``, True when made, is saved with
the result image); a forward loss node's predictions, labels, weights (or none), loss
descriptor (shared, as the node keeps it) and ``reduce_across_batch``; an initial gradient
node's source. A Gram matrix node's and a forward loss node's ``property_call_back`` and a
scale node's ``transform_provider`` are code and are refused. The gradient nodes of the Gram
matrix, the spatial mean, the resizes and the forward loss are saved as the other gradient nodes are
(`mpsnn.io.graph_training`).
"""

from __future__ import annotations

from typing import Any

import mpsnn.nodes.loss as ln
import mpsnn.nodes.reduction as red
import mpsnn.nodes.resize as rs
from mpsnn.cnn.compare import ComparisonType
from mpsnn.cnn.loss import LossDescriptor
from mpsnn.core.geometry import Region, Size
from mpsnn.graph.nodes import ImageNode
from mpsnn.io.codec import Encoder, Fields, fail, per_class, register_codec, show
from mpsnn.io.graph_nodes import attr, finish, forward_encoder, image_ref, read_source
from mpsnn.io.kernels import decode_crop_regions, decode_region, encode_region

__all__: list[str] = []  # the codecs are registered at import


def _refuse_code(node: Any, name: str, enc: Encoder) -> None:
    value = getattr(node, name)
    if value is not None:
        raise TypeError(
            f"[save] {type(node).__name__}.{name} must be None to be saved (it is code, which a "
            f"file does not hold: set it again after loading), got {type(value).__name__} at "
            f"{enc.path()}"
        )


# ---------------------------------------------------------------------------------------------
# the Gram matrix, the comparison


def _enc_gram(node: red.GramMatrixCalculationNode, enc: Encoder) -> dict[str, Any]:
    _refuse_code(node, "property_call_back", enc)
    return {"source": enc.object(node.source_images[0]), "alpha": node.alpha}


def _dec_gram(f: Fields) -> red.GramMatrixCalculationNode:
    source = read_source(f)
    return finish(f, red.GramMatrixCalculationNode(source, f.get_float("alpha")))


def _enc_comparison(node: red.ComparisonNode, enc: Encoder) -> dict[str, Any]:
    props = dict(node.properties)
    if "comparison_type" in props:
        kind = props["comparison_type"]
        if not isinstance(kind, ComparisonType):
            raise TypeError(
                f"[save] ComparisonNode.comparison_type must be a ComparisonType to be saved, "
                f"got {type(kind).__name__} at {enc.path()}"
            )
        props["comparison_type"] = kind.name
    left, right = node.source_images
    return {"sources": [enc.object(left), enc.object(right)], "properties": enc.value(props)}


def _dec_comparison(f: Fields) -> red.ComparisonNode:
    raw = f.raw("sources")
    if type(raw) is not list or len(raw) != 2:
        raise fail(f"{f.who} field 'sources' must be a list of 2 image nodes, got {show(raw)}")
    node = red.ComparisonNode(*(image_ref(f, r, f"'sources.{i}'") for i, r in enumerate(raw)))
    props = f.get_value("properties")
    allowed = red.ComparisonNode._properties
    if type(props) is not dict or not set(props) <= set(allowed):
        raise fail(
            f"{f.who} field 'properties' must map some of {list(allowed)} to values, "
            f"got {show(f.raw('properties'))}"
        )
    if "comparison_type" in props:
        name = props["comparison_type"]
        if type(name) is not str or name not in ComparisonType.__members__:
            raise fail(
                f"{f.who} field 'properties.comparison_type' must be one of the ComparisonType "
                f"names ({', '.join(ComparisonType.__members__)}), got {show(name)}"
            )
        props["comparison_type"] = ComparisonType[name]
    for name, value in props.items():
        setattr(node, name, value)
    return finish(f, node)


# ---------------------------------------------------------------------------------------------
# reductions


def _enc_reduction(node: Any, enc: Encoder) -> dict[str, Any]:
    out = {
        "source": enc.object(node.source_images[0]),
        "clip_rect_source": encode_region(attr(node, "clip_rect_source", (Region,), enc)),
    }
    if isinstance(node, red.ReductionFeatureChannelsSumNode):
        out["weight"] = attr(node, "weight", (float, int), enc)
    return out


def _dec_reduction(f: Fields, kind: type) -> Any:
    node = kind(read_source(f))
    node.clip_rect_source = decode_region(f, "clip_rect_source")
    if kind is red.ReductionFeatureChannelsSumNode:
        node.weight = f.get_float("weight")
    return finish(f, node)


# ---------------------------------------------------------------------------------------------
# resizes and scales


def _enc_resize(node: Any, enc: Encoder) -> dict[str, Any]:
    out: dict[str, Any] = {
        "source": enc.object(node.source_images[0]),
        "resize_width": node.resize_width,
        "resize_height": node.resize_height,
    }
    if isinstance(node, rs.ResizeBilinearNode):
        out["align_corners"] = node.align_corners
    else:
        out["regions"] = [list(r) for r in node.regions]
    return out


def _dec_resize(f: Fields, kind: type) -> Any:
    source = read_source(f)
    w, h = f.get_int("resize_width", 1), f.get_int("resize_height", 1)
    if kind is rs.ResizeBilinearNode:
        return finish(f, kind(source, w, h, f.get_bool("align_corners")))
    regions = decode_crop_regions(f)
    return finish(f, kind(source, w, h, len(regions), regions))


def _enc_scale(node: rs.ScaleNode, enc: Encoder) -> dict[str, Any]:
    _refuse_code(node, "transform_provider", enc)
    return {"source": enc.object(node.source_images[0]), "output_size": list(node.output_size)}


def _dec_scale(f: Fields, kind: type) -> Any:
    source: ImageNode = read_source(f)
    return finish(f, kind(source, Size(*f.get_ints("output_size", 3))))


# ---------------------------------------------------------------------------------------------
# the split loss


def _enc_forward_loss(node: ln.ForwardLossNode, enc: Encoder) -> dict[str, Any]:
    _refuse_code(node, "property_call_back", enc)
    weights = node.input_weights
    return {
        "source": enc.object(node.source_images[0]),
        "labels": enc.object(node.input_labels),
        "weights": None if weights is None else enc.object(weights),
        "loss_descriptor": enc.object(node.descriptor),
        "reduce_across_batch": attr(node, "reduce_across_batch", (bool,), enc),
    }


def _dec_forward_loss(f: Fields) -> ln.ForwardLossNode:
    source, labels = read_source(f), f.get_object("labels", ImageNode)
    weights = f.get_object("weights", ImageNode, optional=True)
    desc = f.get_object("loss_descriptor", LossDescriptor)
    across = f.get_bool("reduce_across_batch")
    return finish(f, ln.ForwardLossNode(source, labels, desc, weights, reduce_across_batch=across))


def _enc_initial_gradient(node: ln.InitialGradientNode, enc: Encoder) -> dict[str, Any]:
    return {"source": enc.object(node.source_images[0])}


def _dec_initial_gradient(f: Fields) -> ln.InitialGradientNode:
    return finish(f, ln.InitialGradientNode(read_source(f)))


# ---------------------------------------------------------------------------------------------
# the table


def _register() -> None:
    reductions = [
        getattr(red, name)
        for name in red.__all__
        if isinstance(getattr(red, name), type)
        and issubclass(getattr(red, name), red.UnaryReductionNode)
    ]
    families: list[tuple[list[type], Any, Any]] = [
        (reductions, _enc_reduction, _dec_reduction),
        ([rs.ResizeBilinearNode, rs.CropAndResizeBilinearNode], _enc_resize, _dec_resize),
        # ScaleNode is abstract: never saved, and a file naming it is refused by its constructor
        ([rs.ScaleNode, rs.BilinearScaleNode, rs.LanczosScaleNode], _enc_scale, _dec_scale),
    ]
    for classes, encode, decode in families:
        for cls in classes:
            register_codec(cls, forward_encoder(encode), per_class(decode, cls))
    register_codec(red.GramMatrixCalculationNode, forward_encoder(_enc_gram), _dec_gram)
    register_codec(red.ComparisonNode, forward_encoder(_enc_comparison), _dec_comparison)
    register_codec(ln.ForwardLossNode, forward_encoder(_enc_forward_loss), _dec_forward_loss)
    register_codec(
        ln.InitialGradientNode, forward_encoder(_enc_initial_gradient), _dec_initial_gradient
    )


_register()
