"""The generic codec of the forward filter node classes that declare their saved fields
(`mpsnn.core.saved`; `FilterNode.__init_subclass__` records them).

A declared node is written as what every forward node's codec writes (`mpsnn.io.graph_nodes`),
with its declared fields in the middle:

* ``source``: its first source image (a reference to an `ImageNode`); any further source must
  be the value of one of its `ImageNode` fields (a forward loss's ``labels``);
* one JSON field per declared `Field`: the init fields, then the others;
* ``trainable``, ``label``, ``padding_policy``, ``result_image`` and ``result_state``.

Loading builds ``cls(source, **init fields)``, sets the common attributes, then the fields
with ``init=False`` (in the order declared). Saving refuses a node whose `code_attributes`
hold anything but None (code is not saved: set it again after loading).
"""

from __future__ import annotations

from typing import Any

from mpsnn.core.saved import saved_fields
from mpsnn.graph.nodes import FilterNode, GradientFilterNode, ImageNode
from mpsnn.io.codec import Codec, Encoder, Fields, per_class, set_declared_codec
from mpsnn.io.declared import decode_field, encode_field, kernel_codec, set_fields_after_init
from mpsnn.io.graph_nodes import finish, forward_encoder, read_source
from mpsnn.io.graph_training import gradient_codec

__all__ = ["decode_node", "encode_node_fields", "node_codec"]


def _refuse_code(node: FilterNode, enc: Encoder) -> None:
    for name in type(node).code_attributes:
        value = getattr(node, name, None)
        if value is not None:
            raise TypeError(
                f"[save] {type(node).__name__}.{name} must be None to be saved (it is code, "
                f"which a file does not hold: set it again after loading), got "
                f"{type(value).__name__} at {enc.path()}"
            )


def encode_node_fields(node: FilterNode, enc: Encoder) -> dict[str, Any]:
    """A declared node's own fields: ``source`` and its declared fields (see the module)."""
    cls, who = type(node), type(node).__name__
    fields = saved_fields(cls) or ()
    _refuse_code(node, enc)
    sources = node.source_images
    if not sources:
        raise TypeError(
            f"[save] {who} declares its saved fields, so it must have a source (saved as "
            f"'source'), got none at {enc.path()}"
        )
    out: dict[str, Any] = {"source": enc.object(sources[0])}
    out.update({f.name: encode_field(node, f, enc) for f in fields if f.init})
    out.update({f.name: encode_field(node, f, enc) for f in fields if not f.init})
    held = {id(getattr(node, f.attr)) for f in fields if issubclass(f.kind, ImageNode)}
    unsaved = [i for i, s in enumerate(sources) if i > 0 and id(s) not in held]
    if unsaved:
        raise TypeError(
            f"[save] {who} has {len(sources)} sources: the first is saved as 'source', each "
            f"other must be the value of one of its ImageNode fields, got sources {unsaved} "
            f"in none at {enc.path()}"
        )
    return out


def decode_node(f: Fields, cls: type) -> Any:
    """A node of ``cls`` (which declares its saved fields) from its fields."""
    fields = saved_fields(cls) or ()
    source = read_source(f)
    node = cls(source, **{fd.name: decode_field(f, fd) for fd in fields if fd.init})
    finish(f, node)
    set_fields_after_init(f, node, fields)
    return node


def node_codec(cls: type) -> Codec:
    """The generic codec of the node class ``cls`` (which declares its saved fields)."""
    return Codec(
        cls, cls.__name__, forward_encoder(encode_node_fields), per_class(decode_node, cls)
    )


def _declared_codec(cls: type) -> Codec:
    if issubclass(cls, GradientFilterNode):  # recorded by name, saved by the training graph
        return gradient_codec(cls)
    return node_codec(cls) if issubclass(cls, FilterNode) else kernel_codec(cls)


set_declared_codec(_declared_codec)
