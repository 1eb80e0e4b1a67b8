"""Planning a `Graph`: the filters its results need, in order; its sources; which forward
filters train; who reads what (for releases); the kernels and their allocators; fusion.

Fusion: a neuron node whose source is made by a convolution-family or batch-normalization
node, with no other reader and not exported, runs inside that node's kernel (the convolution's
fused neuron, applied after the bias; batch normalization's, after gamma and beta). Its
gradient follows: after a convolution, `NeuronGradient` differentiates the fused neuron from
the pre-activation the convolution keeps in its state (a plain ReLU computed in the graph's
format reads the convolution's result instead, `ReLUGradientOfResult`, and nothing is kept),
and a plain ReLU's gradient whose only reader is the layer's gradient runs inside that
gradient's command (`_plan_gradient_fusion`); after batch normalization, the
batch-normalization gradient kernels apply the neuron's gradient first and the neuron's
gradient node passes its input on. A ReLU after an arithmetic node fuses into it only when
its gradient reads its own result (nothing keeps the arithmetic's result); its node then
writes its own forward record (no command) for that gradient. In an inference graph any
neuron after arithmetic fuses.

Recomputation: see `_plan_recompute`.

Aliases: a fused neuron's result, an inference dropout's result (the identity) and a gradient
passed on hold the image of another node; they share its read-count key, and a kept alias
(a result, an exported image) makes the producer allocate that image as the kept node's.
"""

from __future__ import annotations

from typing import Any

from mpsnn.cnn.neuron import ReLUGradientOfResult
from mpsnn.cnn.neuron_descriptor import FusedNeuron, NeuronType
from mpsnn.core.kernel import TrainingStyle
from mpsnn.graph.nodes import FilterNode, GradientFilterNode, ImageNode, StateNode
from mpsnn.graph.step import _NodeAllocator

__all__ = ["plan_graph"]


def _order(results: list[ImageNode]) -> tuple[list[FilterNode], list[ImageNode], list[StateNode]]:
    """Filters producers-first (depth first, inputs in order), the source images and the
    source states in the order the walk meets them."""
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
        for img in node.source_images:
            if img.producer is None:
                if all(s is not img for s in sources):
                    sources.append(img)
            else:
                visit(img.producer, [*path, node])
        for st in node.source_states:
            if st.producer is None:
                if all(s is not st for s in state_sources):
                    state_sources.append(st)
            else:
                visit(st.producer, [*path, node])
        mark[node._id] = 2
        order.append(node)

    for r in results:
        if r.producer is None:
            raise ValueError(
                f"[Graph] a result image must be made by a filter node, got a source {r!r}"
            )
        visit(r.producer, [])
    return order, sources, state_sources


def _fusible(node: FilterNode, readers: dict[int, list[FilterNode]], keep: set[int]) -> Any:
    """The node a neuron node fuses into, or None."""
    from mpsnn.graph.forward_nodes import ConvolutionNode, _ArithmeticNode
    from mpsnn.graph.gradient_nodes import _NeuronGradientNode
    from mpsnn.graph.neuron_nodes import NeuronNode
    from mpsnn.graph.normalization_nodes import BatchNormalizationNode

    if not isinstance(node, NeuronNode) or node.descriptor.neuron_type is NeuronType.PRELU:
        return None
    src = node.source_images[0]
    prev = src.producer
    if not isinstance(prev, ConvolutionNode | BatchNormalizationNode | _ArithmeticNode):
        return None
    if isinstance(prev, _ArithmeticNode):
        # nothing keeps the arithmetic's result: only a ReLU whose gradient reads its own
        # result (a plain ReLU in the graph's format) can fuse into it
        for g in readers.get(node.result_image._id, []) + readers.get(src._id, []):
            if (
                isinstance(g, GradientFilterNode)
                and g.inference_node is node
                and not (isinstance(g, _NeuronGradientNode) and g._uses_result())
            ):
                return None
    if isinstance(prev, ConvolutionNode):
        desc = prev.data_source.descriptor()
        if getattr(desc, "fused_neuron_descriptor", None) is not None:
            return None  # the data source fuses a neuron already
    forward_readers = [r for r in readers.get(src._id, []) if not isinstance(r, GradientFilterNode)]
    gradient_readers = [r for r in readers.get(src._id, []) if isinstance(r, GradientFilterNode)]
    if forward_readers != [node] or src._id in keep or src.image_allocator is not None:
        return None
    # the source's only gradient readers may be the neuron's own gradient node
    if any(g.inference_node is not node for g in gradient_readers):
        return None
    return prev


# Whether a plain ReLU's gradient may fuse into the convolution gradient after it (see
# `_plan_gradient_fusion`); tests turn it off to compare the two plans bit for bit.
FUSE_GRADIENTS = True


def _plan_gradient_fusion(
    order: list[FilterNode], readers: dict[int, list[FilterNode]], keep: set[int], fused_into: dict
) -> dict[int, Any]:
    """``{convolution-family gradient node id: ReLU gradient node}`` for each plain ReLU
    (``a = +0.0``) fused into a convolution-family node whose gradient feeds only that layer's
    gradient node, as its incoming gradient, in the graph's format, neither kept nor given an
    allocator, and whose own incoming gradient is made in the graph in the graph's format
    (decided when the graph is planned, like the rest of the plan: node formats set later
    are not seen here). That gradient then runs inside the convolution gradient's command:
    the same mask product (from the ReLU's result, or from the pre-activation the convolution
    kept) on the block the convolution gradient reads, exact in any dtype, so no value
    changes; one encode, one command and one image fewer per layer and step. The ReLU's
    gradient node stays in the graph (a node handler saw it) and passes its incoming gradient
    on; the convolution gradient reads the forward result in its place, until it ran."""
    from mpsnn.graph.forward_nodes import ConvolutionNode
    from mpsnn.graph.gradient_nodes import _ConvolutionGradientNode, _NeuronGradientNode

    out: dict[int, Any] = {}
    if not FUSE_GRADIENTS:
        return out
    for n in order:
        if not (isinstance(n, _NeuronGradientNode) and n._plain_relu):
            continue
        target = fused_into.get(n._forward._id)
        res = n.result_image
        rs = readers.get(res._id, [])
        if (
            not isinstance(target, ConvolutionNode)
            or len(rs) != 1
            or res._id in keep
            or res.format is not None
            or res.image_allocator is not None
        ):
            continue
        # the incoming gradient in the graph's format too, made by a node of the graph with
        # the graph's allocator: the layer gradient then reads it in the dtype the ReLU's
        # gradient would have written (another format would round, or widen, differently)
        g_in = n.source_images[0]
        if g_in.producer is None or g_in.format is not None or g_in.image_allocator is not None:
            continue
        g = rs[0]
        if (
            isinstance(g, _ConvolutionGradientNode)
            and g._forward is target
            and g.source_images[0] is res
            and all(s is not res for s in g.source_images[1:])
        ):
            out[g._id] = n
    return out


def plan_graph(graph: Any) -> None:
    """Set the graph's plan attributes (see the module docstring)."""
    from mpsnn.graph.forward_nodes import ConvolutionNode, DropoutNode

    order, sources, state_sources = _order(graph._results)
    graph._order, graph._sources, graph._state_sources = order, sources, state_sources
    graph._source_ids = {s._id for s in sources}
    in_graph = {n._id for n in order}
    graph._training = {
        st.producer._id
        for n in order
        if isinstance(n, GradientFilterNode)
        for st in n.source_states
        if st.producer is not None and st.producer._id in in_graph
    }
    # a convolution whose state a forward node reads (a transpose convolution undoing its
    # size) makes that state in any graph; for a convolution that changes nothing else
    graph._training |= {
        st.producer._id
        for n in order
        if not isinstance(n, GradientFilterNode)
        for st in n.source_states
        if isinstance(st.producer, ConvolutionNode) and st.producer._id in in_graph
    }
    # result states (MPS ``resultStateHandles``): exported state nodes of forward filters,
    # which then run in training mode to make them; the graph never releases them
    graph._exported_states = [
        n.result_state
        for n in order
        if not isinstance(n, GradientFilterNode)
        and n.result_state is not None
        and n.result_state.export_from_graph
    ]
    graph._training |= {st.producer._id for st in graph._exported_states}
    exported = [n.result_image for n in order if n.result_image.export_from_graph]
    graph._exported = [r for r in graph._results[1:]] + [
        e for e in exported if all(e is not r for r in graph._results)
    ]
    keep = {r._id for r in graph._results} | {e._id for e in graph._exported}
    graph._permanent = set(keep)  # image ids the allocator makes permanent (never aliased)
    # who reads what: release an image or state after its last reader (never a kept one)
    readers: dict[int, list[FilterNode]] = {}
    for n in order:
        for img in n.source_images:
            readers.setdefault(img._id, []).append(n)
    fused: dict[int, str] = {}
    graph._fused_into = {}
    for n in order:
        target = _fusible(n, readers, keep)
        if target is not None:
            graph._fused_into[n._id] = target
            fused[target._id] = n.descriptor.neuron_type.name
    graph._fused = fused
    # a plain ReLU's gradient fused into the convolution gradient after it: G id -> ReLU's
    fused_grads = _plan_gradient_fusion(order, readers, keep, graph._fused_into)
    # neuron gradients that pass their incoming gradient on: after a fused batch normalization
    # (its gradient kernels apply the neuron's gradient) and those `fused_grads` ran inside
    passed = {n._id for n in fused_grads.values()} | {
        n._id
        for n in order
        if (fwd := getattr(n, "inference_node", None)) is not None
        and isinstance(graph._fused_into.get(fwd._id), _bn_node())
    }
    # fused neurons and passed-on gradients hold their input's value: one key for both
    canon: dict[int, int] = {}
    for n in order:
        target = graph._fused_into.get(n._id)
        if target is not None:
            canon[target.result_image._id] = n.result_image._id
            # the gradient reads the target's state (after arithmetic, the neuron's own)
            kinds = _record_kinds()
            if (
                isinstance(target, kinds)
                and target.result_state is not None
                and (n.result_state is not None)
            ):
                canon[n.result_state._id] = target.result_state._id
    for n in order:
        if n._id in passed:
            src = n.source_images[0]._id
            canon[n.result_image._id] = canon.get(src, src)
        # an inference dropout is the identity (its result is its source's image): without
        # one key for both, the source was freed at the dropout and its readers read a stale
        # image
        if isinstance(n, DropoutNode) and n._id not in graph._training:
            canon[n.result_image._id] = n.source_images[0]._id

    def key(k: int) -> int:
        while k in canon:
            k = canon[k]
        return k

    # the image node a filter allocates its result for: the kept node that shows that image
    # (a fused neuron's or an inference dropout's result, which must be permanent and take the
    # result's allocator and format), or the one with an allocator of its own, else its own
    # result
    shown: dict[int, ImageNode] = {}
    for img in [*graph._results, *graph._exported]:
        shown.setdefault(key(img._id), img)
    for n in order:  # a fused neuron's result with an allocator of its own: that allocator
        if n.result_image.image_allocator is not None:
            shown.setdefault(key(n.result_image._id), n.result_image)
    graph._alloc_nodes = {
        n.result_image._id: shown.get(key(n.result_image._id), n.result_image) for n in order
    }
    keep = {key(k) for k in keep} | {key(st._id) for st in graph._exported_states}
    graph._reads_by = {}
    graph._readers = {}
    graph._last_reader = {}
    trainable_states = set()
    for n in order:
        # liveness follows content reads: a shape-only input does not keep its storage
        content = n._content_sources()
        if n._id in passed:
            content = content[:1]  # a passed-on gradient: it reads nothing of the forward
        elif n._id in fused_grads:  # a ReLU's gradient runs inside: it reads the ReLU result
            content = [*content, fused_grads[n._id]._forward.result_image]
        keys = [s._id for s in content] + [s._id for s in n.source_states]
        keys = list(dict.fromkeys(key(k) for k in keys))
        graph._reads_by[n._id] = [k for k in keys if k not in keep and k not in graph._source_ids]
        for k in graph._reads_by[n._id]:
            graph._readers[k] = graph._readers.get(k, 0) + 1
            graph._last_reader[k] = n._id
        if isinstance(n, GradientFilterNode) and getattr(n, "trainable", False):
            trainable_states.update(key(s._id) for s in n.source_states)
    # states a layer update reads are released after the updates, not by their last node
    for n_id, keys in graph._reads_by.items():
        graph._reads_by[n_id] = [k for k in keys if k not in trainable_states]
    for k in trainable_states:
        graph._readers.pop(k, None)
    graph._update_states = trainable_states
    graph._source_reads = [
        sum(c for n in order for img, c in n._reads() if img is s) for s in sources
    ]
    graph._state_source_reads = [
        sum(1 for n in order if any(x is s for x in n.source_states)) for s in state_sources
    ]
    # kernels: one per filter node, with the graph's allocator on the one that makes the result
    graph._kernels = {}
    for n in order:
        if n._id in graph._fused_into:
            target = graph._fused_into[n._id]
            # after arithmetic, the neuron's kernel writes its record for the gradient
            own = n._make_kernel(graph._device) if not isinstance(target, _record_kinds()) else None
            graph._kernels[n._id] = _Fused(target, own)
            continue
        fwd = getattr(n, "inference_node", None)
        if n._id in fused:  # a convolution, batch normalization or arithmetic node
            neuron = _neuron_of(order, graph._fused_into, n)
            kernel = _make_fused(n, neuron, graph._device)
        elif isinstance(fwd, _bn_node()) and fwd._id in fused:  # its gradient fuses it too
            neuron = _neuron_of(order, graph._fused_into, fwd)
            saved, fwd._neuron = fwd._neuron, neuron
            try:
                kernel = n._make_kernel(graph._device)
            finally:
                fwd._neuron = saved
        else:
            kernel = n._make_kernel(graph._device)
        graph._kernels[n._id] = kernel
        last = kernel[-1] if isinstance(kernel, tuple) else kernel
        if hasattr(last, "destination_image_allocator"):
            last.destination_image_allocator = _NodeAllocator(
                graph, graph._alloc_nodes[n.result_image._id]
            )
    # the neuron gradient after a fused batch normalization passes its gradient on; after a
    # fused convolution, one that reads the result lets the convolution drop its pre-activation
    graph._pre_gradient = {}  # G id -> (the ReLU's gradient kernel, the image it reads)
    for n in order:
        fwd = getattr(n, "inference_node", None)
        if fwd is not None and fwd._id in graph._fused_into:
            target = graph._fused_into[fwd._id]
            if isinstance(target, _bn_node()):
                graph._kernels[n._id] = _PassGradient()
            elif isinstance(graph._kernels[n._id], ReLUGradientOfResult):
                graph._kernels[target._id]._keep_preactivation = False
    for g_id, n in fused_grads.items():
        graph._pre_gradient[g_id] = (graph._kernels[n._id], n._forward.result_image)
        graph._kernels[n._id] = _PassGradient()
    # a result that is not needed: the first layer's data gradient is skipped
    if not graph._needed[0]:
        producer = graph._results[0].producer
        k = graph._kernels.get(producer._id)
        if hasattr(k, "gradient_option"):
            from mpsnn.cnn.convolution import ConvolutionGradientOption

            k.gradient_option = ConvolutionGradientOption.GRADIENT_WITH_WEIGHTS_AND_BIAS
    graph._updates_planned = [
        type(n.inference_node).__name__
        for n in order
        if isinstance(n, GradientFilterNode) and getattr(n, "trainable", False)
    ]
    graph._cpu_updates = {
        n.inference_node._id
        for n in order
        if isinstance(n, GradientFilterNode)
        and getattr(n, "trainable", False)
        and n.training_style is TrainingStyle.UPDATE_ON_CPU
    }
    graph._recompute, graph._recompute_reads = _plan_recompute(graph, order, key)


def _plan_recompute(
    graph: Any, order: list[FilterNode], key: Any
) -> tuple[dict[int, list[_Recompute]], dict[int, int]]:
    """The training-mode batch-normalization results the step frees after the forward and
    recomputes before the backward reads them (see `Graph.recompute_normalization_results`).

    A result ``y = f(gamma (x - mean)/sqrt(var + eps) + beta)`` qualifies when every forward
    reader of it runs before every gradient reader (a convolution's weight gradient reads its
    source), and the normalization's input ``x`` and state (the batch's statistics) are still
    live at the first gradient reader: the batch-normalization gradient reads both later, and
    gamma and beta change only in the updates after every gradient. Recomputing runs the same
    kernel on the same values, so the recomputed image equals the freed one bit for bit.

    Returns ``{first gradient reader's id: [_Recompute, ...]}`` and ``{key: forward reads}``
    (the read count the key starts with: it is freed after its last forward reader).
    """
    bn = _bn_node()
    index = {n._id: i for i, n in enumerate(order)}
    readers: dict[int, list[FilterNode]] = {}
    for n in order:
        for k in graph._reads_by[n._id]:
            readers.setdefault(k, []).append(n)
    plans: dict[int, list[_Recompute]] = {}
    reads: dict[int, int] = {}
    for node in order:
        if not isinstance(node, bn) or node._id not in graph._training:
            continue
        k = key(node.result_image._id)
        shown = graph._alloc_nodes[node.result_image._id]
        if k not in graph._readers or shown.image_allocator is not None:
            continue  # kept (a result, an export, an allocator of its own) or never read
        forward = [
            index[r._id] for r in readers.get(k, []) if not isinstance(r, GradientFilterNode)
        ]
        backward = [r for r in readers.get(k, []) if isinstance(r, GradientFilterNode)]
        if not forward or not backward:
            continue
        first = min(index[r._id] for r in backward)
        if max(forward) >= first:
            continue
        # what the recompute reads must still be live at the first gradient reader
        live = True
        for dep in (node.source_images[0]._id, node.result_state._id):
            d = key(dep)
            if d in graph._source_ids:
                live = False  # a source's read count is the caller's: never read it again
            elif d in reads:
                live = False  # itself freed until recomputed (a normalization of one)
            elif d in graph._readers and index[graph._last_reader[d]] < first:
                live = False
        if not live:
            continue
        # every image node that shows it (the normalization's, a fused neuron's, an inference
        # dropout's): their step values are the freed image until recomputed
        ids = tuple(n.result_image._id for n in order if key(n.result_image._id) == k)
        last = order[max(forward)]._id
        plans.setdefault(order[first]._id, []).append(_Recompute(node, ids, k, len(backward), last))
        reads[k] = len(forward)
    return plans, reads


class _Recompute:
    """A normalization result freed after the forward and computed again before its first
    gradient reader: ``node`` (the batch normalization), ``ids`` (the image nodes that show
    the result: its own and a fused neuron's), ``key`` (their read-count key) and ``reads``
    (the gradient readers) and ``last_forward`` (the id of its last forward reader)."""

    __slots__ = ("ids", "key", "last_forward", "node", "reads")

    def __init__(
        self, node: FilterNode, ids: tuple[int, ...], key: int, reads: int, last_forward: int
    ) -> None:
        self.node, self.ids, self.key, self.reads = node, ids, key, reads
        self.last_forward = last_forward


def _bn_node() -> type:
    from mpsnn.graph.normalization_nodes import BatchNormalizationNode

    return BatchNormalizationNode


def _neuron_of(order: list[FilterNode], fused_into: dict[int, Any], target: FilterNode) -> Any:
    for n in order:
        if fused_into.get(n._id) is target:
            return n.descriptor
    raise AssertionError("a fused target has its neuron")  # pragma: no cover


def _make_fused(node: Any, neuron: Any, device: Any) -> Any:
    """The node's kernel with ``neuron`` fused (a convolution after its bias, batch
    normalization after gamma and beta)."""
    from mpsnn.graph.normalization_nodes import BatchNormalizationNode

    if isinstance(node, BatchNormalizationNode):
        node_neuron, node._neuron = node._neuron, neuron
        try:
            return node._make_kernel(device)
        finally:
            node._neuron = node_neuron
    kernel = node._make_kernel(device)
    kernel._neuron = FusedNeuron.of(type(kernel).__name__, neuron)
    if hasattr(kernel, "_descriptor"):  # a convolution reports it (arithmetic has none)
        kernel._descriptor.fused_neuron_descriptor = neuron
    return kernel


def _record_kinds() -> tuple[type, ...]:
    """The nodes whose state records a neuron fused into them (its gradient reads theirs)."""
    from mpsnn.graph.forward_nodes import ConvolutionNode

    return (ConvolutionNode, _bn_node())


class _Fused:
    """The kernel slot of a neuron node fused into ``target``: its result is the target's.
    ``neuron``: after arithmetic, the neuron's own kernel, which writes the neuron's forward
    record into its state (no command) for the ReLU's gradient."""

    def __init__(self, target: FilterNode, neuron: Any = None) -> None:
        self.target = target
        self.neuron = neuron


class _PassGradient:
    """The kernel slot of a neuron gradient whose neuron batch normalization fused: the
    batch-normalization gradient applies the neuron's gradient, so this node passes its
    incoming gradient on."""
