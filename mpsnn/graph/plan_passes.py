"""The analysis passes of a graph's plan (`mpsnn.graph.plan.GraphPlan`): each a pure function
of the node graph and the earlier passes' records, returning one frozen record.

1. `order_pass`: the filters the results need, producers first; the sources.
2. `modes_pass`: which forward filters run in training mode; what is kept (results, exports,
   result states); which layers are updated on the CPU.
3. `fusion_pass`: neurons that run inside the filter before them, ReLU gradients that run
   inside the convolution gradient after them or inside the sum of gradients before them,
   batch normalizations that run inside the residual sum after them, gradients passed on, and
   the aliases these make (one read-count key for the nodes that show one image).
4. `liveness_pass`: who allocates each image, who reads which key, the last reader of each
   (where it is freed), the sources' read counts.
5. `recompute_pass` (`mpsnn.graph.plan_recompute`): results freed after the forward and
   computed again before the backward.

Fusion is decided from traits the node classes declare (`FilterNode.fuses_neuron` and its
neighbours in `mpsnn.graph.nodes`), not from a list of classes here.

Fusion: a neuron node whose source is made by a node that ``fuses_neuron``, with no other
reader and not exported, runs inside that node's kernel (the convolution's fused neuron,
applied after the bias; batch normalization's, after gamma and beta). Its gradient follows:
after a node that ``records_fused_neuron`` (a convolution), `NeuronGradient` differentiates the
fused neuron from the pre-activation kept in the state (a plain ReLU computed in the graph's
format reads the result instead, `ReLUGradientOfResult`, and nothing is kept), and a plain
ReLU's gradient whose only reader is the layer's gradient runs inside that gradient's command
(`gradient_fuses_relu_gradient`); after a node whose ``gradient_applies_fused_neuron`` (batch
normalization), its gradient kernels apply the neuron's gradient first and the neuron's
gradient node passes its input on. After a node that keeps no record for the neuron
(arithmetic), only a ReLU whose gradient reads its own result fuses; its node then writes its
own forward record (no command) for that gradient. In an inference graph any neuron after
arithmetic fuses. A plain ReLU's gradient that reads its result and whose incoming gradient
is the training graph's sum of two gradients (``sums_gradients_with_relu_gradient``) runs
inside that sum's command.

Fusion is decided when the plan is made, from the node formats set then (a node handler sets
them during ``training_graph``, before any `Graph` is made): a format set on a node later is
not seen by these decisions.

Aliases: a fused neuron's result, an inference dropout's result (``identity_in_inference``)
and a gradient passed on hold the image of another node; they share its read-count key, and
a kept alias (a result, an exported image) makes the producer allocate that image as the kept
node's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mpsnn.core.kernel import TrainingStyle
from mpsnn.graph.nodes import FilterNode, GradientFilterNode, ImageNode, StateNode

__all__ = [
    "Fusion",
    "Liveness",
    "Modes",
    "Topology",
    "fusion_pass",
    "liveness_pass",
    "modes_pass",
    "order_pass",
]

# Whether a plain ReLU's gradient may run inside another node's command (the convolution
# gradient after it, the gradient sum before it: see `fusion_pass`); tests turn it off to
# compare the two plans bit for bit.
FUSE_GRADIENTS = True
# Whether a batch normalization may run inside the residual addition after it
# (`_normalized_sums`); tests turn it off to compare the two plans bit for bit.
FUSE_NORMALIZATIONS = True


def _frozen(d: dict[Any, Any]) -> Mapping[Any, Any]:
    return MappingProxyType(d)


# -- 1. order ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Topology:
    """The filters the results need, producers first (depth first, inputs in order); the
    source images and source states in the order the walk meets them."""

    order: tuple[FilterNode, ...]
    sources: tuple[ImageNode, ...]
    state_sources: tuple[StateNode, ...]
    source_ids: frozenset[int]


def order_pass(results: list[ImageNode]) -> Topology:
    order: list[FilterNode] = []
    sources: list[ImageNode] = []
    state_sources: list[StateNode] = []
    mark: dict[int, int] = {}

    def visit(node: FilterNode, path: list[FilterNode]) -> None:
        if mark.get(node._id) == 2:
            return
        if mark.get(node._id) == 1:
            names = " -> ".join(type(n).__name__ for n in [*path, node])
            raise ValueError(f"[Graph] the node graph must have no cycle, got {names}")
        mark[node._id] = 1
        for inputs, roots in ((node.source_images, sources), (node.source_states, state_sources)):
            for x in inputs:
                if x.producer is not None:
                    visit(x.producer, [*path, node])
                elif all(r is not x for r in roots):
                    roots.append(x)
        mark[node._id] = 2
        order.append(node)

    for r in results:
        if r.producer is None:
            raise ValueError(
                f"[Graph] a result image must be made by a filter node, got a source {r!r}"
            )
        visit(r.producer, [])
    return Topology(tuple(order), tuple(sources), tuple(state_sources),
                    frozenset(s._id for s in sources))  # fmt: skip


# -- 2. modes ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Modes:
    """Attributes:
    training: ids of the forward filters that run in training mode (a gradient node of the
        graph reads their state, a forward node reads a convolution's state, or their state
        is exported).
    exported_states: the result states (MPS ``resultStateHandles``), in order.
    exported: the extra results and the exported images, in ``intermediate_images`` order.
    kept: ids of the image nodes the graph keeps (results and exports): allocated permanent.
    trainable: the trainable gradient nodes, in order (their layers are updated).
    cpu_updates: ids of the forward nodes whose layers are updated on the CPU.
    """

    training: frozenset[int]
    exported_states: tuple[StateNode, ...]
    exported: tuple[ImageNode, ...]
    kept: frozenset[int]
    trainable: tuple[GradientFilterNode, ...]
    cpu_updates: frozenset[int]


def modes_pass(topology: Topology, results: list[ImageNode]) -> Modes:
    order = topology.order
    in_graph = {n._id for n in order}
    training = {
        st.producer._id
        for n in order
        if isinstance(n, GradientFilterNode)
        for st in n.source_states
        if st.producer is not None and st.producer._id in in_graph
    }
    # a convolution whose state a forward node reads (a transpose convolution undoing its
    # size) makes that state in any graph
    training |= {
        st.producer._id
        for n in order
        if not isinstance(n, GradientFilterNode)
        for st in n.source_states
        if st.producer is not None
        and st.producer.makes_state_for_forward_readers
        and st.producer._id in in_graph
    }
    # result states: exported state nodes of forward filters, which then run in training mode
    # to make them; the graph never releases them
    exported_states = tuple(
        n.result_state
        for n in order
        if not isinstance(n, GradientFilterNode)
        and n.result_state is not None
        and n.result_state.export_from_graph
    )
    training |= {st.producer._id for st in exported_states if st.producer is not None}
    exports = [n.result_image for n in order if n.result_image.export_from_graph]
    exported = tuple(results[1:]) + tuple(e for e in exports if all(e is not r for r in results))
    trainable = tuple(
        n for n in order if isinstance(n, GradientFilterNode) and getattr(n, "trainable", False)
    )
    cpu = frozenset(
        n.inference_node._id for n in trainable if n.training_style is TrainingStyle.UPDATE_ON_CPU
    )
    kept = frozenset({r._id for r in results} | {e._id for e in exported})
    return Modes(frozenset(training), exported_states, exported, kept, trainable, cpu)


# -- 3. fusion -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fusion:
    """Attributes:
    fused_into: neuron node id -> the node it runs inside.
    fused: that node's id -> the fused neuron's type name (for reports).
    gradient_fusions: convolution-gradient node id -> the ReLU gradient node it runs inside.
    sum_gradients: gradient-sum node id -> the plain ReLU's gradient node it runs inside.
    normalized_sums: addition node id -> the batch normalization whose normalization runs
        inside its command (`_normalized_sums`); normalized_by: the reverse.
    passed: ids of gradient nodes that pass their incoming gradient on.
    canon: image/state id -> the id whose read-count key it shares (follow with `key`).
    """

    fused_into: Mapping[int, FilterNode]
    fused: Mapping[int, str]
    gradient_fusions: Mapping[int, GradientFilterNode]
    sum_gradients: Mapping[int, GradientFilterNode]
    normalized_sums: Mapping[int, FilterNode]
    normalized_by: Mapping[int, FilterNode]
    passed: frozenset[int]
    canon: Mapping[int, int]

    def key(self, k: int) -> int:
        """The read-count key of image or state id ``k`` (itself, or the node it aliases)."""
        canon = self.canon
        while k in canon:
            k = canon[k]
        return k


def _readers(order: tuple[FilterNode, ...]) -> dict[int, list[FilterNode]]:
    readers: dict[int, list[FilterNode]] = {}
    for n in order:
        for img in n.source_images:
            readers.setdefault(img._id, []).append(n)
    return readers


def _fuses_into(
    node: FilterNode, readers: dict[int, list[FilterNode]], keep: frozenset[int]
) -> FilterNode | None:
    """The node a neuron node fuses into, or None."""
    if node._fusible_neuron() is None:
        return None
    src = node.source_images[0]
    prev = src.producer
    if prev is None or not prev.fuses_neuron or not prev._accepts_fused_neuron():
        return None
    if not prev.records_fused_neuron:
        # nothing keeps the producer's result: only a ReLU whose gradient reads its own
        # result (a plain ReLU in the graph's format) can fuse into it
        for g in readers.get(node.result_image._id, []) + readers.get(src._id, []):
            if isinstance(g, GradientFilterNode) and g.inference_node is node:
                uses_result = getattr(g, "_uses_result", None)
                if uses_result is None or not uses_result():
                    return None
    forward_readers = [r for r in readers.get(src._id, []) if not isinstance(r, GradientFilterNode)]
    gradient_readers = [r for r in readers.get(src._id, []) if isinstance(r, GradientFilterNode)]
    if forward_readers != [node] or src._id in keep or src.image_allocator is not None:
        return None
    # the source's only gradient readers may be the neuron's own gradient node
    if any(g.inference_node is not node for g in gradient_readers):
        return None
    return prev


def _sole_reader(
    img: ImageNode, readers: dict[int, list[FilterNode]], keep: frozenset[int]
) -> FilterNode | None:
    """The one node that reads ``img``, when ``img`` is the graph's own (not kept, no
    allocator of the caller's) and in the graph's format; else None. What a gradient fusion
    needs of an image it stops storing or passes on."""
    rs = readers.get(img._id, [])
    if len(rs) != 1 or img._id in keep or img.format is not None:
        return None
    return rs[0] if img.image_allocator is None else None


def _gradient_fusions(
    order: tuple[FilterNode, ...],
    readers: dict[int, list[FilterNode]],
    keep: frozenset[int],
    fused_into: dict[int, FilterNode],
) -> dict[int, GradientFilterNode]:
    """``{convolution-family gradient node id: ReLU gradient node}`` for each plain ReLU
    (``a = +0.0``) fused into a node whose gradient runs ReLU gradients inside
    (``gradient_fuses_relu_gradient``), whose gradient feeds only that layer's gradient node, as
    its incoming gradient, in the graph's format, neither kept nor given an allocator, and
    whose own incoming gradient is made in the graph in the graph's format (decided when the
    graph is planned: node formats set later are not seen here). That gradient then runs
    inside the layer gradient's command: the same mask product (from the ReLU's result, or
    from the pre-activation the convolution kept) on the block the layer gradient reads, exact
    in any dtype, so no value changes; one encode, one command and one image fewer per layer
    and step. The ReLU's gradient node stays in the graph (a node handler saw it) and passes
    its incoming gradient on; the layer gradient reads the forward result in its place."""
    out: dict[int, GradientFilterNode] = {}
    if not FUSE_GRADIENTS:
        return out
    for n in order:
        if not (isinstance(n, GradientFilterNode) and getattr(n, "_plain_relu", False)):
            continue
        target = fused_into.get(n.inference_node._id)
        res = n.result_image
        g = _sole_reader(res, readers, keep)
        if target is None or not target.gradient_fuses_relu_gradient or g is None:
            continue
        # the incoming gradient in the graph's format too, made by a node of the graph with
        # the graph's allocator: the layer gradient then reads it in the dtype the ReLU's
        # gradient would have written (another format would round, or widen, differently)
        g_in = n.source_images[0]
        if g_in.producer is None or g_in.format is not None or g_in.image_allocator is not None:
            continue
        if (
            isinstance(g, GradientFilterNode)
            and g.inference_node is target
            and g.source_images[0] is res
            and all(s is not res for s in g.source_images[1:])
        ):
            out[g._id] = n
    return out


def _sum_gradients(
    order: tuple[FilterNode, ...],
    readers: dict[int, list[FilterNode]],
    modes: Modes,
    taken: set[int],
) -> dict[int, GradientFilterNode]:
    """``{gradient-sum node id: ReLU gradient node}`` where the automatic training graph's sum
    of two gradients (a plain sum, ``sums_gradients_with_relu_gradient``, in no training mode)
    is the incoming gradient of a plain ReLU's gradient that reads the ReLU's result, and
    nothing else reads that sum: both images in the graph's format, neither kept nor given an
    allocator. In a residual network that is each block input's gradient. The sum's command then
    writes the ReLU's gradient, ``a + b`` where the result is > 0 (one pass instead of two,
    the same bits: the sum rounded to the graph's format, then the mask), and the ReLU's
    gradient node passes its incoming gradient on. ``taken``: ReLU gradient nodes fused
    elsewhere already."""
    out: dict[int, GradientFilterNode] = {}
    if not FUSE_GRADIENTS:
        return out
    keep = modes.kept
    for n in order:
        if not n.sums_gradients_with_relu_gradient or n._id in modes.training:
            continue
        if not n._plain_sum():
            continue
        res = n.result_image
        g = _sole_reader(res, readers, keep)
        uses_result = getattr(g, "_uses_result", None)
        if (
            g is None
            or not isinstance(g, GradientFilterNode)
            or not getattr(g, "_plain_relu", False)
            or uses_result is None
            or not uses_result()
            or g._id in taken
            or g.source_images[0] is not res
            or any(s is res for s in g.source_images[1:])
        ):
            continue
        gres = g.result_image
        if gres._id in keep or gres.format is not None or gres.image_allocator is not None:
            continue
        out[n._id] = g
    return out


def _normalized_sums(
    order: tuple[FilterNode, ...], modes: Modes, fused_into: dict[int, FilterNode]
) -> dict[int, FilterNode]:
    """Additions that run the batch normalization making one of their operands inside their
    own command: ``f(bn(x) + r)`` in one pass (`mpsnn.ops.arithmetic.normalized_add_activation`,
    the same bits), so that ``bn(x)`` is never stored. A residual block's last normalization,
    its shortcut addition and the ReLU after it.

    The addition ``fuses_normalization_of_operand``, is a plain sum (`_plain_sum`) with a
    neuron fused into it, in the graph's format; the operand is the result of a training-mode
    node that ``normalizes_inside_sum`` (its `_plain_normalization`: no padding policy, no
    subclass running it otherwise) with no neuron of its own, in the graph's format, read
    by the addition alone (its gradient reads only its shape), not kept, with no allocator of
    its own; the normalization's input is made by the graph (a source's read count is the
    caller's: its reads are counted per node), in the graph's format and read again after the
    addition (by the normalization's gradient), so it is live when the addition runs."""
    out: dict[int, FilterNode] = {}
    if not FUSE_NORMALIZATIONS:
        return out
    index = {n._id: i for i, n in enumerate(order)}
    content: dict[int, list[FilterNode]] = {}
    for n in order:
        for img in n._content_sources():
            content.setdefault(img._id, []).append(n)
    targets = set(fused_into.values())
    taken: set[int] = set()
    for n in order:
        if not n.fuses_normalization_of_operand or not n._plain_sum() or n not in targets:
            continue
        if n.result_image.format is not None or n.result_image._id in modes.kept:
            continue
        for operand in n.source_images:
            bn = operand.producer
            if (
                bn is None
                or not bn.normalizes_inside_sum
                or not bn._plain_normalization()
                or bn._id not in modes.training
                or bn in targets  # a neuron of its own
                or bn._id in taken
                or operand._id in modes.kept
                or operand.format is not None
                or operand.image_allocator is not None
                or content.get(operand._id) != [n]
                or sum(s is operand for s in n.source_images) != 1
            ):
                continue
            x = bn.source_images[0]
            later = [r for r in content.get(x._id, []) if index[r._id] > index[n._id]]
            if x.producer is None or x.format is not None or not later:
                continue  # a graph source (its read count is the caller's), or not live
            out[n._id] = bn
            taken.add(bn._id)
            break
    return out


def fusion_pass(topology: Topology, modes: Modes) -> Fusion:
    order = topology.order
    keep = modes.kept
    readers = _readers(order)
    fused_into: dict[int, FilterNode] = {}
    fused: dict[int, str] = {}
    for n in order:
        target = _fuses_into(n, readers, keep)
        if target is not None:
            fused_into[n._id] = target
            fused[target._id] = n._fusible_neuron().neuron_type.name
    gradient_fusions = _gradient_fusions(order, readers, keep, fused_into)
    # neuron gradients that pass their incoming gradient on: after a node whose gradient
    # applies the fused neuron's, and those that run inside a layer gradient or a sum
    passed = {n._id for n in gradient_fusions.values()} | {
        n._id
        for n in order
        if isinstance(n, GradientFilterNode)
        and (t := fused_into.get(n.inference_node._id)) is not None
        and t.gradient_applies_fused_neuron
    }
    sum_gradients = _sum_gradients(order, readers, modes, passed)
    passed |= {n._id for n in sum_gradients.values()}
    normalized_sums = _normalized_sums(order, modes, fused_into)
    normalized_by = {bn._id: order_node for order_node in order
                     if (bn := normalized_sums.get(order_node._id)) is not None}  # fmt: skip
    # fused neurons and passed-on gradients hold their input's value: one key for both
    canon: dict[int, int] = {}
    for n in order:
        target = fused_into.get(n._id)
        if target is not None:
            canon[target.result_image._id] = n.result_image._id
            # the gradient reads the target's state (after arithmetic, the neuron's own)
            if (
                target.records_fused_neuron
                and target.result_state is not None
                and n.result_state is not None
            ):
                canon[n.result_state._id] = target.result_state._id
    for n in order:
        if n._id in passed:
            src = n.source_images[0]._id
            canon[n.result_image._id] = canon.get(src, src)
        # an inference dropout is the identity (its result is its source's image): without
        # one key for both, the source was freed at the dropout and its readers read a stale
        # image
        if n.identity_in_inference and n._id not in modes.training:
            canon[n.result_image._id] = n.source_images[0]._id
    return Fusion(_frozen(fused_into), _frozen(fused), _frozen(gradient_fusions),
                  _frozen(sum_gradients), _frozen(normalized_sums), _frozen(normalized_by),
                  frozenset(passed), _frozen(canon))  # fmt: skip


# -- 4. liveness ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Liveness:
    """Attributes:
    alloc_nodes: image node id -> the image node a filter allocates that result as (the kept
        node that shows the image, or one with an allocator of its own, else itself).
    reads_by: filter id -> the keys it reads whose storage the step releases.
    readers: key -> how many filters read it (the read count it starts a step with).
    last_reader: key -> the id of its last reader (where it is freed).
    update_states: keys of the states the layer updates read (released after the updates).
    source_reads: reads per encode of each source image (``read_count_for_source_image``).
    state_source_reads: reads per encode of each source state.
    """

    alloc_nodes: Mapping[int, ImageNode]
    reads_by: Mapping[int, tuple[int, ...]]
    readers: Mapping[int, int]
    last_reader: Mapping[int, int]
    update_states: frozenset[int]
    source_reads: tuple[int, ...]
    state_source_reads: tuple[int, ...]


def liveness_pass(
    topology: Topology, modes: Modes, fusion: Fusion, results: list[ImageNode]
) -> Liveness:
    order, key = topology.order, fusion.key
    shown: dict[int, ImageNode] = {}
    for img in [*results, *modes.exported]:
        shown.setdefault(key(img._id), img)
    for n in order:  # a fused neuron's result with an allocator of its own: that allocator
        if n.result_image.image_allocator is not None:
            shown.setdefault(key(n.result_image._id), n.result_image)
    alloc_nodes = {
        n.result_image._id: shown.get(key(n.result_image._id), n.result_image) for n in order
    }
    keep = {key(k) for k in modes.kept} | {key(st._id) for st in modes.exported_states}
    reads_by: dict[int, list[int]] = {}
    readers: dict[int, int] = {}
    last_reader: dict[int, int] = {}
    update_states: set[int] = set()
    for n in order:
        # liveness follows content reads: a shape-only input does not keep its storage
        content = n._content_sources()
        if n._id in fusion.passed:
            content = content[:1]  # a passed-on gradient: it reads nothing of the forward
        else:  # a ReLU's gradient runs inside (a layer gradient, a sum): it reads the result
            relu = fusion.gradient_fusions.get(n._id) or fusion.sum_gradients.get(n._id)
            if relu is not None:
                content = [*content, relu.inference_node.result_image]
        states = list(n.source_states)
        bn = fusion.normalized_sums.get(n._id)
        if bn is not None:  # it normalizes the input with the statistics itself
            content = [*content, bn.source_images[0]]
            states.append(bn.result_state)
        keys = [s._id for s in content] + [s._id for s in states]
        keys = list(dict.fromkeys(key(k) for k in keys))
        mine = [k for k in keys if k not in keep and k not in topology.source_ids]
        reads_by[n._id] = mine
        for k in mine:
            readers[k] = readers.get(k, 0) + 1
            last_reader[k] = n._id
        if isinstance(n, GradientFilterNode) and getattr(n, "trainable", False):
            update_states.update(key(s._id) for s in n.source_states)
    # states a layer update reads are released after the updates, not by their last node
    frozen_reads = {i: tuple(k for k in ks if k not in update_states) for i, ks in reads_by.items()}
    for k in update_states:
        readers.pop(k, None)
    source_reads = tuple(
        sum(c for n in order for img, c in n._reads() if img is s) for s in topology.sources
    )
    state_source_reads = tuple(
        sum(1 for n in order if any(x is s for x in n.source_states))
        for s in topology.state_sources
    )
    return Liveness(_frozen(alloc_nodes), _frozen(frozen_reads), _frozen(readers),
                    _frozen(last_reader), frozenset(update_states), source_reads,
                    state_source_reads)  # fmt: skip
