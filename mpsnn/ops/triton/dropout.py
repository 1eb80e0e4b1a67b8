"""Dropout (forward or gradient) in one pass, the mask regenerated from its key (Triton).

The same integer hash as `mpsnn.ops.dropout`, in native uint32 arithmetic (the portable path
emulates it with int64 tensors), so the bits equal the portable path's. Bytes moved: the input
once and the output once; nothing is stored for the gradient, which regenerates the mask. The
key is read from device memory (a one-element int64 tensor), so captured work follows it.

Two kernels: without mask broadcasting (the common case) each program takes a contiguous span
of one image, where the mask index is the element's offset in the image (no integer division,
no idle lanes at the end of each plane); with broadcasting, one (image, channel) plane per
program row, with the index math of the broadcast axes.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from mpsnn.ops.plans import DropoutGeometry

__all__ = ["dropout_apply_triton"]


# The hash's multipliers as int32 bit patterns (literals above 2^31 would be typed int64).
_K1 = tl.constexpr(0x7FEB352D)
_K2 = tl.constexpr(0x846CA68B - (1 << 32))


@triton.jit
def _mix(h):
    # "lowbias32" in native uint32 arithmetic (multiplication wraps mod 2^32, shifts are logical)
    h = h ^ (h >> 16)
    h = h * tl.full((), _K1, tl.int32).to(tl.uint32, bitcast=True)
    h = h ^ (h >> 15)
    h = h * tl.full((), _K2, tl.int32).to(tl.uint32, bitcast=True)
    return h ^ (h >> 16)


@triton.jit
def _apply(t_ptr, out_ptr, offs, m, e, image_key, threshold, scale):
    keep = _mix(_mix(e.to(tl.uint32)) ^ image_key) < threshold.to(tl.uint32)
    v = tl.load(t_ptr + offs, mask=m, other=0.0).to(tl.float32)
    out = (v * tl.where(keep, scale, 0.0)).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(out_ptr + offs, out, mask=m)


@triton.jit
def _dropout_flat(t_ptr, out_ptr, key_ptr, first_image, CHW, threshold, scale, BLOCK: tl.constexpr):
    # a contiguous span of one image per program: the mask index is the offset in the image
    n = tl.program_id(0)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = tl.load(key_ptr).to(tl.uint32)
    image_key = _mix(key ^ _mix((n + first_image + 1).to(tl.uint32)))
    _apply(t_ptr, out_ptr, n.to(tl.int64) * CHW + e, e < CHW, e, image_key, threshold, scale)


@triton.jit
def _dropout_planes(
    t_ptr, out_ptr, key_ptr, first_image, C, H, W, threshold, scale,
    SC: tl.constexpr, SY: tl.constexpr, SX: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # one (image, channel) plane per program row; per-program scalars for the image key
    plane = tl.program_id(0)
    n = plane // C
    c = plane - n * C
    s = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    hw = H * W
    if SY == 1 and SX == 1:
        spatial = s
    else:
        y = s // W
        x = s - y * W
        spatial = (y * SY) * (W if SX == 1 else 1) + x * SX
    hm = H if SY == 1 else 1
    wm = W if SX == 1 else 1
    e = (c * SC) * hm * wm + spatial
    key = tl.load(key_ptr).to(tl.uint32)
    image_key = _mix(key ^ _mix((n + first_image + 1).to(tl.uint32)))
    _apply(t_ptr, out_ptr, plane.to(tl.int64) * hw + s, s < hw, e, image_key, threshold, scale)


def dropout_apply_triton(
    t: torch.Tensor, key: torch.Tensor, first_image: int, geom: DropoutGeometry
) -> torch.Tensor:
    """Same result as `mpsnn.ops.dropout.dropout_apply_portable` (float16/bfloat16/float32);
    ``key`` is a one-element int64 tensor on t's device."""
    t = t.contiguous()
    out = torch.empty_like(t)
    n, c, h, w = t.shape
    sc, sy, sx = geom.strides
    # 32-bit threshold as an int32 bit pattern (reinterpreted as uint32 inside)
    thr32 = geom.threshold - (1 << 32) if geom.threshold >= (1 << 31) else geom.threshold
    scale = float(np.float32(geom.scale))  # the float32 the portable path multiplies by
    if (sc, sy, sx) == (1, 1, 1):
        chw = c * h * w
        block = min(4096, triton.next_power_of_2(chw))
        _dropout_flat[(n, triton.cdiv(chw, block))](
            t, out, key, first_image, chw, thr32, scale, BLOCK=block
        )
        return out
    block = min(4096, triton.next_power_of_2(h * w))
    _dropout_planes[(n * c, triton.cdiv(h * w, block))](
        t, out, key, first_image, c, h, w, thr32, scale,
        SC=sc, SY=sy, SX=sx, BLOCK=block,
    )  # fmt: skip
    return out
