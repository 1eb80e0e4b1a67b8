"""Reductions (MPS ``MPSNNReduce*``): min, max, mean and sum along the rows, the columns or the
feature channels, the index of the extreme feature channel, and the weighted feature-channel
sums of two images. Forward only: MPS defines no gradient for them.

**Unary** (`ReduceUnary`, a `CNNKernel`). ``clip_rect_source`` is the source region read
(intersected with the source; its ``z`` range selects the source images); it replaces
``offset``, which these kernels ignore. Destination pixel ``u`` (counted from the clip rect's
origin) holds the reduction of source pixel ``clip_rect_source.origin + u`` along the
non-reduced axes; along the reduced axis the result has size 1 (one column for the row
reductions, one row for the column reductions, one channel for the feature-channel ones) and
covers the whole region. The returning encode allocates exactly that: the region's size with
the reduced axis 1 (MPS sizes it from the whole source; the region's size is what the kernel
can fill). Channels: those read (``source_feature_channel_offset``, ``max_count``), written
from ``destination_feature_channel_offset``.

* ``Row*`` reduce each row (along x), ``Column*`` each column (along y), ``FeatureChannels*``
  the channels of each pixel. Mean divides by the number of values reduced.
* `ReduceFeatureChannelsArgumentMin` / ``ArgumentMax`` write the index of the extreme channel
  as a float, counted from the first channel read; ties give the first index.
* `ReduceFeatureChannelsSum` multiplies the sum by ``weight`` (default 1).

**Binary** (`ReduceBinary`, a `BinaryKernel`): ``primary_source_clip_rect`` and
``secondary_source_clip_rect`` replace the offsets. The feature-channel-and-weights
reductions write one channel, ``sum_c x[c] w[c]`` over the primary's channels read and as many
secondary channels (the weights), then: nothing more (`ReduceFeatureChannelsAndWeightsSum`),
divided by the channel count (`ReduceFeatureChannelsAndWeightsMean`), or divided by the number
of non-zero weights, 0 where there is none (``do_weighted_sum_by_non_zero_weights``). These
are the Sum, Mean and SumByNonZeroWeights of MPS's loss reductions. The weights region is
1x1 (one weight per channel for every pixel) or the primary region's size (per pixel). The
secondary holds as many images as the primary reads, or one image used for all. The result has
the primary region's size; pixels map as for the unary kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpsnn.core._checks import check_type
from mpsnn.core.binary import BinaryKernel
from mpsnn.core.cnn_kernel import CNNKernel, Forward, Records
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.descriptor import ImageDescriptor, _result_format
from mpsnn.core.device import Device
from mpsnn.core.encode import Encoding
from mpsnn.core.geometry import (
    RECT_NO_CLIP,
    AxisWindow,
    DestinationSpan,
    Offset,
    Region,
    Window,
)
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.kernel import image_sequences, resolve_span
from mpsnn.core.saved import Field
from mpsnn.ops.reduce import reduce_block, weighted_channels

__all__ = [
    "ReduceBinary",
    "ReduceColumnMax",
    "ReduceColumnMean",
    "ReduceColumnMin",
    "ReduceColumnSum",
    "ReduceFeatureChannelsAndWeightsMean",
    "ReduceFeatureChannelsAndWeightsSum",
    "ReduceFeatureChannelsArgumentMax",
    "ReduceFeatureChannelsArgumentMin",
    "ReduceFeatureChannelsMax",
    "ReduceFeatureChannelsMean",
    "ReduceFeatureChannelsMin",
    "ReduceFeatureChannelsSum",
    "ReduceRowMax",
    "ReduceRowMean",
    "ReduceRowMin",
    "ReduceRowSum",
    "ReduceUnary",
]

_ROW, _COLUMN, _CHANNELS = 3, 2, 1  # the dimension each family reduces


def source_region(
    who: str, name: str, region: Region, shape: tuple[int, ...], images: bool = True
) -> tuple[int, int, int, int, int, int]:
    """``region`` intersected with an ``(N, C, H, W)`` image: (z, images, y, rows, x, cols);
    raises when nothing is left (``images=False``: the z range is not looked at, (0, N))."""
    n, _, h, w = shape
    axes = [
        (region.origin.y, region.size.height, h, "y"),
        (region.origin.x, region.size.width, w, "x"),
    ]
    out = [0, n]
    if images:
        axes.insert(0, (region.origin.z, region.size.depth, n, "z (images)"))
        out = []
    for origin, size, extent, axis in axes:
        lo, hi = max(origin, 0), min(origin + size, extent)
        if hi <= lo:
            raise ValueError(
                f"[{who}] {name} must overlap the {n}x{w}x{h} (images x width x height) source "
                f"along {axis}, got origin {origin} and size {size}"
            )
        out += [lo, hi - lo]
    return tuple(out)  # type: ignore[return-value]


class ReduceUnary(CNNKernel):
    """Base of the one-source reductions (MPS ``MPSNNReduceUnary``); see the module docstring.
    ``clip_rect_source`` (default `RECT_NO_CLIP`: the whole source) replaces ``offset``."""

    _dim = _ROW
    _op = "min"
    _geometry_attrs = ("_offset", "_edge_mode", "_clip", "_dco", "_sco", "_smax", "_clip_src")

    def __init__(self, device: Device) -> None:
        super().__init__(device)
        self._clip_src = RECT_NO_CLIP

    @property
    def clip_rect_source(self) -> Region:
        """The source region read (intersected with the source)."""
        return self._clip_src

    @clip_rect_source.setter
    def clip_rect_source(self, value: Region) -> None:
        self._clip_src = check_type(type(self).__name__, "clip_rect_source", value, Region)

    def _reduces(self, dim: int) -> bool:
        """Whether the result has size 1 along ``dim`` (1: channels, 2: y, 3: x)."""
        return dim == self._dim

    def _destination_channels(self, source_channels: int) -> int:
        return 1 if self._reduces(_CHANNELS) else source_channels

    def _policy(self, source_images: Any, source_states: Any) -> tuple[ImageDescriptor, Offset]:
        src = source_images[0]
        who = type(self).__name__
        _, nz, _, ny, _, nx = source_region(who, "clip_rect_source", self._clip_src, src.shape)
        c = src.shape[1]
        if self._sco >= c:
            raise ValueError(
                f"[{who}] source_feature_channel_offset must be < the source's {c} channels, "
                f"got {self._sco}"
            )
        channels = self._destination_channels(min(self._smax, c - self._sco))
        h = 1 if self._reduces(_COLUMN) else ny
        w = 1 if self._reduces(_ROW) else nx
        return ImageDescriptor(src.feature_channel_format, w, h, channels, nz), self._offset

    def _window(
        self, src_shape: tuple[int, ...], dst_shape: tuple[int, ...], offset: Offset, batch: bool
    ) -> Window:
        who = type(self).__name__
        z, nz, *_ = source_region(who, "clip_rect_source", self._clip_src, src_shape)
        w = super()._window(src_shape, dst_shape, Offset(0, 0, 0 if batch else z), batch)
        return w if batch else w._replace(images=min(w.images, nz))

    def _axis_windows(self, span: DestinationSpan) -> tuple[AxisWindow, AxisWindow]:
        who = type(self).__name__
        shape = (1, 1, span.source_height, span.source_width)
        _, _, y, ny, x, nx = source_region(who, "clip_rect_source", self._clip_src, shape, False)
        axes = []
        for start, size, skip, count, full, reduced, name in (
            (y, ny, span.skip_y, span.count_y, span.source_height, self._reduces(_COLUMN), "y"),
            (x, nx, span.skip_x, span.count_x, span.source_width, self._reduces(_ROW), "x"),
        ):
            if reduced:  # one output, reading the whole region
                if skip:
                    raise ValueError(
                        f"[{who}] the clip rect's {name} origin must be inside the destination "
                        f"(the reduced axis has one pixel, at the origin), got {-skip}"
                    )
                axes.append(AxisWindow(start, 1, size, 1, 1, full))
                continue
            written = min(count, size - skip)
            if written <= 0:
                raise ValueError(
                    f"[{who}] the clip rect must start inside the {size}-pixel source region "
                    f"along {name}, got {skip} pixels past it"
                )
            axes.append(AxisWindow(start + skip, written, 1, 1, 1, full))
        return axes[0], axes[1]

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        ay, ax = window.y, window.x
        rows = slice(ay.start, ay.start + ay.count * ay.stride + ay.kernel - 1)
        cols = slice(ax.start, ax.start + ax.count * ax.stride + ax.kernel - 1)
        op, dim, weight = self._op, self._dim, getattr(self, "_weight", 1.0)
        return lambda x: reduce_block(x[:, :, rows, cols], op, dim, weight)


#: what a one-source reduction saves besides the kernel configuration
_UNARY_FIELDS = (Field("clip_rect_source", Region, init=False),)


def _unary(name: str, dim: int, op: str, what: str) -> type:
    doc = f"{what} (MPS ``MPSNN{name}``)."
    namespace = {"__doc__": doc, "_dim": dim, "_op": op, "saved_fields": _UNARY_FIELDS}
    return type(name, (ReduceUnary,), namespace)


_ARG = "as a float counted from the first channel read; the first wins ties"
ReduceRowMin = _unary("ReduceRowMin", _ROW, "min", "The minimum of each row")
ReduceRowMax = _unary("ReduceRowMax", _ROW, "max", "The maximum of each row")
ReduceRowMean = _unary("ReduceRowMean", _ROW, "mean", "The mean of each row")
ReduceRowSum = _unary("ReduceRowSum", _ROW, "sum", "The sum of each row")
ReduceColumnMin = _unary("ReduceColumnMin", _COLUMN, "min", "The minimum of each column")
ReduceColumnMax = _unary("ReduceColumnMax", _COLUMN, "max", "The maximum of each column")
ReduceColumnMean = _unary("ReduceColumnMean", _COLUMN, "mean", "The mean of each column")
ReduceColumnSum = _unary("ReduceColumnSum", _COLUMN, "sum", "The sum of each column")
ReduceFeatureChannelsMin = _unary(
    "ReduceFeatureChannelsMin", _CHANNELS, "min", "The minimum over each pixel's channels"
)
ReduceFeatureChannelsMax = _unary(
    "ReduceFeatureChannelsMax", _CHANNELS, "max", "The maximum over each pixel's channels"
)
ReduceFeatureChannelsMean = _unary(
    "ReduceFeatureChannelsMean", _CHANNELS, "mean", "The mean over each pixel's channels"
)
ReduceFeatureChannelsArgumentMin = _unary(
    "ReduceFeatureChannelsArgumentMin", _CHANNELS, "argmin",
    f"The index of each pixel's minimum channel, {_ARG}",
)  # fmt: skip
ReduceFeatureChannelsArgumentMax = _unary(
    "ReduceFeatureChannelsArgumentMax", _CHANNELS, "argmax",
    f"The index of each pixel's maximum channel, {_ARG}",
)  # fmt: skip


class ReduceFeatureChannelsSum(ReduceUnary):
    """``weight * sum_c x[c]`` for each pixel (MPS ``MPSNNReduceFeatureChannelsSum``)."""

    _dim = _CHANNELS
    _op = "sum"
    saved_fields = (*_UNARY_FIELDS, Field("weight", float, init=False))

    def __init__(self, device: Device) -> None:
        super().__init__(device)
        self._weight = 1.0

    @property
    def weight(self) -> float:
        """The factor applied to every channel value (default 1)."""
        return self._weight

    @weight.setter
    def weight(self, value: float) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(
                f"[{type(self).__name__}] weight must be a number, got {type(value).__name__}"
            )
        self._weight = float(value)


# -- binary -------------------------------------------------------------------------------------

Combine = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class ReduceBinary(BinaryKernel):
    """Base of the two-source reductions (MPS ``MPSNNReduceBinary``): each source is read in
    its clip rect (``primary_source_clip_rect``, ``secondary_source_clip_rect``, default
    `RECT_NO_CLIP`), which replaces its offset; see the module docstring. Forward only: an
    encode takes no destination state."""

    def __init__(self, device: Device) -> None:
        super().__init__(device)
        self._pclip = RECT_NO_CLIP
        self._sclip = RECT_NO_CLIP

    @property
    def primary_source_clip_rect(self) -> Region:
        """The primary source region read (intersected with the primary source)."""
        return self._pclip

    @primary_source_clip_rect.setter
    def primary_source_clip_rect(self, value: Region) -> None:
        self._pclip = check_type(type(self).__name__, "primary_source_clip_rect", value, Region)

    @property
    def secondary_source_clip_rect(self) -> Region:
        """The secondary source region read (intersected with the secondary source)."""
        return self._sclip

    @secondary_source_clip_rect.setter
    def secondary_source_clip_rect(self, value: Region) -> None:
        self._sclip = check_type(type(self).__name__, "secondary_source_clip_rect", value, Region)

    # -- family hooks ---------------------------------------------------------------------

    def _out_channels(self, channels: int) -> int:
        """Channels written for ``channels`` read from each source."""
        return 1

    def _check_regions(self, primary: tuple[int, int], secondary: tuple[int, int]) -> None:
        """Raise ValueError when the (height, width) of the two regions do not go together."""

    def _combine(self) -> Combine:
        """The math, from the primary and secondary blocks (regions, channels read) to the
        ``(images, out channels, height, width)`` result over the whole primary region;
        captures the configuration at encode."""
        raise NotImplementedError

    # -- encode ---------------------------------------------------------------------------

    def encode(
        self,
        command_buffer: CommandBuffer,
        primary_image: Image,
        secondary_image: Image,
        destination_image: Image | None = None,
        destination_state: Any = None,
    ) -> Image:
        """Reduce ``primary_image`` with ``secondary_image`` into the destination (allocated
        with the primary region's size when not given)."""
        cb = command_buffer
        self._check_command_buffer(cb)
        self._check_image(cb, primary_image, "primary_image")
        self._check_image(cb, secondary_image, "secondary_image")
        self._no_state(destination_state is not None)
        return self._encode(cb, primary_image, secondary_image, destination_image, batch=False)

    @image_sequences("primary_images", "secondary_images", destinations=("destination_images",))
    def encode_batch(
        self,
        command_buffer: CommandBuffer,
        primary_images: ImageBatch,
        secondary_images: ImageBatch,
        destination_images: ImageBatch | None = None,
        destination_states: Sequence[Any] | None = None,
    ) -> ImageBatch:
        """Batch form of `encode`; the secondary batch holds as many images as the primary, or
        one image used for all."""
        cb = command_buffer
        self._check_command_buffer(cb)
        p = self._check_batch(cb, primary_images, "primary_images")
        s = self._check_batch(cb, secondary_images, "secondary_images")
        d = None
        if destination_images is not None:
            d = self._check_batch(cb, destination_images, "destination_images")
        self._no_state(destination_states is not None)
        out = self._encode(cb, p, s, d, batch=True)
        return destination_images if destination_images is not None else ImageBatch(out)

    def _no_state(self, given: bool) -> None:
        if given:
            raise ValueError(
                f"[{type(self).__name__}] this kernel has no gradient (MPS defines none), so no "
                "destination state: it must be None, got a state"
            )

    def _channels(self, image: Image, which: str) -> tuple[int, int]:
        sco = getattr(self, f"_{which}_source_feature_channel_offset")
        smax = getattr(self, f"_{which}_source_feature_channel_max_count")
        c = image.feature_channels
        if sco >= c:
            raise ValueError(
                f"[{type(self).__name__}] {which}_source_feature_channel_offset must be < the "
                f"{which} source's {c} channels, got {sco}"
            )
        return sco, min(smax, c - sco)

    def _encode(
        self, cb: CommandBuffer, p: Image, s: Image, dst: Image | None, batch: bool
    ) -> Image:
        who = type(self).__name__
        pz, pn, py, ph, px, pw = source_region(
            who, "primary_source_clip_rect", self._pclip, p._shape
        )
        sz, sn, sy, sh, sx, sw = source_region(
            who, "secondary_source_clip_rect", self._sclip, s._shape
        )
        (pc0, nc), (sc0, snc) = self._channels(p, "primary"), self._channels(s, "secondary")
        if snc != nc:
            raise ValueError(
                f"[{who}] the secondary source must give as many channels as the primary "
                f"({nc}), got {snc}"
            )
        self._check_regions((ph, pw), (sh, sw))
        if batch:  # a batch ignores the z ranges, as every batch encode does
            pz, pn, sz, sn = 0, p.number_of_images, 0, s.number_of_images
        if sn != 1 and sn < pn:
            raise ValueError(
                f"[{who}] the secondary source must give as many images as the primary ({pn}) "
                f"or one, got {sn}"
            )
        s_images = 1 if sn < pn else pn
        out_c = self._out_channels(nc)
        clip = self._clip
        if dst is None:
            desc = ImageDescriptor(_result_format(p._fmt), pw, ph, out_c, pn)
            dshape, out = desc.shape, desc
        else:
            self._check_destination(cb, dst, "destination_image", p, s)
            dshape, out = dst._shape, dst
            if self._dco + out_c > dshape[1]:
                raise ValueError(
                    f"[{who}] the destination needs destination_feature_channel_offset + "
                    f"{out_c} channels = {self._dco + out_c}, got a destination with {dshape[1]}"
                )
        if batch:
            dz, count = 0, pn
            if dshape[0] != pn:
                raise ValueError(
                    f"[{who}] the destination batch must hold {pn} images, got {dshape[0]}"
                )
        else:
            dz = clip.origin.z
            count = min(pn, clip.size.depth, dshape[0] - dz)
            if dz < 0 or count <= 0:
                raise ValueError(
                    f"[{who}] the clip rect's z range (origin {dz}, depth {clip.size.depth}) "
                    f"must select at least one of the destination's {dshape[0]} images, got none"
                )
            s_images = 1 if s_images == 1 else count
        spans = []
        for axis, origin, size, extent, region in (
            ("y", clip.origin.y, clip.size.height, dshape[2], ph),
            ("x", clip.origin.x, clip.size.width, dshape[3], pw),
        ):
            lo, n = resolve_span(who, axis, origin, size, extent)
            skip = lo - origin
            n = min(n, region - skip)
            if n <= 0:
                raise ValueError(
                    f"[{who}] the clip rect must start inside the {region}-pixel primary region "
                    f"along {axis}, got {skip} pixels past it"
                )
            spans.append((lo, skip, n))
        (y0, ky, ny), (x0, kx, nx) = spans
        combine = self._combine()
        dco = self._dco

        def run(result: Image) -> None:
            a = p._read()[pz : pz + count, pc0 : pc0 + nc, py : py + ph, px : px + pw]
            b = s._read()[sz : sz + s_images, sc0 : sc0 + nc, sy : sy + sh, sx : sx + sw]
            z = combine(a, b)[:, :, ky : ky + ny, kx : kx + nx]
            result._write_block(z.to(result._read_dtype), dz, dco, y0, x0, p._data())

        enc = Encoding(run, (out,), (p, s), (), None, batch)
        return self._apply(cb, enc)[0]  # type: ignore[return-value]


class _ChannelsAndWeights(ReduceBinary):
    """``sum_c x[c] w[c]`` per pixel, then the family's division (see the module docstring)."""

    _mode = "mean"

    def _check_regions(self, primary: tuple[int, int], secondary: tuple[int, int]) -> None:
        if secondary not in ((1, 1), primary):
            raise ValueError(
                f"[{type(self).__name__}] the weights region must be 1x1 or the primary "
                f"region's {primary[1]}x{primary[0]}, got {secondary[1]}x{secondary[0]}"
            )

    def _combine(self) -> Combine:
        mode = self._mode
        return lambda x, w: weighted_channels(x, w, mode)


#: what a two-source reduction saves besides the kernel configuration
_BINARY_FIELDS = (
    Field("primary_source_clip_rect", Region, init=False),
    Field("secondary_source_clip_rect", Region, init=False),
)


class ReduceFeatureChannelsAndWeightsMean(_ChannelsAndWeights):
    """``sum_c x[c] w[c] / C`` per pixel, ``C`` the channels read (MPS
    ``MPSNNReduceFeatureChannelsAndWeightsMean``)."""

    saved_fields = _BINARY_FIELDS


class ReduceFeatureChannelsAndWeightsSum(_ChannelsAndWeights):
    """``sum_c x[c] w[c]`` per pixel, or divided by the number of non-zero weights (0 where
    there is none) with ``do_weighted_sum_by_non_zero_weights`` (MPS
    ``MPSNNReduceFeatureChannelsAndWeightsSum``).

    Args:
        device: the kernel's device.
        do_weighted_sum_by_non_zero_weights: divide by the number of non-zero weights
            (default False; read-only afterwards, as in MPS).
    """

    saved_fields = (Field("do_weighted_sum_by_non_zero_weights", bool), *_BINARY_FIELDS)

    def __init__(self, device: Device, do_weighted_sum_by_non_zero_weights: bool = False) -> None:
        super().__init__(device)
        self._by_non_zero = check_type(
            type(self).__name__,
            "do_weighted_sum_by_non_zero_weights",
            do_weighted_sum_by_non_zero_weights,
            bool,
        )
        self._mode = "non_zero" if self._by_non_zero else "sum"

    @property
    def do_weighted_sum_by_non_zero_weights(self) -> bool:
        return self._by_non_zero
