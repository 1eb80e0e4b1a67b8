"""Gradient nodes: one per gradient kernel, all from `GradientFilterNode` (MPS
``MPSCNNConvolutionGradientNode``, ``MPSCNNPoolingMaxGradientNode``, ...,
``MPSNNArithmeticGradientNode``, ``MPSNNConcatenationGradientNode``).

A gradient node reads the incoming gradient, the forward image its kernel needs (the forward
source; the forward result for softmax and log-softmax) and the forward node's state, and makes
the gradient with respect to the forward input. Trainable ones (convolutions, normalizations)
register their layer's update with the step; a frozen forward node (``trainable = False``)
computes the data gradient only.
"""

from __future__ import annotations

import math
from typing import Any

import torch

import mpsnn.graph.forward_nodes as fwd
import mpsnn.graph.normalization_nodes as nn_nodes
from mpsnn.cnn.arithmetic import Add, Subtract
from mpsnn.cnn.convolution import ConvolutionGradientOption
from mpsnn.cnn.neuron import ReLUGradientOfResult
from mpsnn.cnn.neuron_descriptor import NeuronType
from mpsnn.core.descriptor import ImageDescriptor
from mpsnn.core.device import Device
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.graph.neuron_nodes import NeuronNode
from mpsnn.graph.nodes import FilterNode, GradientFilterNode, ImageNode, register_gradient_nodes
from mpsnn.graph.step import _Step

__all__ = [
    "ArithmeticGradientNode",
    "BatchNormalizationGradientNode",
    "ConcatenationGradientNode",
    "ConvolutionGradientNode",
    "ConvolutionTransposeGradientNode",
    "CrossChannelNormalizationGradientNode",
    "DilatedPoolingMaxGradientNode",
    "DropoutGradientNode",
    "FullyConnectedGradientNode",
    "GroupNormalizationGradientNode",
    "InstanceNormalizationGradientNode",
    "LocalContrastNormalizationGradientNode",
    "LogSoftMaxGradientNode",
    "NeuronGradientNode",
    "PadGradientNode",
    "PoolingAverageGradientNode",
    "PoolingL2NormGradientNode",
    "PoolingMaxGradientNode",
    "ReshapeGradientNode",
    "SliceGradientNode",
    "SoftMaxGradientNode",
    "SpatialNormalizationGradientNode",
    "UnaryGradientNode",
    "UpsamplingBilinearGradientNode",
    "UpsamplingNearestGradientNode",
]


class UnaryGradientNode(GradientFilterNode):
    """The gradient of a one-source forward node: ``(incoming gradient, forward image)``."""

    _reads_result = False  # the gradient kernel reads the forward result (softmax families)

    def __init__(self, source_gradient: ImageNode, forward: FilterNode) -> None:
        secondary = forward.result_image if self._reads_result else forward.source_images[0]
        super().__init__([source_gradient, secondary], forward, forward.result_state)

    @property
    def trainable(self) -> bool:
        """Whether the layer's weights are trained (the forward node's ``trainable``)."""
        return self._forward.trainable and isinstance(self._forward, fwd._TrainableNode)

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


class _NeuronGradientNode(UnaryGradientNode):
    """A neuron's gradient. A plain ReLU (``a = +0.0``, no padding policy) whose input is made
    by a node of the graph, with the input and the result both in the graph's format, reads
    the forward *result* (`ReLUGradientOfResult`): the ReLU's input is then freed after the
    forward instead of being kept for the backward (in a residual network: every addition's
    result). With a narrower result (a node ``format`` of its own) a tiny positive input could
    round to a zero result and lose its gradient: the source is read then. A ReLU fused into
    the filter before it differentiates through that filter's state either way. Its sources
    are MPS's (incoming gradient, forward source) in both cases."""

    def __init__(self, source_gradient: ImageNode, forward: FilterNode) -> None:
        d = forward.descriptor
        self._plain_relu = (
            d.neuron_type is NeuronType.RELU
            and d.a == 0.0
            and math.copysign(1.0, d.a) > 0
            and forward.padding_policy is None
        )
        super().__init__(source_gradient, forward)

    def _uses_result(self) -> bool:
        """Whether the gradient reads the ReLU's result (decided when a graph is planned).

        After a convolution, which may run fused with the ReLU and then computes the
        pre-activation in its *source's* dtype, that source must be in the graph's format too
        (a wider graph input would round a tiny positive pre-activation to a zero result)."""
        src, result = self._forward.source_images[0], self._forward.result_image
        if not (
            self._plain_relu
            and src.producer is not None
            and src.format is None
            and result.format is None
        ):
            return False
        if isinstance(src.producer, fwd.ConvolutionNode):
            before = src.producer.source_images[0]
            return before.producer is not None and before.format is None
        return True

    def _content_sources(self) -> list[ImageNode]:
        if self._uses_result():
            return [self._sources[0], self._forward.result_image]
        return self._sources

    def _make_kernel(self, device: Device) -> Any:
        if self._uses_result():
            return ReLUGradientOfResult(device, self._forward.descriptor)
        return super()._make_kernel(device)

    def _read_node(self, kernel: Any) -> ImageNode:
        if isinstance(kernel, ReLUGradientOfResult):
            return self._forward.result_image
        return self._sources[1]


class _ConvolutionGradientNode(UnaryGradientNode):
    """Convolution family: no data gradient when nobody needs it; no weight gradient when the
    layer is frozen."""

    def _make_kernel(self, device: Device) -> Any:
        k = super()._make_kernel(device)
        option = ConvolutionGradientOption.ALL
        if not self.trainable:
            option = ConvolutionGradientOption.GRADIENT_WITH_DATA
        if getattr(self, "_data_unneeded", False):
            option = ConvolutionGradientOption.GRADIENT_WITH_WEIGHTS_AND_BIAS
        k.gradient_option = option
        if getattr(self._forward.data_source, "_own_updates", False):
            k._bias_sums = False  # nothing reads a bias-less layer's bias sums: not computed
        return k


class BatchNormalizationGradientNode(UnaryGradientNode):
    """The gradient of batch normalization (MPS ``MPSCNNBatchNormalizationGradientNode``): the
    statistics gradient over the batch, then the input gradient."""

    def _reads(self) -> list[tuple[ImageNode, int]]:
        return [(self._sources[0], 2), (self._sources[1], 2)]

    def _run(self, step: _Step, kernels: Any) -> None:
        sgrad, grad = kernels
        g, x = step.image(self._sources[0]), step.image(self._sources[1])
        state = step.state(self._state)[0]
        sgrad.encode_batch(step.cb, g, x, state)
        if step.collectives is not None:  # data parallel: the sums of every process's images
            step.collectives.batch_norm_gradient_sums(self, state)
        step.set_image(self.result_image, grad.encode_batch(step.cb, g, x, state))
        if self.trainable:
            step.weight_gradient_ready(self, step.graph._plan.kernels[self._forward._id], [state])


class ArithmeticGradientNode(GradientFilterNode):
    """One input's gradient of an arithmetic node (MPS ``MPSNNArithmeticGradientNode``):
    ``is_secondary_source_filter`` selects the input. Add and subtract read the input they
    differentiate, multiply and divide the other one.

    Add and subtract need only the *shape* of their input (``dx = scale * g``, reduced over
    broadcast axes): their kernel gets a storage-less stand-in of the same shape, and the input
    image is not kept alive for them. In a residual network that frees every block's last
    normalization output right after the addition instead of at the block's backward."""

    def __init__(self, source_gradient: ImageNode, forward: Any, secondary: bool) -> None:
        self._reads_other = not issubclass(forward._kernel_class, Add | Subtract)
        which = (not secondary) if self._reads_other else secondary
        super().__init__(
            [source_gradient, forward.source_images[int(which)]], forward, forward.result_state
        )
        self.is_secondary_source_filter = secondary

    def _content_sources(self) -> list[ImageNode]:
        return self._sources if self._reads_other else self._sources[:1]

    def _make_kernel(self, device: Device) -> Any:
        return self._forward._gradient_kernel(device, self.is_secondary_source_filter)

    def _run(self, step: _Step, kernel: Any) -> None:
        g, x = step.image(self._sources[0]), step.image(self._sources[1])
        states = step.state(self._state)
        if not self._reads_other:
            if self._passes_on(step, kernel, g, states):
                step.share(self.result_image, self._sources[0])
                return
            x = _shape_only(x)
        step.set_image(self.result_image, kernel.encode_batch(step.cb, g, x, states))

    def _passes_on(self, step: _Step, kernel: Any, g: ImageBatch, states: Any) -> bool:
        """Whether this node holds its incoming gradient's image instead of a copy: the
        kernel's gradient is that image (`ArithmeticGradient._passes_gradient_on`), the
        graph would store it in the same format, and the result is the graph's own
        intermediate (not a result, an export, or an image of a user's allocator), and the
        incoming gradient is not a source of the graph."""
        graph, result = step.graph, self.result_image
        passes = getattr(kernel, "_passes_gradient_on", None)
        return (
            passes is not None
            # a user's source: its planned read count counts this node's one read
            and self._sources[0]._id not in graph._plan.topology.source_ids
            and result._id not in graph._plan.modes.kept
            and result.image_allocator is None
            and graph._plan.liveness.alloc_nodes.get(result._id) is result
            and (result.format or graph.format) is g.image._fmt
            and passes(g.image, states)
        )


class _ShapeOnly(Image):
    """A stand-in with an image's shape and format and no storage: what the add/subtract
    gradients get instead of an input image the graph may have released already. They read
    only its shape; a command that read its contents would be a planning bug, and raises."""

    def _data(self) -> torch.Tensor:
        raise RuntimeError(
            f"[Graph] internal error: the contents of a shape-only stand-in ({self._describe()}) "
            "were read; please report this"
        )


def _shape_only(batch: ImageBatch | Image) -> ImageBatch | Image:
    """`_ShapeOnly` of ``batch`` (an `ImageBatch` for a batch)."""
    image = batch.image if isinstance(batch, ImageBatch) else batch
    n, c, h, w = image._shape
    stand_in = _ShapeOnly._make(image._device, ImageDescriptor._make(image._fmt, w, h, c, n))
    return ImageBatch(stand_in) if isinstance(batch, ImageBatch) else stand_in


class ConcatenationGradientNode(GradientFilterNode):
    """The gradient of one input of a concatenation (MPS ``MPSNNConcatenationGradientNode``):
    the input's channel range of the incoming gradient."""

    def __init__(self, source_gradient: ImageNode, forward: Any, index: int) -> None:
        super().__init__([source_gradient], forward, None)
        self.index = index

    def _make_kernel(self, device: Device) -> Any:
        from mpsnn.cnn.shape import Slice

        return Slice(device)

    def _run(self, step: _Step, kernel: Any) -> None:
        offsets = step.states[self._forward._id]  # recorded by the concatenation's forward
        start, count = offsets[self.index]
        kernel.source_feature_channel_offset = start
        kernel.source_feature_channel_max_count = count
        g = step.image(self._sources[0])
        step.set_image(self.result_image, kernel.encode_batch(step.cb, g))


def _unary(node_class: type) -> Any:
    """The factory of a one-input forward node's gradient node: one incoming gradient."""

    def factory(forward: FilterNode, incoming: list[ImageNode]) -> list[Any]:
        if len(incoming) != 1:
            raise ValueError(
                f"[{type(forward).__name__}] a one-input filter takes one incoming gradient, "
                f"got {len(incoming)}"
            )
        return [node_class(incoming[0], forward)]

    return factory


# -- one gradient node per one-input forward node ------------------------------------------


class ConvolutionGradientNode(_ConvolutionGradientNode):
    """The gradient node of `ConvolutionNode` (MPS ``MPSCNNConvolutionGradientNode``)."""


class FullyConnectedGradientNode(_ConvolutionGradientNode):
    """The gradient node of `FullyConnectedNode` (MPS ``MPSCNNFullyConnectedGradientNode``)."""


class ConvolutionTransposeGradientNode(_ConvolutionGradientNode):
    """The gradient node of `ConvolutionTransposeNode`
    (MPS ``MPSCNNConvolutionTransposeGradientNode``)."""


class PoolingMaxGradientNode(UnaryGradientNode):
    """The gradient node of `PoolingMaxNode` (MPS ``MPSCNNPoolingMaxGradientNode``)."""


class PoolingAverageGradientNode(UnaryGradientNode):
    """The gradient node of `PoolingAverageNode` (MPS ``MPSCNNPoolingAverageGradientNode``)."""


class PoolingL2NormGradientNode(UnaryGradientNode):
    """The gradient node of `PoolingL2NormNode` (MPS ``MPSCNNPoolingL2NormGradientNode``)."""


class DilatedPoolingMaxGradientNode(UnaryGradientNode):
    """The gradient node of `DilatedPoolingMaxNode`
    (MPS ``MPSCNNDilatedPoolingMaxGradientNode``)."""


class NeuronGradientNode(_NeuronGradientNode):
    """The gradient node of `NeuronNode` (MPS ``MPSCNNNeuronGradientNode``)."""


class SoftMaxGradientNode(UnaryGradientNode):
    """The gradient node of `SoftMaxNode` (MPS ``MPSCNNSoftMaxGradientNode``)."""

    _reads_result = True


class LogSoftMaxGradientNode(UnaryGradientNode):
    """The gradient node of `LogSoftMaxNode` (MPS ``MPSCNNLogSoftMaxGradientNode``)."""

    _reads_result = True


class DropoutGradientNode(UnaryGradientNode):
    """The gradient node of `DropoutNode` (MPS ``MPSCNNDropoutGradientNode``)."""


class UpsamplingNearestGradientNode(UnaryGradientNode):
    """The gradient node of `UpsamplingNearestNode`
    (MPS ``MPSCNNUpsamplingNearestGradientNode``)."""


class UpsamplingBilinearGradientNode(UnaryGradientNode):
    """The gradient node of `UpsamplingBilinearNode`
    (MPS ``MPSCNNUpsamplingBilinearGradientNode``)."""


class SliceGradientNode(UnaryGradientNode):
    """The gradient node of `SliceNode` (MPS ``MPSCNNSliceGradientNode``)."""


class ReshapeGradientNode(UnaryGradientNode):
    """The gradient node of `ReshapeNode` (MPS ``MPSCNNReshapeGradientNode``)."""


class PadGradientNode(UnaryGradientNode):
    """The gradient node of `PadNode` (MPS ``MPSCNNPadGradientNode``)."""


class InstanceNormalizationGradientNode(UnaryGradientNode):
    """The gradient node of `InstanceNormalizationNode`
    (MPS ``MPSCNNInstanceNormalizationGradientNode``)."""


class GroupNormalizationGradientNode(UnaryGradientNode):
    """The gradient node of `GroupNormalizationNode`
    (MPS ``MPSCNNGroupNormalizationGradientNode``)."""


class SpatialNormalizationGradientNode(UnaryGradientNode):
    """The gradient node of `SpatialNormalizationNode`
    (MPS ``MPSCNNSpatialNormalizationGradientNode``)."""


class LocalContrastNormalizationGradientNode(UnaryGradientNode):
    """The gradient node of `LocalContrastNormalizationNode`
    (MPS ``MPSCNNLocalContrastNormalizationGradientNode``)."""


class CrossChannelNormalizationGradientNode(UnaryGradientNode):
    """The gradient node of `CrossChannelNormalizationNode`
    (MPS ``MPSCNNCrossChannelNormalizationGradientNode``)."""


# The one-input forward nodes and their gradient nodes.
_UNARY_GRADIENTS: tuple[tuple[type[FilterNode], type[UnaryGradientNode]], ...] = (
    (fwd.ConvolutionNode, ConvolutionGradientNode),
    (fwd.FullyConnectedNode, FullyConnectedGradientNode),
    (fwd.ConvolutionTransposeNode, ConvolutionTransposeGradientNode),
    (fwd.PoolingMaxNode, PoolingMaxGradientNode),
    (fwd.PoolingAverageNode, PoolingAverageGradientNode),
    (fwd.PoolingL2NormNode, PoolingL2NormGradientNode),
    (fwd.DilatedPoolingMaxNode, DilatedPoolingMaxGradientNode),
    (NeuronNode, NeuronGradientNode),
    (fwd.SoftMaxNode, SoftMaxGradientNode),
    (fwd.LogSoftMaxNode, LogSoftMaxGradientNode),
    (fwd.DropoutNode, DropoutGradientNode),
    (fwd.UpsamplingNearestNode, UpsamplingNearestGradientNode),
    (fwd.UpsamplingBilinearNode, UpsamplingBilinearGradientNode),
    (fwd.SliceNode, SliceGradientNode),
    (fwd.ReshapeNode, ReshapeGradientNode),
    (fwd.PadNode, PadGradientNode),
    (nn_nodes.InstanceNormalizationNode, InstanceNormalizationGradientNode),
    (nn_nodes.GroupNormalizationNode, GroupNormalizationGradientNode),
    (nn_nodes.SpatialNormalizationNode, SpatialNormalizationGradientNode),
    (nn_nodes.LocalContrastNormalizationNode, LocalContrastNormalizationGradientNode),
    (nn_nodes.CrossChannelNormalizationNode, CrossChannelNormalizationGradientNode),
)
for _forward, _gradient in _UNARY_GRADIENTS:
    register_gradient_nodes(_forward, _unary(_gradient))
register_gradient_nodes(nn_nodes.BatchNormalizationNode, _unary(BatchNormalizationGradientNode))
register_gradient_nodes(
    fwd.ConcatenationNode,
    lambda f, g: [ConcatenationGradientNode(g[0], f, i) for i in range(len(f.source_images))],
)
register_gradient_nodes(
    fwd._ArithmeticNode,
    lambda f, g: [ArithmeticGradientNode(g[0], f, secondary) for secondary in (False, True)],
)
