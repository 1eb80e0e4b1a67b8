"""The convolution family's nodes: `ConvolutionNode`, `FullyConnectedNode` and
`ConvolutionTransposeNode` (MPS ``MPSCNNConvolutionNode``, ...), and their gradient nodes."""

from __future__ import annotations

from typing import Any

import mpsnn.cnn.convolution as conv
from mpsnn.cnn.convolution import ConvolutionGradientOption
from mpsnn.cnn.convolution.data_source import ConvolutionDataSource
from mpsnn.cnn.convolution.descriptor import ConvolutionAccumulatorPrecisionOption as Precision
from mpsnn.core.device import Device
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.saved import Field
from mpsnn.graph.nodes import (
    ImageNode,
    UnaryGradientNode,
    _TrainableNode,
)
from mpsnn.graph.step import _Step

__all__ = [
    "ConvolutionGradientNode",
    "ConvolutionNode",
    "ConvolutionTransposeGradientNode",
    "ConvolutionTransposeNode",
    "FullyConnectedGradientNode",
    "FullyConnectedNode",
]


# -- forward nodes ---------------------------------------------------------------------------

#: what a convolution or fully connected node saves (the transpose's pairing is
#: `mpsnn.io.graph_nodes`'s): its data source, shared, and the accumulator precision
_CONVOLUTION_FIELDS = (
    Field("data_source", ConvolutionDataSource),
    Field("accumulator_precision", Precision, init=False, optional=True),
)


class ConvolutionNode(_TrainableNode):
    """A convolution (MPS ``MPSCNNConvolutionNode``); ``data_source`` gives the weights."""

    _kernel_class: type = conv.Convolution
    _gradient_class: type = conv.ConvolutionGradient
    fuses_neuron = True
    records_fused_neuron = True
    gradient_fuses_relu_gradient = True
    makes_state_for_forward_readers = True
    recomputes_result_from_source = True
    saved_fields = _CONVOLUTION_FIELDS

    def __init__(self, source: ImageNode, data_source: Any) -> None:
        super().__init__(source, data_source)
        self.accumulator_precision: Any = None

    def _make_kernel(self, device: Device) -> Any:
        k = self._kernel_class(device, self._data_source)
        self._configure(k)
        if self.accumulator_precision is not None:
            k.accumulator_precision_option = self.accumulator_precision
        return k

    def _gradient_kernel(self, device: Device) -> Any:
        return self._gradient_class(device, self._data_source)

    def _accepts_fused_neuron(self) -> bool:
        # a data source whose descriptor fuses a neuron already: the kernel applies that one
        desc = self.data_source.descriptor()
        return getattr(desc, "fused_neuron_descriptor", None) is None


class FullyConnectedNode(ConvolutionNode):
    """A fully connected layer (MPS ``MPSCNNFullyConnectedNode``)."""

    _kernel_class = conv.FullyConnected
    _gradient_class = conv.FullyConnectedGradient
    saved_fields = _CONVOLUTION_FIELDS


class ConvolutionTransposeNode(ConvolutionNode):
    """A convolution transpose (MPS ``MPSCNNConvolutionTransposeNode``); given the
    ``convolution_gradient_state`` of a convolution node, it undoes that convolution's size."""

    _kernel_class = conv.ConvolutionTranspose
    _gradient_class = conv.ConvolutionTransposeGradient
    # its encode reads the paired convolution's state (the size it undoes), which the
    # recompute's plain encode does not pass
    recomputes_result_from_source = False

    def __init__(
        self, source: ImageNode, convolution_gradient_state: Any, data_source: Any
    ) -> None:
        super().__init__(source, data_source)
        self._pair = convolution_gradient_state

    @property
    def source_states(self) -> list[Any]:
        return [self._pair] if self._pair is not None else []

    def _run(self, step: _Step, kernel: Any) -> None:
        if self._pair is None:
            return super()._run(step, kernel)
        x = step.image(self._sources[0])
        pair = step.state(self._pair)
        states = step.states_for(self, kernel, x) if step.training(self) else None
        y = kernel.encode(
            step.cb, x.image, None, None if states is None else states[0],
            convolution_gradient_state=pair[0],
        )  # fmt: skip
        step.set_image(self.result_image, ImageBatch(y))
        if states is not None:
            step.set_state(self.result_state, states)
        return None


# -- gradient nodes --------------------------------------------------------------------------


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

    def _run(self, step: _Step, kernel: Any) -> None:
        if type(kernel) is conv.ConvolutionGradient:
            # the collectives that follow (a synchronized batch normalization's) overlap the
            # weight gradient on the side stream; the program lowered from this encode keeps it
            kernel._weights_beside = getattr(step.collectives, "weights_beside", False) is True
        return super()._run(step, kernel)


class ConvolutionGradientNode(_ConvolutionGradientNode, gradient_of=ConvolutionNode):
    """The gradient node of `ConvolutionNode` (MPS ``MPSCNNConvolutionGradientNode``)."""


class FullyConnectedGradientNode(_ConvolutionGradientNode, gradient_of=FullyConnectedNode):
    """The gradient node of `FullyConnectedNode` (MPS ``MPSCNNFullyConnectedGradientNode``)."""


class ConvolutionTransposeGradientNode(
    _ConvolutionGradientNode, gradient_of=ConvolutionTransposeNode
):
    """The gradient node of `ConvolutionTransposeNode`
    (MPS ``MPSCNNConvolutionTransposeGradientNode``)."""
