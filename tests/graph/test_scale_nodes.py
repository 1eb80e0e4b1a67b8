"""Scale nodes (MPS MPSNNScaleNode family): forward in a Graph against the float64 references,
the transform provider (called at each encode with the source and its handle), and the
training graph stopping at them as at a stop_gradient (no gradient node, nothing upstream
trained through them), errors."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.cnn.test_scale import axis_matrix, reference
from tests.graph._helpers import (
    DEV,
    F64,
    TOL,
    TorchConv,
    assert_close,
    conv_sandwich,
    encode,
    gen,
    mse_loss,
    mse_reference,
    rand,
    training_seen,
)


@pytest.mark.parametrize("lanczos", [True, False])
def test_scale_nodes_fit_the_output_size(lanczos) -> None:
    g = gen(51)
    x = m.ImageNode("x")
    cls = m.LanczosScaleNode if lanczos else m.BilinearScaleNode
    node = cls(x, m.Size(13, 4))
    graph = m.Graph(DEV, node.result_image)
    graph.format = F64
    xt = rand(g, 2, 3, 7, 6)
    out = encode(graph, [xt])
    assert node.output_size == m.Size(13, 4) and node.transform_provider is None
    if lanczos:
        ref = reference(xt, axis_matrix(4, 7, 4 / 7, 0.0), axis_matrix(13, 6, 13 / 6, 0.0))
    else:
        ref = F.interpolate(xt, size=(4, 13), mode="bilinear", align_corners=False)
    assert_close(out.tensor, ref, "scale node", TOL)


class Provider:
    """A transform provider that records its calls and hands out the next transform."""

    def __init__(self, transforms: list[Any]) -> None:
        self.transforms = list(transforms)
        self.calls: list[tuple[Any, Any]] = []

    def transform_for_source_image(self, source_image: m.Image, handle: Any) -> Any:
        self.calls.append((source_image, handle))
        return self.transforms.pop(0)


def test_transform_provider_is_asked_at_every_encode() -> None:
    g = gen(52)
    t1, t2 = m.ScaleTransform(1.5, 0.5, -1.0, 0.25), m.ScaleTransform(0.8, 0.9, 2.0, -1.0)
    provider = Provider([t1, t2, None])
    assert isinstance(provider, m.ImageTransformProvider)
    x = m.ImageNode("src")
    node = m.LanczosScaleNode(x, m.Size(9, 5), provider)
    graph = m.Graph(DEV, node.result_image)
    graph.format = F64
    xt = rand(g, 2, 1, 6, 8)
    for t in (t1, t2, None):
        out = encode(graph, [xt])
        if t is None:
            t = m.ScaleTransform(9 / 8, 5 / 6)
        ay = axis_matrix(5, 6, t.scale_y, t.translate_y)
        ax = axis_matrix(9, 8, t.scale_x, t.translate_x)
        assert_close(out.tensor, reference(xt, ay, ax), f"with {t}", TOL)
    assert [h for _, h in provider.calls] == ["src"] * 3
    assert all(img.shape == (2, 1, 6, 8) for img, _ in provider.calls)


def test_training_graph_stops_at_a_scale_node() -> None:
    g = gen(53)
    nodes: list[m.LanczosScaleNode] = []

    def middle(h: m.ImageNode) -> m.ImageNode:
        nodes.append(m.LanczosScaleNode(h, m.Size(9, 7)))
        return nodes[0].result_image

    c2, (d1, d2), loss = conv_sandwich(g, (3, 3, 2, 3), middle, (3, 3, 3, 2))
    (scaled,) = nodes
    t1, t2 = TorchConv(d1), TorchConv(d2)
    graph, terminals, seen = training_seen(loss)
    # The walk ends at the scale node: no gradient for it, c1 or the input.
    assert seen == ["ConvolutionGradientNode"]
    assert terminals[0].inference_node is c2
    assert scaled.result_image.stop_gradient is True

    xt, target = rand(g, 2, 2, 5, 6), rand(g, 2, 2, 7, 9)
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    h = t1(xt).detach()  # as a stop_gradient: nothing flows into c1
    s = reference(h, axis_matrix(7, 5, 7 / 5, 0.0), axis_matrix(9, 6, 9 / 6, 0.0))
    sr = s.clone().requires_grad_()
    mse_reference(t2(sr), target).backward()
    assert_close(out.tensor, sr.grad, "dL/d(scaled): the gradient where the walk ends", TOL)
    t2.check_step("conv after the scale")
    t1.check_unchanged("conv before the scale is not trained")

    # Asked to differentiate it anyway (stop_gradient turned off), the walk refuses.
    scaled.result_image.stop_gradient = False
    with pytest.raises(
        ValueError,
        match=r"\[LanczosScaleNode\] a scale node has no gradient \(MPS defines none; keep its result_image.stop_gradient True so that a training graph stops here\), got a request for its gradient filters",
    ):
        mse_loss(c2.result_image).training_graph()


def test_scale_node_errors() -> None:
    x = m.ImageNode()
    with pytest.raises(
        TypeError,
        match=r"\[ScaleNode\] ScaleNode is abstract: make a BilinearScaleNode or a LanczosScaleNode, got ScaleNode",
    ):
        m.ScaleNode(x, m.Size(2, 2))
    with pytest.raises(
        TypeError, match=r"\[LanczosScaleNode\] output_size must be a Size, got tuple"
    ):
        m.LanczosScaleNode(x, (2, 2))
    with pytest.raises(
        ValueError,
        match=r"\[BilinearScaleNode\] output_size must have a positive width and height, got 0x3",
    ):
        m.BilinearScaleNode(x, m.Size(0, 3))
    with pytest.raises(
        TypeError,
        match=r"\[BilinearScaleNode\] transform_provider must have a transform_for_source_image\(source_image, handle\) method \(an ImageTransformProvider\) or be None, got int",
    ):
        m.BilinearScaleNode(x, m.Size(2, 2), 5)
    node = m.BilinearScaleNode(x, m.Size(2, 2))
    with pytest.raises(
        ValueError,
        match=r"\[BilinearScaleNode\] a scale node has no gradient \(MPS defines none; keep its result_image.stop_gradient True so that a training graph stops here\), got a request for its gradient filters",
    ):
        node.gradient_filter(node.result_image)
    bad = m.LanczosScaleNode(x, m.Size(3, 3), Provider([(2.0, 2.0, 0.0, 0.0)]))
    graph = m.Graph(DEV, bad.result_image)
    with pytest.raises(
        TypeError,
        match=r"\[LanczosScaleNode\] the transform provider must return a ScaleTransform or None, got tuple",
    ):
        encode(graph, [torch.randn(1, 1, 4, 4)])
