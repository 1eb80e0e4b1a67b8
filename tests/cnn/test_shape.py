"""Shape kernels: slice, HWC reshape, pad with every edge mode (against numpy.pad), their
gradients (the header's examples, the adjoint test), concatenation by channel offsets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.helpers import DEVICES, assert_adjoint, assert_close, run


def _fwd_grad(dev, fwd, grad, x, g=None, dst=None):
    src = m.Image.from_tensor(x)
    cb = dev.new_command_queue().command_buffer()
    st = fwd.result_state(src)
    y = fwd.encode(cb, src, None if dst is None else m.Image.from_tensor(dst.clone()), st)
    dx = None if g is None else grad.encode(cb, m.Image.from_tensor(g), src, st)
    run(cb)
    return y.tensor, (None if dx is None else dx.tensor)


def test_slice_copies_a_region_and_its_gradient_embeds_it() -> None:
    gen = torch.Generator().manual_seed(131)
    dev = m.Device("cpu")
    x = torch.randn(2, 5, 6, 7, generator=gen, dtype=torch.float64)
    sl = m.Slice(dev)
    sl.offset = m.Offset(2, 1, 0)
    sl.source_feature_channel_offset = 1
    sl.source_feature_channel_max_count = 3
    sl.clip_rect = m.Region.make(0, 0, 4, 3, depth=2)
    dst = torch.zeros(2, 3, 3, 4, dtype=torch.float64)
    g = torch.randn(dst.shape, generator=gen, dtype=torch.float64)
    y, dx = _fwd_grad(dev, sl, m.SliceGradient(dev), x, g, dst)
    assert torch.equal(y, x[:, 1:4, 1:4, 2:6])
    want = torch.zeros_like(x)
    want[:, 1:4, 1:4, 2:6] = g
    assert torch.equal(dx, want)


@pytest.mark.parametrize("device", DEVICES)
def test_reshape_uses_the_hwc_order_and_round_trips(device) -> None:
    gen = torch.Generator().manual_seed(132)
    dev = m.Device(device)
    x = torch.randn(2, 3, 4, 6, generator=gen, dtype=torch.float64)
    reshape = m.Reshape(dev, 2, 9, 4)  # 3x4x6 = 72 = 4x9x2
    g = torch.randn(2, 4, 9, 2, generator=gen, dtype=torch.float64)
    y, dx = _fwd_grad(dev, reshape, m.ReshapeGradient(dev), x.to(device), g.to(device))
    hwc = x.numpy().transpose(0, 2, 3, 1).reshape(2, 9, 2, 4)  # per image, channel fastest
    assert np.array_equal(y.cpu().numpy(), hwc.transpose(0, 3, 1, 2))
    assert np.array_equal(
        dx.cpu().numpy(), g.numpy().transpose(0, 2, 3, 1).reshape(2, 4, 6, 3).transpose(0, 3, 1, 2)
    )
    back, _ = _fwd_grad(dev, m.Reshape(dev, 6, 4, 3), m.ReshapeGradient(dev), y)
    assert torch.equal(back.cpu(), x)
    assert_adjoint(y, g, x, dx, "reshape adjoint", tol=1e-13)


def test_reshape_errors() -> None:
    dev = m.Device("cpu")
    cb = dev.new_command_queue().command_buffer()
    x = m.Image.from_tensor(torch.zeros(1, 3, 4, 6))
    with pytest.raises(
        ValueError,
        match=r"\[Reshape\] the result must hold as many elements as the source per image \(3x4x6 = 72\), got 5x2x7 = 70",
    ):
        m.Reshape(dev, 7, 2, 5).encode(cb, x)
    r = m.Reshape(dev, 6, 4, 3)
    r.offset = m.Offset(1, 0, 0)
    with pytest.raises(m.UnsupportedError, match=r"\[Reshape\] reshapes whole images"):
        r.encode(cb, x, m.Image.from_tensor(torch.zeros(1, 3, 4, 6)))
    with pytest.raises(ValueError, match=r"\[Reshape\] result_width must be positive, got 0"):
        m.Reshape(dev, 0, 1, 1)


MODES = {
    m.EdgeMode.ZERO: dict(mode="constant", constant_values=0.0),
    m.EdgeMode.CONSTANT: dict(mode="constant", constant_values=2.5),
    m.EdgeMode.CLAMP: dict(mode="edge"),
    m.EdgeMode.MIRROR: dict(mode="reflect"),
    m.EdgeMode.MIRROR_WITH_EDGE: dict(mode="symmetric"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(MODES), ids=lambda e: e.name)
def test_pad_matches_numpy_pad_and_is_adjoint(mode, device) -> None:
    gen = torch.Generator().manual_seed(133)
    dev = m.Device(device)
    x = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    before, after = m.ImageCoordinate(3, 2, 1), m.ImageCoordinate(1, 4, 2)
    pad = m.Pad(dev, before, after, fill_value=2.5)
    pad.edge_mode = mode
    y, _ = _fwd_grad(dev, pad, m.PadGradient(dev), x.to(device))
    want = np.pad(x.numpy(), ((0, 0), (0, 0), (2, 4), (3, 1)), **MODES[mode])
    full = np.full((2, 6, 10, 9), 2.5)
    full[:, 1:4] = want
    assert y.shape == (2, 6, 10, 9) and pad.offset == m.Offset(-3, -2, 0)
    assert_close(y, torch.from_numpy(full), f"pad {mode.name}", tol=1e-14)
    v = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    g = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    jv = _fwd_grad(dev, pad, m.PadGradient(dev), (x + v).to(device))[0] - y
    _, dx = _fwd_grad(dev, pad, m.PadGradient(dev), x.to(device), g.to(device))
    assert_adjoint(jv, g, v, dx, f"pad {mode.name} adjoint", tol=1e-12)


@pytest.mark.parametrize(
    "mode,before,after,want",
    [
        (m.EdgeMode.CLAMP, 2, 3, [1 + 2 + 3, 4, 5 + 6 + 7 + 8]),  # [d0+d1+d2, d3, d4+d5+d6+d7]
        (m.EdgeMode.MIRROR, 4, 1, [1 + 5, 2 + 4 + 6 + 8, 3 + 7]),  # [d0+d4, d1+d3+d5+d7, d2+d6]
        (m.EdgeMode.ZERO, 2, 3, [3, 4, 5]),  # the interior only
    ],
    ids=["clamp", "mirror", "zero"],
)
def test_pad_gradient_header_examples(mode, before, after, want) -> None:
    dev = m.Device("cpu")
    pad = m.Pad(dev, m.ImageCoordinate(before, 0, 0), m.ImageCoordinate(after, 0, 0))
    pad.edge_mode = mode
    d = torch.arange(1.0, 9.0, dtype=torch.float64).view(1, 1, 1, 8)  # d0..d7 = 1..8
    _, dx = _fwd_grad(dev, pad, m.PadGradient(dev), torch.zeros(1, 1, 1, 3, dtype=torch.float64), d)
    assert dx.flatten().tolist() == want


def test_pad_errors() -> None:
    dev = m.Device("cpu")
    with pytest.raises(ValueError, match=r"\[ImageCoordinate\] channel must be >= 0, got -1"):
        m.ImageCoordinate(0, 0, -1)
    with pytest.raises(
        TypeError, match=r"\[Pad\] padding_size_before must be a ImageCoordinate, got tuple"
    ):
        m.Pad(dev, (1, 1, 0))
    with pytest.raises(
        ValueError, match=r"\[Pad\] fill_value needs one value per destination channel \(4\), got 3"
    ):
        m.Pad(dev, m.ImageCoordinate(0, 0, 1), fill_value=[1.0, 2.0, 3.0]).encode(
            dev.new_command_queue().command_buffer(), m.Image.from_tensor(torch.zeros(1, 3, 2, 2))
        )
    with pytest.raises(
        ValueError, match=r"\[Convolution\] edge_mode must be one of ZERO, CLAMP, got MIRROR"
    ):
        m.Convolution(
            dev,
            m.TensorConvolutionDataSource(
                m.ConvolutionDescriptor(1, 1, 1, 1), torch.ones(1, 1, 1, 1)
            ),
        ).edge_mode = m.EdgeMode.MIRROR


@pytest.mark.parametrize("device", DEVICES)
def test_concatenation_by_channel_offsets(device) -> None:
    """Two convolutions write into one image at channel offsets 0 and 3 (no copy); each
    gradient reads its own channels of the concatenated gradient."""
    gen = torch.Generator().manual_seed(134)
    dev = m.Device(device)
    x = torch.randn(2, 2, 6, 6, generator=gen, dtype=torch.float64).to(device)
    wa = torch.randn(3, 3, 3, 2, generator=gen, dtype=torch.float64)
    wb = torch.randn(2, 1, 1, 2, generator=gen, dtype=torch.float64)
    da = m.TensorConvolutionDataSource(m.ConvolutionDescriptor(3, 3, 2, 3), wa)
    db = m.TensorConvolutionDataSource(m.ConvolutionDescriptor(1, 1, 2, 2), wb)
    a, b = m.Convolution(dev, da), m.Convolution(dev, db)
    b.destination_feature_channel_offset = 3
    src = m.Image.from_tensor(x)
    cat = m.Image(dev, m.ImageDescriptor(m.FeatureChannelFormat.FLOAT64, 6, 6, 5, 2))
    g = torch.randn(2, 5, 6, 6, generator=gen, dtype=torch.float64).to(device)
    cb = dev.new_command_queue().command_buffer()
    sa, sb = a.result_state(src), b.result_state(src)
    a.encode(cb, src, cat, sa)
    b.encode(cb, src, cat, sb)
    dxa = m.ConvolutionGradient(dev, da).encode(cb, m.Image.from_tensor(g), src, sa)
    dxb = m.ConvolutionGradient(dev, db).encode(cb, m.Image.from_tensor(g), src, sb)
    run(cb)
    xc = x.cpu()
    want = torch.cat(
        [F.conv2d(xc, wa.permute(0, 3, 1, 2), padding=1), F.conv2d(xc, wb.permute(0, 3, 1, 2))], 1
    )
    assert_close(cat.tensor, want, "concatenated forward", tol=1e-13)
    want_a = torch.nn.grad.conv2d_input(xc.shape, wa.permute(0, 3, 1, 2), g.cpu()[:, :3], padding=1)
    want_b = torch.nn.grad.conv2d_input(xc.shape, wb.permute(0, 3, 1, 2), g.cpu()[:, 3:])
    assert_close(dxa.tensor, want_a, "first input's gradient", tol=1e-12)
    assert_close(dxb.tensor, want_b, "second input's gradient", tol=1e-12)
