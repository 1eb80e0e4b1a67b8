"""Gram matrix: the forward against ``torch.einsum`` in float64 (MPS's C x 1 x C layout), the
gradient against autograd and the adjoint test, every storage format, batches, channel ranges
and image selection, and the errors."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from tests.helpers import DEVICES, FORMATS, assert_adjoint, assert_close, run


def _gram(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """Reference: ``G[b, i, j] = alpha sum_p x[b, i, p] x[b, j, p]`` as (N, C, 1, C)."""
    return (alpha * torch.einsum("bihw,bjhw->bij", x, x)).unsqueeze(2)


def _encode(dev, x, g, alpha, batch=False, configure=None):
    fwd, grad = m.GramMatrixCalculation(dev, alpha), m.GramMatrixCalculationGradient(dev, alpha)
    if configure:
        configure(fwd)
    cb = dev.new_command_queue().command_buffer()
    if batch:
        src = m.ImageBatch.from_tensor(x)
        st = fwd.result_state_batch(src)
        y = fwd.encode_batch(cb, src, destination_states=st).image
        dx = grad.encode_batch(cb, m.ImageBatch.from_tensor(g), src, st).image
    else:
        src = m.Image.from_tensor(x)
        st = fwd.result_state(src)
        y = fwd.encode(cb, src, None, st)
        dx = grad.encode(cb, m.Image.from_tensor(g), src, st)
    run(cb)
    return y, dx


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("alpha", [1.0, -0.37])
def test_forward_is_einsum_and_gradient_is_autograd(alpha, batch, device) -> None:
    gen = torch.Generator().manual_seed(1)
    dev = m.Device(device)
    x = torch.randn(3, 5, 4, 6, generator=gen, dtype=torch.float64)
    g = torch.randn(3, 5, 1, 5, generator=gen, dtype=torch.float64)  # not symmetric
    y, dx = _encode(dev, x.to(device), g.to(device), alpha, batch)
    assert (y.width, y.height, y.feature_channels) == (5, 1, 5)  # MPS: C wide, 1 high, C chans
    xr = x.clone().requires_grad_()
    ref = _gram(xr, alpha)
    ref.backward(g)
    assert_close(y.tensor, ref.detach(), "gram forward", tol=1e-13)
    assert_close(dx.tensor, xr.grad, "gram gradient", tol=1e-13)
    # the formula of the docs: alpha (dG + dG^T) x
    dg = g[:, :, 0, :]
    want = alpha * torch.einsum("bkj,bjhw->bkhw", dg + dg.transpose(1, 2), x)
    assert_close(dx.tensor, want, "gram gradient formula", tol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_storage_formats(dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    dev = m.Device("cpu")
    x = (torch.randn(2, 4, 5, 3, generator=gen) * 0.5).to(dtype)
    g = torch.randn(2, 4, 1, 4, generator=gen).to(dtype)
    y, dx = _encode(dev, x, g, 0.25)
    assert y.feature_channel_format is FORMATS[dtype]
    xr = x.double().requires_grad_()
    ref = _gram(xr, 0.25)
    ref.backward(g.double())
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert_close(y.tensor, ref.detach(), "gram forward", tol=tol)
    assert_close(dx.tensor, xr.grad, "gram gradient", tol=tol)


def test_adjoint_identity() -> None:
    gen = torch.Generator().manual_seed(3)
    dev = m.Device("cpu")
    x = torch.randn(2, 3, 4, 4, generator=gen, dtype=torch.float64)
    v = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    w = torch.randn(2, 3, 1, 3, generator=gen, dtype=torch.float64)
    alpha = 0.7
    # J v at x: alpha (v x^T + x v^T), the derivative of the quadratic map
    jv = alpha * (
        torch.einsum("bihw,bjhw->bij", v, x) + torch.einsum("bihw,bjhw->bij", x, v)
    ).unsqueeze(2)
    _, jtw = _encode(dev, x, w, alpha)
    assert_adjoint(jv, w, v, jtw.tensor, "gram adjoint")


def test_channel_range_destination_offset_and_image_selection() -> None:
    gen = torch.Generator().manual_seed(4)
    dev = m.Device("cpu")
    x = torch.randn(3, 5, 3, 4, generator=gen, dtype=torch.float64)
    dst = torch.randn(2, 4, 2, 6, generator=gen, dtype=torch.float64)
    fwd = m.GramMatrixCalculation(dev, 2.0)
    fwd.source_feature_channel_offset = 1
    fwd.source_feature_channel_max_count = 3
    fwd.destination_feature_channel_offset = 1
    fwd.offset = m.Offset(0, 0, 1)  # source images 1, 2
    cb = dev.new_command_queue().command_buffer()
    src = m.Image.from_tensor(x)
    st = fwd.result_state(src)
    out = fwd.encode(cb, src, m.Image.from_tensor(dst.clone()), st)
    g = torch.randn(2, 4, 2, 6, generator=gen, dtype=torch.float64)
    grad = m.GramMatrixCalculationGradient(dev, 2.0)
    dx = grad.encode(cb, m.Image.from_tensor(g), src, st)
    run(cb)
    want = dst.clone()
    want[:, 1:4, 0:1, 0:3] = _gram(x[1:3, 1:4], 2.0)  # the 3x1x3 result; the rest untouched
    assert_close(out.tensor, want, "gram into a destination", tol=1e-13)
    xr = x.clone().requires_grad_()
    _gram(xr[1:3, 1:4], 2.0).backward(g[:, 1:4, 0:1, 0:3])
    # the gradient has the forward source's shape: unread channels and images get 0
    assert_close(dx.tensor[1:3], xr.grad[1:3], "gram gradient of the images read", tol=1e-13)
    assert torch.equal(dx.tensor[1:3, [0, 4]], torch.zeros(2, 2, 3, 4, dtype=torch.float64))


def test_errors() -> None:
    dev = m.Device("cpu")
    with pytest.raises(
        TypeError, match=r"\[GramMatrixCalculation\] alpha must be a number, got str"
    ):
        m.GramMatrixCalculation(dev, "1")
    with pytest.raises(
        ValueError, match=r"\[GramMatrixCalculation\] alpha must be finite, got inf"
    ):
        m.GramMatrixCalculation(dev, float("inf"))
    k = m.GramMatrixCalculation(dev)
    with pytest.raises(
        ValueError, match=r"\[GramMatrixCalculationGradient\] alpha must be finite, got nan"
    ):
        m.GramMatrixCalculationGradient(dev).alpha = float("nan")
    src = m.Image.from_tensor(torch.randn(1, 3, 4, 4))
    cb = dev.new_command_queue().command_buffer()
    k.offset = m.Offset(1, 0, 0)
    with pytest.raises(
        ValueError, match=r"\[GramMatrixCalculation\] offset must be 0 in x and y .*got \(1, 0\)"
    ):
        k.encode(cb, src, m.Image.from_tensor(torch.zeros(1, 3, 1, 3)))
    k.offset = m.Offset()
    k.clip_rect = m.Region.make(0, 0, 2, 1)
    with pytest.raises(
        ValueError,
        match=r"\[GramMatrixCalculation\] the clip rect must cover the 3x1 result from the "
        r"origin, got origin \(0, 0\) and 2x1 pixels",
    ):
        k.encode(cb, src)
    k.clip_rect = m.RECT_NO_CLIP
    with pytest.raises(
        ValueError, match=r"\[GramMatrixCalculation\] the clip rect must cover the 3x1 result"
    ):
        k.encode(cb, src, m.Image.from_tensor(torch.zeros(1, 3, 1, 2)))
    with pytest.raises(
        ValueError, match=r"source_feature_channel_offset must be < the source's 3 channels, got 3"
    ):
        k.source_feature_channel_offset = 3
        k.encode(cb, src)
    k.source_feature_channel_offset = 0
    st = k.result_state(src)
    k.encode(cb, src, None, st)
    g = m.Image.from_tensor(torch.zeros(1, 3, 1, 3))
    with pytest.raises(
        ValueError,
        match=r"\[GramMatrixCalculationGradient\] alpha must equal the forward's 1.0, got 2.0",
    ):
        m.GramMatrixCalculationGradient(dev, 2.0).encode(cb, g, src, st)
    with pytest.raises(ValueError, match=r"gradient_state must come from a GramMatrixCalculation"):
        up = m.UpsamplingNearest(dev, 1, 1)
        st2 = up.result_state(src)
        up.encode(cb, src, None, st2)
        m.GramMatrixCalculationGradient(dev).encode(
            cb, m.Image.from_tensor(torch.zeros(1, 3, 4, 4)), src, st2
        )
    run(cb)
