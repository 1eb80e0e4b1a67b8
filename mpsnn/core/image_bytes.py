"""Byte I/O of images: the region checks and value conversions behind `Image.read_bytes`,
`Image.write_bytes`, `Image.numpy` and UNORM8 writes (`Image._write_block`).

These helpers know nothing of `mpsnn.core.image.Image` (which calls them): they take the
image's name, shape and format and work on tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mpsnn.core.descriptor import DataLayout, FeatureChannelFormat, ImageReadWriteParams
from mpsnn.core.geometry import Region


def _io_index(
    name: str,
    who: str,
    shape: tuple[int, int, int, int],
    data_layout: DataLayout,
    image_index: int,
    region: Region | None,
    info: ImageReadWriteParams | None,
) -> tuple[int, slice, slice, slice]:
    """The index into an image of ``shape`` that ``who`` (``read_bytes`` or ``write_bytes``)
    reads or writes: one image, its channel range and the region's rows and columns.

    Raises:
        TypeError: ``data_layout`` is not a `DataLayout`.
        ValueError: the image index, region or channel range lies outside the image.
    """
    if not isinstance(data_layout, DataLayout):
        raise TypeError(f"[{name}] {who} data_layout must be a DataLayout, got {data_layout!r}")
    n, c, h, w = shape
    if not 0 <= image_index < n:
        raise ValueError(f"[{name}] {who} image_index must be in [0, {n}), got {image_index}")
    if region is None:
        x0, y0, rw, rh = 0, 0, w, h
    else:
        x0, y0 = region.origin.x, region.origin.y
        rw, rh = region.size.width, region.size.height
        if region.size.depth != 1 or region.origin.z != 0:
            raise ValueError(
                f"[{name}] {who} region must have origin.z 0 and depth 1 (use image_index), "
                f"got z={region.origin.z} depth={region.size.depth}"
            )
        if x0 < 0 or y0 < 0 or x0 + rw > w or y0 + rh > h:
            raise ValueError(
                f"[{name}] {who} region must lie inside the {w}x{h} image, "
                f"got x={x0} y={y0} width={rw} height={rh}"
            )
    c0 = 0 if info is None else info.feature_channel_offset
    nc = None if info is None else info.number_of_feature_channels_to_read_write
    nc = c - c0 if nc is None else nc
    if c0 < 0 or nc < 0 or c0 + nc > c:
        raise ValueError(
            f"[{name}] {who} channels [{c0}, {c0 + nc}) must lie in [0, {c}), "
            f"got feature_channel_offset={c0} count={nc}"
        )
    return image_index, slice(c0, c0 + nc), slice(y0, y0 + rh), slice(x0, x0 + rw)


def _bytes_to_write(
    name: str, array: Any, shape: tuple[int, ...], fmt: FeatureChannelFormat
) -> torch.Tensor:
    """``array`` as a tensor to copy into a view of ``shape`` of an image of format ``fmt``:
    for UNORM8, uint8 data as is (the raw bytes) and float data as
    ``round(clamp(v, 0, 1) * 255)``.

    Raises:
        ValueError: the array's shape is not ``shape``.
        TypeError: a UNORM8 image given data that is neither uint8 nor floating-point.
    """
    data = torch.as_tensor(np.asarray(array))
    if tuple(data.shape) != tuple(shape):
        raise ValueError(
            f"[{name}] write_bytes needs an array of shape {tuple(shape)} "
            f"for this region and layout, got {tuple(data.shape)}"
        )
    if fmt is FeatureChannelFormat.UNORM8 and data.dtype != torch.uint8:
        if not data.is_floating_point():
            raise TypeError(
                f"[{name}] write_bytes into a UNORM8 image needs uint8 (raw "
                f"bytes) or floating-point (values in [0, 1]) data, got {data.dtype}"
            )
        data = _to_unorm8(data)
    return data


def _to_unorm8(t: torch.Tensor) -> torch.Tensor:
    """UNORM8 bytes of float values: ``round(clamp(v, 0, 1) * 255)`` (half to even), computed in
    at least float32; a new tensor."""
    v = t.clamp(0, 1)
    if v.dtype not in (torch.float32, torch.float64):
        v = v.float()
    return v.mul_(255).round_().to(torch.uint8)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.cpu().numpy().copy()
