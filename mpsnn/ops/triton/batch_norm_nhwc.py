"""Batch normalization over channels-last (NHWC) data, ReLU fused (Triton): the passes of
`mpsnn.ops.triton.batch_norm` for a tensor of logical shape (N, C, H, W) whose memory is
``[N H W, C]`` row-major (``torch.channels_last``), the layout cuDNN's half-precision
convolutions read and write on Hopper GPUs (an NCHW image costs them a layout conversion on
each side of every convolution).

Tiles are ``block_m`` rows (pixels) by ``block_c`` channels; a row of a tile is ``block_c``
contiguous elements. Every per-channel quantity is a vector over the tile's channels, so no
element needs an integer division, and the per-element operations are the NCHW kernels', in
their order: the normalization and ``dx`` passes give the portable path's bits; the statistics
and gradient sums equal it up to summation order (partial results per channel, merged as in the
NCHW path).

Statistics: every lane of a program's tile (a pixel row and a channel) keeps a running Welford
triple (count, mean, m2) of the values it reads, shifted by the channel's first sample; the
lanes of a channel are merged with Chan's update once, after the loop. No cancellation,
whatever the channel's mean or where its first sample lies, and no reduction across the tile
inside the loop.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mpsnn.ops.batch_norm_params import BatchNormParams, BatchNormSums
from mpsnn.ops.triton.batch_norm import (
    _MAX_PARTS,
    _bfloat16_bits,
    _channel_params,
    _channel_sums,
    _coefficients,
    _count,
    _neuron,
    _programs_wanted,
    _relu,
    _store,
    _through_neuron,
    _warps,
    combine_statistics,
)
from mpsnn.ops.triton.launch import cdiv, fast_kernel, next_power_of_2
from mpsnn.ops.triton.layout import channels_last_copy

__all__ = [
    "nhwc_backward",
    "nhwc_channel_sums",
    "nhwc_forward",
    "nhwc_forward_add_relu",
    "nhwc_gradient_sums",
    "nhwc_statistics",
]


@triton.jit
def _welford_merge(mean_a, m2_a, n_a, mean_b, m2_b, n_b):
    """Chan's merge of two (mean, m2, count) triples (a reduction's combine: empty lanes,
    count 0, merge to the other triple)."""
    n = n_a + n_b
    w = tl.where(n == 0.0, 0.0, n_b / tl.where(n == 0.0, 1.0, n))
    delta = mean_b - mean_a
    return mean_a + delta * w, m2_a + m2_b + delta * delta * n_a * w, n


@fast_kernel
@triton.jit
def _stats_partial_nhwc(
    x_ptr, part_ptr, M, C, rows, BM: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    # grid (channel blocks, chunks): channels [c0, c0 + BC), pixels [m0, m1). Each lane (a
    # tile row and channel) keeps a running Welford triple of the values shifted by x[0, c]
    # (no reduction across the tile inside the loop: the tile's loads are the loop's only
    # wait), merged across the tile's rows once at the end.
    cs = tl.program_id(0) * BC + tl.arange(0, BC)
    chunk = tl.program_id(1)
    parts = tl.num_programs(1)
    cmask = cs < C
    m0 = chunk * rows
    m1 = tl.minimum(m0 + rows, M)
    shift = tl.load(x_ptr + cs, mask=cmask, other=0.0).to(tl.float32)  # x[0, c]
    ms = tl.arange(0, BM)
    n = tl.zeros((BM, 1), tl.float32)  # samples seen by each row's lanes
    mean = tl.zeros((BM, BC), tl.float32)
    m2 = tl.zeros((BM, BC), tl.float32)
    for m in range(m0, m1, BM):
        r = m + ms
        live = (r < m1)[:, None]
        mask = live & cmask[None, :]
        idx = r.to(tl.int64)[:, None] * C + cs[None, :]
        d = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32) - shift[None, :]
        n = n + live.to(tl.float32)
        step = tl.where(live, 1.0 / tl.maximum(n, 1.0), 0.0)
        delta = d - mean
        mean = mean + delta * step
        m2 = m2 + tl.where(live, delta * (d - mean), 0.0)
    cnt, mean_c, m2_c = _lane_merge(mean, m2, n, BC)
    p = cs * parts + chunk
    plane = C * parts
    tl.store(part_ptr + p, cnt, mask=cmask)
    tl.store(part_ptr + plane + p, mean_c, mask=cmask)
    tl.store(part_ptr + 2 * plane + p, m2_c, mask=cmask)


@triton.jit
def _lane_merge(mean, m2, n, BC: tl.constexpr):
    """The (count, mean, m2) of each channel from its lanes' triples (rows of the tile)."""
    counts = tl.broadcast_to(n, (n.shape[0], BC))
    mean_c, m2_c, cnt = tl.reduce((mean, m2, counts), 0, _welford_merge)
    return cnt, mean_c, m2_c


@triton.jit
def _normalized_tile(
    x_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, M, C, eps,
    BM: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    """This program's tile of the grid (pixel blocks, channel blocks), the last pixels first
    (see the NCHW module): its element offsets, its mask and ``(x - mean) a + beta`` in
    float32 (the normalization before the neuron)."""
    r = (tl.num_programs(0) - 1 - tl.program_id(0)) * BM + tl.arange(0, BM)
    cs = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cs < C
    c = tl.where(cmask, cs, 0)  # a valid channel to read coefficients for on masked lanes
    mu, _, a, beta = _coefficients(mean_ptr, var_ptr, gamma_ptr, beta_ptr, c, eps)
    mask = (r < M)[:, None] & cmask[None, :]
    idx = r.to(tl.int64)[:, None] * C + cs[None, :]
    xc = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32) - mu[None, :]
    return idx, mask, xc * a[None, :] + beta[None, :]


@fast_kernel
@triton.jit
def _forward_nhwc(
    x_ptr, y_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, M, C, eps, slope,
    RELU: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    idx, mask, v = _normalized_tile(x_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, M, C, eps,
                                    BM, BC)  # fmt: skip
    _store(y_ptr + idx, _neuron(v, slope, RELU), mask)


@fast_kernel
@triton.jit
def _forward_add_relu_nhwc(
    x_ptr, r_ptr, y_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, M, C, eps,
    FIRST: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    # `_forward_nhwc` without a neuron, its result rounded to the storage dtype as `_store`
    # writes it, then `mpsnn.ops.triton.elementwise._add_relu` on that value and the residual
    idx, mask, v = _normalized_tile(x_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, M, C, eps,
                                    BM, BC)  # fmt: skip
    v = _stored(v, y_ptr.dtype.element_ty)
    s = tl.load(r_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    z = v + s if FIRST else s + v  # the unfused sum's operand order
    z = z.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
    out = tl.where(z >= 0, 1.0, 0.0) * z
    tl.store(y_ptr + idx, out.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _stored(v, dtype: tl.constexpr):
    """The float32 value `_store` writes for ``v`` in ``dtype``, read back as float32."""
    if dtype == tl.bfloat16:
        out = (_bfloat16_bits(v) << 16).to(tl.float32, bitcast=True)
    else:
        out = v.to(dtype).to(tl.float32)
    return out


@fast_kernel
@triton.jit
def _gradient_sums_partial_nhwc(
    g_ptr, x_ptr, part_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, M, C, rows, eps, slope,
    RELU: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    # grid and tiles as in _stats_partial_nhwc; lanes accumulate, one sum at the end
    cs = tl.program_id(0) * BC + tl.arange(0, BC)
    chunk = tl.program_id(1)
    parts = tl.num_programs(1)
    cmask = cs < C
    c = tl.where(cmask, cs, 0)
    mu, s, a, beta = _coefficients(mean_ptr, var_ptr, gamma_ptr, beta_ptr, c, eps)
    m0 = chunk * rows
    m1 = tl.minimum(m0 + rows, M)
    ms = tl.arange(0, BM)
    acc_g = tl.zeros((BM, BC), tl.float32)
    acc_gx = tl.zeros((BM, BC), tl.float32)
    for m in range(m0, m1, BM):
        r = m + ms
        mask = (r < m1)[:, None] & cmask[None, :]
        idx = r.to(tl.int64)[:, None] * C + cs[None, :]
        xc = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32) - mu[None, :]
        gy = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)  # 0 where masked
        gy = _through_neuron(gy, xc * a[None, :] + beta[None, :], slope, RELU)
        acc_g += gy
        acc_gx += gy * (xc * s[None, :])
    p = cs * parts + chunk
    tl.store(part_ptr + p, tl.sum(acc_g, axis=0), mask=cmask)
    tl.store(part_ptr + C * parts + p, tl.sum(acc_gx, axis=0), mask=cmask)


@fast_kernel
@triton.jit
def _backward_nhwc(
    g_ptr, x_ptr, dx_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, sum_gy_ptr, sum_gyx_ptr,
    count_ptr, count_stride, M, C, eps, slope, RELU: tl.constexpr, BM: tl.constexpr,
    BC: tl.constexpr,
):  # fmt: skip
    # grid and tiles as in _forward_nhwc
    r = (tl.num_programs(0) - 1 - tl.program_id(0)) * BM + tl.arange(0, BM)
    cs = tl.program_id(1) * BC + tl.arange(0, BC)
    cmask = cs < C
    c = tl.where(cmask, cs, 0)
    mu, s, a, beta = _coefficients(mean_ptr, var_ptr, gamma_ptr, beta_ptr, c, eps)
    cnt = tl.load(count_ptr + c * count_stride)
    mean_gy = tl.math.div_rn(tl.load(sum_gy_ptr + c), cnt)
    mean_gyx = tl.math.div_rn(tl.load(sum_gyx_ptr + c), cnt)
    mask = (r < M)[:, None] & cmask[None, :]
    idx = r.to(tl.int64)[:, None] * C + cs[None, :]
    xc = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32) - mu[None, :]
    gy = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    gy = _through_neuron(gy, xc * a[None, :] + beta[None, :], slope, RELU)
    t = gy - mean_gy[None, :]
    t = t - (xc * s[None, :]) * mean_gyx[None, :]
    dx = t * a[None, :]
    _store(dx_ptr + idx, dx, mask)


@fast_kernel
@triton.jit
def _channel_sums_partial(g_ptr, part_ptr, M, C, rows, BM: tl.constexpr, BC: tl.constexpr):
    # grid and tiles as in _stats_partial_nhwc: float32 sums of each channel's pixels
    cs = tl.program_id(0) * BC + tl.arange(0, BC)
    chunk = tl.program_id(1)
    cmask = cs < C
    m0 = chunk * rows
    m1 = tl.minimum(m0 + rows, M)
    ms = tl.arange(0, BM)
    acc = tl.zeros((BM, BC), tl.float32)
    for m in range(m0, m1, BM):
        r = m + ms
        mask = (r < m1)[:, None] & cmask[None, :]
        idx = r.to(tl.int64)[:, None] * C + cs[None, :]
        acc += tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    tl.store(part_ptr + cs * tl.num_programs(1) + chunk, tl.sum(acc, axis=0), mask=cmask)


# -- plans and entry points ------------------------------------------------------------------


class _Tile(NamedTuple):
    """``bm`` pixels by ``bc`` channels; reductions: ``rows`` pixels per program, ``chunks``
    programs (partial results) per channel block."""

    bm: int
    bc: int
    rows: int
    chunks: int


# The reductions' tile bytes, and their programs per SM relative to the NCHW module's: the
# fastest of tiles from 32 to 256 pixels by 32 to 128 channels and of 4x fewer and more
# programs on an H100 (ResNet-18's 20 normalization layers, batch 512, bfloat16, CUDA-graph
# timings). Against 8 KiB tiles everywhere with 8 programs per SM they took the gradient sums
# from 0.81 to 0.54 ms and the channel sums from 0.35 to 0.27 (the same sweep set the
# element-wise passes' first tiles).
#
# The element-wise passes run on half-precision data only (float32 CUDA storage is NCHW).
# Sweeps of 64 to 512 pixels by 64 channels with 4, 8 and 16 warps on an H200 (bfloat16,
# ResNet-18's four layer shapes at batch 512) favour 4 warps, with 256 pixels for the
# normalization and dx and 64 for the normalization inside the residual addition (three
# tensors): 512x64x32x32 took 35.9 / 61.2 / 58.3 µs against 40.2 / 69.8 / 64.7 µs with
# 128-pixel tiles and 8 warps (a plain copy of that tensor: 33.4 µs).
#
# The statistics keep a Welford triple per lane, so a program's loop has no reduction
# across its tile and small tiles with many programs keep the most loads in flight: 32
# pixels by 64 channels, 2 warps, about 384 pixels a program or more (up to 8 programs per SM
# and 1,024 partial results): the fastest plan on ResNet-18's layer shapes (H200; the sweep is
# in benchmarks/RESULTS.md, "Statistics with a running triple per lane").
class _Spec(NamedTuple):
    """How a pass chooses its tiles (`_tile`): ``pixels`` per tile, or as many as fit in
    ``budget`` bytes of 64 channels; reductions: ``programs_per_sm / fewer`` programs (SMs x
    `_PROGRAMS_PER_SM` of the NCHW module, divided), at most one per ``min_rows`` pixels."""

    budget: int = 0
    pixels: int = 0
    fewer: int = 1
    min_rows: int = 1


_STATS = _Spec(pixels=32, min_rows=384)  # statistics: one tensor, a triple per lane
_CHANNEL_SUMS = _Spec(budget=32768, fewer=4)  # channel sums: one tensor
_SUMS = _Spec(budget=8192, fewer=4)  # gradient sums: two tensors and two accumulators
_EW = _Spec(budget=32768)  # normalization and dx
_ADD = _Spec(budget=8192)  # normalization inside the residual addition
_EW_WARPS = 4  # most warps a program runs: element-wise passes
_STATS_WARPS = 2


def _ew_warps(block: int) -> int:
    return max(1, min(_EW_WARPS, block // 256))


def _tile(x: torch.Tensor, spec: _Spec, tile: tuple[int, int] | None, rows: int | None) -> _Tile:
    if tile is None:  # every training step asks again: once per shape
        return _default_tile(x.shape, x.element_size(), x.device, spec, rows)
    return _make_tile(x.shape, x.element_size(), x.device, spec, tile, rows)


@functools.lru_cache(maxsize=1024)
def _default_tile(
    shape: torch.Size, element_size: int, device: torch.device, spec: _Spec, rows: int | None
) -> _Tile:
    return _make_tile(shape, element_size, device, spec, None, rows)


def _make_tile(
    shape: torch.Size, element_size: int, device: torch.device, spec: _Spec,
    tile: tuple[int, int] | None, rows: int | None,
) -> _Tile:  # fmt: skip
    n, c, h, w = shape
    m = n * h * w
    if tile is None:
        bc = min(64, next_power_of_2(c))  # 128-byte rows in bfloat16
        bm = spec.pixels or spec.budget // element_size // bc
        bm = max(1, min(bm, next_power_of_2(m)))
    else:
        bm, bc = tile
    if rows is None:
        programs = cdiv(_programs_wanted(device), spec.fewer)
        want = min(_MAX_PARTS, cdiv(programs, cdiv(c, bc)), cdiv(m, spec.min_rows))
        rows = cdiv(m, max(1, want))
    return _Tile(bm, bc, rows, cdiv(m, rows))


_nhwc = channels_last_copy  # an incoming gradient in the layout of the passes


def nhwc_statistics(
    x: torch.Tensor, *, tile: tuple[int, int] | None = None, rows: int | None = None,
    variance: bool = False,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``(count, mean, m2)`` of channels-last ``x``, and ``var`` with ``variance`` (see the
    NCHW `bn_statistics_triton`)."""
    n, c, h, w = x.shape
    t = _tile(x, _STATS, tile, rows)
    part = torch.empty(3, c, t.chunks, dtype=torch.float32, device=x.device)
    warps = max(1, min(_STATS_WARPS, t.bm * t.bc // 256))
    _stats_partial_nhwc[(cdiv(c, t.bc), t.chunks)](
        x, part, n * h * w, c, t.rows, BM=t.bm, BC=t.bc, num_warps=warps
    )
    # the shift of channel c is x[0, c, 0, 0], at element c of channels-last memory
    return combine_statistics(part, x, 1, variance)


def nhwc_forward(
    x: torch.Tensor, p: BatchNormParams, *, tile: tuple[int, int] | None = None
) -> torch.Tensor:
    """The normalization (+ ReLU) of channels-last ``x``; the result is channels-last."""
    n, c, h, w = x.shape
    relu, slope = _relu(p.neuron)
    y = torch.empty_like(x)  # keeps the channels-last layout
    t = _tile(x, _EW, tile, 1)
    m = n * h * w
    _forward_nhwc[(cdiv(m, t.bm), cdiv(c, t.bc))](
        x, y, *_channel_params(p, x), m, c, float(p.eps), slope, RELU=relu, BM=t.bm, BC=t.bc,
        num_warps=_ew_warps(t.bm * t.bc), enable_fp_fusion=False,
    )  # fmt: skip
    return y


def nhwc_forward_add_relu(
    x: torch.Tensor, p: BatchNormParams, r: torch.Tensor, *, first: bool = True,
    tile: tuple[int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """``relu(bn(x) + r)`` of channels-last ``x`` and ``r`` (one shape, strides and dtype; no
    neuron in ``p``) in one pass: the bits of `nhwc_forward` followed by the residual addition
    and ReLU (`mpsnn.ops.triton.elementwise.add_relu_triton`), without writing and reading
    ``bn(x)``. ``first``: ``bn(x)`` is the sum's first operand. The result is channels-last."""
    n, c, h, w = x.shape
    y = torch.empty_like(x)
    t = _tile(x, _ADD, tile, 1)
    m = n * h * w
    _forward_add_relu_nhwc[(cdiv(m, t.bm), cdiv(c, t.bc))](
        x, r, y, *_channel_params(p, x), m, c, float(p.eps), FIRST=bool(first), BM=t.bm, BC=t.bc,
        num_warps=_ew_warps(t.bm * t.bc), enable_fp_fusion=False,
    )  # fmt: skip
    return y


def nhwc_gradient_sums(
    g: torch.Tensor, x: torch.Tensor, p: BatchNormParams, *,
    tile: tuple[int, int] | None = None, rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(Σ gy, Σ gy xhat)`` of channels-last ``x`` (``g`` is made channels-last)."""
    n, c, h, w = x.shape
    relu, slope = _relu(p.neuron)
    g = _nhwc(g)
    t = _tile(x, _SUMS, tile, rows)
    part = torch.empty(2, c, t.chunks, dtype=torch.float32, device=x.device)
    _gradient_sums_partial_nhwc[(cdiv(c, t.bc), t.chunks)](
        g, x, part, *_channel_params(p, x), n * h * w, c, t.rows, float(p.eps), slope,
        RELU=relu, BM=t.bm, BC=t.bc, num_warps=_warps(t.bm * t.bc), enable_fp_fusion=False,
    )  # fmt: skip
    sum_gy, sum_gy_xhat = part.sum(dim=2).unbind(0)  # both views in one call
    return sum_gy, sum_gy_xhat


def nhwc_backward(
    g: torch.Tensor, x: torch.Tensor, p: BatchNormParams, sums: BatchNormSums, *,
    tile: tuple[int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """``dx`` of channels-last ``x`` (``g`` is made channels-last); the result is
    channels-last."""
    n, c, h, w = x.shape
    relu, slope = _relu(p.neuron)
    g = _nhwc(g)
    dx = torch.empty_like(x)
    t = _tile(x, _EW, tile, 1)
    cnt = _count(sums, x)
    m = n * h * w
    _backward_nhwc[(cdiv(m, t.bm), cdiv(c, t.bc))](
        g, x, dx, *_channel_params(p, x), *_channel_sums(sums, x), cnt,
        0 if cnt.numel() == 1 else 1, m, c, float(p.eps), slope, RELU=relu, BM=t.bm, BC=t.bc,
        num_warps=_ew_warps(t.bm * t.bc), enable_fp_fusion=False,
    )  # fmt: skip
    return dx


def nhwc_channel_sums(
    g: torch.Tensor, *, tile: tuple[int, int] | None = None, rows: int | None = None
) -> torch.Tensor:
    """``g.sum((0, 2, 3))`` in float32 for channels-last ``g`` (a convolution's bias gradient):
    per-channel partial sums over pixel ranges, then one small reduction. PyTorch's reduction
    over the outer dimension of the ``(N H W, C)`` view reaches about a fifth of the memory
    bandwidth for bfloat16 there."""
    n, c, h, w = g.shape
    t = _tile(g, _CHANNEL_SUMS, tile, rows)
    part = torch.empty(c, t.chunks, dtype=torch.float32, device=g.device)
    _channel_sums_partial[(cdiv(c, t.bc), t.chunks)](
        g, part, n * h * w, c, t.rows, BM=t.bm, BC=t.bc, num_warps=_warps(t.bm * t.bc)
    )
    return part.sum(dim=1)
