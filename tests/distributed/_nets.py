"""A small float64 training graph (convolutions, optional batch normalization and dropout,
a fully connected layer) and its data, shared by the test process (one process, the whole
batch) and the ranks (their shard of it)."""

from __future__ import annotations

from typing import Any

import torch

import mpsnn as m

DEV = m.Device("cpu")
BATCH = 8  # the global batch
STEPS = 3
CLASSES = 5


def _rand(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def _optimizer(name: str) -> Any:
    if name == "sgd":
        return m.SGD(DEV, momentum_scale=0.9, descriptor=m.OptimizerDescriptor(learning_rate=0.1))
    return m.Adam(DEV, descriptor=m.OptimizerDescriptor(learning_rate=0.01))


def _conv(
    g: torch.Generator, k: int, cin: int, cout: int, opt: Any, bias: bool = True,
    dtype: torch.dtype = torch.float64,
) -> Any:  # fmt: skip
    desc = m.ConvolutionDescriptor(k, k, cin, cout)
    w = _rand(g, *desc.weights_shape, scale=(k * k * cin) ** -0.5).to(dtype)  # OHWI memory
    b = _rand(g, cout, scale=0.1).to(dtype) if bias else None  # none before a batch norm
    return m.TensorConvolutionDataSource(desc, w, b, optimizer=opt)


def _bn(g: torch.Generator, c: int, opt: Any) -> Any:
    return m.TensorBatchNormalizationDataSource(
        c, gamma=1 + _rand(g, c, scale=0.1), beta=_rand(g, c, scale=0.1),
        mean=torch.zeros(c, dtype=torch.float64), variance=torch.ones(c, dtype=torch.float64),
        epsilon=1e-5, momentum=0.1, optimizer=opt,
    )  # fmt: skip


def build(
    bn: bool, optimizer: str, dropout: bool = False, dtype: torch.dtype = torch.float64
) -> tuple[m.Graph, list[Any]]:
    """The training graph (``dtype`` storage and convolution weights, float64 by default; loss
    weight 1/BATCH) and its data sources."""
    g = torch.Generator().manual_seed(7)
    opt = _optimizer(optimizer)
    sources: list[Any] = []
    x = m.ImageNode("image")
    for cin, cout in ((2, 4), (4, 6)):
        ds = _conv(g, 3, cin, cout, opt, bias=not bn, dtype=dtype)
        sources.append(ds)
        x = m.ConvolutionNode(x, ds).result_image
        if bn:
            sources.append(_bn(g, cout, opt))
            x = m.BatchNormalizationNode(x, sources[-1]).result_image
        x = m.NeuronReLUNode(x).result_image
        if cin == 2:
            x = m.PoolingMaxNode(x, 2).result_image
            if dropout:
                x = m.DropoutNode(x, keep_probability=0.7, seed=3).result_image
    fc = _conv(g, 4, 6, CLASSES, opt, dtype=dtype)
    sources.append(fc)
    logits = m.FullyConnectedNode(x, fc).result_image
    loss = m.LossNode(logits, m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY,
                                               m.ReductionType.SUM, weight=1 / BATCH))  # fmt: skip
    (exit_node,) = loss.training_graph()
    graph = m.Graph(DEV, exit_node.result_image, result_image_is_needed=False)
    graph.format = (
        m.FeatureChannelFormat.FLOAT64 if dtype == torch.float64 else m.FeatureChannelFormat.FLOAT32
    )
    return graph, sources


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return _rand(g, BATCH, 2, 8, 8), torch.randint(0, CLASSES, (BATCH,), generator=g)


def train(graph: m.Graph, rank: int = 0, world: int = 1, steps: int = STEPS) -> None:
    """``steps`` steps on this rank's shard of each global batch."""
    queue = DEV.new_command_queue()
    n = BATCH // world
    for step in range(steps):
        x, y = batch(step)
        x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        if graph.format == m.FeatureChannelFormat.FLOAT32:
            x = x.to(torch.float32)
        cb = queue.command_buffer()
        graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)],
                           [m.LossLabels(DEV, y.view(-1, 1, 1))])  # fmt: skip
        cb.commit()
        cb.wait_until_completed()


def values(sources: list[Any]) -> list[torch.Tensor]:
    """Every trained value: weights, biases, gamma, beta, running mean and variance."""
    out: list[torch.Tensor] = []
    for ds in sources:
        if isinstance(ds, m.TensorConvolutionDataSource):
            out.append(ds.weights().clone())
            if ds.bias_terms() is not None:
                out.append(ds.bias_terms().clone())
        else:
            out += [ds.gamma().clone(), ds.beta().clone(), ds.mean().clone(),
                    ds.variance().clone()]  # fmt: skip
    return out


#: (name, batch norm, optimizer, dropout, bucket MiB)
CASES = [
    ("plain-sgd", False, "sgd", False, 0.0),
    ("plain-adam", False, "adam", False, 25.0),
    ("bn-sgd", True, "sgd", True, 0.0),
    ("bn-adam", True, "adam", False, 0.0005),
]
