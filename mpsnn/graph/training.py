"""The automatic training graph (MPS ``trainingGraphWithSourceGradient:nodeHandler:``).

From a loss node (whose result image is the gradient of the loss with respect to its source),
from an initial-gradient node (whose result, ones, is the gradient of its source with respect
to itself) or from any node given the gradient of its result, walk back over the forward
graph and ask each forward filter for its gradient node(s) (``gradient_filters``, which the
forward → gradient registry backs):

* where an image feeds several filters, the gradients of its readers are summed by inserted
  `AdditionNode` s;
* a concatenation gives one slice of the incoming gradient per input, arithmetic a primary and
  a secondary gradient;
* an image with ``stop_gradient`` ends the walk (nothing upstream gets its gradient through
  it); a frozen layer (``trainable = False``) gets a data gradient but no weight gradient and
  no update, and the walk goes on below it;
* the gradient of the graph's inputs is created too (Apple's sample has exactly that one exit
  point: the first convolution's gradient node).

``node_handler(gradient_node, inference_node, inference_source, gradient_source)`` is called
once for every gradient node created, additions and slices included (``inference_node`` is
None for an inserted addition); it may change the node's ``result_image.format``.

Returns the terminal gradient nodes: those whose results no other gradient node reads.
"""

from __future__ import annotations

from typing import Any

from mpsnn.graph.nodes import (
    _GRADIENT_SUM,
    _TRAINING_GRAPH,
    FilterNode,
    GradientFilterNode,
    ImageNode,
    NodeHandler,
)

__all__ = ["training_graph"]


def _forward_order(start: FilterNode) -> list[FilterNode]:
    """The forward filters ``start`` depends on (through images), producers first."""
    order: list[FilterNode] = []
    state: dict[int, int] = {}
    stack: list[tuple[FilterNode, bool]] = [(start, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            state[node._id] = 2
            order.append(node)
            continue
        if state.get(node._id) == 2:
            continue
        if state.get(node._id) == 1:
            raise ValueError(
                f"[training_graph] the node graph must have no cycle, got one through {node!r}"
            )
        state[node._id] = 1
        stack.append((node, True))
        for src in reversed(node.source_images):
            p = src.producer
            if p is not None and state.get(p._id) != 2:
                if state.get(p._id) == 1:
                    raise ValueError(
                        f"[training_graph] the node graph must have no cycle, got one through {p!r}"
                    )
                stack.append((p, False))
    return order


def training_graph(
    node: FilterNode,
    source_gradient: ImageNode | None = None,
    node_handler: NodeHandler | None = None,
) -> list[GradientFilterNode]:
    """See the module docstring."""
    if isinstance(node, GradientFilterNode):
        node.training_graph()  # raises: a training graph starts at a forward node
    handler = node_handler or (lambda *args: None)
    if not callable(handler):
        raise TypeError(f"[training_graph] node_handler must be callable, got {handler!r}")
    grads: dict[int, list[ImageNode]] = {}  # image id -> gradients flowing into it
    what = node.supplies_gradient
    if what is not None:
        # a loss node's result is its source's gradient; an initial gradient's result (ones)
        # is its source's gradient with respect to itself
        start = node.source_images[0]
        if start.producer is None:
            raise ValueError(f"[training_graph] the {what} node's source must be made by a filter")
        grads[start._id] = [node.result_image]
        forward = _forward_order(start.producer)
    else:
        if source_gradient is None:
            raise ValueError(
                f"[training_graph] {node!r} is not a loss node: source_gradient (the gradient "
                "of its result) must be given, got None"
            )
        if not isinstance(source_gradient, ImageNode):
            raise TypeError(
                f"[training_graph] source_gradient must be an ImageNode, "
                f"got {type(source_gradient).__name__}"
            )
        grads[node.result_image._id] = [source_gradient]
        forward = _forward_order(node)
    made: list[GradientFilterNode] = []
    consumed: set[int] = set()  # gradient images read by another gradient node
    for fnode in reversed(forward):
        incoming = grads.get(fnode.result_image._id)
        if not incoming or fnode.result_image.stop_gradient:
            continue
        g = _sum(incoming, handler, made, consumed)
        consumed.add(g._id)
        gnodes = fnode.gradient_filters([g])
        for i, gnode in enumerate(gnodes):
            source = _differentiated(fnode, gnode, i)
            handler(gnode, fnode, source, g)
            made.append(gnode)
            if source is not None and not source.stop_gradient:
                grads.setdefault(source._id, []).append(gnode.result_image)
    # inputs of the graph read by several filters get their summed gradient too
    for images in grads.values():
        if len(images) > 1 and all(i._id not in consumed for i in images):
            _sum(images, handler, made, consumed)
    return [n for n in made if n.result_image._id not in consumed]


def _differentiated(fnode: FilterNode, gnode: Any, index: int) -> ImageNode | None:
    """The forward input whose gradient ``gnode`` computes."""
    sources = fnode.source_images
    if hasattr(gnode, "is_labels_gradient_filter"):  # a forward loss: predictions or labels
        return sources[int(gnode.is_labels_gradient_filter)]
    if hasattr(gnode, "is_secondary_source_filter"):
        return sources[int(gnode.is_secondary_source_filter)]
    if hasattr(gnode, "index"):  # a concatenation's slice
        return sources[gnode.index]
    return sources[index] if index < len(sources) else None


def _sum(
    images: list[ImageNode],
    handler: Any,
    made: list[GradientFilterNode],
    consumed: set[int],
) -> ImageNode:
    """One image holding the sum of ``images`` (AdditionNodes inserted, left to right)."""
    total = images[0]
    if len(images) > 1 and not _GRADIENT_SUM:
        raise RuntimeError(
            "[training_graph] no node class sums gradients: import mpsnn.nodes (the arithmetic "
            "family registers AdditionNode), got none registered"
        )
    for other in images[1:]:
        add = _GRADIENT_SUM[0](total, other)
        handler(add, None, None, None)
        made.append(add)
        consumed.update((total._id, other._id))
        total = add.result_image
    return total


_TRAINING_GRAPH.append(training_graph)  # what FilterNode.training_graph calls
