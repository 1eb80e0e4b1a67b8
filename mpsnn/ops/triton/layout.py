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
included), with the strides PyTorch gives a channels-last tensor of that shape. Two more
transposes convert as they move, for a convolution's weights: `nchw_float32_triton` widens a
channels-last half-precision tensor into NCHW float32 (exact), and `nchw_to_nhwc_into` narrows
NCHW float32 into an existing channels-last half-precision tensor (rounded to nearest, ties
to even, as PyTorch does; only a NaN's payload may differ). `narrow_flat_into` narrows several
contiguous float32 tensors into half-precision ones of the same layout in one launch (the
weight copies whose layouts coincide: 1x1 kernels, fully connected matrices, biases).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mpsnn.core.layout import channels_last_only
from mpsnn.ops.triton.launch import cdiv, fast_kernel, next_power_of_2

__all__ = [
    "channels_last_copy",
    "flat_narrowable",
    "narrow_flat_into",
    "nchw_float32_triton",
    "nchw_to_nhwc_into",
    "nchw_to_nhwc_triton",
]

_TILE_ELEMENTS = 4096  # BC x BP: 8 KiB of bfloat16 a tile
_MAX_GRID_YZ = 65535  # CUDA's limit on the grid's second and third dimensions
_MAX_I32 = 2**31 - 1  # pixel indices within a plane are int32
_FLAT_BLOCK = 4096  # elements a program of the flat narrowing
_MAX_FLAT = 32  # tensors a launch of the flat narrowing (one branch per tensor)


@fast_kernel
@triton.jit
def _nchw_to_nhwc(
    x_ptr, y_ptr, C, HW, BC: tl.constexpr, BP: tl.constexpr, NARROW: tl.constexpr = False
):  # fmt: skip
    # grid (pixel blocks, channel blocks, images): channels [c0, c0 + BC) x pixels [p0, p0 + BP);
    # NARROW: y is float16/bfloat16 and x float32, rounded to nearest, ties to even (as
    # PyTorch's conversion)
    ps = tl.program_id(0) * BP + tl.arange(0, BP)
    cs = tl.program_id(1) * BC + tl.arange(0, BC)
    base = tl.program_id(2).to(tl.int64) * C * HW
    cmask = cs < C
    pmask = ps < HW
    v = tl.load(
        x_ptr + base + cs.to(tl.int64)[:, None] * HW + ps[None, :],
        mask=cmask[:, None] & pmask[None, :],
    )
    v = tl.trans(v)
    if NARROW:
        v = v.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(y_ptr + base + ps.to(tl.int64)[:, None] * C + cs[None, :], v,
             mask=pmask[:, None] & cmask[None, :])  # fmt: skip


class _Tiles(NamedTuple):
    """A transpose's launch: grid (pixel blocks, channel blocks, images), ``(C, H W)``, and
    tiles of ``bc`` channels by ``bp`` pixels."""

    grid: tuple[int, int, int]
    sizes: tuple[int, int]
    bc: int
    bp: int


def _tiles(t: torch.Tensor) -> _Tiles | None:
    """The launch of a transpose of 4-D ``t``, or None when ``t`` is empty or larger than the
    grid or the int32 pixel indices take."""
    n, c, h, w = t.shape
    hw = h * w
    bc = min(64, next_power_of_2(c))
    bp = min(_TILE_ELEMENTS // bc, max(16, next_power_of_2(hw)))
    if t.numel() == 0 or n > _MAX_GRID_YZ or cdiv(c, bc) > _MAX_GRID_YZ or hw + bp > _MAX_I32:
        return None
    return _Tiles((cdiv(hw, bp), cdiv(c, bc), n), (c, hw), bc, bp)


def nchw_to_nhwc_triton(t: torch.Tensor) -> torch.Tensor | None:
    """``t.contiguous(memory_format=torch.channels_last)`` for an NCHW-contiguous 4-D ``t``
    that is not also channels-last contiguous, in one Triton pass; None when ``t`` is not such
    a tensor, or one larger than the grid or the int32 pixel indices take (the caller then makes
    PyTorch's copy)."""
    if t.dim() != 4 or not t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last):
        return None
    tiles = _tiles(t)
    if tiles is None:
        return None
    out = torch.empty_like(t, memory_format=torch.channels_last)
    _nchw_to_nhwc[tiles.grid](t, out, *tiles.sizes, BC=tiles.bc, BP=tiles.bp, num_warps=4)
    return out


def nchw_to_nhwc_into(t: torch.Tensor, out: torch.Tensor) -> bool:
    """Write the NCHW-contiguous float32 4-D ``t`` into ``out``, a channels-last (not also
    NCHW) float16/bfloat16 tensor of its shape, in one Triton pass (the transpose, each value
    rounded to nearest, ties to even: PyTorch's ``out.copy_(t)`` for every value but NaN, whose
    payload may differ); False, writing nothing, for other tensors or sizes. Half-precision
    copies of a convolution's float32 OIHW master weights, written at every update: PyTorch's
    strided copy took about 10 µs for 64x64x3x3 weights on an H200."""
    if (
        t.dim() != 4
        or t.dtype is not torch.float32
        or out.dtype not in (torch.float16, torch.bfloat16)
        or out.shape != t.shape
        or not t.is_contiguous()
        or not channels_last_only(out)
        or out.device != t.device
    ):
        return False
    tiles = _tiles(t)
    if tiles is None:
        return False
    _nchw_to_nhwc[tiles.grid](
        t, out, *tiles.sizes, BC=tiles.bc, BP=tiles.bp, NARROW=True, num_warps=4
    )
    return True


def channels_last_copy(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous(memory_format=torch.channels_last)``: ``t`` itself when it is
    channels-last already, the transpose where it takes ``t``, else PyTorch's copy."""
    if t.is_contiguous(memory_format=torch.channels_last):
        return t
    out = nchw_to_nhwc_triton(t)
    return out if out is not None else t.contiguous(memory_format=torch.channels_last)


@fast_kernel
@triton.jit
def _nhwc_to_nchw(x_ptr, y_ptr, C, HW, BC: tl.constexpr, BP: tl.constexpr):
    # `_nchw_to_nhwc` the other way, the values converted to y's dtype on the way
    ps = tl.program_id(0) * BP + tl.arange(0, BP)
    cs = tl.program_id(1) * BC + tl.arange(0, BC)
    base = tl.program_id(2).to(tl.int64) * C * HW
    cmask = cs < C
    pmask = ps < HW
    v = tl.load(
        x_ptr + base + ps.to(tl.int64)[:, None] * C + cs[None, :],
        mask=pmask[:, None] & cmask[None, :],
    )
    tl.store(
        y_ptr + base + cs.to(tl.int64)[:, None] * HW + ps[None, :],
        tl.trans(v).to(y_ptr.dtype.element_ty),
        mask=cmask[:, None] & pmask[None, :],
    )


def nchw_float32_triton(t: torch.Tensor) -> torch.Tensor | None:
    """``t.to(torch.float32, memory_format=torch.contiguous_format)`` for a float16/bfloat16
    4-D ``t`` that is channels-last and not NCHW-contiguous (cuDNN's weight gradient of a
    half-precision channels-last convolution: the optimizers' float32 OIHW), in one Triton
    pass; the widening is exact. None for any other tensor, or one larger than the grid or the
    int32 pixel indices take. PyTorch's strided copy took 9.7 µs for a 64x64x3x3 bfloat16
    gradient on an H200 (37K elements)."""
    if t.dtype not in (torch.float16, torch.bfloat16) or not channels_last_only(t):
        return None
    tiles = _tiles(t)
    if tiles is None:
        return None
    out = torch.empty(t.shape, dtype=torch.float32, device=t.device)
    _nhwc_to_nchw[tiles.grid](t, out, *tiles.sizes, BC=tiles.bc, BP=tiles.bp, num_warps=4)
    return out


@fast_kernel
@triton.jit
def _narrow_flat(srcs, dsts, sizes, N: tl.constexpr, BLOCK: tl.constexpr):
    # grid (blocks, N tensors): elements [b BLOCK, (b + 1) BLOCK) of tensor i, rounded to
    # nearest, ties to even (PyTorch's conversion); the blocks on the first axis, which takes
    # 2^31 - 1 of them (the others 65535)
    which = tl.program_id(1)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    for i in tl.static_range(N):  # one branch per tensor: a tuple takes constant indices only
        if which == i:
            mask = offs < sizes[i]
            v = tl.load(srcs[i] + offs, mask=mask)
            v = v.to(dsts[i].dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(dsts[i] + offs, v, mask=mask)


def flat_narrowable(d: torch.Tensor, s: torch.Tensor, device: torch.device) -> bool:
    """Whether `narrow_flat_into` takes the pair ``d <- s`` on ``device``."""
    return (
        s.dtype is torch.float32
        and (d.dtype is torch.float16 or d.dtype is torch.bfloat16)
        and d.shape == s.shape
        and s.is_contiguous()
        and d.is_contiguous()
        and s.device == device
        and d.device == device
    )


def narrow_flat_into(dst: list[torch.Tensor], src: list[torch.Tensor]) -> bool:
    """``dst[i].copy_(src[i])`` for contiguous float32 ``src`` and contiguous float16/bfloat16
    ``dst`` of the same shapes on one device, in one launch per `_MAX_FLAT` pairs (rounded to
    nearest, ties to even: PyTorch's bits for every value but NaN, whose payload may differ);
    False, writing nothing, for any other list. PyTorch's multi-tensor copy gives each 64K
    elements one block: on an H200 it took 15 µs for ResNet-18's five weight copies of this
    kind (177K elements)."""
    if not dst or len(dst) != len(src):
        return False
    device = src[0].device
    if not all(flat_narrowable(d, s, device) for d, s in zip(dst, src, strict=True)):
        return False
    for i in range(0, len(dst), _MAX_FLAT):
        outs, ins = tuple(dst[i : i + _MAX_FLAT]), tuple(src[i : i + _MAX_FLAT])
        sizes = tuple(t.numel() for t in ins)
        _narrow_flat[(cdiv(max(sizes), _FLAT_BLOCK), len(ins))](
            ins, outs, sizes, N=len(ins), BLOCK=_FLAT_BLOCK, num_warps=4
        )
    return True
