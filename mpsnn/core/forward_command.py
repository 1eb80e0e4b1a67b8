"""The command of one `mpsnn.core.cnn_kernel.CNNKernel` encode.

The closure an encode records: read the source block the `Window` names, run the family's
``forward`` on it in the compute dtype (the wider of the source's and the destination's, for
mixed formats), and write the result into the destination block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mpsnn.core.geometry import Window
from mpsnn.core.image import Image

__all__ = ["compute_dtype", "forward_command"]


def forward_command(
    forward: Callable[[torch.Tensor], torch.Tensor],
    src: Image,
    w: Window,
    out_dtype: torch.dtype,
    memo: dict[str, Any],
) -> Callable[[Image], None]:
    """The command of one encode: read the source block, run ``forward``, write its result.

    ``out_dtype``: the dtype of the destination the encode gives or allocates. ``memo`` is the
    plan's (`CNNKernel._plan`: the same window and source shape): what the window says is read
    there once per configuration, not at every encode."""
    where = memo.get("command")
    if where is None:
        z0, n, c0, nc = w.src_image, w.images, w.src_channel, w.src_channels
        whole = z0 == 0 and n == src._shape[0] and c0 == 0 and nc == src._shape[1]
        index = None if whole else (slice(z0, z0 + n), slice(c0, c0 + nc))  # None: common
        where = memo["command"] = (index, w.dst_image, w.dst_channel, w.dst_y, w.dst_x)
    index, dz, dc, dy, dx = where
    # The formats are known now: decide the compute dtype once (an allocator that returns an
    # image of another format is still served right, when the command runs).
    wide = compute_dtype(out_dtype, src)

    def run(dst: Image) -> None:
        dtype = wide if dst._dtype is out_dtype else compute_dtype(dst._dtype, src)
        data = src._read(dtype)
        x = data if index is None else data[index]
        if dtype is not None and x.dtype != dtype:
            x = x.to(dtype)
        dst._write_block(forward(x), dz, dc, dy, dx, data)

    return run


def compute_dtype(out_dtype: torch.dtype, src: Image) -> torch.dtype | None:
    """Mixed formats: the math runs in the wider of the source's and the destination's dtypes;
    None when that is the dtype the source reads in."""
    if out_dtype is src._dtype:  # the common case: a source reads its own dtype or a wider one
        return None
    return out_dtype if out_dtype.itemsize > src._read_dtype.itemsize else None
