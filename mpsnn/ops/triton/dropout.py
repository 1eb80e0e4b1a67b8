"""Dropout (forward or gradient) in one pass, the mask regenerated from its key (Triton).

The same integer hash as `mpsnn.ops.dropout` (int64 arithmetic, no overflow), so the bits equal
the portable path's. Bytes moved: the input once and the output once; nothing is stored for
the gradient, which regenerates the mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpsnn.ops.dropout import DropoutGeometry

__all__ = ["dropout_apply_triton"]


@triton.jit
def _mul32(h, k: tl.constexpr):
    lo = h * (k & 0xFFFF)
    hi = ((h * (k >> 16)) & 0xFFFF) << 16
    return (lo + hi) & 0xFFFFFFFF


@triton.jit
def _mix(h):
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


@triton.jit
def _dropout(
    t_ptr, out_ptr, total, key, first_image, C, H, W, threshold, scale,
    SC: tl.constexpr, SY: tl.constexpr, SX: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = idx < total
    chw = C * H * W
    n = idx // chw
    rem = idx - n * chw
    c = rem // (H * W)
    y = (rem // W) % H
    x = rem % W
    hm = H if SY else 1
    wm = W if SX else 1
    e = ((c * SC) * hm + y * SY) * wm + x * SX
    image_key = _mix(key ^ _mix(n + first_image + 1))
    keep = _mix(_mix(e) ^ image_key) < threshold
    v = tl.load(t_ptr + idx, mask=m, other=0.0).to(tl.float32)
    factor = tl.where(keep, scale, 0.0)
    out = (v * factor).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(out_ptr + idx, out, mask=m)


def dropout_apply_triton(
    t: torch.Tensor, key: int, first_image: int, geom: DropoutGeometry
) -> torch.Tensor:
    """Same result as `mpsnn.ops.dropout.dropout_apply_portable` (float16/bfloat16/float32)."""
    t = t.contiguous()
    out = torch.empty_like(t)
    _, c, h, w = t.shape
    total = t.numel()
    block = 2048
    sc, sy, sx = geom.strides
    _dropout[(triton.cdiv(total, block),)](
        t, out, total, key, first_image, c, h, w, geom.threshold,
        float(torch.tensor(geom.scale, dtype=torch.float32)),
        SC=sc, SY=sy, SX=sx, BLOCK=block,
    )  # fmt: skip
    return out
