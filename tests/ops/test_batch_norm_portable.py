"""Batch normalization's portable passes (`mpsnn.ops.batch_norm`): they update their own
temporaries in place, and must give the bits of the formulas written with a new tensor for
every operation (below, `_reference_*`), the sums' order included, whatever the layouts of
``x`` and ``g``; never write their inputs; and stay differentiable in reverse and forward mode
(a gradient penalty differentiates the gradient passes)."""

from __future__ import annotations

import itertools

import pytest
import torch

from mpsnn.ops import batch_norm as bn
from mpsnn.ops._dtypes import acc_dtype
from mpsnn.ops.batch_norm_params import BatchNormParams as P
from mpsnn.ops.batch_norm_params import BatchNormSums as S
from mpsnn.ops.neuron import RELU, SIGMOID, NeuronParams, activation
from tests.helpers import assert_same_bits

F64 = torch.float64
DIMS = (0, 2, 3)
NEURONS = {
    "none": None,
    "relu": NeuronParams(RELU, 0.0, 0.0, 0.0, None),
    "leaky": NeuronParams(RELU, 0.2, 0.0, 0.0, None),
    "sigmoid": NeuronParams(SIGMOID, 0.0, 0.0, 0.0, None),
}
LAYOUTS = {"nchw": torch.contiguous_format, "cl": torch.channels_last}


# -- the formulas with a new tensor for every operation -------------------------------------


def _reference_statistics(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    ct = acc_dtype(x.dtype)
    c = x.shape[1]
    shift = x[:1, :, :1, :1].to(ct)
    d = x.to(ct) - shift
    dm = d.mean(dim=DIMS, keepdim=True)
    d = d - dm
    return (shift + dm).view(c), (d * d).sum(dim=DIMS)


def _reference_forward(x: torch.Tensor, p: P) -> torch.Tensor:
    ct = acc_dtype(x.dtype)
    inv = bn._inv_std(p.var.to(ct), p.eps)
    a = p.gamma.to(ct) * inv
    z = (x.to(ct) - bn._col(p.mean, ct)) * bn._col(a, ct) + bn._col(p.beta, ct)
    if p.neuron is not None:
        z = activation(p.neuron, z)
    return z.to(x.dtype)


def _reference_sums(g: torch.Tensor, x: torch.Tensor, p: P) -> tuple[torch.Tensor, ...]:
    ct = acc_dtype(x.dtype)
    inv = bn._inv_std(p.var.to(ct), p.eps)
    xc = x.to(ct) - bn._col(p.mean, ct)
    xhat = xc * bn._col(inv, ct)
    gy = g.to(ct)
    if p.neuron is not None:
        z = xc * bn._col(p.gamma.to(ct) * inv, ct) + bn._col(p.beta, ct)
        gy = bn._neuron_gradient(p.neuron, gy, z)
    return gy.sum(dim=DIMS), (gy * xhat).sum(dim=DIMS)


def _reference_backward(g: torch.Tensor, x: torch.Tensor, p: P, s: S) -> torch.Tensor:
    ct = acc_dtype(x.dtype)
    m = torch.as_tensor(s.count, dtype=ct)
    inv = bn._inv_std(p.var.to(ct), p.eps)
    a = p.gamma.to(ct) * inv
    xc = x.to(ct) - bn._col(p.mean, ct)
    xhat = xc * bn._col(inv, ct)
    gy = g.to(ct)
    if p.neuron is not None:
        gy = bn._neuron_gradient(p.neuron, gy, xc * bn._col(a, ct) + bn._col(p.beta, ct))
    t = gy - bn._col(s.sum_gy.to(ct) / m, ct)
    t = t - xhat * bn._col(s.sum_gy_xhat.to(ct) / m, ct)
    return (t * bn._col(a, ct)).to(x.dtype)


def _case(dtype: torch.dtype, x_layout: str, g_layout: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shape = (3, 5, 4, 6)
    x = (torch.randn(shape, generator=gen) * 3 + 1).to(dtype)
    g = torch.randn(shape, generator=gen).to(dtype)
    x[0, 1, 2, 3] = float("nan")  # channel 1: NaN statistics
    x[2, 3, 1, 1] = float("-inf")  # channel 3: an infinite mean
    x = x.contiguous(memory_format=LAYOUTS[x_layout])
    g = g.contiguous(memory_format=LAYOUTS[g_layout])
    ct = acc_dtype(dtype)
    gamma = (torch.rand(5, generator=gen) + 0.5).to(ct)
    beta = (torch.randn(5, generator=gen) * 0.1).to(ct)
    return x, g, gamma, beta


@pytest.mark.parametrize("neuron", list(NEURONS))
@pytest.mark.parametrize(("x_layout", "g_layout"), list(itertools.product(LAYOUTS, LAYOUTS)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64], ids=str)
def test_portable_passes_give_the_bits_of_new_tensors(dtype, x_layout, g_layout, neuron) -> None:
    x, g, gamma, beta = _case(dtype, x_layout, g_layout, seed=len(neuron) + 7)
    kept = [t.clone() for t in (x, g, gamma, beta)]
    count, mean, m2 = bn.bn_statistics_portable(x)
    want_mean, want_m2 = _reference_statistics(x)
    assert_same_bits(mean, want_mean)
    assert_same_bits(m2, want_m2)
    p = P(mean, bn.bn_variance(count, m2), gamma, beta, 1e-3, NEURONS[neuron])
    y = bn.bn_forward_portable(x, p)
    assert_same_bits(y, _reference_forward(x, p))
    assert y.stride() == _reference_forward(x, p).stride()
    sums = bn.bn_gradient_sums_portable(g, x, p)
    for got, want in zip(sums, _reference_sums(g, x, p), strict=True):
        assert_same_bits(got, want)
    s = S(sums[0], sums[1], count)
    dx = bn.bn_backward_portable(g, x, p, s)
    want_dx = _reference_backward(g, x, p, s)
    assert_same_bits(dx, want_dx)
    assert dx.stride() == want_dx.stride()
    for t, k in zip((x, g, gamma, beta), kept, strict=True):  # the inputs are never written
        assert_same_bits(t, k)


@pytest.mark.parametrize("neuron", ["none", "relu", "sigmoid"])
def test_the_gradient_passes_differentiate_in_reverse_mode(neuron) -> None:
    """``torch.autograd.grad`` through the gradient sums and the input gradient (with respect
    to x, the variance and gamma) equals the reference formulas' gradients: the passes' in-place
    updates never overwrite what autograd saved."""
    gen = torch.Generator().manual_seed(5)
    x0 = torch.randn(2, 3, 4, 4, generator=gen, dtype=F64)
    g = torch.randn(2, 3, 4, 4, generator=gen, dtype=F64)
    var0 = torch.rand(3, generator=gen, dtype=F64) + 0.5
    gamma0 = torch.rand(3, generator=gen, dtype=F64) + 0.5
    mean, beta = torch.randn(3, generator=gen, dtype=F64), torch.randn(3, generator=gen, dtype=F64)
    s = S(torch.randn(3, generator=gen, dtype=F64), torch.randn(3, generator=gen, dtype=F64), 32.0)
    grads = []
    for sums_fn, back_fn in (
        (bn.bn_gradient_sums_portable, bn.bn_backward_portable),
        (_reference_sums, _reference_backward),
    ):
        x, var, gamma = (t.clone().requires_grad_() for t in (x0, var0, gamma0))
        p = P(mean, var, gamma, beta, 1e-3, NEURONS[neuron])
        sum_gy, sum_gy_xhat = sums_fn(g, x, p)
        loss = (sum_gy * sum_gy_xhat).sum() + (back_fn(g, x, p, s) ** 2).sum()
        grads.append(torch.autograd.grad(loss, (x, var, gamma)))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_input_gradient_under_torch_func_never_writes_a_captured_gradient() -> None:
    """Under `torch.func` a widened ``g`` can be a new object sharing ``g``'s memory: the pass
    decides what it may update in place from the dtypes and the neuron, not from identity, so
    a Jacobian with respect to ``x`` (``g`` captured, no neuron) computes as plain autograd."""
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(2, 3, 4, 4, generator=gen, dtype=F64)
    g = torch.randn(2, 3, 4, 4, generator=gen, dtype=F64)
    kept = g.clone()
    mean, var = torch.randn(3, generator=gen, dtype=F64), torch.rand(3, generator=gen, dtype=F64)
    p = P(mean, var + 0.5, torch.ones(3, dtype=F64), torch.zeros(3, dtype=F64), 1e-3, None)
    s = S(mean * 0.3, var, torch.tensor([32.0], dtype=F64))

    w = torch.randn(2, 3, 4, 4, generator=gen, dtype=F64)  # a random cotangent, not all ones

    def f(xx: torch.Tensor) -> torch.Tensor:
        return (bn.bn_backward_portable(g, xx, p, s) * w).sum()

    got = torch.func.jacfwd(f)(x)
    want = torch.func.jacfwd(lambda xx: (_reference_backward(g, xx, p, s) * w).sum())(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(g, kept)


def test_the_cpu_square_root_is_correctly_rounded() -> None:
    """`_sqrt_rn` of float32 values on the CPU is the float32 nearest to the real square root:
    its neighbours' squares (in float64, exact for float32 values) are no closer to ``v`` (a
    square root never falls halfway between two floats); ``sqrt(inf) = inf`` and
    ``sqrt(0) = 0``, as on CUDA."""
    gen = torch.Generator().manual_seed(11)
    bits = torch.randint(0, 0x7F800000, (200_000,), generator=gen, dtype=torch.int64)
    squares = (torch.rand(50_000, generator=gen, dtype=F64) * 1e3).float().double() ** 2
    v = torch.cat([bits.to(torch.int32).view(torch.float32), squares.float()])
    s = bn._sqrt_rn(v)
    exact = v.double()
    inf = torch.full_like(s, float("inf"))
    for other in (torch.nextafter(s, inf), torch.nextafter(s, -inf)):
        # |s² - v| <= |other² - v| in float64 (float32 products are exact there, up to one
        # rounding of the difference, far below the gap between neighbours' squares)
        assert ((s.double() ** 2 - exact).abs() <= (other.double() ** 2 - exact).abs()).all()
    special = bn._sqrt_rn(torch.tensor([0.0, float("inf")]))
    assert special.tolist() == [0.0, float("inf")]


def test_the_portable_passes_make_few_layer_sized_tensors() -> None:
    """On the CPU a new layer-sized tensor costs about a pass (fresh pages): the float32 passes
    with a ReLU make at most these many (the formulas with a new tensor per operation make
    2, 4, 6 and 9), counted by the profiler's memory events of the operations that allocate
    them (``self_cpu_memory_usage``: a nested operation does not count them again)."""
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(2, 8, 32, 32)
    g = torch.randn(2, 8, 32, 32)
    count, mean, m2 = bn.bn_statistics_portable(x)
    p = P(mean, bn.bn_variance(count, m2), torch.ones(8), torch.zeros(8), 1e-5, NEURONS["relu"])
    s = S(torch.zeros(8), torch.zeros(8), count)
    calls = {
        "statistics": (lambda: bn.bn_statistics_portable(x), 1),
        "forward": (lambda: bn.bn_forward_portable(x, p), 2),
        "gradient sums": (lambda: bn.bn_gradient_sums_portable(g, x, p), 3),
        "backward": (lambda: bn.bn_backward_portable(g, x, p, s), 3),
    }
    for name, (fn, most) in calls.items():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        made = sum(1 for e in prof.events() if e.self_cpu_memory_usage >= x.numel() * 4)
        assert 1 <= made <= most, (name, made)
