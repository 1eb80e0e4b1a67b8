"""`GraphPlan`: what a `Graph` decided about its node graph, once, when it was made.

A frozen record built by separate passes (`mpsnn.graph.plan_passes`: order, modes, fusion,
liveness; `mpsnn.graph.plan_recompute`: recompute) and a last one that binds the kernels
(`kernels_pass`, here). A step (`mpsnn.graph.step._Step`) reads the plan and never changes
it; `Graph.debug_description` prints it. The kernels are the only mutable things the plan
refers to (their properties are the kernels' own), and the graph owns them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mpsnn.cnn.convolution import ConvolutionGradientOption
from mpsnn.core.device import Device
from mpsnn.graph.nodes import FilterNode, GradientFilterNode, ImageNode, StateNode
from mpsnn.graph.plan_passes import (
    Fusion,
    Liveness,
    Modes,
    Topology,
    fusion_pass,
    liveness_pass,
    modes_pass,
    order_pass,
)
from mpsnn.graph.plan_recompute import RecomputePlan, recompute_pass
from mpsnn.graph.step import _NodeAllocator

__all__ = ["GraphPlan", "build_plan"]


@dataclass(frozen=True, slots=True)
class GraphPlan:
    """The plan of a graph (see the module docstring).

    Attributes:
        topology: the filters in order and the sources (`order_pass`).
        modes: training modes, kept images, result states, updates (`modes_pass`).
        fusion: fused neurons and gradients, aliases (`fusion_pass`).
        liveness: allocation nodes, readers and last readers (`liveness_pass`).
        recompute: results freed and recomputed (`recompute_pass`).
        kernels: filter node id -> its kernel (a tuple for two-kernel nodes; `_Fused` or
            `_PassGradient` for a node that runs inside another).
        pre_gradient: layer-gradient node id -> (the ReLU gradient kernel it applies first,
            the image node that kernel reads).
        skips_data_gradient: the first layer's data gradient is not computed (the result is
            not needed).
    """

    topology: Topology
    modes: Modes
    fusion: Fusion
    liveness: Liveness
    recompute: RecomputePlan
    kernels: Mapping[int, Any]
    pre_gradient: Mapping[int, tuple[Any, ImageNode]]
    skips_data_gradient: bool

    @property
    def order(self) -> tuple[FilterNode, ...]:
        """The filters, producers first."""
        return self.topology.order

    @property
    def sources(self) -> tuple[ImageNode, ...]:
        return self.topology.sources

    @property
    def state_sources(self) -> tuple[StateNode, ...]:
        return self.topology.state_sources

    def updates_planned(self) -> list[str]:
        """The forward classes of the layers updated after the gradients, in order."""
        return [type(n.inference_node).__name__ for n in self.modes.trainable]

    def describe(self, normalization: bool, inputs: bool = False) -> list[str]:
        """One line per filter: kernel, what it reads, training mode, fusion, what it frees
        (``normalization``, ``inputs``: the graph's ``recompute_normalization_results`` and
        ``recompute_input_convolution_results``)."""
        liveness = self.liveness
        selected = self.recompute.selected(normalization, inputs)
        freed_until: dict[int, list[Any]] = {}  # last forward reader's id -> results freed
        for plans in selected.values():
            for r in plans:
                freed_until.setdefault(r.last_forward, []).append(r)
        names = {}
        for i, n in enumerate(self.sources):
            names[n._id] = f"in{i}" + (f"({n.handle!r})" if n.handle is not None else "")
        for i, node in enumerate(self.order):
            names[node.result_image._id] = f"t{i}"
        lines = []
        for i, node in enumerate(self.order):
            kernel = self.kernels[node._id]
            kname = (
                "+".join(type(k).__name__ for k in kernel)
                if isinstance(kernel, tuple)
                else type(kernel).__name__
            )
            reads = ", ".join(names.get(s._id, "?") for s in node.source_images)
            extra = []
            if node._id in self.modes.training:
                extra.append("training")
            if node._id in self.fusion.fused:
                extra.append(f"fused {self.fusion.fused[node._id]}")
            if node._id in self.fusion.gradient_fusions or node._id in self.fusion.sum_gradients:
                extra.append("applies the ReLU gradient")
            add = self.fusion.normalized_by.get(node._id)
            if add is not None:
                extra.append(f"normalized inside {names.get(add.result_image._id, '?')}")
            bn = self.fusion.normalized_sums.get(node._id)
            if bn is not None:
                extra.append(f"normalizes {names.get(bn.result_image._id, '?')} inside")
            last = [
                names.get(k, "state")
                for k in liveness.reads_by[node._id]
                if liveness.readers.get(k) and liveness.last_reader.get(k) == node._id
            ]
            if last:
                extra.append("frees " + ", ".join(last))
            first = selected.get(node._id, ())
            extra[:0] = [f"recomputes {names.get(r.key, '?')} first" for r in first]
            for r in freed_until.get(node._id, ()):
                extra.append(f"frees {names.get(r.key, '?')} until recomputed")
            label = f" {node.label!r}" if node.label else ""
            lines.append(
                f"  {i:3d} {type(node).__name__}{label} [{kname}] ({reads}) -> t{i}"
                + (f"  ({'; '.join(extra)})" if extra else "")
            )
        return lines


def build_plan(graph: Any, results: list[ImageNode], needed: list[bool]) -> GraphPlan:
    """Run the passes in order and bind the kernels (``graph``: the allocators' owner)."""
    topology = order_pass(results)
    modes = modes_pass(topology, results)
    fusion = fusion_pass(topology, modes)
    liveness = liveness_pass(topology, modes, fusion, results)
    recompute = recompute_pass(topology, modes, fusion, liveness)
    kernels, pre_gradient, skips = kernels_pass(graph, topology, fusion, liveness, results, needed)
    return GraphPlan(topology, modes, fusion, liveness, recompute, kernels, pre_gradient, skips)


# -- 6. kernels ----------------------------------------------------------------------------


class _Fused:
    """The kernel slot of a neuron node fused into ``target``: its result is the target's.
    ``neuron``: after a node that keeps no record for it (arithmetic), the neuron's own
    kernel, which writes the neuron's forward record into its state (no command) for the
    ReLU's gradient."""

    def __init__(self, target: FilterNode, neuron: Any = None) -> None:
        self.target = target
        self.neuron = neuron


class _PassGradient:
    """The kernel slot of a neuron gradient that runs inside another node's command (batch
    normalization's gradient kernels, a convolution gradient's command, or the sum of the
    gradients it differentiates): this node passes its incoming gradient on."""


def kernels_pass(
    graph: Any,
    topology: Topology,
    fusion: Fusion,
    liveness: Liveness,
    results: list[ImageNode],
    needed: list[bool],
) -> tuple[Mapping[int, Any], Mapping[int, tuple[Any, ImageNode]], bool]:
    """One kernel per filter node, fused where the fusion pass said, with the graph's
    allocator on the kernel that makes each node's result (``graph``: their owner, and the
    device the kernels are made for)."""
    device: Device = graph.device
    order = topology.order
    fused_into = fusion.fused_into
    neuron_of = {t._id: n._fusible_neuron() for n in order if (t := fused_into.get(n._id))}
    kernels: dict[int, Any] = {}
    for n in order:
        target = fused_into.get(n._id)
        if target is not None:
            # after a node that keeps no record for it, the neuron's kernel writes its record
            own = None if target.records_fused_neuron else n._make_kernel(device)
            kernels[n._id] = _Fused(target, own)
            continue
        fwd = n.inference_node if isinstance(n, GradientFilterNode) else None
        if n._id in neuron_of:  # a node with a neuron fused into it
            kernel = n._make_fused_kernel(device, neuron_of[n._id])
        elif fwd is not None and fwd._id in neuron_of and fwd.gradient_applies_fused_neuron:
            kernel = fwd._make_fused_gradient_kernel(n, device, neuron_of[fwd._id])
        else:
            kernel = n._make_kernel(device)
        kernels[n._id] = kernel
        last = kernel[-1] if isinstance(kernel, tuple) else kernel
        if hasattr(last, "destination_image_allocator"):
            alloc = liveness.alloc_nodes[n.result_image._id]
            last.destination_image_allocator = _NodeAllocator(graph, alloc)
    # the neuron gradient after a node whose gradient applies it passes its gradient on; after
    # a fused convolution, one that reads the result lets the convolution drop its
    # pre-activation
    for n in order:
        if not isinstance(n, GradientFilterNode):
            continue
        target = fused_into.get(n.inference_node._id)
        if target is None:
            continue
        if target.gradient_applies_fused_neuron:
            kernels[n._id] = _PassGradient()
        elif getattr(n, "_uses_result", lambda: False)():
            kernels[target._id]._keep_preactivation = False
    for n in fusion.sum_gradients.values():  # applied by the sum before it
        kernels[n._id] = _PassGradient()
    pre_gradient = {}
    for g_id, n in fusion.gradient_fusions.items():
        pre_gradient[g_id] = (kernels[n._id], n.inference_node.result_image)
        kernels[n._id] = _PassGradient()
    # a result that is not needed: the first layer's data gradient is skipped
    skips = False
    if not needed[0]:
        producer = results[0].producer
        k = kernels.get(producer._id) if producer is not None else None
        if hasattr(k, "gradient_option"):
            k.gradient_option = ConvolutionGradientOption.GRADIENT_WITH_WEIGHTS_AND_BIAS
            skips = True
    return MappingProxyType(kernels), MappingProxyType(pre_gradient), skips
