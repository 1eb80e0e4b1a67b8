"""Max pooling math (`mpsnn.ops.pooling`): the CPU tile paths (disjoint windows inside the image)
against the general path, bit for bit: forward and gradient, ties to the first maximum in
raster order (+0.0 and -0.0 in one window included), NaN sources (the last NaN wins), ±inf,
inf/NaN/-0.0 gradients (signalling NaNs and payloads too), leftover rows and columns,
non-square and 1-wide windows, both dtypes they take (float32, float64), non-contiguous inputs.
Geometries that are not tiles, and float16/bfloat16 data, never reach the tile paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpsnn.core.geometry import AxisWindow, EdgeMode
from mpsnn.ops import pooling as P
from mpsnn.ops.pooling import (
    max_pool_backward,
    max_pool_backward_portable,
    max_pool_forward,
    pool_geometry,
)
from mpsnn.ops.window import apply_extract

DTYPES = [torch.float64, torch.float32]  # the tile paths' dtypes
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16}

TILES = [
    # (N, C, H, W, kh, kw, y0, x0, OH, OW)
    (2, 3, 8, 8, 2, 2, 0, 0, 4, 4),  # tiles the image
    (1, 2, 9, 7, 3, 3, 0, 1, 3, 2),  # leftover rows and columns get 0
    (2, 2, 6, 6, 2, 2, 1, 0, 2, 3),  # starts one row in
    (1, 2, 8, 12, 4, 4, 0, 0, 2, 3),
    (1, 2, 6, 9, 2, 3, 0, 0, 3, 3),  # non-square windows
    (2, 1, 5, 8, 1, 2, 0, 0, 5, 4),  # one row per window
    (2, 1, 6, 5, 3, 1, 0, 0, 2, 5),  # one column per window
    (1, 1, 5, 33, 1, 1, 0, 0, 5, 33),  # 1x1 windows
    (3, 6, 28, 28, 2, 2, 0, 0, 14, 14),  # LeNet's
    (0, 2, 4, 4, 2, 2, 0, 0, 2, 2),  # no images
    (1, 2, 7, 10, 2, 2, 0, 0, 3, 4),  # a leftover row and two leftover columns
    (2, 2, 6, 9, 2, 2, 0, 0, 3, 4),  # an odd width
    (2, 2, 7, 5, 3, 1, 0, 0, 2, 5),  # a leftover row under 1-wide windows
]


_PAYLOADS = {
    torch.float32: [-0x400000, 0x7FC00001, 0x7F800001],  # -NaN, a payload, a signaling NaN
    torch.float64: [-0x8000000000000, 0x7FF8000000000001, 0x7FF0000000000001],
}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_BITS[t.element_size()])


def _geometry(shape, edge=EdgeMode.CLAMP):
    _, _, h, w, kh, kw, y0, x0, oh, ow = shape
    return pool_geometry(AxisWindow(y0, oh, kh, kh, 1, h), AxisWindow(x0, ow, kw, kw, 1, w), edge)


def _source(shape, dtype, seed, *, nan=False):
    n, c, h, w = shape[:4]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, (n, c, h, w), generator=gen).double()  # many ties
    x[torch.rand(x.shape, generator=gen) < 0.3] = -0.0  # ties of +0.0 and -0.0
    x.view(-1)[3::11] = -float("inf")
    x.view(-1)[5::29] = float("inf")
    if nan:
        x.view(-1)[::7] = float("nan")
    x = x.to(dtype)
    if nan and dtype in _PAYLOADS:  # NaNs of other signs and payloads (quiet and signaling)
        for i, pattern in enumerate(_PAYLOADS[dtype]):
            x.view(-1).view(_BITS[x.element_size()])[i * 5 :: 23] = pattern
    return x


def _gradient(shape, dtype, seed):
    n, c, oh, ow = shape[0], shape[1], shape[8], shape[9]
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(n, c, oh, ow, generator=gen, dtype=torch.float64)
    g[torch.rand(g.shape, generator=gen) < 0.2] = -0.0  # 0 + (-0.0) is +0.0
    return g.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", TILES, ids=str)
def test_tile_gradient_equals_the_general_path_bit_for_bit(shape, dtype) -> None:
    geom = _geometry(shape)
    assert P._cpu_tiles(torch.zeros(1, dtype=dtype), geom)
    for seed in range(4):
        x, g = _source(shape, dtype, seed, nan=seed % 2 == 1), _gradient(shape, dtype, 9 + seed)
        g.view(-1)[1::13] = float("inf")  # any gradient: PyTorch's backward routes it
        g.view(-1)[2::17] = float("nan")
        fast = P._tile_max_backward(g, x, geom)
        want = max_pool_backward_portable(g, x, geom)
        assert fast.dtype == dtype and fast.shape == x.shape
        assert torch.equal(bits(fast), bits(want))
        assert torch.equal(bits(max_pool_backward(g, x, geom)), bits(want))
        # a non-contiguous gradient and source
        xt = x.transpose(2, 3).contiguous().transpose(2, 3)
        gt = g.transpose(2, 3).contiguous().transpose(2, 3)
        assert torch.equal(bits(P._tile_max_backward(gt, xt, geom)), bits(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", TILES, ids=str)
def test_tile_forward_equals_the_general_path_bit_for_bit(shape, dtype) -> None:
    geom = _geometry(shape)
    k = (shape[4], shape[5])
    for seed in range(4):
        x = _source(shape, dtype, seed, nan=seed % 2 == 1)  # ties, ±0.0 in one window, ±inf, NaN
        t = apply_extract(x, geom.plan)
        want, want_idx = F.max_pool2d(t, k, k, return_indices=True)
        y, tap = P._tile_max(t, geom)
        assert y._base is None and y.is_contiguous() and y.dtype == dtype
        assert torch.equal(bits(y), bits(want))
        assert torch.equal(bits(max_pool_forward(x, geom)), bits(want))
        # the tap number i kw + j of the argmax, as the general path's index into t's plane
        i, j = tap // k[1], tap % k[1]
        oh = torch.arange(shape[8]).view(-1, 1) * k[0]
        ow = torch.arange(shape[9]) * k[1]
        assert torch.equal((oh + i) * t.shape[3] + ow + j, want_idx)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", TILES, ids=str)
def test_tile_gradient_routes_any_bits_from_the_forward_argmax(shape, dtype) -> None:
    """Gradients of every kind (NaNs of both signs, with payloads, signalling; ±inf; ±0.0),
    routed from the argmax the forward found (as a graph's step hands it over) and found again:
    the general path's bits, ``0 + g`` (a signalling NaN quieted, -0.0 made +0.0)."""
    geom = _geometry(shape)
    for seed in range(2):
        x, g = _source(shape, dtype, 20 + seed, nan=seed == 1), _gradient(shape, dtype, 30 + seed)
        for i, pattern in enumerate(_PAYLOADS[dtype]):
            g.view(-1).view(_BITS[g.element_size()])[i::5] = pattern
        g.view(-1)[3::10] = float("inf")
        g.view(-1)[4::10] = -float("inf")
        want = max_pool_backward_portable(g, x, geom)
        tap = P.max_pool_forward_argmax(x, geom)[1]
        assert tap is not None
        assert torch.equal(bits(max_pool_backward(g, x, geom, tap)), bits(want))
        assert torch.equal(bits(P._tile_max_backward(g, x, geom)), bits(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_tile_gradient_follows_the_argmax_it_is_given(dtype) -> None:
    """The forward's argmax handed to the gradient is used, not found again: a (valid) argmax of
    each window's last tap routes every gradient there."""
    shape = (2, 3, 8, 8, 2, 2, 0, 0, 4, 4)
    geom = _geometry(shape)
    x, g = _source(shape, dtype, 5, nan=False), _gradient(shape, dtype, 6)
    last = torch.full(g.shape, 3, dtype=torch.int64)  # tap 3 = (1, 1) of each 2x2 window
    got = max_pool_backward(g, x, geom, last)
    want = torch.zeros_like(got)
    want[:, :, 1::2, 1::2] = 0 + g
    assert torch.equal(bits(got), bits(want))


def test_ties_go_to_the_first_maximum_in_raster_order() -> None:
    x = torch.tensor([[[[1.0, 5.0, -0.0, 0.0], [5.0, 2.0, 0.0, -1.0]]]])
    g = torch.tensor([[[[7.0, 9.0]]]])
    geom = _geometry((1, 1, 2, 4, 2, 2, 0, 0, 1, 2))
    dx = P._tile_max_backward(g, x, geom)
    assert dx.flatten().tolist() == [0, 7, 9, 0, 0, 0, 0, 0]  # +0.0 is not larger than -0.0
    assert torch.equal(bits(dx), bits(max_pool_backward_portable(g, x, geom)))
    y = P._tile_max(x, geom)[0]
    assert y.flatten().tolist() == [5.0, 0.0] and torch.signbit(y.flatten()[1])  # the -0.0


NOT_TILES = [
    # overlapping windows (stride < kernel), strides past the kernel, dilation, windows that
    # read outside the image (ZERO edges: padding zeros take part in the maximum; CLAMP edges)
    (AxisWindow(0, 3, 2, 1, 1, 4), AxisWindow(0, 3, 2, 1, 1, 4), EdgeMode.ZERO),
    (AxisWindow(0, 2, 2, 3, 1, 5), AxisWindow(0, 2, 2, 3, 1, 5), EdgeMode.CLAMP),
    (AxisWindow(0, 2, 2, 2, 2, 6), AxisWindow(0, 2, 2, 2, 1, 4), EdgeMode.CLAMP),
    (AxisWindow(-1, 3, 2, 2, 1, 4), AxisWindow(0, 2, 2, 2, 1, 4), EdgeMode.ZERO),
    (AxisWindow(0, 2, 2, 2, 1, 4), AxisWindow(-1, 3, 2, 2, 1, 4), EdgeMode.CLAMP),
]


@pytest.mark.parametrize("windows", NOT_TILES, ids=str)
def test_other_geometries_take_the_general_path(windows, monkeypatch) -> None:
    geom = pool_geometry(*windows)
    x = -torch.rand(1, 2, windows[0].size, windows[1].size, dtype=torch.float64) - 1
    assert not P._cpu_tiles(x, geom)

    def refuse(*args):
        raise AssertionError("the tile path ran for a geometry it does not handle")

    monkeypatch.setattr(P, "_tile_max", refuse)
    monkeypatch.setattr(P, "_tile_max_backward", refuse)
    y = max_pool_forward(x, geom)
    g = torch.randn(y.shape, dtype=torch.float64)
    assert torch.equal(max_pool_backward(g, x, geom), max_pool_backward_portable(g, x, geom))


def test_tile_paths_need_cpu_float32_or_float64_data(monkeypatch) -> None:
    geom = _geometry(TILES[0])
    assert not P._cpu_tiles(torch.zeros(1, dtype=torch.int32), geom)
    assert not P._cpu_tiles(torch.zeros(1, device="meta"), geom)

    def refuse(*args):
        raise AssertionError("the tile path ran for a dtype it does not handle")

    monkeypatch.setattr(P, "_tile_max", refuse)
    monkeypatch.setattr(P, "_tile_max_backward", refuse)
    for dtype in (torch.float16, torch.bfloat16):  # there a NaN's bits would differ
        x, g = _source(TILES[0], dtype, 3, nan=True), _gradient(TILES[0], dtype, 4)
        assert not P._cpu_tiles(x, geom)
        want = F.max_pool2d(x, 2, 2)
        assert torch.equal(bits(max_pool_forward(x, geom)), bits(want))
        want = max_pool_backward_portable(g, x, geom)
        assert torch.equal(bits(max_pool_backward(g, x, geom)), bits(want))


@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str
)
@pytest.mark.parametrize("shape", TILES, ids=str)
def test_tiled_average_gradient_equals_the_float32_sum_bit_for_bit(shape, dtype) -> None:
    """Disjoint windows (stride = kernel): the average's gradient spreads ``g / N`` rounded
    once, which is the general path's value (its float32 sum has one term per pixel). The one
    difference in bits: a -0.0 gradient is copied as -0.0 where the sum made +0.0."""
    for valid in (None, (1, shape[2] - 1)):  # every tap counts, or a divisor per window
        geom = pool_geometry(
            AxisWindow(shape[6], shape[8], shape[4], shape[4], 1, shape[2]),
            AxisWindow(shape[7], shape[9], shape[5], shape[5], 1, shape[3]),
            EdgeMode.ZERO,
            valid_y=valid,
        )
        g = _gradient(shape, torch.float64, 31).to(dtype)
        x = torch.zeros(shape[:4], dtype=dtype)
        got = P.average_pool_backward(g, x, geom)
        gd = P._divide(g.double() if dtype == torch.float64 else g.float(), geom)
        t = torch.empty((shape[0], shape[1], geom.plan.y.length, geom.plan.x.length),
                        dtype=gd.dtype)  # fmt: skip
        want = P.apply_extract_adjoint(P._sum_pool_backward(gd, t, geom).to(dtype), geom.plan)
        assert got.dtype == dtype and got.shape == x.shape
        nonzero = want != 0
        assert torch.equal(bits(got[nonzero]), bits(want[nonzero]))
        assert (got[~nonzero] == 0).all() and (g.numel() == 0 or (g == 0).any())


AVERAGE = [
    # (N, C, H, W, kh, kw, y0, x0, OH, OW): areas that are powers of two, and others
    (8, 64, 4, 4, 4, 4, 0, 0, 1, 1),  # a global 4x4 pooling (ResNet's head)
    (2, 16, 8, 8, 2, 2, 0, 0, 4, 4),
    (2, 8, 9, 9, 3, 3, 0, 0, 3, 3),  # area 9
    (2, 8, 6, 6, 2, 3, 0, 0, 3, 2),  # area 6
]


def _widened_average(x, geom):
    """The widened path: float32 sums, the divisor's reciprocal, rounded once."""
    t = P.widen(apply_extract(x, geom.plan))
    return P._divide(P._sum_pool(t, geom), geom).to(x.dtype)


@pytest.mark.parametrize("shape", AVERAGE, ids=str)
def test_half_average_pooling_takes_pytorchs_pooling_only_where_the_bits_agree(shape) -> None:
    """Half-precision CUDA data, every tap counted, no dilation, an area that is a power of
    two: PyTorch's half-precision pooling (no float32 copy); anything else: the widened path."""
    geom = _geometry(shape, EdgeMode.ZERO)
    x = torch.zeros(shape[:4], dtype=torch.bfloat16)
    area = shape[4] * shape[5]
    assert not P._half_average(x, geom)  # on the CPU: never
    if torch.cuda.is_available():
        assert P._half_average(x.cuda(), geom) == (area & (area - 1) == 0)
        assert not P._half_average(x.cuda().float(), geom)  # float32: nothing to widen
        counted = pool_geometry(geom.y, geom.x, EdgeMode.ZERO, valid_y=(1, shape[2] - 1))
        assert not P._half_average(x.cuda(), counted)  # a divisor per window
        whole = pool_geometry(geom.y, geom.x, EdgeMode.ZERO, valid_y=(0, shape[2]))
        assert P._half_average(x.cuda(), whole) == (area & (area - 1) == 0)  # all taps count


def _half_specials(shape, dtype, channels_last):
    """Random half-precision CUDA images with infinities (one window with both: NaN), NaNs,
    subnormals, and for bfloat16 values whose window sums overflow float32."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(shape[:4], generator=gen) * 100
    x.view(-1)[::13] = 1e-3  # small values beside large ones: rounding matters
    flat = x.view(-1)
    flat[0], flat[1] = float("inf"), float("-inf")
    flat[7] = float("nan")
    flat[9] = float("inf")
    x = x.to(dtype)
    tiny = 2.0**-24 if dtype == torch.float16 else torch.finfo(torch.bfloat16).tiny / 4
    x.view(-1)[20:24] = tiny
    if dtype == torch.bfloat16:
        x[-1, -1] = 3e38  # a window of them sums past float32's largest value
    x = x.cuda()
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="PyTorch's half-precision pooling on CUDA"
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("shape", AVERAGE, ids=str)
def test_half_average_pooling_has_the_widened_paths_bits(
    shape, channels_last, dtype, monkeypatch
) -> None:
    """With no divisor per window, and with one that is the area everywhere (a window that
    lies inside the image: ResNet's global pooling); special values included. Where the area
    is a power of two no float32 copy is made (the widened path's sum never runs)."""
    plain = _geometry(shape, EdgeMode.ZERO)
    whole = pool_geometry(plain.y, plain.x, EdgeMode.ZERO, valid_y=(0, shape[2]))
    x = _half_specials(shape, dtype, channels_last)
    area = shape[4] * shape[5]
    widened: list[torch.dtype] = []
    real = P._sum_pool

    def spy(t, g):
        widened.append(t.dtype)
        return real(t, g)

    for geom in (plain, whole):
        widened.clear()
        monkeypatch.setattr(P, "_sum_pool", spy)
        got = P.average_pool_forward(x, geom)
        monkeypatch.setattr(P, "_sum_pool", real)
        assert widened == ([] if area & (area - 1) == 0 else [torch.float32])
        want = _widened_average(x, geom)
        assert got.dtype == dtype and got.shape == want.shape
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(bits(got[~nan]), bits(want[~nan]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", AVERAGE, ids=str)
def test_a_divisor_that_is_the_area_everywhere_divides_once(shape, dtype, monkeypatch) -> None:
    """Windows whose taps all count: one division by the area where that is exact (an area
    that is a power of two), with the per-window division's bits; other areas keep the
    per-window division."""
    plain = _geometry(shape, EdgeMode.ZERO)
    whole = pool_geometry(plain.y, plain.x, EdgeMode.ZERO, valid_y=(0, shape[2]))
    area = shape[4] * shape[5]
    assert whole.area == area == plain.area
    part = pool_geometry(plain.y, plain.x, EdgeMode.ZERO, valid_y=(1, shape[2]))
    assert part.area is None
    gen = torch.Generator().manual_seed(8)
    total = (torch.randn(2, shape[1], shape[8], shape[9], generator=gen) * 1e3).to(dtype)
    total.view(-1)[::5] = 1e-40 if dtype == torch.float32 else 1e-310  # subnormal quotients
    div = P._divisor(whole.counts).to(dtype)
    per_window = torch.where(div > 0, total / div.clamp(min=1), 0.0)
    built = []
    real = P.device_constant
    monkeypatch.setattr(P, "device_constant", lambda *a: (built.append(a[0][0]), real(*a))[1])
    assert torch.equal(bits(P._divide(total, whole)), bits(per_window))
    # no divisor tensor where one division is exact
    assert built == ([] if area & (area - 1) == 0 else ["pool-divisor"])
