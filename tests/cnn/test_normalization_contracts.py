"""The MPS contracts of the normalization states that client programs rely on: the statistics
gradient on a state only the statistics kernel updated (no forward encode), state fields as
stable storage that client work encoded on the command buffer reads and writes (a user's
batch-normalization data source with public API only, explicit encodes and in a graph, against
PyTorch's BatchNorm2d), the channel count the statistics read, and one instance/group
normalization gradient state per image."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.helpers import assert_adjoint, assert_close, run

DEV = m.Device("cpu")
RELU = m.NeuronDescriptor(m.NeuronType.RELU)


def _data(n=6, c=3, h=4, w=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64) * 2 + 0.5
    g = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64)
    gamma = torch.rand(c, generator=gen, dtype=torch.float64) + 0.5
    beta = torch.randn(c, generator=gen, dtype=torch.float64)
    return x, g, gamma, beta


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
    x, g, gamma, beta = _data(seed=1)
    dx, state = _statistics_then_gradients(x, g, gamma, beta, neuron, parts)
    rdx, rdg, rdb = _bn_reference(x, g, gamma, beta, act)
    assert_close(state.gradient_for_gamma, rdg, "dL/dgamma")
    assert_close(state.gradient_for_beta, rdb, "dL/dbeta")
    assert_close(dx, rdx, "dL/dx")


def test_statistics_gradient_without_forward_adjoint() -> None:
    x, w, gamma, beta = _data(n=3, seed=2)
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def forward(t: torch.Tensor) -> torch.Tensor:
        return F.relu(F.batch_norm(t, None, None, gamma, beta, training=True, eps=1e-5))

    _, jv = torch.autograd.functional.jvp(forward, x, v)
    dx, _ = _statistics_then_gradients(x, w, gamma, beta, RELU)
    assert_adjoint(jv, w, v, dx, "statistics, then the gradients (no forward encode)")


def test_statistics_gradient_still_needs_statistics() -> None:
    x, g, gamma, beta = _data(n=2, seed=4)
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
    x, g, gamma, beta = _data(n=2, c=5, seed=5)
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
    x, g, gamma, beta = _data(n=4, seed=6)
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


class _ClientDataSource(m.BatchNormalizationDataSource):
    """A user's data source, public API only: gamma/beta by SGD on the state's gradients, and
    the running statistics as SGD with a negative learning rate (``w -= -k (g - w)``, the L2
    term giving ``-w``), the variance's Bessel correction as the gradient rescale."""

    def __init__(self, c, gamma, beta, lr, momentum, elements):
        self.g, self.b = gamma.clone(), beta.clone()
        self.mu, self.var = torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64)
        self.updates = []
        desc = m.OptimizerDescriptor(learning_rate=lr)
        self.sgd = m.SGD(DEV, descriptor=desc)
        l2 = m.RegularizationType.L2
        avg = m.OptimizerDescriptor(learning_rate=-momentum, regularization_type=l2,
                                    regularization_scale=-1.0)  # fmt: skip
        self.avg = m.SGD(DEV, descriptor=avg)
        unbiased = m.OptimizerDescriptor(learning_rate=-momentum, regularization_type=l2,
                                         regularization_scale=-1.0,
                                         gradient_rescale=elements / (elements - 1))  # fmt: skip
        self.avg_unbiased = m.SGD(DEV, descriptor=unbiased)

    @property
    def number_of_feature_channels(self):
        return self.g.shape[0]

    @property
    def epsilon(self):
        return 1e-5

    def gamma(self):
        return self.g

    def beta(self):
        return self.b

    def mean(self):
        return self.mu

    def variance(self):
        return self.var

    def update_gamma_and_beta(self, command_buffer, state):
        for grad, w in ((state.gradient_for_gamma, self.g), (state.gradient_for_beta, self.b)):
            self.sgd.encode(command_buffer, input_gradient_vector=grad, input_values_vector=w,
                            result_values_vector=w)  # fmt: skip
        self.updates.append("gamma_beta")
        return m.NormalizationGammaAndBetaState(self.g, self.b)

    def update_mean_and_variance(self, command_buffer, state):
        self.avg.encode(command_buffer, input_gradient_vector=state.mean,
                        input_values_vector=self.mu, result_values_vector=self.mu)  # fmt: skip
        self.avg_unbiased.encode(command_buffer, input_gradient_vector=state.variance,
                                 input_values_vector=self.var,
                                 result_values_vector=self.var)  # fmt: skip
        self.updates.append("mean_variance")
        return m.NormalizationMeanAndVarianceState(self.mu, self.var)


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


def _batches(n, c, h, w, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, c, h, w, generator=gen, dtype=torch.float64) * 1.5 + 0.7,
         torch.randn(n, c, h, w, generator=gen, dtype=torch.float64))
        for _ in range(steps)
    ]  # fmt: skip


def _compare(ds, bn_kernel, ref, what):
    assert_close(ds.mu, ref.running_mean, f"{what}: running mean")
    assert_close(ds.var, ref.running_var, f"{what}: running variance (unbiased)")
    assert_close(ds.g, ref.weight.detach(), f"{what}: gamma")
    assert_close(ds.b, ref.bias.detach(), f"{what}: beta")
    assert_close(bn_kernel.mean, ref.running_mean, f"{what}: the kernel's reloaded mean")
    assert_close(bn_kernel.gamma, ref.weight.detach(), f"{what}: the kernel's reloaded gamma")


def test_user_data_source_with_explicit_encodes_matches_pytorch() -> None:
    n, c, h, w, lr, k = 4, 3, 3, 4, 0.05, 0.25
    _, _, gamma, beta = _data(c=c, seed=7)
    batches = _batches(n, c, h, w, 3, seed=8)
    ds = _ClientDataSource(c, gamma, beta, lr, k, n * h * w)
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
    _, _, gamma, beta = _data(c=c, seed=9)
    batches = _batches(n, c, h, w, 3, seed=10)
    ds = _ClientDataSource(c, gamma, beta, lr, k, n * h * w)
    node = m.BatchNormalizationNode(m.ImageNode("x"), ds)
    desc = m.LossDescriptor(m.LossType.MEAN_SQUARED_ERROR, m.ReductionType.SUM, weight=0.5)
    terminals = m.LossNode(node.result_image, desc).training_graph(None, None)
    graph = m.Graph(DEV, terminals[0].result_image, False)
    graph.format = m.FeatureChannelFormat.FLOAT64
    for x, target in batches:
        cb = DEV.new_command_queue().command_buffer()
        graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)], [m.LossLabels(DEV, target)])
        run(cb)
    assert ds.updates == ["gamma_beta", "mean_variance"] * 3
    ref = _torch_bn(c, gamma, beta, k)
    _torch_steps(ref, batches, lr)
    _compare(ds, graph._kernels[node._id][1], ref, "graph")


# -- 6. instance and group normalization: one gradient state per image ------------------------


def _norm(kind, c, gamma, beta, groups, optimizer=None):
    if kind == "instance":
        ds = m.TensorInstanceNormalizationDataSource(c, gamma, beta, 1e-5, optimizer)
        return ds, m.InstanceNormalization(DEV, ds), m.InstanceNormalizationGradient(DEV)
    ds = m.TensorGroupNormalizationDataSource(c, groups, gamma, beta, 1e-5, optimizer)
    return ds, m.GroupNormalization(DEV, ds), m.GroupNormalizationGradient(DEV)


def _gn_reference(x, g, gamma, beta, groups):
    xr = x.clone().requires_grad_()
    ga, be = gamma.clone().requires_grad_(), beta.clone().requires_grad_()
    y = F.group_norm(xr, groups, ga, be, eps=1e-5)
    return torch.autograd.grad(y, (xr, ga, be), g)


KINDS = [("instance", 4), ("group", 2)]


@pytest.mark.parametrize("kind,groups", KINDS)
def test_one_gradient_state_per_image(kind, groups) -> None:
    x, g, gamma, beta = _data(n=3, c=4, h=3, w=5, seed=11)
    _, fwd, grad = _norm(kind, 4, gamma, beta, groups)
    xb, gb = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(g)
    cb = DEV.new_command_queue().command_buffer()
    st = fwd.result_state_batch(xb)
    temp = fwd.temporary_result_state_batch(cb, xb)
    assert len(st.unique()) == 3 and len(temp.unique()) == 3
    temp.increment_read_count(-1)  # not used
    fwd.encode_batch(cb, xb, destination_states=st)
    dx = grad.encode_batch(cb, gb, xb, st)
    run(cb)
    rdx, rdg, rdb = _gn_reference(x, g, gamma, beta, groups)
    assert_close(dx.tensor, rdx, f"{kind} dL/dx")
    for i, state in enumerate(st):  # image i's own gradient: the loss of image i alone
        gi = torch.zeros_like(g)
        gi[i] = g[i]
        _, dgi, dbi = _gn_reference(x, gi, gamma, beta, groups)
        assert_close(state.gradient_for_gamma, dgi, f"{kind} image {i} dL/dgamma")
        assert_close(state.gradient_for_beta, dbi, f"{kind} image {i} dL/dbeta")
    dgamma, dbeta = type(st[0]).summed_gradients(st)
    assert_close(dgamma, rdg, f"{kind} dL/dgamma summed over the batch")
    assert_close(dbeta, rdb, f"{kind} dL/dbeta summed over the batch")


@pytest.mark.parametrize("kind,groups", KINDS)
def test_a_shared_state_still_sums_the_batch(kind, groups) -> None:
    x, g, gamma, beta = _data(n=3, c=4, h=3, w=5, seed=12)
    _, fwd, grad = _norm(kind, 4, gamma, beta, groups)
    xb, gb = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(g)
    cb = DEV.new_command_queue().command_buffer()
    shared = fwd.result_state(xb[0])
    fwd.encode_batch(cb, xb, destination_states=[shared] * 3)
    dx = grad.encode_batch(cb, gb, xb, [shared] * 3)
    run(cb)
    rdx, rdg, rdb = _gn_reference(x, g, gamma, beta, groups)
    assert_close(dx.tensor, rdx, "dL/dx")
    assert_close(shared.gradient_for_gamma, rdg, "dL/dgamma")
    assert_close(shared.gradient_for_beta, rdb, "dL/dbeta")


@pytest.mark.parametrize("kind,groups", KINDS)
@pytest.mark.parametrize("path", ["gpu", "cpu"])
def test_data_source_updates_from_the_batch_of_states(kind, groups, path) -> None:
    x, g, gamma, beta = _data(n=3, c=4, h=3, w=5, seed=13)
    opt = m.SGD(DEV, descriptor=m.OptimizerDescriptor(learning_rate=0.5))
    ds, fwd, grad = _norm(kind, 4, gamma, beta, groups, opt)
    xb, gb = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(g)
    cb = DEV.new_command_queue().command_buffer()
    st = fwd.result_state_batch(xb)
    fwd.encode_batch(cb, xb, destination_states=st)
    grad.encode_batch(cb, gb, xb, st)
    if path == "gpu":
        fwd.reload_gamma_and_beta(cb, ds.update_gamma_and_beta(cb, st))
        run(cb)
    else:
        run(cb)
        assert ds.update_gamma_and_beta_on_cpu(st)
        fwd.reload_gamma_and_beta_from_data_source()
    _, rdg, rdb = _gn_reference(x, g, gamma, beta, groups)
    assert_close(ds.gamma(), gamma - 0.5 * rdg, "gamma after SGD on the summed gradient")
    assert_close(fwd.beta, beta - 0.5 * rdb, "beta reloaded")


class _ClientInstanceDataSource(m.InstanceNormalizationDataSource):
    """A user's data source: SGD on each image's state (public API only): the sum of the
    per-image steps is one step on the batch's gradient."""

    def __init__(self, c, gamma, beta, lr):
        self.g, self.b = gamma.clone(), beta.clone()
        self.sgd = m.SGD(DEV, descriptor=m.OptimizerDescriptor(learning_rate=lr))
        self.batches = []

    @property
    def number_of_feature_channels(self):
        return self.g.shape[0]

    @property
    def epsilon(self):
        return 1e-5

    def gamma(self):
        return self.g

    def beta(self):
        return self.b

    def update_gamma_and_beta(self, command_buffer, state_batch):
        states = m.StateBatch(state_batch).unique()
        self.batches.append(len(states))
        for st in states:
            for grad, w in ((st.gradient_for_gamma, self.g), (st.gradient_for_beta, self.b)):
                self.sgd.encode(command_buffer, input_gradient_vector=grad,
                                input_values_vector=w, result_values_vector=w)  # fmt: skip
        return m.NormalizationGammaAndBetaState(self.g, self.b)


@pytest.mark.parametrize("client", [False, True], ids=["tensor-data-source", "client"])
def test_graph_updates_instance_normalization_from_the_state_batch(client) -> None:
    n, c, h, w, lr = 3, 4, 3, 4, 0.1
    _, _, gamma, beta = _data(c=c, seed=14)
    if client:
        ds = _ClientInstanceDataSource(c, gamma, beta, lr)
    else:
        opt = m.SGD(DEV, descriptor=m.OptimizerDescriptor(learning_rate=lr))
        ds = m.TensorInstanceNormalizationDataSource(c, gamma, beta, 1e-5, opt)
    node = m.InstanceNormalizationNode(m.ImageNode("x"), ds)
    desc = m.LossDescriptor(m.LossType.MEAN_SQUARED_ERROR, m.ReductionType.SUM, weight=0.5)
    terminals = m.LossNode(node.result_image, desc).training_graph(None, None)
    graph = m.Graph(DEV, terminals[0].result_image, False)
    graph.format = m.FeatureChannelFormat.FLOAT64
    batches = _batches(n, c, h, w, 2, seed=15)
    for x, target in batches:
        cb = DEV.new_command_queue().command_buffer()
        graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)], [m.LossLabels(DEV, target)])
        run(cb)
    ga, be = gamma.clone().requires_grad_(), beta.clone().requires_grad_()
    for x, target in batches:
        y = F.instance_norm(x, weight=ga, bias=be, eps=1e-5)
        dg, db = torch.autograd.grad(0.5 * ((y - target) ** 2).sum(), (ga, be))
        with torch.no_grad():
            ga -= lr * dg
            be -= lr * db
    if client:
        assert ds.batches == [n, n]  # the data source received one state per image
    assert_close(ds.gamma(), ga.detach(), "gamma after two graph steps")
    assert_close(ds.beta(), be.detach(), "beta after two graph steps")
    assert_close(graph._kernels[node._id].gamma, ga.detach(), "the kernel reloaded gamma")


class _Collectives:
    """Step hooks standing in for a data-parallel run: ``weight_gradient_ready`` keeps what
    the batch of states `mpsnn.DataParallel` is given; ``before_updates``
    changes the batch-normalization sums in place, as a merge of the ranks' statistics does."""

    def __init__(self):
        self.summed, self.bn_states, self.step = [], [], None

    def begin_step(self, step):
        self.step = step
        return self

    def weight_gradient_ready(self, node, kernel, states):
        self.summed.append(list(m.StateBatch(states).unique()))

    def batch_norm_statistics(self, node, state):
        self.bn_states.append(state)

    def batch_norm_gradient_sums(self, node, state):
        pass

    def before_updates(self):
        def merge():
            for st in self.bn_states:
                st._slots[0][2].mul_(4.0)  # m2 of the (simulated) whole batch, in place

        self.step.cb.record("merge", merge)

    def after_updates(self):
        pass


def test_every_images_state_reaches_the_collectives() -> None:
    x, _, gamma, beta = _data(n=3, c=4, h=3, w=4, seed=16)
    ds = m.TensorInstanceNormalizationDataSource(4, gamma, beta, 1e-5, m.SGD(DEV))
    node = m.InstanceNormalizationNode(m.ImageNode("x"), ds)
    desc = m.LossDescriptor(m.LossType.MEAN_SQUARED_ERROR, m.ReductionType.SUM, weight=0.5)
    graph = m.Graph(DEV, m.LossNode(node.result_image, desc).training_graph()[0].result_image)
    graph.format = m.FeatureChannelFormat.FLOAT64
    graph.data_parallel = hooks = _Collectives()
    cb = DEV.new_command_queue().command_buffer()
    graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)], [m.LossLabels(DEV, torch.zeros_like(x))])
    run(cb)
    (states,) = hooks.summed
    assert len(set(map(id, states))) == 3  # the three images' gradient states, in one call


def test_folding_the_per_image_states_keeps_the_update() -> None:
    """What `mpsnn.DataParallel` does before its all-reduce: the batch's per-image sums are
    folded into the first state on the device (one exchange per layer, not one per image);
    the data source's update, which sums the batch of states, gives the same gamma/beta."""
    from mpsnn.distributed.data_parallel import _fold, _sums

    x, _, gamma, beta = _data(n=3, c=4, h=3, w=4, seed=16)
    results, seen = [], {}
    for fold in (False, True):
        ds = m.TensorInstanceNormalizationDataSource(4, gamma, beta, 1e-5, m.SGD(DEV))
        node = m.InstanceNormalizationNode(m.ImageNode("x"), ds)
        desc = m.LossDescriptor(m.LossType.MEAN_SQUARED_ERROR, m.ReductionType.SUM, weight=0.5)
        graph = m.Graph(DEV, m.LossNode(node.result_image, desc).training_graph()[0].result_image)
        graph.format = m.FeatureChannelFormat.FLOAT64
        graph.data_parallel = hooks = _Collectives()
        if fold:

            def before(hooks=hooks) -> None:
                def run_fold() -> None:
                    states = hooks.summed[0]
                    seen["total"] = [sum(t) for t in zip(*(_sums(s) for s in states), strict=True)]
                    _fold(states[0], states[1:], 0)
                    seen["first"] = [t.clone() for t in _sums(states[0])]
                    seen["others"] = [t.clone() for s in states[1:] for t in _sums(s)]

                hooks.step.cb.record("fold", run_fold)

            hooks.before_updates = before
        cb = DEV.new_command_queue().command_buffer()
        labels = [m.LossLabels(DEV, torch.zeros_like(x))]
        graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)], labels)
        run(cb)
        results.append((ds.gamma().clone(), ds.beta().clone()))
    for got, want in zip(seen["first"], seen["total"], strict=True):
        assert torch.equal(got, want)
    assert all(not t.any() for t in seen["others"])
    for a, b in zip(*results, strict=True):
        assert_close(b, a, "gamma/beta after the folded update", 1e-12)


def test_a_data_source_reads_the_variance_after_an_in_place_merge() -> None:
    n, c, h, w = 4, 3, 3, 4
    x, target = _batches(n, c, h, w, 1, seed=17)[0]
    _, _, gamma, beta = _data(c=c, seed=18)
    ds = _ClientDataSource(c, gamma, beta, 0.0, 1.0, n * h * w)  # running = the batch's
    node = m.BatchNormalizationNode(m.ImageNode("x"), ds)
    desc = m.LossDescriptor(m.LossType.MEAN_SQUARED_ERROR, m.ReductionType.SUM, weight=0.5)
    graph = m.Graph(DEV, m.LossNode(node.result_image, desc).training_graph()[0].result_image)
    graph.format = m.FeatureChannelFormat.FLOAT64
    graph.data_parallel = _Collectives()
    cb = DEV.new_command_queue().command_buffer()
    graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)], [m.LossLabels(DEV, target)])
    run(cb)
    assert_close(ds.mean(), x.mean((0, 2, 3)), "running mean")
    assert_close(ds.variance(), 4 * x.var((0, 2, 3)), "running variance of the merged sums")


def test_state_accessor_errors() -> None:
    x, g, gamma, beta = _data(n=2, c=4, h=3, w=4, seed=19)
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
    _, fwd, grad = _norm("instance", 4, gamma, beta, 4)
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
