"""A training graph's running-statistics updates: the layers whose data sources are mpsnn's
``TensorBatchNormalizationDataSource`` are updated by one command (one launch on CUDA) with the
values the per-layer updates give; a data source class that overrides the update gets it
called per layer; a data source shared by two layers blends twice, in order."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from tests.graph._helpers import DEV, ce_loss, gen, new_cb, rand, training

_UPDATE = "TensorBatchNormalizationDataSource.update_mean_and_variance"


class _PerLayer(m.TensorBatchNormalizationDataSource):
    """mpsnn's update, reached through an override: the graph calls it per layer."""

    calls = 0

    def update_mean_and_variance(self, command_buffer, state):
        type(self).calls += 1
        return super().update_mean_and_variance(command_buffer, state)


def _sources(seed: int, cls: type, shared: bool) -> list[m.TensorBatchNormalizationDataSource]:
    g = gen(seed)

    def one(momentum: float) -> m.TensorBatchNormalizationDataSource:
        return cls(3, gamma=1 + rand(g, 3, scale=0.2), beta=rand(g, 3, scale=0.2),
                   mean=rand(g, 3), variance=1 + rand(g, 3, scale=0.1).abs(),
                   momentum=momentum, optimizer=m.Adam(DEV))  # fmt: skip

    first = one(0.1)
    return [first, first] if shared else [first, one(0.3)]


def _net(seed: int, sources: list[m.TensorBatchNormalizationDataSource]) -> m.Graph:
    g = gen(seed)
    x = m.ImageNode("x")
    src = x
    for i, ds in enumerate(sources):
        cin = 2 if i == 0 else 3
        w = m.TensorConvolutionDataSource(m.ConvolutionDescriptor(3, 3, cin, 3),
                                          rand(g, 3, 3, 3, cin), optimizer=m.Adam(DEV))  # fmt: skip
        conv = m.ConvolutionNode(src, w)
        bn = m.BatchNormalizationNode(conv.result_image, ds)
        src = m.NeuronReLUNode(bn.result_image).result_image
    pool = m.PoolingAverageNode(src, 2)
    fc = m.FullyConnectedNode(pool.result_image, m.TensorConvolutionDataSource(
        m.ConvolutionDescriptor(3, 3, 3, 4), rand(g, 4, 3, 3, 3), optimizer=m.Adam(DEV)))  # fmt: skip
    graph, _ = training(ce_loss(fc.result_image, 4))
    return graph


def _train(cls: type, shared: bool, steps: int = 2) -> tuple[list[torch.Tensor], list[str]]:
    sources = _sources(7, cls, shared)
    graph = _net(8, sources)
    g = gen(9)
    names: list[str] = []
    for _ in range(steps):
        cb = new_cb()
        labels = [m.LossLabels(DEV, torch.randint(0, 4, (4, 1, 1), generator=g))]
        graph.encode_batch(cb, [m.ImageBatch.from_tensor(rand(g, 4, 2, 8, 8))], labels)
        names = [c.name for c in cb._commands]
        cb.commit()
        cb.wait_until_completed()
        assert cb.error is None
    running = [t.clone() for ds in sources for t in (ds.mean(), ds.variance())]
    return running, names


@pytest.mark.parametrize("shared", [False, True], ids=["two_sources", "one_shared"])
def test_one_command_updates_every_layer_as_the_per_layer_updates_do(shared) -> None:
    got, names = _train(m.TensorBatchNormalizationDataSource, shared)
    assert names.count(_UPDATE) == 1
    _PerLayer.calls = 0
    want, per_layer_names = _train(_PerLayer, shared)
    assert _PerLayer.calls == 2 * 2  # two layers, two steps
    assert per_layer_names.count(_UPDATE) == 2
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    # and the running statistics moved (the updates ran)
    start = _sources(7, m.TensorBatchNormalizationDataSource, shared)
    assert not torch.equal(got[0], start[0].mean())
