"""Standard configurations against PyTorch, in float32, float16 and bfloat16 storage; fully
connected against a matrix product; the accumulator precision option."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.helpers import DEVICES, FORMATS, TOL, assert_close, run

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
STANDARD = [
    # (N, C, H, W, O, k, stride, dilation, groups)
    (2, 5, 9, 8, 7, 3, 1, 1, 1),
    (3, 6, 10, 11, 4, 3, 2, 1, 2),
    (2, 4, 8, 8, 4, 3, 1, 2, 4),
    (1, 3, 7, 9, 6, 5, 2, 1, 3),
    (2, 3, 6, 6, 5, 1, 1, 1, 1),
]


def _ids(c):
    n, ch, h, w, o, k, s, d, g = c
    return f"n{n}c{ch}h{h}w{w}_o{o}k{k}s{s}d{d}g{g}"


def _make(dev, c, dtype, gen):
    n, ch, h, w, o, k, s, d, g = c
    desc = m.ConvolutionDescriptor(k, k, ch, o, s, s, d, d, g)
    wt = torch.randn(desc.weights_shape, generator=gen) / (k * (ch // g)) ** 0.5
    b = torch.randn(o, generator=gen)
    ds = m.TensorConvolutionDataSource(desc, wt, b)
    x = torch.randn(n, ch, h, w, generator=gen).to(dtype)
    return ds, x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("c", STANDARD, ids=_ids)
def test_standard_case_matches_torch(c, dtype, device) -> None:
    gen = torch.Generator().manual_seed(11)
    dev = m.Device(device)
    ds, x = _make(dev, c, dtype, gen)
    *_, k, s, d, g = c
    pad = d * (k - 1) // 2  # SIZE_SAME, centred, odd kernel: PyTorch's symmetric padding
    conv, grad = m.Convolution(dev, ds), m.ConvolutionGradient(dev, ds)
    src = m.Image.from_tensor(x.to(device))
    cb = dev.new_command_queue().command_buffer()
    state = conv.result_state(src)
    y = conv.encode(cb, src, destination_state=state)
    gy = torch.randn(y.shape, generator=gen).to(dtype)
    dx = grad.encode(cb, m.Image.from_tensor(gy.to(device)), src, state)
    run(cb)
    assert (
        y.feature_channel_format is FORMATS[dtype] and dx.feature_channel_format is FORMATS[dtype]
    )

    # Reference in float64 from the values actually stored (weights in the compute dtype).
    w64 = ds.weights().permute(0, 3, 1, 2).to(dtype).double()
    b64 = ds.bias_terms().to(dtype).double()
    x64, g64 = x.double(), gy.double()
    kw = dict(stride=s, padding=pad, dilation=d, groups=g)
    assert_close(y.tensor, F.conv2d(x64, w64, b64, **kw), "forward", dtype=dtype)
    assert_close(
        dx.tensor,
        torch.nn.grad.conv2d_input(x64.shape, w64, g64, **kw),
        "data gradient",
        dtype=dtype,
    )
    want_w = torch.nn.grad.conv2d_weight(x64, w64.shape, g64, **kw).permute(0, 2, 3, 1)
    assert state.gradient_for_weights.dtype == torch.float32
    assert_close(state.gradient_for_weights, want_w, "weight gradient", dtype=dtype)
    assert_close(
        state.gradient_for_biases, g64.sum((0, 2, 3)), "bias gradient", tol=TOL[torch.float32]
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64], ids=str)
def test_fully_connected_is_a_matrix_product_with_ohwi_weights(dtype, device) -> None:
    gen = torch.Generator().manual_seed(12)
    dev = m.Device(device)
    n, c, h, w, o = 3, 4, 5, 6, 7
    desc = m.ConvolutionDescriptor(w, h, c, o)
    wt = torch.randn(o, h, w, c, generator=gen, dtype=torch.float64)
    b = torch.randn(o, generator=gen, dtype=torch.float64)
    ds = m.TensorConvolutionDataSource(desc, wt, b)
    fc, fcg = m.FullyConnected(dev, ds), m.FullyConnectedGradient(dev, ds)
    x = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64).to(dtype)
    src = m.Image.from_tensor(x.to(device))
    cb = dev.new_command_queue().command_buffer()
    state = fc.result_state(src)
    y = fc.encode(cb, src, destination_state=state)
    gy = torch.randn(n, o, 1, 1, generator=gen, dtype=torch.float64).to(dtype)
    dx = fcg.encode(cb, m.Image.from_tensor(gy.to(device)), src, state)
    run(cb)
    assert y.shape == (n, o, 1, 1)
    wq = wt.to(dtype).double() if dtype != torch.float64 else wt
    x_hwc = x.double().permute(0, 2, 3, 1).reshape(n, -1)  # MPS HWC order of each image
    w_mat = wq.reshape(o, -1)  # OHWI rows
    g2 = gy.double().reshape(n, o)
    assert_close(
        y.tensor.reshape(n, o), x_hwc @ w_mat.T + b.to(dtype).double(), "fc forward", dtype=dtype
    )
    assert_close(
        dx.tensor.permute(0, 2, 3, 1).reshape(n, -1), g2 @ w_mat, "fc data gradient", dtype=dtype
    )
    assert_close(
        state.gradient_for_weights.reshape(o, -1), g2.T @ x_hwc, "fc weight gradient", dtype=dtype
    )
    assert_close(state.gradient_for_biases, g2.sum(0), "fc bias gradient", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_fully_connected_math_returns_new_tensors_equal_to_linear(dtype) -> None:
    """`fc_forward` / `fc_backward` write F.linear's product (addmm, mm) into new tensors that an
    image adopts as its storage (no view, so no copy): the same bits as F.linear."""
    from mpsnn.ops.convolution import fc_backward, fc_forward

    gen = torch.Generator().manual_seed(14)
    for n, c, h, w, o, kh, kw in [(5, 16, 5, 5, 12, 5, 5), (4, 3, 6, 5, 4, 4, 3)]:
        x = torch.randn(n, c, h, w, generator=gen).to(dtype)
        wt = torch.randn(o, c, kh, kw, generator=gen).to(dtype)
        xin = x[:, :, :kh, :kw].reshape(n, -1)
        for b in (torch.randn(o, generator=gen).to(dtype), None):
            y = fc_forward(x, wt, b)
            assert y._base is None and y.shape == (n, o, 1, 1)
            assert torch.equal(y.view(n, o), F.linear(xin, wt.reshape(o, -1), b))
        g = torch.randn(n, o, 1, 1, generator=gen).to(dtype)
        dx = fc_backward(g, x, wt, need_weights=False)[0]
        want = F.pad(
            (g.reshape(n, o) @ wt.reshape(o, -1)).view(n, c, kh, kw), (0, w - kw, 0, h - kh)
        )
        assert dx._base is None and torch.equal(dx, want)


def test_fully_connected_reads_top_left_of_a_larger_source_and_writes_at_clip_origin() -> None:
    gen = torch.Generator().manual_seed(13)
    dev = m.Device("cpu")
    desc = m.ConvolutionDescriptor(2, 2, 3, 4)
    wt = torch.randn(4, 2, 2, 3, generator=gen, dtype=torch.float64)
    fc = m.FullyConnected(dev, m.TensorConvolutionDataSource(desc, wt))
    x = torch.randn(1, 3, 4, 5, generator=gen, dtype=torch.float64)
    dst = m.Image.from_tensor(torch.full((1, 6, 3, 3), 9.0, dtype=torch.float64))
    fc.clip_rect = m.Region.make(1, 2, 1, 1)
    fc.destination_feature_channel_offset = 2
    cb = dev.new_command_queue().command_buffer()
    fc.encode(cb, m.Image.from_tensor(x), dst)
    run(cb)
    want = torch.full((1, 6, 3, 3), 9.0, dtype=torch.float64)
    want[0, 2:6, 2, 1] = wt.reshape(4, -1) @ x[0, :, :2, :2].permute(1, 2, 0).reshape(-1)
    assert_close(dst.tensor, want, "fc into a clip rect", tol=1e-13)


def test_half_accumulator_option_rounds_through_float16() -> None:
    gen = torch.Generator().manual_seed(14)
    dev = m.Device("cpu")
    desc = m.ConvolutionDescriptor(3, 3, 8, 8)
    ds = m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape, generator=gen))
    conv = m.Convolution(dev, ds)
    x = m.Image.from_tensor(torch.randn(1, 8, 6, 6, generator=gen))
    cb = dev.new_command_queue().command_buffer()
    full = conv.encode(cb, x)
    conv.accumulator_precision_option = m.ConvolutionAccumulatorPrecisionOption.HALF
    half = conv.encode(cb, x)
    run(cb)
    assert full.feature_channel_format is m.FeatureChannelFormat.FLOAT32
    assert torch.equal(half.tensor, half.tensor.half().float())  # values representable in fp16
    assert not torch.equal(half.tensor, full.tensor)
    assert_close(half.tensor, full.tensor, "half vs float accumulation", tol=2e-3)


def test_groups_equal_concatenated_convolutions() -> None:
    """Metamorphic: a 2-group convolution equals two convolutions on channel halves."""
    gen = torch.Generator().manual_seed(15)
    dev = m.Device("cpu")
    wt = torch.randn(6, 3, 3, 2, generator=gen, dtype=torch.float64)
    b = torch.randn(6, generator=gen, dtype=torch.float64)
    grouped = m.Convolution(
        dev, m.TensorConvolutionDataSource(m.ConvolutionDescriptor(3, 3, 4, 6, groups=2), wt, b)
    )
    halves = []
    for i in range(2):
        k = m.Convolution(
            dev,
            m.TensorConvolutionDataSource(
                m.ConvolutionDescriptor(3, 3, 2, 3), wt[3 * i : 3 * i + 3], b[3 * i : 3 * i + 3]
            ),
        )
        k.source_feature_channel_offset = 2 * i
        k.source_feature_channel_max_count = 2
        k.destination_feature_channel_offset = 3 * i
        halves.append(k)
    x = m.Image.from_tensor(torch.randn(2, 4, 7, 7, generator=gen, dtype=torch.float64))
    cb = dev.new_command_queue().command_buffer()
    y = grouped.encode(cb, x)
    concat = m.Image(dev, m.ImageDescriptor(m.FeatureChannelFormat.FLOAT64, 7, 7, 6, 2))
    for k in halves:
        k.encode(cb, x, concat)
    run(cb)
    assert_close(concat.tensor, y.tensor, "groups vs concatenated halves", tol=1e-13)


def test_stride_two_equals_stride_one_subsampled() -> None:
    gen = torch.Generator().manual_seed(16)
    dev = m.Device("cpu")
    wt = torch.randn(3, 3, 3, 2, generator=gen, dtype=torch.float64)
    x = m.Image.from_tensor(torch.randn(1, 2, 9, 9, generator=gen, dtype=torch.float64))
    s1 = m.Convolution(dev, m.TensorConvolutionDataSource(m.ConvolutionDescriptor(3, 3, 2, 3), wt))
    s2 = m.Convolution(
        dev, m.TensorConvolutionDataSource(m.ConvolutionDescriptor(3, 3, 2, 3, 2, 2), wt)
    )
    s2.offset = m.Offset(0, 0, 0)
    s1.offset = m.Offset(0, 0, 0)
    cb = dev.new_command_queue().command_buffer()
    a = s1.encode(cb, x, m.Image(dev, m.ImageDescriptor(m.FeatureChannelFormat.FLOAT64, 9, 9, 3)))
    b = s2.encode(cb, x, m.Image(dev, m.ImageDescriptor(m.FeatureChannelFormat.FLOAT64, 5, 5, 3)))
    run(cb)
    assert_close(b.tensor, a.tensor[:, :, ::2, ::2], "stride 2 vs subsampled stride 1", tol=1e-13)
