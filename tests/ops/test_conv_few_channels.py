"""The Triton convolution of images with few channels (`mpsnn.ops.triton.conv_few_channels`):
forward and weight gradient against float64 PyTorch (strides, pads, dilations, bias, ragged
tiles, float32 and float16, NCHW, channels-last and strided operands), the weight gradient as
the forward's exact adjoint, its pixel ranges, the sizes the kernels take, the fast path's
refusals, the decision that sends a stem there (`mpsnn.ops.convolution._few_channels`), the
forward and gradient dispatch for every kind of window plan, the fallback with Triton off,
and the bfloat16 kernels on a GPU (eager and replayed from a CUDA graph).

On the CPU, Triton's interpreter runs the kernels in float32 and float16 (its dot and its
conversions mishandle bfloat16); on a GPU float32 runs them with IEEE products."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpsnn.core.geometry import AxisWindow, EdgeMode
from mpsnn.ops import convolution as C
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.triton import conv_few_channels as few
from tests.helpers import TRITON_DEVICES

_wgrad = torch.ops.aten.convolution_backward.default

# (N, C, H, W, O, kH, kW, stride, pads, dilation): 9x7 images take a partial last pixel tile
CASES = [
    (2, 3, 9, 7, 64, 3, 3, (1, 1), (1, 1), (1, 1)),
    (3, 2, 8, 8, 20, 3, 2, (2, 1), (0, 1), (1, 2)),
    (1, 3, 5, 5, 64, 1, 1, (1, 1), (0, 0), (1, 1)),
    (2, 3, 11, 6, 130, 2, 3, (1, 2), (1, 0), (2, 1)),  # 130 filters: two filter tiles
]


def _operands(case, device, dtype=torch.float32, seed=3, layout="cl"):
    """Image, weights and bias; ``layout``: "cl" (channels-last image and weights, as a graph
    holds them), "nchw", or "view" (an image that is a strided window of a larger one)."""
    n, c, h, w, o, kh, kw, *_ = case
    gen = torch.Generator().manual_seed(seed)
    big = torch.randn(n, c + 1, h + 2, w + 3, generator=gen).to(device, dtype)
    x = big[:, 1:, 2:, 3:] if layout == "view" else big[:, :c, :h, :w].contiguous()
    wt = (torch.randn(o, c, kh, kw, generator=gen) * 0.3).to(device, dtype)
    if layout == "cl":
        x = x.contiguous(memory_format=torch.channels_last)
        wt = wt.contiguous(memory_format=torch.channels_last)
    b = torch.randn(o, generator=gen).to(device, dtype)
    return x, wt, b


# float16 products are exact in float32 as float32's are: the forward's error is its rounding
# to the storage dtype, the weight gradient's its float32 accumulation
FORWARD_TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
DTYPES = [torch.float32, torch.float16]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("layout", ["cl", "nchw", "view"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_and_weight_gradient_against_float64(case, dtype, layout, device) -> None:
    x, wt, b = _operands(case, device, dtype, layout=layout)
    stride, pads, dil = case[7:]
    for bias in (b, None):
        y = few.few_channel_conv_forward(x, wt, bias, stride, pads, dil)
        want = F.conv2d(x.double(), wt.double(), None if bias is None else bias.double(),
                        stride, pads, dil)  # fmt: skip
        assert y.shape == want.shape and y.dtype == x.dtype
        assert y.is_contiguous(memory_format=torch.channels_last)
        assert _rel(y, want) < FORWARD_TOL[dtype]
    gen = torch.Generator().manual_seed(8)
    g = torch.randn(want.shape, generator=gen).to(device, dtype)
    g = g.contiguous(memory_format=torch.channels_last)
    dw = few.few_channel_conv_weight_grad(g, x, tuple(wt.shape), stride, pads, dil)
    want_dw = _wgrad(g.double(), x.double(), wt.double(), None, list(stride), list(pads),
                     list(dil), False, [0, 0], 1, [False, True, False])[1]  # fmt: skip
    assert dw.dtype == torch.float32 and dw.is_contiguous() and dw.shape == wt.shape
    assert _rel(dw, want_dw) < 1e-5
    # an NCHW gradient is read through its strides
    dw2 = few.few_channel_conv_weight_grad(g.contiguous(), x, tuple(wt.shape), stride, pads, dil)
    assert torch.equal(dw2, dw)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_weight_gradient_is_the_adjoint_of_the_forward(device) -> None:
    """``<conv(x, v), g> == <v, dW(x, g)>`` for random ``v`` and cotangent ``g``: the forward
    is linear in the weights, and the weight gradient is its transpose."""
    case = CASES[1]
    x, _, _ = _operands(case, device)
    stride, pads, dil = case[7:]
    gen = torch.Generator().manual_seed(12)
    c, o, kh, kw = case[1], case[4], case[5], case[6]
    v = torch.randn(o, c, kh, kw, generator=gen).to(device)
    y = few.few_channel_conv_forward(x, v, None, stride, pads, dil)
    g = torch.randn(y.shape, generator=gen).to(device)
    dw = few.few_channel_conv_weight_grad(g, x, (o, c, kh, kw), stride, pads, dil)
    lhs = (y.double() * g.double()).sum()
    rhs = (v.double() * dw.double()).sum()
    assert abs(lhs - rhs) <= 1e-5 * (y.double().abs() * g.double().abs()).sum()


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_weight_gradient_pixel_ranges(device) -> None:
    """Any number of pixel ranges gives the sum up to float32 rounding, and one setting gives
    the same bits at every call (fixed ranges, summed in a fixed order)."""
    case = CASES[0]
    x, wt, _ = _operands(case, device)
    stride, pads, dil = case[7:]
    gen = torch.Generator().manual_seed(4)
    oh, ow = x.shape[2], x.shape[3]
    g = torch.randn(x.shape[0], wt.shape[0], oh, ow, generator=gen).to(device)
    one = few.few_channel_conv_weight_grad(g, x, tuple(wt.shape), stride, pads, dil, ranges=1)
    for ranges in (2, 3, 7):
        got = few.few_channel_conv_weight_grad(g, x, tuple(wt.shape), stride, pads, dil,
                                               ranges=ranges)  # fmt: skip
        assert _rel(got, one) < 1e-6, ranges
        again = few.few_channel_conv_weight_grad(g, x, tuple(wt.shape), stride, pads, dil,
                                                 ranges=ranges)  # fmt: skip
        assert torch.equal(got, again), ranges


def test_the_fast_path_refuses_what_it_does_not_run() -> None:
    x = torch.randn(2, 3, 8, 8).bfloat16()
    w = torch.randn(64, 3, 3, 3).bfloat16()
    geo = ((1, 1), (1, 1), (1, 1))
    assert fast_paths.few_channel_conv(x, w, None, *geo) is None  # CPU tensors
    assert fast_paths.few_channel_conv_weight_grad(x, x, (64, 3, 3, 3), *geo) is None
    if torch.cuda.is_available():
        xc, wc = x.cuda(), w.cuda()
        assert fast_paths.few_channel_conv(xc.float(), wc.float(), None, *geo) is None
        assert fast_paths.few_channel_conv(xc, wc.half(), None, *geo) is None  # mixed dtypes
        big = torch.randn(64, 3, 5, 5, device="cuda").bfloat16()  # 75 products > 64
        assert fast_paths.few_channel_conv(xc, big, None, (1, 1), (2, 2), (1, 1)) is None
        g = torch.randn(2, 64, 8, 8, device="cuda").bfloat16()
        assert fast_paths.few_channel_conv_weight_grad(g, xc, (64, 3, 5, 5), *geo) is None


# -- the decision and the dispatch -----------------------------------------------------------


def _input(c: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return torch.empty(2, c, 9, 9, dtype=dtype, device=device).contiguous(
        memory_format=torch.channels_last
    )


def _weight(o: int, c: int, kh: int = 3, kw: int = 3) -> torch.Tensor:
    return torch.empty(o, c, kh, kw)


def test_the_decision(monkeypatch) -> None:
    bf16, f16 = torch.bfloat16, torch.float16
    assert not C._few_channels(_input(3, bf16, "cpu"), _weight(64, 3), 1)  # the CPU's layout
    real = C.channels_last_preferred  # decided as for CUDA tensors from here on
    monkeypatch.setattr(C, "channels_last_preferred", lambda d, _: real(d, torch.device("cuda")))
    for dtype in (bf16, f16):
        for c in (2, 3):
            for w in (_weight(64, c), _weight(16, c), _weight(64, c, 1, 1), _weight(64, c, 3, 2)):
                assert C._few_channels(_input(c, dtype, "cpu"), w, 1), (dtype, c, w.shape)
    for c in (1, 4, 8):  # one channel and four were not faster (or not measured)
        assert not C._few_channels(_input(c, bf16, "cpu"), _weight(64, c), 1), c
    assert not C._few_channels(_input(3, bf16, "cpu"), _weight(8, 3), 1)  # few filters
    assert not C._few_channels(_input(3, bf16, "cpu"), _weight(64, 3, 5), 1)
    assert not C._few_channels(_input(3, bf16, "cpu"), _weight(64, 1), 3)  # groups
    assert not C._few_channels(_input(3, torch.float32, "cpu"), _weight(64, 3), 1)


def _geometry(size: int, kernel: int, stride: int) -> C.ConvGeometry:
    pad = kernel // 2
    count = (size + 2 * pad - kernel) // stride + 1
    a = AxisWindow(-pad, count, kernel, stride, 1, size)
    return C.conv_geometry(a, a, EdgeMode.ZERO, 1)


def _few_spies(monkeypatch) -> list[str]:
    """Send 3-channel convolutions to the few-channel kernels (forced for float32, which the
    interpreter runs) and record the calls."""
    calls: list[str] = []
    monkeypatch.setattr(C, "_few_channels", lambda t, w, g: t.shape[1] == 3)

    def conv(x, w, b, *geo):
        calls.append("forward")
        return few.few_channel_conv_forward(x, w, b, *geo)

    def wgrad(g, x, shape, *geo):
        calls.append("weights")
        return few.few_channel_conv_weight_grad(g, x, tuple(shape), *geo)

    monkeypatch.setattr(fast_paths, "few_channel_conv", conv)
    monkeypatch.setattr(fast_paths, "few_channel_conv_weight_grad", wgrad)
    return calls


# (y window, x window, edge mode) as AxisWindow(start, count, kernel, stride, dilation, size):
# each plan the source preparation makes (zero pads, a copy for clamped edges, a view of a
# window inside the image, a zero-copy plan, outputs the operator makes beyond the window)
PLANS = {
    "same": (AxisWindow(-1, 10, 3, 1, 1, 10), AxisWindow(-1, 10, 3, 1, 1, 10), EdgeMode.ZERO),
    "strided": (AxisWindow(-1, 5, 3, 2, 1, 10), AxisWindow(0, 4, 3, 2, 1, 10), EdgeMode.ZERO),
    "dilated": (AxisWindow(1, 3, 3, 2, 1, 9), AxisWindow(-2, 5, 3, 2, 2, 9), EdgeMode.ZERO),
    "clamp": (AxisWindow(-1, 8, 3, 1, 1, 8), AxisWindow(-1, 8, 3, 1, 1, 8), EdgeMode.CLAMP),
    "clamp-offset": (
        AxisWindow(-2, 7, 3, 1, 1, 8),
        AxisWindow(-1, 5, 3, 2, 1, 8),
        EdgeMode.CLAMP,
    ),
    "crop": (AxisWindow(-1, 3, 3, 1, 1, 8), AxisWindow(-1, 3, 3, 1, 1, 8), EdgeMode.ZERO),
    "zero-copy": (AxisWindow(-3, 6, 3, 1, 1, 8), AxisWindow(2, 3, 3, 1, 1, 8), EdgeMode.ZERO),
}


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("plan", list(PLANS))
def test_forward_and_gradient_dispatch(plan, device, monkeypatch) -> None:
    """With the decision taken, the forward and the weight gradient go through the few-channel
    kernels, the data gradient through the backend's convolution, and all three (and the bias
    gradient) equal the float64 path, for every kind of window plan."""
    ay, ax, edge = PLANS[plan]
    geom = C.conv_geometry(ay, ax, edge, 1)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 3, ay.size, ax.size, generator=gen).to(device)
    w = torch.randn(32, 3, 3, 3, generator=gen).to(device)
    b = torch.randn(32, generator=gen).to(device)
    want_y = C.conv_forward(x.double(), w.double(), b.double(), geom)
    g = torch.randn(want_y.shape, generator=gen).to(device)
    want = C.conv_backward(g.double(), x.double(), w.double(), geom)
    calls = _few_spies(monkeypatch)
    y = C.conv_forward(x, w, b, geom)
    assert _rel(y, want_y) < 1e-5
    dx, dw, db = C.conv_backward(g, x, w, geom)
    for got, ref in zip((dx, dw, db), want, strict=True):
        assert _rel(got, ref) < 1e-5
    assert dw.dtype == torch.float32 and dw.is_contiguous()
    none, dw2, db2 = C.conv_backward(g, x, w, geom, need_data=False)
    assert none is None and torch.equal(dw2, dw) and torch.equal(db2, db)
    dx3, dw3, db3 = C.conv_backward(g, x, w, geom, need_bias=False)
    assert torch.equal(dx3, dx) and torch.equal(dw3, dw) and db3 is None
    assert calls == ["forward", "weights", "weights", "weights"]


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_with_triton_off_the_backend_runs(device, monkeypatch) -> None:
    """The decision taken but the fast paths off: the backend's convolution, bit for bit."""
    geom = _geometry(10, 3, 1)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 3, 10, 10, generator=gen).to(device)
    w = torch.randn(32, 3, 3, 3, generator=gen).to(device)
    g = torch.randn(2, 32, 10, 10, generator=gen).to(device)
    want_y = C.conv_forward(x, w, None, geom)
    want = C.conv_backward(g, x, w, geom)
    monkeypatch.setattr(C, "_few_channels", lambda t, w, g: True)
    fast_paths.set_enabled(False)
    try:
        assert torch.equal(C.conv_forward(x, w, None, geom), want_y)
        for got, ref in zip(C.conv_backward(g, x, w, geom), want, strict=True):
            assert torch.equal(got, ref)
    finally:
        fast_paths.set_enabled(True)


def test_the_sizes_the_kernels_take(monkeypatch) -> None:
    """`fits`: patches of at most 64 products, a non-empty image and output, and pixel
    indices and per-image offsets within int32 (checked here against a lowered bound)."""
    geo = ((1, 1), (1, 1), (1, 1))
    x = torch.empty(2, 3, 8, 8)
    assert few.fits(x, (64, 3, 3, 3), *geo)
    assert not few.fits(x, (64, 3, 5, 5), (1, 1), (2, 2), (1, 1))  # 75 products
    assert not few.fits(torch.empty(0, 3, 8, 8), (64, 3, 3, 3), *geo)  # no image
    assert not few.fits(torch.empty(2, 3, 1, 1), (64, 3, 3, 3), (1, 1), (0, 0), (1, 1))
    assert not few.fits(x, (0, 3, 3, 3), *geo)  # no filter
    monkeypatch.setattr(few, "_MAX_I32", 2 * 8 * 8 + few._BM)  # 128 pixels and a tile fit
    assert few.fits(x, (64, 3, 3, 3), *geo)
    assert not few.fits(torch.empty(3, 3, 8, 8), (64, 3, 3, 3), *geo)  # 192 pixels
    monkeypatch.setattr(few, "_MAX_I32", 3 * 8 * 8 - 1 + few._BM)  # an image's reach: 191
    assert few.fits(x, (64, 3, 3, 3), *geo)
    assert not few.fits(x, (64, 3, 3, 3), *geo, g=torch.empty(2, 64, 8, 8))  # reach 4095


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the half-precision kernels are CUDA's")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(3, 64, 3, 1), (2, 16, 1, 2)], ids=str)  # C, O, k, stride
def test_a_half_precision_stem_on_the_gpu(shape, dtype) -> None:
    """A stem runs the Triton kernels: the forward (with a bias) within two units in the last
    place of the storage dtype of float64's, channels-last; the weight and bias gradients
    close to float64's; a CUDA graph that records the forward and the gradients replays them
    with the eager calls' bits."""
    c, o, k, stride = shape
    launches = [few._few_channel_conv.direct_launches, few._few_channel_conv_wgrad.direct_launches]
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(16, c, 32, 32, generator=gen).cuda().to(dtype)
    w = torch.randn(o, c, k, k, generator=gen).cuda().to(dtype)
    w = w.contiguous(memory_format=torch.channels_last)
    b = torch.randn(o, generator=gen).cuda().to(dtype)
    geom = _geometry(32, k, stride)
    want = F.conv2d(x.double(), w.double(), b.double(), stride, k // 2)
    g = torch.randn(want.shape, generator=gen).cuda().to(dtype)
    for _ in range(3):  # the first launch of a key goes through Triton's own path
        got = C.conv_forward(x, w, b, geom)
        _, dw, db = C.conv_backward(g, x, w, geom, need_data=False)
    assert few._few_channel_conv.direct_launches > launches[0]
    assert few._few_channel_conv_wgrad.direct_launches > launches[1]
    assert got.is_contiguous(memory_format=torch.channels_last)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), want, rtol=2 * eps, atol=2 * eps)
    want_dw = _wgrad(g.double(), x.double(), w.double(), None, [stride] * 2, [k // 2] * 2,
                     [1, 1], False, [0, 0], 1, [False, True, False])[1]  # fmt: skip
    assert dw.dtype == torch.float32 and _rel(dw, want_dw) < 1e-5
    assert _rel(db, g.double().sum((0, 2, 3))) < 1e-5
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y2 = C.conv_forward(x, w, b, geom)
        _, dw2, db2 = C.conv_backward(g, x, w, geom, need_data=False)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y2, got) and torch.equal(dw2, dw) and torch.equal(db2, db)
