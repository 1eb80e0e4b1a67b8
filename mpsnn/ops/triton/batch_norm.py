"""Batch normalization in four passes over NCHW data, ReLU fused (Triton).

Same math as `mpsnn.ops.batch_norm` (its docstring has the formulas), for contiguous
(N, C, H, W) tensors in float16, bfloat16 or float32, computed in float32, with no neuron,
NONE or RELU (``z >= 0 ? z : a z``, any slope ``a``):

1. statistics: each program reads a span of planes of one channel (the (n, c) planes of NCHW
   are contiguous) and leaves a partial ``(count, mean, m2)``; a second kernel merges the
   partials of each channel in float64. Within a program the data are shifted by the
   channel's first sample, each loaded block is reduced two-pass in registers (its mean, then
   its squared deviations) and merged into the running triple with Chan's update: no
   cancellation, whatever the channel's mean, for one read of ``x``.
2. normalization + neuron: one elementwise pass (read ``x``, write ``y``).
3. gradient sums: one pass reading ``g`` and ``x``; ``xhat`` and ``z`` (for the ReLU branch)
   are recomputed in registers; per-program partial sums, added up by one small reduction.
4. ``dx``: one elementwise pass reading ``g`` and ``x``, writing ``dx``.

Per-channel coefficients (``1 / sqrt(var + eps)``, ``gamma s``, ``Σ gy / m``...) are computed
by each program from the (C,) tensors, with correctly rounded square root and division, and
the kernels are compiled without multiply-add contraction, so passes 2 and 4 give the portable
path's bits: every operation is the portable path's, in its order, rounded once.

Tiles: a program loads ``rows x block`` elements at a time. Large planes take one plane per
tile row (``rows = 1``, planes split into spans); small planes (CIFAR-sized networks: 4x4 to
32x32) take many planes per tile, so that a tile stays a few thousand elements instead of one
plane of 16 (at 16 elements per program the passes ran at a quarter of the memory bandwidth).
Reduction tiles are planes (n) of one channel; elementwise tiles are consecutive (n, c) planes,
whose channel is computed once per plane: no element needs an integer division.

Bytes moved: forward ``x`` twice and ``y`` once; gradient ``g`` and ``x`` twice, ``dx`` once.
The elementwise passes take the planes in reverse order: the reductions before them read the
last planes last, so those are still in L2 when the elementwise pass starts (up to the L2's
size read from it instead of memory: most useful for bfloat16, where more of ``x`` fits).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from mpsnn.ops.batch_norm_params import BatchNormParams, BatchNormSums
from mpsnn.ops.triton.launch import cdiv, fast_kernel, next_power_of_2, sm_count

__all__ = [
    "bn_backward_triton",
    "bn_forward_triton",
    "bn_gradient_sums_triton",
    "bn_statistics_triton",
    "combine_statistics",
]

_RELU = 1  # neuron type code (`mpsnn.ops.neuron`)
# Reductions: about this many programs per SM (several resident at once hide the latency of
# their loads), and at most this many partial results per channel.
_PROGRAMS_PER_SM = 8
_MAX_PARTS = 1024
_BLOCK_BYTES = 16384  # bytes a program loads per tensor and loop step (reductions)
_EW_BLOCK_BYTES = 8192  # ... in the elementwise passes
_EW_MAX_SPAN = 16384  # elements of a plane per elementwise program (longer planes are split)


# -- kernels --------------------------------------------------------------------------------


@triton.jit
def _coefficients(mean_ptr, var_ptr, gamma_ptr, beta_ptr, c, eps):
    """The channel's ``mean``, ``s = 1 / sqrt(var + eps)`` (0 where ``var + eps <= 0``),
    ``a = gamma s`` and ``beta``, as `mpsnn.ops.batch_norm._inv_std` computes them."""
    mu = tl.load(mean_ptr + c)
    v = tl.load(var_ptr + c) + eps
    pos = v > 0
    s = tl.math.div_rn(tl.full((), 1.0, tl.float32), tl.sqrt_rn(tl.where(pos, v, 1.0)))
    s = tl.where(pos, s, 0.0)
    return mu, s, tl.load(gamma_ptr + c) * s, tl.load(beta_ptr + c)


@triton.jit
def _neuron(z, slope, RELU: tl.constexpr):
    """The fused neuron of the normalized ``z``: ``z >= 0 ? z : slope z`` (RELU), or ``z``."""
    if RELU:
        z = tl.where(z >= 0, z, z * slope)
    return z


@triton.jit
def _through_neuron(gy, z, slope, RELU: tl.constexpr):
    """``gy`` through the fused neuron's derivative at ``z`` (1 where ``z >= 0``, ``slope``
    below; RELU), or ``gy`` (then ``z`` is unused, and the compiler drops its arithmetic)."""
    if RELU:
        gy = tl.where(z >= 0, gy, gy * slope)
    return gy


@triton.jit
def _bfloat16_bits(v):
    """The bits of float32 ``v`` rounded to bfloat16 (nearest even), in a uint32's low half:
    rounded in integer arithmetic (Triton's interpreter truncates in its own conversion); a
    NaN becomes 0x7FC0."""
    b = v.to(tl.uint32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, r)


@triton.jit
def _store(ptr, v, mask):
    """Store float32 ``v`` in ``ptr``'s dtype, rounded to nearest even (bfloat16:
    `_bfloat16_bits`)."""
    if ptr.dtype.element_ty == tl.bfloat16:
        r = _bfloat16_bits(v)
        tl.store(ptr, r.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _chan_merge(cnt, mean, m2, k, bmean, bm2):
    """Chan's update: the triple (count, mean, m2) merged with a block's (k, bmean, bm2)
    (scalars, or vectors of channels)."""
    tot = cnt + k
    w = k / tot
    delta = bmean - mean
    return tot, mean + delta * w, m2 + bm2 + delta * delta * cnt * w


@fast_kernel
@triton.jit
def _stats_partial(
    x_ptr, part_ptr, N, C, L, planes, span, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # grid (C, chunks, splits): channel c, planes [n0, n1), elements [l0, l1) of each plane;
    # a tile is ROWS planes (n) by BLOCK elements (several planes at once when they are small)
    c = tl.program_id(0)
    chunk = tl.program_id(1)
    split = tl.program_id(2)
    parts = tl.num_programs(1) * tl.num_programs(2)
    n0 = chunk * planes
    n1 = tl.minimum(n0 + planes, N)
    l0 = split * span
    l1 = tl.minimum(l0 + span, L)
    shift = tl.load(x_ptr + c.to(tl.int64) * L).to(tl.float32)  # x[0, c, 0]
    offs = tl.arange(0, BLOCK)
    rs = tl.arange(0, ROWS)
    cnt = 0.0
    mean = 0.0
    m2 = 0.0
    for n in range(n0, n1, ROWS):
        r = n + rs
        rows = (r * C + c).to(tl.int64) * L  # planes (r, c); r * C + c < 2^31
        for s in range(l0, l1, BLOCK):
            idx = s + offs
            mask = (r < n1)[:, None] & (idx < l1)[None, :]
            v = tl.load(x_ptr + rows[:, None] + idx[None, :], mask=mask, other=0.0)
            d = tl.where(mask, v.to(tl.float32) - shift, 0.0)
            k = (tl.minimum(n1 - n, ROWS) * tl.minimum(l1 - s, BLOCK)).to(tl.float32)
            bmean = tl.sum(tl.sum(d, axis=1), axis=0) / k
            e = tl.where(mask, d - bmean, 0.0)
            bm2 = tl.sum(tl.sum(e * e, axis=1), axis=0)
            cnt, mean, m2 = _chan_merge(cnt, mean, m2, k, bmean, bm2)
    p = c * parts + chunk * tl.num_programs(2) + split
    plane = C * parts
    tl.store(part_ptr + p, cnt)
    tl.store(part_ptr + plane + p, mean)
    tl.store(part_ptr + 2 * plane + p, m2)


@fast_kernel
@triton.jit
def _stats_combine(
    part_ptr, x_ptr, count_ptr, mean_ptr, m2_ptr, var_ptr, C, L, P, BLOCK_P: tl.constexpr,
    VARIANCE: tl.constexpr,
):  # fmt: skip
    # one program per channel: merge its P partial triples in float64 (two-pass over them);
    # VARIANCE: also the biased variance m2 / max(count, 1) of the float32 results, rounded
    # once as `bn_variance`'s division (the work that makes the statistics writes it)
    c = tl.program_id(0)
    offs = tl.arange(0, BLOCK_P)
    mask = offs < P
    base = part_ptr + c * P + offs
    n = tl.load(base, mask=mask, other=0.0).to(tl.float64)
    mu = tl.load(base + C * P, mask=mask, other=0.0).to(tl.float64)
    q = tl.load(base + 2 * C * P, mask=mask, other=0.0).to(tl.float64)
    total = tl.sum(n, axis=0)
    mean = tl.sum(n * mu, axis=0) / total
    dev = mu - mean
    m2 = tl.sum(q + n * dev * dev, axis=0)
    shift = tl.load(x_ptr + c.to(tl.int64) * L).to(tl.float64)
    tl.store(mean_ptr + c, (shift + mean).to(tl.float32))
    # rounding may leave a tiny negative sum: 0 then; a NaN stays NaN (a bare maximum would
    # drop it, and the variance of a channel holding a NaN would read 0)
    m2 = tl.where(m2 != m2, m2, tl.maximum(m2, 0.0)).to(tl.float32)
    tl.store(m2_ptr + c, m2)
    if VARIANCE:
        tl.store(var_ptr + c, tl.math.div_rn(m2, tl.maximum(total.to(tl.float32), 1.0)))
    if c == 0:
        tl.store(count_ptr, total.to(tl.float32))


@fast_kernel
@triton.jit
def _forward(
    x_ptr, y_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, NC, C, L, span, eps, slope,
    RELU: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # grid (cdiv(N C, ROWS), splits): planes (n, c) [p0, p0 + ROWS), elements [l0, l1) of each
    p0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * ROWS  # last planes first (docstring)
    planes = p0 + tl.arange(0, ROWS)
    c = planes % C  # one division per plane, none per element
    mu, _, a, beta = _coefficients(mean_ptr, var_ptr, gamma_ptr, beta_ptr, c, eps)
    l0 = tl.program_id(1) * span
    l1 = tl.minimum(l0 + span, L)
    base = planes.to(tl.int64) * L
    offs = tl.arange(0, BLOCK)
    for i in range(l0, l1, BLOCK):
        idx = base[:, None] + (i + offs)[None, :]
        mask = (planes < NC)[:, None] & (i + offs < l1)[None, :]
        xc = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32) - mu[:, None]
        z = _neuron(xc * a[:, None] + beta[:, None], slope, RELU)
        _store(y_ptr + idx, z, mask)


@fast_kernel
@triton.jit
def _gradient_sums_partial(
    g_ptr, x_ptr, part_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, N, C, L, planes, span, eps,
    slope, RELU: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # grid (C, chunks, splits) and tiles as in _stats_partial; lanes accumulate, one sum at
    # the end
    c = tl.program_id(0)
    chunk = tl.program_id(1)
    split = tl.program_id(2)
    parts = tl.num_programs(1) * tl.num_programs(2)
    mu, s, a, beta = _coefficients(mean_ptr, var_ptr, gamma_ptr, beta_ptr, c, eps)
    n0 = chunk * planes
    n1 = tl.minimum(n0 + planes, N)
    l0 = split * span
    l1 = tl.minimum(l0 + span, L)
    offs = tl.arange(0, BLOCK)
    rs = tl.arange(0, ROWS)
    acc_g = tl.zeros((ROWS, BLOCK), tl.float32)
    acc_gx = tl.zeros((ROWS, BLOCK), tl.float32)
    for n in range(n0, n1, ROWS):
        r = n + rs
        rows = (r * C + c).to(tl.int64) * L
        for i in range(l0, l1, BLOCK):
            idx = rows[:, None] + (i + offs)[None, :]
            mask = (r < n1)[:, None] & (i + offs < l1)[None, :]
            xc = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32) - mu
            gy = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)  # 0 where masked
            gy = _through_neuron(gy, xc * a + beta, slope, RELU)
            acc_g += gy
            acc_gx += gy * (xc * s)
    p = c * parts + chunk * tl.num_programs(2) + split
    tl.store(part_ptr + p, tl.sum(tl.sum(acc_g, axis=1), axis=0))
    tl.store(part_ptr + C * parts + p, tl.sum(tl.sum(acc_gx, axis=1), axis=0))


@fast_kernel
@triton.jit
def _backward(
    g_ptr, x_ptr, dx_ptr, mean_ptr, var_ptr, gamma_ptr, beta_ptr, sum_gy_ptr, sum_gyx_ptr,
    count_ptr, count_stride, NC, C, L, span, eps, slope, RELU: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # grid and tiles as in _forward
    p0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * ROWS  # last planes first (docstring)
    planes = p0 + tl.arange(0, ROWS)
    c = planes % C
    mu, s, a, beta = _coefficients(mean_ptr, var_ptr, gamma_ptr, beta_ptr, c, eps)
    m = tl.load(count_ptr + c * count_stride)
    mean_gy = tl.math.div_rn(tl.load(sum_gy_ptr + c), m)
    mean_gyx = tl.math.div_rn(tl.load(sum_gyx_ptr + c), m)
    l0 = tl.program_id(1) * span
    l1 = tl.minimum(l0 + span, L)
    base = planes.to(tl.int64) * L
    offs = tl.arange(0, BLOCK)
    for i in range(l0, l1, BLOCK):
        idx = base[:, None] + (i + offs)[None, :]
        mask = (planes < NC)[:, None] & (i + offs < l1)[None, :]
        xc = tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32) - mu[:, None]
        gy = tl.load(g_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        gy = _through_neuron(gy, xc * a[:, None] + beta[:, None], slope, RELU)
        t = gy - mean_gy[:, None]
        t = t - (xc * s[:, None]) * mean_gyx[:, None]
        dx = t * a[:, None]
        _store(dx_ptr + idx, dx, mask)


# -- launch plans ---------------------------------------------------------------------------


def _programs_wanted(device: torch.device) -> int:
    # Triton's interpreter (CPU tensors) runs programs one after the other: few suffice.
    sms = sm_count(device.index or 0) if device.type == "cuda" else 1
    return _PROGRAMS_PER_SM * sms


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


class _ReductionPlan(NamedTuple):
    """Each program: ``planes`` planes of its channel, ``span`` elements of each, in tiles of
    ``rows`` planes by ``block`` elements; grid (C, chunks, splits), ``chunks * splits``
    partial results per channel."""

    planes: int
    span: int
    rows: int
    block: int
    chunks: int
    splits: int


def _reduction_plan(
    x: torch.Tensor,
    planes: int | None,
    span: int | None,
    block: int | None,
    rows: int | None = None,
) -> _ReductionPlan:
    n, c, h, w = x.shape
    length = h * w
    budget = _BLOCK_BYTES // x.element_size()  # elements a tile loads per tensor
    if planes is None or span is None:
        want = min(_MAX_PARTS, max(1, cdiv(_programs_wanted(x.device), c)))
        if n >= want:  # whole planes, several per program
            planes, span = cdiv(n, want), length
        else:  # one plane per program, split along the plane
            planes, span = 1, cdiv(length, cdiv(want, n))
    if block is None:
        block = min(budget, next_power_of_2(span))
    if rows is None:  # small planes: several in one tile, so that a tile stays large
        rows = max(1, min(budget // block, next_power_of_2(planes)))
    if span < length:
        span = cdiv(span, block) * block  # splits start on a block boundary
    span = min(span, length)
    return _ReductionPlan(planes, span, rows, block, cdiv(n, planes), cdiv(length, span))


class _ElementwisePlan(NamedTuple):
    """Each program: ``rows`` consecutive planes, ``span`` elements of each, by ``block``;
    grid (cdiv(N C, rows), splits)."""

    rows: int
    span: int
    block: int
    splits: int


def _elementwise_plan(
    x: torch.Tensor, span: int | None, block: int | None, rows: int | None = None
) -> _ElementwisePlan:
    n, c, h, w = x.shape
    length = h * w
    budget = _EW_BLOCK_BYTES // x.element_size()
    if span is None:
        span = cdiv(length, cdiv(length, _EW_MAX_SPAN))
    if block is None:
        block = min(budget, next_power_of_2(span))
    if rows is None:  # small planes (CIFAR-sized networks): many per program
        rows = max(1, min(budget // block, next_power_of_2(n * c)))
    if span < length:
        span = cdiv(span, block) * block
    span = min(span, length)
    return _ElementwisePlan(rows, span, block, cdiv(length, span))


def _per_channel(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` as the kernels read a per-channel vector: float32, contiguous, on ``device``."""
    if t.dtype is torch.float32 and t.is_contiguous() and t.device == device:
        return t
    return t.to(device=device, dtype=torch.float32).contiguous()


def _channel_params(p: BatchNormParams, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``mean, var, gamma, beta`` as the kernels read them: float32, contiguous, on ``x``'s
    device. The common case (the statistics' and the data source's vectors) returns them after
    one test each, with no call into PyTorch: a normalization layer's commands ask for them
    about a dozen times per step."""
    device = x.device
    mean, var, gamma, beta = p.mean, p.var, p.gamma, p.beta
    f32 = torch.float32
    if (
        mean.dtype is f32 and var.dtype is f32 and gamma.dtype is f32 and beta.dtype is f32
        and mean.is_contiguous() and var.is_contiguous() and gamma.is_contiguous()
        and beta.is_contiguous() and mean.device == device and var.device == device
        and gamma.device == device and beta.device == device
    ):  # fmt: skip
        return mean, var, gamma, beta
    return tuple(_per_channel(t, device) for t in (mean, var, gamma, beta))


def _channel_sums(sums: BatchNormSums, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_gy, sum_gy_xhat`` as the kernels read them."""
    device = x.device
    return _per_channel(sums.sum_gy, device), _per_channel(sums.sum_gy_xhat, device)


def _count(sums: BatchNormSums, x: torch.Tensor) -> torch.Tensor:
    """The count ``m`` as a float32 vector on ``x``'s device (one element, or one per channel)."""
    m = sums.count
    if type(m) is torch.Tensor and m.dim() == 1:
        return _per_channel(m, x.device)  # as the statistics wrote it: no call into PyTorch
    m = torch.as_tensor(m, dtype=torch.float32, device=x.device)
    return m.reshape(-1).contiguous()


def _relu(neuron: Any) -> tuple[bool, float]:
    """(whether the ReLU branch runs, its negative slope); no neuron and NONE are identities."""
    if neuron is not None and neuron.kind == _RELU:
        return True, float(neuron.a)
    return False, 0.0


# -- entry points ---------------------------------------------------------------------------


def bn_statistics_triton(
    x: torch.Tensor, *, planes: int | None = None, span: int | None = None,
    block: int | None = None, rows: int | None = None, variance: bool = False,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """`mpsnn.ops.batch_norm.bn_statistics_portable`'s ``(count, mean, m2)`` (float32; equal up
    to summation order), and with ``variance`` the biased variance of those too (the bits of
    `mpsnn.ops.batch_norm.bn_variance` of them). ``planes``, ``span``, ``block``, ``rows``: the
    work split (tests force it)."""
    x = x.contiguous()
    n, c, h, w = x.shape
    plan = _reduction_plan(x, planes, span, block, rows)
    parts = plan.chunks * plan.splits
    part = torch.empty(3, c, parts, dtype=torch.float32, device=x.device)
    _stats_partial[(c, plan.chunks, plan.splits)](
        x, part, n, c, h * w, plan.planes, plan.span, ROWS=plan.rows, BLOCK=plan.block,
        num_warps=_warps(plan.rows * plan.block),
    )  # fmt: skip
    return combine_statistics(part, x, h * w, variance)


def combine_statistics(
    part: torch.Tensor, x: torch.Tensor, shift_stride: int, variance: bool
) -> tuple[torch.Tensor, ...]:
    """The statistics of ``x`` from the partial triples ``part`` (3, C, P): ``(count, mean,
    m2)``, and ``var`` with ``variance``, as views of one buffer. ``shift_stride``: the
    elements between channel ``c``'s first sample and channel ``c + 1``'s in ``x``'s memory
    (the shift the partial sums used)."""
    c, parts = part.shape[1], part.shape[2]
    out = torch.empty((3 if variance else 2) * c + 1, dtype=torch.float32, device=x.device)
    # the views in one call into PyTorch (half the host time of three or four slices)
    if variance:
        count, mean, m2, var = out.split_with_sizes((1, c, c, c))
    else:
        count, mean, m2 = out.split_with_sizes((1, c, c))
        var = m2  # (not written without VARIANCE)
    _stats_combine[(c,)](
        part, x, count, mean, m2, var, c, shift_stride, parts, BLOCK_P=next_power_of_2(parts),
        VARIANCE=variance,
    )  # fmt: skip
    return (count, mean, m2, var) if variance else (count, mean, m2)


def bn_forward_triton(
    x: torch.Tensor, p: BatchNormParams, *, span: int | None = None, block: int | None = None,
    rows: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """`mpsnn.ops.batch_norm.bn_forward_portable`'s bits (no neuron, NONE or RELU)."""
    x = x.contiguous()
    n, c, h, w = x.shape
    y = torch.empty_like(x)
    relu, slope = _relu(p.neuron)
    plan = _elementwise_plan(x, span, block, rows)
    _forward[(cdiv(n * c, plan.rows), plan.splits)](
        x, y, *_channel_params(p, x), n * c, c, h * w, plan.span, float(p.eps), slope,
        RELU=relu, ROWS=plan.rows, BLOCK=plan.block, num_warps=_warps(plan.rows * plan.block),
        enable_fp_fusion=False,
    )  # fmt: skip
    return y


def bn_gradient_sums_triton(
    g: torch.Tensor, x: torch.Tensor, p: BatchNormParams, *, planes: int | None = None,
    span: int | None = None, block: int | None = None, rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`mpsnn.ops.batch_norm.bn_gradient_sums_portable`'s ``(Σ gy, Σ gy xhat)`` (float32;
    equal up to summation order)."""
    x, g = x.contiguous(), g.contiguous()
    n, c, h, w = x.shape
    relu, slope = _relu(p.neuron)
    plan = _reduction_plan(x, planes, span, block, rows)
    parts = plan.chunks * plan.splits
    part = torch.empty(2, c, parts, dtype=torch.float32, device=x.device)
    _gradient_sums_partial[(c, plan.chunks, plan.splits)](
        g, x, part, *_channel_params(p, x), n, c, h * w, plan.planes, plan.span, float(p.eps),
        slope, RELU=relu, ROWS=plan.rows, BLOCK=plan.block,
        num_warps=_warps(plan.rows * plan.block), enable_fp_fusion=False,
    )  # fmt: skip
    sum_gy, sum_gy_xhat = part.sum(dim=2).unbind(0)  # both views in one call
    return sum_gy, sum_gy_xhat


def bn_backward_triton(
    g: torch.Tensor, x: torch.Tensor, p: BatchNormParams, sums: BatchNormSums, *,
    span: int | None = None, block: int | None = None, rows: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """`mpsnn.ops.batch_norm.bn_backward_portable`'s bits (no neuron, NONE or RELU)."""
    x, g = x.contiguous(), g.contiguous()
    n, c, h, w = x.shape
    dx = torch.empty_like(x)
    relu, slope = _relu(p.neuron)
    plan = _elementwise_plan(x, span, block, rows)
    m = _count(sums, x)
    _backward[(cdiv(n * c, plan.rows), plan.splits)](
        g, x, dx, *_channel_params(p, x), *_channel_sums(sums, x), m,
        0 if m.numel() == 1 else 1, n * c, c, h * w, plan.span, float(p.eps), slope,
        RELU=relu, ROWS=plan.rows, BLOCK=plan.block, num_warps=_warps(plan.rows * plan.block),
        enable_fp_fusion=False,
    )  # fmt: skip
    return dx
