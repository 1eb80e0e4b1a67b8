"""`YOLOLossNode` in a Graph: its training graph (forward, YOLO loss, gradients, updates in one
``encode_batch``) against PyTorch autograd of the independent YOLO restatement, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.cnn._yolo_reference import Config, loss_image, random_labels
from tests.graph._helpers import (
    DEV,
    F64,
    TOL,
    TorchConv,
    assert_close,
    conv_ds,
    encode,
    gen,
    rand,
    sgd1,
    training,
)

ANCHORS = [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0)]


@pytest.mark.parametrize("per_image", [True, False])
def test_training_graph_matches_autograd(per_image) -> None:
    """conv 3x3 -> leaky ReLU -> conv 1x1 -> YOLO loss: the input gradient, both layers'
    weight and bias gradients (SGD, learning rate 1) and the loss in the labels."""
    g = gen(40)
    n, h, w, k = 2, 3, 4, 2
    cfg = Config(ANCHORS, reduction=m.ReductionType.SUM, scales=(10.0, 10.0, 2.5, 50.0, 2.0))
    d1, d2 = conv_ds(g, 3, 3, 3, 6, sgd1()), conv_ds(g, 1, 1, 6, 3 * (5 + k), sgd1())
    t1, t2 = TorchConv(d1), TorchConv(d2)
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, d1)
    r1 = m.NeuronReLUNode(c1.result_image, a=0.1)
    c2 = m.ConvolutionNode(r1.result_image, d2)
    node = m.YOLOLossNode(c2.result_image, cfg.descriptor())
    assert isinstance(node.input_labels, m.LabelsNode)
    assert node.source_states == [node.input_labels]
    graph, terminals = training(node)
    assert [type(t).__name__ for t in terminals] == ["ConvolutionGradientNode"]

    xt = rand(g, n, 3, h, w)
    labels = random_labels(n, ANCHORS, k, h, w, seed=41)
    if per_image:
        states = m.StateBatch(m.LossLabels(DEV, labels[i]) for i in range(n))
    else:
        states = m.LossLabels(DEV, labels, loss_image_size=m.Size(1, 1, 1))
    out = encode(graph, [xt], [states])

    xr = xt.clone().requires_grad_()
    y = t2.fc(F.leaky_relu(t1(xr), 0.1))
    ref = loss_image(y, labels, None, cfg)
    ref.sum().backward()
    assert out is not None and out.feature_channel_format is F64
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
    t1.check_step("conv 3x3")
    t2.check_step("conv 1x1")
    labs = list(states) if per_image else [states]
    got = torch.cat([lab.loss_image().tensor for lab in labs])
    assert_close(got, ref.detach(), "loss images", TOL)


def test_node_errors() -> None:
    x = m.ImageNode("x")
    with pytest.raises(TypeError, match=r"\[YOLOLossNode\] loss_descriptor must be a "
                       r"YOLOLossDescriptor, got LossDescriptor"):  # fmt: skip
        m.YOLOLossNode(x, m.LossDescriptor(m.LossType.HUBER, m.ReductionType.SUM))
    with pytest.raises(TypeError, match=r"\[YOLOLossNode\] source 0 must be an ImageNode"):
        m.YOLOLossNode(None, Config(ANCHORS).descriptor())  # type: ignore[arg-type]
    node = m.YOLOLossNode(x, Config(ANCHORS).descriptor())
    with pytest.raises(ValueError, match=r"\[YOLOLossNode\] a loss node has no gradient filter: "
                       r"its result image is the gradient"):  # fmt: skip
        node.gradient_filters([node.result_image])
    with pytest.raises(ValueError, match=r"\[training_graph\] the loss node's source must be "
                       r"made by a filter"):  # fmt: skip
        node.training_graph()
