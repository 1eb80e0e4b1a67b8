"""Triton kernels for batch normalization's per-channel bookkeeping: the running statistics'
update, and the merge of statistics gathered from several processes (a synchronized batch
normalization). Each replaces a dozen small PyTorch operations (and their launches) by one
launch; both are checked against the portable operations in `mpsnn.ops.batch_norm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mpsnn.ops.triton.launch import cdiv, fast_kernel

__all__ = ["bn_merge_rows_triton", "bn_running_update_triton"]

_BLOCK = 1024  # channels per program (ResNet-18's widest layer has 512)
# PyTorch's CUDA build compiles its `a + alpha b` (the portable update's add) to a fused
# multiply-add; the running update rounds as it does
_RUNNING_FUSED = True


@fast_kernel
@triton.jit
def _running_update(
    run_mean_ptr, run_var_ptr, count_ptr, mean_ptr, m2_ptr, C, count_stride, keep, momentum,
    FUSED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # run = keep run + momentum batch, for the mean and the unbiased variance m2 / max(n - 1, 1)
    # of each channel, with the roundings of the portable path's PyTorch operations: the
    # division correctly rounded, the product by keep rounded, then (FUSED) one fused
    # multiply-add
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    n = tl.load(count_ptr + offs * count_stride, mask=mask, other=1.0)
    m2 = tl.load(m2_ptr + offs, mask=mask, other=0.0)
    unbiased = tl.math.div_rn(m2, tl.maximum(n - 1.0, 1.0))
    mean = tl.load(mean_ptr + offs, mask=mask, other=0.0)
    _blend(run_mean_ptr, offs, mask, mean, keep, momentum, FUSED)
    _blend(run_var_ptr, offs, mask, unbiased, keep, momentum, FUSED)


@triton.jit
def _blend(ptr, offs, mask, batch, keep, momentum, FUSED: tl.constexpr):
    kept = tl.load(ptr + offs, mask=mask, other=0.0) * keep
    if FUSED:
        new = tl.fma(batch, momentum, kept)
    else:
        new = kept + batch * momentum
    tl.store(ptr + offs, new, mask=mask)


@fast_kernel
@triton.jit
def _merge_rows(
    rows_ptr, count_ptr, mean_ptr, m2_ptr, var_ptr, W, row_len, count_stride, C,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # rows (W, row_len): [count (1 or C), mean (C), m2 (C)] of each process. Per channel, in
    # float64: n = Σ n_r, mean = Σ n_r mean_r / n, m2 = Σ m2_r + Σ n_r (mean_r - mean)², rows
    # with n_r = 0 left out (their mean and m2 may be anything); then the biased variance of
    # the float32 results, rounded as `bn_variance`'s division
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    k = (C - 1) * count_stride + 1  # the count's length
    n = tl.zeros([BLOCK], dtype=tl.float64)
    s = tl.zeros([BLOCK], dtype=tl.float64)
    for r in range(0, W):
        row = rows_ptr + r * row_len
        nr = tl.load(row + offs * count_stride, mask=mask, other=0.0).to(tl.float64)
        mr = tl.load(row + k + offs, mask=mask, other=0.0).to(tl.float64)
        n += nr
        s += tl.where(nr > 0, nr * mr, 0.0)
    mean = tl.where(n > 0, s / tl.where(n > 0, n, 1.0), 0.0)
    m2 = tl.zeros([BLOCK], dtype=tl.float64)
    for r in range(0, W):
        row = rows_ptr + r * row_len
        nr = tl.load(row + offs * count_stride, mask=mask, other=0.0).to(tl.float64)
        mr = tl.load(row + k + offs, mask=mask, other=0.0).to(tl.float64)
        qr = tl.load(row + k + C + offs, mask=mask, other=0.0).to(tl.float64)
        d = mr - mean
        m2 += tl.where(nr > 0, qr + nr * d * d, 0.0)
    n32 = n.to(tl.float32)
    m2_32 = m2.to(tl.float32)
    tl.store(mean_ptr + offs, mean.to(tl.float32), mask=mask)
    tl.store(m2_ptr + offs, m2_32, mask=mask)
    tl.store(var_ptr + offs, tl.math.div_rn(m2_32, tl.maximum(n32, 1.0)), mask=mask)
    if count_stride == 0:  # one count for every channel: channel 0's
        tl.store(count_ptr + offs, n32, mask=offs == 0)
    else:
        tl.store(count_ptr + offs, n32, mask=mask)


def bn_running_update_triton(
    running: tuple[torch.Tensor, torch.Tensor],
    count: torch.Tensor,
    mean: torch.Tensor,
    m2: torch.Tensor,
    momentum: float,
) -> None:
    """`mpsnn.ops.batch_norm.bn_running_update_portable` in one launch (its bits): float32
    (C,) tensors on one device, ``count`` (1,) or (C,)."""
    run_mean, run_var = running
    c = run_mean.numel()
    _running_update[(cdiv(c, _BLOCK),)](
        run_mean, run_var, count, mean, m2, c, 0 if count.numel() == 1 else 1,
        1.0 - momentum, momentum, FUSED=_RUNNING_FUSED, BLOCK=_BLOCK, enable_fp_fusion=False,
    )  # fmt: skip


def bn_merge_rows_triton(
    rows: torch.Tensor,
    into: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    var: torch.Tensor | None = None,
) -> torch.Tensor:
    """`mpsnn.ops.batch_norm.bn_merge_rows` in one launch (merged in float64; the variance
    with `bn_variance`'s bits of the results): ``rows`` a contiguous float32 (W, k + 2C),
    ``into`` = (count (k,), mean (C,), m2 (C,)) contiguous float32, written in place, and the
    variance into ``var`` (a new tensor when None)."""
    count, mean, m2 = into
    c = mean.numel()
    if var is None:
        var = torch.empty_like(mean)
    _merge_rows[(cdiv(c, _BLOCK),)](
        rows, count, mean, m2, var, rows.shape[0], rows.shape[1],
        0 if count.numel() == 1 else 1, c, BLOCK=_BLOCK, enable_fp_fusion=False,
    )  # fmt: skip
    return var
