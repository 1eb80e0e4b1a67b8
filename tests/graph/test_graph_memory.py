"""What a training graph keeps alive for the backward: an addition's gradient reads only the
shape of its inputs, and an unfused plain ReLU's gradient reads the ReLU's result. Both free a
residual block's normalization output and addition result after the forward; the gradients stay
equal to PyTorch autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from mpsnn.cnn.neuron import ReLUGradientOfResult
from mpsnn.ops.neuron import relu_backward_of_result
from tests.graph._helpers import (
    DEV,
    TOL,
    TorchConv,
    assert_close,
    conv_ds,
    encode,
    gen,
    mse_loss,
    mse_reference,
    peak_and_total,
    rand,
    sgd1,
    training,
)


def _residual(g: torch.Generator, channels: int = 3):
    """conv -> batch norm -> + x -> ReLU (a residual block's tail), and its PyTorch twin."""
    dc = conv_ds(g, 3, 3, channels, channels, sgd1())
    bn_ds = m.TensorBatchNormalizationDataSource(channels)
    x = m.ImageNode("x")
    bn = m.BatchNormalizationNode(m.ConvolutionNode(x, dc).result_image, bn_ds)
    add = m.AdditionNode(bn.result_image, x)
    relu = m.NeuronReLUNode(add.result_image)
    return x, bn, add, relu, dc


def test_residual_tail_frees_the_addition_inputs_and_result_and_matches_autograd() -> None:
    g = gen(61)
    _, bn, add, relu, dc = _residual(g)
    graph, _ = training(mse_loss(relu.result_image))
    last = graph._plan.liveness.last_reader
    # the normalization's result: read by the addition only (its gradient needs the shape)
    assert last[bn.result_image._id] == add._id
    # the ReLU runs inside the addition (one pass, no addition result of its own); its
    # gradient reads the ReLU's result
    assert graph._plan.fusion.fused_into[relu._id] is add and add.result_image._id not in last
    kinds = {type(k).__name__ for k in graph._plan.kernels.values() if not isinstance(k, tuple)}
    assert "ReLUGradientOfResult" in kinds

    xt, target = rand(g, 2, 3, 6, 5), rand(g, 2, 3, 6, 5)
    tconv = TorchConv(dc)
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    xr = xt.clone().requires_grad_()
    z = tconv(xr)
    zn = F.batch_norm(z, None, None, training=True, eps=1e-5)
    mse_reference(F.relu(zn + xr), target).backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
    after_w = dc.weights().permute(0, 3, 1, 2)  # SGD, lr 1: moved by minus the gradient
    assert_close(tconv.w.detach() - after_w, tconv.w.grad, "conv weight gradient", TOL)
    # (the bias gradient is zero in exact arithmetic: batch normalization removes the mean)
    assert (tconv.b.detach() - dc.bias_terms()).abs().max() < 1e-12


def test_residual_tail_planned_peak_is_lower_than_keeping_every_forward_image() -> None:
    g = gen(62)
    x = m.ImageNode("x")
    img = x
    for _ in range(4):  # four residual tails in a row
        dc = conv_ds(g, 3, 3, 8, 8, sgd1())
        bn = m.BatchNormalizationNode(
            m.ConvolutionNode(img, dc).result_image, m.TensorBatchNormalizationDataSource(8)
        )
        img = m.NeuronReLUNode(m.AdditionNode(bn.result_image, img).result_image).result_image
    graph, _ = training(mse_loss(img))
    xt, target = rand(g, 4, 8, 32, 32), rand(g, 4, 8, 32, 32)
    encode(graph, [xt], [m.LossLabels(DEV, target)])
    peak, _ = peak_and_total(graph)
    one = 4 * 8 * 32 * 32 * 8 / 2**20  # one float64 image: 0.25 MiB
    # kept for the backward: each tail's convolution result and ReLU result (2 per tail), not
    # its normalization result and addition result (4 per tail), plus a few gradients in flight
    assert peak <= (2 * 4 + 4) * one, graph.debug_description()


def test_multiplication_gradient_still_keeps_the_other_input() -> None:
    g = gen(63)
    da, db = conv_ds(g, 1, 1, 2, 2, sgd1()), conv_ds(g, 1, 1, 2, 2, sgd1())
    x = m.ImageNode("x")
    a, b = m.ConvolutionNode(x, da), m.ConvolutionNode(x, db)
    prod = m.MultiplicationNode(a.result_image, b.result_image)
    graph, _ = training(mse_loss(prod.result_image))
    grads = [n for n in graph._plan.order if type(n).__name__ == "ArithmeticGradientNode"]
    assert len(grads) == 2
    for n in grads:  # each reads the other factor's values
        assert len(n._content_sources()) == 2
    xt, target = rand(g, 2, 2, 4, 4), rand(g, 2, 2, 4, 4)
    ta, tb = TorchConv(da), TorchConv(db)  # before the step updates the data sources
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    xr = xt.clone().requires_grad_()
    mse_reference(ta(xr) * tb(xr), target).backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_relu_gradient_of_result_equals_the_source_rule_except_at_zero(dtype) -> None:
    gen_ = torch.Generator().manual_seed(64)
    x = torch.randn(3, 4, 5, 6, generator=gen_, dtype=torch.float64)
    x[0, 0, 0, :3] = torch.tensor([0.0, -0.0, -1.0])
    x = x.to(dtype)
    gr = torch.randn(x.shape, generator=gen_, dtype=torch.float64).to(dtype)
    y = x * (x >= 0)  # the forward's bits (negative x -> -0.0)
    got = relu_backward_of_result(gr, y)
    want = gr * (x >= 0)  # the source rule (MPS: x >= 0 ? 1 : 0)
    zero = x == 0
    assert torch.equal(got[~zero], want[~zero])
    assert (got[zero] == 0).all() and zero.sum() == 2  # the other subgradient there
    assert torch.equal(got, torch.ops.aten.threshold_backward(gr, x, 0))  # PyTorch's rule
    assert got.dtype == dtype


def test_relu_gradient_of_result_kernel_through_the_kernel_api() -> None:
    gen_ = torch.Generator().manual_seed(65)
    relu = m.NeuronDescriptor(m.NeuronType.RELU)
    fwd, grad = m.Neuron(DEV, relu), ReLUGradientOfResult(DEV, relu)
    x = torch.randn(2, 3, 4, 5, generator=gen_, dtype=torch.float64)
    gt = torch.randn(x.shape, generator=gen_, dtype=torch.float64)
    cb = DEV.new_command_queue().command_buffer()
    src = m.Image.from_tensor(x)
    state = fwd.result_state(src)
    y = fwd.encode(cb, src, destination_state=state)
    dx = grad.encode(cb, m.Image.from_tensor(gt), y, state)
    cb.commit()
    cb.wait_until_completed()
    xr = x.clone().requires_grad_()
    F.relu(xr).backward(gt)
    assert torch.equal(dx.tensor, xr.grad)  # no zeros in x: the rules agree with autograd's
    with pytest.raises(ValueError, match=r"\[ReLUGradientOfResult\] the neuron must be a ReLU"):
        ReLUGradientOfResult(DEV, m.NeuronDescriptor(m.NeuronType.RELU, a=0.1))


def test_a_relu_with_a_narrower_result_reads_its_source() -> None:
    """A float16 ReLU result after a float64 addition: a tiny positive sum would round to a
    zero result and lose its gradient, so the gradient reads the sum (the kernel's rule)."""
    g = gen(66)
    _, _, add, relu, _ = _residual(g)
    relu.result_image.format = m.FeatureChannelFormat.FLOAT16
    graph, _ = training(mse_loss(m.NeuronLinearNode(relu.result_image, 1.0, 0.0).result_image))
    kinds = [type(k).__name__ for k in graph._plan.kernels.values() if not isinstance(k, tuple)]
    assert "ReLUGradientOfResult" not in kinds and "NeuronGradient" in kinds
    assert (
        graph._plan.liveness.last_reader[add.result_image._id] != relu._id
    )  # kept for the gradient


def test_a_shape_only_stand_in_refuses_to_be_read() -> None:
    from mpsnn.graph.step import _shape_only

    stand_in = _shape_only(m.ImageBatch.from_tensor(torch.zeros(2, 3, 4, 5)))
    assert stand_in.image._shape == (2, 3, 4, 5) and stand_in.image._storage is None
    with pytest.raises(RuntimeError, match=r"\[Graph\] internal error: the contents of a shape"):
        stand_in.image._data()


def _spy_shares(monkeypatch) -> list[tuple[object, object, object]]:
    """Record every `_Step.share` call: (step, node, the image it now holds)."""
    from mpsnn.graph.step import _Step

    calls: list[tuple[object, object, object]] = []
    real = _Step.share

    def share(self, node, same_as) -> None:
        real(self, node, same_as)
        calls.append((self, node, self.images[node._id]))

    monkeypatch.setattr(_Step, "share", share)
    return calls


def _count_add_gradient_encodes(monkeypatch) -> list[int]:
    from mpsnn.cnn.arithmetic_gradient import ArithmeticGradient

    count = [0]
    real = ArithmeticGradient._plan_gradient

    def plan(self, *args, **kwargs):
        count[0] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ArithmeticGradient, "_plan_gradient", plan)
    return count


def test_addition_gradients_hold_the_incoming_gradient_and_free_it_after_both(
    monkeypatch,
) -> None:
    """Both gradients of a residual addition are its incoming gradient: the graph's nodes hold
    that image (no copy is encoded), the values equal autograd's, and the storage is freed
    once, after the last reader of any of the three keys."""
    shares = _spy_shares(monkeypatch)
    encodes = _count_add_gradient_encodes(monkeypatch)
    g = gen(67)
    _, _, _, relu, dc = _residual(g)
    graph, _ = training(mse_loss(relu.result_image))
    xt, target = rand(g, 2, 3, 6, 5), rand(g, 2, 3, 6, 5)
    tconv = TorchConv(dc)
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    assert encodes[0] == 0
    assert len(shares) == 2
    (step, _, a), (_, _, b) = shares
    assert a is b  # one image, held by the relu gradient's key and both addition gradients'
    assert step.shared[id(a.image._root())] == 1  # every holder released it...
    assert a.image._root()._released_by is not None  # ... and the storage went with the last
    xr = xt.clone().requires_grad_()
    zn = F.batch_norm(tconv(xr), None, None, training=True, eps=1e-5)
    mse_reference(F.relu(zn + xr), target).backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
    after_w = dc.weights().permute(0, 3, 1, 2)
    assert_close(tconv.w.detach() - after_w, tconv.w.grad, "conv weight gradient", TOL)


@pytest.mark.parametrize("case", ["scale", "subtract", "broadcast", "exported", "format"])
def test_addition_gradients_that_are_not_the_incoming_gradient_are_computed(
    monkeypatch, case
) -> None:
    """A scale, a subtraction's negated secondary, a broadcast input, an exported gradient
    and a gradient stored in another format are each encoded (and equal autograd)."""
    shares = _spy_shares(monkeypatch)
    encodes = _count_add_gradient_encodes(monkeypatch)
    g = gen(68)
    dc = conv_ds(g, 3, 3, 3, 3, sgd1())
    x, bias_x = m.ImageNode("x"), m.ImageNode("b")
    conv = m.ConvolutionNode(x, dc)
    right = bias_x if case == "broadcast" else x
    node_class = m.SubtractionNode if case == "subtract" else m.AdditionNode
    arith = node_class(conv.result_image, right)
    if case == "scale":
        arith.primary_scale = 2.0
    if case == "broadcast":  # a per-channel (N, C, 1, 1) right input
        arith.secondary_stride_in_pixels_x = arith.secondary_stride_in_pixels_y = 0
    loss = mse_loss(arith.result_image)
    terminals = loss.training_graph(None, None)
    grads = {n.result_image: n for n in _walk_gradients(terminals)}
    arith_grads = [n for n in grads.values() if type(n).__name__ == "ArithmeticGradientNode"]
    assert arith_grads
    if case == "exported":
        for n in arith_grads:
            n.result_image.export_from_graph = True
    if case == "format":
        for n in arith_grads:
            n.result_image.format = m.FeatureChannelFormat.FLOAT32
    results = [t.result_image for t in terminals]
    graph = m.Graph.from_results(DEV, results, [True] * len(results))
    graph.format = m.FeatureChannelFormat.FLOAT64
    xt, target = rand(g, 2, 3, 6, 5), rand(g, 2, 3, 6, 5)
    bt = rand(g, 2, 3, 1, 1)
    tconv = TorchConv(dc)
    sources = [xt] + ([bt] if case == "broadcast" else [])
    assert len(graph.source_image_handles) == len(sources)
    cb = DEV.new_command_queue().command_buffer()
    outs = graph.encode_batch(
        cb, [m.ImageBatch.from_tensor(t) for t in sources], [m.LossLabels(DEV, target)]
    )
    cb.commit()
    cb.wait_until_completed()
    assert outs is not None
    assert encodes[0] >= 1
    passed = {id(node) for _, node, _ in shares} & {id(n.result_image) for n in arith_grads}
    # the other input's gradient of a scaled addition, a subtraction's primary and the
    # non-broadcast input's still pass their gradient on
    assert len(passed) == {"scale": 1, "subtract": 1, "broadcast": 1}.get(case, 0)
    xr, br = xt.clone().requires_grad_(), bt.clone().requires_grad_()
    z = tconv(xr)
    if case == "scale":
        y = 2.0 * z + xr
    elif case == "subtract":
        y = z - xr
    elif case == "broadcast":
        y = z + br
    else:
        y = z + xr
    mse_reference(y, target).backward()
    want = xr.grad if outs.tensor.shape == xt.shape else br.grad
    tol = 1e-6 if case == "format" else TOL  # "format": the gradients stored in float32
    assert_close(outs.tensor, want, "the first result's gradient", tol)
    after_w = dc.weights().permute(0, 3, 1, 2)
    assert_close(tconv.w.detach() - after_w, tconv.w.grad, "conv weight gradient", tol)


def _walk_gradients(terminals):
    seen, todo, out = set(), list(terminals), []
    while todo:
        n = todo.pop()
        if n._id in seen:
            continue
        seen.add(n._id)
        out.append(n)
        for img in n.source_images:
            if img.producer is not None:
                todo.append(img.producer)
    return out


def test_a_relu_fused_into_a_convolution_differentiates_from_the_result(monkeypatch) -> None:
    """The gradient of a ReLU fused into a convolution reads the convolution's result: its
    state keeps no pre-activation, and at a pre-activation of exactly 0 the gradient is 0
    (PyTorch's subgradient), equal to autograd's."""
    from mpsnn.cnn.convolution.state import ConvolutionGradientState

    g = gen(69)
    d0 = conv_ds(g, 1, 1, 2, 2, sgd1())  # the fused convolution reads an intermediate
    dc = conv_ds(g, 3, 3, 2, 3, sgd1())
    w = dc.weights().clone()
    w[1] = 0.0  # channel 1: z = bias = 0 everywhere, a ReLU at its kink
    b = dc.bias_terms().clone()
    b[1] = 0.0
    dc = m.TensorConvolutionDataSource(dc.descriptor(), w, b, optimizer=sgd1())
    conv0 = m.ConvolutionNode(m.ImageNode("x"), d0)
    conv = m.ConvolutionNode(conv0.result_image, dc)
    relu = m.NeuronReLUNode(conv.result_image)
    graph, _ = training(mse_loss(relu.result_image))
    assert graph._plan.fusion.fused and graph._plan.kernels[conv._id]._keep_preactivation is False
    kept = []
    real = ConvolutionGradientState._free_storage

    def spy(self) -> None:
        kept.append(self._preactivation)
        real(self)

    monkeypatch.setattr(ConvolutionGradientState, "_free_storage", spy)
    xt, target = rand(g, 2, 2, 5, 4), rand(g, 2, 3, 5, 4)
    t0, tconv = TorchConv(d0), TorchConv(dc)
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    assert kept and all(k is None for k in kept)
    xr = xt.clone().requires_grad_()
    mse_reference(F.relu(tconv(t0(xr))), target).backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
    tconv.check_step("fused ReLU")
    assert tconv.b.grad[1] == 0  # the kink: no gradient through channel 1


def test_a_fused_relu_on_a_wider_graph_input_keeps_its_pre_activation() -> None:
    """A convolution of a float32 graph input computes its pre-activation in float32; in a
    float16 graph a tiny positive one rounds to a zero result. Its fused ReLU's gradient then
    reads the kept pre-activation (MPS's rule), so that pixel's gradient is not lost."""
    desc = m.ConvolutionDescriptor(1, 1, 2, 3)
    w = torch.zeros(desc.weights_shape, dtype=torch.float32)
    ds = m.TensorConvolutionDataSource(desc, w, torch.full((3,), 1e-9), optimizer=sgd1())
    conv = m.ConvolutionNode(m.ImageNode("x"), ds)
    relu = m.NeuronReLUNode(conv.result_image)
    graph, _ = training(mse_loss(relu.result_image), fmt=m.FeatureChannelFormat.FLOAT16)
    assert graph._plan.kernels[conv._id]._keep_preactivation is True
    xt = rand(gen(70), 2, 2, 3, 3).float()
    encode(graph, [xt], [m.LossLabels(DEV, torch.ones(2, 3, 3, 3))])
    # dL/db = sum(y - 1) over 2 x 3 x 3 pixels per channel = -18: SGD (lr 1) moves b by +18
    assert torch.allclose(ds.bias_terms(), torch.full((3,), 18.0), atol=1e-2)


def test_an_addition_gradient_that_is_a_graph_source_is_not_shared() -> None:
    """An incoming gradient given as a source of the graph is counted once per reading node
    (``read_count_for_source_image``); the addition's gradients read it, copy it, and a
    temporary source image with exactly that read count serves the whole encode."""
    g = gen(73)
    x, gin = m.ImageNode("x"), m.ImageNode("g")
    bn = m.BatchNormalizationNode(x, m.TensorBatchNormalizationDataSource(3))
    add = m.AdditionNode(bn.result_image, x)
    ga, gx = add.gradient_filters([gin])
    bng = bn.gradient_filter(ga.result_image)
    graph = m.Graph.from_results(DEV, [bng.result_image, gx.result_image], [True, True])
    graph.format = m.FeatureChannelFormat.FLOAT64
    cb = DEV.new_command_queue().command_buffer()
    gt = rand(g, 2, 3, 4, 5)
    gs = m.TemporaryImage(cb, m.ImageDescriptor(m.FeatureChannelFormat.FLOAT64, 5, 4, 3, 2))
    for i in range(2):
        gs.write_bytes(gt[i].numpy(), m.DataLayout.FEATURE_CHANNELS_HEIGHT_WIDTH, i)
    idx = graph.source_image_handles.index("g")
    gs.read_count = graph.read_count_for_source_image(idx)
    srcs = [None, None]
    srcs[graph.source_image_handles.index("x")] = m.ImageBatch.from_tensor(rand(g, 2, 3, 4, 5))
    srcs[idx] = m.ImageBatch(gs)
    out = graph.encode_batch(cb, srcs)
    (gx_value,) = graph.intermediate_images
    cb.commit()
    cb.wait_until_completed()
    assert out is not None and out.tensor.shape == (2, 3, 4, 5)
    assert torch.equal(gx_value.tensor, gt)  # the secondary gradient: the incoming one
