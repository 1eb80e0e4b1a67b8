"""Batch-normalization math: statistics, forward (+ neuron) and gradient against PyTorch's
``F.batch_norm`` and autograd in float64; the adjoint identity of the whole gradient map with
forward-mode products of our own forward; sub-batch merging in 1, 2 and 3 parts and its order;
zero-variance channels; a channel of mean 1e4 in float32, float16 and bfloat16 storage;
half-precision storage against a float64 reference; and the Triton kernels against the
portable path (bit for bit where promised), in Triton's interpreter on the CPU."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from mpsnn.ops import triton as fast_paths
from mpsnn.ops.batch_norm import (
    bn_backward,
    bn_backward_portable,
    bn_forward,
    bn_forward_portable,
    bn_gradient_sums,
    bn_gradient_sums_portable,
    bn_merge,
    bn_merge_all,
    bn_statistics,
    bn_statistics_portable,
    bn_variance,
)
from mpsnn.ops.batch_norm_params import BatchNormParams as P
from mpsnn.ops.batch_norm_params import BatchNormSums as S
from mpsnn.ops.neuron import ELU, NONE, PRELU, RELU, SIGMOID, TANH, NeuronParams
from mpsnn.ops.triton import batch_norm as triton_bn  # the dev setup installs Triton
from tests.helpers import DEVICES, TOL, TRITON_DEVICES, assert_adjoint, assert_close

F64 = torch.float64
HALF_AND_SINGLE = [torch.float32, torch.float16, torch.bfloat16]


def _neuron(kind: int, a: float = 0.0, b: float = 0.0, data=None) -> NeuronParams:
    return NeuronParams(kind, a, b, 0.0, data)


_PRELU_SLOPES = torch.tensor([0.1, -0.3, 0.7])
# (id, neuron, the same function in PyTorch); 3 channels wherever PRELU is used.
NEURONS = [
    ("none", None, lambda z: z),
    ("relu", _neuron(RELU), F.relu),
    ("leaky", _neuron(RELU, 0.15), lambda z: F.leaky_relu(z, 0.15)),
    ("sigmoid", _neuron(SIGMOID), torch.sigmoid),
    ("tanh", _neuron(TANH, 1.5, 0.7), lambda z: 1.5 * torch.tanh(0.7 * z)),
    ("elu", _neuron(ELU, 0.8), lambda z: F.elu(z, 0.8)),
    ("prelu", _neuron(PRELU, data=_PRELU_SLOPES), lambda z: F.prelu(z, _PRELU_SLOPES.to(z))),
]
NEURON_IDS = [n[0] for n in NEURONS]


def _inputs(shape, seed: int, dtype=F64, device="cpu"):
    """x with a different mean and spread per channel, gamma, beta and a random cotangent."""
    n, c, h, w = shape
    gen = torch.Generator().manual_seed(seed)
    offset = torch.randn(1, c, 1, 1, generator=gen, dtype=F64) * 3
    scale = torch.rand(1, c, 1, 1, generator=gen, dtype=F64) * 2 + 0.3
    x = torch.randn(n, c, h, w, generator=gen, dtype=F64) * scale + offset
    gamma = torch.randn(c, generator=gen, dtype=F64) + 0.5
    beta = torch.randn(c, generator=gen, dtype=F64)
    g = torch.randn(n, c, h, w, generator=gen, dtype=F64)
    acc = torch.float64 if dtype == F64 else torch.float32
    return (
        x.to(device=device, dtype=dtype),
        gamma.to(device=device, dtype=acc),
        beta.to(device=device, dtype=acc),
        g.to(device=device, dtype=dtype),
    )


def _ours(x, gamma, beta, eps, neuron, g):
    """Forward and gradient through the public functions: y, (count, mean, var), and
    (dx, dgamma, dbeta)."""
    count, mean, m2 = bn_statistics(x)
    var = bn_variance(count, m2)
    p = P(mean, var, gamma, beta, eps, neuron)
    y = bn_forward(x, p)
    sum_gy, sum_gy_xhat = bn_gradient_sums(g, x, p)
    dx = bn_backward(g, x, p, S(sum_gy, sum_gy_xhat, count))
    return y, (count, mean, var), (dx, sum_gy_xhat, sum_gy)


def _torch(x, gamma, beta, eps, fn, g):
    """PyTorch float64: y and autograd's (dx, dgamma, dbeta) for the cotangent g."""
    xr, gr, br = (t.detach().double().clone().requires_grad_() for t in (x, gamma, beta))
    y = fn(F.batch_norm(xr, None, None, gr, br, training=True, eps=eps))
    return y.detach(), torch.autograd.grad(y, (xr, gr, br), g.double())


# -- against PyTorch, float64 ---------------------------------------------------------------


@pytest.mark.parametrize("eps", [1e-5, 0.1])
@pytest.mark.parametrize("neuron_case", NEURONS, ids=NEURON_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_forward_and_gradient_match_pytorch_autograd(neuron_case, eps, device) -> None:
    _, neuron, fn = neuron_case
    x, gamma, beta, g = _inputs((4, 3, 5, 6), 1, device=device)
    y, (count, mean, var), grads = _ours(x, gamma, beta, eps, neuron, g)
    want_y, want_grads = _torch(x, gamma, beta, eps, fn, g)
    want_var, want_mean = torch.var_mean(x, dim=(0, 2, 3), correction=0)
    assert count.dtype == F64 and count.shape == (1,) and count.item() == 4 * 5 * 6
    assert_close(mean, want_mean, "mean", tol=1e-13)
    assert_close(var, want_var, "var", tol=1e-13)
    assert y.dtype == F64 and y.shape == x.shape
    assert_close(y, want_y, "y", tol=1e-12)
    for got, want, what in zip(grads, want_grads, ("dx", "dgamma", "dbeta"), strict=True):
        assert got.dtype == F64
        assert_close(got, want, what, tol=1e-10)


@pytest.mark.parametrize("neuron_case", NEURONS[:4], ids=NEURON_IDS[:4])
def test_odd_shapes_match_pytorch(neuron_case) -> None:
    _, neuron, fn = neuron_case
    for shape in [(1, 3, 7, 5), (5, 3, 1, 1), (2, 3, 1, 9)]:
        x, gamma, beta, g = _inputs(shape, 2)
        y, _, grads = _ours(x, gamma, beta, 1e-3, neuron, g)
        want_y, want_grads = _torch(x, gamma, beta, 1e-3, fn, g)
        assert_close(y, want_y, f"y {shape}", tol=1e-12)
        for got, want, what in zip(grads, want_grads, ("dx", "dgamma", "dbeta"), strict=True):
            assert_close(got, want, f"{what} {shape}", tol=1e-10)


@pytest.mark.parametrize("neuron_case", [NEURONS[i] for i in (0, 2, 3, 6)], ids=str)
def test_gradient_map_is_the_adjoint_of_the_forward(neuron_case) -> None:
    """``<J v, w> = <v, J^T w>`` for the whole map (x, gamma, beta) -> y, with ``J v`` from
    forward-mode differentiation of our own forward (statistics included) and ``J^T w`` from
    the gradient functions."""
    _, neuron, _ = neuron_case
    eps = 1e-4
    x, gamma, beta, w = _inputs((3, 3, 4, 5), 3)
    gen = torch.Generator().manual_seed(33)
    v = [torch.randn(t.shape, generator=gen, dtype=F64) for t in (x, gamma, beta)]

    def forward(x, gamma, beta):
        count, mean, m2 = bn_statistics(x)
        return bn_forward(x, P(mean, bn_variance(count, m2), gamma, beta, eps, neuron))

    _, jv = torch.func.jvp(forward, (x, gamma, beta), tuple(v))
    _, _, (dx, dgamma, dbeta) = _ours(x, gamma, beta, eps, neuron, w)
    jtw = torch.cat([dx.flatten(), dgamma, dbeta])
    assert_adjoint(jv, w, torch.cat([t.flatten() for t in v]), jtw, "batch norm", tol=1e-11)


# -- sub-batches ----------------------------------------------------------------------------

PARTS = [[6], [2, 4], [1, 2, 3]]


def _merged(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    c = parts[0].shape[1]
    # A fresh accumulator: count 0, and mean/m2 that must not leak into the result.
    acc = [torch.zeros(1, dtype=F64), torch.full((c,), float("nan"), dtype=F64),
           torch.full((c,), float("nan"), dtype=F64)]  # fmt: skip
    for p in parts:
        bn_merge(acc, bn_statistics(p))
    return acc


@pytest.mark.parametrize("sizes", PARTS, ids=str)
def test_sub_batches_merge_to_the_whole_batch(sizes) -> None:
    neuron = _neuron(RELU, 0.1)
    eps = 1e-3
    x, gamma, beta, g = _inputs((6, 3, 4, 5), 4)
    xs, gs = x.split(sizes), g.split(sizes)
    count, mean, m2 = _merged(list(xs))
    whole = bn_statistics(x)
    assert torch.equal(count, whole[0])
    assert_close(mean, whole[1], "mean", tol=1e-13)
    assert_close(m2, whole[2], "m2", tol=1e-12)
    var = bn_variance(count, m2)
    p = P(mean, var, gamma, beta, eps, neuron)
    # Gradient sums of the sub-batches add up to the whole batch's ...
    sums = [bn_gradient_sums(gp, xp, p) for gp, xp in zip(gs, xs, strict=True)]
    sum_gy = sum(s[0] for s in sums)
    sum_gy_xhat = sum(s[1] for s in sums)
    whole_sums = bn_gradient_sums(g, x, p)
    assert_close(sum_gy, whole_sums[0], "sum_gy", tol=1e-12)
    assert_close(sum_gy_xhat, whole_sums[1], "sum_gy_xhat", tol=1e-12)
    # ... and each sub-batch's dx, given the whole batch's sums, is its slice of the whole dx.
    dxs = [
        bn_backward(gp, xp, p, S(sum_gy, sum_gy_xhat, count)) for gp, xp in zip(gs, xs, strict=True)
    ]
    want = bn_backward(g, x, P(whole[1], var, gamma, beta, eps, neuron), S(*whole_sums, whole[0]))
    assert_close(torch.cat(dxs), want, "dx", tol=1e-12)
    _, want_grads = _torch(x, gamma, beta, eps, lambda z: F.leaky_relu(z, 0.1), g)
    assert_close(torch.cat(dxs), want_grads[0], "dx vs PyTorch", tol=1e-10)


def test_merge_order_does_not_matter() -> None:
    x, *_ = _inputs((6, 3, 4, 5), 5)
    parts = list(x.split([1, 2, 3]))
    ref = _merged(parts)
    for order in itertools.permutations(range(3)):
        got = _merged([parts[i] for i in order])
        assert torch.equal(got[0], ref[0])
        assert_close(got[1], ref[1], f"mean {order}", tol=1e-14)
        assert_close(got[2], ref[2], f"m2 {order}", tol=1e-13)


def test_first_merge_stores_the_triple_and_empty_merges_keep_it() -> None:
    x, *_ = _inputs((2, 3, 4, 5), 6)
    new = bn_statistics(x)
    acc = [torch.zeros(1, dtype=F64), torch.full((3,), float("nan"), dtype=F64),
           torch.full((3,), float("inf"), dtype=F64)]  # fmt: skip
    held = list(acc)
    bn_merge(acc, new)
    for got, want in zip(acc, new, strict=True):
        assert torch.equal(got, want)
    assert all(a is b for a, b in zip(acc, held, strict=True))  # written in place
    # A zero-count triple changes nothing, whatever its mean and m2.
    empty = (torch.zeros(1, dtype=F64), torch.full((3,), float("nan"), dtype=F64),
             torch.full((3,), 7.0, dtype=F64))  # fmt: skip
    bn_merge(acc, empty)
    for got, want in zip(acc, new, strict=True):
        assert torch.equal(got, want)


def test_per_channel_counts_merge() -> None:
    """A (C,) count (channels seen by different numbers of elements) merges per channel."""
    x, *_ = _inputs((4, 3, 4, 5), 7)
    a, b = x[:1], x[1:]
    acc = [torch.tensor([0.0, 20.0, 0.0], dtype=F64), torch.zeros(3, dtype=F64),
           torch.zeros(3, dtype=F64)]  # fmt: skip
    # channel 1 already holds the statistics of the images in a
    _, ma, qa = bn_statistics(a)
    acc[1][1], acc[2][1] = ma[1], qa[1]
    bn_merge(acc, bn_statistics(b))
    whole = bn_statistics(x)
    part = bn_statistics(b)
    assert acc[0].tolist() == [60.0, 80.0, 60.0]
    assert_close(acc[1][1], whole[1][1], "merged channel mean", tol=1e-14)
    assert_close(acc[2][1], whole[2][1], "merged channel m2", tol=1e-13)
    assert torch.equal(acc[1][0::2], part[1][0::2]) and torch.equal(acc[2][0::2], part[2][0::2])
    # a (1,) accumulator merged with a (C,) count grows to (C,)
    acc1 = [torch.zeros(1, dtype=F64), torch.zeros(3, dtype=F64), torch.zeros(3, dtype=F64)]
    bn_merge(acc1, (torch.full((3,), 60.0, dtype=F64), part[1], part[2]))
    assert acc1[0].shape == (3,) and torch.equal(acc1[1], part[1])


def test_variance_guards_small_counts() -> None:
    m2 = torch.tensor([0.0, 2.0, 6.0], dtype=F64)
    assert bn_variance(torch.tensor([4.0], dtype=F64), m2).tolist() == [0.0, 0.5, 1.5]
    assert bn_variance(torch.tensor([4.0], dtype=F64), m2, unbiased=True).tolist() == [
        0.0,
        2.0 / 3.0,
        2.0,
    ]
    one = bn_variance(torch.tensor([1.0], dtype=F64), torch.zeros(3, dtype=F64), unbiased=True)
    assert one.tolist() == [0.0, 0.0, 0.0]  # a single sample: 0, not 0/0
    empty = bn_variance(torch.tensor([0.0], dtype=F64), torch.zeros(3, dtype=F64))
    assert empty.tolist() == [0.0, 0.0, 0.0]


# -- numerics -------------------------------------------------------------------------------


@pytest.mark.parametrize("neuron_case", NEURONS[:3], ids=NEURON_IDS[:3])
def test_zero_variance_channel_is_finite_and_matches_pytorch(neuron_case) -> None:
    _, neuron, fn = neuron_case
    x, gamma, beta, g = _inputs((3, 3, 4, 4), 8)
    x[:, 1] = 2.5  # constant channel
    beta[1] = 0.3  # z = 0.3 on it: away from ReLU's kink
    y, (_, mean, var), grads = _ours(x, gamma, beta, 1e-3, neuron, g)
    assert mean[1].item() == 2.5 and var[1].item() == 0.0  # exact: shifted by a sample
    want_y, want_grads = _torch(x, gamma, beta, 1e-3, fn, g)
    assert_close(y, want_y, "y", tol=1e-12)
    for got, want, what in zip(grads, want_grads, ("dx", "dgamma", "dbeta"), strict=True):
        assert_close(got, want, what, tol=1e-10)
    # eps = 0: 0/0 on the constant channel; here xhat = 0 there, so y = f(beta),
    # dx = 0 and dgamma = 0, and the other channels are unchanged.
    y0, _, (dx0, dgamma0, dbeta0) = _ours(x, gamma, beta, 0.0, neuron, g)
    assert torch.isfinite(y0).all() and torch.isfinite(dx0).all()
    assert torch.isfinite(dgamma0).all() and torch.isfinite(dbeta0).all()
    want_y0, want_grads0 = _torch(x, gamma, beta, 1e-300, fn, g)  # PyTorch refuses eps = 0
    z = torch.full_like(y0[:, 1], 0.3)
    assert torch.equal(y0[:, 1], fn(z))
    assert dx0[:, 1].abs().max().item() == 0.0 and dgamma0[1].item() == 0.0
    for c in (0, 2):
        assert_close(y0[:, c], want_y0[:, c], f"y0 channel {c}", tol=1e-12)
        assert_close(dx0[:, c], want_grads0[0][:, c], f"dx0 channel {c}", tol=1e-10)


# (storage dtype, channel mean): std 1 around a mean of 1e4. In bfloat16 (spacing 64 there)
# and float16 (spacing 8) such values collapse to one stored value or straddle two: 1e4 itself
# (a constant channel: m2 must be exactly 0) and a mean on a rounding boundary (two values).
BIG_MEAN = [
    (torch.float32, 1e4),
    (torch.bfloat16, 1e4),
    (torch.bfloat16, 1e4 + 16),
    (torch.float16, 1e4 + 4),
]


def _big_mean_source(dtype, mean, device):
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, 3, 9, 11, generator=gen, dtype=F64)
    x[:, 1] += mean  # channel 1 of mean ~1e4, std 1; the others near 0
    return x.to(dtype).to(device)


def _check_big_mean(stats, x) -> None:
    count, mean, m2 = stats
    stored = x.double().cpu()
    want_var, want_mean = torch.var_mean(stored, dim=(0, 2, 3), correction=0)
    var = m2.double().cpu() / count.double().cpu()
    assert abs(mean[1].item() - want_mean[1].item()) <= 1e-6 * abs(want_mean[1].item())
    if want_var[1].item() == 0:
        assert m2[1].item() == 0.0
    else:
        rel = abs(var[1].item() - want_var[1].item()) / want_var[1].item()
        assert rel <= 1e-3, f"variance relative error {rel:.2e}"
    assert_close(var, want_var, "all channels' variances", tol=1e-3)


@pytest.mark.parametrize(("dtype", "mean"), BIG_MEAN, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_large_mean_keeps_the_variance(dtype, mean, device) -> None:
    x = _big_mean_source(dtype, mean, device)
    _check_big_mean(bn_statistics(x), x)


@pytest.mark.parametrize(("dtype", "mean"), BIG_MEAN, ids=str)
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_large_mean_keeps_the_variance(dtype, mean, device) -> None:
    x = _big_mean_source(dtype, mean, device)
    _check_big_mean(triton_bn.bn_statistics_triton(x), x)
    _check_big_mean(triton_bn.bn_statistics_triton(x, planes=1, span=40, block=16), x)


@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_storage_formats_against_a_float64_reference(dtype, device) -> None:
    """Inputs rounded to the storage dtype; the reference is PyTorch in float64 on those
    rounded values. Outputs in the storage dtype, sums in float32."""
    neuron, fn = _neuron(RELU, 0.2), lambda z: F.leaky_relu(z, 0.2)
    x, gamma, beta, g = _inputs((4, 3, 6, 7), 10, dtype=dtype, device=device)
    y, _, grads = _ours(x, gamma, beta, 1e-3, neuron, g)
    want_y, want_grads = _torch(x, gamma, beta, 1e-3, fn, g)
    assert y.dtype == dtype and grads[0].dtype == dtype
    assert grads[1].dtype == torch.float32 and grads[2].dtype == torch.float32
    assert_close(y, want_y, "y", dtype=dtype)
    for got, want, what in zip(grads, want_grads, ("dx", "dgamma", "dbeta"), strict=True):
        assert_close(got, want, what, tol=TOL[dtype])


def test_bad_shapes_are_errors() -> None:
    x, gamma, beta, g = _inputs((2, 3, 4, 4), 11)
    count, mean, m2 = bn_statistics(x)
    with pytest.raises(
        ValueError, match=r"\[bn_statistics\] x must be \(N, C, H, W\), got shape \(2, 3, 16\)"
    ):
        bn_statistics(x.flatten(2))
    with pytest.raises(ValueError, match=r"\[bn_forward\] gamma must be \(3,\), got shape \(2,\)"):
        bn_forward(x, P(mean, m2, gamma[:2], beta, 1e-3))
    with pytest.raises(
        ValueError,
        match=r"\[bn_gradient_sums\] g must have x's shape \(2, 3, 4, 4\), got \(1, 3, 4, 4\)",
    ):
        bn_gradient_sums(g[:1], x, P(mean, m2, gamma, beta, 1e-3))
    with pytest.raises(
        ValueError, match=r"\[bn_merge\] acc and new must be \(count, mean, m2\), got 2 and 3"
    ):
        bn_merge([count, mean], (count, mean, m2))


# -- Triton fast paths ----------------------------------------------------------------------

TRITON_SHAPES = [
    (2, 3, 5, 7),  # H W = 35: not a multiple of any block
    (1, 3, 17, 19),  # N = 1
    (3, 4, 8, 8),
    (5, 2, 1, 3),  # tiny planes, several per program
]
# Work splits: the default plan, then one plane per program split in 13-element spans read by
# 8-element blocks (rounded up to 16: a ragged last span and a ragged last block), then two
# planes per program in 16-element blocks.
# The fourth: tiles of several planes (3 planes per reduction program in tiles of 2 rows, and 4
# planes per elementwise program: ragged last tiles of rows), each plane in 4-element blocks.
SPLITS = [
    {},
    dict(planes=1, span=13, block=8),
    dict(planes=2, span=None, block=16),
    dict(planes=3, span=None, block=4, rows=2),
]
# Each neuron case and each split at least once (ReLU with all three).
TRITON_CASES = [
    ("none", None, SPLITS[0]),
    ("NONE", _neuron(NONE), SPLITS[1]),
    ("relu", _neuron(RELU), SPLITS[2]),
    ("leaky", _neuron(RELU, 0.2), SPLITS[0]),
    ("leaky", _neuron(RELU, 0.2), SPLITS[1]),
    ("leaky", _neuron(RELU, 0.2), SPLITS[2]),
    ("relu", _neuron(RELU), SPLITS[3]),
    ("none", None, SPLITS[3]),
]


def _elementwise_split(split: dict) -> dict:
    ew = {k: v for k, v in split.items() if k in ("span", "block")}
    if "rows" in split:
        ew["rows"] = 2 * split["rows"]  # 4 planes per elementwise program: ragged last ones
    return ew


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=str)
@pytest.mark.parametrize("shape", TRITON_SHAPES, ids=str)
def test_triton_statistics_equal_portable(shape, dtype, device) -> None:
    x, *_ = _inputs(shape, 12, dtype=dtype, device=device)
    want = bn_statistics_portable(x)
    for split in SPLITS:
        count, mean, m2 = triton_bn.bn_statistics_triton(x, **split)
        assert count.dtype == mean.dtype == m2.dtype == torch.float32
        assert torch.equal(count, want[0]), split
        assert_close(mean, want[1], f"mean {split}", tol=1e-6)
        assert_close(m2, want[2], f"m2 {split}", tol=1e-5)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=str)
@pytest.mark.parametrize("shape", TRITON_SHAPES, ids=str)
def test_triton_passes_equal_portable(shape, dtype, device) -> None:
    """Normalization and dx bit for bit; gradient sums up to summation order."""
    x, gamma, beta, g = _inputs(shape, 13, dtype=dtype, device=device)
    count, mean, m2 = bn_statistics_portable(x)
    var = bn_variance(count, m2)
    eps = 1e-3
    for name, neuron, split in TRITON_CASES:
        what = f"{name} {split}"
        ew = _elementwise_split(split)
        p = P(mean, var, gamma, beta, eps, neuron)
        y = triton_bn.bn_forward_triton(x, p, **ew)
        want_y = bn_forward_portable(x, p)
        assert y.dtype == dtype and torch.equal(y, want_y), f"y {what}"
        sums = triton_bn.bn_gradient_sums_triton(g, x, p, **split)
        want_sums = bn_gradient_sums_portable(g, x, p)
        assert_close(sums[0], want_sums[0], f"sum_gy {what}", tol=1e-5)
        assert_close(sums[1], want_sums[1], f"sum_gy_xhat {what}", tol=1e-5)
        for cnt in (count, count.expand(shape[1]).contiguous()):  # (1,) and (C,) counts
            args = (p, S(*want_sums, cnt))
            dx = triton_bn.bn_backward_triton(g, x, *args, **ew)
            want_dx = bn_backward_portable(g, x, *args)
            assert dx.dtype == dtype and torch.equal(dx, want_dx), f"dx {what}"


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", HALF_AND_SINGLE, ids=str)
def test_triton_zero_variance_channel(dtype, device) -> None:
    x, gamma, beta, g = _inputs((2, 3, 5, 5), 14, dtype=dtype, device=device)
    x[:, 2] = 1.25
    count, mean, m2 = triton_bn.bn_statistics_triton(x)
    assert mean[2].item() == 1.25 and m2[2].item() == 0.0
    var = bn_variance(count, m2)
    relu = _neuron(RELU, 0.1)
    for eps in (1e-3, 0.0):
        p = P(mean, var, gamma, beta, eps, relu)
        y = triton_bn.bn_forward_triton(x, p)
        sums = triton_bn.bn_gradient_sums_triton(g, x, p)
        dx = triton_bn.bn_backward_triton(g, x, p, S(*sums, count))
        assert torch.isfinite(y).all() and torch.isfinite(dx).all()
        assert torch.isfinite(sums[0]).all() and torch.isfinite(sums[1]).all()
        assert torch.equal(y, bn_forward_portable(x, p))
        assert torch.equal(dx, bn_backward_portable(g, x, p, S(*sums, count)))


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_bfloat16_results_round_to_nearest_even(device) -> None:
    """float32 results exactly between two bfloat16 values (ties to even), just above and below
    them, beyond the largest bfloat16, subnormal, infinite and NaN, stored bit for bit as
    PyTorch rounds them. One value per channel, with x = 0, mean 0 and var + eps = 1: the
    normalization gives z = beta, and dx (g = 1, zero sums, count 1) gives gamma."""
    t = 2.0**-20
    values = [1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + t, 1 + 2**-8 - t, -3 - 2**-7, 100.25,
              3.4028234663852886e38, 1e-40, float("inf"), -float("inf"), float("nan"), 0.1]  # fmt: skip
    v = torch.tensor(values, dtype=torch.float32, device=device)
    c = v.numel()
    x = torch.zeros(1, c, 1, 2, dtype=torch.bfloat16, device=device)
    mean, var = torch.zeros(c, device=device), torch.full((c,), 0.5, device=device)
    want = v.to(torch.bfloat16).view(1, c, 1, 1).expand(1, c, 1, 2)
    nan = want.isnan()  # PyTorch's own NaN bits differ between devices: any NaN will do

    def same(got: torch.Tensor) -> bool:
        bits, want_bits = got.view(torch.int16), want.view(torch.int16)
        return torch.equal(got.isnan(), nan) and torch.equal(bits[~nan], want_bits[~nan])

    y = triton_bn.bn_forward_triton(x, P(mean, var, torch.ones(c, device=device), v, 0.5))
    assert same(y)
    zeros = torch.zeros(c, device=device)
    dx = triton_bn.bn_backward_triton(
        torch.ones_like(x), x, P(mean, var, v, zeros, 0.5),
        S(zeros, zeros, torch.ones(1, device=device)),
    )  # fmt: skip
    assert same(dx)


def test_dispatch_picks_triton_only_where_it_applies() -> None:
    x = torch.zeros(2, 3, 4, 4)
    relu, prelu = _neuron(RELU, 0.1), _neuron(PRELU, data=_PRELU_SLOPES)
    assert not fast_paths.batch_norm_eligible(x)  # CPU tensors
    assert fast_paths.batch_norm_statistics(x) is None
    if torch.cuda.is_available():
        gpu = x.cuda()
        assert fast_paths.batch_norm_eligible(gpu, relu, gpu)
        assert fast_paths.batch_norm_eligible(gpu.half(), _neuron(NONE))
        assert not fast_paths.batch_norm_eligible(gpu.double())
        assert not fast_paths.batch_norm_eligible(gpu, prelu)
        assert not fast_paths.batch_norm_eligible(gpu, None, gpu.half())
        assert not fast_paths.batch_norm_eligible(gpu[:0])
        fast_paths.set_enabled(False)
        try:
            assert not fast_paths.batch_norm_eligible(gpu)
        finally:
            fast_paths.set_enabled(True)


def test_each_layout_takes_its_own_passes(monkeypatch) -> None:
    """Channels-last storage takes the NHWC passes, NCHW storage the NCHW ones (which have no
    normalization inside the residual addition); an ineligible case takes none. (On the CPU
    the CUDA test itself is replaced, as the interpreter's tests do.)"""
    from mpsnn.ops.triton import batch_norm_nhwc as nhwc

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setattr(fast_paths, "_runs", lambda *ts: True)
    nchw_x = torch.zeros(2, 8, 4, 4, device=device, dtype=torch.bfloat16)
    nhwc_x = nchw_x.contiguous(memory_format=torch.channels_last)
    want = {
        fast_paths._STATS: (triton_bn.bn_statistics_triton, nhwc.nhwc_statistics),
        fast_paths._FORWARD: (triton_bn.bn_forward_triton, nhwc.nhwc_forward),
        fast_paths._SUMS: (triton_bn.bn_gradient_sums_triton, nhwc.nhwc_gradient_sums),
        fast_paths._BACKWARD: (triton_bn.bn_backward_triton, nhwc.nhwc_backward),
        fast_paths._ADD: (None, nhwc.nhwc_forward_add_relu),
    }
    prelu = _neuron(PRELU, data=_PRELU_SLOPES)
    for kind, (for_nchw, for_nhwc) in want.items():
        assert fast_paths._bn_pass(kind, nchw_x, None) is for_nchw
        assert fast_paths._bn_pass(kind, nhwc_x, None) is for_nhwc
        assert fast_paths._bn_pass(kind, nhwc_x, _neuron(RELU, 0.1), nhwc_x) is for_nhwc
        assert fast_paths._bn_pass(kind, nhwc_x.double(), None) is None
        assert fast_paths._bn_pass(kind, nhwc_x, prelu) is None
        assert fast_paths._bn_pass(kind, nhwc_x, None, nhwc_x.float()) is None
        assert fast_paths._bn_pass(kind, nhwc_x, None, nhwc_x[:1]) is None
        assert fast_paths._bn_pass(kind, nhwc_x[:0], None) is None
    # several incoming tensors: each must match x
    assert fast_paths.batch_norm_eligible(nhwc_x, None, nhwc_x, nhwc_x)
    assert not fast_paths.batch_norm_eligible(nhwc_x, None, nhwc_x, nhwc_x.float())


def test_bn_merge_all_equals_pairwise_merges_and_ignores_empty_rows() -> None:
    """The closed form over W rows equals W - 1 pairwise Chan merges (float64, to rounding),
    with (W, 1) and (W, C) counts; a row with count 0 is ignored even when it holds NaN."""
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(n, 5, 3, 2, generator=g, dtype=torch.float64) * 3 + 10 for n in (2, 5, 1)]
    triples = [bn_statistics(p) for p in parts]
    acc = [t.clone() for t in triples[0]]
    for t in triples[1:]:
        bn_merge(acc, t)
    whole = bn_statistics(torch.cat(parts))
    for counts in ("scalar", "per channel"):
        count = torch.stack([t[0].reshape(-1) for t in triples])
        if counts == "per channel":
            count = count.expand(-1, 5).contiguous()
        n, mean, m2 = bn_merge_all(count, torch.stack([t[1] for t in triples]),
                                   torch.stack([t[2] for t in triples]))  # fmt: skip
        for got, pairwise, direct in zip((n, mean, m2), acc, whole, strict=True):
            torch.testing.assert_close(got, pairwise.expand_as(got), rtol=1e-13, atol=1e-12)
            torch.testing.assert_close(got, direct.expand_as(got), rtol=1e-13, atol=1e-12)
    nan = torch.full((1, 5), float("nan"), dtype=torch.float64)
    count = torch.cat([torch.stack([t[0].reshape(-1) for t in triples]), torch.zeros(1, 1,
                       dtype=torch.float64)])  # fmt: skip
    n2, mean2, m22 = bn_merge_all(count, torch.cat([torch.stack([t[1] for t in triples]), nan]),
                                  torch.cat([torch.stack([t[2] for t in triples]), nan]))  # fmt: skip
    torch.testing.assert_close(n2, n, rtol=0, atol=0)
    torch.testing.assert_close(mean2, mean, rtol=0, atol=0)
    torch.testing.assert_close(m22, m2, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"\[bn_merge_all\] count must be \(W, C\) or \(W, 1\)"):
        bn_merge_all(torch.ones(2, 3), torch.zeros(2, 5), torch.zeros(2, 5))
