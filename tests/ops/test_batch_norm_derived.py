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
    bn_running_updates,
    bn_statistics_and_variance,
    bn_statistics_portable,
    bn_variance,
)
from mpsnn.ops.batch_norm_params import RunningUpdate
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


def _single(u: RunningUpdate) -> tuple[torch.Tensor, torch.Tensor]:
    """``u`` applied to copies of its running tensors by the portable operations."""
    want = (u.running[0].clone(), u.running[1].clone())
    bn_running_update_portable(want, u.count, u.mean, u.m2, u.momentum)
    return want


def _assert_rounded_alike(got, want, device) -> None:
    if device == "cuda":  # compiled: the same roundings, fused multiply-add included
        assert torch.equal(got, want)
    else:  # the interpreter rounds the multiply-add twice: within an ulp
        torch.testing.assert_close(got, want, rtol=2e-7, atol=1e-7)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("per_channel_count", [False, True], ids=["count1", "countC"])
@pytest.mark.parametrize("c", [1, 64, 1500])
def test_running_update_kernel_equals_the_portable_operations(c, per_channel_count, device):
    mu, var, count, mean, m2 = _running_inputs(c, device, per_channel_count)
    if per_channel_count:
        count[0] = 1.0  # a single sample: the unbiased divisor clamps to 1
    got = (mu.clone(), var.clone())
    want = _single(RunningUpdate(got, count, mean, m2, 0.1))
    triton_stats.bn_running_updates_triton([RunningUpdate(got, count, mean, m2, 0.1)])
    _assert_rounded_alike(got[0], want[0], device)
    _assert_rounded_alike(got[1], want[1], device)
    # the math itself, in float64: (1 - m) run + m batch, unbiased variance
    n = count.double().clamp(min=2) - 1 if per_channel_count else count.double() - 1
    exact_var = 0.9 * var.double() + 0.1 * m2.double() / n
    torch.testing.assert_close(got[1].double(), exact_var, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[0].double(), 0.9 * mu.double() + 0.1 * mean.double(),
                               rtol=1e-6, atol=1e-6)  # fmt: skip


def _network_updates(device, layers=5, seed=11):
    """Running updates of ``layers`` layers of varied widths (one wider than a program's
    block), counts (1 or per channel) and momenta."""
    widths = [1, 64, 1500, 3, 512, 7, 33]
    out = []
    for i in range(layers):
        c = widths[i % len(widths)]
        mu, var, count, mean, m2 = _running_inputs(c, device, i % 2 == 1, seed=seed + i)
        out.append(RunningUpdate((mu, var), count, mean, m2, (0.1, 0.5, 1.0, 0.0)[i % 4]))
    return out


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_one_launch_updates_every_layer_as_its_own_update_would(device, monkeypatch) -> None:
    updates = _network_updates(device)
    want = [_single(u) for u in updates]
    launches = []
    real = triton_stats._launch
    monkeypatch.setattr(triton_stats, "_launch", lambda b: (launches.append(len(b)), real(b)))
    triton_stats.bn_running_updates_triton(updates)
    assert launches == [5]
    for u, w in zip(updates, want, strict=True):
        _assert_rounded_alike(u.running[0], w[0], device)
        _assert_rounded_alike(u.running[1], w[1], device)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_a_layer_listed_twice_blends_twice_in_list_order(device, monkeypatch) -> None:
    a, b, c = _network_updates(device, layers=3)
    again = RunningUpdate(a.running, b.count[:1], a.mean, a.m2 * 2, 0.3)  # a's tensors again
    updates = [a, b, again, c]
    # what one update after the other gives (the portable operations)
    want = [(u.running[0].clone(), u.running[1].clone()) for u in (a, b, c)]
    for u in updates:
        dst = want[[a, b, c].index(u)] if u is not again else want[0]
        bn_running_update_portable(dst, u.count, u.mean, u.m2, u.momentum)
    launches = []
    real = triton_stats._launch
    monkeypatch.setattr(triton_stats, "_launch", lambda b: (launches.append(len(b)), real(b)))
    triton_stats.bn_running_updates_triton(updates)
    assert launches == [2, 2]  # the second blend of a's tensors waits for the first
    for u, w in zip((a, b, c), want, strict=True):
        _assert_rounded_alike(u.running[0], w[0], device)
        _assert_rounded_alike(u.running[1], w[1], device)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_more_layers_than_one_launch_takes(device, monkeypatch) -> None:
    updates = _network_updates(device, layers=triton_stats._MAX_LAYERS + 3)
    want = [_single(u) for u in updates]
    launches = []
    real = triton_stats._launch
    monkeypatch.setattr(triton_stats, "_launch", lambda b: (launches.append(len(b)), real(b)))
    triton_stats.bn_running_updates_triton(updates)
    assert launches == [triton_stats._MAX_LAYERS, 3]
    for u, w in zip(updates, want, strict=True):
        _assert_rounded_alike(u.running[1], w[1], device)


@pytest.mark.skipif(not CUDA, reason="the fast paths run on CUDA only")
def test_running_update_dispatch() -> None:
    mu, var, count, mean, m2 = _running_inputs(8, "cuda", False)
    good = RunningUpdate((mu, var), count, mean, m2, 0.5)
    assert fast_paths.batch_norm_running_updates([good])
    # float64 (a verification run), a non-contiguous vector, another device, a count of
    # another length: the portable path for all of them, with nothing run
    d = [t.double() for t in (mu, var, count, mean, m2)]
    strided = torch.zeros(16, device="cuda")[::2]
    for bad in (
        RunningUpdate((d[0], d[1]), d[2], d[3], d[4], 0.5),
        RunningUpdate((strided, var), count, mean, m2, 0.5),
        RunningUpdate((mu, var), count.cpu(), mean, m2, 0.5),
        RunningUpdate((mu, var), torch.ones(3, device="cuda"), mean, m2, 0.5),
    ):
        before = (mu.clone(), var.clone())
        assert not fast_paths.batch_norm_running_updates([good, bad])
        assert torch.equal(mu, before[0]) and torch.equal(var, before[1])


def test_running_update_cpu_is_the_portable_path() -> None:
    mu, var, count, mean, m2 = _running_inputs(6, "cpu", True)
    u = RunningUpdate((mu, var), count, mean, m2, 0.3)
    assert not fast_paths.batch_norm_running_updates([u])
    want = _single(u)
    bn_running_update((mu, var), count, mean, m2, 0.3)
    assert torch.equal(mu, want[0]) and torch.equal(var, want[1])
    # several, one listed twice: one after the other
    other = _network_updates("cpu", layers=2)
    twice = [other[0], other[1], other[0]]
    want = [(t.running[0].clone(), t.running[1].clone()) for t in other]
    for i in (0, 1, 0):
        bn_running_update_portable(want[i], other[i].count, other[i].mean, other[i].m2,
                                   other[i].momentum)  # fmt: skip
    bn_running_updates(twice)
    for t, w in zip(other, want, strict=True):
        assert torch.equal(t.running[0], w[0]) and torch.equal(t.running[1], w[1])


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
