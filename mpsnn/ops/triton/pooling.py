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

from mpsnn.ops.pooling import PoolGeometry

__all__ = ["max_pool_backward_triton"]


@triton.jit
def _max_pool_bwd(
    x_ptr, g_ptr, dx_ptr, rows, OH, OW, H, W, y0, x0,
    KH: tl.constexpr, KW: tl.constexpr, KWP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # (plane, output row) pairs
    ow = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    kw = tl.arange(0, KWP)
    plane = (r // OH).to(tl.int64)
    oh = r % OH
    r3 = r[:, None, None]
    ow3 = ow[None, :, None]
    kw3 = kw[None, None, :]
    mask = (r3 < rows) & (ow3 < OW) & (kw3 < KW)
    col = x0 + ow3 * KW + kw3
    base = plane[:, None, None] * H * W
    best = tl.full((BLOCK_R, BLOCK_W), float("-inf"), tl.float32)
    best_nan = tl.zeros((BLOCK_R, BLOCK_W), tl.int32)
    best_kh = tl.zeros((BLOCK_R, BLOCK_W), tl.int32)
    best_kw = tl.zeros((BLOCK_R, BLOCK_W), tl.int32)
    for kh in tl.static_range(KH):
        row = (y0 + oh * KH + kh)[:, None, None]
        v = tl.load(x_ptr + base + row * W + col, mask=mask, other=float("-inf")).to(tl.float32)
        isn = v != v
        has_nan = tl.max(isn.to(tl.int32), axis=2)
        nan_pos = tl.max(tl.where(isn, kw3, -1), axis=2)  # the last NaN, as PyTorch
        vv = tl.where(isn, float("-inf"), v)
        rmax = tl.max(vv, axis=2)
        rpos = tl.min(tl.where(vv == rmax[:, :, None], kw3, KWP), axis=2)  # the first maximum
        take_nan = has_nan > 0
        take_num = (has_nan == 0) & (best_nan == 0) & (rmax > best)
        best_kh = tl.where(take_nan | take_num, kh, best_kh)
        best_kw = tl.where(take_nan, nan_pos, tl.where(take_num, rpos, best_kw))
        best = tl.where(take_num, rmax, best)
        best_nan = tl.maximum(best_nan, has_nan)
    gmask = (r[:, None] < rows) & (ow[None, :] < OW)
    gv = tl.load(g_ptr + r[:, None].to(tl.int64) * OW + ow[None, :], mask=gmask, other=0.0)
    for kh in tl.static_range(KH):
        row = (y0 + oh * KH + kh)[:, None, None]
        hit = (best_kh[:, :, None] == kh) & (best_kw[:, :, None] == kw3)
        val = tl.where(hit, gv[:, :, None], 0.0)
        tl.store(dx_ptr + base + row * W + col, val.to(dx_ptr.dtype.element_ty), mask=mask)


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
    kwp = triton.next_power_of_2(kw)
    block_w = min(triton.next_power_of_2(ow), 64)
    block_r = max(1, 2048 // (block_w * kwp))
    rows = n * c * oh
    grid = (triton.cdiv(rows, block_r), triton.cdiv(ow, block_w))
    _max_pool_bwd[grid](
        x, g, dx, rows, oh, ow, h, w, y0, x0,
        KH=kh, KW=kw, KWP=kwp, BLOCK_R=block_r, BLOCK_W=block_w,
    )  # fmt: skip
    return dx
