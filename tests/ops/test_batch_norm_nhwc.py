"""The channels-last (NHWC) Triton batch-normalization passes against the portable path:
normalization and input gradient bit for bit, statistics and gradient sums up to summation
order; default and forced tiles (ragged in pixels and in channels); the dispatch."""

from __future__ import annotations

import pytest
import torch

from mpsnn.core.layout import channels_last_only
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.batch_norm import (
    bn_backward_portable,
    bn_forward_portable,
    bn_gradient_sums_portable,
    bn_statistics_portable,
    bn_variance,
)
from mpsnn.ops.batch_norm_params import BatchNormParams as P
from mpsnn.ops.batch_norm_params import BatchNormSums as S
from mpsnn.ops.neuron import NONE, RELU, NeuronParams
from mpsnn.ops.triton import batch_norm_nhwc as nhwc
from tests.helpers import TRITON_DEVICES, assert_close

CL = torch.channels_last
SHAPES = [(2, 3, 5, 7), (3, 70, 4, 4), (1, 5, 17, 3)]  # 70 channels: two channel blocks
# default tiles, then 4 pixels x 2 channels with 5 pixels per reduction program (ragged both ways)
TILES = [{}, dict(tile=(4, 2), rows=5)]
NEURONS = [None, NeuronParams(NONE, 0.0, 0.0, 0.0, None), NeuronParams(RELU, 0.0, 0.0, 0.0, None),
           NeuronParams(RELU, 0.2, 0.0, 0.0, None)]  # fmt: skip


def _inputs(shape, dtype, device, seed=21):
    n, c, h, w = shape
    gen = torch.Generator().manual_seed(seed)
    offset = torch.randn(1, c, 1, 1, generator=gen) * 3
    x = torch.randn(n, c, h, w, generator=gen) * (torch.rand(1, c, 1, 1, generator=gen) + 0.3)
    x = (x + offset).to(device=device, dtype=dtype).contiguous(memory_format=CL)
    g = torch.randn(n, c, h, w, generator=gen).to(device=device, dtype=dtype)
    gamma = (torch.randn(c, generator=gen) + 0.5).to(device)
    beta = torch.randn(c, generator=gen).to(device)
    assert channels_last_only(x)
    return x, g.contiguous(memory_format=CL), gamma, beta


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_nhwc_passes_equal_portable(shape, dtype, device) -> None:
    x, g, gamma, beta = _inputs(shape, dtype, device)
    count, mean, m2 = bn_statistics_portable(x)
    var = bn_variance(count, m2)
    eps = 1e-3
    for split in TILES:
        got = nhwc.nhwc_statistics(x, **split)
        assert torch.equal(got[0], count), split
        assert_close(got[1], mean, f"mean {split}", tol=1e-6)
        assert_close(got[2], m2, f"m2 {split}", tol=1e-5)
        tile = {k: v for k, v in split.items() if k == "tile"}
        for neuron in NEURONS:
            what = f"{neuron} {split}"
            p = P(mean, var, gamma, beta, eps, neuron)
            y = nhwc.nhwc_forward(x, p, **tile)
            want_y = bn_forward_portable(x, p)
            assert y.dtype == dtype and torch.equal(y, want_y), f"y {what}"
            assert channels_last_only(y), "the result keeps the channels-last layout"
            sums = nhwc.nhwc_gradient_sums(g, x, p, **split)
            want = bn_gradient_sums_portable(g, x, p)
            assert_close(sums[0], want[0], f"sum_gy {what}", tol=1e-5)
            assert_close(sums[1], want[1], f"sum_gy_xhat {what}", tol=1e-5)
            args = (p, S(*want, count))
            dx = nhwc.nhwc_backward(g, x, *args, **tile)
            assert torch.equal(dx, bn_backward_portable(g, x, *args)), f"dx {what}"
            # an NCHW gradient of a channels-last source is read in the source's layout
            dx2 = nhwc.nhwc_backward(g.contiguous(), x, *args, **tile)
            assert torch.equal(dx2, dx)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fast paths run on CUDA only")
def test_dispatch_sends_channels_last_sources_to_the_nhwc_passes() -> None:
    x, g, gamma, beta = _inputs((2, 4, 3, 3), torch.float32, "cuda")
    assert not channels_last_only(x.contiguous()) and not channels_last_only(
        torch.zeros(2, 4, 1, 1)
    )
    assert fast_paths.batch_norm_eligible(x)
    count, mean, m2 = fast_paths.batch_norm_statistics(x)
    var = bn_variance(count, m2)
    p = P(mean, var, gamma, beta, 1e-3)
    y = fast_paths.batch_norm_forward(x, p)
    assert channels_last_only(y)
    assert torch.equal(y, bn_forward_portable(x.contiguous(), p))
    sums = fast_paths.batch_norm_gradient_sums(g, x, p)
    dx = fast_paths.batch_norm_backward(g, x, p, S(*sums, count))
    assert channels_last_only(dx)
    want = bn_backward_portable(g, x, p, S(*sums, count))
    assert torch.equal(dx, want)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_nhwc_channel_sums_equal_torch(shape, device) -> None:
    """A convolution's bias gradient from a channels-last incoming gradient."""
    _, g, _, _ = _inputs(shape, torch.bfloat16, device)
    want = g.sum((0, 2, 3), dtype=torch.float32)
    for split in TILES:
        got = nhwc.nhwc_channel_sums(g, **split)
        assert got.dtype == torch.float32 and got.shape == (shape[1],)
        assert_close(got, want, f"channel sums {split}", tol=1e-5)
    if device == "cuda":  # the dispatch: channels-last CUDA tensors only
        assert_close(fast_paths.channel_sums(g), want, "dispatched", tol=1e-5)
        assert fast_paths.channel_sums(g.contiguous()) is None


# the default plan, and one program per channel block with lanes of 32 samples
FAR_SPLITS = [{}, dict(tile=(32, 4), rows=1024)]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("split", FAR_SPLITS, ids=str)
def test_nhwc_statistics_far_from_zero_with_an_outlier_first(split, device) -> None:
    # Each lane's running triple is of the values shifted by the channel's first sample: a
    # first sample 100 standard deviations out, on a large common offset, must not cost the
    # variance its digits. Per-lane sums and sums of squares about that shift (float32) come
    # to about 2.5e-5 relative error here, a single sum of squares to about 1e-4
    gen = torch.Generator().manual_seed(5)
    n, c, h, w = 4, 3, 16, 16
    x = 1e4 + torch.randn(n, c, h, w, generator=gen, dtype=torch.float64)
    x[0, :, 0, 0] += 100.0
    x32 = x.float()
    ref = x32.double()
    var = ref.var((0, 2, 3), unbiased=False)
    xd = x32.to(device).contiguous(memory_format=CL)
    count, mean, m2, v = nhwc.nhwc_statistics(xd, variance=True, **split)
    assert float(count) == n * h * w
    assert_close(mean.double().cpu(), ref.mean((0, 2, 3)), "mean", tol=1e-7)
    for name, got in (("variance", v), ("m2 / count", m2 / count)):
        rel = ((got.double().cpu() - var) / var).abs().max().item()
        assert rel < 4e-6, f"{name} relative error {rel}"


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("split", TILES, ids=str)
def test_nhwc_statistics_of_nan_and_inf(split, device) -> None:
    """A channel holding a NaN: NaN mean and variance, as on the portable path (the combine's
    clamp of a tiny negative m2 to 0 keeps a NaN). A channel holding +inf: a NaN or +inf
    mean (the portable path gives +inf; the lanes' updates make inf - inf) and a NaN
    variance: never a finite value. A clean channel: the portable statistics."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 3, 5, 7, generator=gen)
    x[1, 0, 2, 3] = float("nan")
    x[0, 1, 4, 6] = float("inf")
    xd = x.to(device).contiguous(memory_format=CL)
    count, mean, m2, var = nhwc.nhwc_statistics(xd, variance=True, **split)
    p_count, p_mean, p_m2 = bn_statistics_portable(xd)
    p_var = bn_variance(p_count, p_m2)
    assert torch.equal(count, p_count) and torch.isnan(m2[0])
    assert torch.isnan(mean[0]) and torch.isnan(var[0]) and torch.isnan(p_var[0])
    assert not torch.isfinite(mean[1]) and torch.isnan(var[1])
    assert torch.isinf(p_mean[1]) and torch.isnan(p_var[1])
    assert torch.allclose(mean[2:], p_mean[2:], rtol=1e-5, atol=1e-6), (mean, p_mean)
    assert torch.allclose(var[2:], p_var[2:], rtol=1e-5, atol=1e-6), (var, p_var)


def test_channels_of_2_to_the_30_pixels_take_the_portable_path(monkeypatch) -> None:
    # the channels-last passes count a channel's pixels in 32-bit integers
    monkeypatch.setattr(fast_paths, "_runs", lambda *ts: True)  # the check, on any device
    one = torch.zeros(1)
    big = one.expand(1, 2, 1 << 15, 1 << 15)  # no memory
    assert not fast_paths.batch_norm_eligible(big)
    assert fast_paths.batch_norm_eligible(one.expand(1, 2, 1 << 15, (1 << 15) - 1))
