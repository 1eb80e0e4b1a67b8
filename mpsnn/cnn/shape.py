"""Shape kernels: `Slice`, `Reshape`, `Pad` and their gradients (MPS ``MPSNNSlice``,
``MPSNNReshape``/``MPSNNReshapeGradient``, ``MPSNNPad``/``MPSNNPadGradient``).

* Slice copies the source region at ``offset`` (channels from ``source_feature_channel_offset``)
  into the destination clip rect; its gradient (an mpsnn extension: MPS slices only in the
  graph, as the concatenation gradient) is the zero-embedding adjoint. Concatenation itself
  needs no kernel: producers write at ``destination_feature_channel_offset``, and each gradient
  kernel reads its own channel range of the concatenated gradient.
* Reshape moves each image's elements into a new shape in the HWC linear order.
* Pad grows the source by ``padding_size_before/after`` (x, y, channels) with any edge mode;
  channel padding takes the fill value. The gradient sums the padded copies back
  (`mpsnn.ops.shape`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from mpsnn.cnn._pointwise import Pointwise, PointwiseBackward, PointwiseGradient, PointwiseKernel
from mpsnn.core._checks import check_positive, check_type
from mpsnn.core.binary import GradientKernel
from mpsnn.core.cnn_kernel import CNNKernel, Forward, Records
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.descriptor import ImageDescriptor
from mpsnn.core.device import Device
from mpsnn.core.geometry import (
    AxisWindow,
    DestinationSpan,
    EdgeMode,
    ImageCoordinate,
    Offset,
    Window,
)
from mpsnn.core.gradient_command import Backward
from mpsnn.core.image import Image
from mpsnn.core.registry import gradient_of
from mpsnn.core.state import ForwardRecord, GradientState
from mpsnn.errors import UnsupportedError
from mpsnn.ops.shape import PadAxis, pad_axis, pad_backward, pad_forward, reshape_hwc

__all__ = [
    "Pad",
    "PadGradient",
    "Reshape",
    "ReshapeGradient",
    "Slice",
    "SliceGradient",
]


@dataclass(frozen=True, slots=True, eq=False)
class PadRecord:
    """What a pad encode hands its gradient: where the source channels start in the result,
    and the per-axis maps (`mpsnn.ops.shape.PadAxis`) of the forward."""

    channel_before: int
    y: PadAxis
    x: PadAxis


class Slice(PointwiseKernel):
    """Copy a region and a channel range (MPS ``MPSNNSlice``); the returning encode keeps the
    source's size and the channels read."""

    _gradient_state_class = GradientState

    def _pointwise(self, window: Window, records: Records) -> Pointwise:
        return lambda x: x.clone()  # a fresh block: it may become the destination's storage


@gradient_of(Slice)
class SliceGradient(PointwiseGradient):
    """Gradient of `Slice` (an mpsnn extension): the copied region's gradient, zeros elsewhere."""

    _state_class = GradientState

    def _pointwise_backward(self, record: ForwardRecord, states: list[Any]) -> PointwiseBackward:
        return lambda g, x: g.clone()


class Reshape(CNNKernel):
    """Reshape each image in the HWC linear order (MPS ``MPSNNReshape``).

    Args:
        device: the kernel's device.
        result_width, result_height, result_feature_channels: the new shape; its element count
            must equal the source's (channels read x height x width).

    The whole image is reshaped: ``offset`` and ``clip_rect`` must keep their defaults.
    """

    _gradient_state_class = GradientState

    def __init__(
        self, device: Device, result_width: int, result_height: int, result_feature_channels: int
    ) -> None:
        super().__init__(device)
        who = "Reshape"
        self._result = (
            check_positive(who, "result_feature_channels", result_feature_channels),
            check_positive(who, "result_height", result_height),
            check_positive(who, "result_width", result_width),
        )

    @property
    def result_width(self) -> int:
        return self._result[2]

    @property
    def result_height(self) -> int:
        return self._result[1]

    @property
    def result_feature_channels(self) -> int:
        return self._result[0]

    def _destination_channels(self, source_channels: int) -> int:
        return self._result[0]

    def _policy(self, source_images: Any, source_states: Any) -> tuple[ImageDescriptor, Offset]:
        src = source_images[0]
        c, h, w = self._result
        images = max(1, src.number_of_images - self._offset.z)
        return ImageDescriptor(src.feature_channel_format, w, h, c, images), Offset(
            0, 0, self._offset.z
        )

    def _axis_windows(self, span: DestinationSpan) -> tuple[AxisWindow, AxisWindow]:
        return (
            AxisWindow(0, span.count_y, 1, 1, 1, span.source_height),
            AxisWindow(0, span.count_x, 1, 1, 1, span.source_width),
        )

    def _check_window(self, window: Window, src: Image) -> None:
        c, h, w = self._result
        if (
            (self._offset.x, self._offset.y) != (0, 0)
            or (window.dst_y, window.dst_x) != (0, 0)
            or ((window.y.count, window.x.count) != (h, w))
        ):
            raise UnsupportedError(
                "[Reshape] reshapes whole images: offset must be (0, 0) and the clip rect must "
                f"cover a {w}x{h} destination, got offset {self._offset} and "
                f"{window.x.count}x{window.y.count} pixels at ({window.dst_x}, {window.dst_y})"
            )
        have = window.src_channels * src.height * src.width
        if have != c * h * w:
            raise ValueError(
                f"[Reshape] the result must hold as many elements as the source per image "
                f"({window.src_channels}x{src.height}x{src.width} = {have}), got "
                f"{c}x{h}x{w} = {c * h * w}"
            )

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        c, h, w = self._result
        return lambda x: reshape_hwc(x, c, h, w).contiguous()


@gradient_of(Reshape)
class ReshapeGradient(GradientKernel):
    """Gradient of `Reshape` (MPS ``MPSNNReshapeGradient``): the inverse reshape."""

    _state_class = GradientState

    def _make_backward(
        self, cb: CommandBuffer, record: ForwardRecord, window: Window, states: list[Any]
    ) -> Backward:
        c = window.src_channels
        _, _, h, w = record.source_shape
        return lambda g, x: reshape_hwc(g, c, h, w).contiguous()


class Pad(CNNKernel):
    """Pad the source in x, y and feature channels (MPS ``MPSNNPad``).

    Args:
        device: the kernel's device.
        padding_size_before, padding_size_after: `ImageCoordinate` sizes (x, y, channel).
        fill_value: what CONSTANT edges read outside the source, and what the padded channels
            hold (a number, or one per destination channel). ZERO edges read 0.

    Edge modes: ZERO, CONSTANT, CLAMP, MIRROR, MIRROR_WITH_EDGE. The returning encode sizes the
    destination as ``source + before + after`` and sets ``offset = -before``; with an explicit
    destination, offset and clip rect place the x/y padding (as MPS), channel padding stays.
    """

    _gradient_state_class = GradientState
    _edge_modes = tuple(EdgeMode)

    def __init__(
        self,
        device: Device,
        padding_size_before: ImageCoordinate | None = None,
        padding_size_after: ImageCoordinate | None = None,
        fill_value: Any = 0.0,
    ) -> None:
        super().__init__(device)
        who = "Pad"
        self._before = check_type(
            who, "padding_size_before", padding_size_before or ImageCoordinate(), ImageCoordinate
        )
        self._after = check_type(
            who, "padding_size_after", padding_size_after or ImageCoordinate(), ImageCoordinate
        )
        if isinstance(fill_value, int | float) and not isinstance(fill_value, bool):
            if not math.isfinite(fill_value):
                raise ValueError(f"[Pad] fill_value must be finite, got {fill_value}")
            self._fill: Any = float(fill_value)
            self._fill_key: tuple[Any, ...] | None = None
        else:
            t = torch.as_tensor(fill_value, dtype=torch.float64)
            if t.dim() != 1:
                raise ValueError(
                    "[Pad] fill_value must be a number or one per channel, "
                    f"got shape {tuple(t.shape)}"
                )
            self._fill = t
            self._fill_key = ("pad-fill", *t.tolist())  # names its device copies

    @property
    def padding_size_before(self) -> ImageCoordinate:
        return self._before

    @property
    def padding_size_after(self) -> ImageCoordinate:
        return self._after

    @property
    def fill_value(self) -> Any:
        return self._fill

    def _destination_channels(self, source_channels: int) -> int:
        out = self._before.channel + source_channels + self._after.channel
        if isinstance(self._fill, torch.Tensor) and self._fill.numel() != out:
            raise ValueError(
                f"[Pad] fill_value needs one value per destination channel ({out}), "
                f"got {self._fill.numel()}"
            )
        return out

    def _policy(self, source_images: Any, source_states: Any) -> tuple[ImageDescriptor, Offset]:
        src = source_images[0]
        b, a = self._before, self._after
        channels = self._destination_channels(min(self._smax, src.feature_channels - self._sco))
        images = max(1, src.number_of_images - self._offset.z)
        desc = ImageDescriptor(
            src.feature_channel_format,
            src.width + b.x + a.x,
            src.height + b.y + a.y,
            channels,
            images,
        )
        return desc, Offset(-b.x, -b.y, self._offset.z)

    def _axis_windows(self, span: DestinationSpan) -> tuple[AxisWindow, AxisWindow]:
        return (
            AxisWindow(span.offset.y + span.skip_y, span.count_y, 1, 1, 1, span.source_height),
            AxisWindow(span.offset.x + span.skip_x, span.count_x, 1, 1, 1, span.source_width),
        )

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        ay, ax = _pad_axes(window, self._edge_mode)
        fill, before, out_c = self._fill, self._before.channel, window.dst_channels
        outside = self._edge_mode is EdgeMode.CONSTANT  # ZERO reads 0 outside

        def forward(x: torch.Tensor) -> torch.Tensor:
            return pad_forward(
                x, ay, ax, channel_before=before, out_channels=out_c, fill=fill,
                constant_outside=outside,
            )  # fmt: skip

        return forward

    def _record_params(self, window: Window, memo: dict[str, Any]) -> PadRecord:
        return PadRecord(self._before.channel, *_pad_axes(window, self._edge_mode))


def _pad_axes(window: Window, mode: EdgeMode) -> tuple[PadAxis, PadAxis]:
    """The forward's two per-axis maps (host-built once per geometry)."""
    y, x = window.y, window.x
    return pad_axis(y.start, y.count, y.size, mode), pad_axis(x.start, x.count, x.size, mode)


@gradient_of(Pad)
class PadGradient(GradientKernel):
    """Gradient of `Pad` (MPS ``MPSNNPadGradient``): every source pixel sums the gradients of
    the positions copied from it (CLAMP with 2 before and 3 after on 3 pixels gives
    ``[d0+d1+d2, d3, d4+d5+d6+d7]``); padded channels and fill values pass nothing back."""

    _state_class = GradientState

    def _make_backward(
        self, cb: CommandBuffer, record: ForwardRecord, window: Window, states: list[Any]
    ) -> Backward:
        p: PadRecord = record.params
        c0, n = p.channel_before, window.src_channels
        return lambda g, x: pad_backward(g, p.y, p.x, channel_before=c0, channels=n)
