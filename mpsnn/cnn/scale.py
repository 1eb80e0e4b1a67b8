"""Image scaling (MPS ``MPSImageScale``, ``MPSImageBilinearScale``, ``MPSImageLanczosScale``):
the kernels behind `mpsnn.nodes.resize.BilinearScaleNode` and ``LanczosScaleNode``.

MPS's transform maps source positions to destination positions, ``dst = src * scale +
translate`` per axis, in pixel edges (pixel centres handled internally), with the destination
clip rect's top-left corner at 0. So destination pixel ``u`` (counted from the clip rect's
origin) samples the source at ``p = (u + 1/2 - translate) / scale - 1/2`` (pixel centres at
integers). Without a transform the whole source fits the whole destination image:
``scale = destination size / source size``, ``u`` counted from the destination's origin.

* `ImageBilinearScale`: two taps, ``floor(p)`` and ``floor(p) + 1`` (no low-pass filter when
  reducing, as the GPU's texture sampling). With no transform it equals
  ``F.interpolate(mode="bilinear", align_corners=False, antialias=False)``.
* `ImageLanczosScale`: Lanczos with a = 3 (``L(x) = sinc(x) sinc(x / 3)``, 6 taps per axis when
  enlarging); when reducing by ``1 / scale = m > 1`` the kernel is stretched by ``m``
  (``L((i - p) / m)`` over ``|i - p| < 3 m``), which is what lets Lanczos reduce without a
  separate low-pass filter. The weights of each output are divided by their sum.

Edges: CLAMP by default (a tap outside the source reads the edge pixel; the normalized weights
are kept, so a constant image stays constant), ZERO available (reads 0). Pillow's
``Image.resize(LANCZOS)`` has the same kernel, support and normalization; it differs only near
the edges, where it drops the outside taps and renormalizes the rest. The math is in
`mpsnn.ops.resize`. These kernels have no gradient (MPS defines none): a training graph stops
at the scale nodes.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Protocol, runtime_checkable

from mpsnn.core.cnn_kernel import CNNKernel, Forward, Records
from mpsnn.core.descriptor import ImageDescriptor
from mpsnn.core.device import Device
from mpsnn.core.geometry import AxisWindow, DestinationSpan, EdgeMode, Offset, Window
from mpsnn.core.image import Image
from mpsnn.ops.resize import ScaleAxis, resample_forward

__all__ = [
    "ImageTransformProvider",
    "ScaleTransform",
]


class _TransformFields(NamedTuple):
    scale_x: float
    scale_y: float
    translate_x: float
    translate_y: float


class ScaleTransform(_TransformFields):
    """How an image scale maps the source onto the destination (MPS ``MPSScaleTransform``):
    ``dst = src * scale + translate`` per axis, in pixels, the destination clip rect's top-left
    corner at 0 (MPS: ``CGAffineTransform {a = scale_x, d = scale_y, tx = translate_x, ty =
    translate_y}``). Scales must be finite and positive, translations finite.

    The whole source onto a whole ``W x H`` destination: ``ScaleTransform(W / w, H / h, 0, 0)``;
    to put source position ``(x, y)`` at the clip rect's corner: ``translate_x = -x *
    scale_x``, ``translate_y = -y * scale_y``.
    """

    __slots__ = ()

    def __new__(
        cls,
        scale_x: float = 1.0,
        scale_y: float = 1.0,
        translate_x: float = 0.0,
        translate_y: float = 0.0,
    ) -> ScaleTransform:
        values = []
        for name, v in (
            ("scale_x", scale_x),
            ("scale_y", scale_y),
            ("translate_x", translate_x),
            ("translate_y", translate_y),
        ):
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise TypeError(
                    f"[ScaleTransform] {name} must be a real number, got {type(v).__name__} {v!r}"
                )
            v = float(v)
            if not math.isfinite(v) or (name.startswith("scale") and v <= 0.0):
                what = "finite and > 0" if name.startswith("scale") else "finite"
                raise ValueError(f"[ScaleTransform] {name} must be {what}, got {v!r}")
            values.append(v)
        return super().__new__(cls, *values)


@runtime_checkable
class ImageTransformProvider(Protocol):
    """Gives a scale node its transform at encode time (MPS ``MPSImageTransformProvider``,
    ``transformForSourceImage:handle:``): called once per graph encode with the source
    `Image` (the whole batch: one shape) and the source image node's ``handle``; returns a
    `ScaleTransform`, or None for the default (the source fits the destination)."""

    def transform_for_source_image(self, source_image: Image, handle: Any) -> ScaleTransform | None:
        """The transform for ``source_image``."""
        ...


class ImageScale(CNNKernel):
    """Base of the image scales (MPS ``MPSImageScale``, abstract: make an `ImageBilinearScale`
    or an `ImageLanczosScale`). ``scale_transform`` (None by default) sets the mapping; without
    one, the source fits the destination image. ``offset.x``/``offset.y`` must be 0 (the
    transform places the source). Channels are unchanged. A returning encode makes a
    destination of ``round(source size * scale)`` pixels per axis, so it needs a transform."""

    _lanczos = False

    def __init__(self, device: Device) -> None:
        if type(self) is ImageScale:
            raise TypeError(
                "[ImageScale] ImageScale is abstract: make an ImageBilinearScale or an "
                "ImageLanczosScale, got ImageScale"
            )
        super().__init__(device)
        self._edge_mode = EdgeMode.CLAMP
        self._transform: ScaleTransform | None = None
        self._output_size: tuple[int, int] | None = None  # (width, height): set by scale nodes

    @property
    def scale_transform(self) -> ScaleTransform | None:
        """The source-to-destination mapping (None: the source fits the destination)."""
        return self._transform

    @scale_transform.setter
    def scale_transform(self, value: ScaleTransform | None) -> None:
        if value is not None and not isinstance(value, ScaleTransform):
            raise TypeError(
                f"[{type(self).__name__}] scale_transform must be a ScaleTransform or None, "
                f"got {type(value).__name__}"
            )
        self._transform = value

    def _policy(self, source_images: Any, source_states: Any) -> tuple[ImageDescriptor, Offset]:
        src = source_images[0]
        if self._output_size is not None:
            w, h = self._output_size
        elif self._transform is not None:
            w = max(1, round(src.width * self._transform.scale_x))
            h = max(1, round(src.height * self._transform.scale_y))
        else:
            raise ValueError(
                f"[{type(self).__name__}] a returning encode sizes its destination from "
                "scale_transform (source size times its scale): set one or give a "
                "destination_image, got scale_transform None"
            )
        channels = self._destination_channels(min(self._smax, src.feature_channels - self._sco))
        images = max(1, src.number_of_images - self._offset.z)
        desc = ImageDescriptor(src.feature_channel_format, w, h, channels, images)
        return desc, Offset(0, 0, self._offset.z)

    def _axis_windows(self, span: DestinationSpan) -> tuple[AxisWindow, AxisWindow]:
        return (
            AxisWindow(0, span.count_y, 1, 1, 1, span.source_height),
            AxisWindow(0, span.count_x, 1, 1, 1, span.source_width),
        )

    def _check_window(self, window: Window, src: Image) -> None:
        if self._offset.x or self._offset.y:
            raise ValueError(
                f"[{type(self).__name__}] offset.x and offset.y must be 0 (scale_transform "
                f"places the source), got ({self._offset.x}, {self._offset.y})"
            )

    def _plan(
        self, src: Image, dst: Image | None, batch: bool, policy_states: Any, saved: tuple[Any, ...]
    ) -> tuple[ImageDescriptor | None, dict[str, Any], Window, dict[str, Any]]:
        desc, props, window, memo = super()._plan(src, dst, batch, policy_states, saved)
        if "destination" not in memo:  # the default transform fits the whole destination
            shape = desc.shape if dst is None else dst._shape  # type: ignore[union-attr]
            memo["destination"] = shape[2:]
        return desc, props, window, memo

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        clamp = self._edge_mode is EdgeMode.CLAMP
        t = self._transform
        if t is None:  # the whole source onto the whole destination, u from its origin
            h, w = memo["destination"]
            t = ScaleTransform(w / window.x.size, h / window.y.size)
            fy, fx = window.dst_y, window.dst_x
        else:
            fy, fx = window.dst_y - self._clip.origin.y, window.dst_x - self._clip.origin.x
        lz = self._lanczos
        ay = ScaleAxis(fy, window.y.count, window.y.size, t.scale_y, t.translate_y, lz, clamp)
        ax = ScaleAxis(fx, window.x.count, window.x.size, t.scale_x, t.translate_x, lz, clamp)
        return lambda x: resample_forward(x, ay, ax)


class ImageBilinearScale(ImageScale):
    """Bilinear resampling (MPS ``MPSImageBilinearScale``): two taps per axis at
    ``p = (u + 1/2 - translate) / scale - 1/2``; no low-pass filter when reducing."""


class ImageLanczosScale(ImageScale):
    """Lanczos resampling, a = 3 (MPS ``MPSImageLanczosScale``): 6 taps per axis when
    enlarging, ``6 / scale`` when reducing (the kernel stretched by the reduction), weights
    normalized to sum 1."""

    _lanczos = True
