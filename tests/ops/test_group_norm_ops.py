"""Group / instance normalization math: forward against PyTorch (group_norm, instance_norm),
gradients against PyTorch's autograd and against autograd of our own forward, the adjoint
identity with forward-mode products, half-precision storage, zero-variance groups and a group
of mean 1e4 in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpsnn.ops.group_norm import group_norm_backward, group_norm_forward
from tests.helpers import DEVICES, TOL, assert_adjoint, assert_close

F64 = torch.float64

# (N, C, H, W, groups): several channels per group (gamma varies inside a group), one group,
# instance normalization (groups = C), odd sizes, a 1x1 image.
SHAPES = [
    (2, 6, 5, 4, 3),
    (3, 4, 3, 3, 1),
    (2, 5, 4, 6, 5),
    (1, 8, 2, 3, 2),
    (4, 6, 1, 1, 2),
]


def _inputs(shape, seed: int, dtype=F64):
    n, c, h, w, groups = shape
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, c, h, w, generator=gen, dtype=F64) * 1.7 + 0.4).to(dtype)
    gamma = torch.randn(c, generator=gen, dtype=F64) + 1.0
    beta = torch.randn(c, generator=gen, dtype=F64)
    g = torch.randn(n, c, h, w, generator=gen, dtype=F64).to(dtype)
    return x, groups, gamma, beta, g


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_matches_torch_group_norm(shape) -> None:
    x, groups, gamma, beta, _ = _inputs(shape, 1)
    eps = 1e-5
    y, mean, var = group_norm_forward(x, groups, gamma, beta, eps)
    assert y.dtype == F64 and mean.dtype == F64 and var.dtype == F64
    assert_close(y, F.group_norm(x, groups, gamma, beta, eps), "y", tol=1e-13)
    xg = x.reshape(x.shape[0], groups, -1)
    want_var, want_mean = torch.var_mean(xg, -1, unbiased=False)
    assert_close(mean, want_mean, "mean", tol=1e-13)
    assert_close(var, want_var, "var", tol=1e-13)
    # beta None is a zero shift; gamma None a unit scale.
    y0, _, _ = group_norm_forward(x, groups, gamma, None, eps)
    assert_close(y0, F.group_norm(x, groups, gamma, None, eps), "y without beta", tol=1e-13)
    y1, _, _ = group_norm_forward(x, groups, None, beta, eps)
    assert_close(y1, F.group_norm(x, groups, None, beta, eps), "y without gamma", tol=1e-13)


def test_instance_norm_is_one_group_per_channel() -> None:
    x, _, gamma, beta, g = _inputs((3, 5, 4, 3, 5), 2)
    eps = 1e-3
    xr = x.clone().requires_grad_()
    gr, br = gamma.clone().requires_grad_(), beta.clone().requires_grad_()
    want = F.instance_norm(xr, weight=gr, bias=br, use_input_stats=True, eps=eps)
    y, mean, var = group_norm_forward(x, 5, gamma, beta, eps)
    assert_close(y, want.detach(), "instance norm y", tol=1e-13)
    dx, dgamma, dbeta = group_norm_backward(g, x, 5, mean, var, gamma, eps)
    wx, wg, wb = torch.autograd.grad(want, (xr, gr, br), g)
    assert_close(dx, wx, "instance norm dx", tol=1e-12)
    assert_close(dgamma, wg, "instance norm dgamma", tol=1e-12)
    assert_close(dbeta, wb, "instance norm dbeta", tol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backward_matches_torch_autograd(shape, device) -> None:
    x, groups, gamma, beta, g = _inputs(shape, 3)
    eps = 1e-4
    xr = x.clone().requires_grad_()
    gr, br = gamma.clone().requires_grad_(), beta.clone().requires_grad_()
    want = F.group_norm(xr, groups, gr, br, eps)
    wx, wg, wb = torch.autograd.grad(want, (xr, gr, br), g)
    xd, gd, gamd, betd = (t.to(device) for t in (x, g, gamma, beta))
    _, mean, var = group_norm_forward(xd, groups, gamd, betd, eps)
    dx, dgamma, dbeta = group_norm_backward(gd, xd, groups, mean, var, gamd, eps)
    assert dx.dtype == F64 and dgamma.shape == (x.shape[1],) and dbeta.shape == (x.shape[1],)
    assert_close(dx, wx, "dx", tol=1e-12)
    assert_close(dgamma, wg, "dgamma", tol=1e-12)
    assert_close(dbeta, wb, "dbeta", tol=1e-12)


def test_gamma_inside_the_group_sums_matters() -> None:
    """The shorthand ``gamma_c r (g - mean(g) - xhat mean(g xhat))`` differs from the true
    gradient when gamma varies within a group: the case the tests above exercise."""
    x, groups, gamma, beta, g = _inputs(SHAPES[0], 4)
    eps = 1e-5
    _, mean, var = group_norm_forward(x, groups, gamma, beta, eps)
    dx, _, _ = group_norm_backward(g, x, groups, mean, var, gamma, eps)
    n, c, h, w = x.shape
    xg = x.reshape(n, groups, -1)
    r = torch.rsqrt(var + eps).unsqueeze(-1)
    xhat = (xg - mean.unsqueeze(-1)) * r
    gg = g.reshape(n, groups, -1)
    inner = gg - gg.mean(-1, keepdim=True) - xhat * (gg * xhat).mean(-1, keepdim=True)
    shorthand = (r * inner).reshape(n, c, h * w) * gamma.view(1, c, 1)
    rel = (shorthand.reshape(x.shape) - dx).norm() / dx.norm()
    assert rel > 0.05, f"shorthand unexpectedly close to the true gradient ({rel:.2e})"


@pytest.mark.parametrize("shape", SHAPES[:3], ids=str)
def test_backward_is_the_adjoint_of_the_forward(shape) -> None:
    """``backward`` equals autograd of our forward, and ``<J v, w> = <v, J^T w>`` with ``J v``
    from forward-mode differentiation (autograd.functional.jvp) of our forward, jointly in
    (x, gamma, beta)."""
    x, groups, gamma, beta, w = _inputs(shape, 5)
    eps = 1e-3
    gen = torch.Generator().manual_seed(6)
    vx = torch.randn(x.shape, generator=gen, dtype=F64)
    vg = torch.randn(gamma.shape, generator=gen, dtype=F64)
    vb = torch.randn(beta.shape, generator=gen, dtype=F64)

    def fwd(xx, gg, bb):
        return group_norm_forward(xx, groups, gg, bb, eps)[0]

    _, jv = torch.autograd.functional.jvp(fwd, (x, gamma, beta), (vx, vg, vb))
    _, mean, var = group_norm_forward(x, groups, gamma, beta, eps)
    dx, dgamma, dbeta = group_norm_backward(w, x, groups, mean, var, gamma, eps)

    xr = x.clone().requires_grad_()
    gr, br = gamma.clone().requires_grad_(), beta.clone().requires_grad_()
    ax, ag, ab = torch.autograd.grad(fwd(xr, gr, br), (xr, gr, br), w)
    assert_close(dx, ax, "dx vs autograd of our forward", tol=1e-12)
    assert_close(dgamma, ag, "dgamma vs autograd of our forward", tol=1e-12)
    assert_close(dbeta, ab, "dbeta vs autograd of our forward", tol=1e-12)

    v = torch.cat([vx.flatten(), vg, vb])
    jtw = torch.cat([dx.flatten(), dgamma, dbeta])
    assert_adjoint(jv, w, v, jtw, f"group norm adjoint {shape}")
    # x alone as well (the gamma/beta parts must not hide an error in dx).
    _, jvx = torch.autograd.functional.jvp(lambda xx: fwd(xx, gamma, beta), x, vx)
    assert_adjoint(jvx, w, vx, dx, f"group norm adjoint in x {shape}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2]], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_storage_dtypes(dtype, shape, device) -> None:
    """Inputs rounded to ``dtype``; the reference is float64 on the rounded values."""
    x, groups, gamma, beta, g = _inputs(shape, 7, dtype)
    gamma32, beta32 = gamma.float(), beta.float()
    eps = 1e-5
    xd, gd, gamd, betd = (t.to(device) for t in (x, g, gamma32, beta32))
    y, mean, var = group_norm_forward(xd, groups, gamd, betd, eps)
    assert y.dtype == dtype and mean.dtype == torch.float32 and var.dtype == torch.float32
    x64, g64 = x.double(), g.double()
    gam64, bet64 = gamma32.double(), beta32.double()
    xr = x64.clone().requires_grad_()
    gr, br = gam64.clone().requires_grad_(), bet64.clone().requires_grad_()
    want = F.group_norm(xr, groups, gr, br, eps)
    assert_close(y, want.detach(), f"y {dtype}", dtype=dtype)
    want_var, want_mean = torch.var_mean(x64.reshape(x.shape[0], groups, -1), -1, unbiased=False)
    assert_close(mean, want_mean, f"mean {dtype}", tol=TOL[torch.float32])
    assert_close(var, want_var, f"var {dtype}", tol=TOL[torch.float32])

    dx, dgamma, dbeta = group_norm_backward(gd, xd, groups, mean, var, gamd, eps)
    assert dx.dtype == dtype and dgamma.dtype == torch.float32 and dbeta.dtype == torch.float32
    wx, wg, wb = torch.autograd.grad(want, (xr, gr, br), g64)
    assert_close(dx, wx, f"dx {dtype}", dtype=dtype)
    assert_close(dgamma, wg, f"dgamma {dtype}", tol=TOL[torch.float32])
    assert_close(dbeta, wb, f"dbeta {dtype}", tol=TOL[torch.float32])


def test_large_mean_group_is_precise_in_float32() -> None:
    """A group of mean 1e4 and std 1: float32 storage, float32 statistics, and still float32
    precision relative to the spread (a mean rounded to float32 alone would bias every xhat
    by up to half an ulp of 1e4, ~5e-4)."""
    gen = torch.Generator().manual_seed(8)
    n, c, h, w, groups = 2, 4, 9, 7, 2
    x = (1e4 + torch.randn(n, c, h, w, generator=gen, dtype=F64)).float()
    gamma = (torch.randn(c, generator=gen, dtype=F64) + 1.0).float()
    beta = torch.randn(c, generator=gen, dtype=F64).float()
    g = torch.randn(n, c, h, w, generator=gen, dtype=F64).float()
    eps = 1e-5
    y, mean, var = group_norm_forward(x, groups, gamma, beta, eps)

    x64 = x.detach().double().clone().requires_grad_()
    want = F.group_norm(x64, groups, gamma.double(), beta.double(), eps)
    want_var, want_mean = torch.var_mean(x64.detach().reshape(n, groups, -1), -1, unbiased=False)
    assert_close(y, want.detach(), "y, mean 1e4", dtype=torch.float32)
    assert_close(mean, want_mean, "mean, mean 1e4", dtype=torch.float32)
    assert_close(var, want_var, "var, mean 1e4", dtype=torch.float32)

    dx, _, _ = group_norm_backward(g, x, groups, mean, var, gamma, eps)
    (wx,) = torch.autograd.grad(want, x64, g.double())
    assert_close(dx, wx, "dx, mean 1e4", dtype=torch.float32)


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.float16], ids=str)
def test_zero_variance_groups_are_finite(dtype) -> None:
    x, groups, gamma, beta, g = _inputs((2, 6, 3, 4, 3), 9, dtype)
    x[0, 2:4] = 0.1  # group 1 of image 0: constant, not exactly representable
    x[1, 0:2] = 3.0  # group 0 of image 1: constant, exact
    gamma32, beta32 = gamma.float(), beta.float()

    # eps > 0: a regular point; compare with PyTorch in float64 on the same values.
    eps = 1e-3
    y, mean, var = group_norm_forward(x, groups, gamma32, beta32, eps)
    dx, dgamma, dbeta = group_norm_backward(g, x, groups, mean, var, gamma32, eps)
    xr = x.detach().double().clone().requires_grad_()
    want = F.group_norm(xr, groups, gamma32.double(), beta32.double(), eps)
    (wx,) = torch.autograd.grad(want, xr, g.double())
    assert_close(y, want.detach(), "y, constant groups", dtype=dtype)
    assert_close(dx, wx, "dx, constant groups", dtype=dtype)
    assert torch.isfinite(dgamma).all() and torch.isfinite(dbeta).all()
    assert_close(y[1, 0:2], beta32[0:2].view(2, 1, 1).expand(2, 3, 4), "y = beta", dtype=dtype)

    # eps = 0 on an exactly constant group: no derivative there; finite by convention.
    x0 = x.clone()
    x0[0, 2:4] = 3.0
    y, mean, var = group_norm_forward(x0, groups, gamma32, beta32, 0.0)
    dx, dgamma, dbeta = group_norm_backward(g, x0, groups, mean, var, gamma32, 0.0)
    for t in (y, mean, var, dx, dgamma, dbeta):
        assert torch.isfinite(t.double()).all()
    assert_close(
        y[0, 2:4], beta32[2:4].view(2, 1, 1).expand(2, 3, 4), "y = beta, eps 0", dtype=dtype
    )
    assert not dx[0, 2:4].any() and not dx[1, 0:2].any()
    # the other groups are unaffected
    want0 = F.group_norm(x0.double(), groups, gamma32.double(), beta32.double(), 0.0)
    assert_close(y[0, 4:], want0[0, 4:], "other groups, eps 0", dtype=dtype)


def test_invalid_arguments() -> None:
    x = torch.zeros(2, 6, 3, 3)
    with pytest.raises(ValueError, match="divide"):
        group_norm_forward(x, 4, None, None, 1e-5)
    with pytest.raises(ValueError, match="positive"):
        group_norm_forward(x, 0, None, None, 1e-5)
    with pytest.raises(ValueError, match="gamma"):
        group_norm_forward(x, 3, torch.ones(5), None, 1e-5)
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        group_norm_forward(x[0], 3, None, None, 1e-5)
