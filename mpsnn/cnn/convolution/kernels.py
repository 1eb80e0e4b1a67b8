"""Forward convolution kernels: `Convolution`, `FullyConnected`, `ConvolutionTranspose`.

Shared by the three (`_ConvolutionBase`): the data source and descriptor, the master weights
(`ConvWeights`, updated in place), reloads and exports of weights (CPU path and command-buffer
path), the fused neuron (`FusedNeuron`), the accumulator precision option, and
``result_state`` (a `ConvolutionGradientState` shared by the whole batch). What an encode hands
its gradient is a typed `ConvolutionRecord`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mpsnn.cnn.convolution.data_source import (
    ConvolutionDataSource,
    ConvolutionWeightsAndBiasesState,
    read_data_source,
)
from mpsnn.cnn.convolution.descriptor import (
    ConvolutionAccumulatorPrecisionOption,
    ConvolutionDescriptor,
)
from mpsnn.cnn.convolution.state import ConvolutionGradientState, ConvolutionTransposeGradientState
from mpsnn.cnn.convolution.weights import ConvWeights
from mpsnn.cnn.neuron_descriptor import FusedNeuron
from mpsnn.core._checks import check_enum, check_int
from mpsnn.core.cnn_kernel import CNNKernel, Forward, Records
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.descriptor import ImageDescriptor
from mpsnn.core.device import Device
from mpsnn.core.encode import Encoding
from mpsnn.core.geometry import (
    AxisWindow,
    DestinationSpan,
    Offset,
    PaddingMethod,
    Window,
    padding_offset,
    remainder_first,
)
from mpsnn.core.grouped import check_grouped_reads, pair_copier
from mpsnn.core.image import Image
from mpsnn.core.layout import channels_last_only
from mpsnn.core.state import ForwardRecord, State
from mpsnn.ops.convolution import (
    ConvGeometry,
    conv_forward,
    conv_geometry,
    conv_transpose_forward,
    fc_forward,
)
from mpsnn.ops.neuron import relu_in_place

__all__ = [
    "Convolution",
    "ConvolutionRecord",
    "ConvolutionTranspose",
    "FullyConnected",
    "reload_weights_and_biases",
]


@dataclass(frozen=True, slots=True, eq=False)
class ConvolutionRecord:
    """What a convolution encode hands its gradient (the `ForwardRecord`'s ``params``).

    Attributes:
        descriptor: the convolution's shape (gradients must describe the same).
        weights: the kernel's master weights (the gradient reads them when it runs).
        geometry: the windows, edge mode and source preparation the forward used.
        neuron: the fused neuron, or None.
        stride: (y, x) strides (the transpose's gradient needs them).
    """

    descriptor: ConvolutionDescriptor
    weights: ConvWeights
    geometry: ConvGeometry
    neuron: FusedNeuron | None
    stride: tuple[int, int]


class _ConvolutionBase(CNNKernel):
    """Data source, master weights and their reload/export paths (see the module docstring)."""

    _gradient_state_class = ConvolutionGradientState
    _reused_across_batch = True
    # a training encode keeps the fused neuron's input for `NeuronGradient`; a graph whose
    # neuron gradient reads the result instead (`ReLUGradientOfResult`) turns this off
    _keep_preactivation = True

    def __init__(self, device: Device, weights: ConvolutionDataSource) -> None:
        who = type(self).__name__
        desc, w, b = read_data_source(who, weights)
        neuron = FusedNeuron.of(who, desc.fused_neuron_descriptor)
        super().__init__(
            device,
            kernel_width=desc.kernel_width,
            kernel_height=desc.kernel_height,
            stride_in_pixels_x=desc.stride_in_pixels_x,
            stride_in_pixels_y=desc.stride_in_pixels_y,
            dilation_rate_x=desc.dilation_rate_x,
            dilation_rate_y=desc.dilation_rate_y,
        )
        self._neuron = neuron
        self._data_source = weights
        self._descriptor = desc
        self._weights = ConvWeights.from_ohwi(w, b, device)
        self._precision = ConvolutionAccumulatorPrecisionOption.FLOAT

    # -- properties ---------------------------------------------------------------------

    @property
    def data_source(self) -> ConvolutionDataSource:
        return self._data_source

    @property
    def descriptor(self) -> ConvolutionDescriptor:
        """A copy of the convolution's descriptor."""
        return self._descriptor.copy()

    @property
    def input_feature_channels(self) -> int:
        return self._descriptor.input_feature_channels

    @property
    def output_feature_channels(self) -> int:
        return self._descriptor.output_feature_channels

    @property
    def groups(self) -> int:
        return self._descriptor.groups

    @property
    def sub_pixel_scale_factor(self) -> int:
        return 1

    @property
    def channel_multiplier(self) -> int:
        """0: an ordinary (grouped or depthwise) convolution."""
        return 0

    @property
    def fused_neuron_descriptor(self) -> Any:
        return self._descriptor.fused_neuron_descriptor

    @property
    def accumulator_precision_option(self) -> ConvolutionAccumulatorPrecisionOption:
        return self._precision

    @accumulator_precision_option.setter
    def accumulator_precision_option(self, value: ConvolutionAccumulatorPrecisionOption) -> None:
        self._precision = check_enum(
            type(self).__name__,
            "accumulator_precision_option",
            value,
            ConvolutionAccumulatorPrecisionOption,
        )

    @property
    def weights(self) -> torch.Tensor:
        """The master weights in OHWI, as a view to read. Change them by reloading: their
        float16/bfloat16 copies are rewritten only by reloads (see `ConvWeights`)."""
        return self._weights.ohwi

    @property
    def biases(self) -> torch.Tensor | None:
        """The master biases ``(O,)`` (None when the layer has none)."""
        return self._weights.bias

    # -- weights ------------------------------------------------------------------------

    def reload_weights_and_biases_from_data_source(self) -> None:
        """CPU path: copy the data source's current values into the master weights, in place,
        now (MPS ``reloadWeightsAndBiasesFromDataSource``).

        On CUDA the copy is ordered on the current stream: work already committed there reads
        the old values, work committed afterwards the new ones.
        """
        desc, w, b = read_data_source(type(self).__name__, self._data_source)
        if desc != self._descriptor:
            raise ValueError(
                f"[{type(self).__name__}] the data source's descriptor must not change, "
                f"got {desc!r} instead of {self._descriptor!r}"
            )
        dev = self._device.torch_device
        self._weights.load_ohwi(w.to(dev), None if b is None else b.to(dev))

    def reload_weights_and_biases(
        self, command_buffer: CommandBuffer, state: ConvolutionWeightsAndBiasesState
    ) -> None:
        """Command-buffer path: copy ``state``'s weights into the master weights as recorded
        work; later commands read them. The state's read count drops by one
        (MPS ``reloadWeightsAndBiasesWithCommandBuffer:state:``). `reload_weights_and_biases`
        (the module function) reloads several kernels as one command."""
        self._check_reload(command_buffer, state)
        ws, sw, sb = self._reload_sources(state)

        def run() -> None:
            ws.copy_oihw(sw, sb)  # the masters, then their low-precision copies

        self._apply(command_buffer, Encoding(run, (), (state,)))

    def _check_reload(self, cb: CommandBuffer, state: Any) -> None:
        """Raise unless ``state`` can be reloaded into this kernel on ``cb`` (changes nothing)."""
        self._check_command_buffer(cb)
        self._check_state(cb, state, "state", ConvolutionWeightsAndBiasesState)
        o, i, kh, kw = state._oihw.shape  # live (checked): the OIHW storage, no OHWI view made
        if state._oihw.shape != self._weights.weight.shape:
            want = self._descriptor.weights_shape
            raise ValueError(
                f"[{type(self).__name__}] state.weights must have the OHWI shape {want}, "
                f"got {(o, kh, kw, i)}"
            )

    def _reload_sources(self, state: Any) -> tuple[ConvWeights, Any, Any]:
        """The masters and the state's tensors a reload copies (taken now: the state may be
        released before the command runs); a layer without bias gains one here."""
        ws = self._weights
        if ws.bias is None and state._biases is not None:
            w = ws.weight
            ws.bias = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device)
        return ws, state._oihw, state._biases

    def export_weights_and_biases(
        self, command_buffer: CommandBuffer, result_state_can_be_temporary: bool = False
    ) -> ConvolutionWeightsAndBiasesState:
        """A state holding the current weights once ``command_buffer`` ran (MPS
        ``exportWeightsAndBiasesWithCommandBuffer:resultStateCanBeTemporary:``)."""
        self._check_command_buffer(command_buffer)
        ws = self._weights
        state = ConvolutionWeightsAndBiasesState._made(  # storage the command below fills
            self._device,
            self._descriptor,
            ws.bias is not None,
            ws.weight.dtype,
            command_buffer if result_state_can_be_temporary else None,
            torch.empty,
            # in the masters' memory order (OHWI memory: the CPU's float32 convolutions, and a
            # fully connected layer whose data source keeps it), so that the copy and an
            # update reading it need no reordering
            ohwi_memory=channels_last_only(ws.weight),
        )
        sw, sb = state._oihw, state._biases

        def run() -> None:
            sw.copy_(ws.weight)  # type: ignore[union-attr]
            if sb is not None:
                sb.copy_(ws.bias)

        self._apply(command_buffer, Encoding(run))
        return state

    # -- encode hooks -------------------------------------------------------------------

    def _destination_channels(self, source_channels: int) -> int:
        cin = self._descriptor.input_feature_channels
        if source_channels != cin:
            raise ValueError(
                f"[{type(self).__name__}] the source must provide input_feature_channels={cin} "
                f"channels (after source_feature_channel_offset={self._sco} and "
                f"source_feature_channel_max_count), got {source_channels}"
            )
        return self._descriptor.output_feature_channels

    def _new_state(self, cb: CommandBuffer | None) -> State | None:
        return self._gradient_state_class(self._device, self, command_buffer=cb)

    def _record_params(self, window: Window, memo: dict[str, Any]) -> ConvolutionRecord:
        return ConvolutionRecord(
            self._descriptor,
            self._weights,
            self._geometry(window, memo),
            self._neuron,
            (self._sy, self._sx),
        )

    def _geometry(self, window: Window, memo: dict[str, Any]) -> ConvGeometry:
        geom = memo.get("geometry")
        if geom is None:
            geom = conv_geometry(window.y, window.x, self._edge_mode, self._descriptor.groups)
            memo["geometry"] = geom
        return geom

    def _with_precision(self, op: Callable[..., torch.Tensor], records: Records) -> Forward:
        """The forward of ``op(x, w, b)`` with the master weights (cast when it runs), the
        accumulator option and the fused neuron (whose input a training encode keeps in its
        state, for `NeuronGradient`)."""
        ws = self._weights
        half = self._precision is ConvolutionAccumulatorPrecisionOption.HALF
        neuron = self._neuron
        keep = [s for s, _ in records] if neuron is not None and self._keep_preactivation else []

        def forward(x: torch.Tensor) -> torch.Tensor:
            if half and x.dtype != torch.float16:
                x = x.to(torch.float16)
            w, b = ws.cast(x.dtype)
            z = op(x, w, b)
            if neuron is None:
                return z
            if keep:
                # a plain ReLU on the CPU: its result written over z (a new tensor of ours;
                # not a cropped view, which the destination would copy) and its slope kept
                # in place of z: the gradient's one pass instead of two
                mask = relu_in_place(neuron.params, z) if z._base is None else None
                for state in keep:
                    state._preactivation = z if mask is None else None
                    state._relu_mask = mask
                if mask is not None:
                    return z
            return neuron.forward(z)

        return forward


def reload_weights_and_biases(
    command_buffer: CommandBuffer,
    pairs: Sequence[tuple[_ConvolutionBase, ConvolutionWeightsAndBiasesState]],
) -> None:
    """``kernel.reload_weights_and_biases(command_buffer, state)`` for every ``(kernel,
    state)`` pair, as one command: one multi-tensor copy (one launch on CUDA, where the
    per-kernel form costs two launches and their host dispatch per layer at every training
    step). Every pair is checked before anything changes, with the per-kernel messages; each
    pair drops its state's read count by one, as its own reload would (a temporary state
    listed more often than its read count allows raises). The copies behave as if made in list
    order (`mpsnn.core.grouped.pair_copier`)."""
    pairs = list(pairs)
    for kernel, state in pairs:
        kernel._check_reload(command_buffer, state)
    check_grouped_reads([(type(kernel).__name__, state) for kernel, state in pairs])
    if not pairs:
        return
    parts = [kernel._reload_sources(state) for kernel, state in pairs]
    pieces = [
        p for ws, sw, sb in parts for p in ((ws.weight, sw), (ws.bias, sb)) if p[1] is not None
    ]
    copy = pair_copier([d for d, _ in pieces], [s for _, s in pieces])
    masters = [ws for ws, _, _ in parts]

    def run() -> None:
        copy()
        ConvWeights.refresh_all(masters)  # the low-precision copies

    command_buffer.record("reload_weights_and_biases", run)
    for kernel, state in pairs:
        state._consume_read(command_buffer, type(kernel).__name__)


class Convolution(_ConvolutionBase):
    """2-D convolution with MPS geometry (MPS ``MPSCNNConvolution``).

    ``y(k, i, j) = b[k] + sum_{q, p, c} W[k][q][p][c] x(g(k) I/G + c, ys + sy i + dy q,
    xs + sx j + dx p)`` (correlation; see `mpsnn.ops.convolution`), then the fused neuron.

    Args:
        device: the kernel's device.
        weights: a `ConvolutionDataSource` (weights OHWI, float32).

    The source must provide exactly ``input_feature_channels`` channels from
    ``source_feature_channel_offset``; results go to ``output_feature_channels`` channels from
    ``destination_feature_channel_offset``. Groups, depthwise (``groups == channels``), strides,
    dilations, odd and even kernels, offsets, clip rects and both edge modes are supported.
    """

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        op = memo.get("op")
        if op is None:  # depends on the geometry alone: made once per configuration
            geom = self._geometry(window, memo)
            op = memo["op"] = lambda x, w, b: conv_forward(x, w, b, geom)
        return self._with_precision(op, records)


class FullyConnected(_ConvolutionBase):
    """Fully connected layer (MPS ``MPSCNNFullyConnected``).

    ``y[o] = b[o] + sum_{h, w, c} W[o][h][w][c] x(c, h, w)`` over the top-left ``kH x kW``
    pixels of each source image (the kernel size is the source size); the result is 1x1xO at the
    clip rect's origin. ``offset`` is ignored; the default padding is SIZE_VALID_ONLY.

    Note:
        MPS documents two weight orders for fully connected layers; mpsnn uses the data-source
        order ``[O][kH][kW][I]``, the same as convolution.
    """

    _default_padding_method = PaddingMethod.ALIGN_CENTERED | PaddingMethod.SIZE_VALID_ONLY

    def __init__(self, device: Device, weights: ConvolutionDataSource) -> None:
        super().__init__(device, weights)
        # it computes in its weights' memory order through a matrix view (`ConvWeights.matrix`):
        # masters OIHW-contiguous unless the data source keeps OHWI memory, casts for other
        # image formats OIHW-contiguous (`ConvWeights.channels_last_casts`, `_new_cast`)
        self._weights.channels_last_casts = False
        d = self._descriptor
        if (
            d.stride_in_pixels_x,
            d.stride_in_pixels_y,
            d.dilation_rate_x,
            d.dilation_rate_y,
            d.groups,
        ) != (1, 1, 1, 1, 1):
            raise ValueError(
                "[FullyConnected] strides, dilations and groups must be 1, got "
                f"stride=({d.stride_in_pixels_x}, {d.stride_in_pixels_y}) "
                f"dilation=({d.dilation_rate_x}, {d.dilation_rate_y}) groups={d.groups}"
            )

    def _policy(self, source_images: Any, source_states: Any) -> tuple[ImageDescriptor, Offset]:
        src = source_images[0]
        channels = self._destination_channels(min(self._smax, src.feature_channels - self._sco))
        offset = Offset(self._kw // 2, self._kh // 2, self._offset.z)
        images = max(1, src.number_of_images - self._offset.z)
        return ImageDescriptor(src.feature_channel_format, 1, 1, channels, images), offset

    def _axis_windows(self, span: DestinationSpan) -> tuple[AxisWindow, AxisWindow]:
        return (
            AxisWindow(0, 1, self._kh, 1, 1, span.source_height),
            AxisWindow(0, 1, self._kw, 1, 1, span.source_width),
        )

    def _check_window(self, window: Window, src: Image) -> None:
        h, w = src.height, src.width
        if h < self._kh or w < self._kw:
            raise ValueError(
                f"[FullyConnected] the source must be at least the kernel size "
                f"{self._kw}x{self._kh}, got {w}x{h}"
            )

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        ws = self._weights
        return self._with_precision(lambda x, w, b: fc_forward(x, w, b, ws.matrix(w)), records)


class ConvolutionTranspose(_ConvolutionBase):
    """Convolution transpose (MPS ``MPSCNNConvolutionTranspose``), as MPS defines it.

    Insert ``stride - 1`` zeros between source pixels, then correlate with the weights *as
    given* (no rotation) at stride 1. In that zero-inserted frame, destination pixel ``x`` has
    its window centre at ``offset.x * stride + kernel_offset_x + (x - clip.origin.x)``. The
    descriptor's channel counts are the transpose's own input and output counts.

    The padding policy uses the reverse size rule and sets ``offset`` to 0 and
    ``kernel_offset_x/y``. Given the `ConvolutionGradientState` of a paired convolution
    (``convolution_gradient_state``), the result has that convolution's source size and the
    transpose with weights ``W_t[i][kh][kw][o] = W[o][kH-1-kh][kW-1-kw][i]`` is exactly the
    adjoint of the convolution's data map.
    """

    _is_backwards = True
    _gradient_state_class = ConvolutionTransposeGradientState
    # Its padding policy also sets the kernel offsets.
    _geometry_attrs = (*CNNKernel._geometry_attrs, "_kernel_offset_x", "_kernel_offset_y")

    def __init__(self, device: Device, weights: ConvolutionDataSource) -> None:
        super().__init__(device, weights)
        self._kernel_offset_x = 0
        self._kernel_offset_y = 0

    @property
    def kernel_offset_x(self) -> int:
        return self._kernel_offset_x

    @kernel_offset_x.setter
    def kernel_offset_x(self, value: int) -> None:
        self._kernel_offset_x = check_int("ConvolutionTranspose", "kernel_offset_x", value)

    @property
    def kernel_offset_y(self) -> int:
        return self._kernel_offset_y

    @kernel_offset_y.setter
    def kernel_offset_y(self, value: int) -> None:
        self._kernel_offset_y = check_int("ConvolutionTranspose", "kernel_offset_y", value)

    def encode(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_image: Image,
        destination_image: Image | None = None,
        destination_state: State | None = None,
        *,
        convolution_gradient_state: ConvolutionGradientState | None = None,
    ) -> Image:
        """Like `CNNKernel.encode`; a paired ``convolution_gradient_state`` sizes the result."""
        self._check_command_buffer(command_buffer)
        self._check_image(command_buffer, source_image, "source_image")
        states: list[Any] = []
        if destination_state is not None:
            states = [
                self._check_state(
                    command_buffer,
                    destination_state,
                    "destination_state",
                    self._gradient_state_class,
                )
            ]
        policy_states = None
        if convolution_gradient_state is not None:
            policy_states = [
                self._check_state(
                    command_buffer,
                    convolution_gradient_state,
                    "convolution_gradient_state",
                    ConvolutionGradientState,
                )
            ]
        return self._encode(
            command_buffer, source_image, destination_image, states, False, policy_states
        )

    def _pair_with_convolution(
        self, record: ForwardRecord, suggested: ImageDescriptor
    ) -> ImageDescriptor:
        """Size this transpose to undo the convolution of ``record`` exactly (called by the
        convolution's gradient state while the padding policy runs).

        The result gets the convolution's source size and the kernel offset that makes this
        transpose the adjoint of the convolution's data map:
        ``T = s * dst_x - start - E + 1 + E // 2`` per axis, with ``start`` the first tap of the
        convolution's first output and ``dst_x`` where that output was written.
        """
        fw = record.window
        for axis, a, k, st, d in (
            ("x", fw.x, self._kw, self._sx, self._dx),
            ("y", fw.y, self._kh, self._sy, self._dy),
        ):
            if (a.kernel, a.stride, a.dilation) != (k, st, d):
                raise ValueError(
                    f"[ConvolutionTranspose] a transpose paired with a convolution state must "
                    f"use the convolution's kernel, stride and dilation along {axis} "
                    f"({a.kernel}, {a.stride}, {a.dilation}), got ({k}, {st}, {d})"
                )

        def t(a: AxisWindow, dst: int) -> int:
            e = a.extent
            return a.stride * dst - a.start - e + 1 + e // 2

        self._offset = Offset(0, 0, self._offset.z)
        self._kernel_offset_x = t(fw.x, fw.dst_x)
        self._kernel_offset_y = t(fw.y, fw.dst_y)
        _, _, h, w = record.source_shape
        desc = suggested.copy()
        desc.width, desc.height = w, h
        return desc

    def _policy(self, source_images: Any, source_states: Any) -> tuple[ImageDescriptor, Offset]:
        desc, _ = super()._policy(source_images, source_states)  # reverse sizes
        src = source_images[0]
        method = PaddingMethod(self._padding.padding_method)
        x_first, y_first = remainder_first(method)
        ex = self._dx * (self._kw - 1) + 1
        ey = self._dy * (self._kh - 1) + 1
        # In the zero-inserted frame the transpose is a stride-1 window: centre it there.
        self._kernel_offset_x = padding_offset(
            (src.width - 1) * self._sx + 1, desc.width, ex, 1, method.alignment, x_first
        )
        self._kernel_offset_y = padding_offset(
            (src.height - 1) * self._sy + 1, desc.height, ey, 1, method.alignment, y_first
        )
        return desc, Offset(0, 0, self._offset.z)

    def _axis_windows(self, span: DestinationSpan) -> tuple[AxisWindow, AxisWindow]:
        ey = self._dy * (self._kh - 1) + 1
        ex = self._dx * (self._kw - 1) + 1
        # The window runs over the zero-upsampled source: stride 1, size (n - 1) * s + 1.
        cy = span.offset.y * self._sy + self._kernel_offset_y + span.skip_y
        cx = span.offset.x * self._sx + self._kernel_offset_x + span.skip_x
        hy = (span.source_height - 1) * self._sy + 1
        hx = (span.source_width - 1) * self._sx + 1
        return (
            AxisWindow(cy - ey // 2, span.count_y, self._kh, 1, self._dy, hy),
            AxisWindow(cx - ex // 2, span.count_x, self._kw, 1, self._dx, hx),
        )

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        op = memo.get("op")
        if op is None:  # depends on the geometry and the (read-only) strides alone
            geom = self._geometry(window, memo)
            stride = (self._sy, self._sx)
            op = memo["op"] = lambda x, w, b: conv_transpose_forward(x, w, b, geom, stride)
        return self._with_precision(op, records)
