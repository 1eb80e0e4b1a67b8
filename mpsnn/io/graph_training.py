"""Codecs of the nodes a training graph is made of: how the gradient nodes were made.

Gradient nodes are code's output, not a recipe: ``loss_node.training_graph()``,
``initial_gradient_node.training_graph()`` (the split loss: the walk starts at the initial
gradient's source, e.g. the sum of several forward losses' images) or
``node.training_graph(source_gradient)`` makes them, and the order it makes them in is
deterministic (the order its node handler sees them). So a file stores the call — a
``TrainingGraph`` object: the loss or initial gradient node (or the node and its source
gradient) and the types of the nodes it made — and each gradient node as its position in what
that call makes, with the attributes a node handler (or the user) may have set on it
afterwards: ``label``, ``padding_policy``, and its result image's ``format``, ``handle``,
``export_from_graph`` and ``stop_gradient``. `load` rebuilds the forward nodes, calls
``training_graph()`` again, checks that it made the same node types, and applies the saved
attributes to each node.

At save time the call is found from the gradient nodes (the incoming gradient of the first
ones is the loss or initial gradient node's result, or the source gradient), made again on
the saved forward nodes, and its nodes are matched to the saved ones by what they are (type,
the forward node they differentiate, which input — for a loss gradient, the predictions or
the labels —, the images they read). A gradient node that no such call makes again (made
some other way, or by a training graph whose forward graph changed since) is refused. An
`AdditionNode` that sums gradients is a training graph's when it matches; otherwise it is an
ordinary forward node.
"""

from __future__ import annotations

from typing import Any

from mpsnn.core.kernel import TrainingStyle
from mpsnn.graph.nodes import FilterNode, GradientFilterNode, ImageNode
from mpsnn.io.codec import (
    Codec,
    Encoder,
    Fields,
    codec_of_class,
    fail,
    per_class,
    register_codec,
    show,
)
from mpsnn.io.graph_nodes import (
    dec_arithmetic,
    dec_common,
    enc_arithmetic,
    enc_common,
    forward_encoder,
    set_properties,
)
from mpsnn.nodes.arithmetic import AdditionNode, ArithmeticGradientNode
from mpsnn.nodes.loss import InitialGradientNode, LossGradientNode, LossNode
from mpsnn.nodes.shape import ConcatenationGradientNode

__all__ = ["TrainingCall", "gradient_codec", "register_gradient_node"]

_CONTEXT = "mpsnn.io.graph_training"
# the nodes whose result is their source's gradient: a training graph starts at one of them
# without a source gradient
_STARTS = (LossNode, InitialGradientNode)


class TrainingCall:
    """One ``node.training_graph(source_gradient)`` call (a loss or initial gradient node's:
    ``source_gradient`` None) and the nodes it made, in the order it made them."""

    def __init__(self, node: FilterNode, source_gradient: ImageNode | None) -> None:
        self.node = node
        self.source_gradient = source_gradient
        self.made: list[FilterNode] = []
        node.training_graph(source_gradient, lambda made, *_: self.made.append(made))
        self.originals: dict[int, FilterNode] = {}  # save: position -> the saved node
        self.images: dict[int, ImageNode] = {}  # save: made image id -> the saved image
        self.claimed: set[int] = set()  # load: positions handed out

    def names(self) -> list[str]:
        """The types of the nodes made, as written in files."""
        out = []
        for n in self.made:
            codec = codec_of_class(type(n))
            out.append(type(n).__name__ if codec is None else codec.name)
        return out


def _enc_call(call: TrainingCall, enc: Encoder) -> dict[str, Any]:
    return {
        "node": enc.object(call.node),
        "source_gradient": enc.object(call.source_gradient),
        "made": call.names(),
    }


def _dec_call(f: Fields) -> TrainingCall:
    node = f.get_object("node", FilterNode)
    source_gradient = f.get_object("source_gradient", ImageNode, optional=True)
    if isinstance(node, GradientFilterNode) or (
        isinstance(node, _STARTS) != (source_gradient is None)
    ):
        raise fail(
            f"{f.who} must start at a loss or initial gradient node without a source gradient, "
            f"or at a forward node with one, got a {type(node).__name__} "
            f"{'without' if source_gradient is None else 'with'} a source gradient"
        )
    names = f.raw("made")
    if type(names) is not list or any(type(n) is not str for n in names):
        raise fail(f"{f.who} field 'made' must be a list of type names, got {show(names)}")
    call = TrainingCall(node, source_gradient)
    if call.names() != names:
        raise fail(
            f"{f.who} field 'made' must list the nodes training_graph() makes again from the "
            f"saved forward nodes ({show(call.names())}), got {show(names)}"
        )
    return call


# ---------------------------------------------------------------------------------------------
# finding, at save time, the call that made a gradient node


def _made_kind(node: Any) -> bool:
    """Whether ``node`` may have been made by a training graph."""
    return isinstance(node, GradientFilterNode) or type(node) is AdditionNode


def _key(node: Any, images: dict[int, ImageNode]) -> tuple[Any, ...]:
    """What a made node is: its type, the forward node and input it differentiates, the
    images it reads (``images`` maps a made image to the saved one)."""
    inference = node.inference_node if isinstance(node, GradientFilterNode) else None
    which: Any = None
    if isinstance(node, ArithmeticGradientNode):
        which = node.is_secondary_source_filter
    elif isinstance(node, ConcatenationGradientNode):
        which = node.index
    elif isinstance(node, LossGradientNode):
        which = node.is_labels_gradient_filter
    sources = tuple(id(images.get(s._id, s)) for s in node.source_images)
    return (type(node), id(inference), which, sources)


def _closure(node: FilterNode) -> list[FilterNode]:
    """``node`` and every filter node it depends on (through images and states)."""
    seen: dict[int, FilterNode] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen[id(n)] = n
        producers = [s.producer for s in n.source_images] + [s.producer for s in n.source_states]
        stack.extend(p for p in producers if p is not None)
    return sorted(seen.values(), key=lambda n: n._id)


class _Analysis:
    """The training graph calls found so far in one save, and where each saved node made by
    one of them stands in it."""

    def __init__(self) -> None:
        self.calls: list[TrainingCall] = []
        self.where: dict[int, tuple[TrainingCall, int]] = {}  # id(saved node) -> position
        self.seen: dict[int, FilterNode] = {}  # nodes whose closure was analysed (kept alive)

    def locate(self, node: FilterNode) -> tuple[TrainingCall, int] | None:
        if id(node) not in self.where and id(node) not in self.seen:
            self._analyse(node)
        return self.where.get(id(node))

    def _analyse(self, node: FilterNode) -> None:
        closure = _closure(node)
        candidates = [n for n in closure if _made_kind(n) and id(n) not in self.where]
        tried: set[tuple[int, int]] = set()
        while candidates:
            # the calls of the nodes placed already (by an earlier graph of this save) that
            # the candidates read, then the calls the candidates' incoming gradients point at
            placed = False
            for call in self._calls_read_by(candidates):
                placed = self._match(call, candidates) or placed
            candidates = [n for n in candidates if id(n) not in self.where]
            starts = self._starts(candidates, tried, False) or self._starts(candidates, tried, True)
            for start, source_gradient in starts:
                tried.add((id(start), id(source_gradient)))
                placed = self._match_start(start, source_gradient, candidates) or placed
            candidates = [n for n in candidates if id(n) not in self.where]
            if not placed and not starts:
                break
        self.seen.update((id(n), n) for n in closure)

    def _calls_read_by(self, candidates: list[FilterNode]) -> list[TrainingCall]:
        out: dict[int, TrainingCall] = {}
        for c in candidates:
            for s in c.source_images:
                where = self.where.get(id(s.producer))
                if where is not None:
                    out.setdefault(id(where[0]), where[0])
        return list(out.values())

    def _starts(
        self, candidates: list[FilterNode], tried: set[tuple[int, int]], through_additions: bool
    ) -> list[tuple[FilterNode, ImageNode | None]]:
        """The calls the unplaced gradient nodes point at: a loss or initial gradient node's
        result as their incoming gradient, else a source gradient (read through an addition
        that is not a training graph's, with ``through_additions``)."""
        out: dict[tuple[int, int], tuple[FilterNode, ImageNode | None]] = {}
        for g in candidates:
            if not isinstance(g, GradientFilterNode) or id(g) in self.where:
                continue
            incoming = g.source_images[0]
            p = incoming.producer
            start: tuple[FilterNode, ImageNode | None]
            if isinstance(p, _STARTS):
                start = (p, None)
            elif isinstance(p, GradientFilterNode) or (
                type(p) is AdditionNode and (id(p) in self.where or not through_additions)
            ):
                continue
            else:
                start = (g.inference_node, incoming)
            key = (id(start[0]), id(start[1]))
            if key not in tried:
                out.setdefault(key, start)
        return list(out.values())

    def _match_start(
        self, node: FilterNode, source_gradient: ImageNode | None, candidates: list[FilterNode]
    ) -> bool:
        for call in self.calls:
            same = call.node is node and call.source_gradient is source_gradient
            if same and self._match(call, candidates):
                return True
        call = TrainingCall(node, source_gradient)
        if not self._match(call, candidates):
            return False
        self.calls.append(call)
        return True

    def _match(self, call: TrainingCall, candidates: list[FilterNode]) -> bool:
        """Place the candidates ``call`` makes again at their positions; False: none."""
        by_key: dict[tuple[Any, ...], list[FilterNode]] = {}
        for c in candidates:
            if id(c) not in self.where:
                by_key.setdefault(_key(c, {}), []).append(c)
        images = dict(call.images)
        found: dict[int, FilterNode] = {}
        used: set[int] = set()
        for position, made in enumerate(call.made):
            if position in call.originals:
                continue
            same = [o for o in by_key.get(_key(made, images), []) if id(o) not in used]
            if same:
                found[position] = same[0]
                used.add(id(same[0]))
                images[made.result_image._id] = same[0].result_image
        if not found:
            return False
        for position, original in found.items():
            call.originals[position] = original
            self.where[id(original)] = (call, position)
        call.images = images
        return True


def _analysis(enc: Encoder) -> _Analysis:
    found = enc.context.get(_CONTEXT)
    if found is None:
        found = enc.context[_CONTEXT] = _Analysis()
    return found


# ---------------------------------------------------------------------------------------------
# gradient nodes and additions


def _enc_made(node: Any, enc: Encoder, where: tuple[TrainingCall, int]) -> dict[str, Any]:
    call, position = where
    out: dict[str, Any] = {"training": enc.object(call), "position": position}
    out.update(enc_common(node, enc))
    style = getattr(node, "_training_style", None)  # set on the node (None: the data source's)
    if style is not None:
        out["training_style"] = TrainingStyle(style).name
    return out


def _dec_made(f: Fields, kind: type) -> Any:
    call = f.get_object("training", TrainingCall)
    position = f.get_int("position", 0)
    if position >= len(call.made) or type(call.made[position]) is not kind:
        raise fail(
            f"{f.who} field 'position' must name a {kind.__name__} among the "
            f"{len(call.made)} nodes its training graph makes, got {position}"
        )
    if position in call.claimed:
        raise fail(
            f"{f.who} field 'position' must name a node no other object names, got {position}"
        )
    call.claimed.add(position)
    node = call.made[position]
    dec_common(f, node)
    if f.has("training_style"):
        node.training_style = f.get_enum("training_style", TrainingStyle)
    return node


def _enc_gradient(node: GradientFilterNode, enc: Encoder) -> dict[str, Any]:
    where = _analysis(enc).locate(node)
    if where is None:
        raise TypeError(
            f"[save] a gradient node must be one that training_graph() makes again from the "
            f"saved forward nodes (its loss or initial gradient node, or its node and source "
            f"gradient) to be saved, got a {type(node).__name__} that it does not make (made "
            f"some other way, or the forward graph changed after training_graph()) at "
            f"{enc.path()}"
        )
    return _enc_made(node, enc, where)


_forward_addition = forward_encoder(enc_arithmetic)


def _enc_addition(node: AdditionNode, enc: Encoder) -> dict[str, Any]:
    if any(_made_kind(s.producer) for s in node.source_images):  # may sum gradients
        where = _analysis(enc).locate(node)
        if where is not None:
            out = _enc_made(node, enc, where)
            out["properties"] = enc.value(dict(node.properties))
            return out
    return _forward_addition(node, enc)


def _dec_addition(f: Fields) -> AdditionNode:
    if not f.has("training"):
        return dec_arithmetic(f, AdditionNode)
    node = _dec_made(f, AdditionNode)
    set_properties(f, node)
    return node


def gradient_codec(cls: type) -> Codec:
    """The codec of the gradient node class ``cls``: saved as its place in the
    ``training_graph()`` call that makes it (see the module docstring)."""
    return Codec(cls, cls.__name__, _enc_gradient, per_class(_dec_made, cls))


def register_gradient_node(cls: type, *, name: str | None = None) -> None:
    """Register a gradient node class under ``name`` (default: its ``__name__``): saved as its
    place in the ``training_graph()`` call that makes it (see the module docstring). Every
    gradient node class is found by its name without this (`GradientFilterNode` records it);
    register one whose name another class has, under a name of its own."""
    register_codec(cls, _enc_gradient, per_class(_dec_made, cls), name=name)


def _register() -> None:
    register_codec(TrainingCall, _enc_call, _dec_call, name="TrainingGraph")
    register_codec(AdditionNode, _enc_addition, _dec_addition)


_register()
