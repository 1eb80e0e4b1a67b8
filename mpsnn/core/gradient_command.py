"""The command a window-model gradient kernel records (`GradientKernel._plan_gradient`).

At execution it reads the incoming-gradient block (the region the forward wrote) and the
secondary block, computes in the wider of their dtypes, calls the family's `Backward` and
writes the result into the destination gradient: channels the forward did not read get 0, and
a clip rect on the gradient kernel crops it. `mpsnn.core.binary` records it; import `Backward`
from here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mpsnn.core.geometry import Window
from mpsnn.core.image import Image

Backward = Callable[[torch.Tensor, torch.Tensor], "torch.Tensor | None"]


def _backward_command(
    backward: Backward,
    grad: Image,
    src: Image,
    fw: Window,
    secondary_is_result: bool,
    images: tuple[int, int, int],
    channels: int,
    dco: int,
    span: tuple[int, int, int, int],
) -> Callable[[Image | None], None]:
    z_src, z_dst, n = images
    y0, ny, x0, nx = span

    # mixed formats (MPS reads every format as float): compute in the wider one; a UNORM8
    # image is read as k/255 directly in that dtype
    a, b = grad._read_dtype, src._read_dtype
    wide = a if a == b else torch.promote_types(a, b)
    # whole images need no indexing (a view op per read, at every step, saved)
    dst_block = (z_dst, n, fw.dst_channel, fw.dst_channels, fw.dst_y, fw.y.count, fw.dst_x,
                 fw.x.count)  # fmt: skip
    g_whole = _covers(grad._shape, dst_block)
    if secondary_is_result:
        x_whole = _covers(src._shape, dst_block)
    else:
        sn, sc = src._shape[:2]
        x_whole = z_src == 0 and n == sn and fw.src_channel == 0 and fw.src_channels == sc

    region = (
        slice(z_dst, z_dst + n),
        slice(fw.dst_channel, fw.dst_channel + fw.dst_channels),
        slice(fw.dst_y, fw.dst_y + fw.y.count),
        slice(fw.dst_x, fw.dst_x + fw.x.count),
    )

    def run(out: Image | None) -> None:
        g = grad._read(wide)
        if not g_whole:
            g = g[region]
        x = src._read(wide)
        if not x_whole and secondary_is_result:
            x = x[region]
        elif not x_whole:
            c0, nc = fw.src_channel, fw.src_channels
            x = x[z_src : z_src + n, c0 : c0 + nc]
        if g.dtype != x.dtype:
            g, x = g.to(wide), x.to(wide)
        dx = backward(g, x)
        if dx is None or out is None:
            return
        if fw.src_channels != channels:  # the forward read a channel slice: the rest gets 0
            full = dx.new_zeros((n, channels, dx.shape[2], dx.shape[3]))
            full[:, fw.src_channel : fw.src_channel + fw.src_channels] = dx
            dx = full
        if ny != dx.shape[2] or nx != dx.shape[3]:  # a clip rect on the gradient kernel
            dx = dx[:, :, y0 : y0 + ny, x0 : x0 + nx]
        # the result must not share storage with an input: a backward that returns one of
        # them unchanged (the input's storage itself, not a view of it) gets copied
        out._write_block(dx, z_src, dco, y0, x0, x if dx is x else grad._data())

    return run


def _covers(shape: tuple[int, int, int, int], block: tuple[int, ...]) -> bool:
    """Whether ``block`` (z, images, c, channels, y, rows, x, cols) is the whole image."""
    z, n, c, nc, y, ny, x, nx = block
    return (z, c, y, x) == (0, 0, 0, 0) and (n, nc, ny, nx) == shape
