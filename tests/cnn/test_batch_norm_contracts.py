"""The MPS contracts of the batch-normalization state that client programs rely on: the
statistics gradient on a state only the statistics kernel updated (no forward encode), the
channel count the statistics read, state fields as stable storage that client work encoded on
the command buffer reads and writes, and a user's data source with public API only (explicit
encodes, in a graph, after an in-place merge of the sums), against PyTorch's BatchNorm2d."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.cnn._normalization_helpers import (
    DEV,
    RELU,
    ClientDataSource,
    Collectives,
    data,
    make_batches,
    norm,
    training_graph,
)
from tests.helpers import assert_adjoint, assert_close, run


def _bn_reference(x, g, gamma, beta, act, eps=1e-5):
    xr = x.clone().requires_grad_()
    ga, be = gamma.clone().requires_grad_(), beta.clone().requires_grad_()
    y = act(F.batch_norm(xr, None, None, ga, be, training=True, eps=eps))
    return torch.autograd.grad(y, (xr, ga, be), g)


# -- 4. the statistics gradient on a state the statistics kernel updated --------------------


def _statistics_then_gradients(x, g, gamma, beta, neuron=None, parts=1):
    """Statistics, statistics gradient and gradient over ``parts`` sub-batches, without any
    BatchNormalization.encode; returns (dx, state)."""
    ds = m.TensorBatchNormalizationDataSource(x.shape[1], gamma, beta, epsilon=1e-5)
    bn = m.BatchNormalization(DEV, ds, neuron)
    xs = [m.ImageBatch.from_tensor(t) for t in x.chunk(parts)]
    gs = [m.ImageBatch.from_tensor(t) for t in g.chunk(parts)]
    state = bn.result_state(xs[0][0])
    cb = DEV.new_command_queue().command_buffer()
    for xk in xs:
        m.BatchNormalizationStatistics(DEV).encode_batch(cb, xk, state)
    sgrad = m.BatchNormalizationStatisticsGradient(DEV, neuron)
    for gk, xk in zip(gs, xs, strict=True):
        sgrad.encode_batch(cb, gk, xk, state)
    grad = m.BatchNormalizationGradient(DEV, neuron)
    dxs = [grad.encode_batch(cb, gk, xk, state) for gk, xk in zip(gs, xs, strict=True)]
    run(cb)
    return torch.cat([d.tensor for d in dxs]), state


@pytest.mark.parametrize("neuron,act", [(None, lambda t: t), (RELU, F.relu)], ids=["none", "relu"])
@pytest.mark.parametrize("parts", [1, 2])
def test_statistics_gradient_needs_only_the_statistics_kernel(neuron, act, parts) -> None:
    x, g, gamma, beta = data(seed=1)
    dx, state = _statistics_then_gradients(x, g, gamma, beta, neuron, parts)
    rdx, rdg, rdb = _bn_reference(x, g, gamma, beta, act)
    assert_close(state.gradient_for_gamma, rdg, "dL/dgamma")
    assert_close(state.gradient_for_beta, rdb, "dL/dbeta")
    assert_close(dx, rdx, "dL/dx")


def test_statistics_gradient_without_forward_adjoint() -> None:
    x, w, gamma, beta = data(n=3, seed=2)
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def forward(t: torch.Tensor) -> torch.Tensor:
        return F.relu(F.batch_norm(t, None, None, gamma, beta, training=True, eps=1e-5))

    _, jv = torch.autograd.functional.jvp(forward, x, v)
    dx, _ = _statistics_then_gradients(x, w, gamma, beta, RELU)
    assert_adjoint(jv, w, v, dx, "statistics, then the gradients (no forward encode)")


def test_statistics_gradient_still_needs_statistics() -> None:
    x, g, gamma, beta = data(n=2, seed=4)
    bn = m.BatchNormalization(DEV, m.TensorBatchNormalizationDataSource(3, gamma, beta))
    xb, gb = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(g)
    state = bn.result_state(xb[0])
    cb = DEV.new_command_queue().command_buffer()
    with pytest.raises(
        ValueError,
        match=r"\[BatchNormalizationStatisticsGradient\] the state must hold batch statistics",
    ):
        m.BatchNormalizationStatisticsGradient(DEV).encode_batch(cb, gb, xb, state)
    with pytest.raises(
        ValueError,
        match=r"\[BatchNormalizationStatisticsGradient\] fused_neuron_descriptor must equal",
    ):
        m.BatchNormalizationStatistics(DEV).encode_batch(cb, xb, state)
        m.BatchNormalizationStatisticsGradient(DEV, RELU).encode_batch(cb, gb, xb, state)
    assert state.forward is None  # the failed encode left no record behind
    assert len(cb) == 1  # the statistics only


# -- 8. the channels the statistics read ------------------------------------------------------


def test_statistics_refuse_a_source_with_more_channels_than_the_state() -> None:
    x, g, gamma, beta = data(n=2, c=5, seed=5)
    bn = m.BatchNormalization(DEV, m.TensorBatchNormalizationDataSource(3, gamma[:3], beta[:3]))
    stats = m.BatchNormalizationStatistics(DEV)
    xb = m.ImageBatch.from_tensor(x)
    state = bn.result_state(xb[0])
    cb = DEV.new_command_queue().command_buffer()
    with pytest.raises(
        ValueError,
        match=r"\[BatchNormalizationStatistics\] the channels read \(from "
        r"source_feature_channel_offset 0, at most source_feature_channel_max_count\) must "
        r"be the state's 3, got 5 of the source's 5",
    ):
        stats.encode_batch(cb, xb, state)
    stats.source_feature_channel_offset = 1
    with pytest.raises(ValueError, match=r"must be the state's 3, got 4 of the source's 5"):
        stats.encode_batch(cb, xb, state)
    stats.source_feature_channel_offset = 5
    with pytest.raises(ValueError, match=r"must be the state's 3, got 0 of the source's 5"):
        stats.encode_batch(cb, xb, state)
    assert len(cb) == 0
    # channels 1..3 read through the offset and the max count: accepted, the right statistics
    stats.source_feature_channel_offset = 1
    stats.source_feature_channel_max_count = 3
    stats.encode_batch(cb, xb, state)
    run(cb)
    assert_close(state.mean, x[:, 1:4].mean((0, 2, 3)), "mean of channels 1..3")
    # the gradient kernels without a forward encode read the state's kernel's channels
    gb = m.ImageBatch.from_tensor(g)
    cb = DEV.new_command_queue().command_buffer()
    with pytest.raises(
        ValueError,
        match=r"\[BatchNormalizationStatisticsGradient\] the channels read \(from "
        r"source_feature_channel_offset 0, at most source_feature_channel_max_count\) must "
        r"be the state's 3, got 5 of the source's 5",
    ):
        m.BatchNormalizationStatisticsGradient(DEV).encode_batch(cb, gb, xb, state)


# -- 5. state fields are stable storage ------------------------------------------------------


def test_fields_read_at_encode_are_the_storage_the_work_writes() -> None:
    x, g, gamma, beta = data(n=4, seed=6)
    bn = m.BatchNormalization(DEV, m.TensorBatchNormalizationDataSource(3, gamma, beta))
    xb, gb = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(g)
    state = bn.result_state(xb[0])
    cb = DEV.new_command_queue().command_buffer()
    m.BatchNormalizationStatistics(DEV).encode_batch(cb, xb, state)
    mean, var = state.mean, state.variance  # encode time: the storage
    m.BatchNormalizationStatisticsGradient(DEV).encode_batch(cb, gb, xb, state)
    dgamma, dbeta = state.gradient_for_gamma, state.gradient_for_beta
    for name in ("mean", "variance", "gradient_for_gamma", "gradient_for_beta"):
        with pytest.raises(
            ValueError,
            match=rf"\[BatchNormalizationState\] {name} must have been written by work that "
            r"ran \(commit its command buffer first\), got none yet",
        ):
            state.numpy(name)
    # client work recorded after the kernels reads the storage when it runs
    seen = {}
    cb.record("client", lambda: seen.update(mean=mean.clone(), dgamma=dgamma.clone()))
    run(cb)
    _, rdg, rdb = _bn_reference(x, g, gamma, beta, lambda t: t)
    assert state.mean is mean and state.variance is var
    assert state.gradient_for_gamma is dgamma and state.gradient_for_beta is dbeta
    assert_close(mean, x.mean((0, 2, 3)), "mean")
    assert_close(var, x.var((0, 2, 3), unbiased=False), "biased variance")
    assert_close(seen["mean"], x.mean((0, 2, 3)), "mean seen by client work")
    assert_close(seen["dgamma"], rdg, "dgamma seen by client work")
    assert_close(dbeta, rdb, "dbeta")
    assert_close(torch.from_numpy(state.numpy("variance")), var, "host copy")
    # a new batch after reset: the same storage, rewritten
    state.reset()
    cb = DEV.new_command_queue().command_buffer()
    m.BatchNormalizationStatistics(DEV).encode_batch(cb, m.ImageBatch.from_tensor(x[:2]), state)
    run(cb)
    assert state.mean is mean and state.variance is var
    assert_close(mean, x[:2].mean((0, 2, 3)), "mean after reset")
    assert_close(var, x[:2].var((0, 2, 3), unbiased=False), "variance after reset")


def _torch_bn(c, gamma, beta, momentum):
    bn = torch.nn.BatchNorm2d(c, eps=1e-5, momentum=momentum).double()
    with torch.no_grad():
        bn.weight.copy_(gamma)
        bn.bias.copy_(beta)
    return bn


def _torch_steps(bn, batches, lr):
    for x, target in batches:
        loss = 0.5 * ((bn(x) - target) ** 2).sum()
        loss.backward()
        with torch.no_grad():
            for p in (bn.weight, bn.bias):
                p -= lr * p.grad
                p.grad = None


def _compare(ds, bn_kernel, ref, what):
    assert_close(ds.mu, ref.running_mean, f"{what}: running mean")
    assert_close(ds.var, ref.running_var, f"{what}: running variance (unbiased)")
    assert_close(ds.g, ref.weight.detach(), f"{what}: gamma")
    assert_close(ds.b, ref.bias.detach(), f"{what}: beta")
    assert_close(bn_kernel.mean, ref.running_mean, f"{what}: the kernel's reloaded mean")
    assert_close(bn_kernel.gamma, ref.weight.detach(), f"{what}: the kernel's reloaded gamma")


def test_user_data_source_with_explicit_encodes_matches_pytorch() -> None:
    n, c, h, w, lr, k = 4, 3, 3, 4, 0.05, 0.25
    _, _, gamma, beta = data(c=c, seed=7)
    batches = make_batches(n, c, h, w, 3, seed=8)
    ds = ClientDataSource(c, gamma, beta, lr, k, n * h * w)
    bn = m.BatchNormalization(DEV, ds)
    stats, sgrad = m.BatchNormalizationStatistics(DEV), m.BatchNormalizationStatisticsGradient(DEV)
    grad = m.BatchNormalizationGradient(DEV)
    q = DEV.new_command_queue()
    for x, target in batches:
        xb = m.ImageBatch.from_tensor(x)
        cb = q.command_buffer()
        state = bn.result_state(xb[0])  # permanent: read by two command buffers
        stats.encode_batch(cb, xb, state)
        y = bn.encode_batch(cb, xb, state)
        run(cb)  # the loss gradient is computed on the host here: y - target
        cb = q.command_buffer()
        gb = m.ImageBatch.from_tensor(y.tensor - target)
        sgrad.encode_batch(cb, gb, xb, state)
        grad.encode_batch(cb, gb, xb, state)
        bn.reload_gamma_and_beta(cb, ds.update_gamma_and_beta(cb, state))
        bn.reload_mean_and_variance(cb, ds.update_mean_and_variance(cb, state))
        run(cb)
    ref = _torch_bn(c, gamma, beta, k)
    _torch_steps(ref, batches, lr)
    _compare(ds, bn, ref, "explicit encodes")


def test_user_data_source_in_a_graph_training_step_matches_pytorch() -> None:
    n, c, h, w, lr, k = 4, 3, 3, 4, 0.05, 0.25
    _, _, gamma, beta = data(c=c, seed=9)
    batches = make_batches(n, c, h, w, 3, seed=10)
    ds = ClientDataSource(c, gamma, beta, lr, k, n * h * w)
    node = m.BatchNormalizationNode(m.ImageNode("x"), ds)
    graph = training_graph(node)
    for x, target in batches:
        cb = DEV.new_command_queue().command_buffer()
        graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)], [m.LossLabels(DEV, target)])
        run(cb)
    assert ds.updates == ["gamma_beta", "mean_variance"] * 3
    ref = _torch_bn(c, gamma, beta, k)
    _torch_steps(ref, batches, lr)
    _compare(ds, graph._plan.kernels[node._id][1], ref, "graph")


def test_a_data_source_reads_the_variance_after_an_in_place_merge() -> None:
    n, c, h, w = 4, 3, 3, 4
    x, target = make_batches(n, c, h, w, 1, seed=17)[0]
    _, _, gamma, beta = data(c=c, seed=18)
    ds = ClientDataSource(c, gamma, beta, 0.0, 1.0, n * h * w)  # running = the batch's
    node = m.BatchNormalizationNode(m.ImageNode("x"), ds)
    graph = training_graph(node)
    graph.data_parallel = Collectives()
    cb = DEV.new_command_queue().command_buffer()
    graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)], [m.LossLabels(DEV, target)])
    run(cb)
    assert_close(ds.mean(), x.mean((0, 2, 3)), "running mean")
    assert_close(ds.variance(), 4 * x.var((0, 2, 3)), "running variance of the merged sums")


def test_state_accessor_errors() -> None:
    x, g, gamma, beta = data(n=2, c=4, h=3, w=4, seed=19)
    bn = m.BatchNormalization(DEV, m.TensorBatchNormalizationDataSource(4, gamma, beta))
    xb = m.ImageBatch.from_tensor(x)
    state = bn.result_state(xb[0])
    with pytest.raises(
        ValueError,
        match=r"\[BatchNormalizationState\] name must be one of \['gradient_for_beta', "
        r"'gradient_for_gamma', 'mean', 'variance'\], got 'gamma'",
    ):
        state.numpy("gamma")
    with pytest.raises(
        ValueError, match=r"\[BatchNormalizationState\] the state must hold batch statistics"
    ):
        state.numpy("mean")
    cb = DEV.new_command_queue().command_buffer()
    m.BatchNormalizationStatistics(DEV).encode_batch(cb, xb, state)
    run(cb)
    assert state.gradient_for_gamma is None
    with pytest.raises(
        ValueError,
        match=r"\[BatchNormalizationState\] the state must hold gamma/beta gradients \(encode "
        r"BatchNormalizationStatisticsGradient into it first\), got none",
    ):
        state.numpy("gradient_for_beta")
    _, fwd, grad = norm("instance", 4, gamma, beta, 4)
    st = fwd.result_state_batch(xb)
    cb = DEV.new_command_queue().command_buffer()
    fwd.encode_batch(cb, xb, destination_states=st)
    grad.encode_batch(cb, m.ImageBatch.from_tensor(g), xb, st)
    who = r"\[InstanceNormalizationGradientState\]"
    with pytest.raises(ValueError, match=who + r" every state must hold gamma/beta gradients "
                       r"that ran \(encode the gradient kernel and commit its command buffer "
                       r"first\), got one without"):  # fmt: skip
        m.InstanceNormalizationGradientState.summed_gradients(st)
    with pytest.raises(ValueError, match=who + r" state_batch must hold states, got none"):
        m.InstanceNormalizationGradientState.summed_gradients([])
    with pytest.raises(
        TypeError,
        match=who + r" state_batch must hold instance or group normalization gradient states, "
        r"got BatchNormalizationState",
    ):
        m.InstanceNormalizationGradientState.summed_gradients([state])
    run(cb)
