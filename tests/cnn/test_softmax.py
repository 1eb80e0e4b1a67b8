"""Softmax and log-softmax over channels: torch equality, gradients from the forward result
(autograd and adjoint), channel slices and window geometry, numerics, errors."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from tests.helpers import DEVICES, assert_adjoint, assert_close, run

PAIRS = {
    "softmax": (m.SoftMax, m.SoftMaxGradient, torch.softmax),
    "log": (m.LogSoftMax, m.LogSoftMaxGradient, torch.log_softmax),
}


def _run(dev, name, x, g=None, configure=None, dst0=None):
    fwd_cls, grad_cls, _ = PAIRS[name]
    fwd, grad = fwd_cls(dev), grad_cls(dev)
    if configure:
        configure(fwd)
    src = m.Image.from_tensor(x)
    cb = dev.new_command_queue().command_buffer()
    st = fwd.result_state(src)
    y = fwd.encode(cb, src, None if dst0 is None else m.Image.from_tensor(dst0.clone()), st)
    dx = None if g is None else grad.encode(cb, m.Image.from_tensor(g), y, st)  # reads the RESULT
    run(cb)
    return y.tensor, (None if dx is None else dx.tensor)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str
)
def test_matches_torch_and_autograd(name, dtype, device) -> None:
    gen = torch.Generator().manual_seed(91)
    x = (torch.randn(2, 5, 3, 4, generator=gen) * 3).to(dtype)
    g = torch.randn(2, 5, 3, 4, generator=gen).to(dtype)
    y, dx = _run(m.Device(device), name, x.to(device), g.to(device))
    ref = PAIRS[name][2]
    xr = x.double().requires_grad_()
    out = ref(xr, 1)
    out.backward(g.double())
    assert_close(y, out.detach(), f"{name} forward", dtype=dtype)
    assert_close(
        dx, xr.grad, f"{name} gradient", dtype=dtype, tol=1e-12 if dtype == torch.float64 else None
    )


@pytest.mark.parametrize("name", list(PAIRS))
def test_channel_slice_geometry_and_adjoint(name) -> None:
    gen = torch.Generator().manual_seed(92)
    dev = m.Device("cpu")
    x = torch.randn(1, 6, 3, 3, generator=gen, dtype=torch.float64)
    dst0 = torch.randn(1, 5, 3, 3, generator=gen, dtype=torch.float64)

    def configure(k):
        k.source_feature_channel_offset = 1
        k.source_feature_channel_max_count = 4
        k.destination_feature_channel_offset = 1
        k.edge_mode = m.EdgeMode.CLAMP
        k.offset = m.Offset(1, 0, 0)  # reads columns 1, 2, then the clamped column 2

    y, _ = _run(dev, name, x, configure=configure, dst0=dst0)
    cols = x[:, 1:5, :, [1, 2, 2]]
    assert_close(y[:, 1:5], PAIRS[name][2](cols, 1), f"{name} slice forward", tol=1e-13)
    assert torch.equal(y[:, :1], dst0[:, :1])  # channels outside the write are untouched
    v = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    cot = torch.randn(dst0.shape, generator=gen, dtype=torch.float64)
    eps = 1e-6
    jv = (
        _run(dev, name, x + eps * v, configure=configure, dst0=dst0)[0]
        - _run(dev, name, x - eps * v, configure=configure, dst0=dst0)[0]
    ) / (2 * eps)
    _, dx = _run(dev, name, x, cot, configure=configure, dst0=dst0)
    assert dx[:, [0, 5]].abs().max() == 0
    assert_adjoint(jv, cot, v, dx, f"{name} slice adjoint", tol=1e-7)


@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_logits_1000_apart_stay_finite(name, dtype) -> None:
    x = torch.tensor([0.0, 1000.0, -1000.0, 999.0]).view(1, 4, 1, 1).to(dtype)
    g = torch.tensor([1.0, -2.0, 0.5, 3.0]).view(1, 4, 1, 1).to(dtype)
    y, dx = _run(m.Device("cpu"), name, x, g)
    assert torch.isfinite(y).all()
    assert torch.isfinite(dx).all()
    if name == "softmax":
        assert y.sum().item() == pytest.approx(1.0, rel=1e-2)


def test_softmax_errors() -> None:
    dev = m.Device("cpu")
    x = m.Image.from_tensor(torch.randn(1, 3, 2, 2))
    cb = dev.new_command_queue().command_buffer()
    sm = m.SoftMax(dev)
    st = sm.result_state(x)
    y = sm.encode(cb, x, destination_state=st)
    with pytest.raises(
        ValueError,
        match=r"\[LogSoftMaxGradient\] gradient_state must come from a LogSoftMax encode, got one from SoftMax",
    ):
        m.LogSoftMaxGradient(dev).encode(cb, y, y, st)
    with pytest.raises(
        ValueError,
        match=r"\[SoftMaxGradient\] source_image must have the forward result's shape 2x2x3",
    ):
        m.SoftMaxGradient(dev).encode(cb, y, m.Image.from_tensor(torch.randn(1, 4, 2, 2)), st)
