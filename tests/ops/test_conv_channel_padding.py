"""A half-precision CUDA convolution forward with fewer than 8 input channels runs on operands
zero-padded to 8 channels (`mpsnn.ops.convolution._pads_channels`): the Triton pad
(`mpsnn.ops.triton.layout.pad_channels_triton`) is a bit copy with zeros after it, in
channels-last strides; it refuses what it cannot index; the padded operands give the unpadded
convolution; and the forward pads exactly in the cases the decision names."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from mpsnn.core.geometry import AxisWindow, EdgeMode
from mpsnn.ops import convolution as C
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.triton import layout
from mpsnn.ops.triton.layout import pad_channels_triton
from tests.helpers import TRITON_DEVICES

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
# (N, C, H, W): 40x40 and 33x17 images take several pixel blocks of 512, the last one partial
SHAPES = [(2, 3, 40, 40), (3, 1, 33, 17), (1, 7, 5, 7), (2, 4, 1, 1), (1, 2, 1, 3)]


def _random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Any bit pattern: NaNs with payloads, infinities, subnormals, -0.0."""
    gen = torch.Generator().manual_seed(seed)
    info = torch.iinfo(BITS[dtype])
    raw = torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64)
    return raw.to(BITS[dtype]).view(dtype)


def _reference(t: torch.Tensor, channels: int) -> torch.Tensor:
    n, _, h, w = t.shape
    out = torch.zeros(n, channels, h, w, dtype=t.dtype, device=t.device)
    out[:, : t.shape[1]] = t
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(BITS[t.dtype])


def _layouts(t: torch.Tensor) -> dict[str, torch.Tensor]:
    return {
        "nchw": t,
        "channels_last": t.contiguous(memory_format=torch.channels_last),
        "pixel_view": t[:, :, ::2, 1:] if t.shape[3] > 1 else t[:, :, ::2],
        "channel_view": torch.cat([t, t], 1)[:, ::2],  # channel stride 2 H W
        "broadcast": t[:1].expand(3, -1, -1, -1),  # image stride 0
    }


# -- (a) the Triton pad ------------------------------------------------------------------------


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", list(BITS), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_pad_copies_the_bits_and_appends_positive_zeros(shape, dtype, device) -> None:
    base = _random_bits(shape, dtype, sum(shape)).to(device)
    for name, t in _layouts(base).items():
        got = pad_channels_triton(t, 8)
        want = _reference(t, 8)
        assert got is not None, name
        assert got.shape == want.shape and got.dtype == dtype, name
        assert got.stride() == torch.empty_like(want, memory_format=torch.channels_last).stride()
        assert torch.equal(_bits(got), _bits(want)), name  # +0.0 bits after the copy


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", list(BITS), ids=str)
def test_every_channel_count_and_nan_payloads_and_negative_zeros(dtype, device) -> None:
    """C = 1..7 to 8 channels (and to 5 and 16, not the tile's width), with NaN payloads and
    -0.0 where the copy is, which a computed (not moved) value would lose."""
    ints = BITS[dtype]
    nan = {torch.float32: 0x7FC01234, torch.bfloat16: 0x7FC5, torch.float16: 0x7E15}[dtype]
    neg_nan = {torch.float32: -0x3FEDCC, torch.bfloat16: -0x3B, torch.float16: -0x1EB}[dtype]
    neg_zero = torch.iinfo(ints).min  # the sign bit alone: -0.0
    for c in range(1, 8):
        t = torch.randn(2, c, 23, 25).to(dtype)
        raw = t.view(ints)
        raw[0, c - 1, 3, 4] = nan
        raw[1, 0, 22, 24] = neg_nan
        raw[1, c - 1, 0, 0] = neg_zero
        assert bool(t.isnan()[0, c - 1, 3, 4]) and bool(t.isnan()[1, 0, 22, 24])
        t = t.contiguous(memory_format=torch.channels_last).to(device)
        for channels in (c, 5, 8, 16):
            if channels < c:
                continue
            got = pad_channels_triton(t, channels)
            assert got is not None
            assert torch.equal(_bits(got), _bits(_reference(t, channels))), (c, channels)
        got = pad_channels_triton(t, 8).view(ints)
        assert got[0, c - 1, 3, 4] == nan and got[1, 0, 22, 24] == neg_nan
        assert got[1, c - 1, 0, 0] == neg_zero and bool((got[:, c:] == 0).all())


def test_the_tensors_it_does_not_take_are_refused(monkeypatch) -> None:
    t = torch.randn(2, 3, 4, 4)
    assert pad_channels_triton(t.double(), 8) is None  # no float64 kernel
    assert pad_channels_triton(t.to(torch.int16), 8) is None
    assert pad_channels_triton(t[0], 8) is None  # 3-D
    assert pad_channels_triton(t, 2) is None  # fewer channels than it has
    assert pad_channels_triton(torch.randn(0, 3, 4, 4), 8) is None  # empty
    assert pad_channels_triton(torch.empty(65536, 2, 1, 2), 8) is None  # more images than a grid
    # offsets within an image past int32 (meta tensors: no memory behind them, no launch)
    assert pad_channels_triton(torch.empty(1, 3, 2**16, 2**15, device="meta"), 8) is None
    wide = torch.empty(2**33, device="meta").as_strided((1, 3, 16, 1), (1, 1, 2**28, 1))
    assert pad_channels_triton(wide, 8) is None
    # a channel stride just within int32 for the three channels read, past it for the masked
    # lanes up to the tile's 8: refused too (no lane's offset may wrap)
    edge = torch.empty(2**33, device="meta").as_strided((1, 3, 1, 1), (1, 2**29, 1, 1))
    assert pad_channels_triton(edge, 8) is None
    # the fast-path switch: CPU tensors and float64 take PyTorch's pad
    assert fast_paths.pad_channels(t, 8) is None
    monkeypatch.setattr(fast_paths, "_runs", lambda *ts: True)
    t = t.to(TRITON_DEVICES[0])  # the interpreter runs the kernel on the CPU, else CUDA
    assert fast_paths.pad_channels(t.double(), 8) is None
    assert fast_paths.pad_channels(t, 8) is not None


# -- (b) the padded operands give the same convolution -------------------------------------------

CONV_CASES = [  # (C, kernel, stride, padding, dilation)
    (3, (3, 3), 1, 1, 1),
    (1, (3, 3), 2, 0, 1),
    (7, (5, 3), (2, 1), (2, 1), 1),
    (5, (3, 3), 1, 2, 2),
    (2, (1, 1), 1, 0, 1),
    (6, (2, 4), 3, (0, 3), (2, 1)),
    (4, (3, 3), 2, 1, 3),
]


@pytest.mark.parametrize("layout_name", ["nchw", "channels_last"])
@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_the_padded_operands_give_the_unpadded_convolution(case, layout_name) -> None:
    c, (kh, kw), stride, padding, dilation = case
    gen = torch.Generator().manual_seed(c * 7 + kh)
    x = torch.randn(3, c, 13, 11, generator=gen, dtype=torch.float64)
    w = torch.randn(5, c, kh, kw, generator=gen, dtype=torch.float64)
    b = torch.randn(5, generator=gen, dtype=torch.float64)
    if layout_name == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
        w = w.contiguous(memory_format=torch.channels_last)
    xp, wp = C._padded_operands(x, w)
    assert xp.shape == (3, 8, 13, 11) and wp.shape == (5, 8, kh, kw)
    assert xp.is_contiguous(memory_format=torch.channels_last)
    assert wp.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(xp[:, :c], x) and torch.equal(wp[:, :c], w)
    assert bool((xp[:, c:] == 0).all()) and bool((wp[:, c:] == 0).all())
    want = F.conv2d(x, w, b, stride, padding, dilation)
    got = F.conv2d(xp, wp, b, stride, padding, dilation)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# -- (c) the decision ----------------------------------------------------------------------------


def _input(channels: int, dtype: torch.dtype, device: str) -> SimpleNamespace:
    """What the decision reads of the input (shape, dtype, device), for a CUDA tensor without
    a GPU here."""
    return SimpleNamespace(shape=(2, channels, 9, 9), dtype=dtype, device=torch.device(device))


def _input_like(t: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(shape=t.shape, dtype=torch.bfloat16, device=torch.device("cuda"))


def _weight(out: int, channels: int, k: int = 3, k2: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(shape=(out, channels, k, k if k2 is None else k2))


def test_bfloat16_stems_of_two_or_three_channels_are_padded() -> None:
    bf16 = torch.bfloat16
    for c in (2, 3):
        for device in ("cuda", "cuda:1"):
            for w in (_weight(64, c), _weight(128, c, 1), _weight(64, c, 3, 1)):
                assert C._pads_channels(_input(c, bf16, device), w, 1), (c, device, w)
    # what was measured slower, or not faster: one or four channels, fewer than 64 filters,
    # filters larger than 3x3, float16, grouped convolutions, the CPU
    for c in (1, 4, 5, 7, 8, 64):
        assert not C._pads_channels(_input(c, bf16, "cuda"), _weight(64, c), 1), c
    assert not C._pads_channels(_input(3, bf16, "cuda"), _weight(32, 3), 1)
    assert not C._pads_channels(_input(3, bf16, "cuda"), _weight(64, 3, 5), 1)
    assert not C._pads_channels(_input(3, bf16, "cuda"), _weight(64, 3, 3, 7), 1)
    assert not C._pads_channels(_input(3, bf16, "cuda"), _weight(64, 1), 3)
    assert not C._pads_channels(_input(3, bf16, "cpu"), _weight(64, 3), 1)
    assert not C._pads_channels(torch.empty(2, 3, 9, 9, dtype=bf16), _weight(64, 3), 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64], ids=str)
def test_other_dtypes_are_not_padded(dtype) -> None:
    for c in range(1, 8):
        assert not C._pads_channels(_input(c, dtype, "cuda"), _weight(64, c), 1), c


# -- the forward ---------------------------------------------------------------------------------


def _geometry(size: int, kernel: int, stride: int, groups: int = 1) -> C.ConvGeometry:
    pad = kernel // 2
    count = (size + 2 * pad - kernel) // stride + 1
    a = AxisWindow(-pad, count, kernel, stride, 1, size)
    return C.conv_geometry(a, a, EdgeMode.ZERO, groups)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_the_forward_pads_through_the_triton_kernel(device, monkeypatch) -> None:
    """With the half-precision CUDA decision taken (forced here for float32 tensors, which the
    interpreter runs on the CPU), the forward hands conv2d 8-channel channels-last operands,
    the input padded by the Triton kernel, and returns the unpadded convolution."""
    calls = []
    convs = []
    real_pad, real_conv = layout.pad_channels_triton, F.conv2d
    monkeypatch.setattr(C, "channels_last_preferred", lambda dtype, device: True)
    monkeypatch.setattr(fast_paths, "_runs", lambda *ts: True)
    monkeypatch.setattr(
        layout, "pad_channels_triton", lambda t, n: calls.append(t) or real_pad(t, n)
    )
    monkeypatch.setattr(F, "conv2d", lambda x, w, *a: convs.append((x, w)) or real_conv(x, w, *a))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 10, 10, generator=gen).to(device)
    w = torch.randn(64, 3, 3, 3, generator=gen).to(device)
    b = torch.randn(64, generator=gen).to(device)
    real_decision = C._pads_channels
    monkeypatch.setattr(  # the decision on these shapes, as for a bfloat16 CUDA input
        C, "_pads_channels", lambda t, w, g: real_decision(_input_like(t), w, g)
    )
    for i, stride in enumerate((1, 2)):
        got = C.conv_forward(x, w, b, _geometry(10, 3, stride))
        xp, wp = convs[-1]
        assert len(calls) == i + 1 and xp.shape[1] == 8 and wp.shape == (64, 8, 3, 3)
        assert xp.is_contiguous(memory_format=torch.channels_last)
        assert wp.is_contiguous(memory_format=torch.channels_last)
        want = real_conv(x.double(), w.double(), b.double(), stride, 1)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # eight channels, or two groups: the operands as they are
    for xs, ws, groups in ((torch.randn(2, 8, 10, 10), torch.randn(64, 8, 3, 3), 1),
                           (torch.randn(2, 4, 10, 10), torch.randn(64, 2, 3, 3), 2)):  # fmt: skip
        C.conv_forward(xs.to(device), ws.to(device), None, _geometry(10, 3, 1, groups))
        assert len(calls) == 2 and convs[-1][0].shape[1] == xs.shape[1]
        assert convs[-1][1].shape == ws.shape


def test_the_forward_keeps_cpu_operands(monkeypatch) -> None:
    """Without the decision (the CPU), the operands reach conv2d as they are."""
    convs = []
    real_conv = F.conv2d
    monkeypatch.setattr(F, "conv2d", lambda x, w, *a: convs.append((x, w)) or real_conv(x, w, *a))
    x, w = torch.randn(2, 3, 10, 10).bfloat16(), torch.randn(64, 3, 3, 3).bfloat16()
    C.conv_forward(x, w, None, _geometry(10, 3, 1))
    assert convs[-1][0] is x and convs[-1][1] is w


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the half-precision path is CUDA's")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_three_channel_half_precision_forward_on_the_gpu(dtype, monkeypatch) -> None:
    """On CUDA a bfloat16 stem pads through the Triton kernel (float16 does not) and gives the
    unpadded convolution up to the last place of the storage dtype (cuDNN's summation
    order)."""
    calls = []
    real_pad = layout.pad_channels_triton
    monkeypatch.setattr(
        layout, "pad_channels_triton", lambda t, n: calls.append(t) or real_pad(t, n)
    )
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(16, 3, 32, 32, generator=gen).cuda().to(dtype)
    w = torch.randn(64, 3, 3, 3, generator=gen).cuda().to(dtype)
    w = w.contiguous(memory_format=torch.channels_last)
    got = C.conv_forward(x, w, None, _geometry(32, 3, 1))
    assert len(calls) == (dtype is torch.bfloat16)
    assert got.is_contiguous(memory_format=torch.channels_last)
    want = F.conv2d(x.double(), w.double(), None, 1, 1)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(got.double(), want, rtol=2 * eps, atol=2 * eps)
