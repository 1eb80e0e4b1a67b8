"""The plain ReLU's Triton passes equal the portable forms bit for bit (NaN, infinities, sums
that round to zero, -0.0, both memory layouts, every storage format): ``relu(x + y)`` against
the addition followed by the portable ReLU, ``(x >= 0) t`` against the 1.0/0.0 mask and its
product. On the CPU they run in Triton's interpreter, with bfloat16 sums that need no rounding
(the interpreter truncates; the GPU run checks the rounding)."""

from __future__ import annotations

import pytest
import torch

from mpsnn.ops import neuron as N
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.arithmetic import add_activation
from mpsnn.ops.neuron import RELU, NeuronParams, activation
from mpsnn.ops.triton.elementwise import add_relu_triton, relu_times_triton
from tests.helpers import TRITON_DEVICES, assert_same_bits

RELU0 = NeuronParams(RELU, 0.0, 0.0, 0.0, None)


def _pair(shape, dtype, device, channels_last: bool):
    gen = torch.Generator().manual_seed(91)
    x = torch.randn(shape, generator=gen) * 3
    y = torch.randn(shape, generator=gen) * 3
    if dtype is torch.bfloat16 and device == "cpu":
        # Triton's interpreter truncates float32 -> bfloat16 (a GPU rounds to nearest even):
        # quarters below 16 in size add up exactly, so no sum needs rounding there
        x, y = (torch.round(t * 4).clamp(-60, 60) / 4 for t in (x, y))
    flat_x, flat_y = x.view(-1), y.view(-1)
    flat_x[::13] = float("nan")
    flat_x[5::17], flat_y[5::17] = float("inf"), -float("inf")  # inf - inf = NaN
    flat_x[7::19] = -float("inf")  # MPS's ReLU: 0 * -inf = NaN
    flat_y[2::11] = -flat_x[2::11]  # exact zeros
    flat_x[3::23], flat_y[3::23] = -0.0, -0.0  # -0.0 + -0.0 = -0.0
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return (t.to(device=device, dtype=dtype).contiguous(memory_format=fmt) for t in (x, y))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 8, 33, 65)], ids=str)
def test_triton_add_relu_equals_add_then_relu(shape, dtype, channels_last, device) -> None:
    x, y = _pair(shape, dtype, device, channels_last)
    got = add_relu_triton(x, y)
    want = activation(RELU0, x + y)
    assert got.dtype == dtype and got.stride() == x.stride()
    assert_same_bits(got, want)  # NaNs by position (a NaN's payload may differ)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_triton_relu_times_equals_the_mask_product(dtype, channels_last, device) -> None:
    """The ReLU (``t = x``) and its gradient (``t`` another tensor): -0.0 for ``x < 0``, NaN for
    a NaN ``x`` and for ``x = -inf`` (``0 * -inf``), ``t``'s own ±0/±inf/NaN where ``x >= 0``."""
    x, t = _pair((2, 3, 5, 7), dtype, device, channels_last)
    for a, b in ((x, x), (x, t), (t, x)):
        got = relu_times_triton(a, b)
        assert got.stride() == a.stride()
        assert_same_bits(got, N._times(N._nonnegative(a), b))
    assert N.plain_relu(RELU0, x)
    assert_same_bits(activation(RELU0, x), N._times(N._nonnegative(x), x))


def test_dispatch_takes_one_layout_and_dtype_only() -> None:
    x = torch.randn(2, 3, 4, 5)
    assert fast_paths.add_relu(x, x) is None  # CPU tensors: the portable path
    got = add_activation(x, -x, RELU0)
    assert torch.equal(got, activation(RELU0, x - x))
    if torch.cuda.is_available():
        gpu = x.cuda()
        assert fast_paths.add_relu(gpu, gpu) is not None
        assert fast_paths.add_relu(gpu, gpu.contiguous(memory_format=torch.channels_last)) is None
        assert fast_paths.add_relu(gpu, gpu.double()) is None
        assert fast_paths.add_relu(gpu[..., ::2], gpu[..., ::2]) is None  # not dense
        for a, b in ((gpu, gpu), (gpu, -gpu)):
            assert_same_bits(fast_paths.relu_times(a, b), N._times(N._nonnegative(a), b))
        assert fast_paths.relu_times(gpu, gpu.contiguous(memory_format=torch.channels_last)) is None
        assert fast_paths.relu_times(gpu.double(), gpu.double()) is None
    assert fast_paths.relu_times(x, x) is None  # CPU tensors: the portable path
