"""The NCHW -> channels-last conversion in Triton (`mpsnn.ops.triton.layout`): PyTorch's copy
bit for bit (any bit pattern, NaN payloads included) with PyTorch's channels-last strides, for
the shapes a tile covers exactly and those it does not; the tensors it does not take are
refused; and the convolution's operands take it on CUDA."""

from __future__ import annotations

import pytest
import torch

from mpsnn.ops import triton as fast_paths
from mpsnn.ops.triton.layout import nchw_to_nhwc_triton
from tests.helpers import TRITON_DEVICES

SHAPES = [(2, 3, 5, 7), (3, 64, 7, 9), (1, 65, 4, 4), (2, 130, 3, 3), (2, 8, 16, 16), (1, 2, 1, 3)]
SHAPES += [(1, 64, 9, 9), (2, 3, 40, 40)]  # several pixel blocks, the last one partial
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern is possible: NaNs with payloads, infinities, subnormals, -0.0."""
    gen = torch.Generator().manual_seed(seed)
    ints = BITS[dtype]
    info = torch.iinfo(ints)
    raw = torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64)
    return raw.to(ints).view(dtype)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", list(BITS), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_transpose_is_pytorchs_copy_bit_for_bit(shape, dtype, device) -> None:
    t = _random_bits(shape, dtype, sum(shape)).to(device)
    got = nchw_to_nhwc_triton(t)
    want = t.contiguous(memory_format=torch.channels_last)
    assert got is not None
    assert got.stride() == want.stride() and got.shape == want.shape and got.dtype == dtype
    assert torch.equal(got.view(BITS[dtype]), want.view(BITS[dtype]))
    assert got.is_contiguous(memory_format=torch.channels_last)


def test_the_tensors_it_does_not_take_are_refused() -> None:
    t = torch.randn(2, 4, 3, 3)
    assert nchw_to_nhwc_triton(t.contiguous(memory_format=torch.channels_last)) is None
    assert nchw_to_nhwc_triton(t[:, :, :, :2]) is None  # not NCHW-contiguous
    assert nchw_to_nhwc_triton(t[0]) is None  # 3-D
    assert nchw_to_nhwc_triton(torch.randn(2, 1, 3, 3)) is None  # both layouts at once
    assert nchw_to_nhwc_triton(torch.randn(2, 4, 1, 1)) is None
    assert nchw_to_nhwc_triton(torch.randn(0, 4, 3, 3)) is None  # empty
    assert nchw_to_nhwc_triton(torch.empty(65536, 2, 1, 2)) is None  # more images than a grid
    # the fast-path switch: a CPU tensor takes PyTorch's copy
    copy = fast_paths.to_channels_last(t)
    assert torch.equal(copy, t) and copy.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_channels_last_operands_are_never_copied(device, monkeypatch) -> None:
    """Where channels-last is the convolution's layout, a channels-last operand (a graph's
    image) is passed through as it is, and an NCHW one goes through the transpose when the fast
    paths take it; batch normalization's gradient does the same."""
    from mpsnn.ops import convolution as C
    from mpsnn.ops.triton import batch_norm_nhwc as B
    from mpsnn.ops.triton import layout

    calls = []
    monkeypatch.setattr(C, "channels_last_preferred", lambda dtype, device: True)
    monkeypatch.setattr(fast_paths, "_runs", lambda *ts: True)  # the interpreter's CPU too
    monkeypatch.setattr(
        layout, "nchw_to_nhwc_triton", lambda t: calls.append(t) or nchw_to_nhwc_triton(t)
    )
    t = torch.randn(2, 6, 5, 5).to(device)
    cl = t.contiguous(memory_format=torch.channels_last)
    assert C._channels_last(cl) is cl and B._nhwc(cl) is cl and calls == []
    got = C._channels_last(t)
    assert len(calls) == 1 and torch.equal(got, t) and got.stride() == cl.stride()
    got = B._nhwc(t)
    assert len(calls) == 2 and torch.equal(got, t) and got.stride() == cl.stride()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fast paths run on CUDA only")
def test_a_convolution_gradient_on_nchw_operands_converts_them_in_triton(monkeypatch) -> None:
    """A bfloat16 convolution gradient on NCHW images (a kernel user's, not a graph's) converts
    its two operands with the transpose, and its results are those of PyTorch's copies."""
    from mpsnn.core.geometry import AxisWindow, EdgeMode
    from mpsnn.ops import convolution as C
    from mpsnn.ops.triton import layout

    calls = []
    real = layout.nchw_to_nhwc_triton
    monkeypatch.setattr(layout, "nchw_to_nhwc_triton", lambda t: calls.append(t) or real(t))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 16, 12, 12, generator=gen).cuda().bfloat16()
    g = torch.randn(4, 16, 12, 12, generator=gen).cuda().bfloat16()
    w = torch.randn(16, 16, 3, 3, generator=gen).cuda().bfloat16()
    a = AxisWindow(-1, 12, 3, 1, 1, 12)
    geom = C.conv_geometry(a, a, EdgeMode.ZERO, 1)
    got = C.conv_backward(g, x, w, geom)
    assert len(calls) == 2
    fast_paths.set_enabled(False)
    try:
        want = C.conv_backward(g, x, w, geom)
    finally:
        fast_paths.set_enabled(True)
    # the data and weight gradients (cuDNN's kernels on the same operands); the bias sums take
    # another summation order without the fast paths
    for fast, slow in zip(got[:2], want[:2], strict=True):
        assert fast.dtype == slow.dtype and torch.equal(_bits(fast), _bits(slow))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(BITS[t.dtype]) if t.dtype in BITS else t


# -- channels-last half precision -> NCHW float32 (a convolution's weight gradient) ----------


def _special_values(
    shape: tuple[int, ...], dtype: torch.dtype, seed: int, subnormals: bool = True
) -> torch.Tensor:
    """Random values with infinities, signed zeros, NaNs and (``subnormals``) subnormals among
    them."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen) * 3
    flat = t.view(-1)
    tiny = torch.finfo(dtype).tiny
    small = [tiny / 4, -tiny / 8] if subnormals else []
    specials = [float("inf"), -float("inf"), -0.0, 0.0, *small, float("nan")]
    for i, v in enumerate(specials[: flat.numel()]):
        flat[(i * 7) % flat.numel()] = v
    return t.to(dtype)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_widening_transpose_is_pytorchs_conversion(shape, dtype, device) -> None:
    from mpsnn.ops.triton.layout import nchw_float32_triton

    # Triton's interpreter (the CPU) flushes bfloat16 subnormals to zero; a GPU widens them
    subnormals = device == "cuda" or dtype is torch.float16
    t = _special_values(shape, dtype, sum(shape), subnormals).to(device)
    t = t.contiguous(memory_format=torch.channels_last)
    want = t.to(torch.float32, memory_format=torch.contiguous_format)
    got = nchw_float32_triton(t)
    if t.is_contiguous():  # one channel or one pixel: both layouts, nothing to transpose
        assert got is None
        return
    assert got is not None and got.dtype == torch.float32 and got.is_contiguous()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


def test_the_widening_transpose_refuses_other_tensors() -> None:
    from mpsnn.ops.triton.layout import nchw_float32_triton

    t = torch.randn(2, 4, 3, 3).bfloat16()
    assert nchw_float32_triton(t) is None  # NCHW already
    assert nchw_float32_triton(t.float().contiguous(memory_format=torch.channels_last)) is None
    assert nchw_float32_triton(t[0]) is None  # 3-D
    assert nchw_float32_triton(torch.empty(0, 4, 3, 3).bfloat16()) is None
    many = torch.empty(65536, 2, 2, 1, dtype=torch.bfloat16, memory_format=torch.channels_last)
    assert nchw_float32_triton(many) is None  # more images than a grid's dimension takes
    assert fast_paths.nchw_float32(t.contiguous(memory_format=torch.channels_last)) is None  # CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's weight gradient")
def test_a_recorded_half_precision_weight_gradient_widens_through_the_transpose() -> None:
    """Recorded into a CUDA graph, cuDNN's channels-last bfloat16 weight gradient reaches the
    caller as float32 OIHW by the Triton transpose, with PyTorch's values; an eager call keeps
    PyTorch's conversion (one call from the host)."""
    from mpsnn.core.geometry import AxisWindow, EdgeMode
    from mpsnn.ops import convolution as C
    from mpsnn.ops.triton import layout

    a = AxisWindow(-1, 8, 3, 1, 1, 8)
    geom = C.conv_geometry(a, a, EdgeMode.ZERO, 1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, 8, 8, generator=gen).cuda().bfloat16()
    w = torch.randn(32, 16, 3, 3, generator=gen).cuda().bfloat16()
    g = torch.randn(4, 32, 8, 8, generator=gen).cuda().bfloat16()
    cl = torch.channels_last
    layout.nchw_float32_triton(torch.empty(32, 16, 3, 3, device="cuda", dtype=torch.bfloat16,
                                           memory_format=cl))  # compiled outside the capture  # fmt: skip
    before = layout._nhwc_to_nchw.direct_launches
    _, eager, _ = C.conv_backward(g, x, w, geom, need_data=False, need_bias=False)
    assert layout._nhwc_to_nchw.direct_launches == before  # eager: PyTorch's conversion
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, dw, _ = C.conv_backward(g, x, w, geom, need_data=False, need_bias=False)
    graph.replay()
    torch.cuda.synchronize()
    assert layout._nhwc_to_nchw.direct_launches == before + 1  # recorded once
    _, want, _ = torch.ops.aten.convolution_backward.default(
        g.contiguous(memory_format=cl), x.contiguous(memory_format=cl), w.contiguous(memory_format=cl),
        None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False],
    )  # fmt: skip
    assert dw.dtype == torch.float32 and dw.is_contiguous()
    assert torch.equal(dw, want.float()) and torch.equal(eager, want.float())


# -- NCHW float32 -> channels-last half precision, into an existing tensor (weight copies) ---


# Triton's interpreter (the CPU) rounds to bfloat16 otherwise than a GPU: bfloat16 where CUDA is
NARROW_DTYPES = [torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
# exact ties (checked with PyTorch): the even neighbour wins, away from zero or towards it
TIES = {
    torch.float16: [2049.0, 2051.0, -2049.0, 65520.0, 2.0**-25, 3 * 2.0**-25],
    torch.bfloat16: [1 + 2.0**-8, 1 + 3 * 2.0**-8, -(1 + 2.0**-8), 2.0**-134],
}


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", NARROW_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(64, 64, 3, 3), (130, 3, 3, 3), (8, 65, 1, 1), *SHAPES], ids=str)
def test_the_narrowing_transpose_is_pytorchs_copy(shape, dtype, device) -> None:
    """Every value but NaN gets PyTorch's bits (rounded to nearest, ties to even: exact ties
    among the values); NaN stays NaN."""
    from mpsnn.ops.triton.layout import nchw_to_nhwc_into

    t = _special_values(shape, torch.float32, sum(shape)).to(device)
    flat = t.view(-1)
    ties = TIES[dtype]
    for i, v in enumerate(ties[: flat.numel()]):
        flat[-1 - i] = v
    out = torch.empty(shape, dtype=dtype, device=device, memory_format=torch.channels_last)
    want = torch.empty_like(out).copy_(t)
    if out.is_contiguous():  # one channel or one pixel: refused, nothing written
        assert not nchw_to_nhwc_into(t, out)
        return
    assert nchw_to_nhwc_into(t, out)
    nan = want.isnan()
    assert torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16))


def test_the_narrowing_transpose_refuses_other_tensors() -> None:
    from mpsnn.ops.triton.layout import nchw_to_nhwc_into

    t = torch.randn(4, 8, 3, 3)
    cl = torch.channels_last
    half = torch.full((4, 8, 3, 3), 7.0, dtype=torch.bfloat16).contiguous(memory_format=cl)
    assert not nchw_to_nhwc_into(t.double(), half)  # not float32
    assert not nchw_to_nhwc_into(t, torch.empty(4, 8, 3, 3, memory_format=cl))  # float32 out
    assert not nchw_to_nhwc_into(t, torch.empty(4, 8, 3, 3, dtype=torch.bfloat16))  # NCHW out
    assert not nchw_to_nhwc_into(t.contiguous(memory_format=cl), half)  # source not NCHW
    assert not nchw_to_nhwc_into(t[:2], half)  # shapes differ
    assert not fast_paths.cast_into_channels_last(t, half)  # CPU tensors: PyTorch's copy
    many = torch.empty(65536, 2, 2, 1)  # more images than a grid's dimension takes
    many_out = torch.empty(65536, 2, 2, 1, dtype=torch.bfloat16, memory_format=cl)
    assert not nchw_to_nhwc_into(many, many_out)
    assert (half == 7.0).all()  # nothing was written


def _launches(monkeypatch, module, name) -> list[int]:
    """The tensors (the grid's second dimension) of each launch of ``module.name``."""
    seen: list[int] = []
    real = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            seen.append(grid[1])
            return real[grid]

    monkeypatch.setattr(module, name, Spy())
    return seen


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_the_flat_narrowing_is_pytorchs_copy_in_one_launch(device, monkeypatch) -> None:
    """Several contiguous float32 tensors (1x1 weights, a matrix, biases, one larger than a
    program's block) into half-precision ones of their layout: every value but NaN gets
    PyTorch's bits, exact ties included; one launch for all."""
    from mpsnn.ops.triton import layout

    shapes = [(8, 65, 1, 1), (10,), (3, 5000), (4097,)]
    dtypes = [NARROW_DTYPES[i % len(NARROW_DTYPES)] for i in range(len(shapes))]
    src, dst, want = [], [], []
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
        t = _special_values(shape, torch.float32, 11 + i).to(device)
        flat = t.view(-1)
        for j, v in enumerate(TIES[dtype]):
            flat[-1 - j] = v
        src.append(t)
        dst.append(torch.full(shape, 7.0, dtype=dtype, device=device))
        want.append(torch.empty(shape, dtype=dtype, device=device).copy_(t))
    seen = _launches(monkeypatch, layout, "_narrow_flat")
    assert layout.narrow_flat_into(dst, src)
    assert seen == [len(shapes)]
    for got, w in zip(dst, want, strict=True):
        nan = w.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(torch.int16), w[~nan].view(torch.int16))
    # more tensors than a launch takes: several launches, the same values
    monkeypatch.setattr(layout, "_MAX_FLAT", 3)
    again = [torch.zeros_like(d) for d in dst]
    assert layout.narrow_flat_into(again, src)
    assert seen[1:] == [3, 1]
    for got, d in zip(again, dst, strict=True):
        assert torch.equal(got.view(torch.int16), d.view(torch.int16))


def test_the_flat_narrowing_puts_the_blocks_on_the_grids_long_axis(monkeypatch) -> None:
    """The blocks on the first axis (2^31 - 1 of them), the tensors on the second (65535):
    a tensor of more than 65535 blocks still launches."""
    from mpsnn.ops.triton import layout

    grids = []

    class Spy:  # records the launch without running it (70001 programs)
        def __getitem__(self, grid):
            grids.append(grid)
            return lambda *args, **kwargs: None

    monkeypatch.setattr(layout, "_narrow_flat", Spy())
    monkeypatch.setattr(layout, "_FLAT_BLOCK", 16)
    src = [torch.randn(16 * 70000 + 3), torch.randn(5)]
    dst = [torch.empty(t.shape, dtype=torch.float16) for t in src]
    assert layout.narrow_flat_into(dst, src)
    assert grids == [(70001, 2)]


def test_the_flat_narrowing_refuses_other_lists() -> None:
    from mpsnn.ops.triton.layout import narrow_flat_into

    t = torch.randn(4, 8)
    half = torch.full((4, 8), 7.0, dtype=torch.bfloat16)
    assert not narrow_flat_into([], [])
    assert not narrow_flat_into([half], [t, t])  # lengths differ
    assert not narrow_flat_into([half], [t.double()])  # not float32
    assert not narrow_flat_into([torch.empty(4, 8)], [t])  # float32 destination
    assert not narrow_flat_into([half], [t.t().contiguous().t()])  # source not contiguous
    assert not narrow_flat_into([torch.empty(8, 4, dtype=torch.bfloat16).t()], [t])
    assert not narrow_flat_into([half], [t[:2]])  # shapes differ
    assert not narrow_flat_into([half, half], [t, t.double()])  # one pair of many
    left = fast_paths.narrow_into([half], [t])  # CPU tensors: all left for PyTorch's copy
    assert left[0] == [half] and left[1] == [t]
    assert (half == 7.0).all()  # nothing was written


def test_narrow_into_writes_the_pairs_it_takes_and_returns_the_others(monkeypatch) -> None:
    """One refused pair (a float64 source, a strided destination) no longer sends every pair
    to PyTorch's copy: the flat narrowing takes the others, in their order."""
    from mpsnn.ops.triton import layout

    device = TRITON_DEVICES[0]
    if device == "cpu":  # the interpreter runs the launch; the dispatch wants CUDA otherwise
        monkeypatch.setattr(fast_paths, "_runs", lambda *ts: True)
        monkeypatch.setattr(fast_paths, "_on_current_device", lambda *ts: True)
    taken = []
    original = layout.narrow_flat_into

    def spy(dst, src):
        taken.append((list(dst), list(src)))
        return original(dst, src)

    monkeypatch.setattr(layout, "narrow_flat_into", spy)
    g = torch.Generator().manual_seed(3)
    src = [torch.randn(5, 3, generator=g).to(device) for _ in range(4)]
    src[1] = src[1].double()
    half = NARROW_DTYPES[-1]
    dst = [torch.full((5, 3), 7.0, dtype=half, device=device) for _ in range(4)]
    dst[3] = torch.full((3, 5), 7.0, dtype=half, device=device).t()  # strided
    rest_dst, rest_src = fast_paths.narrow_into(dst, src)
    assert [d is e for d, e in zip(rest_dst, [dst[1], dst[3]], strict=True)] == [True, True]
    assert [s is e for s, e in zip(rest_src, [src[1], src[3]], strict=True)] == [True, True]
    ((got_dst, got_src),) = taken
    assert all(a is b for a, b in zip(got_dst, [dst[0], dst[2]], strict=True))
    assert all(a is b for a, b in zip(got_src, [src[0], src[2]], strict=True))
    for i in (0, 2):
        assert torch.equal(dst[i], src[i].to(half))
    for i in (1, 3):
        assert (dst[i] == 7.0).all()  # left for the caller


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the weight copies' CUDA path")
def test_recorded_weight_copies_are_rewritten_through_the_transpose() -> None:
    """Recorded into a CUDA graph, a refresh rewrites a convolution's bfloat16 channels-last
    copy of its float32 OIHW masters by the Triton transpose, with PyTorch's bits, at every
    replay; an eager refresh keeps PyTorch's multi-tensor copy."""
    from mpsnn.cnn.convolution.weights import ConvWeights
    from mpsnn.ops.triton import layout

    gen = torch.Generator().manual_seed(3)
    ws = ConvWeights(torch.randn(64, 32, 3, 3, generator=gen).cuda(), None)
    w16, _ = ws.cast(torch.bfloat16)
    assert w16.is_contiguous(memory_format=torch.channels_last)
    layout.nchw_to_nhwc_into(ws.weight, torch.empty_like(w16))  # compiled outside the capture
    before = layout._nchw_to_nhwc.direct_launches
    ws.weight.copy_(torch.randn(64, 32, 3, 3, generator=gen).cuda())
    ws.refresh()
    assert layout._nchw_to_nhwc.direct_launches == before  # eager: PyTorch's copy
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ws.refresh()
    for _ in range(2):
        ws.weight.copy_(torch.randn(64, 32, 3, 3, generator=gen).cuda())
        graph.replay()
        torch.cuda.synchronize()
        want = ws.weight.to(torch.bfloat16, memory_format=torch.channels_last)
        assert torch.equal(w16.view(torch.int16), want.view(torch.int16))
    assert layout._nchw_to_nhwc.direct_launches == before + 1  # recorded once


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the weight copies' CUDA path")
def test_recorded_copies_of_coinciding_layouts_take_the_flat_narrowing(monkeypatch) -> None:
    """Recorded into a CUDA graph, the half-precision copies that need no transpose (a 1x1
    kernel, its bias, a fully connected layer's matrix) are rewritten by one flat narrowing
    with PyTorch's bits at every replay; an eager refresh keeps PyTorch's multi-tensor copy."""
    from mpsnn.cnn.convolution.weights import ConvWeights
    from mpsnn.ops.triton import layout

    gen = torch.Generator().manual_seed(4)
    one = ConvWeights(torch.randn(96, 80, 1, 1, generator=gen).cuda(),
                      torch.randn(96, generator=gen).cuda())  # fmt: skip
    fc = ConvWeights(torch.randn(10, 16, 2, 2, generator=gen).cuda(), None)
    fc.channels_last_casts = False  # a fully connected layer's matrix
    casts = [one.cast(torch.bfloat16), fc.cast(torch.bfloat16)]
    seen = _launches(monkeypatch, layout, "_narrow_flat")
    ConvWeights.refresh_all([one, fc])
    assert seen == []  # eager: PyTorch's copy
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ConvWeights.refresh_all([one, fc])
    assert seen == [3]  # one launch: the 1x1 weights, their bias, the matrix
    for _ in range(2):
        for ws in (one, fc):
            ws.weight.copy_(torch.randn(ws.weight.shape, generator=gen).cuda())
        one.bias.copy_(torch.randn(96, generator=gen).cuda())
        graph.replay()
        torch.cuda.synchronize()
        for ws, (w, _) in zip((one, fc), casts, strict=True):
            assert torch.equal(w.view(torch.int16), ws.weight.to(torch.bfloat16).view(torch.int16))
        assert torch.equal(casts[0][1], one.bias.to(torch.bfloat16))
