"""Where two gradients of one image meet the plain ReLU that made it (a residual block's input
in the backward), the automatic training graph's sum of the two runs the ReLU's gradient in
its own command: one pass instead of two. The values are those of the unfused plan bit for
bit (the sum rounded to the graph's format, then the mask), and match PyTorch autograd in
float64; another reader of the sum, an export, or a ReLU that is not plain keeps them apart."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from mpsnn.graph.plan import _PassGradient
from tests.graph._helpers import (
    DEV,
    F32,
    F64,
    TOL,
    TorchConv,
    assert_close,
    conv_ds,
    encode,
    gen,
    gradient_fusion,
    mse_loss,
    mse_reference,
    rand,
    same_bytes,
    sgd1,
    training,
)

BF16 = m.FeatureChannelFormat.BFLOAT16


def _net(g: torch.Generator, optimizer=sgd1, leaky: float = 0.0, export: bool = False):
    """Two residual tails: ``y1 = relu(conv1(x) + x)``, ``y2 = relu(conv2(y1) + y1)``. The
    gradient of ``y1`` is the sum of conv2's data gradient and the addition's, and ``y1``'s
    ReLU (fused into the first addition) differentiates it from its result."""
    d1, d2 = conv_ds(g, 3, 3, 3, 3, optimizer()), conv_ds(g, 3, 3, 3, 3, optimizer())
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, d1)
    y1 = m.NeuronReLUNode(m.AdditionNode(c1.result_image, x).result_image, a=leaky)
    c2 = m.ConvolutionNode(y1.result_image, d2)
    y2 = m.NeuronReLUNode(m.AdditionNode(c2.result_image, y1.result_image).result_image)
    loss = mse_loss(y2.result_image)
    seen: list = []

    def handler(gnode, forward, source, gradient):
        seen.append(gnode)
        if export and forward is None:  # the inserted sum: its result kept for the caller
            gnode.result_image.export_from_graph = True

    return loss, (d1, d2), handler, seen


def _sums(graph: m.Graph) -> dict:
    return dict(graph._plan.fusion.sum_gradients)


def test_the_sum_runs_the_relu_gradient_and_matches_autograd() -> None:
    g = gen(81)
    loss, (d1, d2), handler, seen = _net(g)
    graph, _ = training(loss, handler=handler)
    sums = _sums(graph)
    assert len(sums) == 1
    ((add_id, relu_grad),) = sums.items()
    (add,) = [n for n in graph._plan.topology.order if n._id == add_id]
    assert type(add) is m.AdditionNode and add in seen  # the sum the walk inserted
    listing = graph.debug_description()
    assert any(
        "AdditionNode" in line and "applies the ReLU gradient" in line
        for line in listing.splitlines()
    ), listing
    assert type(relu_grad).__name__ == "NeuronGradientNode" and relu_grad in seen
    assert isinstance(graph._plan.kernels[relu_grad._id], _PassGradient)
    xt, target = rand(g, 2, 3, 5, 6), rand(g, 2, 3, 5, 6)
    t1, t2 = TorchConv(d1), TorchConv(d2)
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    xr = xt.clone().requires_grad_()
    r1 = F.relu(t1(xr) + xr)
    mse_reference(F.relu(t2(r1) + r1), target).backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
    t1.check_step("first convolution (below the fused gradient)")
    t2.check_step("second convolution")


def _steps(fused: bool, fmt, steps: int = 3):
    with gradient_fusion(fused):
        g = gen(82)
        loss, ds, handler, _ = _net(g, lambda: m.Adam(DEV))
        graph, _ = training(loss, fmt=fmt, handler=handler)
    data = gen(83)
    dx = None
    for _ in range(steps):
        xt, target = rand(data, 2, 3, 5, 6), rand(data, 2, 3, 5, 6)
        dx = encode(graph, [xt], [m.LossLabels(DEV, target)])
    return graph, [t for d in ds for t in (d.weights(), d.bias_terms())], dx.tensor


@pytest.mark.parametrize("fmt", [F64, F32, BF16], ids=["f64", "f32", "bf16"])
def test_fused_and_unfused_steps_give_the_same_bits(fmt) -> None:
    fused, w_fused, dx_fused = _steps(True, fmt)
    plain, w_plain, dx_plain = _steps(False, fmt)
    assert len(_sums(fused)) == 1 and not _sums(plain)
    assert same_bytes(dx_fused, dx_plain)
    for a, b in zip(w_fused, w_plain, strict=True):
        assert same_bytes(a, b)


def test_an_exported_sum_or_a_leaky_relu_is_not_fused() -> None:
    loss, _, handler, _ = _net(gen(84), export=True)
    graph, _ = training(loss, handler=handler)
    assert not _sums(graph)
    loss, _, handler, _ = _net(gen(85), leaky=0.1)
    graph, _ = training(loss, handler=handler)
    assert not _sums(graph)


def test_a_sum_node_that_runs_its_kernel_otherwise_is_not_fused() -> None:
    """The training graph's sum made by an `AdditionNode` subclass with its own ``_run``: the
    plan keeps the ReLU gradient apart (the mask is applied by the library's run only), and
    the gradients still match autograd."""
    from mpsnn.graph import nodes as node_base

    class LoggedAddition(m.AdditionNode):
        runs = 0

        def _run(self, step, kernel) -> None:
            LoggedAddition.runs += 1
            super()._run(step, kernel)

    saved = list(node_base._GRADIENT_SUM)
    node_base.register_gradient_sum(LoggedAddition)
    try:
        g = gen(86)
        loss, (d1, d2), handler, _ = _net(g)
        graph, _ = training(loss, handler=handler)
    finally:
        node_base._GRADIENT_SUM[:] = saved
    assert not _sums(graph)
    xt, target = rand(g, 2, 3, 5, 6), rand(g, 2, 3, 5, 6)
    t1, t2 = TorchConv(d1), TorchConv(d2)
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    assert LoggedAddition.runs == 2  # the gradients of y1 and of the input x
    xr = xt.clone().requires_grad_()
    r1 = F.relu(t1(xr) + xr)
    mse_reference(F.relu(t2(r1) + r1), target).backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
