"""The dropout node (MPS ``MPSCNNDropoutNode``) and its gradient node."""

from __future__ import annotations

from typing import Any

import mpsnn.cnn.dropout as drop
from mpsnn.core.device import Device
from mpsnn.core.geometry import Size
from mpsnn.core.saved import Field
from mpsnn.graph.nodes import (
    ImageNode,
    UnaryGradientNode,
    UnaryNode,
)
from mpsnn.graph.step import _Step

__all__ = [
    "DropoutGradientNode",
    "DropoutNode",
]


class DropoutNode(UnaryNode):
    """Dropout (MPS ``MPSCNNDropoutNode``): a new mask at every encode (its key advances on
    the device); in a graph with no gradient consumer it is the identity."""

    identity_in_inference = True
    saved_fields = (
        Field("keep_probability", float),
        Field("seed", int, minimum=0),
        Field("mask_stride_in_pixels", Size),
    )

    def __init__(
        self,
        source: ImageNode,
        keep_probability: float = 0.5,
        seed: int = 0,
        mask_stride_in_pixels: Size | None = None,
    ) -> None:
        super().__init__(source)
        self.keep_probability = keep_probability
        self.seed = seed
        self.mask_stride_in_pixels = mask_stride_in_pixels or Size(1, 1, 1)
        drop.Dropout(Device("cpu"), keep_probability, seed, self.mask_stride_in_pixels)  # checks

    def _args(self) -> tuple[Any, ...]:
        return (self.keep_probability, self.seed, self.mask_stride_in_pixels)

    def _make_kernel(self, device: Device) -> Any:
        k = drop.Dropout(device, *self._args())
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device) -> Any:
        return drop.DropoutGradient(device, *self._args())

    def _run(self, step: _Step, kernel: Any) -> None:
        if not step.training(self):  # inference: the identity, no work, no copy
            step.set_image(self.result_image, step.image(self._sources[0]))
            return
        super()._run(step, kernel)


class DropoutGradientNode(UnaryGradientNode, gradient_of=DropoutNode):
    """The gradient node of `DropoutNode` (MPS ``MPSCNNDropoutGradientNode``)."""
