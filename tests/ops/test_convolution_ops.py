"""CPU float16 convolutions: computed in float32 and rounded once to float16 (PyTorch's CPU
float16 convolution is a slow scalar path); the same numbers as the float32 math rounded."""

from __future__ import annotations

import torch

import mpsnn as m
from mpsnn.core.geometry import AxisWindow
from mpsnn.ops.convolution import conv_backward, conv_forward, conv_geometry


def _geometry(size: int, k: int) -> object:
    a = AxisWindow(start=-(k // 2), count=size, kernel=k, stride=1, dilation=1, size=size)
    return conv_geometry(a, a, m.EdgeMode.ZERO, 1)


def test_cpu_float16_convolution_is_float32_math_rounded_once() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 7, 7, generator=g).half()
    w = (torch.randn(4, 3, 3, 3, generator=g) * 0.3).half()
    b = torch.randn(4, generator=g).half()
    dy = torch.randn(2, 4, 7, 7, generator=g).half()
    geom = _geometry(7, 3)
    y = conv_forward(x, w, b, geom)
    assert y.dtype == torch.float16
    assert torch.equal(y, conv_forward(x.float(), w.float(), b.float(), geom).half())
    dx, dw, db = conv_backward(dy, x, w, geom)
    rx, rw, rb = conv_backward(dy.float(), x.float(), w.float(), geom)
    assert dx.dtype == torch.float16 and dw.dtype == torch.float16 and db.dtype == torch.float32
    assert torch.equal(dx, rx.half()) and torch.equal(dw, rw.half()) and torch.equal(db, rb)
    # and close to the float64 math (one rounding to float16 per output)
    ref = conv_forward(x.double(), w.double(), b.double(), geom)
    assert (y.double() - ref).abs().max() <= ref.abs().max() * 2**-10
