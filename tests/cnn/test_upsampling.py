"""Upsampling: nearest and bilinear (both align_corners) against F.interpolate, the general
geometry (offsets, clip rects, ZERO edges) against the standard path and a direct formula,
gradients by autograd and the adjoint test, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.helpers import DEVICES, assert_adjoint, assert_close, run


def _make(dev, bilinear, sx, sy, align=False):
    if bilinear:
        return m.UpsamplingBilinear(dev, sx, sy, align), m.UpsamplingBilinearGradient(dev, sx, sy)
    return m.UpsamplingNearest(dev, sx, sy), m.UpsamplingNearestGradient(dev, sx, sy)


def _run(dev, kernels, x, g=None, dst=None, configure=None):
    fwd, grad = kernels
    if configure:
        configure(fwd)
    src = m.Image.from_tensor(x)
    cb = dev.new_command_queue().command_buffer()
    st = fwd.result_state(src)
    y = fwd.encode(cb, src, None if dst is None else m.Image.from_tensor(dst.clone()), st)
    dx = None if g is None else grad.encode(cb, m.Image.from_tensor(g), src, st)
    run(cb)
    return y.tensor, (None if dx is None else dx.tensor)


CASES = [
    (False, 2, 2, False),
    (False, 3, 1, False),
    (True, 2, 2, False),
    (True, 3, 2, False),
    (True, 2, 2, True),
    (True, 1, 3, True),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str
)
@pytest.mark.parametrize("bilinear,sx,sy,align", CASES, ids=str)
def test_standard_matches_interpolate_and_autograd(bilinear, sx, sy, align, dtype, device) -> None:
    gen = torch.Generator().manual_seed(111)
    x = torch.randn(2, 3, 5, 4, generator=gen).to(dtype)
    g = torch.randn(2, 3, 5 * sy, 4 * sx, generator=gen).to(dtype)
    y, dx = _run(
        m.Device(device),
        _make(m.Device(device), bilinear, sx, sy, align),
        x.to(device),
        g.to(device),
    )
    xr = x.double().requires_grad_()
    mode = dict(mode="bilinear", align_corners=align) if bilinear else dict(mode="nearest")
    ref = F.interpolate(xr, size=(5 * sy, 4 * sx), **mode)
    ref.backward(g.double())
    tol = 1e-12 if dtype == torch.float64 else None
    assert_close(y, ref.detach(), "upsampling forward", dtype=dtype, tol=tol)
    assert_close(dx, xr.grad, "upsampling gradient", dtype=dtype, tol=tol)


@pytest.mark.parametrize("bilinear,sx,sy,align", CASES, ids=str)
@pytest.mark.parametrize("edge", [m.EdgeMode.ZERO, m.EdgeMode.CLAMP], ids=lambda e: e.name)
def test_general_geometry_formula_and_adjoint(bilinear, sx, sy, align, edge) -> None:
    gen = torch.Generator().manual_seed(112)
    dev = m.Device("cpu")
    x = torch.randn(1, 2, 4, 3, generator=gen, dtype=torch.float64)
    dst = torch.randn(1, 3, 9, 8, generator=gen, dtype=torch.float64)

    def configure(k):
        k.edge_mode = edge
        k.offset = m.Offset(-1, 1, 0)
        k.clip_rect = m.Region.make(-2, 1, 9, 6)
        k.destination_feature_channel_offset = 1

    y, _ = _run(dev, _make(dev, bilinear, sx, sy, align), x, dst=dst, configure=configure)
    want = dst.clone()
    h, w = 4, 3

    def read(i, j):
        if 0 <= i < h and 0 <= j < w:
            return x[0, :, i, j]
        if edge is m.EdgeMode.CLAMP:
            return x[0, :, min(max(i, 0), h - 1), min(max(j, 0), w - 1)]
        return torch.zeros(2, dtype=torch.float64)

    def pos(u, off, size, s):
        if align:
            return off + u * (size - 1) / (size * s - 1)
        return off + (u + 0.5) / s - 0.5

    for r in range(1, 7):  # written rows: clip [1, 7) in a 9-row destination
        for c in range(0, 7):  # clip [-2, 7) in an 8-wide destination: columns 0..6
            u, v = r - 1, c + 2  # counted from the clip origin
            if not bilinear:
                val = read(1 + u // sy, -1 + v // sx)
            else:
                py, px = pos(u, 1, h, sy), pos(v, -1, w, sx)
                i0, j0 = math.floor(py), math.floor(px)
                fy, fx = py - i0, px - j0
                val = (
                    (1 - fy) * (1 - fx) * read(i0, j0)
                    + (1 - fy) * fx * read(i0, j0 + 1)
                    + fy * (1 - fx) * read(i0 + 1, j0)
                    + fy * fx * read(i0 + 1, j0 + 1)
                )
            want[0, 1:3, r, c] = val
    assert_close(y, want, "upsampling general geometry", tol=1e-13)
    v = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    cot = torch.randn(dst.shape, generator=gen, dtype=torch.float64)
    kernels = _make(dev, bilinear, sx, sy, align)
    jv = (
        _run(dev, kernels, x + v, dst=dst, configure=configure)[0]
        - _run(dev, kernels, x, dst=dst, configure=configure)[0]
    )
    _, dx = _run(dev, kernels, x, cot, dst=dst, configure=configure)
    assert_adjoint(jv, cot, v, dx, "upsampling adjoint", tol=1e-12)


def test_upsampling_errors() -> None:
    dev = m.Device("cpu")
    with pytest.raises(
        ValueError, match=r"\[UpsamplingNearest\] integer_scale_factor_x must be positive, got 0"
    ):
        m.UpsamplingNearest(dev, 0, 2)
    with pytest.raises(
        TypeError, match=r"\[UpsamplingBilinear\] align_corners must be a bool, got int"
    ):
        m.UpsamplingBilinear(dev, 2, 2, 1)
    up = m.UpsamplingBilinear(dev, 2, 2)
    x = m.Image.from_tensor(torch.randn(1, 1, 3, 3))
    cb = dev.new_command_queue().command_buffer()
    st = up.result_state(x)
    y = up.encode(cb, x, destination_state=st)
    with pytest.raises(
        ValueError,
        match=r"\[UpsamplingBilinearGradient\] the scale factors must equal the forward's \(2, 2\), got \(3, 2\)",
    ):
        m.UpsamplingBilinearGradient(dev, 3, 2).encode(cb, y, x, st)
    with pytest.raises(
        ValueError,
        match=r"\[UpsamplingNearestGradient\] gradient_state must come from a UpsamplingNearest encode, got one from UpsamplingBilinear",
    ):
        m.UpsamplingNearestGradient(dev, 2, 2).encode(cb, y, x, st)
