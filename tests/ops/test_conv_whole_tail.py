"""A strided convolution whose taps start at the image's first pixel and leave its last rows
or columns unread (a 1x1 stride-2 shortcut on an even size) reads the whole image instead of a
cropped view: no copy of the source in the forward and the weight gradient, no embedding copy
of the data gradient. The values are those of the cropped computation; where reading the whole
axis would make a further output (a clip rect at the top-left of a large image), the view
stays cropped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpsnn.core.geometry import AxisWindow, EdgeMode
from mpsnn.ops.convolution import conv_backward, conv_forward, conv_geometry
from mpsnn.ops.window import plan_extract
from tests.helpers import assert_adjoint, assert_close


def _axis(start: int, count: int, k: int, s: int, size: int) -> AxisWindow:
    return AxisWindow(start, count, k, s, 1, size)


@pytest.mark.parametrize(
    ("k", "start", "size"),
    [(1, 0, 32), (1, 0, 8), (3, -1, 8), (2, 0, 10)],
    ids=["1x1-s2-32", "1x1-s2-8", "3x3-s2-pad1-8", "2x2-s2-10"],
)
def test_a_strided_convolution_reads_the_whole_image(k: int, start: int, size: int) -> None:
    count = (size - 1) // 2 + 1 if start == 0 else size // 2
    if k == 2:
        count = size // 2
    a = _axis(start, count, k, 2, size)
    geom = conv_geometry(a, a, EdgeMode.ZERO, 1)
    cropped = plan_extract(a, a, EdgeMode.ZERO)
    if a.stop < size or (start < 0 and min(a.stop, size) < size):
        assert not cropped.identity  # what it was: a cropped view
    assert geom.plan.identity and not geom.crop  # now: the image itself, no extra output
    gen = torch.Generator().manual_seed(size + k)
    x = torch.randn(2, 3, size, size, generator=gen, dtype=torch.float64)
    w = torch.randn(4, 3, k, k, generator=gen, dtype=torch.float64)
    b = torch.randn(4, generator=gen, dtype=torch.float64)
    # PyTorch autograd on the window model: pad before, taps [start, stop)
    pad = -start if start < 0 else 0
    xr = x.clone().requires_grad_(True)
    wr = w.clone().requires_grad_(True)
    want = F.conv2d(xr, wr, b, stride=2, padding=pad)[:, :, :count, :count]
    y = conv_forward(x, w, b, geom)
    assert_close(y, want.detach(), "forward", tol=1e-12)
    g = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    dx, dw, db = conv_backward(g, x, w, geom)
    want.backward(g)
    assert dx.shape == x.shape
    assert_close(dx, xr.grad, "data gradient", tol=1e-12)
    assert_close(dw, wr.grad, "weight gradient", tol=1e-12)
    assert_close(db, g.sum((0, 2, 3)), "bias gradient", tol=1e-12)
    # adjoint: <J_x v, g> = <v, dx>
    v = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    jv = conv_forward(v, w, None, geom)
    assert_adjoint(jv, g, v, dx, "data adjoint", tol=1e-12)


def test_a_small_clip_of_a_large_image_stays_cropped() -> None:
    """Reading the whole axis would make more outputs than the window has: the view stays
    cropped (no work on pixels nothing reads)."""
    a = _axis(0, 2, 1, 2, 64)  # two outputs at the top-left of a 64-pixel axis
    geom = conv_geometry(a, a, EdgeMode.ZERO, 1)
    assert not geom.plan.identity and geom.plan.y.hi == 3 and not geom.crop
    x = torch.randn(1, 2, 64, 64, dtype=torch.float64)
    w = torch.randn(3, 2, 1, 1, dtype=torch.float64)
    y = conv_forward(x, w, None, geom)
    assert y.shape == (1, 3, 2, 2)
    assert_close(y, F.conv2d(x[:, :, :3, :3], w, stride=2), "forward", tol=1e-12)
