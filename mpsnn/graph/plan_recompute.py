"""Pass 5 of a graph's plan (`mpsnn.graph.plan.GraphPlan`): results freed after the forward and
computed again just before the backward reads them, so that the backward holds one such image
at a time instead of all of them. Two kinds, each under a graph setting the step reads:

* **normalization results** (`Graph.recompute_normalization_results`, on by default): a
  training-mode batch normalization's result ``y = f(gamma (x - mean)/sqrt(var + eps) +
  beta)`` that a gradient reads again (a convolution's weight gradient reads its source),
  computed from the normalization's input and its batch statistics: one elementwise pass.
* **input convolution results** (`Graph.recompute_input_convolution_results`, off by
  default): the result of a convolution (or fully connected layer) whose source is one of the
  graph's source images, a network's first layer. Its forward readers (a normalization, a
  pooling) read it again at the very end of the backward (their gradients), so it is live for
  the whole backward; its source is the caller's batch, which the layer's weight gradient
  reads last anyway. It is computed again from the same source and weights (they change only
  in the updates, after every gradient) by the same kernel: one more forward of that layer per
  step, whose input usually has a few channels only.

Either way the recomputed image equals the freed one bit for bit (the same kernel on the same
values). When both are on and a recomputed normalization reads a recomputed convolution result
(a first convolution followed by batch normalization), the convolution runs again first, at
the earlier of the two points.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mpsnn.graph.nodes import FilterNode, GradientFilterNode
from mpsnn.graph.plan_passes import Fusion, Liveness, Modes, Topology

__all__ = ["INPUT_CONVOLUTION", "NORMALIZATION", "Recompute", "RecomputePlan", "recompute_pass"]

NORMALIZATION = "normalization"
INPUT_CONVOLUTION = "input convolution"

_EMPTY: Mapping[int, tuple[Any, ...]] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Recompute:
    """A result freed after the forward and computed again before its first gradient reader:
    ``node`` (the filter that makes it), ``ids`` (the image nodes that show the result: its own
    and a fused neuron's), ``key`` (their read-count key), ``reads`` (the gradient readers),
    ``last_forward`` (the id of its last forward reader), ``kind`` (`NORMALIZATION` or
    `INPUT_CONVOLUTION`) and, for an input convolution, ``source`` (the index of the graph
    source it reads; -1 otherwise)."""

    node: FilterNode
    ids: tuple[int, ...]
    key: int
    reads: int
    last_forward: int
    kind: str = NORMALIZATION
    source: int = -1


@dataclass(frozen=True, slots=True)
class RecomputePlan:
    """Where each kind runs: first gradient reader's id -> the results recomputed just before
    it, normalization results (``before``), input convolution results (``inputs``), and both
    kinds when both settings are on (``both``: convolutions first). ``reads`` and
    ``input_reads``: key -> the read count a freed result starts a step with (its forward
    readers)."""

    before: Mapping[int, tuple[Recompute, ...]]
    inputs: Mapping[int, tuple[Recompute, ...]]
    both: Mapping[int, tuple[Recompute, ...]]
    reads: Mapping[int, int]
    input_reads: Mapping[int, int]

    def selected(self, normalization: bool, inputs: bool) -> Mapping[int, tuple[Recompute, ...]]:
        """The recomputations a step runs under the graph's two settings."""
        if normalization:
            return self.both if inputs else self.before
        return self.inputs if inputs else _EMPTY

    def start_reads(self, normalization: bool, inputs: bool) -> dict[int, int]:
        """Key -> read count at the start of a step, for the results it frees."""
        out = dict(self.reads) if normalization else {}
        if inputs:
            out.update(self.input_reads)
        return out

    def source_reads(self, index: int) -> int:
        """The reads of graph source ``index`` the input recomputations add to an encode."""
        return sum(1 for rs in self.inputs.values() for r in rs if r.source == index)


def recompute_pass(
    topology: Topology, modes: Modes, fusion: Fusion, liveness: Liveness
) -> RecomputePlan:
    """The results a step may free and recompute (see the module docstring).

    A normalization result (a node that ``recomputes_result``, in training mode) qualifies when
    every forward reader of it runs before every gradient reader, and the normalization's input
    ``x`` and state (the batch's statistics) are still live at the first gradient reader (the
    normalization gradient reads both later; gamma and beta change only in the updates after
    every gradient); where ``x`` is a recomputed input convolution result freed by then, the
    convolution runs again first (with both settings on). An input
    convolution result (a node that ``recomputes_result_from_source`` whose source is a graph
    source) qualifies under the same reader rule."""
    order, key = topology.order, fusion.key
    index = {n._id: i for i, n in enumerate(order)}
    # the readers of each read-count key, in order: what liveness counted (content reads
    # after fusion, kept images and sources left out), not `_readers`' raw source images
    readers: dict[int, list[FilterNode]] = {}
    for n in order:
        for k in liveness.reads_by[n._id]:
            readers.setdefault(k, []).append(n)

    def split(node: FilterNode) -> tuple[int, list[int], int] | None:
        """(key, forward reader indices, first gradient reader index) of ``node``'s result,
        when it may be freed between the two; else None."""
        k = key(node.result_image._id)
        shown = liveness.alloc_nodes[node.result_image._id]
        if k not in liveness.readers or shown.image_allocator is not None:
            return None  # kept (a result, an export, an allocator of its own) or never read
        forward = [
            index[r._id] for r in readers.get(k, []) if not isinstance(r, GradientFilterNode)
        ]
        backward = [index[r._id] for r in readers.get(k, []) if isinstance(r, GradientFilterNode)]
        if not forward or not backward or max(forward) >= min(backward):
            return None
        return k, forward, min(backward)

    def plan(node: FilterNode, k: int, forward: list[int], first: int, **kw: Any) -> Recompute:
        # every image node that shows it (the filter's, a fused neuron's, an inference
        # dropout's): their step values are the freed image until recomputed
        ids = tuple(n.result_image._id for n in order if key(n.result_image._id) == k)
        backward = sum(1 for r in readers[k] if isinstance(r, GradientFilterNode))
        return Recompute(node, ids, k, backward, order[max(forward)]._id, **kw)

    norm: dict[int, list[Recompute]] = {}
    reads: dict[int, int] = {}
    inputs: dict[int, list[Recompute]] = {}
    input_reads: dict[int, int] = {}
    input_at: dict[int, int] = {}  # input recompute key -> index of its earliest point
    input_plans: dict[int, Recompute] = {}
    input_freed: dict[int, int] = {}  # input recompute key -> index of its last forward reader
    for node in order:
        if node.recomputes_result_from_source:
            src = node.source_images[0]
            found = split(node) if src._id in topology.source_ids else None
            if found is not None:
                k, forward, first = found
                source = topology.sources.index(src)
                r = plan(node, k, forward, first, kind=INPUT_CONVOLUTION, source=source)
                inputs.setdefault(order[first]._id, []).append(r)
                input_reads[k] = len(forward)
                input_at[k] = first
                input_plans[k] = r
                input_freed[k] = max(forward)
            continue
        if not node.recomputes_result or node._id not in modes.training:
            continue
        found = split(node)
        if found is None:
            continue
        k, forward, first = found
        # what the recompute reads must still be live at the first gradient reader
        live, needs = True, []
        for dep in (node.source_images[0]._id, node.result_state._id):  # type: ignore[union-attr]
            d = key(dep)
            if d in topology.source_ids:
                live = False  # a source's read count is the caller's: never read it again
            elif d in reads:
                live = False  # itself freed until recomputed (a normalization of one)
            elif d in liveness.readers and index[liveness.last_reader[d]] < first:
                live = False
            elif d in input_plans and input_freed[d] < first:
                # with both settings on it is freed by then: the convolution runs first (a
                # forward reader after that point keeps the forward image live instead)
                needs.append(d)
        if not live:
            continue
        norm.setdefault(order[first]._id, []).append(plan(node, k, forward, first))
        reads[k] = len(forward)
        for d in needs:  # with both settings on, that convolution runs by this point
            input_at[d] = min(input_at[d], first)
    both: dict[int, list[Recompute]] = {}
    for k, r in input_plans.items():  # convolutions first: a normalization may read one
        both.setdefault(order[input_at[k]]._id, []).append(r)
    for at, rs in norm.items():
        both.setdefault(at, []).extend(rs)
    return RecomputePlan(_tuples(norm), _tuples(inputs), _tuples(both),
                         MappingProxyType(reads), MappingProxyType(input_reads))  # fmt: skip


def _tuples(plans: dict[int, list[Recompute]]) -> Mapping[int, tuple[Recompute, ...]]:
    return MappingProxyType({i: tuple(p) for i, p in plans.items()})
