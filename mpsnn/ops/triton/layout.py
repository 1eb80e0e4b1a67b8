"""Layout conversion of a 4-D tensor from NCHW to channels-last (NHWC), in Triton.

Why: PyTorch's ``t.contiguous(memory_format=torch.channels_last)`` of an NCHW CUDA tensor runs
its generic strided copy, which reads or writes with a stride of ``H W`` elements; on an H200
it moved a 64x64x56x56 bfloat16 tensor (25.7 MB) in 59 µs, about a third of the copy
bandwidth. mpsnn converts NCHW half-precision operands before each convolution (cuDNN's
half-precision kernels on recent GPUs are NHWC-only), so a convolution's gradient on NCHW
images made two such copies. This kernel transposes tiles of ``BC`` channels by ``BP`` pixels
of one image through on-chip memory: each tile is read along the pixels and written along the
channels, both contiguous runs.

The values are moved, never computed: the result is the copy's, bit for bit (NaN payloads
included), with the strides PyTorch gives a channels-last tensor of that shape.

`pad_channels_triton` makes a convolution's input of a few channels a channels-last tensor of
8 (the rest zeros) in one pass: cuDNN's half-precision tensor-core kernels want channel
counts that are multiples of 8, and PyTorch's ``F.pad`` of a channels-last tensor runs its
generic strided kernel (43 µs for a 512x3x32x32 bfloat16 batch on an H200, for 3 MiB read and
8 MiB written).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpsnn.ops.triton.launch import cdiv, fast_kernel, next_power_of_2

__all__ = ["channels_last_copy", "nchw_to_nhwc_triton", "pad_channels_triton"]

_TILE_ELEMENTS = 4096  # BC x BP: 8 KiB of bfloat16 a tile
_MAX_GRID_YZ = 65535  # CUDA's limit on the grid's second and third dimensions
_MAX_I32 = 2**31 - 1  # pixel indices within a plane are int32


@fast_kernel
@triton.jit
def _nchw_to_nhwc(x_ptr, y_ptr, C, HW, BC: tl.constexpr, BP: tl.constexpr):
    # grid (pixel blocks, channel blocks, images): channels [c0, c0 + BC) x pixels [p0, p0 + BP)
    ps = tl.program_id(0) * BP + tl.arange(0, BP)
    cs = tl.program_id(1) * BC + tl.arange(0, BC)
    base = tl.program_id(2).to(tl.int64) * C * HW
    cmask = cs < C
    pmask = ps < HW
    v = tl.load(
        x_ptr + base + cs.to(tl.int64)[:, None] * HW + ps[None, :],
        mask=cmask[:, None] & pmask[None, :],
    )
    tl.store(
        y_ptr + base + ps.to(tl.int64)[:, None] * C + cs[None, :],
        tl.trans(v),
        mask=pmask[:, None] & cmask[None, :],
    )


def nchw_to_nhwc_triton(t: torch.Tensor) -> torch.Tensor | None:
    """``t.contiguous(memory_format=torch.channels_last)`` for an NCHW-contiguous 4-D ``t``
    that is not also channels-last contiguous, in one Triton pass; None when ``t`` is not such
    a tensor, or one larger than the grid or the int32 pixel indices take (the caller then makes
    PyTorch's copy)."""
    if t.dim() != 4 or not t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last):
        return None
    n, c, h, w = t.shape
    hw = h * w
    bc = min(64, next_power_of_2(c))
    bp = min(_TILE_ELEMENTS // bc, max(16, next_power_of_2(hw)))
    if t.numel() == 0 or n > _MAX_GRID_YZ or cdiv(c, bc) > _MAX_GRID_YZ or hw + bp > _MAX_I32:
        return None
    out = torch.empty_like(t, memory_format=torch.channels_last)
    _nchw_to_nhwc[(cdiv(hw, bp), cdiv(c, bc), n)](t, out, c, hw, BC=bc, BP=bp, num_warps=4)
    return out


def channels_last_copy(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous(memory_format=torch.channels_last)``: ``t`` itself when it is
    channels-last already, the transpose where it takes ``t``, else PyTorch's copy."""
    if t.is_contiguous(memory_format=torch.channels_last):
        return t
    out = nchw_to_nhwc_triton(t)
    return out if out is not None else t.contiguous(memory_format=torch.channels_last)


# the kernel copies bits: each dtype's values travel as the integers of their width
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


@fast_kernel
@triton.jit
def _pad_channels(
    x_ptr, y_ptr, C, W, HW, sn, sc, sh, sw, CO,
    BC: tl.constexpr, BP: tl.constexpr,
):  # fmt: skip
    # grid (pixel blocks, images): pixels [p0, p0 + BP) x all BC >= CO output channels of one
    # image; input channels c < C are read through the strides, c in [C, CO) are written 0
    ps = tl.program_id(0) * BP + tl.arange(0, BP)
    cs = tl.arange(0, BC)
    n = tl.program_id(1).to(tl.int64)
    hs = ps // W
    pmask = ps < HW
    v = tl.load(
        x_ptr + n * sn + (hs * sh + (ps - hs * W) * sw)[:, None] + cs[None, :] * sc,
        mask=pmask[:, None] & (cs < C)[None, :],
        other=0,  # integer zero: the bits of +0.0
    )
    # the output is channels-last: one image's (pixel, channel) tile is one contiguous run
    tl.store(
        y_ptr + n * HW * CO + ps[:, None] * CO + cs[None, :],
        v,
        mask=pmask[:, None] & (cs < CO)[None, :],
    )


def pad_channels_triton(t: torch.Tensor, channels: int) -> torch.Tensor | None:
    """A new channels-last ``(N, channels, H, W)`` tensor whose first ``C`` channels are those
    of the 4-D ``(N, C, H, W)`` ``t`` (any strides: NCHW, channels-last or a view; float16,
    bfloat16 or float32) and the others +0.0, in one Triton pass. The values are copied as
    bits (NaN payloads and -0.0 kept). None when ``t`` is not such a tensor, ``channels < C``,
    ``t`` is empty, or it is larger than the grid or the int32 offsets within an image take
    (the caller then pads with PyTorch)."""
    bits = _BITS.get(t.dtype)
    if bits is None or t.dim() != 4 or t.numel() == 0:
        return None
    n, c, h, w = t.shape
    if c > channels:
        return None
    hw = h * w
    bc = next_power_of_2(channels)
    bp = min(max(_TILE_ELEMENTS // bc, 16), max(16, next_power_of_2(hw)))
    sn, sc, sh, sw = t.stride()
    # Offsets within an image are int32. Lanes past the image's last pixel (the last block's
    # tail, rows up to (hw + bp) / w) and past C (up to bc) compute addresses too, masked:
    # bound those as well, so no lane's offset wraps.
    reach = (bc - 1) * sc + ((hw + bp) // w) * sh + (w - 1) * sw
    if n > _MAX_GRID_YZ or reach > _MAX_I32 or (hw + bp) * bc > _MAX_I32:
        return None
    out = torch.empty(
        (n, channels, h, w), dtype=t.dtype, device=t.device, memory_format=torch.channels_last
    )
    _pad_channels[(cdiv(hw, bp), n)](
        t.view(bits), out.view(bits), c, w, hw, sn, sc, sh, sw, channels,
        BC=bc, BP=bp, num_warps=4,
    )  # fmt: skip
    return out
