"""The loss nodes: `LossNode` (MPS ``MPSCNNLossNode``, the fused loss whose result is its
source's gradient) and the split-loss nodes (MPS ``MPSNNForwardLossNode``,
``MPSNNLossGradientNode``, ``MPSNNInitialGradientNode``).

With them a training graph starts from an **initial gradient** instead of a fused loss node:

    loss = ForwardLossNode(logits, labels, descriptor)          # the loss image
    start = InitialGradientNode(loss.result_image)              # ones: dL/dL
    terminals = start.training_graph()

``start.training_graph()`` walks back from the initial gradient's source: the forward loss
node's gradient is a `LossGradientNode` (reading the ones, the predictions, the labels and
the weights), and the walk goes on through the network as from a `LossNode`. Several losses
train together by combining their loss images before the initial gradient (e.g.
``AdditionNode(loss_a.result_image, loss_b.result_image)``): the arithmetic gradients route
the ones to each loss, and the gradients of layers both losses reach are summed by the
additions the walk inserts where an image feeds several filters.

Labels and weights are ordinary image nodes (graph sources, in ``source_image_handles``, or
images made by filters). The labels of a forward loss get a gradient of their own (a second
`LossGradientNode`, ``is_labels_gradient_filter``) only when a filter of the graph makes them
and their image has no ``stop_gradient``; the weights never get one (MPS defines none).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpsnn.cnn.loss import Loss, LossDescriptor
from mpsnn.cnn.loss_split import ForwardLoss, InitialGradient, LossGradient
from mpsnn.core._checks import check_type
from mpsnn.core.device import Device
from mpsnn.core.saved import Field
from mpsnn.graph.nodes import (
    FilterNode,
    GradientFilterNode,
    ImageNode,
    LabelsNode,
    UnaryNode,
    register_gradient_nodes,
)
from mpsnn.graph.step import _Step
from mpsnn.ops.loss_split import LABEL_GRADIENT_TYPES

__all__ = ["ForwardLossNode", "InitialGradientNode", "LossGradientNode", "LossNode"]


class LossNode(FilterNode):
    """A loss (MPS ``MPSCNNLossNode``): its result image **is** the gradient of the loss with
    respect to its source (the start of the training graph), and the loss goes into the
    labels (``input_labels``, a `LabelsNode`: a source state of the graph).

    Args:
        source: the predictions.
        loss_descriptor: a `LossDescriptor`.
    """

    _has_state = False
    supplies_gradient = "loss"

    def __init__(self, source: ImageNode, loss_descriptor: LossDescriptor) -> None:
        super().__init__([source])
        self.descriptor = check_type("LossNode", "loss_descriptor", loss_descriptor, LossDescriptor)
        self.input_labels = LabelsNode()

    @property
    def source_states(self) -> list[LabelsNode]:
        return [self.input_labels]

    def _make_kernel(self, device: Device) -> Any:
        k = Loss(device, self.descriptor)
        self._configure(k)
        return k

    def _run(self, step: _Step, kernel: Any) -> None:
        y = step.image(self._sources[0])
        labels = step.state(self.input_labels)
        step.set_image(self.result_image, kernel.encode_batch(step.cb, y, labels))

    def gradient_filters(self, sources: Sequence[ImageNode]) -> list[Any]:
        raise ValueError(
            "[LossNode] a loss node has no gradient filter: its result image is the gradient "
            "(use loss_node.training_graph())"
        )


class ForwardLossNode(FilterNode):
    """A forward loss (MPS ``MPSNNForwardLossNode``): its result image is the loss image of
    `ForwardLoss` (one value per image for a reduction; the batch's value in image 0 with
    ``reduce_across_batch``; the weighted per-element losses for NONE).

    Args:
        source: the predictions (logits for the softmax and sigmoid cross entropies).
        labels: the labels image node (at least the predictions' channels).
        loss_descriptor: a `LossDescriptor` (kept, as `LossNode` keeps it: changes before a
            graph is made take effect).
        weights: None, or the weights image node (the labels' shape).
        reduce_across_batch: one loss value for the whole batch (MPS ``reduceAcrossBatch``).

    Attributes:
        property_call_back: None, or an object whose ``scalar_weight(source_image,
            destination_descriptor)`` returns the loss's ``weight`` for each encode (MPS
            ``MPSNNLossCallback``), e.g. ``1 / batch size``. It gets the predictions' `Image`
            (the batch) and the loss image's `ImageDescriptor`; the gradient uses the same
            weight (it reads it from the forward's gradient state).
    """

    saved_fields = (
        Field("labels", ImageNode, attr="input_labels"),
        Field("weights", ImageNode, optional=True, attr="input_weights"),
        Field("loss_descriptor", LossDescriptor, attr="descriptor"),  # shared, as kept
        Field("reduce_across_batch", bool),
    )
    code_attributes = ("property_call_back",)

    def __init__(
        self,
        source: ImageNode,
        labels: ImageNode,
        loss_descriptor: LossDescriptor,
        weights: ImageNode | None = None,
        *,
        reduce_across_batch: bool = False,
    ) -> None:
        who = "ForwardLossNode"
        sources = [source, labels] if weights is None else [source, labels, weights]
        super().__init__(sources)
        self.descriptor = check_type(who, "loss_descriptor", loss_descriptor, LossDescriptor)
        self.reduce_across_batch = check_type(who, "reduce_across_batch", reduce_across_batch, bool)
        self.property_call_back: Any = None  # asked at every encode (no step program then)

    @classmethod
    def from_sources(
        cls,
        sources: Sequence[ImageNode],
        loss_descriptor: LossDescriptor,
        *,
        reduce_across_batch: bool = False,
    ) -> ForwardLossNode:
        """MPS ``nodeWithSources:lossDescriptor:``: ``(predictions, labels[, weights])``."""
        if isinstance(sources, ImageNode) or not isinstance(sources, Sequence):
            raise TypeError(
                "[ForwardLossNode] sources must be a sequence (predictions, labels[, weights]), "
                f"got {type(sources).__name__}"
            )
        if len(sources) not in (2, 3):
            raise ValueError(
                "[ForwardLossNode] sources must be (predictions, labels) or (predictions, "
                f"labels, weights), got {len(sources)} sources"
            )
        return cls(*sources[:2], loss_descriptor, *sources[2:],
                   reduce_across_batch=reduce_across_batch)  # fmt: skip

    @property
    def input_labels(self) -> ImageNode:
        """The labels image node."""
        return self._sources[1]

    @property
    def input_weights(self) -> ImageNode | None:
        """The weights image node (None without weights)."""
        return self._sources[2] if len(self._sources) > 2 else None

    def _make_kernel(self, device: Device) -> Any:
        k = ForwardLoss(device, self.descriptor, reduce_across_batch=self.reduce_across_batch)
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device, labels: bool) -> Any:
        return LossGradient(
            device,
            self.descriptor,
            reduce_across_batch=self.reduce_across_batch,
            compute_label_gradients=labels,
        )

    def _run(self, step: _Step, kernel: Any) -> None:
        y = step.image(self._sources[0])
        t = step.image(self._sources[1])
        w = step.image(self._sources[2]) if len(self._sources) > 2 else None
        callback = self.property_call_back
        if callback is not None:
            src = y.image
            kernel.weight = callback.scalar_weight(src, kernel.destination_image_descriptor([src]))
        states = step.states_for(self, kernel, y) if step.training(self) else None
        loss = kernel.encode_batch(step.cb, y, t, w, destination_states=states)
        step.set_image(self.result_image, loss)
        if states is not None:
            step.set_state(self.result_state, states)


class LossGradientNode(GradientFilterNode):
    """The gradient of a `ForwardLossNode` (MPS ``MPSNNLossGradientNode``): `LossGradient`
    with the forward's descriptor, reading the incoming gradient (the loss image's shape),
    the predictions, the labels, the weights and the forward's state.

    Args:
        source_gradient: the gradient of the loss image (normally an `InitialGradientNode`'s
            result, or what the walk routes to this loss).
        forward: the `ForwardLossNode`.
        is_labels_gradient_filter: the gradient with respect to the labels instead of the
            predictions (MPS ``isLabelsGradientFilter``).
    """

    def __init__(
        self,
        source_gradient: ImageNode,
        forward: ForwardLossNode,
        is_labels_gradient_filter: bool = False,
    ) -> None:
        who = "LossGradientNode"
        check_type(who, "forward", forward, ForwardLossNode)
        check_type(who, "is_labels_gradient_filter", is_labels_gradient_filter, bool)
        if is_labels_gradient_filter and int(forward.descriptor.loss_type) not in (
            LABEL_GRADIENT_TYPES
        ):
            raise ValueError(
                f"[{who}] a labels gradient needs a loss type with one (not "
                f"KULLBACK_LEIBLER_DIVERGENCE), got {forward.descriptor.loss_type.name}"
            )
        super().__init__([source_gradient, *forward.source_images], forward, forward.result_state)
        self.is_labels_gradient_filter = is_labels_gradient_filter

    @property
    def descriptor(self) -> LossDescriptor:
        """The forward node's loss descriptor."""
        return self._forward.descriptor

    def _make_kernel(self, device: Device) -> Any:
        return self._forward._gradient_kernel(device, self.is_labels_gradient_filter)

    def _run(self, step: _Step, kernel: Any) -> None:
        g, y, t = (step.image(s) for s in self._sources[:3])
        w = step.image(self._sources[3]) if len(self._sources) > 3 else None
        states = step.state(self._state)
        step.set_image(self.result_image, kernel.encode_batch(step.cb, g, y, t, w, states))


def _loss_gradients(forward: Any, incoming: list[ImageNode]) -> list[Any]:
    """The predictions' gradient, and the labels' when a filter of the graph makes them."""
    if len(incoming) != 1:
        raise ValueError(
            f"[{type(forward).__name__}] a forward loss takes one incoming gradient (of its "
            f"loss image), got {len(incoming)}"
        )
    nodes = [LossGradientNode(incoming[0], forward)]
    labels = forward.input_labels
    if labels.producer is not None and not labels.stop_gradient:
        if int(forward.descriptor.loss_type) not in LABEL_GRADIENT_TYPES:
            raise ValueError(
                f"[{type(forward).__name__}] the labels are made by a filter, so the training "
                f"graph differentiates them, but {forward.descriptor.loss_type.name} has no "
                "label gradient: set stop_gradient on the labels image, got none"
            )
        nodes.append(LossGradientNode(incoming[0], forward, True))
    return nodes


register_gradient_nodes(ForwardLossNode, _loss_gradients)


class InitialGradientNode(UnaryNode):
    """The start of a training graph (MPS ``MPSNNInitialGradientNode``): an image of ones the
    size of its source (`InitialGradient`), the gradient of that source with respect to
    itself.

    ``initial_gradient_node.training_graph(source_gradient=None, node_handler=None)`` walks
    back from the source with this node's result as the source's gradient (as a `LossNode`
    supplies its own gradient, ``source_gradient`` is not used); the source must be made by a
    filter, usually a `ForwardLossNode` or a combination of several losses' results.
    """

    _has_state = False
    supplies_gradient = "initial gradient"  # the walk starts at its source with its result
    saved_fields = ()  # its source and what every node saves

    def _make_kernel(self, device: Device) -> Any:
        k = InitialGradient(device)
        self._configure(k)
        return k

    def gradient_filters(self, sources: Sequence[ImageNode]) -> list[GradientFilterNode]:
        raise ValueError(
            "[InitialGradientNode] an initial gradient has no gradient filter: its result is "
            "the start of the gradients (use initial_gradient_node.training_graph())"
        )
