"""Convolutions of images with few channels (an RGB network's stem) in Triton: the forward and
the weights' gradient as implicit GEMMs whose whole reduction over ``C kH kW`` (at most
`MAX_PATCH` products) is one tensor-core dot per tile.

Why: cuDNN runs a bfloat16 3x3 convolution of a 3-channel image with 64 filters several times
slower than the bytes it writes allow (its kernels want 8 input channels; padded operands
halve its time but stay about 5x over the copy floor), and its weight gradient for such a
layer reads the 64-channel gradient at a fraction of the memory bandwidth. Both are
memory-bound: the forward writes ``N OH OW O`` elements and reads an image 20x smaller; the
weight gradient reads the output gradient once.

Layouts. The image ``x`` (N, C, H, W) and the gradient ``g`` (N, O, OH, OW) are read through
their strides (channels-last in practice); the forward writes a new channels-last result.
A patch row ``k`` is ordered ``(ky, kx, c)``: ``k = (ky kW + kx) C + c``, the OHWI order of
MPS weights, so a tile of weights is a (kH kW C, O) matrix read through the OIHW strides.

Math (zero padding ``py, px``, strides ``sy, sx``, dilations ``dy, dx``), for output pixel
``p = (n, i, j)``::

    A[p, k] = x[n, c, i sy - py + ky dy, j sx - px + kx dx]    (0 outside the image)
    y[p, o] = b[o] + sum_k A[p, k] W[o, k]                     (forward)
    dW[o, k] = sum_p g[p, o] A[p, k]                           (weight gradient)

each product of two half-precision values exact in float32 and accumulated in float32 by the
tensor cores (their order and rounding, not cuDNN's: the last place of a result may differ
from cuDNN's). The weight gradient sums fixed pixel ranges per program (two ranges per
streaming multiprocessor), then PyTorch sums the ranges' results deterministically: on a
given GPU the result does not depend on the run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from mpsnn.ops.triton.launch import cdiv, fast_kernel, next_power_of_2, sm_count

__all__ = ["MAX_PATCH", "few_channel_conv_forward", "few_channel_conv_weight_grad", "fits"]

MAX_PATCH = 64  # most products per output (C kH kW): one dot's reduction
_BM = 128  # output pixels per tile
_WGRAD_PROGRAMS_PER_SM = 2
_MAX_I32 = 2**31 - 1  # pixel indices, and offsets within one image, are int32


@triton.jit
def _patches(
    x_ptr, p, pmask, OH, OW, H, W, sxn, sxc, sxh, sxw, C: tl.constexpr, KW: tl.constexpr,
    KTOT: tl.constexpr, sy, sx, py, px, dy, dx, BK: tl.constexpr,
):  # fmt: skip
    """The (BM, BK) tile of patch rows ``A[p, k]`` for output pixels ``p``, and ``p``'s
    coordinates ``(n, i, j)``."""
    j = p % OW
    t = p // OW
    i = t % OH
    n = t // OH
    k = tl.arange(0, BK)
    c = k % C
    tap = k // C
    kx = tap % KW
    ky = tap // KW
    ih = i[:, None] * sy - py + ky[None, :] * dy
    iw = j[:, None] * sx - px + kx[None, :] * dx
    m = pmask[:, None] & (k < KTOT)[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
    off = n.to(tl.int64)[:, None] * sxn + c[None, :] * sxc + ih * sxh + iw * sxw
    return tl.load(x_ptr + off, mask=m, other=0.0), n, i, j


@fast_kernel
@triton.jit
def _few_channel_conv(
    x_ptr, w_ptr, b_ptr, y_ptr, P, OH, OW, H, W, sxn, sxc, sxh, sxw, NO, swo, swc, swh, sww,
    sy, sx, py, px, dy, dx, C: tl.constexpr, KW: tl.constexpr, KTOT: tl.constexpr,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # grid (pixel tiles, filter tiles); NO filters; y channels-last: (p, o) at p NO + o
    p = tl.program_id(0) * BM + tl.arange(0, BM)
    pmask = p < P
    a, _, _, _ = _patches(x_ptr, p, pmask, OH, OW, H, W, sxn, sxc, sxh, sxw, C, KW, KTOT,
                          sy, sx, py, px, dy, dx, BK)  # fmt: skip
    o = tl.program_id(1) * BN + tl.arange(0, BN)
    omask = o < NO
    k = tl.arange(0, BK)
    c = k % C
    tap = k // C
    woff = (
        o[None, :] * swo + c[:, None] * swc + (tap // KW)[:, None] * swh + (tap % KW)[:, None] * sww
    )
    wt = tl.load(w_ptr + woff, mask=(k < KTOT)[:, None] & omask[None, :], other=0.0)
    if a.dtype == tl.float32:  # (tests) float32 products, not TF32's
        acc = tl.dot(a, wt, input_precision="ieee")
    else:
        acc = tl.dot(a, wt)  # float32 sums of exact products
    if HAS_BIAS:
        acc += tl.load(b_ptr + o, mask=omask, other=0.0).to(tl.float32)[None, :]
    out = p.to(tl.int64)[:, None] * NO + o[None, :]
    tl.store(y_ptr + out, acc.to(y_ptr.dtype.element_ty), mask=pmask[:, None] & omask[None, :])


@fast_kernel
@triton.jit
def _few_channel_conv_wgrad(
    g_ptr, x_ptr, part_ptr, P, rows, OH, OW, H, W, sxn, sxc, sxh, sxw, sgn, sgc, sgh, sgw, NO,
    sy, sx, py, px, dy, dx, C: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr,
    KTOT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    # grid (pixel ranges, filter tiles): this range's sums of g[p, o] A[p, k], stored OIHW
    # at part[range, o, c, ky, kx]
    chunk = tl.program_id(0)
    o = tl.program_id(1) * BN + tl.arange(0, BN)
    omask = o < NO
    p0 = chunk * rows
    p1 = tl.minimum(p0 + rows, P)
    acc = tl.zeros((BN, BK), tl.float32)
    for m in range(p0, p1, BM):
        p = m + tl.arange(0, BM)
        pmask = p < p1
        a, n, i, j = _patches(x_ptr, p, pmask, OH, OW, H, W, sxn, sxc, sxh, sxw, C, KW, KTOT,
                              sy, sx, py, px, dy, dx, BK)  # fmt: skip
        goff = n.to(tl.int64)[:, None] * sgn + o[None, :] * sgc + (i * sgh + j * sgw)[:, None]
        g = tl.load(g_ptr + goff, mask=pmask[:, None] & omask[None, :], other=0.0)
        if a.dtype == tl.float32:
            acc = tl.dot(tl.trans(g), a, acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(g), a, acc)
    k = tl.arange(0, BK)
    c = k % C
    tap = k // C
    dst = o[:, None] * KTOT + (c * (KH * KW) + (tap // KW) * KW + tap % KW)[None, :]
    tl.store(part_ptr + chunk.to(tl.int64) * NO * KTOT + dst, acc,
             mask=omask[:, None] & (k < KTOT)[None, :])  # fmt: skip


def _geometry(
    x: torch.Tensor, kh: int, kw: int, stride: tuple[int, int], pads: tuple[int, int],
    dilation: tuple[int, int],
) -> tuple[int, int]:  # fmt: skip
    """The output's (OH, OW) for zero padding ``pads``."""
    h, w = x.shape[2], x.shape[3]
    oh = (h + 2 * pads[0] - dilation[0] * (kh - 1) - 1) // stride[0] + 1
    ow = (w + 2 * pads[1] - dilation[1] * (kw - 1) - 1) // stride[1] + 1
    return oh, ow


def _reach(t: torch.Tensor) -> int:
    """The largest element offset within one image of 4-D ``t`` (channels, rows, columns)."""
    dims = zip(t.shape[1:], t.stride()[1:], strict=True)
    return sum((size - 1) * abs(stride) for size, stride in dims)


def fits(
    x: torch.Tensor, weight_shape: Sequence[int], stride: tuple[int, int],
    pads: tuple[int, int], dilation: tuple[int, int], g: torch.Tensor | None = None,
) -> bool:  # fmt: skip
    """Whether the kernels take the convolution of ``x`` by weights of ``weight_shape`` (and
    its output gradient ``g``): a non-empty image and output, at most `MAX_PATCH` products an
    output, and sizes within their int32 arithmetic (pixel indices, offsets within an image)."""
    o, c, kh, kw = weight_shape
    oh, ow = _geometry(x, kh, kw, stride, pads, dilation)
    pixels = x.shape[0] * oh * ow
    return (
        c * kh * kw <= MAX_PATCH
        and x.numel() > 0
        and oh > 0
        and ow > 0
        and o > 0
        and pixels + _BM <= _MAX_I32
        and _reach(x) <= _MAX_I32
        and (g is None or _reach(g) <= _MAX_I32)
    )


def _tiles(c: int, kh: int, kw: int, o: int) -> tuple[int, int]:
    """(BK, BN): the patch length and filters per tile, powers of 2 of at least 16 (a dot's
    smallest operand)."""
    return max(16, next_power_of_2(c * kh * kw)), max(16, min(128, next_power_of_2(o)))


def few_channel_conv_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    stride: tuple[int, int], pads: tuple[int, int], dilation: tuple[int, int],
    *, bm: int = _BM, warps: int = 4,
) -> torch.Tensor:  # fmt: skip
    """``conv2d(x, weight, bias, stride, pads, dilation)`` (one group) as a new channels-last
    (N, O, OH, OW) tensor in ``x``'s dtype; ``weight`` OIHW in ``x``'s dtype, any strides,
    ``C kH kW <= MAX_PATCH`` (the caller checks). ``bm``, ``warps``: output pixels per tile
    and warps per program."""
    n, c, _, _ = x.shape
    o, _, kh, kw = weight.shape
    oh, ow = _geometry(x, kh, kw, stride, pads, dilation)
    y = torch.empty((n, o, oh, ow), dtype=x.dtype, device=x.device,
                    memory_format=torch.channels_last)  # fmt: skip
    p = n * oh * ow
    bk, bn = _tiles(c, kh, kw, o)
    _few_channel_conv[(cdiv(p, bm), cdiv(o, bn))](
        x, weight, bias if bias is not None else weight, y, p, oh, ow, x.shape[2], x.shape[3],
        *x.stride(), o, *weight.stride(), *stride, *pads, *dilation, C=c, KW=kw,
        KTOT=c * kh * kw, HAS_BIAS=bias is not None, BM=bm, BK=bk, BN=bn, num_warps=warps,
    )  # fmt: skip
    return y


def few_channel_conv_weight_grad(
    g: torch.Tensor, x: torch.Tensor, weight_shape: Sequence[int],
    stride: tuple[int, int], pads: tuple[int, int], dilation: tuple[int, int],
    ranges: int | None = None, *, bm: int = _BM, warps: int = 4,
) -> torch.Tensor:  # fmt: skip
    """The weights' gradient of `few_channel_conv_forward` for the output gradient ``g``
    (N, O, OH, OW): a new contiguous float32 OIHW tensor. ``ranges``: how many pixel ranges
    are summed separately (default: two per streaming multiprocessor); ``bm``, ``warps``: pixels
    per tile and warps per program."""
    o, c, kh, kw = weight_shape
    n = x.shape[0]
    oh, ow = g.shape[2], g.shape[3]
    p = n * oh * ow
    bk, bn = _tiles(c, kh, kw, o)
    if ranges is None:
        ranges = _default_ranges(x.device)
    rows = max(bm, cdiv(cdiv(p, max(1, ranges)), bm) * bm)  # whole tiles per range
    chunks = cdiv(p, rows)
    part = torch.empty((chunks, o, c, kh, kw), dtype=torch.float32, device=x.device)
    _few_channel_conv_wgrad[(chunks, cdiv(o, bn))](
        g, x, part, p, rows, oh, ow, x.shape[2], x.shape[3], *x.stride(), *g.stride(), o,
        *stride, *pads, *dilation, C=c, KH=kh, KW=kw, KTOT=c * kh * kw, BM=bm, BK=bk, BN=bn,
        num_warps=warps,
    )  # fmt: skip
    return part.sum(0) if chunks > 1 else part[0]


def _default_ranges(device: torch.device) -> int:
    if device.type != "cuda":
        return 2  # the interpreter runs programs one after the other
    return _WGRAD_PROGRAMS_PER_SM * sm_count(device.index or 0)
