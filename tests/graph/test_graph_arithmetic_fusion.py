"""A ReLU after an arithmetic node runs inside it (one pass, no arithmetic result of its own)
when its gradient reads its own result; the arithmetic gradients are unchanged. Other neurons
fuse only where no gradient needs their input (an inference graph)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import mpsnn as m
from tests.graph._helpers import (
    DEV,
    F16,
    F64,
    TOL,
    TorchConv,
    assert_close,
    conv_ds,
    encode,
    gen,
    mse_loss,
    mse_reference,
    rand,
    sgd1,
    training,
)


def _pair(g: torch.Generator, kind: type, neuron: type = m.NeuronReLUNode):
    """``neuron(conv_a(x) op conv_b(x))`` and its two data sources."""
    da, db = conv_ds(g, 3, 3, 3, 3, sgd1()), conv_ds(g, 1, 1, 3, 3, sgd1())
    x = m.ImageNode("x")
    a, b = m.ConvolutionNode(x, da), m.ConvolutionNode(x, db)
    op = kind(a.result_image, b.result_image)
    return neuron(op.result_image), op, da, db


def test_relu_after_a_subtraction_fuses_and_matches_autograd() -> None:
    g = gen(81)
    relu, sub, da, db = _pair(g, m.SubtractionNode)
    sub.primary_scale = 0.5  # the general path: scale, then the ReLU after the result
    graph, _ = training(mse_loss(relu.result_image))
    assert graph._plan.fusion.fused_into[relu._id] is sub
    assert "fused RELU" in graph.debug_description()
    ta, tb = TorchConv(da), TorchConv(db)
    xt, target = rand(g, 2, 3, 6, 5), rand(g, 2, 3, 6, 5)
    dx = encode(graph, [xt], [m.LossLabels(DEV, target)])
    xr = xt.clone().requires_grad_()
    mse_reference(F.relu(0.5 * ta(xr) - tb(xr, padding=0)), target).backward()
    assert_close(dx.tensor, xr.grad, "dL/dx", TOL)
    ta.check_step("primary convolution")
    tb.check_step("secondary convolution")


def test_a_neuron_whose_gradient_needs_its_input_is_not_fused_in_training() -> None:
    g = gen(82)
    sig, *_ = _pair(g, m.AdditionNode, m.NeuronSigmoidNode)
    graph, _ = training(mse_loss(sig.result_image))
    assert sig._id not in graph._plan.fusion.fused_into  # its gradient reads the addition's result
    # a ReLU with a narrower result reads its input too (a tiny sum could round to zero)
    relu, *_ = _pair(g, m.AdditionNode)
    relu.result_image.format = F16
    graph, _ = training(mse_loss(relu.result_image))
    assert relu._id not in graph._plan.fusion.fused_into


def test_inference_fuses_any_neuron_after_arithmetic_with_the_same_values() -> None:
    g = gen(83)
    sig, add, da, db = _pair(g, m.AdditionNode, m.NeuronSigmoidNode)
    fused = m.Graph(DEV, sig.result_image)
    fused.format = F64
    assert fused._plan.fusion.fused_into[sig._id] is add
    xt = rand(g, 2, 3, 5, 4)
    got = encode(fused, [xt]).tensor
    ta, tb = TorchConv(da), TorchConv(db)
    assert_close(got, torch.sigmoid(ta(xt) + tb(xt, padding=0)), "sigmoid(a + b)", TOL)
    # the kernel alone, unfused: the same bits
    add_k = m.Add(DEV)
    neuron = m.Neuron(DEV, m.NeuronDescriptor(m.NeuronType.SIGMOID))
    cb = DEV.new_command_queue().command_buffer()
    a = m.Image.from_tensor(ta(xt).detach())
    b = m.Image.from_tensor(tb(xt, padding=0).detach())
    ref = neuron.encode(cb, add_k.encode(cb, a, b))
    cb.commit()
    cb.wait_until_completed()
    ours = m.Add(DEV)
    ours._neuron = fused._plan.kernels[add._id]._neuron
    cb = DEV.new_command_queue().command_buffer()
    one = ours.encode(cb, a, b)
    cb.commit()
    cb.wait_until_completed()
    assert torch.equal(one.tensor, ref.tensor)


def test_a_fused_neuron_reads_the_stored_sum_as_the_unfused_one_does() -> None:
    # float64 sources into a float32 graph: the neuron runs on the sum rounded to float32
    g = gen(84)
    x, y = m.ImageNode("x"), m.ImageNode("y")
    add = m.AdditionNode(x, y)
    sig = m.NeuronSigmoidNode(add.result_image)
    fused = m.Graph(DEV, sig.result_image)
    assert fused._plan.fusion.fused_into[sig._id] is add
    xt, yt = rand(g, 2, 3, 9, 7), rand(g, 2, 3, 9, 7)
    got = encode(fused, [xt, yt]).tensor
    want = torch.sigmoid((xt + yt).float())
    assert got.dtype == torch.float32 and torch.equal(got, want)
