"""Convolution on random MPS geometry: forward vs the loop-level window model, and the float64
adjoint test of every gradient (data, weights, bias), on every device."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mpsnn as m
from tests import reference
from tests.cnn.conv_cases import CASES, ConvCase, numpy_of
from tests.helpers import DEVICES, assert_adjoint, assert_close, run


def _kernel(
    dev: m.Device, case: ConvCase, w: torch.Tensor, b: torch.Tensor | None
) -> m.Convolution:
    conv = m.Convolution(dev, m.TensorConvolutionDataSource(case.descriptor(), w, b))
    case.configure(conv)
    return conv


def _forward(dev, case, x, w, b, dst0, state=None) -> torch.Tensor:
    conv = _kernel(dev, case, w, b)
    dst = m.Image.from_tensor(dst0.clone())
    cb = dev.new_command_queue().command_buffer()
    conv.encode(cb, m.Image.from_tensor(x), dst, state)
    run(cb)
    return dst.tensor


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_matches_window_model(case: ConvCase, device: str) -> None:
    gen = torch.Generator().manual_seed(hash(str(case)) % 2**31)
    dev = m.Device(device)
    x = torch.randn(case.src, generator=gen, dtype=torch.float64)
    dst0 = torch.randn(case.dst, generator=gen, dtype=torch.float64)
    w, b = case.weights(gen)
    got = _forward(dev, case, x.to(device), w, b, dst0.to(device))
    want = reference.convolution(
        numpy_of(x),
        numpy_of(w),
        None if b is None else numpy_of(b),
        numpy_of(dst0),
        **case.reference_kwargs(),
    )
    assert_close(got, want, "destination (written and untouched pixels)", tol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES[:24], ids=str)
def test_gradients_are_adjoint(case: ConvCase, device: str) -> None:
    gen = torch.Generator().manual_seed(1 + hash(str(case)) % 2**31)
    dev = m.Device(device)
    x = torch.randn(case.src, generator=gen, dtype=torch.float64).to(device)
    dst0 = torch.randn(case.dst, generator=gen, dtype=torch.float64).to(device)
    w, b = case.weights(gen)
    if b is None:
        b = torch.zeros(case.cout, dtype=torch.float64)
    v = torch.randn(case.src, generator=gen, dtype=torch.float64).to(device)
    cot = torch.randn(case.dst, generator=gen, dtype=torch.float64).to(device)
    vw = torch.randn(w.shape, generator=gen, dtype=torch.float64)
    vb = torch.randn(b.shape, generator=gen, dtype=torch.float64)

    # J v by central differences: exact here, the map is affine in x, W and b.
    jv_x = (_forward(dev, case, x + v, w, b, dst0) - _forward(dev, case, x - v, w, b, dst0)) / 2
    jv_w = (_forward(dev, case, x, w + vw, b, dst0) - _forward(dev, case, x, w - vw, b, dst0)) / 2
    jv_b = (_forward(dev, case, x, w, b + vb, dst0) - _forward(dev, case, x, w, b - vb, dst0)) / 2

    conv = _kernel(dev, case, w, b)
    grad = m.ConvolutionGradient(dev, conv.data_source)
    cb = dev.new_command_queue().command_buffer()
    state = conv.result_state(m.Image.from_tensor(x))
    conv.encode(cb, m.Image.from_tensor(x), m.Image.from_tensor(dst0.clone()), state)
    dx = grad.encode(cb, m.Image.from_tensor(cot), m.Image.from_tensor(x), state)
    run(cb)
    assert dx.shape == tuple(case.src)
    assert_adjoint(jv_x, cot, v, dx.tensor, f"data gradient of {case}")
    assert_adjoint(jv_w, cot, vw, state.gradient_for_weights, f"weight gradient of {case}")
    assert_adjoint(jv_b, cot, vb, state.gradient_for_biases, f"bias gradient of {case}")


@pytest.mark.parametrize("case", CASES[:8], ids=str)
def test_returning_encode_uses_policy_offset(case: ConvCase) -> None:
    """A returning encode sizes the result by the policy, sets offset, and computes the window
    model with that offset over the whole result."""
    gen = torch.Generator().manual_seed(7)
    dev = m.Device("cpu")
    _, _, h, wd = case.src
    x = torch.randn((1, case.cin, h, wd), generator=gen, dtype=torch.float64)
    w, b = case.weights(gen)
    conv = m.Convolution(dev, m.TensorConvolutionDataSource(case.descriptor(), w, b))
    conv.edge_mode = m.EdgeMode(case.edge)
    cb = dev.new_command_queue().command_buffer()
    out = conv.encode(cb, m.Image.from_tensor(x))
    run(cb)
    off = conv.offset
    want = reference.convolution(
        numpy_of(x),
        numpy_of(w),
        None if b is None else numpy_of(b),
        np.zeros(out.shape),
        offset=(off.x, off.y, 0),
        clip=(0, 0, 0, 1 << 20, 1 << 20, 1 << 20),
        sco=0,
        smax=1 << 40,
        dco=0,
        edge=case.edge,
        stride=case.stride,
        dilation=case.dilation,
        groups=case.groups,
    )
    assert_close(out.tensor, want, "returning encode", tol=1e-12)


def test_batch_equals_per_image_and_shared_state_sums() -> None:
    gen = torch.Generator().manual_seed(3)
    dev = m.Device("cpu")
    desc = m.ConvolutionDescriptor(3, 2, 3, 4, 2, 1, 1, 2)
    w = torch.randn(desc.weights_shape, generator=gen, dtype=torch.float64)
    b = torch.randn(4, generator=gen, dtype=torch.float64)
    ds = m.TensorConvolutionDataSource(desc, w, b)
    conv, grad = m.Convolution(dev, ds), m.ConvolutionGradient(dev, ds)
    x = torch.randn(4, 3, 7, 6, generator=gen, dtype=torch.float64)
    batch = m.ImageBatch.from_tensor(x)
    q = dev.new_command_queue()
    cb = q.command_buffer()
    states = conv.result_state_batch(batch)
    assert conv.is_result_state_reused_across_batch and len(set(map(id, states))) == 1
    out = conv.encode_batch(cb, batch, destination_states=states)
    run(cb)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    cb = q.command_buffer()
    dxb = grad.encode_batch(cb, m.ImageBatch.from_tensor(g), batch, states)
    run(cb)
    # per image, with one shared state written by four encodes: sums equal the batch's
    shared = conv.result_state(batch[0])
    for i in range(4):
        cb = q.command_buffer()
        yi = conv.encode(cb, batch[i], destination_state=shared)
        dxi = grad.encode(cb, m.Image.from_tensor(g[i : i + 1]), batch[i], shared)
        run(cb)
        assert_close(yi.tensor, out[i].tensor, f"image {i} forward", tol=1e-13)
        assert_close(dxi.tensor, dxb[i].tensor, f"image {i} data gradient", tol=1e-13)
    assert_close(
        shared.gradient_for_weights, states[0].gradient_for_weights, "summed dW", tol=1e-13
    )
    assert_close(shared.gradient_for_biases, states[0].gradient_for_biases, "summed db", tol=1e-13)


def test_distinct_states_per_image_each_sum_their_images() -> None:
    gen = torch.Generator().manual_seed(4)
    dev = m.Device("cpu")
    desc = m.ConvolutionDescriptor(3, 3, 2, 3)
    ds = m.TensorConvolutionDataSource(
        desc, torch.randn(desc.weights_shape, generator=gen, dtype=torch.float64)
    )
    conv, grad = m.Convolution(dev, ds), m.ConvolutionGradient(dev, ds)
    x = m.ImageBatch.from_tensor(torch.randn(3, 2, 5, 5, generator=gen, dtype=torch.float64))
    s0, s1 = conv.result_state(x[0]), conv.result_state(x[0])
    states = m.StateBatch([s0, s1, s0])
    cb = dev.new_command_queue().command_buffer()
    y = conv.encode_batch(cb, x, destination_states=states)
    g = torch.randn(3, 3, 5, 5, generator=gen, dtype=torch.float64)
    grad.encode_batch(cb, m.ImageBatch.from_tensor(g), x, states)
    run(cb)
    assert y.shape == (3, 3, 5, 5)
    for state, idx in ((s0, [0, 2]), (s1, [1])):
        xs = x.tensor[idx]
        want = torch.nn.grad.conv2d_weight(xs, (3, 2, 3, 3), g[idx], padding=1)
        assert_close(
            state.gradient_for_weights, want.permute(0, 2, 3, 1), f"dW of images {idx}", tol=1e-12
        )
        assert_close(
            state.gradient_for_biases, g[idx].sum((0, 2, 3)), f"db of images {idx}", tol=1e-12
        )


def test_gradient_option_selects_what_is_computed() -> None:
    gen = torch.Generator().manual_seed(5)
    dev = m.Device("cpu")
    desc = m.ConvolutionDescriptor(3, 3, 2, 2)
    ds = m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape, generator=gen))
    conv, grad = m.Convolution(dev, ds), m.ConvolutionGradient(dev, ds)
    x = m.Image.from_tensor(torch.randn(1, 2, 4, 4, generator=gen))
    g = m.Image.from_tensor(torch.randn(1, 2, 4, 4, generator=gen))
    for option, data, weights in (
        (m.ConvolutionGradientOption.GRADIENT_WITH_DATA, True, False),
        (m.ConvolutionGradientOption.GRADIENT_WITH_WEIGHTS_AND_BIAS, False, True),
        (m.ConvolutionGradientOption.ALL, True, True),
    ):
        grad.gradient_option = option
        cb = dev.new_command_queue().command_buffer()
        state = conv.result_state(x)
        conv.encode(cb, x, destination_state=state)
        dx = grad.encode(cb, g, x, state)
        run(cb)
        assert (dx is not None) == data
        assert bool(state.gradient_for_weights.abs().sum() > 0) == weights
        assert bool(state.gradient_for_biases.abs().sum() > 0) == weights


def test_clamp_gradient_sums_onto_edge_pixels() -> None:
    """1x3 kernel of ones on a 1x2 image with CLAMP: reads x[-1]->x0 and x[2]->x1."""
    dev = m.Device("cpu")
    desc = m.ConvolutionDescriptor(3, 1, 1, 1)
    ds = m.TensorConvolutionDataSource(desc, torch.ones(1, 1, 3, 1, dtype=torch.float64))
    conv, grad = m.Convolution(dev, ds), m.ConvolutionGradient(dev, ds)
    conv.edge_mode = m.EdgeMode.CLAMP
    x = m.Image.from_tensor(torch.tensor([[[[1.0, 10.0]]]], dtype=torch.float64))
    cb = dev.new_command_queue().command_buffer()
    state = conv.result_state(x)
    y = conv.encode(cb, x, destination_state=state)
    dx = grad.encode(
        cb, m.Image.from_tensor(torch.tensor([[[[1.0, 100.0]]]], dtype=torch.float64)), x, state
    )
    run(cb)
    assert y.tensor.flatten().tolist() == [12.0, 21.0]  # 1+1+10, 1+10+10
    # dx0 = g0*(1 + 1) + g1*1 = 102 ; dx1 = g0*1 + g1*(1 + 1) = 201
    assert dx.tensor.flatten().tolist() == [102.0, 201.0]


def test_gradient_channels_not_read_are_zero_and_geometry_is_reported() -> None:
    gen = torch.Generator().manual_seed(6)
    dev = m.Device("cpu")
    desc = m.ConvolutionDescriptor(3, 3, 2, 3, 2, 2)
    ds = m.TensorConvolutionDataSource(
        desc, torch.randn(desc.weights_shape, generator=gen, dtype=torch.float64)
    )
    conv, grad = m.Convolution(dev, ds), m.ConvolutionGradient(dev, ds)
    conv.source_feature_channel_offset = 1
    conv.source_feature_channel_max_count = 2
    x = m.Image.from_tensor(torch.randn(1, 4, 7, 7, generator=gen, dtype=torch.float64))
    cb = dev.new_command_queue().command_buffer()
    state = conv.result_state(x)
    y = conv.encode(cb, x, destination_state=state)
    desc_g = grad.destination_image_descriptor([y, x], [state])
    dx = grad.encode(
        cb, m.Image.from_tensor(torch.randn(y.shape, generator=gen, dtype=torch.float64)), x, state
    )
    run(cb)
    assert desc_g.shape == x.shape
    assert dx.tensor[:, [0, 3]].abs().max() == 0
    assert dx.tensor[:, 1:3].abs().max() > 0
    assert grad.secondary_offset == conv.offset
    assert grad.secondary_stride_in_pixels_x == 2
    assert grad.secondary_kernel_width == 3
    assert grad.secondary_source_feature_channel_offset == 1
    assert grad.kernel_offset_x == -conv.offset.x  # E = 3 is odd: -o + 0


def test_gradient_clip_rect_limits_written_pixels() -> None:
    gen = torch.Generator().manual_seed(8)
    dev = m.Device("cpu")
    desc = m.ConvolutionDescriptor(3, 3, 1, 1)
    ds = m.TensorConvolutionDataSource(
        desc, torch.randn(desc.weights_shape, generator=gen, dtype=torch.float64)
    )
    conv, grad = m.Convolution(dev, ds), m.ConvolutionGradient(dev, ds)
    x = m.Image.from_tensor(torch.randn(1, 1, 6, 6, generator=gen, dtype=torch.float64))
    g = m.Image.from_tensor(torch.randn(1, 1, 6, 6, generator=gen, dtype=torch.float64))
    cb = dev.new_command_queue().command_buffer()
    state = conv.result_state(x)
    conv.encode(cb, x, destination_state=state)
    full = grad.encode(cb, g, x, state)
    run(cb)
    grad.clip_rect = m.Region.make(1, 2, 3, 2)
    sentinel = torch.full((1, 1, 6, 6), 7.0, dtype=torch.float64)
    part = m.Image.from_tensor(sentinel.clone())
    cb = dev.new_command_queue().command_buffer()
    state2 = conv.result_state(x)
    conv.encode(cb, x, destination_state=state2)
    grad.encode(cb, g, x, state2, part)
    run(cb)
    want = sentinel.clone()
    want[:, :, 2:4, 1:4] = full.tensor[:, :, 2:4, 1:4]
    assert torch.equal(part.tensor, want)
