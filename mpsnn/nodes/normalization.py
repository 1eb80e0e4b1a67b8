"""The normalization nodes (MPS ``MPSCNNBatchNormalizationNode``,
``MPSCNNInstanceNormalizationNode``, ``MPSCNNGroupNormalizationNode``, the local
normalization nodes) and their gradient nodes."""

from __future__ import annotations

from typing import Any

import mpsnn.cnn.local_normalization as local
import mpsnn.cnn.normalization as norm
from mpsnn.cnn.neuron_descriptor import NeuronDescriptor
from mpsnn.cnn.normalization.data_sources import (
    BatchNormalizationDataSource,
    GroupNormalizationDataSource,
    InstanceNormalizationDataSource,
)
from mpsnn.core.device import Device
from mpsnn.core.saved import Field
from mpsnn.graph.nodes import (
    ImageNode,
    UnaryGradientNode,
    UnaryNode,
    _TrainableNode,
)
from mpsnn.graph.step import _shape_only, _Step

__all__ = [
    "BatchNormalizationGradientNode",
    "BatchNormalizationNode",
    "CrossChannelNormalizationGradientNode",
    "CrossChannelNormalizationNode",
    "GroupNormalizationGradientNode",
    "GroupNormalizationNode",
    "InstanceNormalizationGradientNode",
    "InstanceNormalizationNode",
    "LocalContrastNormalizationGradientNode",
    "LocalContrastNormalizationNode",
    "SpatialNormalizationGradientNode",
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
    normalizes_inside_sum = True
    updates_running_statistics = True
    saved_fields = (
        Field("data_source", BatchNormalizationDataSource),
        # what a graph sets while it makes the kernels (None otherwise)
        Field("fused_neuron", NeuronDescriptor, init=False, optional=True, attr="_neuron"),
    )

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

    def _plain_normalization(self) -> bool:
        """Whether a residual sum may run this node's normalization inside its command: this
        class's `_run` and `_make_kernel` (a subclass may run or make its kernel otherwise)
        and no padding policy (which may move what the normalization reads)."""
        own = type(self)
        return (
            own._run is BatchNormalizationNode._run
            and own._make_kernel is BatchNormalizationNode._make_kernel
            and self.padding_policy is None
        )

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
        if self._id in step.graph._plan.fusion.normalized_by:
            # the addition after it normalizes inside its own command (`_normalized_sums`);
            # until then the result is a stand-in of its shape (its gradient reads only that)
            step.deferred[self._id] = (bn, x, state)
            step.set_image(self.result_image, _shape_only(x))
        else:
            step.set_image(self.result_image, bn.encode_batch(step.cb, x, state))
        step.set_state(self.result_state, [state] * len(x))

    def _gradient_kernel(self, device: Device) -> Any:
        return (
            norm.BatchNormalizationStatisticsGradient(device, self._neuron),
            norm.BatchNormalizationGradient(device, self._neuron),
        )


class InstanceNormalizationNode(_TrainableNode):
    """Instance normalization (MPS ``MPSCNNInstanceNormalizationNode``)."""

    updates_from_image_states = True
    saved_fields = (Field("data_source", InstanceNormalizationDataSource),)

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
    saved_fields = (Field("data_source", GroupNormalizationDataSource),)


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


# -- gradient nodes --------------------------------------------------------------------------


class BatchNormalizationGradientNode(UnaryGradientNode, gradient_of=BatchNormalizationNode):
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


class InstanceNormalizationGradientNode(UnaryGradientNode, gradient_of=InstanceNormalizationNode):
    """The gradient node of `InstanceNormalizationNode`
    (MPS ``MPSCNNInstanceNormalizationGradientNode``)."""


class GroupNormalizationGradientNode(UnaryGradientNode, gradient_of=GroupNormalizationNode):
    """The gradient node of `GroupNormalizationNode`
    (MPS ``MPSCNNGroupNormalizationGradientNode``)."""


class SpatialNormalizationGradientNode(UnaryGradientNode, gradient_of=SpatialNormalizationNode):
    """The gradient node of `SpatialNormalizationNode`
    (MPS ``MPSCNNSpatialNormalizationGradientNode``)."""


class LocalContrastNormalizationGradientNode(
    UnaryGradientNode, gradient_of=LocalContrastNormalizationNode
):
    """The gradient node of `LocalContrastNormalizationNode`
    (MPS ``MPSCNNLocalContrastNormalizationGradientNode``)."""


class CrossChannelNormalizationGradientNode(
    UnaryGradientNode, gradient_of=CrossChannelNormalizationNode
):
    """The gradient node of `CrossChannelNormalizationNode`
    (MPS ``MPSCNNCrossChannelNormalizationGradientNode``)."""
