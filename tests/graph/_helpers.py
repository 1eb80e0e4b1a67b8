"""Shared pieces of the graph tests: seeded float64 data sources, one-step runners, and the
PyTorch side of the comparisons (the same network written with ``torch.nn.functional``).

Weight gradients are read through an SGD optimizer of learning rate 1 in the data sources:
after one step ``w_before - w_after`` is the gradient (exact up to one rounding in float64).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

import mpsnn as m
import mpsnn.graph.plan_passes as plan_passes
from tests.helpers import assert_close

DEV = m.Device("cpu")
F64 = m.FeatureChannelFormat.FLOAT64
F32 = m.FeatureChannelFormat.FLOAT32
F16 = m.FeatureChannelFormat.FLOAT16
TOL = 1e-10  # float64 against float64 (relative norm)

__all__ = [
    "DEV",
    "F16",
    "F32",
    "F64",
    "TOL",
    "RecordingAllocator",
    "TorchConv",
    "assert_close",
    "ce_loss",
    "ce_reference",
    "conv_ds",
    "conv_sandwich",
    "encode",
    "gen",
    "mse_loss",
    "mse_reference",
    "new_cb",
    "peak_and_total",
    "rand",
    "sgd1",
    "training",
    "training_seen",
]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


class RecordingAllocator:
    """An image allocator that remembers what it made (a temporary one by default)."""

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner if inner is not None else m.TemporaryImage.default_allocator()
        self.images: list[m.Image] = []

    def image(self, cb: Any, descriptor: Any, kernel: Any) -> m.Image:
        image = self.inner.image(cb, descriptor, kernel)
        self.images.append(image)
        return image


def sgd1() -> m.SGD:
    """Plain SGD with learning rate 1: one step subtracts the gradient."""
    return m.SGD(DEV, descriptor=m.OptimizerDescriptor(learning_rate=1.0))


def conv_ds(
    g: torch.Generator,
    kw: int,
    kh: int,
    cin: int,
    cout: int,
    optimizer: Any = None,
    *,
    bias: bool = True,
    dtype: torch.dtype = torch.float64,
) -> m.TensorConvolutionDataSource:
    """A data source with random OHWI weights and biases (never all ones)."""
    desc = m.ConvolutionDescriptor(kw, kh, cin, cout)
    fan_in = kw * kh * cin
    w = rand(g, *desc.weights_shape, scale=1.0 / fan_in**0.5).to(dtype)
    b = rand(g, cout, scale=0.1).to(dtype) if bias else None
    return m.TensorConvolutionDataSource(desc, w, b, optimizer=optimizer)


class TorchConv:
    """The PyTorch twin of a convolution data source: OIHW weights and biases (leaf tensors
    with gradients, unless frozen), captured when made."""

    def __init__(self, ds: m.TensorConvolutionDataSource, *, requires_grad: bool = True) -> None:
        self.ds = ds
        self.w = ds.weights().permute(0, 3, 1, 2).detach().clone().requires_grad_(requires_grad)
        b = ds.bias_terms()
        self.b = None if b is None else b.detach().clone().requires_grad_(requires_grad)

    def __call__(self, x: torch.Tensor, padding: int | None = None) -> torch.Tensor:
        k = self.w.shape[-1]
        return F.conv2d(x, self.w, self.b, padding=k // 2 if padding is None else padding)

    def fc(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.w, self.b)

    def params(self) -> list[torch.Tensor]:
        return [self.w] if self.b is None else [self.w, self.b]

    def check_step(self, what: str, lr: float = 1.0, tol: float = TOL) -> None:
        """The data source's values moved by ``-lr * grad`` (the PyTorch gradient)."""
        after_w = self.ds.weights().permute(0, 3, 1, 2)
        assert_close((self.w.detach() - after_w) / lr, self.w.grad, f"{what} weight gradient", tol)
        if self.b is not None:
            after_b = self.ds.bias_terms()
            assert_close(
                (self.b.detach() - after_b) / lr, self.b.grad, f"{what} bias gradient", tol
            )

    def check_unchanged(self, what: str) -> None:
        assert torch.equal(self.ds.weights().permute(0, 3, 1, 2), self.w.detach()), what
        if self.b is not None:
            assert torch.equal(self.ds.bias_terms(), self.b.detach()), what


def ce_loss(source: m.ImageNode, n: int) -> m.LossNode:
    """Softmax cross entropy, summed per image, weight 1/n (the batch mean)."""
    desc = m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM, weight=1.0 / n)
    return m.LossNode(source, desc)


def ce_reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    n = logits.shape[0]
    return F.cross_entropy(logits.reshape(n, -1), labels.reshape(n), reduction="sum") / n


def mse_loss(source: m.ImageNode, weight: float = 0.5) -> m.LossNode:
    desc = m.LossDescriptor(m.LossType.MEAN_SQUARED_ERROR, m.ReductionType.SUM, weight=weight)
    return m.LossNode(source, desc)


def mse_reference(y: torch.Tensor, target: torch.Tensor, weight: float = 0.5) -> torch.Tensor:
    return weight * ((y - target) ** 2).sum()


def training(
    loss: m.LossNode,
    *,
    needed: bool = True,
    fmt: m.FeatureChannelFormat = F64,
    handler: Any = None,
    device: m.Device = DEV,
) -> tuple[m.Graph, list[Any]]:
    """The training graph of ``loss`` (one terminal gradient node expected) as a `Graph`."""
    terminals = loss.training_graph(None, handler)
    assert len(terminals) == 1, terminals
    graph = m.Graph(device, terminals[0].result_image, needed)
    graph.format = fmt
    return graph, terminals


def training_seen(loss: m.LossNode) -> tuple[m.Graph, list[Any], list[str]]:
    """`training` of ``loss``, with the class names of the gradient nodes the walk made."""
    seen: list[str] = []
    graph, terminals = training(loss, handler=lambda gn, *rest: seen.append(type(gn).__name__))
    return graph, terminals, seen


def conv_sandwich(
    g: torch.Generator,
    first: tuple[int, int, int, int],
    middle: Callable[[m.ImageNode], m.ImageNode],
    second: tuple[int, int, int, int],
) -> tuple[m.ConvolutionNode, tuple[Any, Any], m.LossNode]:
    """``x -> conv first -> middle -> conv second -> MSE loss``, the convolutions' data
    sources (`conv_ds` of ``(kw, kh, cin, cout)``, made in that order) stepped by `sgd1`:
    (the second convolution node, the two data sources, the loss node)."""
    d1, d2 = conv_ds(g, *first, sgd1()), conv_ds(g, *second, sgd1())
    c1 = m.ConvolutionNode(m.ImageNode("x"), d1)
    c2 = m.ConvolutionNode(middle(c1.result_image), d2)
    return c2, (d1, d2), mse_loss(c2.result_image)


def new_cb() -> m.CommandBuffer:
    return DEV.new_command_queue().command_buffer()


def encode(
    graph: m.Graph, images: Sequence[torch.Tensor], states: Sequence[Any] | None = None
) -> m.ImageBatch | None:
    """One ``encode_batch`` on a fresh command buffer, committed and waited for."""
    cb = new_cb()
    out = graph.encode_batch(cb, [m.ImageBatch.from_tensor(t) for t in images], states)
    cb.commit()
    cb.wait_until_completed()
    return out


_PEAK = re.compile(r"intermediates: peak ([0-9.]+) MiB of ([0-9.]+) MiB")


def peak_and_total(graph: m.Graph) -> tuple[float, float]:
    """The peak and total intermediate memory ``debug_description`` reports (MiB)."""
    found = _PEAK.search(graph.debug_description())
    assert found is not None, graph.debug_description()
    return float(found.group(1)), float(found.group(2))


@contextlib.contextmanager
def gradient_fusion(enabled: bool) -> Iterator[None]:
    """Graphs made inside plan their ReLU gradients fused into other commands or not
    (`mpsnn.graph.plan_passes.FUSE_GRADIENTS`), to compare the two plans bit for bit."""
    saved = plan_passes.FUSE_GRADIENTS
    plan_passes.FUSE_GRADIENTS = enabled
    try:
        yield
    finally:
        plan_passes.FUSE_GRADIENTS = saved


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype and the same bytes, element by element."""
    a, b = a.contiguous().view(-1), b.contiguous().view(-1)
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def resnet18_two_steps(
    configure: Callable[[m.Graph], None] | None = None,
) -> tuple[m.Graph, list[torch.Tensor]]:
    """A small ResNet-18 (width 4, 12x12 images, bfloat16 storage) trained two SGD steps on
    fixed data (``configure(graph)`` first): the graph and its 21 layers' weights after."""
    from mpsnn.models import ResNet18

    net = ResNet18(DEV, m.SGD(DEV, descriptor=m.OptimizerDescriptor(learning_rate=0.1)),
                   seed=3, width=4, input_shape=(3, 12, 12))  # fmt: skip
    graph = net.training_graph(4, storage=m.FeatureChannelFormat.BFLOAT16)
    if configure is not None:
        configure(graph)
    data = torch.Generator().manual_seed(5)
    for _ in range(2):
        x = torch.randn(4, 3, 12, 12, generator=data)
        labels = torch.randint(0, 10, (4,), generator=data)
        onehot = F.one_hot(labels, 10).double().reshape(4, 10, 1, 1)
        encode(graph, [x], [[m.LossLabels(DEV, onehot[i : i + 1]) for i in range(4)]])
    weights = [ds.weights().clone() for ds in net.data_sources if hasattr(ds, "weights")]
    assert len(weights) == 21
    return graph, weights
