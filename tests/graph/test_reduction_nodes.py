"""The Gram matrix, comparison and reduction nodes in a Graph: forward results against PyTorch,
the Gram matrix's training graph against autograd (its alpha callback included), and the
forward-only nodes refusing a gradient with a clear error (stop_gradient ends the walk)."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from tests.graph._helpers import DEV, F64, encode
from tests.helpers import assert_close


def _graph(result: m.ImageNode, needed: bool = True) -> m.Graph:
    g = m.Graph(DEV, result, result_image_is_needed=needed)
    g.format = F64
    return g


def test_gram_node_forward_and_training_graph() -> None:
    gen = torch.Generator().manual_seed(40)
    x = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    dy = torch.randn(2, 3, 1, 3, generator=gen, dtype=torch.float64)
    src = m.ImageNode("x")
    gram = m.GramMatrixCalculationNode(src, alpha=0.5)
    assert gram.alpha == 0.5
    y = encode(_graph(gram.result_image), [x]).image.tensor
    xr = x.clone().requires_grad_()
    ref = 0.5 * torch.einsum("bihw,bjhw->bij", xr, xr).unsqueeze(2)
    assert_close(y, ref.detach(), "gram node", tol=1e-13)

    dy_node = m.ImageNode("dy")
    (exit_node,) = gram.training_graph(dy_node)
    assert isinstance(exit_node, m.GramMatrixCalculationGradientNode)
    assert exit_node.alpha == 0.5
    graph = _graph(exit_node.result_image)
    order = graph.source_image_handles
    dx = encode(graph, [x if h == "x" else dy for h in order]).image.tensor
    ref.backward(dy)
    assert_close(dx, xr.grad, "gram node gradient", tol=1e-13)


def test_gram_node_alpha_callback() -> None:
    gen = torch.Generator().manual_seed(41)
    x = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    dy = torch.randn(2, 3, 1, 3, generator=gen, dtype=torch.float64)
    seen = []

    class PerElement:  # MPS ``MPSNNGramMatrixCallback``: 1 / (C H W), the style-loss scale
        def alpha(self, source_image, destination_image):
            seen.append((source_image.shape, destination_image.width))
            _, c, h, w = source_image.shape
            return 1.0 / (c * h * w)

    src, dy_node = m.ImageNode("x"), m.ImageNode("dy")
    gram = m.GramMatrixCalculationNode(src)
    gram.property_call_back = PerElement()
    (exit_node,) = gram.training_graph(dy_node)
    y = encode(_graph(gram.result_image), [x]).image.tensor
    assert seen == [((2, 3, 4, 5), 3)]
    train = _graph(exit_node.result_image)
    order = train.source_image_handles
    dx = encode(train, [x if h == "x" else dy for h in order]).image.tensor
    assert len(seen) == 2  # the training graph runs the forward (and its callback) too
    alpha = 1.0 / 60
    xr = x.clone().requires_grad_()
    ref = alpha * torch.einsum("bihw,bjhw->bij", xr, xr).unsqueeze(2)
    ref.backward(dy)
    assert_close(y, ref.detach(), "gram with callback alpha", tol=1e-13)
    assert_close(dx, xr.grad, "gram gradient with callback alpha", tol=1e-13)


REDUCTIONS = {
    m.ReductionRowMinNode: lambda t: t.amin(3, keepdim=True),
    m.ReductionRowMaxNode: lambda t: t.amax(3, keepdim=True),
    m.ReductionRowMeanNode: lambda t: t.mean(3, keepdim=True),
    m.ReductionRowSumNode: lambda t: t.sum(3, keepdim=True),
    m.ReductionColumnMinNode: lambda t: t.amin(2, keepdim=True),
    m.ReductionColumnMaxNode: lambda t: t.amax(2, keepdim=True),
    m.ReductionColumnMeanNode: lambda t: t.mean(2, keepdim=True),
    m.ReductionColumnSumNode: lambda t: t.sum(2, keepdim=True),
    m.ReductionFeatureChannelsMinNode: lambda t: t.amin(1, keepdim=True),
    m.ReductionFeatureChannelsMaxNode: lambda t: t.amax(1, keepdim=True),
    m.ReductionFeatureChannelsMeanNode: lambda t: t.mean(1, keepdim=True),
    m.ReductionFeatureChannelsSumNode: lambda t: -2.0 * t.sum(1, keepdim=True),
    m.ReductionFeatureChannelsArgumentMinNode: lambda t: t.argmin(1, keepdim=True).double(),
    m.ReductionFeatureChannelsArgumentMaxNode: lambda t: t.argmax(1, keepdim=True).double(),
}


@pytest.mark.parametrize("cls", list(REDUCTIONS), ids=lambda c: c.__name__)
def test_reduction_nodes_forward_with_source_clip_rect(cls) -> None:
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(2, 4, 5, 6, generator=gen, dtype=torch.float64)
    src = m.ImageNode("x")
    relu = m.NeuronReLUNode(src)  # an interior node feeding the reduction
    node = cls(relu.result_image)
    assert isinstance(node, m.UnaryReductionNode)
    assert node.clip_rect_source == m.RECT_NO_CLIP
    node.clip_rect_source = m.Region.make(1, 1, 4, 3, z=0, depth=2)
    if cls is m.ReductionFeatureChannelsSumNode:
        assert node.weight == 1.0
        node.weight = -2.0
    y = encode(_graph(node.result_image), [x]).image.tensor
    assert_close(y, REDUCTIONS[cls](x.clamp_min(0)[:, :, 1:4, 1:5]), cls.__name__, tol=1e-13)


def test_comparison_node() -> None:
    gen = torch.Generator().manual_seed(43)
    a = torch.randn(2, 3, 4, 4, generator=gen, dtype=torch.float64)
    b = torch.randn(2, 3, 4, 4, generator=gen, dtype=torch.float64)
    left, right = m.ImageNode("a"), m.ImageNode("b")
    node = m.ComparisonNode(left, right)
    assert node.comparison_type is m.ComparisonType.EQUAL and node.threshold == 0.0
    node.comparison_type = m.ComparisonType.GREATER_OR_EQUAL
    node.threshold = 0.5
    assert node.comparison_type is m.ComparisonType.GREATER_OR_EQUAL
    assert node.result_state is None
    graph = _graph(node.result_image)
    order = graph.source_image_handles
    y = encode(graph, [a if h == "a" else b for h in order]).image.tensor
    assert torch.equal(y, ((a >= b) | ((a - b).abs() <= 0.5)).double())
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        _ = node.nonsense


def test_forward_only_nodes_refuse_a_gradient_and_stop_gradient_ends_the_walk() -> None:
    src = m.ImageNode("x")
    conv_like = m.NeuronSigmoidNode(src)
    red = m.ReductionColumnSumNode(conv_like.result_image)
    cmp = m.ComparisonNode(conv_like.result_image, red.result_image)
    for node in (red, cmp):
        with pytest.raises(
            ValueError,
            match=rf"\[{type(node).__name__}\] this filter has no gradient \(MPS defines none\); "
            r"set stop_gradient on its result_image to end the training graph there",
        ):
            node.gradient_filters([m.ImageNode("g")])
    with pytest.raises(ValueError, match=r"\[ReductionColumnSumNode\] this filter has no gradient"):
        red.training_graph(m.ImageNode("dy"))
    # a loss over [sigmoid, reduction]: with stop_gradient the walk ends at the reduction
    add = m.AdditionNode(conv_like.result_image, red.result_image)
    red.result_image.stop_gradient = True
    grads = add.training_graph(m.ImageNode("dy"))
    made = {type(n).__name__ for n in grads}
    assert "NeuronGradientNode" in made
