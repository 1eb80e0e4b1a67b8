"""Local normalizations (cross-channel, spatial, local contrast): forwards against PyTorch's
local_response_norm and loop-level references written here from the formulas (one pixel, one
tap at a time), gradients against autograd of those references and of our forwards, the
adjoint identity with forward-mode products, storage dtypes, and all-zero windows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpsnn.core.geometry import EdgeMode
from mpsnn.ops.local_norm import (
    cross_channel_norm_backward,
    cross_channel_norm_forward,
    local_contrast_norm_backward,
    local_contrast_norm_forward,
    spatial_norm_backward,
    spatial_norm_forward,
)
from tests.helpers import DEVICES, assert_adjoint, assert_close

F64 = torch.float64
EDGES = [EdgeMode.ZERO, EdgeMode.CLAMP]

# (kw, kh, H, W): odd, even, kw != kh, 1-wide, and windows larger than the image.
WINDOWS = [(3, 3, 5, 6), (2, 2, 4, 5), (3, 2, 5, 4), (2, 5, 6, 3), (1, 4, 4, 4), (5, 4, 3, 2)]

LRN = dict(alpha=0.9, beta=0.75, delta=1.3)
SPATIAL = dict(alpha=1.4, beta=0.8, delta=0.6)
CONTRAST = dict(alpha=1.3, beta=0.6, delta=0.2, p0=0.8, pm=0.3, ps=1.7)


def _randn(shape, seed: int, dtype=F64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=F64).to(dtype)


# -- loop-level references (float64, differentiable: autograd gives the reference gradient) --


def _taps(centre: int, k: int) -> list[int]:
    return [centre - k // 2 + a for a in range(k)]


def _read(x: torch.Tensor, r: int, c: int, edge: EdgeMode) -> torch.Tensor:
    h, w = x.shape[-2:]
    if 0 <= r < h and 0 <= c < w:
        return x[:, :, r, c]
    if edge is EdgeMode.ZERO:
        return torch.zeros(x.shape[:2], dtype=x.dtype)
    return x[:, :, min(max(r, 0), h - 1), min(max(c, 0), w - 1)]


def _per_pixel(x: torch.Tensor, fn) -> torch.Tensor:
    h, w = x.shape[-2:]
    return torch.stack([torch.stack([fn(i, j) for j in range(w)], -1) for i in range(h)], -2)


def ref_spatial(x, kw, kh, alpha, beta, delta, edge) -> torch.Tensor:
    def pixel(i, j):
        s = torch.zeros(x.shape[:2], dtype=x.dtype)
        for r in _taps(i, kh):
            for c in _taps(j, kw):
                v = _read(x, r, c, edge)
                s = s + v * v
        t = delta + alpha / (kw * kh) * s
        return x[:, :, i, j] * t ** (-beta)

    return _per_pixel(x, pixel)


def ref_contrast(x, kw, kh, alpha, beta, delta, p0, pm, ps, edge) -> torch.Tensor:
    k = kw * kh

    def pixel(i, j):
        s1 = torch.zeros(x.shape[:2], dtype=x.dtype)
        s2 = torch.zeros(x.shape[:2], dtype=x.dtype)
        for r in _taps(i, kh):
            for c in _taps(j, kw):
                v = _read(x, r, c, edge)
                s1 = s1 + v
                s2 = s2 + v * v
        mean = s1 / k
        var = torch.clamp(s2 / k - mean * mean, min=0.0)
        return pm + ps * (x[:, :, i, j] - p0 * mean) / (delta + alpha * var) ** beta

    return _per_pixel(x, pixel)


def ref_lrn(x, size, alpha, beta, delta) -> torch.Tensor:
    """One channel at a time from Q(k) = [max(0, k - N//2), min(C-1, k + (N-1)//2)]."""
    c = x.shape[1]
    out = []
    for k in range(c):
        s = torch.zeros(x.shape[0], *x.shape[2:], dtype=x.dtype)
        for q in range(max(0, k - size // 2), min(c - 1, k + (size - 1) // 2) + 1):
            s = s + x[:, q] ** 2
        out.append(x[:, k] * (delta + alpha / size * s) ** (-beta))
    return torch.stack(out, 1)


# -- the three operations behind one interface ------------------------------------------------


def _ops(kind: str, kw: int, kh: int, edge: EdgeMode):
    """(ours forward, ours backward, loop reference), each a function of x (and g)."""
    if kind == "spatial":
        p = SPATIAL
        return (
            lambda x: spatial_norm_forward(x, kw, kh, **p, edge=edge),
            lambda g, x: spatial_norm_backward(g, x, kw, kh, **p, edge=edge),
            lambda x: ref_spatial(x, kw, kh, **p, edge=edge),
        )
    if kind == "contrast":
        p = CONTRAST
        return (
            lambda x: local_contrast_norm_forward(x, kw, kh, **p, edge=edge),
            lambda g, x: local_contrast_norm_backward(g, x, kw, kh, **p, edge=edge),
            lambda x: ref_contrast(x, kw, kh, **p, edge=edge),
        )
    size = kw  # cross-channel: kw is the channel window
    return (
        lambda x: cross_channel_norm_forward(x, size, **LRN),
        lambda g, x: cross_channel_norm_backward(g, x, size, **LRN),
        lambda x: F.local_response_norm(x, size, LRN["alpha"], LRN["beta"], LRN["delta"]),
    )


# -- cross-channel ----------------------------------------------------------------------------


@pytest.mark.parametrize("channels", [1, 3, 6])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8])
def test_cross_channel_matches_torch_and_the_loop_reference(size, channels) -> None:
    """Odd and even sizes, sizes beyond the channel count; forward and gradient."""
    x = _randn((2, channels, 3, 4), 10 + size)
    g = _randn((2, channels, 3, 4), 20 + size)
    y = cross_channel_norm_forward(x, size, **LRN)
    xr = x.clone().requires_grad_()
    want = F.local_response_norm(xr, size, LRN["alpha"], LRN["beta"], LRN["delta"])
    assert_close(y, want.detach(), f"lrn size {size}", tol=1e-13)
    assert_close(y, ref_lrn(x, size, **LRN), f"lrn size {size} vs loop", tol=1e-13)
    (wx,) = torch.autograd.grad(want, xr, g)
    assert_close(cross_channel_norm_backward(g, x, size, **LRN), wx, f"lrn dx {size}", tol=1e-12)


def test_cross_channel_mps_default_parameters() -> None:
    """alpha 1, beta 5, delta 1 (steep power), size 5."""
    x, g = _randn((2, 7, 3, 3), 30), _randn((2, 7, 3, 3), 31)
    p = dict(alpha=1.0, beta=5.0, delta=1.0)
    xr = x.clone().requires_grad_()
    want = F.local_response_norm(xr, 5, 1.0, 5.0, 1.0)
    assert_close(cross_channel_norm_forward(x, 5, **p), want.detach(), "lrn", tol=1e-13)
    (wx,) = torch.autograd.grad(want, xr, g)
    assert_close(cross_channel_norm_backward(g, x, 5, **p), wx, "lrn dx", tol=1e-12)


# -- spatial and local contrast against the loop reference -------------------------------------


@pytest.mark.parametrize("edge", EDGES, ids=lambda e: e.name)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("kind", ["spatial", "contrast"])
@pytest.mark.parametrize("device", DEVICES)
def test_windowed_norms_match_the_loop_reference(kind, window, edge, device) -> None:
    kw, kh, h, w = window
    fwd, bwd, ref = _ops(kind, kw, kh, edge)
    x = _randn((2, 2, h, w), 40 + kw * 7 + kh) * 1.5 + 0.3
    g = _randn((2, 2, h, w), 50 + kw * 7 + kh)
    xr = x.clone().requires_grad_()
    want = ref(xr)
    xd, gd = x.to(device), g.to(device)
    assert_close(fwd(xd), want.detach(), f"{kind} {window} {edge.name}", tol=1e-13)
    (wx,) = torch.autograd.grad(want, xr, g)
    assert_close(bwd(gd, xd), wx, f"{kind} dx {window} {edge.name}", tol=1e-12)


def test_edge_modes_differ() -> None:
    """The two edge rules must give different results at the border (so the reference tests
    above tell them apart)."""
    x = _randn((1, 2, 4, 5), 60) + 1.0
    for fwd in (
        lambda e: spatial_norm_forward(x, 3, 3, **SPATIAL, edge=e),
        lambda e: local_contrast_norm_forward(x, 3, 3, **CONTRAST, edge=e),
    ):
        zero, clamp = fwd(EdgeMode.ZERO), fwd(EdgeMode.CLAMP)
        assert_close(zero[..., 1:-1, 1:-1], clamp[..., 1:-1, 1:-1], "interior", tol=1e-14)
        assert (zero - clamp).abs().max() > 1e-3


def test_mps_default_parameters_match_the_loop_reference() -> None:
    """Spatial: alpha 1, beta 5, delta 1; local contrast: alpha 1, beta 0.5, delta 1/1024,
    p0 1, pm 0, ps 1."""
    x, g = _randn((1, 3, 5, 5), 61), _randn((1, 3, 5, 5), 62)
    sp = dict(alpha=1.0, beta=5.0, delta=1.0)
    lc = dict(alpha=1.0, beta=0.5, delta=1.0 / 1024, p0=1.0, pm=0.0, ps=1.0)
    for edge in EDGES:
        xr = x.clone().requires_grad_()
        want = ref_spatial(xr, 3, 3, **sp, edge=edge)
        assert_close(spatial_norm_forward(x, 3, 3, **sp, edge=edge), want.detach(), "sp", tol=1e-13)
        (wx,) = torch.autograd.grad(want, xr, g)
        assert_close(spatial_norm_backward(g, x, 3, 3, **sp, edge=edge), wx, "sp dx", tol=1e-12)
        xr = x.clone().requires_grad_()
        want = ref_contrast(xr, 3, 3, **lc, edge=edge)
        got = local_contrast_norm_forward(x, 3, 3, **lc, edge=edge)
        assert_close(got, want.detach(), "lcn", tol=1e-13)
        (wx,) = torch.autograd.grad(want, xr, g)
        got = local_contrast_norm_backward(g, x, 3, 3, **lc, edge=edge)
        assert_close(got, wx, "lcn dx", tol=1e-12)


# -- adjoint tests ----------------------------------------------------------------------------

ADJOINT_CASES = [
    ("lrn", 3, 1, EdgeMode.ZERO),
    ("lrn", 4, 1, EdgeMode.ZERO),
    *[
        (k, kw, kh, e)
        for k in ("spatial", "contrast")
        for kw, kh in ((3, 3), (2, 4))
        for e in EDGES
    ],
    ("contrast", 5, 2, EdgeMode.CLAMP),
]


@pytest.mark.parametrize("kind,kw,kh,edge", ADJOINT_CASES, ids=str)
def test_backward_is_the_adjoint_of_the_forward(kind, kw, kh, edge) -> None:
    """``backward(w)`` equals autograd of our forward for the cotangent ``w``, and
    ``<J v, w> = <v, backward(w)>`` with ``J v`` from autograd.functional.jvp."""
    fwd, bwd, _ = _ops(kind, kw, kh, edge)
    x = _randn((2, 5, 4, 5), 70) + 0.2
    v, w = _randn(x.shape, 71), _randn(x.shape, 72)
    _, jv = torch.autograd.functional.jvp(fwd, x, v)
    jtw = bwd(w, x)
    xr = x.clone().requires_grad_()
    (ax,) = torch.autograd.grad(fwd(xr), xr, w)
    assert_close(jtw, ax, f"{kind} backward vs autograd of forward", tol=1e-12)
    assert_adjoint(jv, w, v, jtw, f"{kind} {kw}x{kh} {edge.name}")


# -- storage dtypes ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "kind,kw,kh,edge",
    [
        ("lrn", 5, 1, EdgeMode.ZERO),
        ("lrn", 2, 1, EdgeMode.ZERO),
        ("spatial", 3, 2, EdgeMode.ZERO),
        ("spatial", 3, 3, EdgeMode.CLAMP),
        ("contrast", 3, 3, EdgeMode.ZERO),
        ("contrast", 2, 3, EdgeMode.CLAMP),
    ],
    ids=str,
)
@pytest.mark.parametrize("device", DEVICES)
def test_storage_dtypes(kind, kw, kh, edge, dtype, device) -> None:
    """Inputs rounded to ``dtype``; reference in float64 on the rounded values."""
    fwd, bwd, ref = _ops(kind, kw, kh, edge)
    x = (_randn((2, 4, 5, 6), 80) * 1.5 + 0.3).to(dtype)
    g = _randn((2, 4, 5, 6), 81).to(dtype)
    y, dx = fwd(x.to(device)), bwd(g.to(device), x.to(device))
    assert y.dtype == dtype and y.device == x.to(device).device and dx.dtype == dtype
    xr = x.detach().double().clone().requires_grad_()
    want = ref(xr)
    (wx,) = torch.autograd.grad(want, xr, g.double())
    assert_close(y, want.detach(), f"{kind} y {dtype}", dtype=dtype)
    assert_close(dx, wx, f"{kind} dx {dtype}", dtype=dtype)


# -- all-zero windows -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("edge", EDGES, ids=lambda e: e.name)
def test_all_zero_windows_are_finite(edge, dtype) -> None:
    x = _randn((1, 3, 7, 8), 90) + 0.5
    x[:, :, :4, :4] = 0.0  # windows up to 3x3 around the top-left corner read only zeros
    x[:, 1] = 0.0  # a whole channel of zeros (LRN windows of size 1 there are all zero)
    x = x.to(dtype)
    g = _randn(x.shape, 91).to(dtype)

    # delta > 0: a regular point; the values follow the formulas (y = 0 or pm there).
    for kind in ("lrn", "spatial", "contrast"):
        kw = 1 if kind == "lrn" else 3
        fwd, bwd, ref = _ops(kind, kw, 3, edge)
        y, dx = fwd(x), bwd(g, x)
        xr = x.detach().double().clone().requires_grad_()
        want = ref(xr)
        (wx,) = torch.autograd.grad(want, xr, g.double())
        tol = 1e-12 if dtype == F64 else None
        assert_close(y, want.detach(), f"{kind} y", tol=tol, dtype=dtype)
        assert_close(dx, wx, f"{kind} dx", tol=tol, dtype=dtype)
    assert_close(
        local_contrast_norm_forward(x, 3, 3, **CONTRAST, edge=edge)[:, :, :3, :3],
        torch.full((1, 3, 3, 3), CONTRAST["pm"], dtype=F64),
        "contrast y = pm on zero windows",
        dtype=dtype,
    )

    # delta = 0: no derivative where a window is all zero; finite by convention (power 0).
    for y, dx in (
        (
            cross_channel_norm_forward(x, 1, 1.0, 0.75, 0.0),
            cross_channel_norm_backward(g, x, 1, 1.0, 0.75, 0.0),
        ),
        (
            spatial_norm_forward(x, 3, 3, 1.0, 0.75, 0.0, edge),
            spatial_norm_backward(g, x, 3, 3, 1.0, 0.75, 0.0, edge),
        ),
        (
            local_contrast_norm_forward(x, 3, 3, 1.0, 0.5, 0.0, 0.8, 0.3, 1.7, edge),
            local_contrast_norm_backward(g, x, 3, 3, 1.0, 0.5, 0.0, 0.8, 0.3, 1.7, edge),
        ),
    ):
        assert torch.isfinite(y.double()).all() and torch.isfinite(dx.double()).all()
        assert not dx[:, 1].any()  # the all-zero channel: power 0, no gradient
    lrn = cross_channel_norm_forward(x, 1, 1.0, 0.75, 0.0)
    xd = x.double()
    want = xd * (xd * xd).pow(-0.75)  # size 1: y = x |x|^(-1.5) where x != 0
    nz = xd != 0
    assert_close(lrn.double()[nz], want[nz], "lrn delta 0, nonzero pixels", dtype=dtype)
    assert not lrn.double()[~nz].any()


def test_invalid_arguments() -> None:
    x = torch.zeros(1, 2, 3, 3)
    with pytest.raises(ValueError, match="size"):
        cross_channel_norm_forward(x, 0, 1.0, 0.75, 1.0)
    with pytest.raises(ValueError, match="kw"):
        spatial_norm_forward(x, 0, 3, 1.0, 0.75, 1.0, EdgeMode.ZERO)
    with pytest.raises(ValueError, match="edge"):
        local_contrast_norm_forward(x, 3, 3, 1.0, 0.5, 0.1, 1.0, 0.0, 1.0, EdgeMode.MIRROR)
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        spatial_norm_forward(x[0], 3, 3, 1.0, 0.75, 1.0, EdgeMode.CLAMP)
    with pytest.raises(ValueError, match="g shape"):
        spatial_norm_backward(x[:, :1], x, 3, 3, 1.0, 0.75, 1.0, EdgeMode.CLAMP)
