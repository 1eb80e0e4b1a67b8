"""Shared pieces of the normalization contract tests: float64 data, PyTorch references, the
client data sources written with public API only, the one-loss training graph, and the step
hooks standing in for a data-parallel run."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import mpsnn as m

DEV = m.Device("cpu")
RELU = m.NeuronDescriptor(m.NeuronType.RELU)
# (kind, groups) of the per-image normalizations: instance is group norm with one channel a group
KINDS = [("instance", 4), ("group", 2)]


def data(n=6, c=3, h=4, w=5, seed=0):
    """(x, g, gamma, beta): input, a random cotangent, positive gamma and beta."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64) * 2 + 0.5
    g = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64)
    gamma = torch.rand(c, generator=gen, dtype=torch.float64) + 0.5
    beta = torch.randn(c, generator=gen, dtype=torch.float64)
    return x, g, gamma, beta


def make_batches(n, c, h, w, steps, seed):
    """``steps`` (input, target) pairs."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, c, h, w, generator=gen, dtype=torch.float64) * 1.5 + 0.7,
         torch.randn(n, c, h, w, generator=gen, dtype=torch.float64))
        for _ in range(steps)
    ]  # fmt: skip


def gn_reference(x, g, gamma, beta, groups):
    """PyTorch's group-norm (dL/dx, dL/dgamma, dL/dbeta) for the cotangent ``g``."""
    xr = x.clone().requires_grad_()
    ga, be = gamma.clone().requires_grad_(), beta.clone().requires_grad_()
    y = F.group_norm(xr, groups, ga, be, eps=1e-5)
    return torch.autograd.grad(y, (xr, ga, be), g)


def norm(kind, c, gamma, beta, groups, optimizer=None):
    """(data source, forward, gradient) kernels of an instance or group normalization."""
    if kind == "instance":
        ds = m.TensorInstanceNormalizationDataSource(c, gamma, beta, 1e-5, optimizer)
        return ds, m.InstanceNormalization(DEV, ds), m.InstanceNormalizationGradient(DEV)
    ds = m.TensorGroupNormalizationDataSource(c, groups, gamma, beta, 1e-5, optimizer)
    return ds, m.GroupNormalization(DEV, ds), m.GroupNormalizationGradient(DEV)


def training_graph(node: m.Node) -> m.Graph:
    """A float64 training graph of ``node`` under the loss 0.5 * sum((y - target)^2)."""
    desc = m.LossDescriptor(m.LossType.MEAN_SQUARED_ERROR, m.ReductionType.SUM, weight=0.5)
    graph = m.Graph(DEV, m.LossNode(node.result_image, desc).training_graph()[0].result_image)
    graph.format = m.FeatureChannelFormat.FLOAT64
    return graph


class ClientGammaBeta:
    """The gamma/beta half of a user's data source, public API only: gamma/beta by SGD on the
    gradients each state holds (over a batch of states, the sum of the per-image steps is one
    step on the batch's gradient)."""

    def __init__(self, gamma, beta, lr):
        self.g, self.b = gamma.clone(), beta.clone()
        self.sgd = m.SGD(DEV, descriptor=m.OptimizerDescriptor(learning_rate=lr))

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

    def sgd_on(self, command_buffer, states):
        for st in states:
            for grad, w in ((st.gradient_for_gamma, self.g), (st.gradient_for_beta, self.b)):
                self.sgd.encode(command_buffer, input_gradient_vector=grad,
                                input_values_vector=w, result_values_vector=w)  # fmt: skip
        return m.NormalizationGammaAndBetaState(self.g, self.b)


class ClientDataSource(ClientGammaBeta, m.BatchNormalizationDataSource):
    """A user's batch-normalization data source, public API only: gamma/beta by SGD on the
    state's gradients, and the running statistics as SGD with a negative learning rate
    (``w -= -k (g - w)``, the L2 term giving ``-w``), the variance's Bessel correction as the
    gradient rescale."""

    def __init__(self, c, gamma, beta, lr, momentum, elements):
        super().__init__(gamma, beta, lr)
        self.mu, self.var = torch.zeros(c, dtype=torch.float64), torch.ones(c, dtype=torch.float64)
        self.updates = []
        l2 = m.RegularizationType.L2
        avg = m.OptimizerDescriptor(learning_rate=-momentum, regularization_type=l2,
                                    regularization_scale=-1.0)  # fmt: skip
        self.avg = m.SGD(DEV, descriptor=avg)
        unbiased = m.OptimizerDescriptor(learning_rate=-momentum, regularization_type=l2,
                                         regularization_scale=-1.0,
                                         gradient_rescale=elements / (elements - 1))  # fmt: skip
        self.avg_unbiased = m.SGD(DEV, descriptor=unbiased)

    def mean(self):
        return self.mu

    def variance(self):
        return self.var

    def update_gamma_and_beta(self, command_buffer, state):
        self.updates.append("gamma_beta")
        return self.sgd_on(command_buffer, [state])

    def update_mean_and_variance(self, command_buffer, state):
        self.avg.encode(command_buffer, input_gradient_vector=state.mean,
                        input_values_vector=self.mu, result_values_vector=self.mu)  # fmt: skip
        self.avg_unbiased.encode(command_buffer, input_gradient_vector=state.variance,
                                 input_values_vector=self.var,
                                 result_values_vector=self.var)  # fmt: skip
        self.updates.append("mean_variance")
        return m.NormalizationMeanAndVarianceState(self.mu, self.var)


class ClientInstanceDataSource(ClientGammaBeta, m.InstanceNormalizationDataSource):
    """A user's instance-normalization data source: SGD on each image's state."""

    def __init__(self, c, gamma, beta, lr):
        super().__init__(gamma, beta, lr)
        self.batches = []

    def update_gamma_and_beta(self, command_buffer, state_batch):
        states = m.StateBatch(state_batch).unique()
        self.batches.append(len(states))
        return self.sgd_on(command_buffer, states)


class Collectives:
    """Step hooks standing in for a data-parallel run: ``weight_gradient_ready`` keeps what
    the batch of states `mpsnn.DataParallel` is given; ``before_updates``
    changes the batch-normalization sums in place, as a merge of the ranks' statistics does
    (and, as it does, writes the variance of the new sums in the same work)."""

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
                st._write_variance()

        self.step.cb.record("merge", merge)

    def after_updates(self):
        pass
