"""Graph nodes (MPS ``MPSNNImageNode``, ``MPSNNStateNode``, ``MPSNNLabelsNode``,
``MPSNNFilterNode``, ``MPSNNGradientFilterNode``).

A node graph is a recipe: image nodes are edges, filter nodes are kernels-to-be. It holds no
tensors and no device: a `Graph` binds it to a device (making one kernel per filter node) and
encodes it. One recipe can serve several graphs (a training graph and an inference graph that
share data sources).

Every filter node knows three things the graph needs:

* ``_make_kernel(device)``: the kernel(s) it encodes with;
* ``_reads()``: how many reads each input image takes per encode (what the graph sets as the
  read counts of temporary images);
* ``_content_sources()``: the inputs whose *contents* it reads (default: all). An input read
  for its shape only (an add's gradient needs the input's size, not its values) does not keep
  that image's storage alive: the graph frees it after its last content reader;
* ``_run(step, kernel)``: the encode, reading its inputs from and writing its results to the
  ``step`` (one `encode_batch` of a graph).

and, for the automatic training graph, ``gradient_filters(sources)``: the gradient node(s) that
differentiate it, found in the node-level forward → gradient table (`register_gradient_nodes`).
A gradient node of a one-input forward node declares its place in that table where it is
written: ``class PoolingMaxGradientNode(UnaryGradientNode, gradient_of=PoolingMaxNode)``.

This module holds the bases the families build on: `UnaryNode` (one source),
`_TrainableNode` (one source and a data source the step updates), `UnaryGradientNode`. The
families themselves are in `mpsnn.nodes`, one module each; this module imports none of them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from mpsnn.cnn.neuron_descriptor import FusedNeuron
from mpsnn.core.descriptor import FeatureChannelFormat
from mpsnn.core.kernel import Kernel, TrainingStyle
from mpsnn.core.saved import (
    Field,
    declare_saved_fields,
    record_saved_class,
    same_definition,
)

if TYPE_CHECKING:
    from mpsnn.core.device import Device
    from mpsnn.graph.step import _Step

__all__ = [
    "COMMON_SAVED",
    "FilterNode",
    "GradientFilterNode",
    "ImageNode",
    "LabelsNode",
    "NodeHandler",
    "StateNode",
    "UnaryGradientNode",
    "UnaryNode",
    "register_gradient_nodes",
    "register_gradient_sum",
    "unary_gradient_nodes",
]

_ids = itertools.count()

#: what every saved filter node has (`mpsnn.io` writes it): no declared field takes these names
COMMON_SAVED = ("source", "trainable", "label", "padding_policy", "result_image", "result_state")

#: forward node class -> ``factory(forward_node, incoming_gradients) -> gradient nodes``.
_GRADIENT_FACTORIES: dict[type, Callable[[Any, list[Any]], list[Any]]] = {}
#: the automatic training graph (`mpsnn.graph.training` installs it when it is imported).
_TRAINING_GRAPH: list[Callable[..., list[Any]]] = []
#: the node class that sums two gradients of one image (the arithmetic family's `AdditionNode`,
#: registered by `mpsnn.nodes.arithmetic`), made by the automatic training graph.
_GRADIENT_SUM: list[type] = []


def register_gradient_nodes(
    forward_class: type, factory: Callable[[Any, list[Any]], list[Any]]
) -> None:
    """Make ``factory(forward_node, incoming_gradients)`` the gradient nodes of
    ``forward_class`` (and of its subclasses without their own entry)."""
    _GRADIENT_FACTORIES[forward_class] = factory


def register_gradient_sum(node_class: type) -> None:
    """Make ``node_class(left, right)`` the node the automatic training graph sums the
    gradients of an image read by several filters with."""
    _GRADIENT_SUM[:] = [node_class]


#: ``node_handler(gradient_node, inference_node, inference_source, gradient_source)``.
NodeHandler = Callable[[Any, Any, Any, Any], None]


class ImageNode:
    """An image flowing between filters (MPS ``MPSNNImageNode``).

    Args:
        handle: any object naming the image (a graph's ``source_image_handles`` lists the
            handles of its inputs in ``encode`` order).

    Attributes:
        format: the image's storage (a `FeatureChannelFormat`; None: the graph's ``format``).
        export_from_graph: keep the image and return it in ``intermediate_images``.
        stop_gradient: the automatic training graph does not propagate past this image.
        image_allocator: how the graph allocates it (None: a temporary image for intermediates,
            a permanent one for results and exported images).
    """

    def __init__(self, handle: Any = None) -> None:
        self.handle = handle
        self.format: FeatureChannelFormat | None = None
        self.export_from_graph = False
        self.stop_gradient = False
        self.image_allocator: Any = None
        self._producer: FilterNode | None = None
        self._id = next(_ids)

    @classmethod
    def exported(cls, handle: Any = None) -> ImageNode:
        """An image node kept by the graph (MPS ``exportedNodeWithHandle:``)."""
        node = cls(handle)
        node.export_from_graph = True
        return node

    @property
    def producer(self) -> FilterNode | None:
        """The filter that makes this image (None: a graph input)."""
        return self._producer

    def __repr__(self) -> str:
        name = f" {self.handle!r}" if self.handle is not None else ""
        made = f" from {type(self._producer).__name__}" if self._producer else " (source)"
        return f"<ImageNode{name}{made}>"


class StateNode:
    """A state flowing from a forward filter to its gradient (MPS ``MPSNNStateNode``); made
    by filter nodes (``result_state``), never by hand."""

    def __init__(self, producer: FilterNode | None, handle: Any = None) -> None:
        self.handle = handle
        self.export_from_graph = False
        self._producer = producer
        self._id = next(_ids)

    @property
    def producer(self) -> FilterNode | None:
        return self._producer

    def __repr__(self) -> str:
        return f"<{type(self).__name__} of {type(self._producer).__name__}>"


class LabelsNode(StateNode):
    """The labels of a loss node (MPS ``MPSNNLabelsNode``): a graph source state; one
    `LossLabels` per image (or one for the batch) in ``encode_batch``'s ``source_states``."""

    def __init__(self, handle: Any = None) -> None:
        super().__init__(None, handle)


class FilterNode:
    """Base of the filter nodes (MPS ``MPSNNFilterNode``).

    Attributes:
        result_image: the `ImageNode` it makes.
        result_state: the `StateNode` its gradient reads (None for filters without one).
        padding_policy: the kernel's padding policy (None: the kernel's default).
        label: a name (used in ``debug_description``).
    """

    _has_state = True  # filters whose gradient reads a state

    # -- traits the graph's plan reads (`mpsnn.graph.plan_passes`) -------------------------
    #: a neuron node that alone reads this node's result may run inside its kernel
    fuses_neuron: ClassVar[bool] = False
    #: this node's state keeps the fused neuron's forward record, which the neuron's gradient
    #: reads; otherwise only a neuron whose gradient reads its own result may fuse, and its
    #: own kernel writes its record (no command)
    records_fused_neuron: ClassVar[bool] = False
    #: this node's gradient kernels apply a fused neuron's gradient (the neuron's gradient
    #: node passes its incoming gradient on)
    gradient_applies_fused_neuron: ClassVar[bool] = False
    #: this node's gradient can run a fused plain ReLU's gradient inside its own command
    gradient_fuses_relu_gradient: ClassVar[bool] = False
    #: a forward node reading this node's state makes it run in training mode in any graph
    makes_state_for_forward_readers: ClassVar[bool] = False
    #: without a gradient reader the node is the identity (its result is its source's image)
    identity_in_inference: ClassVar[bool] = False
    #: its training-mode result may be freed after the forward and computed again before
    #: the backward (`Graph.recompute_normalization_results`)
    recomputes_result: ClassVar[bool] = False
    #: its training-mode result, read by a plain sum alone, may be computed inside that sum's
    #: command (batch normalization; `mpsnn.graph.plan_passes._normalized_sums`)
    normalizes_inside_sum: ClassVar[bool] = False
    #: as a plain sum with a neuron fused into it, it may run the normalization that makes one
    #: of its operands inside its own command (the addition)
    fuses_normalization_of_operand: ClassVar[bool] = False
    #: its result may be freed after the forward and computed again by its kernel from its
    #: source and weights before the backward, when its source is one of the graph's source
    #: images (`Graph.recompute_input_convolution_results`)
    recomputes_result_from_source: ClassVar[bool] = False

    # -- traits the automatic training graph and the updates read --------------------------
    #: its result is the gradient of its source, where a training graph starts: what it is
    #: ("loss", "initial gradient"), None for the other filters
    supplies_gradient: ClassVar[str | None] = None
    #: its trainable layer's gradient state is one per image, summed by the data source
    #: (instance and group normalization)
    updates_from_image_states: ClassVar[bool] = False
    #: its update also writes running statistics that the kernel reloads (batch normalization)
    updates_running_statistics: ClassVar[bool] = False
    #: as the automatic training graph's sum of two gradients (a plain sum, `_plain_sum`), its
    #: command can apply the plain ReLU gradient that reads the sum (`mpsnn.graph.plan_passes`)
    sums_gradients_with_relu_gradient: ClassVar[bool] = False

    # -- what a file holds (`mpsnn.core.saved`, `mpsnn.io.declared_nodes`) -----------------
    #: what the class saves besides what every filter node saves (its source, label, padding
    #: policy, ``trainable``, result image and state): a forward node class whose own body
    #: sets it is saved and loaded by `mpsnn.io` with no codec of its own
    saved_fields: ClassVar[tuple[Field, ...]]
    #: the attributes holding code (a callback, a provider), which a file cannot hold: saving
    #: refuses a node where one is not None (set it again after loading)
    code_attributes: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("code_attributes", ())
        if type(code) is not tuple or not all(type(c) is str and c.isidentifier() for c in code):
            raise TypeError(
                f"[{cls.__name__}] code_attributes must be a tuple of attribute names, got {code!r}"
            )
        if "saved_fields" not in cls.__dict__:
            return
        if issubclass(cls, GradientFilterNode):
            raise ValueError(
                f"[{cls.__name__}] a gradient node is saved as its place in a training graph: "
                "it must not declare saved_fields, got a declaration"
            )
        declare_saved_fields(cls, COMMON_SAVED)

    def __init__(self, sources: Sequence[ImageNode]) -> None:
        who = type(self).__name__
        for i, s in enumerate(sources):
            if not isinstance(s, ImageNode):
                raise TypeError(
                    f"[{who}] source {i} must be an ImageNode (a node's result_image), "
                    f"got {type(s).__name__}"
                )
        self._sources = list(sources)
        self.result_image = ImageNode()
        self.result_image._producer = self
        self.result_state: StateNode | None = StateNode(self) if self._has_state else None
        self.padding_policy: Any = None
        self.label: str | None = None
        self._id = next(_ids)

    @property
    def source_images(self) -> list[ImageNode]:
        return list(self._sources)

    @property
    def source_states(self) -> list[StateNode]:
        """States this filter reads (forward filters: none; labels for a loss)."""
        return []

    # -- binding to a device (the graph calls these) ---------------------------------------

    def _make_kernel(self, device: Any) -> Any:
        raise NotImplementedError

    def _fusible_neuron(self) -> Any:
        """The neuron descriptor this node applies, if it may run fused into the node before
        it (None: not a fusible neuron)."""
        return None

    def _plain_sum(self) -> bool:
        """Whether this node computes ``left + right`` and nothing else (no scale, bias, clamp,
        stride or padding policy): what a `sums_gradients_with_relu_gradient` node must be for
        the ReLU gradient after it to run inside its command."""
        return False

    def _accepts_fused_neuron(self) -> bool:
        """Whether a neuron may fuse into this node now (a node that ``fuses_neuron``)."""
        return True

    def _make_fused_kernel(self, device: Any, neuron: Any) -> Any:
        """This node's kernel with ``neuron`` applied to its result (after the bias)."""
        kernel = self._make_kernel(device)
        kernel._neuron = FusedNeuron.of(type(kernel).__name__, neuron)
        if hasattr(kernel, "_descriptor"):  # a convolution reports it (arithmetic has none)
            kernel._descriptor.fused_neuron_descriptor = neuron
        return kernel

    def _make_fused_gradient_kernel(self, gradient: Any, device: Any, neuron: Any) -> Any:
        """The kernel(s) of ``gradient`` (this node's gradient node) applying ``neuron``'s
        gradient first (a node whose ``gradient_applies_fused_neuron``)."""
        raise NotImplementedError

    def _configure(self, kernel: Any) -> None:
        """Apply node properties (padding policy) to a fresh kernel."""
        if self.padding_policy is not None and isinstance(kernel, Kernel):
            kernel.padding = self.padding_policy

    def _content_sources(self) -> list[ImageNode]:
        """The inputs whose contents this filter reads (the others: shape only)."""
        return self._sources

    def _reads(self) -> list[tuple[ImageNode, int]]:
        """``(input image, reads per encode)``: one read per distinct content source by
        default."""
        seen: dict[int, ImageNode] = {}
        for s in self._content_sources():
            seen.setdefault(s._id, s)
        return [(s, 1) for s in seen.values()]

    def _run(self, step: _Step, kernel: Any) -> None:
        raise NotImplementedError

    # -- training graph ----------------------------------------------------------------------

    @property
    def trainable(self) -> bool:
        """False freezes a trainable layer (no weight gradient, no update); True otherwise."""
        return getattr(self, "_trainable", True)

    @trainable.setter
    def trainable(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"[{type(self).__name__}] trainable must be a bool, got {value!r}")
        self._trainable = value

    def gradient_filter(self, source: ImageNode) -> GradientFilterNode:
        """The gradient node of this filter for the incoming gradient ``source`` (MPS
        ``gradientFilterWithSource:``); filters with several inputs use `gradient_filters`."""
        nodes = self.gradient_filters([source])
        if len(nodes) != 1:
            raise ValueError(
                f"[{type(self).__name__}] a filter with {len(self._sources)} inputs has "
                f"{len(nodes)} gradient filters: use gradient_filters, got gradient_filter"
            )
        return nodes[0]

    def gradient_filters(self, sources: Sequence[ImageNode]) -> list[GradientFilterNode]:
        """The gradient nodes for the incoming gradient(s) ``sources``: one per input this
        filter has (MPS ``gradientFiltersWithSources:``)."""
        for cls in type(self).__mro__:
            factory = _GRADIENT_FACTORIES.get(cls)
            if factory is not None:
                incoming = list(sources)
                for i, g in enumerate(incoming):
                    if not isinstance(g, ImageNode):
                        raise TypeError(
                            f"[{type(self).__name__}] incoming gradient {i} must be an "
                            f"ImageNode, got {type(g).__name__}"
                        )
                return factory(self, incoming)
        raise ValueError(
            f"[{type(self).__name__}] this filter has no gradient (it is not differentiable "
            "in mpsnn), got a request for its gradient filters"
        )

    def training_graph(
        self, source_gradient: ImageNode | None = None, node_handler: NodeHandler | None = None
    ) -> list[GradientFilterNode]:
        """The gradient graph of everything that leads to this node (MPS
        ``trainingGraphWithSourceGradient:nodeHandler:``); returns the terminal gradient
        nodes. See `mpsnn.graph.training.training_graph`."""
        (training_graph,) = _TRAINING_GRAPH  # installed by mpsnn.graph (always imported)
        return training_graph(self, source_gradient, node_handler)

    def __repr__(self) -> str:
        label = f" {self.label!r}" if self.label else ""
        return f"<{type(self).__name__}{label}>"


class UnaryNode(FilterNode):
    """A filter with one source whose kernel is a `CNNKernel` with a gradient state."""

    def __init__(self, source: ImageNode) -> None:
        super().__init__([source])

    def _run(self, step: _Step, kernel: Any) -> None:
        x = step.image(self._sources[0])
        states = step.states_for(self, kernel, x) if step.training(self) else None
        trusted = getattr(kernel, "_graph_encode_batch", None)
        if trusted is not None:  # mpsnn's kernels: the graph made (and checked) the arguments
            y = trusted(step.cb, x, states)
        else:
            y = kernel.encode_batch(step.cb, x, destination_states=states)
        step.set_image(self.result_image, y)
        if states is not None:
            step.set_state(self.result_state, states)

    def _gradient_kernel(self, device: Device) -> Any:
        raise NotImplementedError


class _TrainableNode(UnaryNode):
    """A node whose kernel has a data source that a training step updates."""

    def __init__(self, source: ImageNode, data_source: Any) -> None:
        super().__init__(source)
        self._data_source = data_source

    @property
    def data_source(self) -> Any:
        return self._data_source

    @property
    def training_style(self) -> Any:
        """The data source's ``training_style`` (where the graph runs the update)."""
        return getattr(self._data_source, "training_style", None)


class GradientFilterNode(FilterNode):
    """Base of every gradient node (MPS ``MPSNNGradientFilterNode``).

    Sources: the incoming gradient first, then the forward images the gradient kernel reads;
    it reads the forward node's ``result_state``. Gradient nodes have no gradients themselves
    (no second-order training graphs, as in MPS).
    """

    _has_state = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # every gradient node class is saved as its place in the training graph that made it
        # (`mpsnn.io.graph_training`): recorded by name, so a file can name a family's own
        super().__init_subclass__(**kwargs)
        record_saved_class(cls)

    def __init__(
        self,
        sources: Sequence[ImageNode],
        forward: FilterNode,
        state: StateNode | None,
    ) -> None:
        super().__init__(sources)
        self._forward = forward
        self._state = state
        self._training_style: TrainingStyle | None = None  # None: the data source's

    @property
    def trainable(self) -> bool:
        """Whether this gradient node's layer is updated (False: it has no weights; the
        gradient nodes of trainable layers answer their forward node's ``trainable``)."""
        return False

    @property
    def inference_node(self) -> FilterNode:
        """The forward filter this node differentiates."""
        return self._forward

    @property
    def training_style(self) -> TrainingStyle:
        """Where a graph runs this layer's update (MPS ``MPSNNTrainingStyle`` of a trainable
        gradient node): `TrainingStyle.UPDATE_ON_GPU` encodes the data source's ``update`` on
        the step's command buffer; `TrainingStyle.UPDATE_ON_CPU` calls its ``update_on_cpu``
        after completion, then reloads the layer from the data source.

        Precedence: a style set on this node wins; unset, it is the forward node's data
        source's ``training_style`` (as MPS copies the forward node's style onto the gradient
        nodes made from it), and `TrainingStyle.UPDATE_ON_GPU` when the data source has none.
        A `Graph` reads it when it is made: set it before."""
        own = self._training_style
        if own is not None:
            return own
        style = getattr(getattr(self._forward, "data_source", None), "training_style", None)
        return style if isinstance(style, TrainingStyle) else TrainingStyle.UPDATE_ON_GPU

    @training_style.setter
    def training_style(self, value: TrainingStyle | None) -> None:
        if value is not None and not isinstance(value, TrainingStyle):
            raise TypeError(
                f"[{type(self).__name__}] training_style must be a TrainingStyle (or None: the "
                f"data source's), got {type(value).__name__} {value!r}"
            )
        self._training_style = value

    @property
    def source_states(self) -> list[StateNode]:
        return [self._state] if self._state is not None else []

    def gradient_filters(self, sources: Sequence[ImageNode]) -> list[GradientFilterNode]:
        raise ValueError(
            f"[{type(self).__name__}] gradient nodes have no gradient filters (no second-order "
            "training graphs), got a request for one"
        )

    def training_graph(self, source_gradient: Any = None, node_handler: Any = None) -> Any:
        raise ValueError(
            f"[{type(self).__name__}] a training graph starts at a forward node (a loss), "
            "got a gradient node"
        )


class UnaryGradientNode(GradientFilterNode):
    """The gradient of a one-source forward node: ``(incoming gradient, forward image)``."""

    _reads_result = False  # the gradient kernel reads the forward result (softmax families)

    def __init_subclass__(cls, *, gradient_of: type[FilterNode] | None = None, **kw: Any) -> None:
        """``class PoolingMaxGradientNode(UnaryGradientNode, gradient_of=PoolingMaxNode)``
        declares the gradient node of a one-input forward node: the automatic training graph
        makes one of it per incoming gradient (`register_gradient_nodes`)."""
        super().__init_subclass__(**kw)
        if gradient_of is None:
            return
        known = getattr(_GRADIENT_FACTORIES.get(gradient_of), "node_class", None)
        if known is not None and not same_definition(known, cls):
            raise ValueError(
                f"[{cls.__name__}] a forward node has one gradient node class: "
                f"{gradient_of.__name__} has {known.__name__}, got a second"
            )
        register_gradient_nodes(gradient_of, unary_gradient_nodes(cls))

    def __init__(self, source_gradient: ImageNode, forward: FilterNode) -> None:
        secondary = forward.result_image if self._reads_result else forward.source_images[0]
        super().__init__([source_gradient, secondary], forward, forward.result_state)

    @property
    def trainable(self) -> bool:
        """Whether the layer's weights are trained (the forward node's ``trainable``)."""
        return self._forward.trainable and isinstance(self._forward, _TrainableNode)

    def _read_node(self, kernel: Any) -> ImageNode:
        """The forward image the gradient kernel reads (its second source by default)."""
        return self._sources[1]

    def _make_kernel(self, device: Device) -> Any:
        return self._forward._gradient_kernel(device)

    def _run(self, step: _Step, kernel: Any) -> None:
        if not hasattr(kernel, "encode_batch"):  # the gradient of a neuron fused into a
            step.alias(self.result_image, self._sources[0])  # batch normalization: passed on
            return
        g = step.image(self._sources[0])
        x = step.image(self._read_node(kernel))
        states = step.state(self._state)
        pre = step.graph._plan.pre_gradient.get(self._id)
        if pre is None:
            dx = _encode(step, kernel, g, x, states)
        else:  # a ReLU's gradient fused into this one (`mpsnn.graph.plan`)
            relu, result = pre
            kernel._incoming_gradient = relu._incoming_transform(states, step.image(result)._image)
            try:
                dx = _encode(step, kernel, g, x, states)
            finally:
                kernel._incoming_gradient = None
        if dx is not None:
            step.set_image(self.result_image, dx)
        if self.trainable:
            step.weight_gradient_ready(self, step.graph._plan.kernels[self._forward._id], states)


def _encode(step: _Step, kernel: Any, g: Any, x: Any, states: Any) -> Any:
    trusted = getattr(kernel, "_graph_encode_batch", None)
    if trusted is not None:  # mpsnn's kernels: the graph made (and checked) the arguments
        return trusted(step.cb, g, x, states)
    return kernel.encode_batch(step.cb, g, x, states)


def unary_gradient_nodes(node_class: type) -> Callable[[Any, list[Any]], list[Any]]:
    """The gradient-node factory of a one-input forward node (what `register_gradient_nodes`
    takes): one incoming gradient, one ``node_class(incoming, forward)``."""

    def factory(forward: FilterNode, incoming: list[ImageNode]) -> list[Any]:
        if len(incoming) != 1:
            raise ValueError(
                f"[{type(forward).__name__}] a one-input filter takes one incoming gradient, "
                f"got {len(incoming)}"
            )
        return [node_class(incoming[0], forward)]

    factory.node_class = node_class  # type: ignore[attr-defined]  # whose factory it is
    return factory
