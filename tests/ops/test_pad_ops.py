"""Padding as gathers (`mpsnn.ops.shape`): forward and gradient against a dense float64 matrix
reference built by loops, for every edge mode, paddings wider than the image (several
reflections), one-pixel axes, negative and positive starts, crops; every dtype; the adjoint
(dot-product) test; determinism; exactness with TF32 allowed."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from mpsnn.core.geometry import EdgeMode
from mpsnn.ops.shape import apply_axis_adjoint, axis_adjoint, pad_axis, pad_backward, pad_forward
from tests.helpers import DEVICES, TOL, assert_adjoint, assert_close

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]

# (start, count, size) of one axis: output u reads coordinate start + u of a size-pixel source.
AXES = [
    (-2, 8, 3),  # 2 before, 3 after
    (-4, 8, 3),  # 4 before, 1 after
    (-7, 20, 3),  # several reflections on both sides
    (-3, 7, 1),  # one-pixel source
    (0, 1, 1),  # one pixel, no padding
    (1, 3, 6),  # crop, positive start
    (-2, 4, 6),  # padding before, crop after
    (2, 9, 4),  # positive start past the end
    (0, 5, 5),  # identity
    (-10, 3, 4),  # wholly before the source
    (5, 30, 4),  # wholly after, long
]

# (mode, fill, constant_outside) as `Pad` calls it; fill "per-channel" means one per channel.
CASES = {
    "zero": (EdgeMode.ZERO, 0.0, False),
    "zero-fill": (EdgeMode.ZERO, 1.5, False),  # padded channels take 1.5, outside reads 0
    "constant": (EdgeMode.CONSTANT, 2.5, True),
    "constant-per-channel": (EdgeMode.CONSTANT, "per-channel", True),
    "clamp": (EdgeMode.CLAMP, -0.75, False),
    "mirror": (EdgeMode.MIRROR, 0.0, False),
    "mirror-edge": (EdgeMode.MIRROR_WITH_EDGE, 3.0, False),
    "mirror-per-channel": (EdgeMode.MIRROR, "per-channel", False),
}

CB, CA = 1, 2  # channels before and after the source's


def _source_index(i: int, size: int, mode: EdgeMode) -> int | None:
    """Coordinate i of a size-pixel axis under the edge mode, reflecting step by step."""
    if 0 <= i < size:
        return i
    if mode in (EdgeMode.ZERO, EdgeMode.CONSTANT):
        return None
    if mode is EdgeMode.CLAMP or size == 1:
        return min(max(i, 0), size - 1)
    while not 0 <= i < size:
        if mode is EdgeMode.MIRROR:  # ... 2 1 | 0 1 2 | 1 0 ...
            i = -i if i < 0 else 2 * (size - 1) - i
        else:  # ... 1 0 | 0 1 2 | 2 1 ...
            i = -i - 1 if i < 0 else 2 * size - 1 - i
    return i


def _matrix(start: int, count: int, size: int, mode: EdgeMode) -> torch.Tensor:
    m = torch.zeros(count, size, dtype=torch.float64)
    for u in range(count):
        i = _source_index(start + u, size, mode)
        if i is not None:
            m[u, i] = 1.0
    return m


def _fill_values(fill, out_channels: int) -> float | torch.Tensor:
    if fill == "per-channel":
        return torch.tensor([0.5 - 1.25 * k for k in range(out_channels)], dtype=torch.float64)
    return fill


def _reference_forward(x, y_axis, x_axis, mode, fill, constant_outside, dtype):
    """Padded x in float64: M_y x M_x^T, fill where a row of M_y or M_x is empty."""
    my, mx = _matrix(*y_axis, mode), _matrix(*x_axis, mode)
    n, c = x.shape[:2]
    out_c = CB + c + CA
    if isinstance(fill, torch.Tensor):
        f = fill
    else:
        f = torch.full((out_c,), float(fill), dtype=torch.float64)
    # The op stores the fill value as a value of the accumulation dtype, then of x's dtype.
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    f = f.to(wide).to(dtype).double()
    out = f.view(1, -1, 1, 1).repeat(n, 1, my.shape[0], mx.shape[0])
    body = torch.einsum("ui,ncij,vj->ncuv", my, x.double(), mx)
    read = my.sum(1).view(-1, 1) * mx.sum(1).view(1, -1)  # 1 where a source is read
    outside = f[CB : CB + c].view(1, -1, 1, 1) if constant_outside else 0.0
    out[:, CB : CB + c] = torch.where(read.bool(), body, outside)
    return out


def _reference_backward(g, y_axis, x_axis, mode, c):
    my, mx = _matrix(*y_axis, mode), _matrix(*x_axis, mode)
    return torch.einsum("ui,ncuv,vj->ncij", my, g[:, CB : CB + c].double(), mx)


def _run(x, g, y_axis, x_axis, mode, fill, constant_outside):
    ay, ax = pad_axis(*y_axis, mode), pad_axis(*x_axis, mode)
    c = x.shape[1]
    y = pad_forward(
        x,
        ay,
        ax,
        channel_before=CB,
        out_channels=CB + c + CA,
        fill=fill,
        constant_outside=constant_outside,
    )
    dx = pad_backward(g, ay, ax, channel_before=CB, channels=c)
    return y, dx


def test_pad_axis_maps_every_mode_like_the_loop_reference() -> None:
    for (start, count, size), mode in itertools.product(AXES, EdgeMode):
        a = pad_axis(start, count, size, mode)
        want = [_source_index(start + u, size, mode) for u in range(count)]
        assert a.source == tuple(-1 if i is None else i for i in want), (start, count, size, mode)
        have = [u for u, i in enumerate(want) if i is not None]
        assert (a.lo, a.hi) == ((have[0], have[-1] + 1) if have else (0, 0))
    assert pad_axis(-3, 9, 3, EdgeMode.MIRROR).source == (1, 2, 1, 0, 1, 2, 1, 0, 1)
    assert pad_axis(-3, 9, 3, EdgeMode.MIRROR_WITH_EDGE).source == (2, 1, 0, 0, 1, 2, 2, 1, 0)
    assert pad_axis(-2, 5, 1, EdgeMode.MIRROR).source == (0,) * 5
    assert pad_axis(-2, 7, 3, EdgeMode.CLAMP).source == (0, 0, 0, 1, 2, 2, 2)
    assert pad_axis(-2, 7, 3, EdgeMode.ZERO).source == (-1, -1, 0, 1, 2, -1, -1)


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_examples(device) -> None:
    """CLAMP 2 before / 3 after and MIRROR 4 before / 1 after on 3 pixels."""
    d = torch.tensor([3.0, -1.0, 4.0, 1.5, -5.0, 9.0, 2.0, 6.0], dtype=torch.float64)
    g = torch.zeros(1, CB + 1 + CA, 1, 8, dtype=torch.float64)
    g[:, CB, 0] = d
    g[:, 0] = 100.0  # padded channels pass nothing back
    g = g.to(device)
    one = pad_axis(0, 1, 1, EdgeMode.ZERO)
    clamp = pad_backward(g, one, pad_axis(-2, 8, 3, EdgeMode.CLAMP), channel_before=CB, channels=1)
    assert clamp.flatten().tolist() == [d[0] + d[1] + d[2], d[3], d[4] + d[5] + d[6] + d[7]]
    mirror = pad_backward(
        g, one, pad_axis(-4, 8, 3, EdgeMode.MIRROR), channel_before=CB, channels=1
    )
    assert mirror.flatten().tolist() == [d[0] + d[4], d[1] + d[3] + d[5] + d[7], d[2] + d[6]]


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
@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_gradient_match_the_matrix_reference(case, dtype, device) -> None:
    mode, fill, constant_outside = CASES[case]
    gen = torch.Generator().manual_seed(7)
    n, c = 2, 2
    fill = _fill_values(fill, CB + c + CA)
    for y_axis, x_axis in itertools.product(AXES[:8], AXES[2:]):
        what = f"{case} {dtype} y={y_axis} x={x_axis}"
        x = torch.randn(n, c, y_axis[2], x_axis[2], generator=gen, dtype=torch.float64)
        g = torch.randn(n, CB + c + CA, y_axis[1], x_axis[1], generator=gen, dtype=torch.float64)
        x, g = x.to(dtype), g.to(dtype)  # the references read the rounded values
        y, dx = _run(x.to(device), g.to(device), y_axis, x_axis, mode, fill, constant_outside)
        assert y.dtype == dtype and dx.dtype == dtype, what
        # The forward copies: bit-exact in every dtype.
        want = _reference_forward(x, y_axis, x_axis, mode, fill, constant_outside, dtype)
        assert torch.equal(y.cpu().double(), want), what
        assert dx.shape == (n, c, y_axis[2], x_axis[2]), what
        assert_close(dx, _reference_backward(g, y_axis, x_axis, mode, c), what, dtype=dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(EdgeMode), ids=lambda e: e.name)
def test_gradient_is_exact_on_small_integers(mode, dtype, device) -> None:
    """Integer gradients whose sums every dtype holds exactly: the gradient equals the
    reference bit for bit (no rounding beyond the sums, no weights)."""
    gen = torch.Generator().manual_seed(8)
    for y_axis, x_axis in [((-7, 20, 3), (-4, 8, 3)), ((-3, 7, 1), (2, 9, 4)), ((-2, 4, 6),) * 2]:
        c = 3
        g = torch.randint(-4, 5, (2, CB + c + CA, y_axis[1], x_axis[1]), generator=gen)
        g = g.to(dtype)
        ay, ax = pad_axis(*y_axis, mode), pad_axis(*x_axis, mode)
        dx = pad_backward(g.to(device), ay, ax, channel_before=CB, channels=c)
        want = _reference_backward(g, y_axis, x_axis, mode, c)
        assert torch.equal(dx.cpu().double(), want), (mode, dtype, y_axis, x_axis)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(EdgeMode), ids=lambda e: e.name)
def test_adjoint(mode, device) -> None:
    """<pad(v), w> == <v, pad^T(w)> in float64 with random v and w (fill 0)."""
    gen = torch.Generator().manual_seed(9)
    c = 3
    for y_axis, x_axis in itertools.product(AXES[:6], AXES[4:]):
        ay, ax = pad_axis(*y_axis, mode), pad_axis(*x_axis, mode)
        if ay.lo == ay.hi or ax.lo == ax.hi:
            continue  # nothing read: the map is 0
        v = torch.randn(2, c, y_axis[2], x_axis[2], generator=gen, dtype=torch.float64)
        w = torch.randn(2, CB + c + CA, y_axis[1], x_axis[1], generator=gen, dtype=torch.float64)
        v, w = v.to(device), w.to(device)
        jv = pad_forward(
            v,
            ay,
            ax,
            channel_before=CB,
            out_channels=CB + c + CA,
            fill=0.0,
            constant_outside=mode is EdgeMode.CONSTANT,
        )
        jtw = pad_backward(w, ay, ax, channel_before=CB, channels=c)
        assert_adjoint(jv, w, v, jtw, f"pad adjoint {mode.name} {y_axis} {x_axis}", tol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_results_are_deterministic_and_fresh(device, deterministic_algorithms) -> None:
    gen = torch.Generator().manual_seed(10)
    for mode in EdgeMode:
        ay, ax = pad_axis(-9, 40, 5, mode), pad_axis(-3, 11, 6, mode)
        x = torch.randn(3, 4, 5, 6, generator=gen).to(device)
        g = torch.randn(3, CB + 4 + CA, 40, 11, generator=gen).to(device)
        fill = _fill_values("per-channel", CB + 4 + CA)
        kw = dict(channel_before=CB, out_channels=CB + 4 + CA, fill=fill, constant_outside=True)
        y1, y2 = pad_forward(x, ay, ax, **kw), pad_forward(x, ay, ax, **kw)
        d1 = pad_backward(g, ay, ax, channel_before=CB, channels=4)
        d2 = pad_backward(g, ay, ax, channel_before=CB, channels=4)
        assert torch.equal(y1, y2) and torch.equal(d1, d2), mode
    # No padding at all: the gradient is a copy of g, not a view the caller might overwrite.
    same = pad_axis(0, 5, 5, EdgeMode.ZERO)
    g = torch.randn(1, 2, 5, 5, generator=gen).to(device)
    dx = pad_backward(g, same, same, channel_before=0, channels=2)
    assert torch.equal(dx, g) and dx.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()
    assert dx.is_contiguous()


def test_gradient_work_is_linear_in_the_padding() -> None:
    """A few targets with huge multiplicity (CLAMP edges) do not widen the others' rows: the
    tables hold at most twice the contributions."""
    for mode in (EdgeMode.CLAMP, EdgeMode.MIRROR, EdgeMode.MIRROR_WITH_EDGE):
        for start, count, size in [(-1000, 2100, 100), (-7, 1000, 3), (-50, 200, 1000)]:
            plan = pad_axis(start, count, size, mode).adjoint
            entries = sum(rows * width for rows, width, _, _ in plan.groups)
            assert entries <= 2 * count, (mode, start, count, size, entries)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fragmented", [False, True])
def test_axis_adjoint_sums_any_contributions(fragmented, device) -> None:
    """The gather-sum engine on random contribution lists (empty, single unweighted, many,
    weighted): equal to the dense matrix, both when pieces assemble the result and when
    targets are so fragmented that one index_select does."""
    r = random.Random(12)
    selected = 0
    for trial in range(20):
        count, size = r.randint(1, 30), r.randint(1, 40)
        weighted = trial % 2 == 1
        contributions = []
        for i in range(size):
            roll = r.random()
            if roll < 0.2:
                us = []
            elif roll < (0.3 if fragmented else 0.7):
                us = [min(i, count - 1)]  # single: a slice when its neighbours are too
            else:
                us = sorted(r.sample(range(count), r.randint(1, min(count, 9))))
            contributions.append(
                [(u, r.choice([0.25, -1.5, 3.0]) if weighted else 1.0) for u in us]
            )
        plan = axis_adjoint(contributions, count, step=r.choice([None, 1, 2, 3]))
        assert (plan.pieces is None) == (plan.select is not None)
        selected += plan.pieces is None
        m = torch.zeros(size, count, dtype=torch.float64)
        for i, c in enumerate(contributions):
            for u, w in c:
                m[i, u] += w
        t = torch.randn(2, 3, count, 4, dtype=torch.float64)
        got = apply_axis_adjoint(t.to(device), plan, 2, ("test-adjoint", trial, fragmented))
        assert_close(got, torch.einsum("iu,ncuw->nciw", m, t), f"trial {trial}", tol=1e-15)
        got = apply_axis_adjoint(
            t.transpose(2, 3).to(device), plan, 3, ("test-adjoint", trial, fragmented)
        )
        assert_close(got, torch.einsum("iu,ncwu->ncwi", m, t.transpose(2, 3)), "dim 3", tol=1e-15)
    # Fragmented lists take the index_select path; most others are assembled from pieces.
    assert selected > 0 if fragmented else selected < 10, selected


@pytest.mark.parametrize("device", DEVICES)
def test_float32_is_exact_with_tf32_allowed(device) -> None:
    """TF32 matmuls allowed: float32 results still equal the float64 reference to float32
    rounding (the forward copies exactly; the gradient rounds only its float32 sums)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    try:
        gen = torch.Generator().manual_seed(11)
        c = 3
        for mode in EdgeMode:
            y_axis, x_axis = (-7, 20, 3), (-5, 64, 50)
            x = torch.randn(2, c, 3, 50, generator=gen).float()
            g = torch.randn(2, CB + c + CA, 20, 64, generator=gen).float()
            y, dx = _run(x.to(device), g.to(device), y_axis, x_axis, mode, 0.3, True)
            want = _reference_forward(x, y_axis, x_axis, mode, 0.3, True, torch.float32)
            assert torch.equal(y.cpu().double(), want), mode
            # Per element: |error| <= (terms) * 2^-24 * sum |terms|.
            exact = _reference_backward(g, y_axis, x_axis, mode, c)
            bound = _reference_backward(g.abs(), y_axis, x_axis, mode, c) * 30 * 2.0**-24
            err = (dx.cpu().double() - exact).abs()
            assert (err <= bound).all(), (mode, err.max().item())
            assert_close(dx, exact, f"tf32 {mode.name}", tol=TOL[torch.float32])
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
