"""Local correlation against a loop-level float64 implementation of MPS's formula: windows and
strides (asymmetric, so the x-fastest channel order shows), out-of-region taps reading zero,
source clip rects of different sizes, channel ranges, batches with one shared secondary, the
storage formats, and the errors."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from tests.cnn.test_reduce import encode_binary
from tests.helpers import DEVICES, assert_close


def _reference(a, b, wx, wy, sx, sy):
    """``O[k(m, n), y, x] = sum_c a[c, y, x] b[c, y + (n - wy) sy, x + (m - wx) sx]``,
    ``k = n (2 wx + 1) + m``; b outside its block reads 0. Written with plain loops."""
    n, _, h, w = a.shape
    hb, wb = b.shape[2], b.shape[3]
    out = torch.zeros(n, (2 * wx + 1) * (2 * wy + 1), h, w, dtype=torch.float64)
    for img in range(n):
        bi = b[img if b.shape[0] > 1 else 0]
        for nn in range(2 * wy + 1):
            for mm in range(2 * wx + 1):
                k = nn * (2 * wx + 1) + mm
                for y in range(h):
                    for x in range(w):
                        yy, xx = y + (nn - wy) * sy, x + (mm - wx) * sx
                        if 0 <= yy < hb and 0 <= xx < wb:
                            out[img, k, y, x] = float((a[img, :, y, x] * bi[:, yy, xx]).sum())
    return out


CASES = [(0, 0, 1, 1), (1, 1, 1, 1), (2, 1, 1, 2), (1, 2, 2, 1), (3, 0, 2, 1)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wx,wy,sx,sy", CASES, ids=str)
@pytest.mark.parametrize("batch", [False, True])
def test_matches_loop_reference(batch, wx, wy, sx, sy, device) -> None:
    gen = torch.Generator().manual_seed(30)
    dev = m.Device(device)
    a = torch.randn(2, 3, 5, 6, generator=gen, dtype=torch.float64)
    b = torch.randn(2, 3, 5, 6, generator=gen, dtype=torch.float64)
    k = m.LocalCorrelation(dev, wx, wy, sx, sy)
    y = encode_binary(dev, k, a.to(device), b.to(device), batch=batch)
    assert y.shape == (2, (2 * wx + 1) * (2 * wy + 1), 5, 6)
    assert_close(y, _reference(a, b, wx, wy, sx, sy), "local correlation", tol=1e-14)


def test_channel_order_is_x_fastest() -> None:
    dev = m.Device("cpu")
    # a = 1 at one pixel, b a ramp: channel k holds b at the k-th offset, x running fastest
    a = torch.zeros(1, 1, 5, 5, dtype=torch.float64)
    a[0, 0, 2, 2] = 1.0
    b = torch.arange(25, dtype=torch.float64).view(1, 1, 5, 5)
    y = encode_binary(dev, m.LocalCorrelation(dev, 2, 1), a, b)
    assert y.shape[1] == 15
    got = y[0, :, 2, 2].tolist()
    want = [float(b[0, 0, 2 + dy, 2 + dx]) for dy in (-1, 0, 1) for dx in (-2, -1, 0, 1, 2)]
    assert got == want


def test_regions_of_different_sizes_channels_and_shared_secondary() -> None:
    gen = torch.Generator().manual_seed(31)
    dev = m.Device("cpu")
    a = torch.randn(3, 5, 6, 7, generator=gen, dtype=torch.float64)
    b = torch.randn(1, 4, 5, 5, generator=gen, dtype=torch.float64)
    k = m.LocalCorrelation(dev, window_in_x=1, window_in_y=1, stride_in_x=2, stride_in_y=1)
    k.primary_source_clip_rect = m.Region.make(1, 1, 5, 4, z=0, depth=3)
    k.secondary_source_clip_rect = m.Region.make(2, 0, 3, 9)  # 3 x 5 after the intersection
    k.primary_source_feature_channel_offset = 1
    k.primary_source_feature_channel_max_count = 3
    k.secondary_source_feature_channel_offset = 1
    y = encode_binary(dev, k, a, b, batch=True)
    want = _reference(a[:, 1:4, 1:5, 1:6], b[:, 1:4, 0:5, 2:5], 1, 1, 2, 1)
    assert_close(y, want, "regions and channels", tol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_storage_formats(dtype) -> None:
    gen = torch.Generator().manual_seed(32)
    dev = m.Device("cpu")
    a = torch.randn(1, 8, 4, 5, generator=gen).to(dtype)
    b = torch.randn(1, 8, 4, 5, generator=gen).to(dtype)
    y = encode_binary(dev, m.LocalCorrelation(dev, 1, 1), a, b)
    assert y.dtype == dtype
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    assert_close(y, _reference(a.double(), b.double(), 1, 1, 1, 1), "correlation", tol=tol)


def test_properties_and_errors() -> None:
    dev = m.Device("cpu")
    k = m.LocalCorrelation(dev)
    assert (k.window_in_x, k.window_in_y, k.stride_in_x, k.stride_in_y) == (0, 0, 1, 1)
    k.window_in_y, k.stride_in_x = 3, 2
    assert (k.window_in_x, k.window_in_y, k.stride_in_x, k.stride_in_y) == (0, 3, 2, 1)
    with pytest.raises(ValueError, match=r"\[LocalCorrelation\] window_in_x must be >= 0, got -1"):
        m.LocalCorrelation(dev, -1)
    with pytest.raises(ValueError, match=r"\[LocalCorrelation\] stride_in_y must be >= 1, got 0"):
        k.stride_in_y = 0
    with pytest.raises(TypeError, match=r"\[LocalCorrelation\] window_in_y must be an int"):
        k.window_in_y = 1.0
    cb = dev.new_command_queue().command_buffer()
    a = m.Image.from_tensor(torch.zeros(1, 3, 4, 4))
    with pytest.raises(
        ValueError,
        match=r"\[LocalCorrelation\] the secondary source must give as many channels as the "
        r"primary \(3\), got 2",
    ):
        k.encode(cb, a, m.Image.from_tensor(torch.zeros(1, 2, 4, 4)))
    with pytest.raises(
        ValueError,
        match=r"destination_feature_channel_offset \+ 7 channels = 7, got a destination with 6",
    ):
        k.encode(cb, a, a, m.Image.from_tensor(torch.zeros(1, 6, 4, 4)))
    with pytest.raises(ValueError, match=r"\[LocalCorrelation\] this kernel has no gradient"):
        k.encode(cb, a, a, None, m.GradientState(dev))
    assert m.gradient_kernels_of(m.LocalCorrelation) == ()
