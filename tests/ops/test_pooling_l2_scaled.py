"""L2-norm pooling is a scaled norm (hypot / BLAS nrm2): each window's taps are divided by a
power of two near the window's largest magnitude before they are squared, so finite inputs
give finite, accurate results far outside the range where ``x^2`` is representable, in every
storage format; an all-zero window gives 0 and a zero gradient. Checked through the kernels
(forward and gradient) against float64 references computed with exact rescaling."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from mpsnn.ops.pooling import l2_pool_backward, l2_pool_forward, pool_geometry
from tests.helpers import DEVICES, run

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _pool(device, x: torch.Tensor, g: torch.Tensor, k=2, s=2, dil=1, edge=m.EdgeMode.ZERO):
    dev = m.Device(device)
    pool = m.PoolingL2Norm(dev, k, k, s, s, dilation_rate_x=dil, dilation_rate_y=dil)
    grad = m.PoolingL2NormGradient(dev, k, k, s, s, dilation_rate_x=dil, dilation_rate_y=dil)
    pool.edge_mode = edge
    pool.padding = m.DefaultPadding(
        m.PaddingMethod.SIZE_VALID_ONLY | m.PaddingMethod.ALIGN_TOP_LEFT
    )
    src = m.Image.from_tensor(x.to(device))
    cb = dev.new_command_queue().command_buffer()
    st = pool.result_state(src)
    y = pool.encode(cb, src, destination_state=st)
    dx = grad.encode(cb, m.Image.from_tensor(g.to(device)), src, st)
    run(cb)
    return y.tensor.cpu(), dx.tensor.cpu()


def _big(dtype) -> float:
    """A value whose square overflows the dtype (and float32 for the half formats)."""
    return {torch.float64: 3e200, torch.float32: 3e19}.get(dtype, 3e19)


def _tiny(dtype) -> float:
    """A value whose square underflows to 0 in the dtype's computation."""
    return {torch.float64: 1e-200, torch.float32: 1e-30, torch.float16: 1e-7}.get(dtype, 1e-30)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("which", ["big", "tiny"])
def test_four_equal_values_give_twice_the_value_and_gradient_half(which, dtype, device) -> None:
    v = (_big if which == "big" else _tiny)(dtype)
    if dtype is torch.float16 and which == "big":
        v = 3e4  # squares past float16 (the half formats are computed in float32)
    x = torch.full((1, 1, 2, 2), v, dtype=torch.float64).to(dtype)
    g = torch.full((1, 1, 1, 1), -2.0, dtype=dtype)  # dx = g / 2; g a power of two, not 1
    y, dx = _pool(device, x, g)
    exact = float(x[0, 0, 0, 0]) * 2
    assert torch.isfinite(y).all() and y.item() != 0
    assert y.double().item() == pytest.approx(exact, rel=torch.finfo(dtype).eps)
    assert torch.equal(dx, torch.full_like(dx, -1.0)), f"{which} {dtype}: {dx.flatten().tolist()}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mixed_magnitudes_against_a_rescaled_reference(dtype, device) -> None:
    """Random windows, each scaled by its own huge or tiny power of ten: values and gradients
    equal a float64 reference of the scaled formula (exact rescaling by powers of two)."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(2, 3, 6, 6, generator=gen, dtype=torch.float64)
    lo, hi = {torch.float64: (-250, 250), torch.float32: (-35, 35)}.get(dtype, (-3, 3))
    exps = torch.randint(lo, hi + 1, (2, 3, 3, 3), generator=gen)
    scale = torch.pow(10.0, exps.double()).repeat_interleave(2, 2).repeat_interleave(2, 3)
    x = (base * scale).to(dtype)
    g = torch.randn(2, 3, 3, 3, generator=gen, dtype=torch.float64).to(dtype)
    y, dx = _pool(device, x, g)
    # reference: per window, r = x / 2^e (e its largest exponent), y = 2^e sqrt(sum r^2)
    xd = x.double()
    win = xd.unfold(2, 2, 2).unfold(3, 2, 2)  # (N, C, 3, 3, 2, 2)
    mx = win.abs().amax((-1, -2), keepdim=True)
    _, e = torch.frexp(mx)
    p2 = torch.ldexp(torch.ones_like(mx), e)
    r = win / p2
    q = (r * r).sum((-1, -2), keepdim=True).sqrt()
    want = (p2 * q).squeeze(-1).squeeze(-1)
    assert torch.isfinite(y).all()
    tol = dict(rtol=4 * torch.finfo(dtype).eps, atol=0)
    torch.testing.assert_close(y.double(), want.to(dtype).double(), **tol)
    dwin = g.double()[..., None, None] * r / q  # x / y = r / q
    want_dx = dwin.permute(0, 1, 2, 4, 3, 5).reshape(2, 3, 6, 6)
    assert torch.isfinite(dx).all()
    torch.testing.assert_close(dx.double(), want_dx.to(dtype).double(), **tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_windows_stay_zero_without_nan(dtype, device) -> None:
    x = torch.zeros(1, 2, 4, 4, dtype=dtype)
    x[0, 1, :2, :2] = torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=dtype)
    g = torch.tensor([[[[1.5, -2.0], [0.5, 2.5]]] * 2], dtype=dtype)
    y, dx = _pool(device, x, g)
    assert y[0, 0].abs().max() == 0 and y[0, 1, 0, 0] == 5 and y[0, 1].sum() == 5
    assert torch.isfinite(dx).all()
    assert dx[0, 0].abs().max() == 0
    assert dx[0, 1, 0, 0].item() == pytest.approx(1.5 * 3 / 5, rel=1e-2)
    assert dx[0, 1, 1, 1].item() == pytest.approx(1.5 * 4 / 5, rel=1e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_special_values_propagate(device) -> None:
    """As the unscaled formula: an infinite tap gives an infinite norm and NaN at that tap's
    gradient (inf/inf), 0 at the others; a NaN tap gives a NaN norm and NaN at that tap's
    gradient only (a NaN norm passes no gradient, the NaN tap keeps its own); the other
    windows are unaffected."""
    x = torch.ones(1, 1, 2, 6)
    x[0, 0, 0, 0] = float("inf")
    x[0, 0, 1, 2] = float("nan")
    g = torch.tensor([[[[1.0, 2.0, 3.0]]]])
    y, dx = _pool(device, x, g)
    assert y[0, 0, 0, 0] == float("inf") and y[0, 0, 0, 1].isnan() and y[0, 0, 0, 2] == 2
    assert dx[0, 0, 0, 0].isnan() and (dx[0, 0, :, 1] == 0).all() and dx[0, 0, 1, 0] == 0
    assert dx[0, 0, 1, 2].isnan() and dx[0, 0, 0, 2] == 0 and (dx[0, 0, :, 3] == 0).all()
    assert (dx[0, 0, :, 4:] == 1.5).all()


@pytest.mark.parametrize("edge", [m.EdgeMode.ZERO, m.EdgeMode.CLAMP], ids=str)
def test_ops_dilated_windows_of_huge_values(edge) -> None:
    """The ops functions with a dilated, strided geometry reaching outside the image."""
    from mpsnn.core.geometry import AxisWindow

    ay = AxisWindow(start=-1, stride=2, kernel=2, dilation=2, count=3, size=5)
    ax = AxisWindow(start=-2, stride=1, kernel=3, dilation=2, count=4, size=6)
    geom = pool_geometry(ay, ax, edge)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, 2, 5, 6, generator=gen, dtype=torch.float64)
    g = torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64)
    s = 2.0**600
    y_small, dx_small = l2_pool_forward(x, geom), l2_pool_backward(g, x, geom)
    y_big, dx_big = l2_pool_forward(x * s, geom), l2_pool_backward(g, x * s, geom)
    assert torch.isfinite(y_big).all()
    assert torch.equal(y_big, y_small * s)  # exact: scaling by powers of two
    assert torch.equal(dx_big, dx_small)  # the gradient x / y is scale-free
