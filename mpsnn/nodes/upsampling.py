"""The upsampling nodes (MPS ``MPSCNNUpsamplingNearestNode``, ``MPSCNNUpsamplingBilinearNode``)
and their gradient nodes."""

from __future__ import annotations

from typing import Any

import mpsnn.cnn.upsampling as up
from mpsnn.core.device import Device
from mpsnn.core.saved import Field
from mpsnn.graph.nodes import (
    ImageNode,
    UnaryGradientNode,
    UnaryNode,
)

__all__ = [
    "UpsamplingBilinearGradientNode",
    "UpsamplingBilinearNode",
    "UpsamplingNearestGradientNode",
    "UpsamplingNearestNode",
]


_FACTORS = (
    Field("integer_scale_factor_x", int, minimum=1),
    Field("integer_scale_factor_y", int, minimum=1),
)


class UpsamplingNearestNode(UnaryNode):
    """Nearest upsampling by integer factors (MPS ``MPSCNNUpsamplingNearestNode``)."""

    saved_fields = _FACTORS

    def __init__(
        self, source: ImageNode, integer_scale_factor_x: int, integer_scale_factor_y: int
    ) -> None:
        super().__init__(source)
        self.integer_scale_factor_x = integer_scale_factor_x
        self.integer_scale_factor_y = integer_scale_factor_y

    def _make_kernel(self, device: Device) -> Any:
        k = up.UpsamplingNearest(device, self.integer_scale_factor_x, self.integer_scale_factor_y)
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device) -> Any:
        return up.UpsamplingNearestGradient(
            device, self.integer_scale_factor_x, self.integer_scale_factor_y
        )


class UpsamplingBilinearNode(UpsamplingNearestNode):
    """Bilinear upsampling (MPS ``MPSCNNUpsamplingBilinearNode``)."""

    saved_fields = (*_FACTORS, Field("align_corners", bool))

    def __init__(
        self,
        source: ImageNode,
        integer_scale_factor_x: int,
        integer_scale_factor_y: int,
        align_corners: bool = False,
    ) -> None:
        super().__init__(source, integer_scale_factor_x, integer_scale_factor_y)
        self.align_corners = align_corners

    def _make_kernel(self, device: Device) -> Any:
        k = up.UpsamplingBilinear(
            device, self.integer_scale_factor_x, self.integer_scale_factor_y, self.align_corners
        )
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device) -> Any:
        return up.UpsamplingBilinearGradient(
            device, self.integer_scale_factor_x, self.integer_scale_factor_y
        )


class UpsamplingNearestGradientNode(UnaryGradientNode, gradient_of=UpsamplingNearestNode):
    """The gradient node of `UpsamplingNearestNode`
    (MPS ``MPSCNNUpsamplingNearestGradientNode``)."""


class UpsamplingBilinearGradientNode(UnaryGradientNode, gradient_of=UpsamplingBilinearNode):
    """The gradient node of `UpsamplingBilinearNode`
    (MPS ``MPSCNNUpsamplingBilinearGradientNode``)."""
