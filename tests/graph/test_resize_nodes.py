"""Resize nodes in graphs: an inference graph against F.interpolate and the crop reference, and
a training graph that walks back through ResizeBilinearNode and CropAndResizeBilinearNode
(their gradient nodes) against float64 autograd, weights included."""

from __future__ import annotations

import pytest
import torch.nn.functional as F

import mpsnn as m
from tests.cnn.test_resize import crop_torch
from tests.graph._helpers import (
    DEV,
    F64,
    TOL,
    TorchConv,
    assert_close,
    conv_sandwich,
    encode,
    gen,
    mse_reference,
    rand,
    training_seen,
)

REGIONS = [(0.1, 0.05, 0.7, 0.8), (-0.2, 0.3, 1.1, 0.6)]


def test_inference_graph_of_resize_then_crop() -> None:
    g = gen(41)
    x = m.ImageNode("x")
    resized = m.ResizeBilinearNode(x, 9, 7, align_corners=True)
    crop = m.CropAndResizeBilinearNode(resized.result_image, 4, 5, 2, REGIONS)
    graph = m.Graph(DEV, crop.result_image)
    graph.format = F64
    xt = rand(g, 3, 2, 5, 6)
    out = encode(graph, [xt])
    ref = crop_torch(
        F.interpolate(xt, size=(7, 9), mode="bilinear", align_corners=True), REGIONS, 4, 5
    )
    assert out.tensor.shape == (3, 4, 5, 4)
    assert_close(out.tensor, ref, "resize then crop", TOL)
    assert (resized.resize_width, resized.resize_height, resized.align_corners) == (9, 7, True)
    assert crop.number_of_regions == 2 and crop.regions == tuple(REGIONS)


@pytest.mark.parametrize("align", [False, True])
def test_training_graph_walks_through_resize_and_crop(align) -> None:
    g = gen(42)

    def middle(h: m.ImageNode) -> m.ImageNode:
        resized = m.ResizeBilinearNode(h, 11, 8, align)
        return m.CropAndResizeBilinearNode(resized.result_image, 5, 6, 2, REGIONS).result_image

    _, (d1, d2), loss = conv_sandwich(g, (3, 3, 2, 3), middle, (3, 3, 6, 2))
    t1, t2 = TorchConv(d1), TorchConv(d2)
    graph, terminals, seen = training_seen(loss)
    assert "ResizeBilinearGradientNode" in seen and "CropAndResizeBilinearGradientNode" in seen
    assert [type(t).__name__ for t in terminals] == ["ConvolutionGradientNode"]

    xt, target = rand(g, 2, 2, 6, 7), rand(g, 2, 2, 6, 5)
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    xr = xt.clone().requires_grad_()
    h = F.interpolate(t1(xr), size=(8, 11), mode="bilinear", align_corners=align)
    mse_reference(t2(crop_torch(h, REGIONS, 5, 6)), target).backward()
    assert_close(out.tensor, xr.grad, "dL/dx through resize and crop", TOL)
    t1.check_step("conv before the resize")
    t2.check_step("conv after the crop")


def test_resize_node_errors() -> None:
    x = m.ImageNode()
    with pytest.raises(
        ValueError, match=r"\[ResizeBilinearNode\] resize_height must be positive, got 0"
    ):
        m.ResizeBilinearNode(x, 2, 0)
    with pytest.raises(
        TypeError, match=r"\[ResizeBilinearNode\] align_corners must be a bool, got str"
    ):
        m.ResizeBilinearNode(x, 2, 2, "yes")
    with pytest.raises(
        ValueError,
        match=r"\[CropAndResizeBilinearNode\] regions must hold number_of_regions \(1\) regions, got 2",
    ):
        m.CropAndResizeBilinearNode(x, 2, 2, 1, REGIONS)
    with pytest.raises(TypeError, match=r"\[ResizeBilinearNode\] source 0 must be an ImageNode"):
        m.ResizeBilinearNode("x", 2, 2)
