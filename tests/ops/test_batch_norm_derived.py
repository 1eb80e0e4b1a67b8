"""Batch-normalization values written by the work that makes their inputs: the statistics'
biased variance, written by the kernel that combines the statistics, the running statistics'
update in one launch, and the merge of statistics gathered from several processes in one
launch; against the portable PyTorch operations (bit for bit where they round alike: compiled
on CUDA for the running update's fused multiply-add) and float64 references."""

from __future__ import annotations

import pytest
import torch

from mpsnn.distributed.collectives import _adjacent
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.batch_norm import (
    bn_merge_all,
    bn_merge_rows,
    bn_running_update,
    bn_running_update_portable,
    bn_statistics_and_variance,
    bn_statistics_portable,
    bn_variance,
)
from mpsnn.ops.triton import batch_norm as triton_bn
from mpsnn.ops.triton import batch_norm_nhwc as nhwc
from mpsnn.ops.triton import batch_norm_vectors as triton_stats
from tests.helpers import TRITON_DEVICES

CUDA = torch.cuda.is_available()


def _source(shape, dtype, device, channels_last, seed=3):
    gen = torch.Generator().manual_seed(seed)
    n, c, h, w = shape
    x = torch.randn(n, c, h, w, generator=gen) * (torch.rand(1, c, 1, 1, generator=gen) + 0.2)
    x = (x + torch.randn(1, c, 1, 1, generator=gen) * 4).to(device=device, dtype=dtype)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("shape", [(3, 5, 4, 6), (2, 70, 3, 3), (1, 1, 1, 1)], ids=str)
def test_statistics_kernel_writes_the_variance_of_its_results(shape, channels_last, device):
    x = _source(shape, torch.float32, device, channels_last)
    if channels_last and shape[1] > 1:
        got = nhwc.nhwc_statistics(x, variance=True)
    else:
        got = triton_bn.bn_statistics_triton(x, variance=True)
    count, mean, m2, var = got
    # the variance of the very (count, m2) the kernel wrote, rounded once: bn_variance's bits
    assert torch.equal(var, bn_variance(count, m2))
    assert var.shape == mean.shape == (shape[1],)
    # one buffer, in this order: what a data-parallel exchange reads in place
    assert _adjacent([count, mean, m2, var]) is not None
    # without the flag: the triple alone, the same values
    plain = triton_bn.bn_statistics_triton(x.contiguous())
    assert len(plain) == 3 and torch.equal(plain[0], count)
    torch.testing.assert_close(plain[1], mean, rtol=1e-6, atol=1e-6)


def test_statistics_and_variance_portable_path_for_float64() -> None:
    x = _source((2, 3, 4, 5), torch.float64, "cpu", False)
    count, mean, m2, var = bn_statistics_and_variance(x)
    want = bn_statistics_portable(x)
    assert all(torch.equal(a, b) for a, b in zip((count, mean, m2), want, strict=True))
    assert var.dtype == torch.float64 and torch.equal(var, bn_variance(count, m2))


def _running_inputs(c, device, per_channel_count, seed=5):
    gen = torch.Generator().manual_seed(seed)
    mu = torch.randn(c, generator=gen)
    var = torch.rand(c, generator=gen) + 0.5
    mean = torch.randn(c, generator=gen) * 3
    m2 = torch.rand(c, generator=gen) * 40
    count = torch.randint(1, 9, (c,), generator=gen).float() if per_channel_count else (
        torch.tensor([7.0]))  # fmt: skip
    return [t.to(device) for t in (mu, var, count, mean, m2)]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("per_channel_count", [False, True], ids=["count1", "countC"])
@pytest.mark.parametrize("c", [1, 64, 1500])
def test_running_update_kernel_equals_the_portable_operations(c, per_channel_count, device):
    mu, var, count, mean, m2 = _running_inputs(c, device, per_channel_count)
    if per_channel_count:
        count[0] = 1.0  # a single sample: the unbiased divisor clamps to 1
    want = (mu.clone(), var.clone())
    bn_running_update_portable(want, count, mean, m2, 0.1)
    got = (mu.clone(), var.clone())
    triton_stats.bn_running_update_triton(got, count, mean, m2, 0.1)
    if device == "cuda":  # compiled: the same roundings, fused multiply-add included
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    else:  # the interpreter rounds the multiply-add twice: within an ulp
        torch.testing.assert_close(got[0], want[0], rtol=2e-7, atol=1e-7)
        torch.testing.assert_close(got[1], want[1], rtol=2e-7, atol=1e-7)
    # the math itself, in float64: (1 - m) run + m batch, unbiased variance
    n = count.double().clamp(min=2) - 1 if per_channel_count else count.double() - 1
    exact_var = 0.9 * var.double() + 0.1 * m2.double() / n
    torch.testing.assert_close(got[1].double(), exact_var, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[0].double(), 0.9 * mu.double() + 0.1 * mean.double(),
                               rtol=1e-6, atol=1e-6)  # fmt: skip


@pytest.mark.skipif(not CUDA, reason="the fast paths run on CUDA only")
def test_running_update_dispatch() -> None:
    mu, var, count, mean, m2 = _running_inputs(8, "cuda", False)
    assert fast_paths.batch_norm_running_update((mu, var), count, mean, m2, 0.5)
    # float64 (a verification run) and non-contiguous vectors take the portable path
    d = [t.double() for t in (mu, var, count, mean, m2)]
    assert not fast_paths.batch_norm_running_update((d[0], d[1]), d[2], d[3], d[4], 0.5)
    strided = torch.zeros(16, device="cuda")[::2]
    assert not fast_paths.batch_norm_running_update((strided, var), count, mean, m2, 0.5)


def test_running_update_cpu_is_the_portable_path() -> None:
    mu, var, count, mean, m2 = _running_inputs(6, "cpu", True)
    assert not fast_paths.batch_norm_running_update((mu, var), count, mean, m2, 0.3)
    got, want = (mu.clone(), var.clone()), (mu.clone(), var.clone())
    bn_running_update(got, count, mean, m2, 0.3)
    bn_running_update_portable(want, count, mean, m2, 0.3)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _gathered(w, c, per_channel_count, device, seed=9):
    """W processes' packed ``[count, mean, m2]`` rows (the last one empty, its mean and m2
    NaN: they must not count), with data far from 0."""
    gen = torch.Generator().manual_seed(seed)
    k = c if per_channel_count else 1
    count = torch.randint(1, 50, (w, k), generator=gen).float()
    mean = torch.randn(w, c, generator=gen) + 100.0
    m2 = torch.rand(w, c, generator=gen) * count.expand(w, c) * 2
    count[-1] = 0.0
    mean[-1] = m2[-1] = float("nan")
    return torch.cat([count, mean, m2], dim=1).to(device), k


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("per_channel_count", [False, True], ids=["count1", "countC"])
@pytest.mark.parametrize("w,c", [(2, 3), (4, 1100)])
def test_merge_of_gathered_rows_kernel(w, c, per_channel_count, device) -> None:
    rows, k = _gathered(w, c, per_channel_count, device)
    into = (torch.empty(k, device=device), torch.empty(c, device=device),
            torch.empty(c, device=device))  # fmt: skip
    var = triton_stats.bn_merge_rows_triton(rows, into)
    d = rows.double()
    n, mean, m2 = bn_merge_all(d[:, :k], d[:, k : k + c], d[:, k + c :])  # float64 reference
    assert torch.equal(into[0], n[:k].float())
    torch.testing.assert_close(into[1].double(), mean, rtol=1e-6, atol=0)
    torch.testing.assert_close(into[2].double(), m2, rtol=1e-5, atol=1e-6)
    assert torch.equal(var, bn_variance(into[0], into[2]))  # the division's bits
    # into a given variance storage
    given = torch.full((c,), -1.0, device=device)
    assert triton_stats.bn_merge_rows_triton(rows, into, given) is given
    assert torch.equal(given, var)


def test_merge_rows_portable_path_equals_the_closed_form_and_checks_shapes() -> None:
    rows, _ = _gathered(3, 4, False, "cpu")
    into = (torch.empty(1), torch.empty(4), torch.empty(4))
    var = torch.empty(4)
    assert bn_merge_rows(rows, into, var) is var
    n, mean, m2 = bn_merge_all(rows[:, :1], rows[:, 1:5], rows[:, 5:])
    assert torch.equal(into[0], n[:1]) and torch.equal(into[1], mean)
    assert torch.equal(into[2], m2) and torch.equal(var, bn_variance(n[:1], m2))
    with pytest.raises(ValueError, match=r"\[bn_merge_rows\] rows must be \(W, k \+ 2C\)"):
        bn_merge_rows(rows[:, :-1], into)
    with pytest.raises(ValueError, match=r"\[bn_merge_rows\] into must be \(count, mean, m2\)"):
        bn_merge_rows(rows, into[:2])
    # a count of neither 1 nor C elements, an m2 of another length: refused before any write
    bad = r"\[bn_merge_rows\] into must be \(count \(1 or C\), mean \(C,\), m2 \(C,\)\)"
    wide_rows = torch.zeros(3, 2 + 2 * 3)
    with pytest.raises(ValueError, match=bad):
        bn_merge_rows(wide_rows, (torch.empty(2), torch.empty(3), torch.empty(3)))
    with pytest.raises(ValueError, match=bad):
        bn_merge_rows(rows, (torch.empty(1), torch.empty(4), torch.empty(3)))


@pytest.mark.skipif(not CUDA, reason="the fast paths run on CUDA only")
def test_merge_rows_dispatch() -> None:
    rows, _ = _gathered(2, 8, True, "cuda")
    into = tuple(torch.empty(n, device="cuda") for n in (8, 8, 8))
    assert fast_paths.batch_norm_merge_rows(rows, into) is not None
    assert fast_paths.batch_norm_merge_rows(rows.double(), into) is None  # float64: portable
    assert fast_paths.batch_norm_merge_rows(rows.cpu(), tuple(t.cpu() for t in into)) is None
