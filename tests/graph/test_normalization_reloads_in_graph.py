"""A training graph's normalization reloads: one grouped command for mpsnn's own kernels, a
kernel class's own reload where it overrides it, and a data source's bad running statistics
refused before the optimizers' updates are encoded (nothing counted)."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from mpsnn.cnn.normalization import BatchNormalization
from tests.graph._helpers import DEV, ce_loss, gen, new_cb, rand, training


def _net(g: torch.Generator, ds: m.TensorBatchNormalizationDataSource, node: type | None = None):
    x = m.ImageNode("x")
    w = m.TensorConvolutionDataSource(m.ConvolutionDescriptor(3, 3, 2, 3), rand(g, 3, 3, 3, 2),
                                      optimizer=m.Adam(DEV))  # fmt: skip
    c1 = m.ConvolutionNode(x, w)
    bn = (node or m.BatchNormalizationNode)(c1.result_image, ds)
    pool = m.PoolingAverageNode(m.NeuronReLUNode(bn.result_image).result_image, 2)
    fc = m.FullyConnectedNode(pool.result_image, m.TensorConvolutionDataSource(
        m.ConvolutionDescriptor(3, 3, 3, 4), rand(g, 4, 3, 3, 3), optimizer=m.Adam(DEV)))  # fmt: skip
    graph, _ = training(ce_loss(fc.result_image, 4))
    return graph, w.optimizer


def _bn_source(g: torch.Generator, cls: type = m.TensorBatchNormalizationDataSource):
    return cls(3, gamma=1 + rand(g, 3, scale=0.2), beta=rand(g, 3, scale=0.2),
               optimizer=m.Adam(DEV))  # fmt: skip


def _step(graph: m.Graph, g: torch.Generator) -> m.CommandBuffer:
    cb = new_cb()
    labels = [m.LossLabels(DEV, torch.randint(0, 4, (4, 1, 1), generator=g))]
    graph.encode_batch(cb, [m.ImageBatch.from_tensor(rand(g, 4, 2, 6, 6))], labels)
    return cb


def test_one_command_reloads_the_normalization_layers() -> None:
    g = gen(1)
    graph, _ = _net(g, _bn_source(g))
    cb = _step(graph, g)
    names = [c.name for c in cb._commands]
    # after the updates: the weights' reload, then gamma/beta and running statistics together
    assert names[-3:] == ["reload_weights_and_biases", "reload_normalization_states",
                          "Graph.outputs"]  # fmt: skip
    # no reload of its own: the other two are the forward and its recomputation in the backward
    assert names.count("BatchNormalization") == 2
    cb.commit()
    cb.wait_until_completed()


class _BadRunning(m.TensorBatchNormalizationDataSource):
    """Running statistics of the wrong channel count."""

    def update_mean_and_variance(self, command_buffer, state):
        super().update_mean_and_variance(command_buffer, state)
        return m.NormalizationMeanAndVarianceState(torch.zeros(2), torch.ones(2))


def test_bad_running_statistics_raise_before_the_updates_are_counted() -> None:
    g = gen(2)
    graph, adam = _net(g, _bn_source(g, _BadRunning))
    before = adam.time_step
    with pytest.raises(
        ValueError,
        match=r"\[BatchNormalization\] mean_and_variance_state must hold 3 channels, got 2",
    ):
        _step(graph, g)
    assert adam.time_step == before


class _CountingBN(BatchNormalization):
    reloads = 0

    def reload_gamma_and_beta(self, command_buffer, gamma_and_beta_state) -> None:
        type(self).reloads += 1
        super().reload_gamma_and_beta(command_buffer, gamma_and_beta_state)


class _CountingNode(m.BatchNormalizationNode):
    def _make_kernel(self, device):
        stats, k = super()._make_kernel(device)
        k.__class__ = _CountingBN
        return stats, k


def test_a_kernel_class_that_overrides_its_reload_gets_it_called() -> None:
    g = gen(3)
    graph, _ = _net(g, _bn_source(g), _CountingNode)
    cb = _step(graph, g)
    assert _CountingBN.reloads == 1
    cb.commit()
    cb.wait_until_completed()
    assert cb.error is None
