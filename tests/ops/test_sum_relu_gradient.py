"""The ReLU's gradient of a sum of two gradients in one pass: the Triton pass equals
``torch.add`` followed by PyTorch's ``threshold_backward`` bit for bit (the ReLU's result
negative, zero, -0.0, positive, NaN and infinite; sums that are NaN, infinite or -0.0; both
memory layouts; every storage format), and the op's portable path is those two operations. On
the CPU the Triton pass runs in Triton's interpreter, with bfloat16 sums that need no rounding
(the interpreter truncates; the GPU run checks the rounding)."""

from __future__ import annotations

import pytest
import torch

from mpsnn.ops import triton as fast_paths
from mpsnn.ops.arithmetic import add_relu_gradient_of_result
from mpsnn.ops.neuron import relu_backward_of_result
from mpsnn.ops.triton.elementwise import sum_relu_gradient_triton
from tests.helpers import TRITON_DEVICES, assert_same_bits


def _three(shape, dtype, device, channels_last: bool):
    gen = torch.Generator().manual_seed(93)
    a, b, r = (torch.randn(shape, generator=gen) * 3 for _ in range(3))
    if dtype is torch.bfloat16 and device == "cpu":
        # quarters below 16 in size add up exactly: no sum needs rounding in the interpreter
        a, b = (torch.round(t * 4).clamp(-60, 60) / 4 for t in (a, b))
    fa, fb, fr = a.view(-1), b.view(-1), r.view(-1)
    fa[::13] = float("nan")
    fa[5::17], fb[5::17] = float("inf"), -float("inf")  # inf - inf = NaN
    fb[2::11] = -fa[2::11]  # exact zeros
    fa[3::23], fb[3::23] = -0.0, -0.0  # -0.0 + -0.0 = -0.0
    fr[::7] = 0.0
    fr[1::29] = -0.0
    fr[4::31] = float("nan")  # the sum passes
    fr[6::37] = float("inf")
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    return (t.to(device=device, dtype=dtype).contiguous(memory_format=fmt) for t in (a, b, r))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 8, 33, 65)], ids=str)
def test_triton_sum_relu_gradient_equals_add_then_threshold_backward(
    shape, dtype, channels_last, device
) -> None:
    a, b, r = _three(shape, dtype, device, channels_last)
    got = sum_relu_gradient_triton(a, b, r)
    assert got.stride() == a.stride()
    assert_same_bits(got, torch.ops.aten.threshold_backward(a + b, r, 0))
    # the masked entries are +0.0, as threshold_backward writes them
    masked = (r <= 0) & ~r.isnan()
    assert torch.equal(got[masked].abs(), got[masked]) and not got[masked].signbit().any()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_the_op_is_the_sum_then_the_relu_gradient_of_result(dtype) -> None:
    a, b, r = _three((2, 4, 6, 5), dtype, "cpu", False)
    assert_same_bits(add_relu_gradient_of_result(a, b, r), relu_backward_of_result(a + b, r))
    # a result in another format than the gradients (compared with 0 only)
    assert_same_bits(
        add_relu_gradient_of_result(a, b, r.double()), relu_backward_of_result(a + b, r.double())
    )


def test_dispatch_takes_one_layout_and_dtype_for_the_three_tensors() -> None:
    a = torch.randn(2, 3, 4, 5)
    assert fast_paths.sum_relu_gradient(a, a, a) is None  # CPU tensors: never the Triton pass
    if torch.cuda.is_available():
        c = a.cuda()
        assert fast_paths.sum_relu_gradient(c, c, c.double()) is None
        assert (
            fast_paths.sum_relu_gradient(c, c, c.contiguous(memory_format=torch.channels_last))
            is None
        )
        assert fast_paths.sum_relu_gradient(c, c, c) is not None
