"""Codecs of the comparison and crop-and-resize nodes (see `mpsnn.io.graph_nodes` for what
every forward node saves: sources, label, padding policy, ``trainable``, its result image's and
state's attributes).

A comparison node is saved as its two sources and its ``properties`` (the arithmetic ones,
``comparison_type`` by name, ``threshold``); a crop-and-resize node as its source, its size
and its regions (their number is the list's length). The Gram matrix, reduction, bilinear
resize, scale and split loss nodes declare their saved fields (`mpsnn.io.declared_nodes`).
The gradient nodes are saved as the other gradient nodes are (`mpsnn.io.graph_training`).
"""

from __future__ import annotations

from typing import Any

import mpsnn.nodes.reduction as red
import mpsnn.nodes.resize as rs
from mpsnn.cnn.compare import ComparisonType
from mpsnn.io.codec import Encoder, Fields, fail, register_codec, show
from mpsnn.io.graph_nodes import finish, forward_encoder, image_ref, read_source
from mpsnn.io.kernels import decode_crop_regions

__all__: list[str] = []  # the codecs are registered at import


# ---------------------------------------------------------------------------------------------
# the comparison


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
# crop and resize


def _enc_crop(node: rs.CropAndResizeBilinearNode, enc: Encoder) -> dict[str, Any]:
    return {
        "source": enc.object(node.source_images[0]),
        "resize_width": node.resize_width,
        "resize_height": node.resize_height,
        "regions": [list(r) for r in node.regions],
    }


def _dec_crop(f: Fields) -> rs.CropAndResizeBilinearNode:
    source = read_source(f)
    w, h = f.get_int("resize_width", 1), f.get_int("resize_height", 1)
    regions = decode_crop_regions(f)
    return finish(f, rs.CropAndResizeBilinearNode(source, w, h, len(regions), regions))


# ---------------------------------------------------------------------------------------------
# the table


def _register() -> None:
    register_codec(red.ComparisonNode, forward_encoder(_enc_comparison), _dec_comparison)
    register_codec(rs.CropAndResizeBilinearNode, forward_encoder(_enc_crop), _dec_crop)


_register()
