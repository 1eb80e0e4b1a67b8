"""Dropout (forward or gradient) in one pass, the mask regenerated from its key (Triton).

The same integer hash as `mpsnn.ops.dropout`, in native uint32 arithmetic (the portable path
emulates it with int64 tensors), so the bits equal the portable path's. Bytes moved: the input
once and the output once; the gradient regenerates the mask from the key (the forward stores the
8-byte key, no mask). The key is read from device memory (a one-element int64 tensor), or
computed there from the kernel's encode counter, so captured work follows it. A forward that
computes its key from the counter also advances the counter: the last of its programs to finish
adds 1 (a ticket counts the programs done), so no separate launch is needed for it.

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
from mpsnn.ops.triton.launch import cdiv, fast_kernel, next_power_of_2

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


_COUNTER_SALT = tl.constexpr(0x632BE5AB)


@triton.jit
def _key(key_ptr, seed_part, key_out_ptr, FROM_COUNTER: tl.constexpr):
    """The encode's key: read (``key_ptr``), or computed from the kernel's encode counter
    (``key_ptr`` then points at it) as `mpsnn.ops.dropout.stream_key_tensor` does, and stored
    by the first program in ``key_out_ptr`` for the gradient."""
    if FROM_COUNTER:
        counter = tl.load(key_ptr).to(tl.uint32)  # mod 2^32, as the int64 form's mask
        seed = seed_part.to(tl.uint32, bitcast=True)
        key = _mix(_mix(counter + tl.full((), _COUNTER_SALT, tl.uint32)) ^ seed)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(key_out_ptr, key.to(tl.int64))
    else:
        key = tl.load(key_ptr).to(tl.uint32)
    return key


@triton.jit
def _advance(counter_ptr, ticket_ptr, FROM_COUNTER: tl.constexpr):
    """With ``FROM_COUNTER``: the last program to get here adds 1 to the encode counter and
    resets the ticket. Every program read the counter before: the barrier orders the reads of
    all of this program's threads before its ticket, and the tickets (acquire-release atomics)
    order every program's before the last one's."""
    if FROM_COUNTER:
        tl.debug_barrier()
        done = tl.atomic_add(ticket_ptr, 1)
        if done == tl.num_programs(0) * tl.num_programs(1) - 1:
            tl.atomic_xchg(ticket_ptr, 0)
            tl.atomic_add(counter_ptr, 1)


@fast_kernel
@triton.jit
def _dropout_flat(
    t_ptr, out_ptr, key_ptr, first_image, CHW, threshold, scale, seed_part, key_out_ptr,
    ticket_ptr, FROM_COUNTER: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # a contiguous span of one image per program: the mask index is the offset in the image
    n = tl.program_id(0)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    key = _key(key_ptr, seed_part, key_out_ptr, FROM_COUNTER)
    image_key = _mix(key ^ _mix((n + first_image + 1).to(tl.uint32)))
    _apply(t_ptr, out_ptr, n.to(tl.int64) * CHW + e, e < CHW, e, image_key, threshold, scale)
    _advance(key_ptr, ticket_ptr, FROM_COUNTER)


@fast_kernel
@triton.jit
def _dropout_planes(
    t_ptr, out_ptr, key_ptr, first_image, C, H, W, threshold, scale, seed_part, key_out_ptr,
    ticket_ptr, FROM_COUNTER: tl.constexpr, SC: tl.constexpr, SY: tl.constexpr, SX: tl.constexpr,
    BLOCK: tl.constexpr,
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
    key = _key(key_ptr, seed_part, key_out_ptr, FROM_COUNTER)
    image_key = _mix(key ^ _mix((n + first_image + 1).to(tl.uint32)))
    _apply(t_ptr, out_ptr, plane.to(tl.int64) * hw + s, s < hw, e, image_key, threshold, scale)
    _advance(key_ptr, ticket_ptr, FROM_COUNTER)


def dropout_apply_triton(
    t: torch.Tensor,
    key: torch.Tensor,
    first_image: int,
    geom: DropoutGeometry,
    *,
    seed_part: int | None = None,
    key_out: torch.Tensor | None = None,
    ticket: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same result as `mpsnn.ops.dropout.dropout_apply_portable` (float16/bfloat16/float32);
    ``key`` is a one-element int64 tensor on t's device. With ``seed_part`` (and ``key_out``,
    ``ticket``), ``key`` is the kernel's encode counter instead: the key is computed from it in
    the kernel (one launch instead of the ~30 small integer operations of the tensor form) and
    written to ``key_out``, and the counter advanced by 1 (``ticket``: a one-element int32
    tensor holding 0, the kernel's scratch, 0 again after the launch)."""
    from_counter = seed_part is not None
    if from_counter and (key_out is None or ticket is None):
        raise ValueError(
            "[dropout_apply_triton] key_out and ticket must be given with seed_part, got None"
        )
    seed32 = 0 if seed_part is None else seed_part - (1 << 32) * (seed_part >= (1 << 31))
    out_key = key_out if key_out is not None else key
    t = t.contiguous()
    out = torch.empty_like(t)
    n, c, h, w = t.shape
    sc, sy, sx = geom.strides
    # 32-bit threshold as an int32 bit pattern (reinterpreted as uint32 inside)
    thr32 = geom.threshold - (1 << 32) if geom.threshold >= (1 << 31) else geom.threshold
    scale = float(np.float32(geom.scale))  # the float32 the portable path multiplies by
    if (sc, sy, sx) == (1, 1, 1):
        chw = c * h * w
        block = min(4096, next_power_of_2(chw))
        _dropout_flat[(n, cdiv(chw, block))](
            t, out, key, first_image, chw, thr32, scale, seed32, out_key, ticket,
            FROM_COUNTER=from_counter, BLOCK=block,
        )  # fmt: skip
        return out
    block = min(4096, next_power_of_2(h * w))
    _dropout_planes[(n * c, cdiv(h * w, block))](
        t, out, key, first_image, c, h, w, thr32, scale, seed32, out_key, ticket,
        FROM_COUNTER=from_counter, SC=sc, SY=sy, SX=sx, BLOCK=block,
    )  # fmt: skip
    return out
