"""The small network the step-program tests train (a convolution with a ReLU, a fully
connected layer, softmax cross entropy, SGD), with a data source or optimizer of the user's in
its place when asked, and the checks they share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import mpsnn as m
from mpsnn.cli.common import parse_device
from mpsnn.cnn.loss_labels import LossLabels
from mpsnn.core.image_batch import ImageBatch

DEV = parse_device("cpu")
Data = list[tuple[torch.Tensor, torch.Tensor]]


def assert_same_sources(a: list[Any], b: list[Any]) -> None:
    """Two runs' data sources hold the same weights and biases, bit for bit."""
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.weights(), y.weights())
        assert torch.equal(x.bias_terms(), y.bias_terms())


def small_data(seed: int) -> Data:
    """Four batches of 4 one-channel 8x8 images and class indices (`small_training`'s input)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(4, 1, 8, 8, generator=gen), torch.randint(0, 10, (4,), generator=gen))
        for _ in range(4)
    ]


class _CountingSource(m.TensorConvolutionDataSource):
    """A data source of the user's: its ``update`` counts its calls."""

    calls = 0

    def update(self, command_buffer, gradient_state, source_state):  # type: ignore[no-untyped-def]
        self.calls += 1
        return super().update(command_buffer, gradient_state, source_state)


class _CountingSGD(m.SGD):
    """An optimizer of the user's: its update counts its calls."""

    calls = 0

    def _update(self, cb, values, grads, results, states):  # type: ignore[no-untyped-def]
        self.calls += 1
        return super()._update(cb, values, grads, results, states)


def small_training(
    custom: str, reuse: bool, cin: int = 1, *, bias: bool = True, momentum: float = 0.9
) -> tuple[m.Graph, list[Any], Any]:
    """conv 3x3 cin->4 (biases or none) + ReLU, fully connected 8x8x4->10, softmax cross
    entropy (batch 4), SGD; ``custom``: which part is the user's ("data source", "optimizer"
    or "none")."""
    gen = torch.Generator().manual_seed(3)
    sgd = _CountingSGD if custom == "optimizer" else m.SGD
    opt = sgd(DEV, momentum_scale=momentum, descriptor=m.OptimizerDescriptor(learning_rate=0.05))
    d1, d2 = m.ConvolutionDescriptor(3, 3, cin, 4), m.ConvolutionDescriptor(8, 8, 4, 10)
    first = _CountingSource if custom == "data source" else m.TensorConvolutionDataSource
    w1 = torch.randn(d1.weights_shape, generator=gen) * 0.3
    c1 = first(d1, w1, torch.zeros(4) if bias else None, opt)
    fc = m.TensorConvolutionDataSource(
        d2, torch.randn(d2.weights_shape, generator=gen) * 0.05, torch.zeros(10), opt
    )
    x = m.ImageNode("x")
    h = m.NeuronReLUNode(m.ConvolutionNode(x, c1).result_image).result_image
    loss = m.LossNode(
        m.FullyConnectedNode(h, fc).result_image,
        m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM, weight=1 / 4),
    )
    (exit_node,) = loss.training_graph()
    graph = m.Graph(DEV, exit_node.result_image, False)
    graph.reuse_step = reuse
    return graph, [c1, fc], c1 if custom == "data source" else opt


def encode(graph: m.Graph, cb: m.CommandBuffer, x: torch.Tensor, y: torch.Tensor) -> Any:
    """One training step encoded on ``cb`` with new images and new labels; its labels."""
    labels = LossLabels(DEV, y.view(-1, 1, 1))
    graph.encode_batch(cb, [ImageBatch.from_tensor(x.clone())], [labels])
    return labels


def train(
    net: Any,
    graph: m.Graph,
    data: Data,
    before: Callable[[int, Any, m.Graph], None] | None = None,
) -> list[torch.Tensor]:
    """One committed step per batch (``before(i, net, graph)`` first); the losses (copies)."""
    queue = DEV.new_command_queue()
    losses = []
    for i, (x, y) in enumerate(data):
        if before is not None:
            before(i, net, graph)
        cb = queue.command_buffer()
        labels = encode(graph, cb, x, y)
        cb.commit()
        cb.wait_until_completed()
        losses.append(labels.loss_image().tensor.clone())
    return losses


def assert_same_losses(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (la, lb) in enumerate(zip(a, b, strict=True)):
        assert la.dtype == lb.dtype and la.shape == lb.shape, (i, la, lb)
        assert torch.equal(la, lb), f"step {i}: {la.flatten()} != {lb.flatten()}"
