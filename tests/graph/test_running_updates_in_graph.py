"""A training graph's running-statistics updates: the layers whose data sources are mpsnn's
``TensorBatchNormalizationDataSource`` are updated by one command (one launch on CUDA) with the
values the per-layer updates give; a data source class that overrides the update gets it
called per layer; a data source shared by two layers blends twice, in order. On the CPU in
float64, and on CUDA in float32 (the Triton launch counted)."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from tests.graph._helpers import DEV, F32, F64, ce_loss, gen, new_cb, rand, training

_UPDATE = "TensorBatchNormalizationDataSource.update_mean_and_variance"


class _PerLayer(m.TensorBatchNormalizationDataSource):
    """mpsnn's update, reached through an override: the graph calls it per layer."""

    calls = 0

    def update_mean_and_variance(self, command_buffer, state):
        type(self).calls += 1
        return super().update_mean_and_variance(command_buffer, state)


def _sources(
    seed: int, cls: type, shared: bool, dev: m.Device = DEV
) -> list[m.TensorBatchNormalizationDataSource]:
    g = gen(seed)
    put = _on(dev)

    def one(momentum: float) -> m.TensorBatchNormalizationDataSource:
        return cls(3, gamma=put(1 + rand(g, 3, scale=0.2)), beta=put(rand(g, 3, scale=0.2)),
                   mean=put(rand(g, 3)), variance=put(1 + rand(g, 3, scale=0.1).abs()),
                   momentum=momentum, optimizer=m.Adam(dev))  # fmt: skip

    first = one(0.1)
    return [first, first] if shared else [first, one(0.3)]


def _on(dev: m.Device):
    """float64 on the CPU; float32 on CUDA (the dtype of the Triton update)."""
    if dev.type == "cpu":
        return lambda t: t
    return lambda t: t.to(dev.torch_device, torch.float32)


def _net(seed: int, sources: list[m.TensorBatchNormalizationDataSource], dev: m.Device = DEV):
    g = gen(seed)
    put = _on(dev)
    x = m.ImageNode("x")
    src = x
    for i, ds in enumerate(sources):
        cin = 2 if i == 0 else 3
        w = m.TensorConvolutionDataSource(m.ConvolutionDescriptor(3, 3, cin, 3),
                                          put(rand(g, 3, 3, 3, cin)), optimizer=m.Adam(dev))  # fmt: skip
        conv = m.ConvolutionNode(src, w)
        bn = m.BatchNormalizationNode(conv.result_image, ds)
        src = m.NeuronReLUNode(bn.result_image).result_image
    pool = m.PoolingAverageNode(src, 2)
    fc = m.FullyConnectedNode(pool.result_image, m.TensorConvolutionDataSource(
        m.ConvolutionDescriptor(3, 3, 3, 4), put(rand(g, 4, 3, 3, 3)), optimizer=m.Adam(dev)))  # fmt: skip
    fmt = F32 if dev.type != "cpu" else F64
    graph, _ = training(ce_loss(fc.result_image, 4), fmt=fmt, device=dev)
    return graph


def _train(
    cls: type, shared: bool, steps: int = 2, dev: m.Device = DEV
) -> tuple[list[torch.Tensor], list[str]]:
    sources = _sources(7, cls, shared, dev)
    graph = _net(8, sources, dev)
    g = gen(9)
    put = _on(dev)
    queue = dev.new_command_queue()
    names: list[str] = []
    for _ in range(steps):
        cb = queue.command_buffer() if dev.type != "cpu" else new_cb()
        y = torch.randint(0, 4, (4, 1, 1), generator=g).to(dev.torch_device)
        labels = [m.LossLabels(dev, y)]
        graph.encode_batch(cb, [m.ImageBatch.from_tensor(put(rand(g, 4, 2, 8, 8)))], labels)
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton update runs on CUDA")
@pytest.mark.parametrize("shared", [False, True], ids=["two_sources", "one_shared"])
def test_one_launch_on_cuda_updates_every_layer_as_the_per_layer_updates_do(shared) -> None:
    """float32 on CUDA: the graph's one command is one Triton launch a step (a shared data
    source: a second launch, which blends the second time), with the per-layer updates' bits."""
    from mpsnn.ops.triton import batch_norm_vectors as bv

    dev = m.Device("cuda")
    launches = []
    original = bv.bn_running_updates_triton

    def counted(updates):
        launches.append(len(updates))
        return original(updates)

    bv.bn_running_updates_triton = counted
    try:
        got, names = _train(m.TensorBatchNormalizationDataSource, shared, dev=dev)
    finally:
        bv.bn_running_updates_triton = original
    assert names.count(_UPDATE) == 1
    assert launches == [2, 2], launches  # one call a step, both layers in it
    kernel = bv._running_updates
    before = kernel.direct_launches
    got_again, _ = _train(m.TensorBatchNormalizationDataSource, shared, dev=dev)
    per_step = 2 if shared else 1  # a source behind two layers: its second blend waits
    assert kernel.direct_launches - before == 2 * per_step  # compiled by the first run
    _PerLayer.calls = 0
    want, per_layer_names = _train(_PerLayer, shared, dev=dev)
    assert _PerLayer.calls == 2 * 2
    assert per_layer_names.count(_UPDATE) == 2
    for a, b, c in zip(got, got_again, want, strict=True):
        assert a.is_cuda and a.dtype is torch.float32
        assert torch.equal(a, b) and torch.equal(a, c)
    start = _sources(7, m.TensorBatchNormalizationDataSource, shared, dev)
    assert not torch.equal(got[0], start[0].mean())
