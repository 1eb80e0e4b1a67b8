"""Triton kernels for batch normalization's per-channel bookkeeping: the running statistics'
update, and the merge of statistics gathered from several processes (a synchronized batch
normalization). Each replaces a dozen small PyTorch operations (and their launches) by one
launch, and the running updates of a whole network's layers share one; both are checked
against the portable operations in `mpsnn.ops.batch_norm`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from mpsnn.ops.batch_norm_params import RunningUpdate
from mpsnn.ops.triton.launch import cdiv, fast_kernel

__all__ = ["bn_merge_rows_triton", "bn_running_updates_triton"]

_BLOCK = 1024  # channels per program (ResNet-18's widest layer has 512)
# layers per launch of the running updates: the kernel has one branch per layer (compiled
# once per count of layers and per specialization of their arguments)
_MAX_LAYERS = 32
# PyTorch's CUDA build compiles its `a + alpha b` (the portable update's add) to a fused
# multiply-add; the running update rounds as it does
_RUNNING_FUSED = True


@fast_kernel
@triton.jit
def _running_updates(
    run_means, run_vars, counts, means, m2s, sizes, count_strides, keeps, momenta,
    N: tl.constexpr, FUSED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # grid (N layers, channel blocks): layer i's tensors are element i of each tuple. For the
    # mean and the unbiased variance m2 / max(n - 1, 1) of each channel: run = keep run +
    # momentum batch, with the roundings of the portable path's PyTorch operations: the
    # division correctly rounded, the product by keep rounded, then (FUSED) one fused
    # multiply-add
    layer = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    for i in tl.static_range(N):  # one branch per layer: a tuple takes constant indices only
        if layer == i:
            mask = offs < sizes[i]
            n = tl.load(counts[i] + offs * count_strides[i], mask=mask, other=1.0)
            m2 = tl.load(m2s[i] + offs, mask=mask, other=0.0)
            unbiased = tl.math.div_rn(m2, tl.maximum(n - 1.0, 1.0))
            mean = tl.load(means[i] + offs, mask=mask, other=0.0)
            _blend(run_means[i], offs, mask, mean, keeps[i], momenta[i], FUSED)
            _blend(run_vars[i], offs, mask, unbiased, keeps[i], momenta[i], FUSED)


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


def bn_running_updates_triton(updates: Sequence[RunningUpdate]) -> None:
    """`mpsnn.ops.batch_norm.bn_running_updates` with each layer's bits of
    `mpsnn.ops.batch_norm.bn_running_update_portable`: float32 (C,) tensors on one device,
    ``count`` (1,) or (C,). One launch per `_MAX_LAYERS` layers whose running tensors are
    distinct objects; a layer whose running tensors an earlier update in the list writes (a
    data source behind two layers) waits for the next launch (launches run in order on the
    stream)."""
    batch: list[RunningUpdate] = []
    written: set[int] = set()
    for u in updates:
        ids = (id(u.running[0]), id(u.running[1]))
        if len(batch) == _MAX_LAYERS or written.intersection(ids):
            _launch(batch)
            batch, written = [], set()
        batch.append(u)
        written.update(ids)
    _launch(batch)


def _launch(batch: Sequence[RunningUpdate]) -> None:
    if not batch:
        return
    c = max(u.mean.numel() for u in batch)
    _running_updates[(len(batch), cdiv(c, _BLOCK))](
        tuple(u.running[0] for u in batch), tuple(u.running[1] for u in batch),
        tuple(u.count for u in batch), tuple(u.mean for u in batch),
        tuple(u.m2 for u in batch), tuple(u.mean.numel() for u in batch),
        tuple(0 if u.count.numel() == 1 else 1 for u in batch),
        tuple(1.0 - u.momentum for u in batch), tuple(float(u.momentum) for u in batch),
        N=len(batch), FUSED=_RUNNING_FUSED, BLOCK=_BLOCK, enable_fp_fusion=False,
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
