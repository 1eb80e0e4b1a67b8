"""Coordinates, edge modes, padding policies and the window model.

The window model, per axis (y is the same with height):

* ``E = dilation * (kernel - 1) + 1`` is the effective window.
* Destination pixel ``x`` (inside the clip rect) centres its window in the source at
  ``c(x) = offset.x + stride * (x - clip.origin.x)``.
* Its taps are ``c(x) - E // 2 + dilation * j`` for ``j = 0 .. kernel - 1`` (even windows lean
  top-left: kernel 2, dilation 3 reads ``c - 2`` and ``c + 1``).
* A tap outside the source reads 0 (`EdgeMode.ZERO`) or the nearest edge pixel (`EdgeMode.CLAMP`).

`AxisWindow` is that model resolved for one encode: the source coordinate of the first tap of
the first written pixel and the number of written pixels. `Window` adds the image and channel
ranges. Every windowed kernel (and the gradient state that records it) works from a `Window`.

Padding policy (``style`` = -1 valid, 0 same, +1 full; ``r`` = 1 when the remainder goes
top/left):

* forward size ``dst = ceil((src + style * (E - 1)) / stride)``
* reverse size ``dst = (src - 1) * stride + 1 + style * (E - 1)`` (enlarging kernels)
* offset ``E // 2 - floor(((dst - 1) * stride + E - src + r) / 2)`` (centred);
  ALIGN_TOP_LEFT puts all padding bottom/right, ALIGN_BOTTOM_RIGHT all top/left.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

if TYPE_CHECKING:
    from mpsnn.core.descriptor import ImageDescriptor

__all__ = [
    "RECT_NO_CLIP",
    "AxisWindow",
    "DefaultPadding",
    "EdgeMode",
    "ImageCoordinate",
    "Offset",
    "Origin",
    "Padding",
    "PaddingMethod",
    "Region",
    "Size",
    "Window",
    "forward_size",
    "padding_offset",
    "reverse_size",
]

_HUGE = 1 << 62  # "no limit" for sizes and channel counts (MPS uses NSUIntegerMax)


def _int(owner: str, name: str, value: Any) -> int:
    # bool is an int subclass; accepting True as a coordinate would hide bugs.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"[{owner}] {name} must be an int, got {type(value).__name__} {value!r}")
    return value


# The value types are validated tuples: immutable, cheap to build, compare and hash (encodes
# use them as cache keys). Like all tuples they compare equal to tuples of the same values.


class _OffsetFields(NamedTuple):
    x: int
    y: int
    z: int


class Offset(_OffsetFields):
    """A signed position (MPS ``MPSOffset``). ``z`` selects the first source image."""

    __slots__ = ()

    def __new__(cls, x: int = 0, y: int = 0, z: int = 0) -> Offset:
        return super().__new__(
            cls, _int("Offset", "x", x), _int("Offset", "y", y), _int("Offset", "z", z)
        )


class Origin(_OffsetFields):
    """A destination position (MPS ``MTLOrigin``); signed here, a clip rect may start outside."""

    __slots__ = ()

    def __new__(cls, x: int = 0, y: int = 0, z: int = 0) -> Origin:
        return super().__new__(
            cls, _int("Origin", "x", x), _int("Origin", "y", y), _int("Origin", "z", z)
        )


class _SizeFields(NamedTuple):
    width: int
    height: int
    depth: int


def _extent(owner: str, name: str, value: Any) -> int:
    v = _int(owner, name, value)
    if v < 0:
        raise ValueError(f"[{owner}] {name} must be >= 0, got {v}")
    return v


class Size(_SizeFields):
    """An extent (MPS ``MTLSize``): width, height and depth (images), each >= 0."""

    __slots__ = ()

    def __new__(cls, width: int = 1, height: int = 1, depth: int = 1) -> Size:
        return super().__new__(
            cls,
            _extent("Size", "width", width),
            _extent("Size", "height", height),
            _extent("Size", "depth", depth),
        )


class _RegionFields(NamedTuple):
    origin: Origin
    size: Size


class Region(_RegionFields):
    """An origin and a size (MPS ``MTLRegion``); used for clip rects and byte I/O."""

    __slots__ = ()

    def __new__(cls, origin: Origin | None = None, size: Size | None = None) -> Region:
        origin = Origin() if origin is None else origin
        size = Size() if size is None else size
        if not isinstance(origin, Origin):
            raise TypeError(f"[Region] origin must be an Origin, got {type(origin).__name__}")
        if not isinstance(size, Size):
            raise TypeError(f"[Region] size must be a Size, got {type(size).__name__}")
        return super().__new__(cls, origin, size)

    @classmethod
    def make(cls, x: int, y: int, width: int, height: int, z: int = 0, depth: int = 1) -> Region:
        """Shorthand for ``Region(Origin(x, y, z), Size(width, height, depth))``."""
        return cls(Origin(x, y, z), Size(width, height, depth))


class _CoordinateFields(NamedTuple):
    x: int
    y: int
    channel: int


class ImageCoordinate(_CoordinateFields):
    """A position in x, y and feature channels (MPS ``MPSImageCoordinate``); each >= 0 here,
    where it gives padding sizes."""

    __slots__ = ()

    def __new__(cls, x: int = 0, y: int = 0, channel: int = 0) -> ImageCoordinate:
        who = "ImageCoordinate"
        return super().__new__(
            cls, _extent(who, "x", x), _extent(who, "y", y), _extent(who, "channel", channel)
        )


RECT_NO_CLIP = Region(Origin(0, 0, 0), Size(_HUGE, _HUGE, _HUGE))
"""The clip rect that means "the whole destination" (MPS ``MPSRectNoClip``)."""


class EdgeMode(enum.IntEnum):
    """What a read outside the source returns (MPS ``MPSImageEdgeMode``).

    ZERO reads 0 and CLAMP the nearest edge pixel; average pooling reads CLAMP as "shrink the
    window" instead. MIRROR, MIRROR_WITH_EDGE and CONSTANT are honoured by `Pad` only; other
    kernels reject them.
    """

    ZERO = 0
    CLAMP = 1
    MIRROR = 2
    MIRROR_WITH_EDGE = 3
    CONSTANT = 4


class PaddingMethod(enum.IntFlag):
    """MPS ``MPSNNPaddingMethod`` bit field: alignment | remainder | size | flags.

    The zero-valued names (ALIGN_CENTERED, ADD_REMAINDER_TO_TOP_LEFT, SIZE_VALID_ONLY) are the
    defaults of their field; combine fields with ``|``.
    """

    ALIGN_CENTERED = 0
    ALIGN_TOP_LEFT = 1
    ALIGN_BOTTOM_RIGHT = 2
    ALIGN_RESERVED = 3
    ADD_REMAINDER_TO_TOP_LEFT = 0
    ADD_REMAINDER_TO_TOP_RIGHT = 4
    ADD_REMAINDER_TO_BOTTOM_LEFT = 8
    ADD_REMAINDER_TO_BOTTOM_RIGHT = 12
    SIZE_VALID_ONLY = 0
    SIZE_SAME = 16
    SIZE_FULL = 32
    SIZE_RESERVED = 48
    CUSTOM_WHITELIST_FOR_NODE_FUSION = 1 << 13
    CUSTOM = 1 << 14
    EXCLUDE_EDGES = 1 << 15

    # Field masks (not members: they are not meaningful methods on their own).
    @property
    def alignment(self) -> int:
        """The alignment field (bits 0-1)."""
        return int(self) & 0x3

    @property
    def remainder(self) -> int:
        """The remainder field (bits 2-3)."""
        return int(self) & 0xC

    @property
    def size_style(self) -> int:
        """-1 for SIZE_VALID_ONLY, 0 for SIZE_SAME, +1 for SIZE_FULL."""
        field = int(self) & 0x7F0
        if field == 0:
            return -1
        if field == int(PaddingMethod.SIZE_SAME):
            return 0
        if field == int(PaddingMethod.SIZE_FULL):
            return 1
        raise ValueError(
            "[PaddingMethod] the size field must be SIZE_VALID_ONLY, SIZE_SAME or SIZE_FULL, "
            f"got {field:#x}"
        )


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def forward_size(src: int, extent: int, stride: int, style: int) -> int:
    """``ceil((src + style * (E - 1)) / stride)``, at least 0 (a valid-only window may not fit)."""
    return max(0, _ceil_div(src + style * (extent - 1), stride))


def reverse_size(src: int, extent: int, stride: int, style: int) -> int:
    """``(src - 1) * stride + 1 + style * (E - 1)`` for enlarging (backwards) kernels."""
    return max(0, (src - 1) * stride + 1 + style * (extent - 1))


def padding_offset(
    src: int, dst: int, extent: int, stride: int, alignment: int, remainder_first: bool
) -> int:
    """Offset (window centre of the first output) that places ``dst`` windows over ``src``.

    ``pad = (dst - 1) * stride + E - src`` is the padding the windows need in total (negative
    when the source has pixels to spare). Centred alignment puts ``floor((pad + r) / 2)`` before
    the image, with ``r = 1`` when the remainder goes first (top/left); ALIGN_TOP_LEFT puts none
    before, ALIGN_BOTTOM_RIGHT puts all of it before.
    """
    pad = (dst - 1) * stride + extent - src
    if alignment == int(PaddingMethod.ALIGN_TOP_LEFT):
        before = 0
    elif alignment == int(PaddingMethod.ALIGN_BOTTOM_RIGHT):
        before = pad
    elif alignment == int(PaddingMethod.ALIGN_CENTERED):
        before = (pad + (1 if remainder_first else 0)) // 2
    else:
        raise ValueError(
            f"[PaddingMethod] the alignment field must not be ALIGN_RESERVED, got {alignment}"
        )
    return extent // 2 - before


def remainder_first(method: PaddingMethod) -> tuple[bool, bool]:
    """(x, y): whether the odd pixel of padding goes left (x) / top (y) for this method."""
    rem = method.remainder
    x_first = rem in (
        int(PaddingMethod.ADD_REMAINDER_TO_TOP_LEFT),
        int(PaddingMethod.ADD_REMAINDER_TO_BOTTOM_LEFT),
    )
    y_first = rem in (
        int(PaddingMethod.ADD_REMAINDER_TO_TOP_LEFT),
        int(PaddingMethod.ADD_REMAINDER_TO_TOP_RIGHT),
    )
    return x_first, y_first


@runtime_checkable
class Padding(Protocol):
    """A padding policy (MPS ``MPSNNPadding``).

    ``padding_method`` drives the default size and offset computation. When it has the CUSTOM
    bit, ``destination_image_descriptor(source_images, source_states, kernel,
    suggested_descriptor)`` is called afterwards; it may change kernel properties (it must set
    ``kernel.offset`` if it changes the size) and returns the descriptor to use.
    """

    @property
    def padding_method(self) -> PaddingMethod: ...


class DefaultPadding:
    """The stock padding policies (MPS ``MPSNNDefaultPadding``).

    Args:
        method: the `PaddingMethod` bits.

    The TensorFlow average-pooling policies also set ``kernel.edge_mode = EdgeMode.CLAMP`` so that
    average pooling divides by the number of valid pixels, as TensorFlow does.
    """

    __slots__ = ("_method", "_sets_clamp", "label")

    def __init__(self, method: PaddingMethod | int, *, label: str | None = None) -> None:
        if isinstance(method, bool) or not isinstance(method, int):
            raise TypeError(
                f"[DefaultPadding] method must be a PaddingMethod, got {type(method).__name__}"
            )
        self._method = PaddingMethod(method)
        _ = self._method.size_style  # validates the size field now, not at the first encode
        if self._method.alignment == int(PaddingMethod.ALIGN_RESERVED):
            raise ValueError("[DefaultPadding] the alignment must not be ALIGN_RESERVED, got 3")
        self._sets_clamp = False
        self.label = label

    @property
    def padding_method(self) -> PaddingMethod:
        return self._method

    @classmethod
    def tensorflow_average_pooling(cls) -> DefaultPadding:
        """TensorFlow SAME average pooling: centred, remainder bottom-right, CLAMP edges."""
        pad = cls(
            PaddingMethod.CUSTOM
            | PaddingMethod.ALIGN_CENTERED
            | PaddingMethod.ADD_REMAINDER_TO_BOTTOM_RIGHT
            | PaddingMethod.SIZE_SAME,
            label="tensorflow_average_pooling",
        )
        pad._sets_clamp = True
        return pad

    @classmethod
    def tensorflow_average_pooling_valid_only(cls) -> DefaultPadding:
        """TensorFlow VALID average pooling (CLAMP edges, no padding needed)."""
        pad = cls(
            PaddingMethod.CUSTOM
            | PaddingMethod.ALIGN_CENTERED
            | PaddingMethod.ADD_REMAINDER_TO_BOTTOM_RIGHT
            | PaddingMethod.SIZE_VALID_ONLY,
            label="tensorflow_average_pooling_valid_only",
        )
        pad._sets_clamp = True
        return pad

    def destination_image_descriptor(
        self,
        source_images: Any,
        source_states: Any,
        kernel: Any,
        suggested_descriptor: ImageDescriptor,
    ) -> ImageDescriptor:
        """Custom hook: the TensorFlow policies switch the kernel to CLAMP edges."""
        if self._sets_clamp:
            kernel.edge_mode = EdgeMode.CLAMP
        return suggested_descriptor

    def __repr__(self) -> str:
        return f"DefaultPadding({self._method!r})"


class AxisWindow(NamedTuple):
    """One axis of the window model, resolved for one encode.

    Output ``i`` in ``[0, count)`` reads source taps ``start + stride * i + dilation * j``,
    ``j`` in ``[0, kernel)``, of a source ``size`` pixels long. (A NamedTuple: encodes make
    these on the hot path.)
    """

    start: int
    count: int  # type: ignore[assignment]  # a NamedTuple field named like a tuple method
    kernel: int
    stride: int
    dilation: int
    size: int

    @property
    def extent(self) -> int:
        """Effective window ``dilation * (kernel - 1) + 1``."""
        return self.dilation * (self.kernel - 1) + 1

    @property
    def stop(self) -> int:
        """One past the last source coordinate any tap reads."""
        if not self.count:
            return self.start
        return self.start + self.stride * (self.count - 1) + self.extent

    @property
    def inside(self) -> bool:
        """True when every tap lies inside the source (edge mode does not matter)."""
        return self.start >= 0 and self.stop <= self.size


class DestinationSpan(NamedTuple):
    """What a kernel's window hook needs to know about one encode's destination rectangle.

    ``offset`` is the kernel's (resolved) offset; rows ``skip_y ..`` and columns ``skip_x ..``
    past the clip rect's origin are the first written (non-zero when the clip rect starts
    above or left of the destination); ``count_y`` by ``count_x`` pixels are written from a
    source ``source_height`` by ``source_width``.
    """

    offset: Offset
    skip_y: int
    count_y: int
    skip_x: int
    count_x: int
    source_height: int
    source_width: int


class Window(NamedTuple):
    """Everything an encode resolved about where it reads and writes.

    Images ``[src_image, src_image + images)`` of the source map to
    ``[dst_image, dst_image + images)`` of the destination. Source channels
    ``[src_channel, src_channel + src_channels)`` are read; ``dst_channels`` results land at
    destination channel ``dst_channel``. Destination pixels ``dst_y .. dst_y + y.count`` by
    ``dst_x .. dst_x + x.count`` are written.
    """

    y: AxisWindow
    x: AxisWindow
    src_image: int
    dst_image: int
    images: int
    src_channel: int
    src_channels: int
    dst_channel: int
    dst_channels: int
    dst_y: int
    dst_x: int
