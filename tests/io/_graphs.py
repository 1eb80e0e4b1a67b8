"""Shared pieces of the graph save/load tests: a small CNN (convolution, [batch norm], ReLU,
[dropout], max pool, fully connected, cross entropy) whose data sources share one Adam, its
training graph, seeded batches, one training step returning the loss, and bit-for-bit
comparisons of what a graph's layers hold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import mpsnn as m

DEV = m.Device("cpu")
F32 = m.FeatureChannelFormat.FLOAT32
F64 = m.FeatureChannelFormat.FLOAT64
FORMATS = {torch.float32: F32, torch.float64: F64}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def conv_ds(
    g: torch.Generator, k: int, cin: int, cout: int, optimizer: Any, dtype: torch.dtype
) -> m.TensorConvolutionDataSource:
    desc = m.ConvolutionDescriptor(k, k, cin, cout)
    w = rand(g, *desc.weights_shape, dtype=dtype) / (k * k * cin) ** 0.5
    return m.TensorConvolutionDataSource(desc, w, rand(g, cout, dtype=dtype) * 0.1, optimizer)


@dataclass
class Net:
    x: m.ImageNode
    conv: m.ConvolutionNode
    fc: m.FullyConnectedNode
    loss: m.LossNode
    adam: m.Adam
    sources: list[Any]
    drop: Any = None
    bn: Any = None


def cnn(seed: int, dtype: torch.dtype, *, batch_norm: bool = False, dropout: bool = False) -> Net:
    """x (4 images 2x6x6) -> conv 3x3 2->3 -> [batch norm] -> ReLU -> [dropout] -> max pool 2 ->
    fully connected 3x3x3->4 -> softmax cross entropy (the batch mean)."""
    g = gen(seed)
    adam = m.Adam(DEV, descriptor=m.OptimizerDescriptor(learning_rate=0.05))
    d1, d2 = conv_ds(g, 3, 2, 3, adam, dtype), conv_ds(g, 3, 3, 4, adam, dtype)
    sources: list[Any] = [d1, d2]
    x = m.ImageNode("x")
    conv = m.ConvolutionNode(x, d1)
    h = conv.result_image
    bn = drop = None
    if batch_norm:
        bn_ds = m.TensorBatchNormalizationDataSource(
            3, 1 + rand(g, 3, dtype=dtype) * 0.2, rand(g, 3, dtype=dtype) * 0.2,
            momentum=0.3, optimizer=adam,
        )  # fmt: skip
        sources.append(bn_ds)
        bn = m.BatchNormalizationNode(h, bn_ds)
        h = bn.result_image
    h = m.NeuronReLUNode(h).result_image
    if dropout:
        drop = m.DropoutNode(h, 0.7, seed=5)
        h = drop.result_image
    fc = m.FullyConnectedNode(m.PoolingMaxNode(h, 2).result_image, d2)
    desc = m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM, weight=0.25)
    loss = m.LossNode(fc.result_image, desc)
    return Net(x, conv, fc, loss, adam, sources, drop, bn)


def training(loss: m.LossNode, dtype: torch.dtype, handler: Any = None) -> m.Graph:
    (terminal,) = loss.training_graph(None, handler)
    graph = m.Graph(DEV, terminal.result_image, False)
    graph.format = FORMATS[dtype]
    graph.label = "training"
    return graph


def batches(seed: int, count: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = gen(seed)
    return [
        (rand(g, 4, 2, 6, 6, dtype=dtype), torch.randint(0, 4, (4, 1, 1), generator=g))
        for _ in range(count)
    ]


def run(graph: m.Graph, images: list[torch.Tensor], states: Any = None) -> Any:
    cb = DEV.new_command_queue().command_buffer()
    out = graph.encode_batch(cb, [m.ImageBatch.from_tensor(t) for t in images], states)
    cb.commit()
    cb.wait_until_completed()
    return out


def step(graph: m.Graph, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One training step; the loss."""
    labels = m.LossLabels(DEV, batch[1])
    run(graph, [batch[0]], [labels])
    return labels.loss_image().tensor.clone()


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit for bit (None equals None)."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = {8: torch.int64, 4: torch.int32, 2: torch.int16}
    if a.is_floating_point():
        a, b = (t.contiguous().view(bits[t.element_size()]) for t in (a, b))
    return torch.equal(a, b)


def layers(graph: m.Graph) -> list[Any]:
    """The trainable forward nodes a graph runs, in order."""
    return [n for n in graph._plan.order if hasattr(n, "data_source")]


def values(graph: m.Graph) -> list[torch.Tensor | None]:
    """Everything the graph's layers hold: data sources (values, optimizer state) and the
    graph's own kernels (master weights, normalization copies, dropout counters)."""
    out: list[torch.Tensor | None] = []
    for node in layers(graph):
        ds = node.data_source
        if isinstance(ds, m.TensorConvolutionDataSource):
            out += [ds.weights(), ds.bias_terms()]
            kernel = graph._plan.kernels[node._id]
            out += [kernel.weights, kernel.biases]
        else:
            out += [ds.gamma(), ds.beta(), ds.mean(), ds.variance()]
            bn = graph._plan.kernels[node._id][1]
            out += [bn.gamma, bn.beta, bn.mean, bn.variance]
        for vectors in ds._optimizer_state or []:
            out += vectors
        opt = ds.optimizer
        out += [opt._hyper, opt._step]
    for node in graph._plan.order:
        if isinstance(node, m.DropoutNode):
            out.append(graph._plan.kernels[node._id]._counter)
    return out


def listing(graph: m.Graph) -> str:
    """The plan's listing (without the last encode's memory report)."""
    return "\n".join(
        line for line in graph.debug_description().splitlines() if "intermediates:" not in line
    )
