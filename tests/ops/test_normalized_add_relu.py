"""``relu(bn(x) + r)`` in one pass (`mpsnn.ops.arithmetic.normalized_add_activation`, the Triton
kernel `mpsnn.ops.triton.batch_norm_nhwc.nhwc_forward_add_relu`): the bits of the normalization
followed by the residual addition and its ReLU, each as the unfused passes compute them (NaN,
infinities, -0.0, a zero gamma, every storage format), and the cases it does not take fall back
to those passes. On the CPU the kernels run in Triton's interpreter, against the interpreter's
unfused kernels (whose float32 -> bfloat16 conversion truncates there, as the fused one's does);
on a GPU also against the portable passes."""

from __future__ import annotations

import pytest
import torch

from mpsnn.ops import triton as fast_paths
from mpsnn.ops.arithmetic import add_activation, normalized_add_activation
from mpsnn.ops.batch_norm import bn_forward, bn_forward_portable
from mpsnn.ops.batch_norm_params import BatchNormParams
from mpsnn.ops.neuron import RELU, NeuronParams, activation
from mpsnn.ops.triton import batch_norm_nhwc as nhwc
from tests.helpers import TRITON_DEVICES, assert_same_bits

RELU0 = NeuronParams(RELU, 0.0, 0.0, 0.0, None)
# (N, C, H, W): 70 channels and 33x17 pixels take several tiles, the last ones partial
SHAPES = [(2, 3, 5, 7), (3, 70, 33, 17)]


def _inputs(shape, dtype, device, seed=5):
    gen = torch.Generator().manual_seed(seed)
    c = shape[1]
    x = torch.randn(shape, generator=gen) * 2 + 0.5
    r = torch.randn(shape, generator=gen) * 2
    flat_x, flat_r = x.view(-1), r.view(-1)
    flat_x[::29] = float("nan")
    flat_r[5::31] = float("inf")
    flat_r[7::37] = -float("inf")
    flat_r[3::41] = -0.0
    p = BatchNormParams(
        mean=torch.randn(c, generator=gen),
        var=torch.rand(c, generator=gen) + 0.1,
        gamma=torch.randn(c, generator=gen),
        beta=torch.randn(c, generator=gen),
        eps=1e-5,
    )
    p.gamma[0] = 0.0  # a zero gamma: bn(x) = beta
    p = BatchNormParams(*(t.to(device) for t in (p.mean, p.var, p.gamma, p.beta)), eps=p.eps)
    cl = torch.channels_last
    x, r = (t.to(device=device, dtype=dtype).contiguous(memory_format=cl) for t in (x, r))
    return x, p, r


def _counting(monkeypatch) -> list[torch.Tensor]:
    calls: list[torch.Tensor] = []
    real = nhwc.nhwc_forward_add_relu
    monkeypatch.setattr(
        nhwc, "nhwc_forward_add_relu", lambda x, *a, **k: calls.append(x) or real(x, *a, **k)
    )
    return calls


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_fused_pass_equals_the_normalization_then_the_addition(
    shape, dtype, device, monkeypatch
) -> None:
    monkeypatch.setattr(fast_paths, "_runs", lambda *ts: True)  # the interpreter's CPU too
    calls = _counting(monkeypatch)
    x, p, r = _inputs(shape, dtype, device)
    got = normalized_add_activation(x, p, r, RELU0)
    assert len(calls) == 1  # the one pass ran
    want = add_activation(bn_forward(x, p), r, RELU0)  # the unfused passes, as a graph ran them
    assert got.stride() == x.stride()
    assert_same_bits(got, want)
    assert bool(got.isnan().any()) and bool((got == 0).any())  # the specials reached the output
    if device == "cuda" or dtype is not torch.bfloat16:  # the portable passes round too
        assert_same_bits(got, activation(RELU0, bn_forward_portable(x, p) + r))
    # bn(x) as the second operand: r + bn(x), in that order
    second = normalized_add_activation(x, p, r, RELU0, first=False)
    assert len(calls) == 2
    assert_same_bits(second, add_activation(r, bn_forward(x, p), RELU0))


def test_what_the_pass_does_not_take_runs_the_two_passes(monkeypatch) -> None:
    monkeypatch.setattr(fast_paths, "_runs", lambda *ts: True)
    calls = _counting(monkeypatch)
    device = TRITON_DEVICES[0]
    x, p, r = _inputs((2, 6, 5, 4), torch.float32, device)
    cases = [
        (x.contiguous(), p, r.contiguous(), RELU0),  # NCHW: the normalization's own NCHW pass
        (x, p, r.contiguous(), RELU0),  # layouts differ
        (x, p, r.double(), RELU0),  # dtypes differ
        (x, BatchNormParams(p.mean, p.var, p.gamma, p.beta, p.eps, RELU0), r, RELU0),  # BN neuron
        (x, p, r, NeuronParams(RELU, 0.1, 0.0, 0.0, None)),  # a leaky ReLU after the sum
    ]
    for xs, ps, rs, neuron in cases:
        got = normalized_add_activation(xs, ps, rs, neuron)
        want = add_activation(bn_forward(xs, ps), rs, neuron)
        assert_same_bits(got, want)
        got = normalized_add_activation(xs, ps, rs, neuron, first=False)
        assert_same_bits(got, add_activation(rs, bn_forward(xs, ps), neuron))
    assert calls == []
    # and off the fast paths (the CPU as it is): the portable passes
    monkeypatch.undo()
    x, p, r = _inputs((2, 6, 5, 4), torch.float32, "cpu")
    assert fast_paths.batch_norm_add_relu(x, p, r) is None
    got = normalized_add_activation(x, p, r, RELU0)
    assert_same_bits(got, activation(RELU0, bn_forward_portable(x, p) + r))
