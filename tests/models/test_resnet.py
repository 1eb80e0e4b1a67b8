"""ResNet18 against its PyTorch twin in float64: the inference graph (even, odd and
non-square sizes), one SGD step of the training graph (weights, gamma/beta, running
statistics), the padding policy of the strided convolutions, and what the graphs fuse."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from mpsnn.models import ResNet18
from mpsnn.models.resnet import _SAME
from tests.helpers import assert_close
from tests.models._helpers import (
    DEV,
    F64,
    TOL,
    check_one_sgd_step,
    check_twin_holds_data_sources,
    logits,
    run,
    sgd,
)

WIDTH = 4  # base channels for the quick tests (ResNet-18 proper: 64)


def _model(shape, seed: int, optimizer=None, width: int = WIDTH) -> ResNet18:
    """A float64 ResNet18 whose batch norms hold random gamma, beta and running statistics
    (the defaults 1, 0, 0, 1 would hide a swapped or ignored value)."""
    model = ResNet18(DEV, optimizer, seed=seed, dtype=torch.float64, input_shape=shape,
                     width=width)  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    for ds in model.data_sources:
        if isinstance(ds, m.TensorBatchNormalizationDataSource):
            c = ds.number_of_feature_channels
            ds.gamma().copy_(1 + 0.3 * torch.randn(c, generator=g, dtype=torch.float64))
            ds.beta().copy_(0.3 * torch.randn(c, generator=g, dtype=torch.float64))
            ds.mean().copy_(0.3 * torch.randn(c, generator=g, dtype=torch.float64))
            ds.variance().copy_(0.5 + torch.rand(c, generator=g, dtype=torch.float64))
    return model


def _batch(n: int, shape, seed: int, classes: int = 10):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *shape, generator=g, dtype=torch.float64)
    return x, torch.randint(0, classes, (n,), generator=g)


SHAPES = [(3, 32, 32), (1, 28, 28), (2, 18, 13)]  # CIFAR, Fashion-MNIST, odd and non-square


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_inference_graph_equals_the_twin_in_eval_mode(shape) -> None:
    model = _model(shape, 1)
    x, _ = _batch(3, shape, 2)
    twin = model.torch_module().eval()
    check_twin_holds_data_sources(model, twin)
    with torch.no_grad():
        assert_close(logits(model, x), twin(x), f"logits {shape}", TOL)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=lambda s: "x".join(map(str, s)))
def test_one_sgd_step_equals_torch_optim_sgd(shape) -> None:
    model = _model(shape, 3, sgd())
    check_one_sgd_step(model, *_batch(4, shape, 4))


def test_full_width_inference_equals_the_twin() -> None:
    model = _model((3, 32, 32), 5, width=64)
    assert model.parameter_count() == 11_173_962
    x, _ = _batch(2, (3, 32, 32), 6)
    with torch.no_grad():
        expected = model.torch_module().eval()(x)
    assert_close(logits(model, x), expected, "ResNet-18 logits", TOL)


def test_model_attributes_and_the_pooling_window() -> None:
    assert ResNet18(DEV, width=2).pool_size == (4, 4)
    assert ResNet18(DEV, width=2, input_shape=(1, 28, 28)).pool_size == (4, 4)
    model = ResNet18(DEV, width=2, input_shape=(2, 18, 13), classes=3)
    assert model.pool_size == (2, 3)  # width 13 -> 7 -> 4 -> 2, height 18 -> 9 -> 5 -> 3
    assert model.input_shape == (2, 18, 13) and model.classes == 3
    assert len(model.layers) == 1 + 1 + 8 * 4 + 3 * 2 + 1  # stem, blocks, shortcuts, fc
    with pytest.raises(ValueError, match="positive"):
        ResNet18(DEV, width=0)


@pytest.mark.parametrize("size", [32, 28, 16, 14, 8, 7, 5, 4, 3, 2, 1])
@pytest.mark.parametrize("kernel,stride", [(3, 1), (3, 2), (1, 2)])
def test_the_padding_policy_gives_pytorch_padding(size: int, kernel: int, stride: int) -> None:
    """Every convolution of the model: 3×3 stride 1 and 2 with PyTorch's ``padding=1``, the
    1×1 stride-2 shortcut sampling pixels 0, 2, 4, ... (even and odd sizes)."""
    g = torch.Generator().manual_seed(size)
    w = torch.randn(3, kernel, kernel, 2, generator=g, dtype=torch.float64)  # OHWI
    desc = m.ConvolutionDescriptor(kernel, kernel, 2, 3, stride, stride)
    x = torch.randn(2, 2, size, size + 1, generator=g, dtype=torch.float64)
    expected = F.conv2d(x, w.permute(0, 3, 1, 2), stride=stride, padding=kernel // 2)

    def conv(policy) -> torch.Tensor:
        node = m.ConvolutionNode(m.ImageNode("x"), m.TensorConvolutionDataSource(desc, w, None))
        node.padding_policy = policy
        graph = m.Graph(DEV, node.result_image)
        graph.format = F64
        return run(graph, x).tensor

    assert_close(conv(_SAME), expected, f"{kernel}x{kernel} stride {stride} on {size}", TOL)
    if kernel == 1 and size % 2 == 0:  # the remainder bottom-right would sample 1, 3, 5, ...
        other = _SAME.padding_method & ~m.PaddingMethod.ADD_REMAINDER_TO_BOTTOM_RIGHT
        late = m.DefaultPadding(other | m.PaddingMethod.ADD_REMAINDER_TO_BOTTOM_RIGHT)
        start = x[..., 1:, size % 2 :]  # rows from 1; columns (size + 1 of them) from 0 or 1
        # which pixels are sampled: a wrong choice differs by O(1), rounding by ~1e-16 (the
        # CPU backend may pick another float64 algorithm for the sliced input)
        late_ref = F.conv2d(start, w.permute(0, 3, 1, 2), stride=2)
        assert_close(conv(late), late_ref, "remainder bottom-right samples 1, 3, 5, ...", TOL)


def _lines(text: str, pattern: str) -> list[str]:
    return [ln for ln in text.splitlines() if re.search(pattern, ln)]


def test_graphs_fuse_relu_into_batch_norm_and_into_the_additions() -> None:
    model = _model((3, 32, 32), 7, sgd())
    text = model.training_graph(4, storage=F64).debug_description()
    bn = _lines(text, r"BatchNormalizationNode \[BatchNormalizationStatistics\+")
    # 20 batch norms: the stem's and each block's first carry the ReLU (9), the others
    # (each block's second, the 3 shortcuts) feed an addition
    assert len(bn) == 20, text
    assert sum("(training; fused RELU" in ln for ln in bn) == 9, text
    # the stem's result is recomputed for its normalization's gradient (the model's choice)
    assert "(training; fused RELU; frees t0 until recomputed)" in bn[0], text
    # and the 8 residual additions carry the ReLU after them (17 fused ReLUs, no ReLU kernel);
    # 8 more additions sum the gradients where a block's input feeds both its first
    # convolution and its shortcut
    assert len(_lines(text, r"NeuronReLUNode \[_Fused\]")) == 17, text
    assert not _lines(text, r"NeuronReLUNode \[Neuron\]"), text
    forward = _lines(text, r"AdditionNode \[Add\] .*\(training[;)]")
    assert len(forward) == 8, text
    assert all("fused RELU" in ln for ln in forward), text
    # each frees its normalization input: its gradient needs the input's shape only
    assert all("frees" in ln for ln in forward), text
    # the residual ReLUs' gradients read the fused result: the last block's in its own
    # kernel, the 7 others inside the sum of the two gradients of the next block's input
    assert len(_lines(text, r"NeuronGradientNode \[ReLUGradientOfResult\]")) == 1, text
    assert len(_lines(text, r"AdditionNode \[Add\]")) == 16, text
    assert len(_lines(text, r"AdditionNode \[Add\] .*applies the ReLU gradient")) == 7, text
    assert len(_lines(text, r"ArithmeticGradientNode \[AddGradient\]")) == 16, text
    assert len(_lines(text, r"NeuronGradientNode \[_PassGradient\]")) == 16, text

    infer = model.inference_graph(storage=F64).debug_description()
    assert "training" not in infer, infer
    assert infer.count("fused RELU") == 17, infer  # 9 batch norms, 8 additions
    assert len(_lines(infer, r"AdditionNode \[Add\]")) == 8, infer
