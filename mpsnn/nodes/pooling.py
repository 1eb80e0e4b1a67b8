"""The pooling nodes (MPS ``MPSCNNPoolingMaxNode``, ``MPSCNNPoolingAverageNode``,
``MPSCNNPoolingL2NormNode``, ``MPSCNNDilatedPoolingMaxNode``) and their gradient nodes."""

from __future__ import annotations

from typing import Any

import mpsnn.cnn.pooling as pool
from mpsnn.core._checks import check_positive
from mpsnn.core.device import Device
from mpsnn.core.geometry import EdgeMode
from mpsnn.core.saved import Field
from mpsnn.graph.nodes import (
    ImageNode,
    UnaryGradientNode,
    UnaryNode,
)

__all__ = [
    "DilatedPoolingMaxGradientNode",
    "DilatedPoolingMaxNode",
    "PoolingAverageGradientNode",
    "PoolingAverageNode",
    "PoolingL2NormGradientNode",
    "PoolingL2NormNode",
    "PoolingMaxGradientNode",
    "PoolingMaxNode",
]


#: what a pooling node saves: its sizes (the constructor's keywords) and edge mode
_POOLING_FIELDS = (
    Field("kernel_width", int, minimum=1),
    Field("kernel_height", int, minimum=1),
    Field("stride_in_pixels_x", int, minimum=1),
    Field("stride_in_pixels_y", int, minimum=1),
    Field("edge_mode", EdgeMode, init=False),
)


class _PoolingNode(UnaryNode):
    """Pooling nodes: ``filter_size`` sets kernel = stride (MPS ``nodeWithSource:filterSize:``);
    graph pooling nodes default to CLAMP edges, as in MPS."""

    _kernel_class: type = pool.PoolingMax
    _gradient_class: type = pool.PoolingMaxGradient

    def __init__(
        self,
        source: ImageNode,
        filter_size: int = 2,
        stride: int | None = None,
        *,
        kernel_width: int | None = None,
        kernel_height: int | None = None,
        stride_in_pixels_x: int | None = None,
        stride_in_pixels_y: int | None = None,
    ) -> None:
        super().__init__(source)
        who = type(self).__name__
        size = check_positive(who, "filter_size", filter_size)
        step = size if stride is None else check_positive(who, "stride", stride)
        self.kernel_width = kernel_width or size
        self.kernel_height = kernel_height or size
        self.stride_in_pixels_x = stride_in_pixels_x or step
        self.stride_in_pixels_y = stride_in_pixels_y or step
        self.edge_mode = EdgeMode.CLAMP

    def _args(self) -> tuple[int, ...]:
        return (self.kernel_width, self.kernel_height, self.stride_in_pixels_x,
                self.stride_in_pixels_y)  # fmt: skip

    def _make_kernel(self, device: Device) -> Any:
        k = self._kernel_class(device, *self._args())
        k.edge_mode = self.edge_mode
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device) -> Any:
        return self._gradient_class(device, *self._args())


class PoolingMaxNode(_PoolingNode):
    """Max pooling (MPS ``MPSCNNPoolingMaxNode``)."""

    saved_fields = _POOLING_FIELDS


class PoolingAverageNode(_PoolingNode):
    """Average pooling (MPS ``MPSCNNPoolingAverageNode``)."""

    _kernel_class = pool.PoolingAverage
    _gradient_class = pool.PoolingAverageGradient
    saved_fields = _POOLING_FIELDS


class PoolingL2NormNode(_PoolingNode):
    """L2-norm pooling (MPS ``MPSCNNPoolingL2NormNode``)."""

    _kernel_class = pool.PoolingL2Norm
    _gradient_class = pool.PoolingL2NormGradient
    saved_fields = _POOLING_FIELDS


class DilatedPoolingMaxNode(_PoolingNode):
    """Dilated max pooling (MPS ``MPSCNNDilatedPoolingMaxNode``): ``filter_size`` sets kernel
    = stride = dilation, as MPS's convenience constructor does."""

    _kernel_class = pool.DilatedPoolingMax
    _gradient_class = pool.DilatedPoolingMaxGradient
    saved_fields = (
        *_POOLING_FIELDS[:4],
        Field("dilation_rate_x", int, init=False, minimum=1),
        Field("dilation_rate_y", int, init=False, minimum=1),
        _POOLING_FIELDS[4],
    )

    def __init__(
        self,
        source: ImageNode,
        filter_size: int = 2,
        stride: int | None = None,
        dilation_rate: int | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(source, filter_size, stride, **kw)
        d = filter_size if dilation_rate is None else dilation_rate
        self.dilation_rate_x = self.dilation_rate_y = check_positive(
            "DilatedPoolingMaxNode", "dilation_rate", d
        )

    def _args(self) -> tuple[int, ...]:
        return (self.kernel_width, self.kernel_height, self.dilation_rate_x,
                self.dilation_rate_y, self.stride_in_pixels_x, self.stride_in_pixels_y)  # fmt: skip


class PoolingMaxGradientNode(UnaryGradientNode, gradient_of=PoolingMaxNode):
    """The gradient node of `PoolingMaxNode` (MPS ``MPSCNNPoolingMaxGradientNode``)."""


class PoolingAverageGradientNode(UnaryGradientNode, gradient_of=PoolingAverageNode):
    """The gradient node of `PoolingAverageNode` (MPS ``MPSCNNPoolingAverageGradientNode``)."""


class PoolingL2NormGradientNode(UnaryGradientNode, gradient_of=PoolingL2NormNode):
    """The gradient node of `PoolingL2NormNode` (MPS ``MPSCNNPoolingL2NormGradientNode``)."""


class DilatedPoolingMaxGradientNode(UnaryGradientNode, gradient_of=DilatedPoolingMaxNode):
    """The gradient node of `DilatedPoolingMaxNode`
    (MPS ``MPSCNNDilatedPoolingMaxGradientNode``)."""
