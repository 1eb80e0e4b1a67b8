"""Upsampling (MPS ``MPSCNNUpsamplingNearest``, ``MPSCNNUpsamplingBilinear`` and gradients).

Integer scale factors (1 is a copy). The returning encode makes a destination ``scale`` times the
source; ``offset`` is the source position of the first destination pixel (inside the clip
rect). The sampling rules are in `mpsnn.ops.upsampling`. The kernels default to CLAMP edges,
where every standard configuration equals ``torch.nn.functional.interpolate`` (MPS leaves the
edge behaviour undocumented; ZERO is available). Channels are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mpsnn.core._checks import check_positive, check_type
from mpsnn.core.binary import GradientKernel
from mpsnn.core.cnn_kernel import CNNKernel, Forward, Records
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.descriptor import ImageDescriptor
from mpsnn.core.device import Device
from mpsnn.core.geometry import AxisWindow, DestinationSpan, EdgeMode, Offset, Window
from mpsnn.core.gradient_command import Backward
from mpsnn.core.registry import gradient_of
from mpsnn.core.state import ForwardRecord, GradientState
from mpsnn.ops.upsampling import AxisSampling, UpsampleGeometry, upsample_backward, upsample_forward

__all__ = [
    "UpsamplingBilinear",
    "UpsamplingBilinearGradient",
    "UpsamplingGradient",
    "UpsamplingNearest",
    "UpsamplingNearestGradient",
]


@dataclass(frozen=True, slots=True, eq=False)
class UpsamplingRecord:
    """What an upsampling encode hands its gradient: the scale factors (x, y) and the
    sampling geometry (which carries ``align_corners``)."""

    scale: tuple[int, int]
    geometry: UpsampleGeometry


class _ScaleFactors:
    """The integer scale factors an upsampling and its gradient share (and must agree on)."""

    _scale: tuple[int, int]

    def _set_scale(self, x: int, y: int) -> None:
        who = type(self).__name__
        self._scale = (
            check_positive(who, "integer_scale_factor_x", x),
            check_positive(who, "integer_scale_factor_y", y),
        )

    @property
    def scale_factor_x(self) -> float:
        return float(self._scale[0])

    @property
    def scale_factor_y(self) -> float:
        return float(self._scale[1])


class _Upsampling(_ScaleFactors, CNNKernel):
    _gradient_state_class = GradientState
    _is_backwards = True
    _bilinear = False

    def __init__(
        self,
        device: Device,
        integer_scale_factor_x: int,
        integer_scale_factor_y: int,
        align_corners: bool = False,
    ) -> None:
        self._set_scale(integer_scale_factor_x, integer_scale_factor_y)
        super().__init__(device)
        self._align = check_type(type(self).__name__, "align_corners", align_corners, bool)
        self._edge_mode = EdgeMode.CLAMP

    @property
    def align_corners(self) -> bool:
        return self._align

    def _policy(self, source_images: Any, source_states: Any) -> tuple[ImageDescriptor, Offset]:
        src = source_images[0]
        sx, sy = self._scale
        channels = self._destination_channels(min(self._smax, src.feature_channels - self._sco))
        images = max(1, src.number_of_images - self._offset.z)
        desc = ImageDescriptor(
            src.feature_channel_format, src.width * sx, src.height * sy, channels, images
        )
        return desc, Offset(0, 0, self._offset.z)

    def _geometry(self, window: Window, memo: dict[str, Any]) -> UpsampleGeometry:
        geom = memo.get("upsample")
        if geom is None:
            geom = memo["upsample"] = self._make_geometry(window)
        return geom

    def _make_geometry(self, window: Window) -> UpsampleGeometry:
        clamp = self._edge_mode is EdgeMode.CLAMP
        sx, sy = self._scale
        fy, fx = window.dst_y - self._clip.origin.y, window.dst_x - self._clip.origin.x
        ay = AxisSampling(window.y.start, fy, window.y.count, window.y.size, sy, clamp)
        ax = AxisSampling(window.x.start, fx, window.x.count, window.x.size, sx, clamp)
        standard = (
            clamp
            and ay.offset == ay.first == 0 and ax.offset == ax.first == 0
            and ay.count == ay.size * sy and ax.count == ax.size * sx
        )  # fmt: skip
        return UpsampleGeometry(ay, ax, self._bilinear, self._align, standard)

    def _axis_windows(self, span: DestinationSpan) -> tuple[AxisWindow, AxisWindow]:
        # An enlarging kernel has no window: the axes carry the offset and the counts.
        return (
            AxisWindow(span.offset.y, span.count_y, 1, 1, 1, span.source_height),
            AxisWindow(span.offset.x, span.count_x, 1, 1, 1, span.source_width),
        )

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        geom = self._geometry(window, memo)
        return lambda x: upsample_forward(x, geom)

    def _record_params(self, window: Window, memo: dict[str, Any]) -> UpsamplingRecord:
        return UpsamplingRecord(self._scale, self._geometry(window, memo))


class UpsamplingNearest(_Upsampling):
    """Each source pixel becomes an ``sx x sy`` block (MPS ``MPSCNNUpsamplingNearest``).

    Args:
        device: the kernel's device.
        integer_scale_factor_x, integer_scale_factor_y: positive integers.
    """

    def __init__(
        self, device: Device, integer_scale_factor_x: int, integer_scale_factor_y: int
    ) -> None:
        super().__init__(device, integer_scale_factor_x, integer_scale_factor_y)


class UpsamplingBilinear(_Upsampling):
    """Bilinear upsampling (MPS ``MPSCNNUpsamplingBilinear``): half-pixel centres, or
    ``align_corners=True``, as ``F.interpolate(mode="bilinear")``."""

    _bilinear = True


class UpsamplingGradient(_ScaleFactors, GradientKernel):
    """Base of the upsampling gradients (MPS ``MPSCNNUpsamplingGradient``): the transpose of the
    forward's sampling map. ``align_corners`` comes from the forward (through the state)."""

    _state_class = GradientState

    def __init__(
        self, device: Device, integer_scale_factor_x: int, integer_scale_factor_y: int
    ) -> None:
        self._set_scale(integer_scale_factor_x, integer_scale_factor_y)
        super().__init__(device)

    def _check_forward(self, record: ForwardRecord) -> None:
        who, theirs = type(self).__name__, record.params.scale
        if theirs != self._scale:
            raise ValueError(
                f"[{who}] the scale factors must equal the forward's {theirs}, got {self._scale}"
            )

    def _make_backward(
        self, cb: CommandBuffer, record: ForwardRecord, window: Window, states: list[Any]
    ) -> Backward:
        geom: UpsampleGeometry = record.params.geometry
        return lambda g, x: upsample_backward(g, geom)


@gradient_of(UpsamplingNearest)
class UpsamplingNearestGradient(UpsamplingGradient):
    """Gradient of `UpsamplingNearest`: each source pixel sums its block's gradient."""


@gradient_of(UpsamplingBilinear)
class UpsamplingBilinearGradient(UpsamplingGradient):
    """Gradient of `UpsamplingBilinear`: each output's gradient spread on its taps."""
