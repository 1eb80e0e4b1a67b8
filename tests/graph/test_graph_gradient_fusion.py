"""A plain ReLU fused into a convolution or fully connected layer has its gradient fused too:
the ReLU's gradient runs inside the layer's gradient command, and its node passes the incoming
gradient on. The values are those of the unfused plan bit for bit (the same mask product on
the same elements), and match PyTorch autograd in float64; the node handler still sees every
gradient node; what another reader, a format of its own or an export needs keeps the
gradient apart."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.graph._helpers import (
    DEV,
    F16,
    F32,
    F64,
    TOL,
    TorchConv,
    assert_close,
    ce_loss,
    ce_reference,
    conv_ds,
    encode,
    gen,
    gradient_fusion,
    rand,
    same_bytes,
    sgd1,
    training,
)


def _net(g: torch.Generator, optimizer=sgd1, leaky: float = 0.0):
    """conv 3x3 + ReLU, conv 3x3 + ReLU, fully connected + ReLU, fully connected: the first
    ReLU reads the convolution's pre-activation (the graph input is not in the graph's format
    rule), the others their results."""
    ds = [
        conv_ds(g, 3, 3, 2, 4, optimizer()),
        conv_ds(g, 3, 3, 4, 3, optimizer()),
        conv_ds(g, 4, 5, 3, 6, optimizer()),
        conv_ds(g, 1, 1, 6, 5, optimizer()),
    ]
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, ds[0])
    r1 = m.NeuronReLUNode(c1.result_image, a=leaky)
    c2 = m.ConvolutionNode(r1.result_image, ds[1])
    r2 = m.NeuronReLUNode(c2.result_image)
    f1 = m.FullyConnectedNode(r2.result_image, ds[2])
    r3 = m.NeuronReLUNode(f1.result_image)
    f2 = m.FullyConnectedNode(r3.result_image, ds[3])
    return ce_loss(f2.result_image, 3), ds, [r1, r2, r3]


def _steps(fused: bool, fmt, steps: int = 3, leaky: float = 0.0, handler=None):
    """Weights after ``steps`` Adam steps and the last input gradient, with the gradient
    fusion on or off; and the graph."""
    with gradient_fusion(fused):
        g = gen(501)
        loss, ds, relus = _net(g, lambda: m.Adam(DEV), leaky)
        graph, _ = training(loss, fmt=fmt, handler=handler)
    data = gen(502)
    dx = None
    for _ in range(steps):
        x = rand(data, 3, 2, 5, 4)
        labels = torch.randint(0, 5, (3, 1, 1), generator=data)
        dx = encode(graph, [x], [m.LossLabels(DEV, labels)])
    weights = [t for d in ds for t in (d.weights(), d.bias_terms())]
    return graph, weights, dx.tensor, relus


@pytest.mark.parametrize("fmt", [F32, F16, F64], ids=["float32", "float16", "float64"])
def test_fused_relu_gradients_give_the_unfused_bits(fmt) -> None:
    fused, w_fused, dx_fused, _ = _steps(True, fmt)
    unfused, w_plain, dx_plain, _ = _steps(False, fmt)
    # every ReLU gradient fused in one plan, none in the other
    assert len(fused._plan.pre_gradient) == 3 and not unfused._plan.pre_gradient
    text = fused.debug_description()
    assert text.count("[_PassGradient]") == 3 and "_PassGradient" not in unfused.debug_description()
    for a, b in zip(w_fused, w_plain, strict=True):
        assert same_bytes(a, b)
    assert same_bytes(dx_fused, dx_plain)


def test_fused_relu_gradients_match_autograd_in_float64() -> None:
    g = gen(503)
    loss, ds, _ = _net(g)
    graph, _ = training(loss)
    assert len(graph._plan.pre_gradient) == 3
    convs = [TorchConv(d) for d in ds]
    x = rand(g, 3, 2, 5, 4)
    labels = torch.randint(0, 5, (3, 1, 1), generator=g)
    dx = encode(graph, [x], [m.LossLabels(DEV, labels)])
    xr = x.clone().requires_grad_()
    h = F.relu(convs[0](xr))
    h = F.relu(convs[1](h))
    h = F.relu(convs[2].fc(h))
    ce_reference(convs[3].fc(h), labels).backward()
    assert_close(dx.tensor, xr.grad, "dL/dx", TOL)
    for i, c in enumerate(convs):
        c.check_step(f"layer {i}")


def test_the_node_handler_sees_every_gradient_node_and_a_format_keeps_one_apart() -> None:
    seen: list[str] = []

    def handler(gnode, inference, source, gradient_source) -> None:
        seen.append(type(gnode).__name__)
        if isinstance(inference, m.NeuronReLUNode) and len(seen) == 2:
            gnode.result_image.format = F32  # the last fully connected ReLU's gradient

    graph, *_ = _steps(True, F64, steps=1, handler=handler)
    assert seen.count("NeuronGradientNode") == 3
    # the gradient with a format of its own runs as its own kernel; the other two are fused
    assert len(graph._plan.pre_gradient) == 2
    assert graph.debug_description().count("[_PassGradient]") == 2


def test_an_exported_or_leaky_relu_gradient_is_not_fused() -> None:
    g = gen(504)
    loss, _, relus = _net(g)
    relu_grads = []  # the ReLUs' gradient nodes, as the node handler sees them
    terminals = loss.training_graph(
        None, lambda gnode, inference, *_: relu_grads.append(gnode) if inference in relus else None
    )
    assert len(relu_grads) == 3
    relu_grads[0].result_image.export_from_graph = True
    graph = m.Graph(DEV, terminals[0].result_image)
    graph.format = F64
    assert len(graph._plan.pre_gradient) == 2
    # a leaky ReLU (a != 0) is not the plain ReLU: its gradient stays a kernel of its own
    leaky, *_ = _steps(True, F64, steps=1, leaky=0.1)
    assert len(leaky._plan.pre_gradient) == 2


def test_an_incoming_gradient_of_another_format_keeps_the_relu_gradient_apart() -> None:
    """The layer gradient would read the incoming gradient in its own format, where the
    ReLU's gradient rounds it to the graph's: not fused, and the same bits as unfused."""

    def wide(gnode, inference, source, gradient_source) -> None:
        if not isinstance(inference, m.NeuronReLUNode):  # the layers' data gradients
            gnode.result_image.format = F32

    fused, w_fused, dx_fused, _ = _steps(True, F16, steps=2, handler=wide)
    _, w_plain, dx_plain, _ = _steps(False, F16, steps=2, handler=wide)
    assert not fused._plan.pre_gradient
    for a, b in zip(w_fused, w_plain, strict=True):
        assert same_bytes(a, b)
    assert same_bytes(dx_fused, dx_plain)
