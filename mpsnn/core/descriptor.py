"""Storage formats, byte-I/O layouts and image descriptors."""

from __future__ import annotations

import enum
from typing import Any

import torch

__all__ = [
    "DataLayout",
    "FeatureChannelFormat",
    "ImageDescriptor",
    "ImageReadWriteParams",
]


class FeatureChannelFormat(enum.IntEnum):
    """Storage format of an image's feature channels (MPS ``MPSImageFeatureChannelFormat``).

    FLOAT64 is an mpsnn extension for verification. Arithmetic on FLOAT16 and BFLOAT16 images
    accumulates in float32.

    UNORM8 (MPS ``MPSImageFeatureChannelFormatUnorm8``, for input images) stores uint8 bytes ``k``
    that read as ``k/255``: kernels read such an image as float32 ``k/255``, and a UNORM8
    destination stores ``round(clamp(v, 0, 1) * 255)`` (round half to even). A destination made
    from a source's format (the padding policy's, a returned gradient's) takes that format,
    except UNORM8, which becomes FLOAT32.
    """

    UNORM8 = 1
    FLOAT16 = 3
    FLOAT32 = 4
    BFLOAT16 = 5
    FLOAT64 = 64

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of the storage."""
        return _FORMAT_TO_DTYPE[self]

    @classmethod
    def from_dtype(cls, dtype: torch.dtype) -> FeatureChannelFormat:
        """The format whose storage dtype is ``dtype``."""
        try:
            return _DTYPE_TO_FORMAT[dtype]
        except KeyError:
            raise TypeError(
                "[FeatureChannelFormat] the dtype must be float32, float16, bfloat16 or float64, "
                f"got {dtype}; uint8 (UNORM8) is accepted too"
            ) from None


_FORMAT_TO_DTYPE = {
    FeatureChannelFormat.UNORM8: torch.uint8,
    FeatureChannelFormat.FLOAT16: torch.float16,
    FeatureChannelFormat.FLOAT32: torch.float32,
    FeatureChannelFormat.BFLOAT16: torch.bfloat16,
    FeatureChannelFormat.FLOAT64: torch.float64,
}
_DTYPE_TO_FORMAT = {v: k for k, v in _FORMAT_TO_DTYPE.items()}


def _result_format(fmt: FeatureChannelFormat) -> FeatureChannelFormat:
    """The format of a destination made from an image of format ``fmt``: ``fmt``, except
    UNORM8 (an input format), which becomes FLOAT32."""
    return FeatureChannelFormat.FLOAT32 if fmt is FeatureChannelFormat.UNORM8 else fmt


class DataLayout(enum.IntEnum):
    """Element order of `Image.read_bytes` / `Image.write_bytes` arrays (MPS ``MPSDataLayout``)."""

    HEIGHT_WIDTH_FEATURE_CHANNELS = 0
    FEATURE_CHANNELS_HEIGHT_WIDTH = 1


class ImageReadWriteParams:
    """Which channels byte I/O touches (MPS ``MPSImageReadWriteParams``).

    Args:
        feature_channel_offset: first channel (any value; no multiple-of-4 rule here).
        number_of_feature_channels_to_read_write: how many; None means the rest.
    """

    __slots__ = ("feature_channel_offset", "number_of_feature_channels_to_read_write")

    def __init__(
        self,
        feature_channel_offset: int = 0,
        number_of_feature_channels_to_read_write: int | None = None,
    ) -> None:
        self.feature_channel_offset = feature_channel_offset
        self.number_of_feature_channels_to_read_write = number_of_feature_channels_to_read_write


def _check_count(owner: str, name: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"[{owner}] {name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"[{owner}] {name} must be >= {minimum}, got {value}")
    return value


class ImageDescriptor:
    """Shape and format of an image to allocate (MPS ``MPSImageDescriptor``).

    Args:
        channel_format: a `FeatureChannelFormat` (FLOAT32 by default).
        width, height, feature_channels, number_of_images: sizes, each >= 1.
    """

    __slots__ = ("_c", "_fmt", "_h", "_n", "_w")

    def __init__(
        self,
        channel_format: FeatureChannelFormat = FeatureChannelFormat.FLOAT32,
        width: int = 1,
        height: int = 1,
        feature_channels: int = 1,
        number_of_images: int = 1,
    ) -> None:
        self.channel_format = channel_format
        self.width = width
        self.height = height
        self.feature_channels = feature_channels
        self.number_of_images = number_of_images

    @property
    def channel_format(self) -> FeatureChannelFormat:
        return self._fmt

    @channel_format.setter
    def channel_format(self, value: FeatureChannelFormat) -> None:
        if not isinstance(value, FeatureChannelFormat):
            raise TypeError(
                "[ImageDescriptor] channel_format must be a FeatureChannelFormat, "
                f"got {type(value).__name__}"
            )
        self._fmt = value

    @property
    def width(self) -> int:
        return self._w

    @width.setter
    def width(self, value: int) -> None:
        self._w = _check_count("ImageDescriptor", "width", value)

    @property
    def height(self) -> int:
        return self._h

    @height.setter
    def height(self, value: int) -> None:
        self._h = _check_count("ImageDescriptor", "height", value)

    @property
    def feature_channels(self) -> int:
        return self._c

    @feature_channels.setter
    def feature_channels(self, value: int) -> None:
        self._c = _check_count("ImageDescriptor", "feature_channels", value)

    @property
    def number_of_images(self) -> int:
        return self._n

    @number_of_images.setter
    def number_of_images(self, value: int) -> None:
        self._n = _check_count("ImageDescriptor", "number_of_images", value)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(number_of_images, feature_channels, height, width)``."""
        return (self._n, self._c, self._h, self._w)

    def copy(self) -> ImageDescriptor:
        return ImageDescriptor._make(self._fmt, self._w, self._h, self._c, self._n)

    @classmethod
    def _make(cls, fmt: FeatureChannelFormat, w: int, h: int, c: int, n: int) -> ImageDescriptor:
        """Internal: a descriptor from values already known to be valid (no checks)."""
        d = cls.__new__(cls)
        d._fmt, d._w, d._h, d._c, d._n = fmt, w, h, c, n
        return d

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ImageDescriptor)
            and other._fmt == self._fmt
            and other.shape == self.shape
        )

    def __repr__(self) -> str:
        return (
            f"ImageDescriptor({self._fmt.name}, width={self._w}, height={self._h}, "
            f"feature_channels={self._c}, number_of_images={self._n})"
        )
