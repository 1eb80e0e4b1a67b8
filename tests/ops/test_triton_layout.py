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
