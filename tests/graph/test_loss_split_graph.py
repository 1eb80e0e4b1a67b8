"""Training graphs that start from an initial gradient (`InitialGradientNode`) through forward
loss nodes, as MPS 13 clients build them, against PyTorch autograd of the same network in
float64: several losses summed, labels made by the network, weights and the batch reduction,
the loss callback, and the errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.cnn._loss_reference import loss_image
from tests.graph._helpers import (
    DEV,
    F64,
    TOL,
    TorchConv,
    assert_close,
    conv_ds,
    gen,
    new_cb,
    rand,
    sgd1,
)

LT, RT = m.LossType, m.ReductionType


def _graph(start: m.InitialGradientNode, handler=None) -> tuple[m.Graph, list]:
    terminals = start.training_graph(None, handler)
    graph = m.Graph.from_results(DEV, [t.result_image for t in terminals])
    graph.format = F64
    return graph, terminals


def _encode(graph: m.Graph, inputs: dict[str, torch.Tensor]) -> m.ImageBatch | None:
    cb = new_cb()
    batches = [m.ImageBatch.from_tensor(inputs[h]) for h in graph.source_image_handles]
    out = graph.encode_batch(cb, batches)
    cb.commit()
    cb.wait_until_completed()
    return out


def test_two_losses_sharing_layers_train_like_autograd() -> None:
    """x -> conv+relu (shared) -> conv -> MSE (MEAN) and -> pool -> fc -> softmax CE (SUM,
    1/n): the losses' images added, then the initial gradient. The shared layer's gradients
    are the sums of both losses'; one step of SGD (learning rate 1) moves every weight by its
    autograd gradient, and the exported total is the two losses' sum per image."""
    g, n = gen(5), 3
    d1, d2 = conv_ds(g, 3, 3, 2, 4, sgd1()), conv_ds(g, 3, 3, 4, 3, sgd1())
    d3 = conv_ds(g, 4, 4, 4, 5, sgd1())
    t1, t2, t3 = TorchConv(d1), TorchConv(d2), TorchConv(d3)
    x, la, lb = m.ImageNode("x"), m.ImageNode("la"), m.ImageNode("lb")
    h = m.NeuronReLUNode(m.ConvolutionNode(x, d1).result_image).result_image
    a = m.ConvolutionNode(h, d2).result_image
    b = m.FullyConnectedNode(m.PoolingMaxNode(h, 2).result_image, d3).result_image
    mse = m.LossDescriptor(LT.MEAN_SQUARED_ERROR, RT.MEAN, weight=0.5)
    ce = m.LossDescriptor(LT.SOFTMAX_CROSS_ENTROPY, RT.SUM, weight=1 / n)
    loss_a, loss_b = m.ForwardLossNode(a, la, mse), m.ForwardLossNode(b, lb, ce)
    total = m.AdditionNode(loss_a.result_image, loss_b.result_image)
    total.result_image.export_from_graph = True
    seen: list[tuple] = []
    graph, terminals = _graph(m.InitialGradientNode(total.result_image), lambda *s: seen.append(s))
    assert [type(t).__name__ for t in terminals] == ["ConvolutionGradientNode"]
    losses = [s for s in seen if isinstance(s[0], m.LossGradientNode)]
    assert [s[1] for s in losses] == [loss_b, loss_a]  # backward order
    assert all(not s[0].is_labels_gradient_filter for s in losses)
    assert sum(isinstance(s[0], m.AdditionNode) for s in seen) == 1  # at the shared layer
    assert graph.source_image_handles == ["x", "la", "lb"]

    xt, at = rand(g, n, 2, 8, 8), rand(g, n, 3, 8, 8)
    classes = torch.randint(0, 5, (n,), generator=g)
    bt = F.one_hot(classes, 5).double().view(n, 5, 1, 1)
    out = _encode(graph, {"x": xt, "la": at, "lb": bt})

    xr = xt.clone().requires_grad_()
    hr = F.relu(t1(xr))
    per_a = 0.5 * ((t2(hr) - at) ** 2).mean((1, 2, 3))
    per_b = F.cross_entropy(t3.fc(F.max_pool2d(hr, 2)).view(n, 5), classes, reduction="none") / n
    (per_a + per_b).sum().backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
    t1.check_step("shared conv")
    t2.check_step("conv of loss a")
    t3.check_step("fc of loss b")
    exported = graph.intermediate_images[-1]
    assert_close(exported.tensor.view(-1), (per_a + per_b).detach(), "total loss", TOL)


def _chain(split: bool, steps: int = 2) -> tuple[list[torch.Tensor], torch.Tensor]:
    g = gen(7)
    ds = conv_ds(g, 3, 3, 2, 3, sgd1())
    x = m.ImageNode("x")
    y = m.ConvolutionNode(x, ds).result_image
    desc = m.LossDescriptor(LT.HUBER, RT.SUM, weight=0.25, delta=0.5)
    if split:
        loss = m.ForwardLossNode(y, m.ImageNode("t"), desc)
        graph, _ = _graph(m.InitialGradientNode(loss.result_image))
    else:
        terminals = m.LossNode(y, desc).training_graph()
        graph = m.Graph(DEV, terminals[0].result_image)
        graph.format = F64
    outs = []
    for _ in range(steps):
        xt, tt = rand(g, 2, 2, 5, 5), rand(g, 2, 3, 5, 5)
        cb = new_cb()
        if split:
            out = graph.encode_batch(cb, [m.ImageBatch.from_tensor(v) for v in (xt, tt)])
        else:
            out = graph.encode_batch(cb, [m.ImageBatch.from_tensor(xt)], [m.LossLabels(DEV, tt)])
        cb.commit()
        cb.wait_until_completed()
        outs.append(out.tensor.clone())
    return outs, ds.weights().clone()


def test_initial_gradient_of_one_forward_loss_equals_the_fused_loss_node() -> None:
    """A forward loss and its initial gradient train exactly as the fused `LossNode` (two
    steps: the second runs the recorded step)."""
    split, w_split = _chain(True)
    fused, w_fused = _chain(False)
    for a, b in zip(split, fused, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(w_split, w_fused)


def test_labels_made_by_a_filter_get_their_gradient() -> None:
    """Labels computed by a convolution of a second input: the walk adds the labels'
    gradient node (``is_labels_gradient_filter``) and trains that convolution too."""
    g, n = gen(9), 2
    dp, dl = conv_ds(g, 3, 3, 2, 3, sgd1()), conv_ds(g, 1, 1, 2, 3, sgd1())
    tp, tl = TorchConv(dp), TorchConv(dl)
    x, z = m.ImageNode("x"), m.ImageNode("z")
    pred = m.ConvolutionNode(x, dp).result_image
    labels = m.ConvolutionNode(z, dl).result_image
    desc = m.LossDescriptor(LT.SIGMOID_CROSS_ENTROPY, RT.MEAN, label_smoothing=0.2)
    loss = m.ForwardLossNode(pred, labels, desc)
    graph, terminals = _graph(m.InitialGradientNode(loss.result_image))
    assert len(terminals) == 2
    made = [nd for nd in graph._plan.order if isinstance(nd, m.LossGradientNode)]
    assert sorted(nd.is_labels_gradient_filter for nd in made) == [False, True]
    xt, zt = rand(g, n, 2, 4, 4), rand(g, n, 2, 4, 4)
    _encode(graph, {"x": xt, "z": zt})
    ref = loss_image(tp(xt), tl(zt), None, desc).sum()
    ref.backward()
    tp.check_step("predictions conv")
    tl.check_step("labels conv")


def test_stopped_labels_get_no_gradient_and_kl_needs_the_stop() -> None:
    g = gen(10)
    dp, dl = conv_ds(g, 1, 1, 2, 3, sgd1()), conv_ds(g, 1, 1, 2, 3, sgd1())
    tl = TorchConv(dl)
    x = m.ImageNode("x")
    labels = m.SoftMaxNode(m.ConvolutionNode(x, dl).result_image).result_image
    pred = m.LogSoftMaxNode(m.ConvolutionNode(x, dp).result_image).result_image
    desc = m.LossDescriptor(LT.KULLBACK_LEIBLER_DIVERGENCE, RT.SUM)
    start = m.InitialGradientNode(m.ForwardLossNode(pred, labels, desc).result_image)
    with pytest.raises(ValueError, match=r"\[ForwardLossNode\] the labels are made by a filter, "
                       r"so the training graph differentiates them, but "
                       r"KULLBACK_LEIBLER_DIVERGENCE has no label gradient: set stop_gradient "
                       r"on the labels image, got none"):  # fmt: skip
        start.training_graph()
    labels.stop_gradient = True
    graph, terminals = _graph(start)
    assert len(terminals) == 1
    _encode(graph, {"x": rand(g, 2, 2, 3, 3)})
    tl.check_unchanged("the labels' convolution")


def test_weights_node_and_batch_reduction() -> None:
    """Weights from an image node and ``reduce_across_batch`` (MEAN over the batch's non-zero
    weights): gradients equal autograd; the loss is in image 0."""
    g, n = gen(11), 3
    ds = conv_ds(g, 3, 3, 2, 2, sgd1())
    tc = TorchConv(ds)
    x, t, w = m.ImageNode("x"), m.ImageNode("t"), m.ImageNode("w")
    desc = m.LossDescriptor(LT.MEAN_ABSOLUTE_ERROR, RT.SUM_BY_NON_ZERO_WEIGHTS, weight=2.0)
    loss = m.ForwardLossNode(m.ConvolutionNode(x, ds).result_image, t, desc, w,
                             reduce_across_batch=True)  # fmt: skip
    assert loss.input_labels is t and loss.input_weights is w and loss.reduce_across_batch
    loss.result_image.export_from_graph = True
    graph, _ = _graph(m.InitialGradientNode(loss.result_image))
    xt, tt, wt = rand(g, n, 2, 4, 4), rand(g, n, 2, 4, 4), torch.rand(n, 2, 4, 4, generator=g)
    wt = wt.double() * (wt > 0.3)
    out = _encode(graph, {"x": xt, "t": tt, "w": wt})
    xr = xt.clone().requires_grad_()
    ref = loss_image(tc(xr), tt, wt, desc, across=True)
    ref.sum().backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
    tc.check_step("conv")
    assert_close(graph.intermediate_images[-1].tensor, ref.detach(), "loss image", TOL)


class _Callback:
    """The weight of each encode: 1, 1/2, 1/3, ..."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def scalar_weight(self, source: m.Image, descriptor: m.ImageDescriptor) -> float:
        self.calls.append((source.shape, descriptor.number_of_images, descriptor.width))
        return 1.0 / len(self.calls)


def _callback_steps(reuse: bool) -> tuple[list[torch.Tensor], _Callback, m.Graph]:
    g = gen(12)
    ds = conv_ds(g, 1, 1, 2, 2, sgd1())
    loss = m.ForwardLossNode(
        m.ConvolutionNode(m.ImageNode("x"), ds).result_image,
        m.ImageNode("t"),
        m.LossDescriptor(LT.MEAN_SQUARED_ERROR, RT.SUM),
    )
    callback = _Callback()
    loss.property_call_back = callback
    graph, _ = _graph(m.InitialGradientNode(loss.result_image))
    graph.reuse_step = reuse
    outs = []
    for _ in range(4):
        xt, tt = rand(g, 2, 2, 3, 3), rand(g, 2, 2, 3, 3)
        outs.append(_encode(graph, {"x": xt, "t": tt}).tensor.clone())
    return outs, callback, graph


def test_property_call_back_weights_the_loss_and_its_gradient_at_every_encode() -> None:
    """The callback is asked at every encode (also when the graph would run a recorded
    step) with the predictions and the loss image's descriptor; the gradient uses its weight."""
    reused, callback, graph = _callback_steps(True)
    eager, _, _ = _callback_steps(False)
    assert callback.calls == [((2, 2, 3, 3), 2, 1)] * 4
    assert graph._programs == []  # never kept: a replay would not ask the callback
    for step, (a, b) in enumerate(zip(reused, eager, strict=True)):
        assert torch.equal(a, b), f"step {step}"
    # the fourth step's weight is 1/4: the gradient of 0.25 * sum (y - t)^2
    g = gen(12)
    ds = conv_ds(g, 1, 1, 2, 2, sgd1())
    tc = TorchConv(ds)
    ins = [(rand(g, 2, 2, 3, 3), rand(g, 2, 2, 3, 3)) for _ in range(4)]
    for i, (xt, tt) in enumerate(ins):
        xr = xt.clone().requires_grad_()
        (((tc(xr) - tt) ** 2).sum() / (i + 1)).backward()
        with torch.no_grad():
            tc.w -= tc.w.grad
            tc.b -= tc.b.grad
        tc.w.grad = tc.b.grad = None
        assert_close(reused[i], xr.grad, f"dL/dx step {i}", TOL)


def test_training_graph_of_a_forward_loss_with_a_given_gradient() -> None:
    """Without an initial gradient, the forward loss node takes the gradient of its loss image
    as ``source_gradient`` (here an input: per-image factors)."""
    g = gen(13)
    ds = conv_ds(g, 1, 1, 2, 2, sgd1())
    tc = TorchConv(ds)
    desc = m.LossDescriptor(LT.HINGE, RT.MEAN)
    loss = m.ForwardLossNode(m.ConvolutionNode(m.ImageNode("x"), ds).result_image,
                             m.ImageNode("t"), desc)  # fmt: skip
    terminals = loss.training_graph(m.ImageNode("g"))
    graph = m.Graph(DEV, terminals[0].result_image)
    graph.format = F64
    xt, gt = rand(g, 2, 2, 3, 3), torch.tensor([0.5, 2.0], dtype=torch.float64).view(2, 1, 1, 1)
    tt = (torch.rand(2, 2, 3, 3, generator=g) > 0.5).double()
    out = _encode(graph, {"x": xt, "t": tt, "g": gt})
    xr = xt.clone().requires_grad_()
    (loss_image(tc(xr), tt, None, desc) * gt).sum().backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)


def test_node_errors() -> None:
    desc = m.LossDescriptor(LT.MEAN_SQUARED_ERROR, RT.SUM)
    x, t = m.ImageNode("x"), m.ImageNode("t")
    with pytest.raises(TypeError, match=r"\[ForwardLossNode\] source 1 must be an ImageNode"):
        m.ForwardLossNode(x, "labels", desc)
    with pytest.raises(TypeError, match=r"\[ForwardLossNode\] loss_descriptor must be a "
                       r"LossDescriptor, got NoneType"):  # fmt: skip
        m.ForwardLossNode(x, t, None)
    with pytest.raises(TypeError, match=r"\[ForwardLossNode\] reduce_across_batch must be a "
                       r"bool, got str"):  # fmt: skip
        m.ForwardLossNode(x, t, desc, reduce_across_batch="yes")
    with pytest.raises(ValueError, match=r"\[ForwardLossNode\] sources must be \(predictions, "
                       r"labels\) or \(predictions, labels, weights\), got 1 sources"):  # fmt: skip
        m.ForwardLossNode.from_sources([x], desc)
    with pytest.raises(TypeError, match=r"\[ForwardLossNode\] sources must be a sequence"):
        m.ForwardLossNode.from_sources(x, desc)
    node = m.ForwardLossNode.from_sources([x, t, m.ImageNode("w")], desc)
    assert len(node.source_images) == 3 and node.input_weights is node.source_images[2]
    start = m.InitialGradientNode(node.result_image)
    with pytest.raises(ValueError, match=r"\[InitialGradientNode\] an initial gradient has no "
                       r"gradient filter"):  # fmt: skip
        start.gradient_filter(x)
    with pytest.raises(ValueError, match=r"\[training_graph\] the initial gradient node's source "
                       r"must be made by a filter"):  # fmt: skip
        m.InitialGradientNode(x).training_graph()
    with pytest.raises(ValueError, match=r"\[ForwardLossNode\] a forward loss takes one incoming "
                       r"gradient \(of its loss image\), got 2"):  # fmt: skip
        node.gradient_filters([x, t])
    kl = m.ForwardLossNode(x, t, m.LossDescriptor(LT.KULLBACK_LEIBLER_DIVERGENCE, RT.SUM))
    with pytest.raises(ValueError, match=r"\[LossGradientNode\] a labels gradient needs a loss "
                       r"type with one \(not KULLBACK_LEIBLER_DIVERGENCE\), got "
                       r"KULLBACK_LEIBLER_DIVERGENCE"):  # fmt: skip
        m.LossGradientNode(start.result_image, kl, True)
    with pytest.raises(TypeError, match=r"\[LossGradientNode\] forward must be a "
                       r"ForwardLossNode, got LossNode"):  # fmt: skip
        m.LossGradientNode(x, m.LossNode(x, desc))
    grad = node.gradient_filter(start.result_image)
    assert isinstance(grad, m.LossGradientNode) and grad.descriptor is desc
    assert grad.inference_node is node and grad.source_states == [node.result_state]
