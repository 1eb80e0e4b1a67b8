"""The automatic training graph against PyTorch autograd of the same network, in float64.

Each test builds a node recipe, asks the loss node for its training graph, runs one
``encode_batch`` (forward, loss, gradients, weight updates) and compares the graph's result
(the gradient with respect to the input) and every weight and bias gradient (read as the
change made by an SGD step of learning rate 1) with ``torch.autograd``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.graph._helpers import (
    DEV,
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
    mse_loss,
    mse_reference,
    rand,
    sgd1,
    training,
)


def _names(nodes: list[object]) -> list[str]:
    return [type(n).__name__ for n in nodes]


# -- a chain ------------------------------------------------------------------------------------


def test_chain_conv_relu_pool_fc_gradients_match_autograd() -> None:
    g = gen(1)
    n = 3
    d1, d2 = conv_ds(g, 3, 3, 2, 4, sgd1()), conv_ds(g, 4, 4, 4, 5, sgd1())
    t1, t2 = TorchConv(d1), TorchConv(d2)
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, d1)
    r1 = m.NeuronReLUNode(c1.result_image)
    p1 = m.PoolingMaxNode(r1.result_image, 2)
    fc = m.FullyConnectedNode(p1.result_image, d2)
    loss = ce_loss(fc.result_image, n)
    graph, terminals = training(loss)
    assert _names(terminals) == ["ConvolutionGradientNode"]
    text = graph.debug_description()
    assert "fused RELU" in text and "[_Fused]" in text, text
    assert "updates after the gradients: FullyConnectedNode, ConvolutionNode" in text, text

    xt = rand(g, n, 2, 8, 8)
    labels = torch.randint(0, 5, (n, 1, 1), generator=g)
    per_image = m.StateBatch(m.LossLabels(DEV, labels[i]) for i in range(n))
    out = encode(graph, [xt], [per_image])

    xr = xt.clone().requires_grad_()
    logits = t2.fc(F.max_pool2d(F.relu(t1(xr)), 2))
    ref = ce_reference(logits, labels)
    ref.backward()
    assert out is not None and out.feature_channel_format is F64
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
    t1.check_step("conv")
    t2.check_step("fully connected")
    loss_sum = sum(lab.loss_image().tensor.sum() for lab in per_image)
    assert abs(loss_sum.item() - ref.item()) < 1e-12


def test_chain_with_one_label_state_for_the_batch_matches_per_image_labels() -> None:
    def run(batched: bool) -> tuple[torch.Tensor, torch.Tensor]:
        g = gen(2)
        d1 = conv_ds(g, 3, 3, 1, 3, sgd1())
        x = m.ImageNode()
        c1 = m.ConvolutionNode(x, d1)
        fc = m.FullyConnectedNode(
            m.PoolingAverageNode(c1.result_image, 2).result_image, conv_ds(g, 3, 3, 3, 4, sgd1())
        )
        graph, _ = training(ce_loss(fc.result_image, 2))
        xt = rand(g, 2, 1, 6, 6)
        labels = torch.randint(0, 4, (2, 1, 1), generator=g)
        states = (
            m.LossLabels(DEV, labels)
            if batched
            else m.StateBatch([m.LossLabels(DEV, labels[0]), m.LossLabels(DEV, labels[1])])
        )
        out = encode(graph, [xt], [states])
        return out.tensor, d1.weights().clone()

    a, wa = run(True)
    b, wb = run(False)
    assert torch.equal(a, b) and torch.equal(wa, wb)


# -- images read by several filters ---------------------------------------------------------


def test_residual_block_sums_the_gradients_of_an_image_read_twice() -> None:
    g = gen(3)
    ds = [conv_ds(g, 3, 3, 3, 3, sgd1()) for _ in range(3)]
    ts = [TorchConv(d) for d in ds]
    x = m.ImageNode("x")
    h = m.ConvolutionNode(x, ds[0]).result_image
    a = m.NeuronReLUNode(m.ConvolutionNode(h, ds[1]).result_image).result_image
    y = m.AdditionNode(m.ConvolutionNode(a, ds[2]).result_image, h)
    seen: list[tuple[object, ...]] = []
    graph, terminals = training(mse_loss(y.result_image), handler=lambda *a: seen.append(a))
    assert _names(terminals) == ["ConvolutionGradientNode"]
    additions = [s for s in seen if isinstance(s[0], m.AdditionNode)]
    assert len(additions) == 1 and additions[0][1:] == (None, None, None)

    xt, target = rand(g, 2, 3, 7, 7), rand(g, 2, 3, 7, 7)
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    xr = xt.clone().requires_grad_()
    hr = ts[0](xr)
    ref = mse_reference(ts[2](F.relu(ts[1](hr))) + hr, target)
    ref.backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
    for i, t in enumerate(ts):
        t.check_step(f"conv {i}")


def test_graph_input_read_by_two_filters_gets_the_summed_gradient() -> None:
    g = gen(4)
    da, db = conv_ds(g, 3, 3, 2, 3, sgd1()), conv_ds(g, 1, 1, 2, 3, sgd1())
    ta, tb = TorchConv(da), TorchConv(db)
    x = m.ImageNode("x")
    y = m.SubtractionNode(
        m.ConvolutionNode(x, da).result_image, m.ConvolutionNode(x, db).result_image
    )
    graph, terminals = training(mse_loss(y.result_image, 0.25))
    assert _names(terminals) == ["AdditionNode"]  # the two input gradients, summed last
    xt, target = rand(g, 2, 2, 6, 5), rand(g, 2, 3, 6, 5)
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    xr = xt.clone().requires_grad_()
    mse_reference(ta(xr) - tb(xr), target, 0.25).backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
    ta.check_step("primary")
    tb.check_step("secondary")


def test_concatenation_of_two_branches() -> None:
    g = gen(5)
    da, db = conv_ds(g, 3, 3, 2, 2, sgd1()), conv_ds(g, 1, 1, 2, 3, sgd1())
    dc = conv_ds(g, 3, 3, 5, 4, sgd1())
    ta, tb, tc = TorchConv(da), TorchConv(db), TorchConv(dc)
    x = m.ImageNode("x")
    a = m.NeuronTanHNode(m.ConvolutionNode(x, da).result_image, 1.0, 1.0).result_image
    b = m.ConvolutionNode(x, db).result_image
    cat = m.ConcatenationNode([a, b])
    out_node = m.ConvolutionNode(cat.result_image, dc)
    seen: list[str] = []
    graph, _ = training(
        mse_loss(out_node.result_image), handler=lambda gn, *r: seen.append(_names([gn])[0])
    )
    assert seen.count("ConcatenationGradientNode") == 2

    xt, target = rand(g, 3, 2, 6, 6), rand(g, 3, 4, 6, 6)
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    xr = xt.clone().requires_grad_()
    mse_reference(tc(torch.cat([torch.tanh(ta(xr)), tb(xr)], 1)), target).backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
    for name, t in (("a", ta), ("b", tb), ("c", tc)):
        t.check_step(name)


def _arithmetic_case(node_class: type, op, seed: int) -> None:
    g = gen(seed)
    da, db = conv_ds(g, 3, 3, 2, 3, sgd1()), conv_ds(g, 3, 3, 2, 3, sgd1())
    ta, tb = TorchConv(da), TorchConv(db)
    x = m.ImageNode("x")
    a = m.ConvolutionNode(x, da).result_image
    b = m.NeuronSoftPlusNode(m.ConvolutionNode(x, db).result_image, 1.0, 1.0).result_image
    y = node_class(a, b)
    seen: list[object] = []
    graph, _ = training(mse_loss(y.result_image), handler=lambda gn, *r: seen.append(gn))
    arith = [s for s in seen if isinstance(s, m.ArithmeticGradientNode)]
    assert sorted(s.is_secondary_source_filter for s in arith) == [False, True]

    xt, target = rand(g, 2, 2, 5, 6), rand(g, 2, 3, 5, 6)
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    xr = xt.clone().requires_grad_()
    mse_reference(op(ta(xr), F.softplus(tb(xr))), target).backward()
    assert_close(out.tensor, xr.grad, f"{node_class.__name__} dL/dx", TOL)
    ta.check_step(f"{node_class.__name__} primary")
    tb.check_step(f"{node_class.__name__} secondary")


def test_multiplication_gradients_of_both_inputs() -> None:
    _arithmetic_case(m.MultiplicationNode, torch.mul, 6)


def test_subtraction_gradients_of_both_inputs() -> None:
    _arithmetic_case(m.SubtractionNode, torch.sub, 7)


def test_division_gradients_of_both_inputs() -> None:
    _arithmetic_case(m.DivisionNode, torch.div, 8)


@pytest.mark.parametrize(
    ("node_class", "op"),
    [(m.MultiplicationNode, lambda h: h * h), (m.AdditionNode, lambda h: h + h)],
    ids=["h_times_h", "h_plus_h"],
)
def test_arithmetic_of_an_image_with_itself(node_class: type, op) -> None:
    g = gen(15)
    d1 = conv_ds(g, 3, 3, 2, 3, sgd1())
    t1 = TorchConv(d1)
    h = m.ConvolutionNode(m.ImageNode("x"), d1).result_image
    graph, _ = training(mse_loss(node_class(h, h).result_image))
    xt, target = rand(g, 2, 2, 5, 5), rand(g, 2, 3, 5, 5)
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    xr = xt.clone().requires_grad_()
    mse_reference(op(t1(xr)), target).backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
    t1.check_step("conv")


def test_concatenation_with_the_graph_input() -> None:
    g = gen(16)
    d1, d2 = conv_ds(g, 3, 3, 2, 3, sgd1()), conv_ds(g, 3, 3, 5, 2, sgd1())
    t1, t2 = TorchConv(d1), TorchConv(d2)
    x = m.ImageNode("x")
    cat = m.ConcatenationNode([x, m.ConvolutionNode(x, d1).result_image])
    graph, terminals = training(mse_loss(m.ConvolutionNode(cat.result_image, d2).result_image))
    assert _names(terminals) == ["AdditionNode"]
    xt, target = rand(g, 2, 2, 5, 5), rand(g, 2, 2, 5, 5)
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    xr = xt.clone().requires_grad_()
    mse_reference(t2(torch.cat([xr, t1(xr)], 1)), target).backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
    t1.check_step("conv")
    t2.check_step("conv after the concatenation")


@pytest.mark.parametrize(
    ("node_class", "op"),
    [(m.SoftMaxNode, lambda a: F.softmax(a, 1)), (m.LogSoftMaxNode, lambda a: F.log_softmax(a, 1))],
    ids=["softmax", "log_softmax"],
)
def test_gradients_that_read_the_forward_result(node_class: type, op) -> None:
    g = gen(17)
    d1, d2 = conv_ds(g, 3, 3, 2, 3, sgd1()), conv_ds(g, 1, 1, 3, 3, sgd1())
    t1, t2 = TorchConv(d1), TorchConv(d2)
    soft = node_class(m.ConvolutionNode(m.ImageNode("x"), d1).result_image)
    graph, _ = training(mse_loss(m.ConvolutionNode(soft.result_image, d2).result_image))
    xt, target = rand(g, 2, 2, 5, 5), rand(g, 2, 3, 5, 5)
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    xr = xt.clone().requires_grad_()
    mse_reference(t2(op(t1(xr))), target).backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
    t1.check_step("conv")
    t2.check_step("conv after softmax")


# -- the node handler --------------------------------------------------------------------------


def test_node_handler_sees_every_gradient_node_with_its_arguments() -> None:
    g = gen(9)
    x = m.ImageNode("x")
    c0 = m.ConvolutionNode(x, conv_ds(g, 3, 3, 2, 3))
    h = c0.result_image
    c1 = m.ConvolutionNode(h, conv_ds(g, 3, 3, 3, 3))
    r1 = m.NeuronReLUNode(c1.result_image)
    add = m.AdditionNode(r1.result_image, h)
    pool = m.PoolingMaxNode(add.result_image, 2)
    fc = m.FullyConnectedNode(pool.result_image, conv_ds(g, 3, 3, 3, 4))
    loss = ce_loss(fc.result_image, 2)
    calls: list[tuple[object, ...]] = []
    terminals = loss.training_graph(None, lambda *a: calls.append(a))
    assert _names([c[0] for c in calls]) == [
        "FullyConnectedGradientNode",
        "PoolingMaxGradientNode",
        "ArithmeticGradientNode",
        "ArithmeticGradientNode",
        "NeuronGradientNode",
        "ConvolutionGradientNode",
        "AdditionNode",
        "ConvolutionGradientNode",
    ]
    assert _names(terminals) == ["ConvolutionGradientNode"]
    assert terminals[0] is calls[-1][0] and terminals[0].inference_node is c0
    forward_of = {
        "FullyConnectedGradientNode": fc,
        "PoolingMaxGradientNode": pool,
        "ArithmeticGradientNode": add,
        "NeuronGradientNode": r1,
    }
    for gnode, fnode, source, gsource in calls:
        if isinstance(gnode, m.AdditionNode):
            assert (fnode, source, gsource) == (None, None, None)
            assert gnode.source_images[0]._producer is not None  # two computed gradients
            continue
        assert gnode.inference_node is fnode
        assert gsource is gnode.source_images[0]  # the incoming gradient
        assert source in fnode.source_images  # the input this node differentiates
        name = type(gnode).__name__
        if name in forward_of:
            assert fnode is forward_of[name]
    arith = [c for c in calls if isinstance(c[0], m.ArithmeticGradientNode)]
    assert {id(c[2]) for c in arith} == {id(r1.result_image), id(h)}
    assert calls[0][3] is loss.result_image


def test_node_handler_changing_result_formats_takes_effect() -> None:
    def build(handler):
        g = gen(10)
        x = m.ImageNode("x")
        c1 = m.ConvolutionNode(x, conv_ds(g, 3, 3, 2, 3))
        c2 = m.ConvolutionNode(
            m.NeuronSigmoidNode(c1.result_image).result_image, conv_ds(g, 3, 3, 3, 2)
        )
        graph, _ = training(mse_loss(c2.result_image), handler=handler)
        xt, target = rand(g, 2, 2, 5, 5), rand(g, 2, 2, 5, 5)
        return encode(graph, [xt], [m.LossLabels(DEV, target)])

    def to_f32(gnode, *rest):
        gnode.result_image.format = F32

    ref = build(None)
    low = build(to_f32)
    assert ref.feature_channel_format is F64 and ref.tensor.dtype == torch.float64
    assert low.feature_channel_format is F32 and low.tensor.dtype == torch.float32
    assert not torch.equal(low.tensor.double(), ref.tensor)  # rounded along the way
    assert_close(low.tensor, ref.tensor, "float32 gradients", 1e-5)


# -- frozen layers and stop_gradient -----------------------------------------------------------


def test_frozen_layer_keeps_its_weights_and_passes_the_gradient_on() -> None:
    g = gen(11)
    d1, d2, d3 = (
        conv_ds(g, 3, 3, 2, 3, sgd1()),
        conv_ds(g, 3, 3, 3, 3, sgd1()),
        conv_ds(g, 3, 3, 3, 4, sgd1()),
    )
    t1, t2, t3 = TorchConv(d1), TorchConv(d2, requires_grad=False), TorchConv(d3)
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, d1)
    c2 = m.ConvolutionNode(m.NeuronReLUNode(c1.result_image).result_image, d2)
    c2.trainable = False
    fc = m.FullyConnectedNode(m.PoolingAverageNode(c2.result_image, 2).result_image, d3)
    graph, _ = training(ce_loss(fc.result_image, 2))
    assert "updates after the gradients: FullyConnectedNode, ConvolutionNode\n" in (
        graph.debug_description() + "\n"
    )
    xt = rand(g, 2, 2, 6, 6)
    labels = torch.randint(0, 4, (2, 1, 1), generator=g)
    out = encode(graph, [xt], [m.LossLabels(DEV, labels)])
    xr = xt.clone().requires_grad_()
    ce_reference(t3.fc(F.avg_pool2d(t2(F.relu(t1(xr))), 2)), labels).backward()
    assert_close(out.tensor, xr.grad, "dL/dx below a frozen layer", TOL)
    t2.check_unchanged("frozen layer")
    t1.check_step("conv below the frozen layer")
    t3.check_step("fully connected")


def test_stop_gradient_ends_the_walk() -> None:
    g = gen(12)
    d1, d2, d3 = (
        conv_ds(g, 3, 3, 2, 3, sgd1()),
        conv_ds(g, 3, 3, 3, 3, sgd1()),
        conv_ds(g, 3, 3, 3, 4, sgd1()),
    )
    t1, t2, t3 = TorchConv(d1), TorchConv(d2), TorchConv(d3)
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, d1)
    r1 = m.NeuronReLUNode(c1.result_image)
    r1.result_image.stop_gradient = True
    c2 = m.ConvolutionNode(r1.result_image, d2)
    fc = m.FullyConnectedNode(m.PoolingMaxNode(c2.result_image, 2).result_image, d3)
    seen: list[object] = []
    graph, terminals = training(
        ce_loss(fc.result_image, 2), handler=lambda gn, fn, *r: seen.append(fn)
    )
    assert all(fn is not r1 and fn is not c1 for fn in seen)
    assert len(seen) == 3 and terminals[0].inference_node is c2
    assert graph.source_image_handles == ["x"]

    xt = rand(g, 2, 2, 6, 6)
    labels = torch.randint(0, 4, (2, 1, 1), generator=g)
    out = encode(graph, [xt], [m.LossLabels(DEV, labels)])
    hr = F.relu(t1(xt)).detach().requires_grad_()
    ce_reference(t3.fc(F.max_pool2d(t2(hr), 2)), labels).backward()
    assert_close(out.tensor, hr.grad, "gradient at the stopped image", TOL)
    t1.check_unchanged("conv above stop_gradient")
    t2.check_step("conv below stop_gradient")
    t3.check_step("fully connected")


# -- storage formats ------------------------------------------------------------------------------


def test_unorm8_source_image_trains_like_bytes_over_255() -> None:
    g = gen(13)
    d1, d2 = conv_ds(g, 3, 3, 3, 4, sgd1()), conv_ds(g, 3, 3, 4, 5, sgd1())
    t1, t2 = TorchConv(d1), TorchConv(d2)
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, d1)
    fc = m.FullyConnectedNode(
        m.PoolingMaxNode(m.NeuronReLUNode(c1.result_image).result_image, 2).result_image, d2
    )
    graph, _ = training(ce_loss(fc.result_image, 2))
    k = torch.randint(0, 256, (2, 3, 6, 6), generator=g, dtype=torch.uint8)
    labels = torch.randint(0, 5, (2, 1, 1), generator=g)
    batch = m.ImageBatch.from_tensor(k)
    assert batch.feature_channel_format is m.FeatureChannelFormat.UNORM8
    cb = DEV.new_command_queue().command_buffer()
    out = graph.encode_batch(cb, [batch], [m.LossLabels(DEV, labels)])
    cb.commit()
    cb.wait_until_completed()
    xr = (k.double() / 255).requires_grad_()
    ce_reference(t2.fc(F.max_pool2d(F.relu(t1(xr)), 2)), labels).backward()
    assert out.feature_channel_format is F64  # the graph's format, not the source's
    # kernels read UNORM8 as k/255 in the dtype they compute in: the wider of the source's
    # (float32 for UNORM8) and the destination's, float64 in this float64 graph
    assert_close(out.tensor, xr.grad, "dL/dx of a UNORM8 source", TOL)
    t1.check_step("conv reading UNORM8", tol=TOL)
    t2.check_step("fully connected", tol=TOL)
    # against a float64 source of the same values: the same numbers
    g2 = gen(13)
    d1b, d2b = conv_ds(g2, 3, 3, 3, 4, sgd1()), conv_ds(g2, 3, 3, 4, 5, sgd1())
    x2 = m.ImageNode("x")
    c1b = m.ConvolutionNode(x2, d1b)
    p1b = m.PoolingMaxNode(m.NeuronReLUNode(c1b.result_image).result_image, 2)
    graph2, _ = training(ce_loss(m.FullyConnectedNode(p1b.result_image, d2b).result_image, 2))
    out2 = encode(graph2, [k.double() / 255], [m.LossLabels(DEV, labels)])
    assert torch.equal(out.tensor, out2.tensor)
    assert torch.equal(d1.weights(), d1b.weights()) and torch.equal(d2.weights(), d2b.weights())


def test_float16_intermediates_train() -> None:
    g = gen(14)
    opt = m.Adam(DEV, descriptor=m.OptimizerDescriptor(learning_rate=0.02))
    d1 = conv_ds(g, 3, 3, 2, 6, opt, dtype=torch.float32)
    d2 = conv_ds(g, 3, 3, 6, 4, opt, dtype=torch.float32)
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, d1)
    fc = m.FullyConnectedNode(
        m.PoolingMaxNode(m.NeuronReLUNode(c1.result_image).result_image, 2).result_image, d2
    )
    graph, _ = training(
        ce_loss(fc.result_image, 8), needed=False, fmt=m.FeatureChannelFormat.FLOAT16
    )
    xt = torch.randn(8, 2, 6, 6, generator=g)
    labels = torch.randint(0, 4, (8, 1, 1), generator=g)
    losses = []
    for _ in range(20):
        lab = m.LossLabels(DEV, labels)
        cb = DEV.new_command_queue().command_buffer()
        assert graph.encode_batch(cb, [m.ImageBatch.from_tensor(xt)], [lab]) is None
        cb.commit()
        cb.wait_until_completed()
        losses.append(lab.loss_image().tensor.double().sum().item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.5 * losses[0], losses
    assert d1.weights().dtype == torch.float32  # master weights stay float32
