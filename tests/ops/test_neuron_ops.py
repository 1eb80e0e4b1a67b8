"""Neuron math (`mpsnn.ops.neuron`): the plain-ReLU fast path (``a = +0.0``) equals the general
formulas bit for bit (signed zeros, infinities, NaN, subnormals; every float dtype, forward,
slope and gradient, contiguous or not), and the dispatch keeps the general path elsewhere."""

from __future__ import annotations

import pytest
import torch

from mpsnn.ops import neuron as N
from mpsnn.ops.neuron import NeuronParams, activation, activation_backward, activation_slope
from tests.helpers import DEVICES

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16}
SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40, float("inf"), -float("inf"), float("nan"), 3.5]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The stored bit patterns (so that -0.0 != 0.0 and NaN == the same NaN)."""
    return t.contiguous().view(_BITS[t.element_size()])


def assert_same_bits(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(bits(a), bits(b))


def _data(dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 4, 9, 11, generator=gen, dtype=torch.float64)
    flat = x.view(-1)
    flat[: len(SPECIAL)] = torch.tensor(SPECIAL, dtype=torch.float64)
    flat[len(SPECIAL) :: 13] = 0.0
    flat[len(SPECIAL) + 5 :: 17] = -0.0
    return x.to(device=device, dtype=dtype)


def _general_forward(p: NeuronParams, x: torch.Tensor) -> torch.Tensor:
    return N.neuron_forward(p.kind, x, p.a, p.b, p.c, p.data)


def _general_backward(p: NeuronParams, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return g * N.neuron_derivative(p.kind, x, p.a, p.b, p.c, p.data)


RELU0 = NeuronParams(N.RELU, 0.0, 1.0, 1.0, None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plain_relu_fast_path_equals_the_general_formulas_bit_for_bit(dtype, device) -> None:
    x = _data(dtype, device, 1)
    g = _data(dtype, device, 2).flip(0)  # gradients with ±0, ±inf, NaN too
    assert N.plain_relu(RELU0, x)
    assert_same_bits(activation(RELU0, x), _general_forward(RELU0, x))
    assert_same_bits(
        activation_slope(RELU0, x), N.neuron_derivative(N.RELU, x, 0.0, 1.0, 1.0, None)
    )
    assert_same_bits(activation_backward(RELU0, g, x), _general_backward(RELU0, g, x))
    # non-contiguous views and a broadcast gradient
    xs, gs = x[:, :, ::2, 1:], g[:, :, ::2, 1:]
    assert_same_bits(activation(RELU0, xs), _general_forward(RELU0, xs))
    assert_same_bits(activation_backward(RELU0, gs, xs), _general_backward(RELU0, gs, xs))
    gb = g[:1, :1]
    assert_same_bits(activation_backward(RELU0, gb, x), _general_backward(RELU0, gb, x))
    # the results are new tensors (an image may adopt them as its storage)
    y = activation(RELU0, x)
    assert y._base is None and y.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_relu_form_equals_the_general_formulas_bit_for_bit(dtype, device):
    """The mask form ``m t`` with ``m = (x >= 0)`` in ``x``'s dtype gives the general formulas'
    bits on any device (±0, ±inf, NaN, subnormals, views, a broadcast gradient), as new
    tensors."""
    x = _data(dtype, device, 5)
    g = _data(dtype, device, 6).flip(1)
    assert_same_bits(N._relu_times(x, x), _general_forward(RELU0, x))
    assert_same_bits(N._relu_times(x, g), _general_backward(RELU0, g, x))
    xs, gs = x[:, 1:, ::3], g[:, 1:, ::3]
    assert_same_bits(N._relu_times(xs, xs), _general_forward(RELU0, xs))
    assert_same_bits(N._relu_times(xs, gs), _general_backward(RELU0, gs, xs))
    gb = g[:1, :1]
    assert_same_bits(N._relu_times(x, gb), _general_backward(RELU0, gb, x))
    y = N._relu_times(x, x)
    assert y._base is None and y.data_ptr() != x.data_ptr()


def test_plain_relu_fast_path_signs_of_zero() -> None:
    x = torch.tensor([-2.0, -0.0, 0.0, 3.0, -float("inf"), float("nan")])
    y = activation(RELU0, x)
    assert torch.signbit(y[:3]).tolist() == [True, True, False]  # x * 0.0 for x < 0: -0.0
    assert y[3] == 3.0 and y[4:].isnan().all()
    g = torch.tensor([-1.0, 2.0, -3.0, float("inf"), float("inf"), 5.0])
    dx = activation_backward(RELU0, g, x)
    assert torch.signbit(dx[0]) and dx[1:4].tolist() == [2.0, -3.0, float("inf")]
    assert dx[4].isnan() and dx[5] == 0.0  # inf * 0 (x = -inf); NaN input: slope 0


@pytest.mark.parametrize("a", [-0.0, 0.2, -0.5])
def test_other_relus_keep_the_general_path(a) -> None:
    """``a = -0.0`` is where the fast form would differ (+0.0 vs -0.0 for x < 0); leaky ReLUs
    are not plain. All run the general formulas."""
    p = NeuronParams(N.RELU, a, 1.0, 1.0, None)
    x, g = _data(torch.float32, "cpu", 3), _data(torch.float32, "cpu", 4)
    assert not N.plain_relu(p, x)
    assert_same_bits(activation(p, x), _general_forward(p, x))
    assert_same_bits(activation_backward(p, g, x), _general_backward(p, g, x))
    if a == -0.0:
        fast_form = torch.ge(x, 0, out=torch.empty_like(x)) * x
        assert not torch.equal(bits(fast_form), bits(activation(p, x)))


def test_relu_fast_path_needs_floating_point_and_the_relu_type() -> None:
    assert not N.plain_relu(RELU0, torch.zeros(2, dtype=torch.int32))
    assert not N.plain_relu(NeuronParams(N.LINEAR, 0.0, 0.0, 1.0, None), torch.zeros(2))
    assert not N.plain_relu(NeuronParams(N.RELU_N, 0.0, 6.0, 1.0, None), torch.zeros(2))
