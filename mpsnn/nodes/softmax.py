"""The softmax nodes (MPS ``MPSCNNSoftMaxNode``, ``MPSCNNLogSoftMaxNode``) and their gradient
nodes, which read the forward result."""

from __future__ import annotations

from typing import Any

import mpsnn.cnn.softmax as softmax
from mpsnn.core.device import Device
from mpsnn.graph.nodes import (
    UnaryGradientNode,
    UnaryNode,
)

__all__ = [
    "LogSoftMaxGradientNode",
    "LogSoftMaxNode",
    "SoftMaxGradientNode",
    "SoftMaxNode",
]


class SoftMaxNode(UnaryNode):
    """Softmax over the feature channels (MPS ``MPSCNNSoftMaxNode``)."""

    _kernel_class: type = softmax.SoftMax
    _gradient_class: type = softmax.SoftMaxGradient
    saved_fields = ()  # its source and what every node saves

    def _make_kernel(self, device: Device) -> Any:
        k = self._kernel_class(device)
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device) -> Any:
        return self._gradient_class(device)


class LogSoftMaxNode(SoftMaxNode):
    """Log-softmax over the feature channels (MPS ``MPSCNNLogSoftMaxNode``)."""

    _kernel_class = softmax.LogSoftMax
    _gradient_class = softmax.LogSoftMaxGradient
    saved_fields = ()


class SoftMaxGradientNode(UnaryGradientNode, gradient_of=SoftMaxNode):
    """The gradient node of `SoftMaxNode` (MPS ``MPSCNNSoftMaxGradientNode``)."""

    _reads_result = True


class LogSoftMaxGradientNode(UnaryGradientNode, gradient_of=LogSoftMaxNode):
    """The gradient node of `LogSoftMaxNode` (MPS ``MPSCNNLogSoftMaxGradientNode``)."""

    _reads_result = True
