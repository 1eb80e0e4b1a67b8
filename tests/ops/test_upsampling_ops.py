"""Upsampling as gathers (`mpsnn.ops.upsampling`): forward and gradient against a dense float64
matrix reference built by loops from the sampling formulas (nearest, bilinear with both
align_corners values, ZERO and CLAMP edges, offsets, partial destinations, scales 1 to 3),
against ``F.interpolate`` and its autograd where they apply; every dtype; the adjoint
(dot-product) test; determinism; exactness with TF32 allowed."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from mpsnn.ops.upsampling import (
    AxisSampling,
    UpsampleGeometry,
    upsample_backward,
    upsample_forward,
)
from tests.helpers import DEVICES, TOL, assert_adjoint, assert_close

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


@functools.cache
def _matrix(a: AxisSampling, bilinear: bool, align_corners: bool) -> torch.Tensor:
    """(count, size) float64: row k holds the weights output first + k puts on each pixel
    (cached: read only)."""
    m = torch.zeros(a.count, a.size, dtype=torch.float64)
    for k in range(a.count):
        u = a.first + k
        if bilinear:
            if align_corners:
                out = a.size * a.scale
                p = a.offset + (u * (a.size - 1) / (out - 1) if out > 1 else 0.0)
            else:
                p = a.offset + (u + 0.5) / a.scale - 0.5
            taps = [
                (math.floor(p), 1 - (p - math.floor(p))),
                (math.floor(p) + 1, p - math.floor(p)),
            ]
        else:
            taps = [(a.offset + u // a.scale, 1.0)]
        for i, w in taps:
            if a.clamp:
                m[k, min(max(i, 0), a.size - 1)] += w
            elif 0 <= i < a.size:
                m[k, i] += w
    return m


def _reference(x: torch.Tensor, geom: UpsampleGeometry) -> torch.Tensor:
    my = _matrix(geom.y, geom.bilinear, geom.align_corners)
    mx = _matrix(geom.x, geom.bilinear, geom.align_corners)
    return torch.einsum("ui,ncij,vj->ncuv", my, x.double(), mx)


def _reference_adjoint(g: torch.Tensor, geom: UpsampleGeometry) -> torch.Tensor:
    my = _matrix(geom.y, geom.bilinear, geom.align_corners)
    mx = _matrix(geom.x, geom.bilinear, geom.align_corners)
    return torch.einsum("ui,ncuv,vj->ncij", my, g.double(), mx)


def _axes(size: int, scale: int, clamp: bool) -> list[AxisSampling]:
    """Whole destinations, offsets either way, partial destinations (first, count), and
    destinations reaching past the source."""
    whole = size * scale
    return [
        AxisSampling(0, 0, whole, size, scale, clamp),
        AxisSampling(-2, 0, whole, size, scale, clamp),
        AxisSampling(1, 0, whole + 3, size, scale, clamp),
        AxisSampling(0, 1, max(1, whole - 2), size, scale, clamp),
        AxisSampling(-1, 3, whole + 4, size, scale, clamp),
        AxisSampling(size + 2, 0, 3, size, scale, clamp),  # wholly past the source
    ]


def _geometries():
    for bilinear, align, clamp in itertools.product([False, True], [False, True], [True, False]):
        if align and not bilinear:
            continue
        for sy, sx in [(1, 1), (2, 3), (3, 2)]:
            for hy, wx in [(1, 4), (5, 1), (4, 5)]:
                for ay, ax in zip(_axes(hy, sy, clamp), _axes(wx, sx, clamp)[::-1], strict=True):
                    yield UpsampleGeometry(ay, ax, bilinear, align, standard=False)


GEOMETRIES = list(_geometries())


def _name(geom: UpsampleGeometry) -> str:
    kind = "bilinear" + ("-align" if geom.align_corners else "") if geom.bilinear else "nearest"
    return f"{kind} y={tuple(geom.y)} x={tuple(geom.x)}"


@pytest.fixture
def deterministic_algorithms():
    """Make PyTorch refuse the ops it knows to be nondeterministic (on CUDA: atomic adds)."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_and_gradient_match_the_matrix_reference(dtype, device) -> None:
    gen = torch.Generator().manual_seed(21)
    for geom in GEOMETRIES:
        what = f"{_name(geom)} {dtype}"
        x = torch.randn(2, 3, geom.y.size, geom.x.size, generator=gen, dtype=torch.float64)
        g = torch.randn(2, 3, geom.y.count, geom.x.count, generator=gen, dtype=torch.float64)
        x, g = x.to(dtype), g.to(dtype)
        y = upsample_forward(x.to(device), geom)
        dx = upsample_backward(g.to(device), geom)
        assert y.dtype == dtype and dx.dtype == dtype, what
        want = _reference(x, geom)
        if not geom.bilinear:  # nearest copies: bit-exact in every dtype
            assert torch.equal(y.cpu().double(), want), what
        else:
            tol = 1e-14 if dtype == torch.float64 else None
            assert_close(y, want, what, tol=tol, dtype=dtype)
        tol = 1e-14 if dtype == torch.float64 else None
        assert_close(dx, _reference_adjoint(g, geom), what, tol=tol, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
def test_nearest_gradient_is_exact_on_small_integers(dtype, device) -> None:
    gen = torch.Generator().manual_seed(22)
    for geom in GEOMETRIES:
        if geom.bilinear:
            continue
        g = torch.randint(-4, 5, (1, 2, geom.y.count, geom.x.count), generator=gen).to(dtype)
        dx = upsample_backward(g.to(device), geom)
        assert torch.equal(dx.cpu().double(), _reference_adjoint(g, geom)), _name(geom)


@pytest.mark.parametrize("device", DEVICES)
def test_adjoint(device) -> None:
    """<up(v), w> == <v, up^T(w)> in float64 with random v and w."""
    gen = torch.Generator().manual_seed(23)
    for geom in GEOMETRIES:
        v = torch.randn(2, 2, geom.y.size, geom.x.size, generator=gen, dtype=torch.float64)
        w = torch.randn(2, 2, geom.y.count, geom.x.count, generator=gen, dtype=torch.float64)
        jv = upsample_forward(v.to(device), geom)
        if not jv.abs().sum() > 0:
            continue  # wholly outside with ZERO edges: the map is 0
        jtw = upsample_backward(w.to(device), geom)
        assert_adjoint(jv, w, v, jtw, f"upsample adjoint {_name(geom)}", tol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "mode, align", [("nearest", False), ("bilinear", False), ("bilinear", True)]
)
def test_gathers_equal_interpolate_and_its_autograd(mode, align, device) -> None:
    """CLAMP, offset 0, whole destination through the gathers (standard=False) and through
    F.interpolate (standard=True): the same values and gradients."""
    gen = torch.Generator().manual_seed(24)
    bilinear = mode == "bilinear"
    for (h, w), (sy, sx) in itertools.product(
        [(1, 1), (1, 5), (4, 3), (7, 6)], [(1, 1), (2, 3), (3, 2)]
    ):
        ay = AxisSampling(0, 0, h * sy, h, sy, True)
        ax = AxisSampling(0, 0, w * sx, w, sx, True)
        gather = UpsampleGeometry(ay, ax, bilinear, align, standard=False)
        standard = gather._replace(standard=True)
        x = torch.randn(2, 3, h, w, generator=gen, dtype=torch.float64).to(device)
        g = torch.randn(2, 3, h * sy, w * sx, generator=gen, dtype=torch.float64).to(device)
        what = f"{mode} align={align} {h}x{w} scale {sy}x{sx}"
        xr = x.clone().requires_grad_(True)
        kw = dict(align_corners=align) if bilinear else {}
        want = F.interpolate(xr, size=(h * sy, w * sx), mode=mode, **kw)
        (want_dx,) = torch.autograd.grad(want, xr, g)
        assert_close(upsample_forward(x, gather), want, what, tol=1e-14)
        assert_close(upsample_forward(x, standard), want, what, tol=1e-14)
        assert_close(upsample_backward(g, gather), want_dx, what, tol=1e-14)
        assert_close(upsample_backward(g, standard), want_dx, what, tol=1e-14)
        if not bilinear:
            assert torch.equal(upsample_forward(x, gather), want), what


@pytest.mark.parametrize("device", DEVICES)
def test_results_are_deterministic_and_fresh(device, deterministic_algorithms) -> None:
    gen = torch.Generator().manual_seed(25)
    for bilinear, clamp in itertools.product([False, True], [False, True]):
        ay = AxisSampling(-3, 2, 61, 17, 3, clamp)
        ax = AxisSampling(2, 1, 40, 13, 2, clamp)
        geom = UpsampleGeometry(ay, ax, bilinear, False, standard=False)
        x = torch.randn(3, 4, 17, 13, generator=gen).to(device)
        g = torch.randn(3, 4, 61, 40, generator=gen).to(device)
        assert torch.equal(upsample_forward(x, geom), upsample_forward(x, geom))
        assert torch.equal(upsample_backward(g, geom), upsample_backward(g, geom))
    # Scale 1 at offset 0 with ZERO edges is a copy: the results are not views of the inputs.
    one = AxisSampling(0, 0, 5, 5, 1, False)
    geom = UpsampleGeometry(one, one, False, False, standard=False)
    x = torch.randn(1, 2, 5, 5, generator=gen).to(device)
    for op in (upsample_forward, upsample_backward):
        out = op(x, geom)
        assert torch.equal(out, x)
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()


def test_gradient_work_is_linear_and_uses_windows() -> None:
    """The interior sums unfolded windows (no index); CLAMP outputs far past the source pile
    onto the edge pixel without widening the other rows: at most twice the contributions."""
    from mpsnn.ops.upsampling import _axis_plan

    for bilinear, align in [(False, False), (True, False), (True, True)]:
        for scale in (2, 3):
            a = AxisSampling(-5, 0, 3000, 100, scale, True)  # most outputs clamp to the end
            plan = _axis_plan(a, bilinear, align).adjoint
            assert plan.window is not None and plan.window[1] >= 80, (bilinear, align, scale)
            entries = sum(rows * width for rows, width, _, _ in plan.groups)
            entries += plan.window[1] * plan.window[4]
            assert entries <= 2 * 2 * a.count, (bilinear, align, scale, entries)
            whole = AxisSampling(0, 0, 100 * scale, 100, scale, True)
            assert _axis_plan(whole, bilinear, align).adjoint.window[1] >= 96


@pytest.mark.parametrize("device", DEVICES)
def test_float32_is_exact_with_tf32_allowed(device) -> None:
    """TF32 matmuls allowed: float32 results equal the float64 reference to float32 rounding
    (nearest copies exactly; bilinear rounds only its float32 weights and sums)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    try:
        gen = torch.Generator().manual_seed(26)
        for bilinear, align, clamp in [
            (False, False, True),
            (True, False, False),
            (True, True, True),
        ]:
            ay = AxisSampling(-1, 1, 40, 9, 3, clamp)
            ax = AxisSampling(1, 0, 70, 33, 2, clamp)
            geom = UpsampleGeometry(ay, ax, bilinear, align, standard=False)
            x = torch.randn(2, 3, 9, 33, generator=gen).float()
            g = torch.randn(2, 3, 40, 70, generator=gen).float()
            y = upsample_forward(x.to(device), geom).cpu().double()
            dx = upsample_backward(g.to(device), geom).cpu().double()
            if not bilinear:
                assert torch.equal(y, _reference(x, geom))
            # Per element: |error| <= 20 * 2^-24 * sum |weight * term|.
            for got, exact, bound in [
                (y, _reference(x, geom), _reference(x.abs(), geom)),
                (dx, _reference_adjoint(g, geom), _reference_adjoint(g.abs(), geom)),
            ]:
                err = (got - exact).abs()
                assert (err <= 20 * 2.0**-24 * bound).all(), (bilinear, err.max().item())
                assert_close(got, exact, "tf32", tol=TOL[torch.float32])
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
