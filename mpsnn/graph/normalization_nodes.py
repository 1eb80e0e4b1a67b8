"""Normalization and loss nodes (MPS ``MPSCNNBatchNormalizationNode``,
``MPSCNNInstanceNormalizationNode``, ``MPSCNNGroupNormalizationNode``, the local
normalization nodes, ``MPSCNNLossNode``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mpsnn.cnn.local_normalization as local
import mpsnn.cnn.normalization as norm
from mpsnn.cnn.loss import Loss, LossDescriptor
from mpsnn.core._checks import check_type
from mpsnn.core.device import Device
from mpsnn.graph.forward_nodes import _TrainableNode
from mpsnn.graph.nodes import FilterNode, ImageNode, LabelsNode, UnaryNode
from mpsnn.graph.step import _Step

__all__ = [
    "BatchNormalizationNode",
    "CrossChannelNormalizationNode",
    "GroupNormalizationNode",
    "InstanceNormalizationNode",
    "LocalContrastNormalizationNode",
    "LossNode",
    "SpatialNormalizationNode",
]


class BatchNormalizationNode(_TrainableNode):
    """Batch normalization (MPS ``MPSCNNBatchNormalizationNode``). In a graph where a
    gradient node reads its state it runs in training mode (statistics of the batch, then the
    normalization); otherwise in inference mode on the data source's running statistics —
    one node recipe serves both graphs."""

    fuses_neuron = True
    records_fused_neuron = True
    gradient_applies_fused_neuron = True
    recomputes_result = True

    def __init__(self, source: ImageNode, data_source: Any) -> None:
        super().__init__(source, data_source)
        self._neuron: Any = None  # the fused neuron, only while a graph makes its kernels

    def _make_fused_kernel(self, device: Device, neuron: Any) -> Any:
        return self._with_neuron(neuron, lambda: self._make_kernel(device))

    def _make_fused_gradient_kernel(self, gradient: Any, device: Device, neuron: Any) -> Any:
        return self._with_neuron(neuron, lambda: gradient._make_kernel(device))

    def _with_neuron(self, neuron: Any, make: Any) -> Any:
        saved, self._neuron = self._neuron, neuron
        try:
            return make()
        finally:
            self._neuron = saved

    def _make_kernel(self, device: Device) -> Any:
        k = norm.BatchNormalization(device, self._data_source, self._neuron)
        self._configure(k)
        return (norm.BatchNormalizationStatistics(device), k)

    def _reads(self) -> list[tuple[ImageNode, int]]:
        return [(self._sources[0], 2)]  # statistics and normalization

    def _run(self, step: _Step, kernels: Any) -> None:
        stats, bn = kernels
        x = step.image(self._sources[0])
        if not step.training(self):
            step.set_image(self.result_image, bn.encode_batch(step.cb, x))
            return
        state = step.states_for(self, bn, x)[0]
        stats.encode_batch(step.cb, x, state)
        if step.collectives is not None:  # data parallel: the statistics of every process
            step.collectives.batch_norm_statistics(self, state)
        step.set_image(self.result_image, bn.encode_batch(step.cb, x, state))
        step.set_state(self.result_state, [state] * len(x))

    def _gradient_kernel(self, device: Device) -> Any:
        return (
            norm.BatchNormalizationStatisticsGradient(device, self._neuron),
            norm.BatchNormalizationGradient(device, self._neuron),
        )


class InstanceNormalizationNode(_TrainableNode):
    """Instance normalization (MPS ``MPSCNNInstanceNormalizationNode``)."""

    _kernel_class: type = norm.InstanceNormalization
    _gradient_class: type = norm.InstanceNormalizationGradient

    def _make_kernel(self, device: Device) -> Any:
        k = self._kernel_class(device, self._data_source)
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device) -> Any:
        return self._gradient_class(device)


class GroupNormalizationNode(InstanceNormalizationNode):
    """Group normalization (MPS ``MPSCNNGroupNormalizationNode``)."""

    _kernel_class = norm.GroupNormalization
    _gradient_class = norm.GroupNormalizationGradient


class _LocalNode(UnaryNode):
    """The local normalizations: parameters set as node attributes (MPS node defaults)."""

    _kernel_class: type = local.SpatialNormalization
    _gradient_class: type = local.SpatialNormalizationGradient
    _parameters: tuple[str, ...] = ("alpha", "beta", "delta")

    def __init__(self, source: ImageNode, *size: int, **parameters: Any) -> None:
        super().__init__(source)
        self._size = size
        probe = self._kernel_class(Device("cpu"), *size)  # validates the size
        for name in self._parameters:
            setattr(self, name, getattr(probe, name))
        for name, value in parameters.items():
            if name not in self._parameters:
                raise TypeError(
                    f"[{type(self).__name__}] unknown parameter {name!r}; "
                    f"it takes {self._parameters}"
                )
            setattr(self, name, value)

    def _set(self, k: Any) -> Any:
        for name in self._parameters:
            setattr(k, name, getattr(self, name))
        return k

    def _make_kernel(self, device: Device) -> Any:
        k = self._set(self._kernel_class(device, *self._size))
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device) -> Any:
        return self._set(self._gradient_class(device, *self._size))


class SpatialNormalizationNode(_LocalNode):
    """Spatial normalization (MPS ``MPSCNNSpatialNormalizationNode``):
    ``SpatialNormalizationNode(source, kernel_width, kernel_height)``."""


class LocalContrastNormalizationNode(_LocalNode):
    """Local contrast normalization (MPS ``MPSCNNLocalContrastNormalizationNode``); the node
    defaults ``alpha`` to 1 (the kernel to 0), as MPS does."""

    _kernel_class = local.LocalContrastNormalization
    _gradient_class = local.LocalContrastNormalizationGradient
    _parameters = ("alpha", "beta", "delta", "p0", "pm", "ps")

    def __init__(self, source: ImageNode, *size: int, **parameters: Any) -> None:
        super().__init__(source, *size, **({"alpha": 1.0} | parameters))


class CrossChannelNormalizationNode(_LocalNode):
    """Cross-channel (local response) normalization (MPS
    ``MPSCNNCrossChannelNormalizationNode``): ``CrossChannelNormalizationNode(source,
    kernel_size=5)``."""

    _kernel_class = local.CrossChannelNormalization
    _gradient_class = local.CrossChannelNormalizationGradient

    def __init__(self, source: ImageNode, kernel_size: int = 5, **parameters: Any) -> None:
        super().__init__(source, kernel_size, **parameters)


class LossNode(FilterNode):
    """A loss (MPS ``MPSCNNLossNode``): its result image **is** the gradient of the loss with
    respect to its source (the start of the training graph), and the loss goes into the
    labels (``input_labels``, a `LabelsNode`: a source state of the graph).

    Args:
        source: the predictions.
        loss_descriptor: a `LossDescriptor`.
    """

    _has_state = False

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
