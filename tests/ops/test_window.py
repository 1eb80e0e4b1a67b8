"""Window extraction and its adjoint, against a naive gather, on every kind of window: inside,
straddling either edge, wholly outside, one-pixel sources, one-pixel overlaps."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from mpsnn.core.geometry import AxisWindow, EdgeMode
from mpsnn.ops.window import apply_extract, apply_extract_adjoint, plan_extract
from tests.helpers import assert_adjoint, assert_close


def _naive(x: torch.Tensor, ay: AxisWindow, ax: AxisWindow, edge: EdgeMode) -> torch.Tensor:
    """x_ext[a, b] = source[ay.start + a, ax.start + b] with the edge rule, no padding tricks."""
    h, w = x.shape[-2:]
    ly, lx = ay.stop - ay.start, ax.stop - ax.start
    out = torch.zeros(*x.shape[:2], ly, lx, dtype=x.dtype)
    for a in range(ly):
        for b in range(lx):
            sy, sx = ay.start + a, ax.start + b
            if 0 <= sy < h and 0 <= sx < w:
                out[..., a, b] = x[..., sy, sx]
            elif edge is EdgeMode.CLAMP:
                out[..., a, b] = x[..., min(max(sy, 0), h - 1), min(max(sx, 0), w - 1)]
    return out


def _full(t: torch.Tensor, pads: tuple[int, int]) -> torch.Tensor:
    return torch.nn.functional.pad(t, (pads[1], pads[1], pads[0], pads[0]))


def _axes(seed: int) -> list[tuple[AxisWindow, AxisWindow]]:
    r = random.Random(seed)
    out = []
    for _ in range(60):
        ws = []
        for _axis in range(2):
            size = r.choice([1, 2, 3, 6])
            k, s, d = r.randint(1, 3), r.randint(1, 2), r.randint(1, 2)
            start = r.randint(-8, size + 2)
            ws.append(AxisWindow(start, r.randint(1, 4), k, s, d, size))
        out.append((ws[0], ws[1]))
    return out


@pytest.mark.parametrize("edge", [EdgeMode.ZERO, EdgeMode.CLAMP], ids=lambda e: e.name)
@pytest.mark.parametrize("allow_pad", [True, False])
def test_extract_and_adjoint_on_random_windows(edge: EdgeMode, allow_pad: bool) -> None:
    gen = torch.Generator().manual_seed(51)
    modes = set()
    for ay, ax in _axes(52 + allow_pad):
        x = torch.randn(2, 3, ay.size, ax.size, generator=gen, dtype=torch.float64)
        plan = plan_extract(ay, ax, edge, allow_pad=allow_pad)
        modes.add((plan.y.mode, plan.x.mode))
        got = _full(apply_extract(x, plan), plan.pads)
        want = _naive(x, ay, ax, edge)
        # the operator reads [start, stop): compare on the window's own span
        oy, ox = plan.y.lo - plan.y.pad - ay.start, plan.x.lo - plan.x.pad - ax.start
        assert oy <= 0 and ox <= 0
        got = got[:, :, -oy : -oy + want.shape[2], -ox : -ox + want.shape[3]]
        assert_close(got, want, f"extract {ay} {ax} {edge.name}", tol=0)
        # adjoint: <E v, w> = <v, E^T w> with w shaped like the (unpadded) extraction
        v = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        t = apply_extract(v, plan)
        w = torch.randn(t.shape, generator=gen, dtype=torch.float64)
        back = apply_extract_adjoint(w, plan)
        assert back.shape == x.shape
        off_image = any(a.stop <= 0 or a.start >= a.size for a in (ay, ax))
        if edge is EdgeMode.ZERO and off_image:  # reads only zeros: nothing flows back
            assert back.abs().max() == 0 and t.abs().max() == 0
        else:
            assert_adjoint(t, w, v, back, f"extract adjoint {ay} {ax} {edge.name}", tol=1e-12)
    assert len(modes) >= 3  # the random windows exercised several combinations of modes


def test_clamp_adjoint_sums_every_overflow_onto_the_edge() -> None:
    """1-D example from the MPS pad header: clamp, 2 before and 3 after, 3 pixels."""
    ay = AxisWindow(0, 1, 1, 1, 1, 1)
    ax = AxisWindow(-2, 8, 1, 1, 1, 3)
    plan = plan_extract(ay, ax, EdgeMode.CLAMP)
    d = torch.arange(1.0, 9.0).view(1, 1, 1, 8)  # d0..d7 = 1..8
    back = apply_extract_adjoint(d, plan).flatten().tolist()
    assert back == [1 + 2 + 3, 4, 5 + 6 + 7 + 8]  # [d0+d1+d2, d3, d4+d5+d6+d7]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_clamp_extraction(dtype) -> None:
    x = torch.randn(1, 2, 4, 5).to(dtype)
    for ay, ax in itertools.product(
        [AxisWindow(-2, 3, 3, 1, 1, 4)], [AxisWindow(1, 4, 3, 1, 1, 5)]
    ):
        plan = plan_extract(ay, ax, EdgeMode.CLAMP)
        got = apply_extract(x, plan)
        assert got.dtype == dtype
        assert torch.equal(got, _naive(x, ay, ax, EdgeMode.CLAMP))
