"""Graph nodes of the Gram matrix, the comparison and the reductions (MPS
``MPSNNGramMatrixCalculationNode`` and its gradient node, ``MPSNNComparisonNode``,
``MPSNNUnaryReductionNode`` and its ``MPSNNReduction…Node`` subclasses, and
``MPSNNReductionSpatialMeanGradientNode``).

The comparison and the reductions have no gradient in MPS (their gradient-node requests fail),
and none here: asking one of these nodes for its gradient filters raises a `ValueError` that
says so, and so does a training graph that reaches one. The spatial mean is the exception, as
in MPS: `ReductionSpatialMeanNode` has a gradient node, `ReductionSpatialMeanGradientNode`,
and training graphs walk through it. Set ``stop_gradient`` on the node's
``result_image`` to end a training graph's walk there. MPS has no node for the binary
reductions or the local correlation; use their kernels.
"""

from __future__ import annotations

from typing import Any, ClassVar

import mpsnn.cnn.reduce as red
from mpsnn.cnn.compare import Compare, ComparisonType
from mpsnn.cnn.gram import GramMatrixCalculation, GramMatrixCalculationGradient
from mpsnn.cnn.reduce_spatial import ReduceSpatialMean, ReduceSpatialMeanGradient
from mpsnn.core.descriptor import ImageDescriptor
from mpsnn.core.device import Device
from mpsnn.core.geometry import RECT_NO_CLIP, Region
from mpsnn.core.image import Image
from mpsnn.core.saved import Field
from mpsnn.graph.nodes import (
    FilterNode,
    ImageNode,
    UnaryGradientNode,
    UnaryNode,
    register_gradient_nodes,
)
from mpsnn.graph.step import _Step
from mpsnn.nodes.arithmetic import _ArithmeticNode

__all__ = [
    "ComparisonNode",
    "GramMatrixCalculationGradientNode",
    "GramMatrixCalculationNode",
    "ReductionColumnMaxNode",
    "ReductionColumnMeanNode",
    "ReductionColumnMinNode",
    "ReductionColumnSumNode",
    "ReductionFeatureChannelsArgumentMaxNode",
    "ReductionFeatureChannelsArgumentMinNode",
    "ReductionFeatureChannelsMaxNode",
    "ReductionFeatureChannelsMeanNode",
    "ReductionFeatureChannelsMinNode",
    "ReductionFeatureChannelsSumNode",
    "ReductionRowMaxNode",
    "ReductionRowMeanNode",
    "ReductionRowMinNode",
    "ReductionRowSumNode",
    "ReductionSpatialMeanGradientNode",
    "ReductionSpatialMeanNode",
    "UnaryReductionNode",
]


# -- Gram matrix ------------------------------------------------------------------------------


class GramMatrixCalculationNode(UnaryNode):
    """The Gram matrix of each image (MPS ``MPSNNGramMatrixCalculationNode``; see
    `GramMatrixCalculation`).

    Args:
        source: the image node.
        alpha: the scale of the result (default 1).

    Attributes:
        property_call_back: None, or an object whose ``alpha(source_image, destination_image)``
            returns the ``alpha`` of each encode (MPS ``MPSNNGramMatrixCallback``), e.g.
            ``1 / (C * H * W)``. It is called with the source `Image` (the batch) and the
            result's `ImageDescriptor` (the result is allocated by the encode itself); the
            gradient uses the same ``alpha``.
    """

    saved_fields = (Field("alpha", float),)
    code_attributes = ("property_call_back",)

    def __init__(self, source: ImageNode, alpha: float = 1.0) -> None:
        super().__init__(source)
        GramMatrixCalculation(Device("cpu"), alpha)  # checks alpha now
        self._alpha = float(alpha)
        self.property_call_back: Any = None

    @property
    def alpha(self) -> float:
        return self._alpha

    def _make_kernel(self, device: Device) -> Any:
        k = GramMatrixCalculation(device, self._alpha)
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device) -> Any:
        return GramMatrixCalculationGradient(device, self._alpha)

    def _run(self, step: _Step, kernel: Any) -> None:
        callback = self.property_call_back
        if callback is not None:
            src: Image = step.image(self._sources[0]).image
            desc: ImageDescriptor = kernel.destination_image_descriptor([src])
            kernel.alpha = callback.alpha(src, desc)
        super()._run(step, kernel)


class GramMatrixCalculationGradientNode(UnaryGradientNode, gradient_of=GramMatrixCalculationNode):
    """The gradient of a `GramMatrixCalculationNode` (MPS
    ``MPSNNGramMatrixCalculationGradientNode``): reads the forward source; its ``alpha`` is the
    forward's (also when a ``property_call_back`` chose it)."""

    @property
    def alpha(self) -> float:
        return self._forward.alpha

    def _run(self, step: _Step, kernel: Any) -> None:
        kernel.alpha = step.graph._plan.kernels[self._forward._id].alpha
        super()._run(step, kernel)


def _no_gradient(forward: FilterNode, incoming: list[ImageNode]) -> list[Any]:
    raise ValueError(
        f"[{type(forward).__name__}] this filter has no gradient (MPS defines none); set "
        "stop_gradient on its result_image to end the training graph there, got a request "
        "for its gradient filters"
    )


# -- comparison ---------------------------------------------------------------------------------


class ComparisonNode(_ArithmeticNode):
    """Elementwise comparison of ``left`` and ``right`` (MPS ``MPSNNComparisonNode``; see
    `Compare`): 1 where it holds, 0 elsewhere. ``comparison_type`` (default EQUAL),
    ``threshold`` and the arithmetic attributes (scales, bias, clamp, strides) are set on the
    node. No gradient."""

    _kernel_class = Compare
    _has_state = False
    _properties = (*_ArithmeticNode._properties, "comparison_type", "threshold")
    _defaults: ClassVar[dict[str, Any]] = {
        "comparison_type": ComparisonType.EQUAL,
        "threshold": 0.0,
    }

    def __getattr__(self, name: str) -> Any:
        # the kernel properties set on the node live in ``properties`` (see _ArithmeticNode)
        if name in type(self)._properties:
            props = self.__dict__.get("properties", {})
            if name in props:
                return props[name]
            if name in self._defaults:
                return self._defaults[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")


register_gradient_nodes(ComparisonNode, _no_gradient)


# -- reductions -----------------------------------------------------------------------------------


class UnaryReductionNode(UnaryNode):
    """Base of the reduction nodes (MPS ``MPSNNUnaryReductionNode``): ``clip_rect_source``
    (default `RECT_NO_CLIP`) is set on the kernel. No gradient."""

    _kernel_class: type = red.ReduceRowMin
    _has_state = False
    saved_fields = (Field("clip_rect_source", Region, init=False),)

    def __init__(self, source: ImageNode) -> None:
        super().__init__(source)
        self.clip_rect_source: Region = RECT_NO_CLIP

    def _make_kernel(self, device: Device) -> Any:
        k = self._kernel_class(device)
        k.clip_rect_source = self.clip_rect_source
        self._configure(k)
        return k


def _reduction_node(name: str, kernel: type) -> type:
    doc = f"A `{kernel.__name__}` (MPS ``MPSNN{name}``). No gradient."
    fields = UnaryReductionNode.saved_fields  # each class declares them itself
    body = {"__doc__": doc, "_kernel_class": kernel, "saved_fields": fields}
    return type(name, (UnaryReductionNode,), body)


ReductionRowMinNode = _reduction_node("ReductionRowMinNode", red.ReduceRowMin)
ReductionRowMaxNode = _reduction_node("ReductionRowMaxNode", red.ReduceRowMax)
ReductionRowMeanNode = _reduction_node("ReductionRowMeanNode", red.ReduceRowMean)
ReductionRowSumNode = _reduction_node("ReductionRowSumNode", red.ReduceRowSum)
ReductionColumnMinNode = _reduction_node("ReductionColumnMinNode", red.ReduceColumnMin)
ReductionColumnMaxNode = _reduction_node("ReductionColumnMaxNode", red.ReduceColumnMax)
ReductionColumnMeanNode = _reduction_node("ReductionColumnMeanNode", red.ReduceColumnMean)
ReductionColumnSumNode = _reduction_node("ReductionColumnSumNode", red.ReduceColumnSum)
ReductionFeatureChannelsMinNode = _reduction_node(
    "ReductionFeatureChannelsMinNode", red.ReduceFeatureChannelsMin
)
ReductionFeatureChannelsMaxNode = _reduction_node(
    "ReductionFeatureChannelsMaxNode", red.ReduceFeatureChannelsMax
)
ReductionFeatureChannelsMeanNode = _reduction_node(
    "ReductionFeatureChannelsMeanNode", red.ReduceFeatureChannelsMean
)
ReductionFeatureChannelsArgumentMinNode = _reduction_node(
    "ReductionFeatureChannelsArgumentMinNode", red.ReduceFeatureChannelsArgumentMin
)
ReductionFeatureChannelsArgumentMaxNode = _reduction_node(
    "ReductionFeatureChannelsArgumentMaxNode", red.ReduceFeatureChannelsArgumentMax
)


class ReductionFeatureChannelsSumNode(UnaryReductionNode):
    """A `ReduceFeatureChannelsSum` (MPS ``MPSNNReductionFeatureChannelsSumNode``): ``weight``
    (default 1) is set on the kernel. No gradient."""

    _kernel_class = red.ReduceFeatureChannelsSum
    saved_fields = (*UnaryReductionNode.saved_fields, Field("weight", float, init=False))

    def __init__(self, source: ImageNode) -> None:
        super().__init__(source)
        self.weight = 1.0

    def _make_kernel(self, device: Device) -> Any:
        k = super()._make_kernel(device)
        k.weight = self.weight
        return k


register_gradient_nodes(UnaryReductionNode, _no_gradient)


class ReductionSpatialMeanNode(UnaryReductionNode):
    """A `ReduceSpatialMean` (MPS ``MPSNNReductionSpatialMeanNode``): the mean over x and y of
    each channel, a 1x1 result per image; ``clip_rect_source`` as for every reduction node.
    Unlike the other reductions it has a gradient (`ReductionSpatialMeanGradientNode`), so a
    training graph walks through it."""

    _kernel_class = ReduceSpatialMean
    _has_state = True
    saved_fields = UnaryReductionNode.saved_fields

    def _gradient_kernel(self, device: Device) -> Any:
        return ReduceSpatialMeanGradient(device)


class ReductionSpatialMeanGradientNode(UnaryGradientNode, gradient_of=ReductionSpatialMeanNode):
    """The gradient of a `ReductionSpatialMeanNode` (MPS
    ``MPSNNReductionSpatialMeanGradientNode``; kernel `ReduceSpatialMeanGradient`): the incoming
    1x1 gradient divided by the number of pixels averaged, on each of them; reads the forward
    source."""
