"""Max-pooling gradient in one pass, without an index tensor (Triton).

For disjoint windows inside the image (stride == kernel, no dilation), each program loads the
windows of a block of outputs, finds each window's first maximum in raster order (a NaN wins,
the last NaN as in PyTorch), and writes every pixel of the window once: the incoming gradient
at the maximum, 0 elsewhere. Bytes moved: the source and the destination once, the incoming
gradient once; PyTorch's ``max_pool2d_with_indices_backward`` also reads an int64 index per
output and zero-fills the destination first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpsnn.ops.plans import PoolGeometry
from mpsnn.ops.triton.launch import cdiv, fast_kernel, next_power_of_2

__all__ = ["max_pool_backward_triton"]


@triton.jit
def _take(v, k, best, best_k, best_nan):
    """Raster-order update with tap ``k``: a number must be strictly larger (the first maximum
    wins) and follow no NaN; every NaN is taken (the last NaN wins, as in PyTorch)."""
    isn = v != v
    take = isn | ((v > best) & (best_nan == 0))
    return tl.where(take & (isn == 0), v, best), tl.where(take, k, best_k), best_nan | isn


@fast_kernel
@triton.jit
def _max_pool_bwd(
    x_ptr, g_ptr, dx_ptr, rows, OH, OW, H, W, y0, x0,
    KH: tl.constexpr, KW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    # A tile of BLOCK_R output rows (over all planes) by BLOCK_W outputs; index math per row.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ow = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    plane = r // OH
    oh = r - plane * OH
    row0 = (plane.to(tl.int64) * H + (y0 + oh * KH)) * W + x0  # window row 0, column x0
    rmask = (r < rows)[:, None]
    mask = rmask & (ow < OW)[None, :]
    best = tl.full((BLOCK_R, BLOCK_W), float("-inf"), tl.float32)
    best_nan = tl.zeros((BLOCK_R, BLOCK_W), tl.int1)
    best_k = tl.zeros((BLOCK_R, BLOCK_W), tl.int32)
    gv = tl.load(g_ptr + r.to(tl.int64)[:, None] * OW + ow[None, :], mask=mask, other=0.0)
    if KW == 2:
        # Whole row segments, split into even/odd columns: every access is contiguous.
        c2 = tl.program_id(1) * 2 * BLOCK_W + tl.arange(0, 2 * BLOCK_W)
        mask2 = rmask & (c2 < 2 * OW)[None, :]
        for kh in tl.static_range(KH):
            ptr = x_ptr + row0[:, None] + kh * W + c2[None, :]
            v = tl.load(ptr, mask=mask2, other=float("-inf")).to(tl.float32)
            even, odd = tl.split(tl.reshape(v, (BLOCK_R, BLOCK_W, 2)))
            best, best_k, best_nan = _take(even, kh * 2, best, best_k, best_nan)
            best, best_k, best_nan = _take(odd, kh * 2 + 1, best, best_k, best_nan)
        for kh in tl.static_range(KH):
            a = tl.where(best_k == kh * 2, gv, 0.0)
            b = tl.where(best_k == kh * 2 + 1, gv, 0.0)
            out = tl.reshape(tl.join(a, b), (BLOCK_R, 2 * BLOCK_W)).to(dx_ptr.dtype.element_ty)
            tl.store(dx_ptr + row0[:, None] + kh * W + c2[None, :], out, mask=mask2)
    else:
        col = (ow * KW)[None, :]
        for kh in tl.static_range(KH):
            for kw in tl.static_range(KW):
                ptr = x_ptr + row0[:, None] + kh * W + col + kw
                v = tl.load(ptr, mask=mask, other=float("-inf")).to(tl.float32)
                best, best_k, best_nan = _take(v, kh * KW + kw, best, best_k, best_nan)
        for kh in tl.static_range(KH):
            for kw in tl.static_range(KW):
                val = tl.where(best_k == kh * KW + kw, gv, 0.0).to(dx_ptr.dtype.element_ty)
                tl.store(dx_ptr + row0[:, None] + kh * W + col + kw, val, mask=mask)


def max_pool_backward_triton(g: torch.Tensor, x: torch.Tensor, geom: PoolGeometry) -> torch.Tensor:
    """Same result as `mpsnn.ops.pooling.max_pool_backward_portable` for disjoint windows."""
    n, c, h, w = x.shape
    oh, ow = geom.y.count, geom.x.count
    kh, kw = geom.y.kernel, geom.x.kernel
    y0, x0 = geom.y.start, geom.x.start
    x = x.contiguous()
    g = g.contiguous()
    tiles = y0 == 0 and x0 == 0 and oh * kh == h and ow * kw == w
    dx = torch.empty_like(x) if tiles else torch.zeros_like(x)  # uncovered pixels get 0
    block_w = min(next_power_of_2(ow), 128)
    block_r = max(1, 1024 // block_w)
    rows = n * c * oh
    grid = (cdiv(rows, block_r), cdiv(ow, block_w))
    _max_pool_bwd[grid](
        x, g, dx, rows, oh, ow, h, w, y0, x0,
        KH=kh, KW=kw, BLOCK_R=block_r, BLOCK_W=block_w,
    )  # fmt: skip
    return dx
