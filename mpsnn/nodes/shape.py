"""The shape nodes (MPS ``MPSNNSliceNode``, ``MPSNNReshapeNode``, ``MPSNNPadNode``,
``MPSNNConcatenationNode``) and their gradient nodes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mpsnn.cnn.shape as shape
from mpsnn.core.device import Device
from mpsnn.core.geometry import EdgeMode, ImageCoordinate
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.saved import Field
from mpsnn.graph.nodes import (
    FilterNode,
    GradientFilterNode,
    ImageNode,
    UnaryGradientNode,
    UnaryNode,
    register_gradient_nodes,
)
from mpsnn.graph.step import _Step

__all__ = [
    "ConcatenationGradientNode",
    "ConcatenationNode",
    "PadGradientNode",
    "PadNode",
    "ReshapeGradientNode",
    "ReshapeNode",
    "SliceGradientNode",
    "SliceNode",
]


class SliceNode(UnaryNode):
    """Copy a region and channel range (MPS ``MPSNNSliceNode`` semantics of `Slice`): set
    ``offset``, ``source_feature_channel_offset`` and ``source_feature_channel_max_count``
    through the node's attributes of the same names."""

    saved_fields = (
        Field("source_feature_channel_offset", int, minimum=0),
        Field("source_feature_channel_max_count", int, optional=True, minimum=1),
    )

    def __init__(
        self,
        source: ImageNode,
        source_feature_channel_offset: int = 0,
        source_feature_channel_max_count: int | None = None,
    ) -> None:
        super().__init__(source)
        self.source_feature_channel_offset = source_feature_channel_offset
        self.source_feature_channel_max_count = source_feature_channel_max_count

    def _make_kernel(self, device: Device) -> Any:
        k = shape.Slice(device)
        k.source_feature_channel_offset = self.source_feature_channel_offset
        if self.source_feature_channel_max_count is not None:
            k.source_feature_channel_max_count = self.source_feature_channel_max_count
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device) -> Any:
        return shape.SliceGradient(device)


class ReshapeNode(UnaryNode):
    """Reshape in the HWC order (MPS ``MPSNNReshapeNode``)."""

    def __init__(
        self, source: ImageNode, result_width: int, result_height: int, result_feature_channels: int
    ) -> None:
        super().__init__(source)
        self._shape = (result_width, result_height, result_feature_channels)

    def _make_kernel(self, device: Device) -> Any:
        k = shape.Reshape(device, *self._shape)
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device) -> Any:
        return shape.ReshapeGradient(device)


class PadNode(UnaryNode):
    """Pad in x, y and channels (MPS ``MPSNNPadNode``)."""

    def __init__(
        self,
        source: ImageNode,
        padding_size_before: ImageCoordinate | None = None,
        padding_size_after: ImageCoordinate | None = None,
        edge_mode: EdgeMode = EdgeMode.ZERO,
        fill_value: Any = 0.0,
    ) -> None:
        super().__init__(source)
        self._args = (padding_size_before, padding_size_after, fill_value)
        self.edge_mode = edge_mode

    def _make_kernel(self, device: Device) -> Any:
        k = shape.Pad(device, *self._args)
        k.edge_mode = self.edge_mode
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device) -> Any:
        return shape.PadGradient(device)


class ConcatenationNode(FilterNode):
    """Concatenate images along the feature channels, back to back (MPS
    ``MPSNNConcatenationNode``, without MPS's padding of each input to 4 channels). Its
    gradient is one slice of the incoming gradient per input."""

    _has_state = False

    def __init__(self, sources: Sequence[ImageNode]) -> None:
        if len(sources) < 1:
            raise ValueError("[ConcatenationNode] needs at least one source, got none")
        super().__init__(sources)

    def _make_kernel(self, device: Device) -> Any:
        return tuple(shape.Slice(device) for _ in self._sources)

    def _run(self, step: _Step, kernels: Any) -> None:
        from mpsnn.core.descriptor import ImageDescriptor
        from mpsnn.core.image import Image

        parts = [step.image(s) for s in self._sources]
        n, _, h, w = parts[0].shape
        for i, p in enumerate(parts):
            if p.shape[0] != n or p.shape[2:] != (h, w):
                raise ValueError(
                    f"[ConcatenationNode] every input must be {w}x{h} with {n} images, input {i} "
                    f"is {p.shape[3]}x{p.shape[2]} with {p.shape[0]}"
                )
        c = sum(p.shape[1] for p in parts)
        desc = ImageDescriptor(parts[0].feature_channel_format, w, h, c, n)
        # the node the planner allocates this image for (an inference dropout's kept result)
        node = step.graph._plan.liveness.alloc_nodes.get(self.result_image._id, self.result_image)
        out = step.graph._allocate(step.cb, node, desc)
        if not isinstance(out, Image):
            out = out.image
        offset, ranges = 0, []
        for k, p in zip(kernels, parts, strict=True):
            k.destination_feature_channel_offset = offset
            k.encode_batch(step.cb, p, ImageBatch(out))
            ranges.append((offset, p.shape[1]))
            offset += p.shape[1]
        step.set_image(self.result_image, ImageBatch(out))
        step.states[self._id] = ranges  # where each input's channels are, for the gradient


class SliceGradientNode(UnaryGradientNode, gradient_of=SliceNode):
    """The gradient node of `SliceNode` (MPS ``MPSCNNSliceGradientNode``)."""


class ReshapeGradientNode(UnaryGradientNode, gradient_of=ReshapeNode):
    """The gradient node of `ReshapeNode` (MPS ``MPSCNNReshapeGradientNode``)."""


class PadGradientNode(UnaryGradientNode, gradient_of=PadNode):
    """The gradient node of `PadNode` (MPS ``MPSCNNPadGradientNode``)."""


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


register_gradient_nodes(
    ConcatenationNode,
    lambda f, g: [ConcatenationGradientNode(g[0], f, i) for i in range(len(f.source_images))],
)
