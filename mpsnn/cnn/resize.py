"""Bilinear resize and crop-and-resize (MPS ``MPSNNResizeBilinear``,
``MPSNNCropAndResizeBilinear``) and their gradients (an mpsnn extension: MPS has none).

`ResizeBilinear` resamples the source to ``resize_width x resize_height`` pixels. Half-pixel
centres by default, the corners' centres aligned with ``align_corners=True``: both as
``torch.nn.functional.interpolate(mode="bilinear")`` (the returning encode, CLAMP edges) and as
TensorFlow's ``resize_bilinear`` with ``half_pixel_centers=True`` or ``align_corners=True``
(TensorFlow 1's default, ``half_pixel_centers=False``, samples at ``u S / R``: not offered).
``offset`` shifts the sampled positions by whole source pixels, as for upsampling (a returning
encode's padding policy sets it to 0); CLAMP edges by default (ZERO available).

`CropAndResizeBilinear` resamples ``number_of_regions`` regions of each source image, each to
``resize_width x resize_height``. A region is ``(x, y, width, height)`` in normalized
coordinates (the source's first pixel centre is 0, its last 1, as TensorFlow's
``crop_and_resize`` box ``[y, x, y + height, x + width]``); negative sizes flip the crop. Sample
positions outside the source give the extrapolation value 0 (TensorFlow's default; MPS names the
value but exposes no property). The crops of one source image land in one destination image,
region-major along channels: crop ``r`` of source channel ``c`` is channel ``r C + c`` (MPS's
destination has ``number_of_regions`` times the source's channels). The sampling rules are in
`mpsnn.ops.resize`.

The gradients (with respect to the source image; the regions are constants) are the exact
transposes of the forwards, made deterministic (no atomics), unlike ``F.interpolate``'s CUDA
backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Real
from typing import Any

from mpsnn.core._checks import check_positive, check_type
from mpsnn.core.binary import GradientKernel
from mpsnn.core.cnn_kernel import CNNKernel, Forward, Records
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.descriptor import ImageDescriptor
from mpsnn.core.device import Device
from mpsnn.core.geometry import AxisWindow, DestinationSpan, EdgeMode, Offset, Window
from mpsnn.core.gradient_command import Backward
from mpsnn.core.image import Image
from mpsnn.core.registry import gradient_of
from mpsnn.core.saved import Field
from mpsnn.core.state import ForwardRecord, GradientState
from mpsnn.ops.resize import (
    CropAxis,
    ResizeAxis,
    crop_backward,
    crop_forward,
    resample_backward,
    resample_forward,
)

__all__ = [
    "CropAndResizeBilinear",
    "CropAndResizeBilinearGradient",
    "ResizeBilinear",
    "ResizeBilinearGradient",
]

NormalizedRegion = tuple[float, float, float, float]  # (x, y, width, height)


@dataclass(frozen=True, slots=True, eq=False)
class ResizeRecord:
    """What a `ResizeBilinear` encode hands its gradient: the resize size ``(width, height)``,
    ``align_corners`` and the sampling of each axis ``(y, x)``."""

    resize: tuple[int, int]
    align_corners: bool
    axes: tuple[ResizeAxis, ResizeAxis]


@dataclass(frozen=True, slots=True, eq=False)
class CropAndResizeRecord:
    """What a `CropAndResizeBilinear` encode hands its gradient: the resize size, the regions
    and the sampling of each axis ``(y, x)``."""

    resize: tuple[int, int]
    regions: tuple[NormalizedRegion, ...]
    axes: tuple[CropAxis, CropAxis]


def check_size(who: str, resize_width: Any, resize_height: Any) -> tuple[int, int]:
    """``(resize_width, resize_height)``, each a positive int."""
    return (
        check_positive(who, "resize_width", resize_width),
        check_positive(who, "resize_height", resize_height),
    )


def check_regions(who: str, number_of_regions: Any, regions: Any) -> tuple[NormalizedRegion, ...]:
    """``regions`` as ``number_of_regions`` tuples of 4 finite floats ``(x, y, width, height)``."""
    count = check_positive(who, "number_of_regions", number_of_regions)
    if not isinstance(regions, Sequence) or isinstance(regions, str | bytes):
        raise TypeError(
            f"[{who}] regions must be a sequence of (x, y, width, height) tuples, "
            f"got {type(regions).__name__}"
        )
    if len(regions) != count:
        raise ValueError(
            f"[{who}] regions must hold number_of_regions ({count}) regions, got {len(regions)}"
        )
    out = []
    for k, region in enumerate(regions):
        if (
            not isinstance(region, Sequence)
            or len(region) != 4
            or not all(isinstance(v, Real) and not isinstance(v, bool) for v in region)
        ):
            raise TypeError(
                f"[{who}] region {k} must be 4 real numbers (x, y, width, height), got {region!r}"
            )
        values = tuple(float(v) for v in region)
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"[{who}] region {k} must be finite, got {region!r}")
        out.append(values)
    return tuple(out)  # type: ignore[return-value]


class _ResizeSize:
    """The resize size a forward and its gradient share (and must agree on)."""

    _resize: tuple[int, int]

    def _set_size(self, width: int, height: int) -> None:
        self._resize = check_size(type(self).__name__, width, height)

    @property
    def resize_width(self) -> int:
        return self._resize[0]

    @property
    def resize_height(self) -> int:
        return self._resize[1]


class _BilinearSettings(_ResizeSize):
    """The settings `ResizeBilinear` and its gradient share."""

    _align: bool

    def _set_bilinear(self, width: int, height: int, align_corners: bool) -> None:
        self._set_size(width, height)
        self._align = check_type(type(self).__name__, "align_corners", align_corners, bool)

    @property
    def align_corners(self) -> bool:
        return self._align


#: what a bilinear resize and its gradient save (the constructor's arguments)
_BILINEAR_FIELDS = (
    Field("resize_width", int, minimum=1),
    Field("resize_height", int, minimum=1),
    Field("align_corners", bool),
)


class _CropSettings(_ResizeSize):
    """The settings `CropAndResizeBilinear` and its gradient share."""

    _regions: tuple[NormalizedRegion, ...]

    def _set_crop(
        self, width: int, height: int, count: int, regions: Sequence[Sequence[float]]
    ) -> None:
        self._set_size(width, height)
        self._regions = check_regions(type(self).__name__, count, regions)

    @property
    def number_of_regions(self) -> int:
        return len(self._regions)

    @property
    def regions(self) -> tuple[NormalizedRegion, ...]:
        """The regions ``(x, y, width, height)``, normalized, as floats."""
        return self._regions


class _Resampling(_ResizeSize, CNNKernel):
    """A kernel whose destination is ``resize_width x resize_height``: the returning encode
    sizes it so; the written pixels are counted from the clip rect's origin."""

    _gradient_state_class = GradientState

    def _channels(self, source_channels: int) -> int:
        return self._destination_channels(min(self._smax, source_channels - self._sco))

    def _policy(self, source_images: Any, source_states: Any) -> tuple[ImageDescriptor, Offset]:
        src = source_images[0]
        w, h = self._resize
        images = max(1, src.number_of_images - self._offset.z)
        channels = self._channels(src.feature_channels)
        desc = ImageDescriptor(src.feature_channel_format, w, h, channels, images)
        return desc, Offset(0, 0, self._offset.z)

    def _axis_windows(self, span: DestinationSpan) -> tuple[AxisWindow, AxisWindow]:
        # No window: the axes carry the offset and the counts (the sampling is the family's).
        return (
            AxisWindow(span.offset.y, span.count_y, 1, 1, 1, span.source_height),
            AxisWindow(span.offset.x, span.count_x, 1, 1, 1, span.source_width),
        )

    def _firsts(self, window: Window) -> tuple[int, int]:
        """The first written pixel, counted from the clip rect's origin, per axis (y, x)."""
        return window.dst_y - self._clip.origin.y, window.dst_x - self._clip.origin.x

    def _axes(self, window: Window, memo: dict[str, Any]) -> Any:
        axes = memo.get("resize")
        if axes is None:
            axes = memo["resize"] = self._make_axes(window)
        return axes

    def _make_axes(self, window: Window) -> Any:
        raise NotImplementedError


class ResizeBilinear(_BilinearSettings, _Resampling):
    """Bilinear resize to ``resize_width x resize_height`` (MPS ``MPSNNResizeBilinear``).

    Destination pixel ``u`` (counted from the clip rect's origin) samples the source at
    ``p = offset + (u + 1/2) S / R - 1/2`` (``S`` source pixels, ``R`` the resize size), or with
    ``align_corners`` at ``p = offset + u (S - 1) / (R - 1)``; taps ``floor(p)`` and
    ``floor(p) + 1`` weighted ``1 - f`` and ``f``. Edges CLAMP (default) or ZERO. The
    returning encode (offset 0, whole destination, CLAMP) equals
    ``F.interpolate(x, size=(resize_height, resize_width), mode="bilinear",
    align_corners=align_corners)``. Channels are unchanged.

    Args:
        device: the kernel's device.
        resize_width, resize_height: the destination size, positive.
        align_corners: align the centres of the corner pixels (default False).
    """

    saved_fields = _BILINEAR_FIELDS

    def __init__(
        self, device: Device, resize_width: int, resize_height: int, align_corners: bool = False
    ) -> None:
        self._set_bilinear(resize_width, resize_height, align_corners)
        super().__init__(device)
        self._edge_mode = EdgeMode.CLAMP

    def _make_axes(self, window: Window) -> tuple[ResizeAxis, ResizeAxis]:
        clamp = self._edge_mode is EdgeMode.CLAMP
        w, h = self._resize
        fy, fx = self._firsts(window)
        ay = ResizeAxis(window.y.start, fy, window.y.count, window.y.size, h, self._align, clamp)
        ax = ResizeAxis(window.x.start, fx, window.x.count, window.x.size, w, self._align, clamp)
        return ay, ax

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        ay, ax = self._axes(window, memo)
        return lambda x: resample_forward(x, ay, ax)

    def _record_params(self, window: Window, memo: dict[str, Any]) -> ResizeRecord:
        return ResizeRecord(self._resize, self._align, self._axes(window, memo))


class CropAndResizeBilinear(_CropSettings, _Resampling):
    """Crops resized bilinearly (MPS ``MPSNNCropAndResizeBilinear``), TensorFlow's
    ``crop_and_resize`` sampling.

    Region ``(x, y, width, height)`` (normalized) gives crop pixel ``u`` of ``R`` the source
    position ``p = x (S - 1) + u width (S - 1) / (R - 1)`` (``R = 1``: the region's centre,
    ``(x + width / 2) (S - 1)``), and the same along y; taps ``floor(p)``, ``ceil(p)``. A
    position outside ``[0, S - 1]`` gives the extrapolation value 0 for its whole row or column
    of the crop (so ``edge_mode`` stays ZERO: nothing outside the source is read). The
    destination has ``number_of_regions`` times the channels read: crop ``r`` of channel ``c``
    is channel ``r C + c``; every source image gets every region. ``offset.x``/``offset.y``
    must be 0 (the regions place the crops).

    Args:
        device: the kernel's device.
        resize_width, resize_height: the size of each crop, positive.
        number_of_regions: how many regions, positive.
        regions: ``number_of_regions`` tuples ``(x, y, width, height)`` of finite reals.
    """

    _edge_modes = (EdgeMode.ZERO,)

    def __init__(
        self,
        device: Device,
        resize_width: int,
        resize_height: int,
        number_of_regions: int,
        regions: Sequence[Sequence[float]],
    ) -> None:
        self._set_crop(resize_width, resize_height, number_of_regions, regions)
        super().__init__(device)

    def _destination_channels(self, source_channels: int) -> int:
        return source_channels * len(self._regions)

    def _check_window(self, window: Window, src: Image) -> None:
        if self._offset.x or self._offset.y:
            raise ValueError(
                f"[{type(self).__name__}] offset.x and offset.y must be 0 (the regions place the "
                f"crops), got ({self._offset.x}, {self._offset.y})"
            )

    def _make_axes(self, window: Window) -> tuple[CropAxis, CropAxis]:
        w, h = self._resize
        fy, fx = self._firsts(window)
        ys = tuple((r[1], r[3]) for r in self._regions)
        xs = tuple((r[0], r[2]) for r in self._regions)
        # The columns of every region are made first; each region's rows read its own block.
        ay = CropAxis(ys, fy, window.y.count, window.y.size, h, True)
        ax = CropAxis(xs, fx, window.x.count, window.x.size, w, False)
        return ay, ax

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        ay, ax = self._axes(window, memo)
        return lambda x: crop_forward(x, ay, ax)

    def _record_params(self, window: Window, memo: dict[str, Any]) -> CropAndResizeRecord:
        return CropAndResizeRecord(self._resize, self._regions, self._axes(window, memo))


@gradient_of(ResizeBilinear)
class ResizeBilinearGradient(_BilinearSettings, GradientKernel):
    """Gradient of `ResizeBilinear` with respect to its source (an mpsnn extension): each
    output's gradient spread on its taps, ``dx[i] = sum of w g[u]``. The resize size and
    ``align_corners`` must equal the forward's."""

    _state_class = GradientState
    saved_fields = _BILINEAR_FIELDS

    def __init__(
        self, device: Device, resize_width: int, resize_height: int, align_corners: bool = False
    ) -> None:
        self._set_bilinear(resize_width, resize_height, align_corners)
        super().__init__(device)

    def _check_forward(self, record: ForwardRecord) -> None:
        p: ResizeRecord = record.params
        mine, theirs = (self._resize, self._align), (p.resize, p.align_corners)
        if mine != theirs:
            raise ValueError(
                f"[{type(self).__name__}] (resize_width, resize_height) and align_corners must "
                f"equal the forward's {theirs}, got {mine}"
            )

    def _make_backward(
        self, cb: CommandBuffer, record: ForwardRecord, window: Window, states: list[Any]
    ) -> Backward:
        ay, ax = record.params.axes
        return lambda g, x: resample_backward(g, ay, ax)


@gradient_of(CropAndResizeBilinear)
class CropAndResizeBilinearGradient(_CropSettings, GradientKernel):
    """Gradient of `CropAndResizeBilinear` with respect to its source (an mpsnn extension;
    the regions are constants): every crop's gradient spread on its taps and summed over the
    regions. The size and regions must equal the forward's."""

    _state_class = GradientState

    def __init__(
        self,
        device: Device,
        resize_width: int,
        resize_height: int,
        number_of_regions: int,
        regions: Sequence[Sequence[float]],
    ) -> None:
        self._set_crop(resize_width, resize_height, number_of_regions, regions)
        super().__init__(device)

    def _check_forward(self, record: ForwardRecord) -> None:
        p: CropAndResizeRecord = record.params
        who = type(self).__name__
        if self._resize != p.resize:
            raise ValueError(
                f"[{who}] (resize_width, resize_height) must equal the forward's {p.resize}, "
                f"got {self._resize}"
            )
        if self._regions != p.regions:
            raise ValueError(
                f"[{who}] regions must equal the forward's {p.regions}, got {self._regions}"
            )

    def _make_backward(
        self, cb: CommandBuffer, record: ForwardRecord, window: Window, states: list[Any]
    ) -> Backward:
        ay, ax = record.params.axes
        return lambda g, x: crop_backward(g, ay, ax)
