"""Batch normalization kernels: the MPS training sequence (statistics, forward, statistics
gradient, gradient) against PyTorch autograd in float64, statistics and gradient sums over
sub-batches, any commit order, inference vs training mode, running statistics, numerics of
constant and large-mean channels, storage formats, and every documented error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.helpers import DEVICES, TOL, assert_adjoint, assert_close, run

RELU = m.NeuronDescriptor(m.NeuronType.RELU)
SIG = m.NeuronDescriptor(m.NeuronType.SIGMOID)


def _data(n=6, c=3, h=4, w=5, seed=0, dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64) * 2 + 0.5
    g = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64)
    gamma = torch.rand(c, generator=gen, dtype=torch.float64) + 0.5
    beta = torch.randn(c, generator=gen, dtype=torch.float64)
    return x.to(device, dtype), g.to(device, dtype), gamma, beta


def _kernels(dev, c, gamma, beta, neuron=None, eps=1e-5, **kw):
    ds = m.TensorBatchNormalizationDataSource(c, gamma, beta, epsilon=eps, **kw)
    return (
        ds,
        m.BatchNormalizationStatistics(dev),
        m.BatchNormalization(dev, ds, neuron),
        m.BatchNormalizationStatisticsGradient(dev, neuron),
        m.BatchNormalizationGradient(dev, neuron),
    )


def _train_step(dev, x, g, gamma, beta, neuron=None, parts=1, order=None):
    """The MPS sequence over ``parts`` sub-batches; returns (y, dx, state)."""
    _, stats, bn, sgrad, grad = _kernels(dev, x.shape[1], gamma, beta, neuron)
    q = dev.new_command_queue()
    xs, gs = x.chunk(parts), g.chunk(parts)
    xb = [m.ImageBatch.from_tensor(t) for t in xs]
    gb = [m.ImageBatch.from_tensor(t) for t in gs]
    state = bn.result_state_batch(xb[0])[0]
    buffers = [q.command_buffer() for _ in range(parts)]
    for cb, xk in zip(buffers, xb, strict=True):
        stats.encode_batch(cb, xk, state)
    for cb in buffers if order is None else [buffers[i] for i in order]:
        run(cb)
    cb = q.command_buffer()
    ys = [bn.encode_batch(cb, xk, state) for xk in xb]
    for gk, xk in zip(gb, xb, strict=True):
        sgrad.encode_batch(cb, gk, xk, state)
    dxs = [grad.encode_batch(cb, gk, xk, state) for gk, xk in zip(gb, xb, strict=True)]
    run(cb)
    return torch.cat([y.tensor for y in ys]), torch.cat([d.tensor for d in dxs]), state


def _torch_reference(x, g, gamma, beta, act, eps=1e-5):
    xr = x.detach().cpu().double().requires_grad_()
    ga, be = gamma.clone().requires_grad_(), beta.clone().requires_grad_()
    y = act(F.batch_norm(xr, None, None, ga, be, training=True, eps=eps))
    dx, dgamma, dbeta = torch.autograd.grad(y, (xr, ga, be), g.cpu().double())
    return y.detach(), dx, dgamma, dbeta


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "neuron,act",
    [(None, lambda t: t), (RELU, F.relu), (SIG, torch.sigmoid)],
    ids=["none", "relu", "sigmoid"],
)
def test_training_step_equals_pytorch_autograd(device, neuron, act) -> None:
    dev = m.Device(device)
    x, g, gamma, beta = _data(device=device)
    y, dx, state = _train_step(dev, x, g, gamma, beta, neuron)
    ry, rdx, rdg, rdb = _torch_reference(x, g, gamma, beta, act)
    assert_close(y, ry, "forward")
    assert_close(dx, rdx, "dL/dx")
    assert_close(state.gradient_for_gamma, rdg, "dL/dgamma")
    assert_close(state.gradient_for_beta, rdb, "dL/dbeta")
    assert_close(state.mean, x.cpu().mean((0, 2, 3)), "batch mean")
    assert_close(state.variance, x.cpu().var((0, 2, 3), unbiased=False), "biased batch variance")


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_sub_batches_equal_the_whole_batch(parts) -> None:
    dev = m.Device("cpu")
    x, g, gamma, beta = _data(n=6, seed=1)
    y1, dx1, s1 = _train_step(dev, x, g, gamma, beta, RELU, parts=1)
    yk, dxk, sk = _train_step(dev, x, g, gamma, beta, RELU, parts=parts)
    for what, a, b in (
        ("y", yk, y1), ("dx", dxk, dx1), ("mean", sk.mean, s1.mean),
        ("variance", sk.variance, s1.variance),
        ("dgamma", sk.gradient_for_gamma, s1.gradient_for_gamma),
        ("dbeta", sk.gradient_for_beta, s1.gradient_for_beta),
    ):  # fmt: skip
        assert_close(a, b, f"{parts} sub-batches: {what}", tol=1e-12)


def test_statistics_accumulate_in_any_commit_order() -> None:
    dev = m.Device("cpu")
    x, g, gamma, beta = _data(n=6, seed=2)
    ref = _train_step(dev, x, g, gamma, beta, parts=3)
    for order in ([2, 0, 1], [1, 2, 0]):
        got = _train_step(dev, x, g, gamma, beta, parts=3, order=order)
        assert_close(got[2].mean, ref[2].mean, f"mean, order {order}", tol=1e-12)
        assert_close(got[1], ref[1], f"dx, order {order}", tol=1e-12)


def test_a_normalization_between_sub_batches_sees_the_merged_statistics() -> None:
    """The batch variance is computed once per change of the statistics and kept: a forward
    that ran after the first sub-batch must not hand its variance to one that runs after the
    second sub-batch was merged in place."""
    dev = m.Device("cpu")
    x, _, gamma, beta = _data(n=6, seed=3)
    _, stats, bn, _, _ = _kernels(dev, x.shape[1], gamma, beta)
    q = dev.new_command_queue()
    first, second = (m.ImageBatch.from_tensor(t) for t in x.chunk(2))
    whole = m.ImageBatch.from_tensor(x)
    state = bn.result_state_batch(whole)[0]
    for part in (first, second):
        cb = q.command_buffer()
        stats.encode_batch(cb, part, state)
        y = bn.encode_batch(cb, whole, state)
        run(cb)
        # the statistics of the sub-batches seen so far
        seen = x[: 3 if part is first else 6]
        mean, var = seen.mean((0, 2, 3)), seen.var((0, 2, 3), unbiased=False)
        ref = F.batch_norm(x, mean, var, gamma, beta, training=False, eps=1e-5)
        assert_close(torch.cat([t.tensor for t in y]), ref, "after a sub-batch")
        assert_close(state.variance, var, "state variance")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_captured_statistics_and_eager_normalizations() -> None:
    """A permanent state whose statistics a captured buffer writes at every replay: the eager
    normalization after each replay uses that replay's statistics (and variance, which the
    captured statistics write). And a captured normalization follows a later sub-batch's merge,
    which rewrites the variance it reads."""
    dev = m.Device("cuda")
    c = 3
    gen = torch.Generator().manual_seed(6)
    xs = [torch.randn(4, c, 5, 5, generator=gen).cuda() * (k + 1) + k for k in range(3)]
    gamma, beta = torch.rand(c, generator=gen) + 0.5, torch.randn(c, generator=gen)
    _, stats, bn, _, _ = _kernels(dev, c, gamma, beta)
    q = dev.new_command_queue()
    src = m.ImageBatch.from_tensor(xs[0].clone())
    first, second = (m.ImageBatch.from_tensor(t) for t in torch.cat(xs[:2]).chunk(2))
    whole = m.ImageBatch.from_tensor(torch.cat(xs[:2]))
    for batch in (src, whole):  # compiles the kernels for these sizes before any capture
        warm = bn.result_state_batch(batch)[0]
        cb = q.command_buffer()
        stats.encode_batch(cb, batch, warm)
        bn.encode_batch(cb, batch, warm)
        run(cb)

    def joined(images: list) -> torch.Tensor:
        return torch.cat([image.tensor for image in images])

    def reference(x: torch.Tensor) -> torch.Tensor:
        mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3), unbiased=False)
        return F.batch_norm(x, mean, var, gamma.cuda(), beta.cuda(), training=False, eps=1e-5)

    state = bn.result_state_batch(src)[0]
    cb = q.command_buffer()
    stats.encode_batch(cb, src, state)
    captured = cb.capture()
    for x in xs:
        for i, image in enumerate(src):  # the captured input, refilled in place
            image.tensor.copy_(x[i : i + 1])
        captured.replay()
        captured.wait_until_completed()
        cb = q.command_buffer()
        y = bn.encode_batch(cb, src, state)
        run(cb)
        assert_close(joined(y), reference(x), "eager normalization after a replay", tol=1e-5)

    # a captured normalization on the first half's statistics; then a merge in place
    state = bn.result_state_batch(whole)[0]
    cb = q.command_buffer()
    stats.encode_batch(cb, first, state)
    bn.encode_batch(cb, whole, state)  # keeps the variance of the first half
    run(cb)
    cb = q.command_buffer()
    y = bn.encode_batch(cb, whole, state)
    captured = cb.capture()
    cb = q.command_buffer()
    stats.encode_batch(cb, second, state)  # merged in place into the same tensors
    run(cb)
    captured.replay()
    captured.wait_until_completed()
    assert_close(joined(y), reference(torch.cat(xs[:2])), "captured after a merge", tol=1e-5)


def test_a_reload_from_parameters_leaves_the_masters_outside_autograd() -> None:
    dev = m.Device("cpu")
    ds = m.TensorBatchNormalizationDataSource(4, torch.ones(4), torch.zeros(4))
    bn = m.BatchNormalization(dev, ds)
    gamma, beta = torch.nn.Parameter(torch.full((4,), 2.0)), torch.nn.Parameter(torch.ones(4))
    cb = dev.new_command_queue().command_buffer()
    bn.reload_gamma_and_beta(cb, m.NormalizationGammaAndBetaState(gamma, beta))
    run(cb)
    assert torch.equal(bn.gamma, torch.full((4,), 2.0)) and torch.equal(bn.beta, torch.ones(4))
    assert not bn.gamma.requires_grad and not bn.beta.requires_grad


def test_adjoint_of_the_gradient_in_float64() -> None:
    """<J(x) v, w> = <v, BN-gradient(w)> with J the derivative of the training forward (the
    statistics depend on x), v and w random."""
    dev = m.Device("cpu")
    x, w, gamma, beta = _data(n=3, seed=3)
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def forward(t: torch.Tensor) -> torch.Tensor:
        return F.relu(F.batch_norm(t, None, None, gamma, beta, training=True, eps=1e-5))

    _, jv = torch.autograd.functional.jvp(forward, x, v)
    _, dx, _ = _train_step(dev, x, w, gamma, beta, RELU)
    assert_adjoint(jv, w, v, dx, "batch normalization + ReLU")


def test_inference_mode_and_running_statistics() -> None:
    dev = m.Device("cpu")
    x, _g, gamma, beta = _data(seed=5)
    mean0, var0 = torch.randn(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64) + 0.5
    ds, stats, bn, *_ = _kernels(dev, 3, gamma, beta, mean=mean0, variance=var0, momentum=0.25)
    q = dev.new_command_queue()
    xb = m.ImageBatch.from_tensor(x)
    cb = q.command_buffer()
    y_inf = bn.encode_batch(cb, xb)  # no state: inference mode
    state = bn.result_state(xb[0])
    y_state = bn.encode_batch(cb, xb, state)  # a state without statistics: inference too
    run(cb)
    want = F.batch_norm(x, mean0, var0, gamma, beta, training=False, eps=1e-5)
    assert_close(y_inf.tensor, want, "inference mode")
    assert_close(y_state.tensor, want, "a state without statistics")
    # running statistics, GPU path (recorded) and CPU path (after completion): PyTorch's rule
    rm, rv = mean0.clone(), var0.clone()
    F.batch_norm(x, rm, rv, gamma, beta, training=True, momentum=0.25)
    cb = q.command_buffer()
    stats.encode_batch(cb, xb, state)
    mv = ds.update_mean_and_variance(cb, state)
    bn.reload_mean_and_variance(cb, mv)
    run(cb)
    assert_close(ds.mean(), rm, "running mean (GPU path)")
    assert_close(ds.variance(), rv, "running variance, unbiased (GPU path)")
    assert_close(bn.mean, rm, "the kernel reloaded the running mean")
    ds2, stats2, bn2, *_ = _kernels(dev, 3, gamma, beta, mean=mean0, variance=var0, momentum=0.25)
    st2 = bn2.result_state(xb[0])
    cb = q.command_buffer()
    stats2.encode_batch(cb, xb, st2)
    run(cb)
    assert ds2.update_mean_and_variance_on_cpu(st2)
    bn2.reload_mean_and_variance_from_data_source()
    assert_close(ds2.variance(), rv, "running variance (CPU path)")
    assert_close(bn2.variance, rv, "reloaded from the data source")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_constant_and_large_mean_channels(dtype) -> None:
    """A constant channel gives finite outputs and gradients; a channel of mean 1e4 and std 1
    keeps its variance (shifted two-pass statistics in float32)."""
    dev = m.Device("cpu")
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(8, 3, 6, 6, generator=gen, dtype=torch.float64)
    x[:, 0] = 3.0  # constant
    x[:, 1] = 1e4 + x[:, 1]  # large mean (float16 cannot hold it finely: std ~4 ulp there)
    if dtype == torch.float16:
        x[:, 1] = 1e3 + (x[:, 1] - 1e4)
    xs = x.to(dtype)
    g = torch.randn(8, 3, 6, 6, generator=gen, dtype=torch.float64).to(dtype)
    gamma, beta = torch.ones(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    y, dx, state = _train_step(dev, xs, g, gamma, beta, RELU)
    assert torch.isfinite(y.float()).all() and torch.isfinite(dx.float()).all()
    truth = xs.double().var((0, 2, 3), unbiased=False)
    rel = ((state.variance.double() - truth).abs() / truth.clamp(min=1e-30))[1:]
    assert (rel < 1e-3).all(), rel
    ry, _rdx, _, _ = _torch_reference(xs.double(), g.double(), gamma, beta, F.relu)
    assert_close(y.double()[:, 2], ry[:, 2], "a regular channel", tol=TOL[dtype] * 4)


def test_batch_normalization_errors() -> None:
    dev = m.Device("cpu")
    x, g, gamma, beta = _data(n=2, seed=7)
    _ds, stats, bn, sgrad, grad = _kernels(dev, 3, gamma, beta)
    cb = dev.new_command_queue().command_buffer()
    xb, gb = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(g)
    state = bn.result_state(xb[0])
    with pytest.raises(
        ValueError,
        match=r"\[BatchNormalizationState\] the state must hold batch statistics \(encode BatchNormalizationStatistics into it first\), got none",
    ):
        _ = state.mean
    wide = m.ImageBatch.from_tensor(torch.zeros(2, 4, 4, 5, dtype=torch.float64))
    with pytest.raises(
        ValueError,
        match=r"\[BatchNormalization\] the source must provide number_of_feature_channels=3 channels",
    ):
        bn.encode_batch(cb, wide)
    with pytest.raises(
        ValueError,
        match=r"\[BatchNormalizationStatistics\] the channels read \(from source_feature_channel_offset 0, at most source_feature_channel_max_count\) must be the state's 3, got 2 of the source's 2",
    ):
        stats.encode_batch(cb, m.ImageBatch.from_tensor(torch.zeros(2, 2, 4, 5)), state)
    other = _kernels(dev, 3, gamma, beta)[2]
    with pytest.raises(
        ValueError,
        match=r"\[BatchNormalization\] batch_normalization_state must come from this kernel's result_state",
    ):
        bn.encode_batch(cb, xb, other.result_state(xb[0]))
    bn.encode_batch(cb, xb, state)  # inference: no statistics
    with pytest.raises(
        ValueError,
        match=r"\[BatchNormalizationStatisticsGradient\] the state must hold batch statistics",
    ):
        sgrad.encode_batch(cb, gb, xb, state)
    stats.encode_batch(cb, xb, state)
    with pytest.raises(
        ValueError, match=r"\[BatchNormalizationGradient\] the state must hold the gradient sums"
    ):
        grad.encode_batch(cb, gb, xb, state)
    with pytest.raises(
        ValueError,
        match=r"\[BatchNormalizationStatisticsGradient\] fused_neuron_descriptor must equal the forward batch normalization's \(None\)",
    ):
        bn.encode_batch(cb, xb, state)
        m.BatchNormalizationStatisticsGradient(dev, RELU).encode_batch(cb, gb, xb, state)
    with pytest.raises(
        TypeError, match=r"\[BatchNormalizationStatistics\] encode is not available"
    ):
        stats.encode(cb, x, state)
    with pytest.raises(
        ValueError,
        match=r"\[TensorBatchNormalizationDataSource\] gamma must have shape \(3,\), got \(2,\)",
    ):
        m.TensorBatchNormalizationDataSource(3, gamma=torch.ones(2))
    with pytest.raises(
        ValueError,
        match=r"\[TensorBatchNormalizationDataSource\] momentum must be in \[0, 1\], got 2",
    ):
        m.TensorBatchNormalizationDataSource(3, momentum=2)
