"""Forward filter nodes of the image families (MPS ``MPSCNN…Node`` / ``MPSNN…Node``).

Each node's constructor is its kernel's, with the source(s) first. A node makes its kernel
when a graph binds it (``_make_kernel``) and, for the training graph, the gradient kernel that
differentiates it (``_gradient_kernel``); the gradient nodes are in `mpsnn.graph.gradient_nodes`.

The neuron nodes (`NeuronNode`, `NeuronReLUNode`, ...) are in `mpsnn.graph.neuron_nodes`;
`UnaryNode`, the base of the one-source filters, is in `mpsnn.graph.nodes` (both modules build
on it without importing this one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mpsnn.cnn.arithmetic as arith
import mpsnn.cnn.convolution as conv
import mpsnn.cnn.dropout as drop
import mpsnn.cnn.pooling as pool
import mpsnn.cnn.shape as shape
import mpsnn.cnn.softmax as softmax
import mpsnn.cnn.upsampling as up
from mpsnn.core._checks import check_positive
from mpsnn.core.device import Device
from mpsnn.core.geometry import EdgeMode, ImageCoordinate, Size
from mpsnn.core.image_batch import ImageBatch
from mpsnn.graph.nodes import FilterNode, ImageNode, UnaryNode
from mpsnn.graph.step import _Step

__all__ = [
    "AdditionNode",
    "ConcatenationNode",
    "ConvolutionNode",
    "ConvolutionTransposeNode",
    "DilatedPoolingMaxNode",
    "DivisionNode",
    "DropoutNode",
    "FullyConnectedNode",
    "LogSoftMaxNode",
    "MultiplicationNode",
    "PadNode",
    "PoolingAverageNode",
    "PoolingL2NormNode",
    "PoolingMaxNode",
    "ReshapeNode",
    "SliceNode",
    "SoftMaxNode",
    "SubtractionNode",
    "UpsamplingBilinearNode",
    "UpsamplingNearestNode",
]


# -- convolution family ------------------------------------------------------------------


class _TrainableNode(UnaryNode):
    """A node whose kernel has a data source that a training step updates."""

    def __init__(self, source: ImageNode, data_source: Any) -> None:
        super().__init__(source)
        self._data_source = data_source

    @property
    def data_source(self) -> Any:
        return self._data_source

    @property
    def training_style(self) -> Any:
        """The data source's ``training_style`` (where the graph runs the update)."""
        return getattr(self._data_source, "training_style", None)


class ConvolutionNode(_TrainableNode):
    """A convolution (MPS ``MPSCNNConvolutionNode``); ``data_source`` gives the weights."""

    _kernel_class: type = conv.Convolution
    _gradient_class: type = conv.ConvolutionGradient
    fuses_neuron = True
    records_fused_neuron = True
    gradient_fuses_relu_gradient = True
    makes_state_for_forward_readers = True

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


class ConvolutionTransposeNode(ConvolutionNode):
    """A convolution transpose (MPS ``MPSCNNConvolutionTransposeNode``); given the
    ``convolution_gradient_state`` of a convolution node, it undoes that convolution's size."""

    _kernel_class = conv.ConvolutionTranspose
    _gradient_class = conv.ConvolutionTransposeGradient

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


# -- pooling ------------------------------------------------------------------------------


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


class PoolingAverageNode(_PoolingNode):
    """Average pooling (MPS ``MPSCNNPoolingAverageNode``)."""

    _kernel_class = pool.PoolingAverage
    _gradient_class = pool.PoolingAverageGradient


class PoolingL2NormNode(_PoolingNode):
    """L2-norm pooling (MPS ``MPSCNNPoolingL2NormNode``)."""

    _kernel_class = pool.PoolingL2Norm
    _gradient_class = pool.PoolingL2NormGradient


class DilatedPoolingMaxNode(_PoolingNode):
    """Dilated max pooling (MPS ``MPSCNNDilatedPoolingMaxNode``): ``filter_size`` sets kernel
    = stride = dilation, as MPS's convenience constructor does."""

    _kernel_class = pool.DilatedPoolingMax
    _gradient_class = pool.DilatedPoolingMaxGradient

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


# -- softmax, dropout, upsampling ---------------------------------------------------------------


class SoftMaxNode(UnaryNode):
    """Softmax over the feature channels (MPS ``MPSCNNSoftMaxNode``)."""

    _kernel_class: type = softmax.SoftMax
    _gradient_class: type = softmax.SoftMaxGradient

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


class DropoutNode(UnaryNode):
    """Dropout (MPS ``MPSCNNDropoutNode``): a new mask at every encode (its key advances on
    the device); in a graph with no gradient consumer it is the identity."""

    identity_in_inference = True

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


class UpsamplingNearestNode(UnaryNode):
    """Nearest upsampling by integer factors (MPS ``MPSCNNUpsamplingNearestNode``)."""

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


# -- shape ----------------------------------------------------------------------------------


class SliceNode(UnaryNode):
    """Copy a region and channel range (MPS ``MPSNNSliceNode`` semantics of `Slice`): set
    ``offset``, ``source_feature_channel_offset`` and ``source_feature_channel_max_count``
    through the node's attributes of the same names."""

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


# -- arithmetic -----------------------------------------------------------------------------


class _ArithmeticNode(FilterNode):
    """Binary arithmetic (MPS ``MPSNNBinaryArithmeticNode``): ``left`` is the primary source.
    The kernel's scales, bias, clamp and strides are set through the node's attributes of the
    same names (``primary_scale``, ``secondary_scale``, ``bias``, ``minimum_value``,
    ``maximum_value``, ``primary_stride_in_feature_channels``, ...)."""

    _kernel_class: type = arith.Add
    _gradient_class: type = arith.Add
    fuses_neuron = True
    _properties = (
        "primary_scale", "secondary_scale", "bias", "minimum_value", "maximum_value",
        "primary_stride_in_feature_channels", "secondary_stride_in_feature_channels",
        "primary_stride_in_pixels_x", "primary_stride_in_pixels_y",
        "secondary_stride_in_pixels_x", "secondary_stride_in_pixels_y",
    )  # fmt: skip

    def __init__(self, left: ImageNode, right: ImageNode) -> None:
        super().__init__([left, right])
        self.properties: dict[str, Any] = {}

    @classmethod
    def from_sources(cls, sources: Sequence[ImageNode]) -> _ArithmeticNode:
        if len(sources) != 2:
            raise ValueError(f"[{cls.__name__}] needs 2 sources, got {len(sources)}")
        return cls(sources[0], sources[1])

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._properties:
            self.properties[name] = value
        else:
            object.__setattr__(self, name, value)

    def _make_kernel(self, device: Device) -> Any:
        k = self._kernel_class(device)
        for name, value in self.properties.items():
            setattr(k, name, value)
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device, secondary: bool) -> Any:
        from mpsnn.core.registry import gradient_kernels_of

        (grad,) = gradient_kernels_of(self._kernel_class)
        return grad(device, secondary)

    def _run(self, step: _Step, kernel: Any) -> None:
        a, b = step.image(self._sources[0]), step.image(self._sources[1])
        states = kernel.result_state_batch(a, b) if step.training(self) else None
        y = kernel.encode_batch(step.cb, a, b, destination_states=states)
        step.set_image(self.result_image, y)
        if states is not None:
            step.set_state(self.result_state, states)


class AdditionNode(_ArithmeticNode):
    """``left + right`` (MPS ``MPSNNAdditionNode``)."""

    _kernel_class = arith.Add


class SubtractionNode(_ArithmeticNode):
    """``left - right`` (MPS ``MPSNNSubtractionNode``)."""

    _kernel_class = arith.Subtract


class MultiplicationNode(_ArithmeticNode):
    """``left * right`` (MPS ``MPSNNMultiplicationNode``)."""

    _kernel_class = arith.Multiply


class DivisionNode(_ArithmeticNode):
    """``left / right`` (MPS ``MPSNNDivisionNode``; its gradient is an mpsnn extension)."""

    _kernel_class = arith.Divide
