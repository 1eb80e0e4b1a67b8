"""A plain ReLU (``a = +0.0``) fused into a convolution on the CPU: the training encode writes
the ReLU over the convolution's result and keeps the slope ``z >= 0`` in the state instead of
the pre-activation ``z``, so the neuron gradient is one pass (``m g``) where it took two
(``z >= 0``, then the product). The bits are those of `activation` and `activation_backward`
on ``z``: -0.0 for a negative input, NaN for -inf and NaN, mixed formats computed in the
wider one. Other neurons keep the pre-activation."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mpsnn as m
from mpsnn.cnn.neuron import NeuronType as T
from mpsnn.ops.neuron import (
    activation,
    activation_backward,
    relu_in_place,
    relu_mask_backward,
)
from tests.helpers import run

_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_BITS[t.element_size()])


def _specials(dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64)
    x.view(-1)[::5] = -0.0
    x.view(-1)[1::7] = 0.0
    x.view(-1)[2::11] = -float("inf")
    x.view(-1)[3::13] = float("inf")
    x.view(-1)[4::17] = float("nan")
    return x.to(dtype)


class _Count(TorchDispatchMode):
    """Counts the ``>=`` comparisons that run."""

    def __init__(self) -> None:
        super().__init__()
        self.ge = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.ge:
            self.ge += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_relu_in_place_and_its_slope_give_the_general_bits(dtype) -> None:
    p = m.NeuronDescriptor(T.RELU).params
    z = _specials(dtype, 0)
    want = activation(p, z)
    got = z.clone()
    mask = relu_in_place(p, got)
    assert mask is not None and mask.dtype == dtype
    assert torch.equal(bits(got), bits(want))
    for g_dtype in (dtype, torch.float32, torch.float64):  # mixed formats: the wider one
        g = _specials(g_dtype, 1)
        assert torch.equal(bits(relu_mask_backward(g, mask)), bits(activation_backward(p, g, z)))


@pytest.mark.parametrize("a", [0.1, -0.0])
def test_relu_in_place_is_only_the_plain_relu(a) -> None:
    p = m.NeuronDescriptor(T.RELU, a=a).params
    z = _specials(torch.float32, 2)
    before = z.clone()
    assert relu_in_place(p, z) is None
    assert torch.equal(bits(z), bits(before))
    assert relu_in_place(m.NeuronDescriptor(T.TANH).params, z) is None


def _convolution(neuron, dtype, gen):
    desc = m.ConvolutionDescriptor(3, 3, 2, 4, fused_neuron_descriptor=neuron)
    w = torch.randn(desc.weights_shape, generator=gen)
    b = torch.randn(4, generator=gen)
    b[1] = 0.0
    w[1] = 0.0  # channel 1: z = 0 everywhere, the ReLU's kink (slope 1 by the MPS rule)
    dev = m.Device("cpu")
    ds = m.TensorConvolutionDataSource(desc, w, b)
    plain = m.TensorConvolutionDataSource(m.ConvolutionDescriptor(3, 3, 2, 4), w, b)
    return dev, ds, m.Convolution(dev, plain)


def _encoded_forward(neuron, x, gen):
    """A fused-neuron convolution of ``x`` encoded with its state, the same convolution
    without the neuron (the pre-activation), on one new buffer; and the neuron's gradient."""
    dev, ds, plain = _convolution(neuron, x.dtype, gen)
    conv = m.Convolution(dev, ds)
    src = m.Image.from_tensor(x)
    q = dev.new_command_queue()
    cb = q.command_buffer()
    state = conv.result_state(src)
    y = conv.encode(cb, src, destination_state=state)
    z = plain.encode(cb, src)  # the pre-activation, from the same weights
    return q, cb, state, y, z, m.NeuronGradient(dev, neuron)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_fused_relu_gradient_reads_the_kept_slope(dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    neuron = m.NeuronDescriptor(T.RELU)
    x = torch.randn(2, 2, 7, 6, generator=gen, dtype=torch.float64).to(dtype)
    q, cb, state, y, z, ngrad = _encoded_forward(neuron, x, gen)
    run(cb)
    assert state._preactivation is None and state._relu_mask is not None
    assert state._relu_mask in state.resources()
    p = neuron.params
    assert torch.equal(bits(y.tensor), bits(activation(p, z.tensor)))
    g = _specials(dtype, 4)[:, :, :, :4].repeat(1, 2, 2, 2)[:, :4, :7, :6].contiguous()
    cb = q.command_buffer()
    dz = ngrad.encode(cb, m.Image.from_tensor(g), y, state)
    with _Count() as count:
        run(cb)
    assert count.ge == 0  # one product, no comparison
    assert torch.equal(bits(dz.tensor), bits(activation_backward(p, g, z.tensor)))
    assert torch.equal(bits(dz.tensor[:, 1]), bits(g[:, 1]))  # z = 0: slope 1, g as is


def test_other_neurons_keep_the_pre_activation() -> None:
    gen = torch.Generator().manual_seed(5)
    neuron = m.NeuronDescriptor(T.RELU, a=0.25)
    _, cb, state, y, z, ngrad = _encoded_forward(neuron, torch.randn(1, 2, 5, 5, generator=gen),
                                                 gen)  # fmt: skip
    g = torch.randn(1, 4, 5, 5, generator=gen)
    dz = ngrad.encode(cb, m.Image.from_tensor(g), y, state)
    run(cb)
    assert state._relu_mask is None and torch.equal(state._preactivation, z.tensor)
    assert torch.equal(dz.tensor, activation_backward(neuron.params, g, z.tensor))


def test_a_client_may_read_the_kept_slope_twice() -> None:
    """Outside a graph the state may be read by more than one gradient: the slope is left as
    it was, and both gradients are right."""
    gen = torch.Generator().manual_seed(6)
    neuron = m.NeuronDescriptor(T.RELU)
    _, cb, state, y, z, ngrad = _encoded_forward(neuron, torch.randn(1, 2, 5, 5, generator=gen),
                                                 gen)  # fmt: skip
    g1, g2 = torch.randn(1, 4, 5, 5, generator=gen), torch.randn(1, 4, 5, 5, generator=gen)
    d1 = ngrad.encode(cb, m.Image.from_tensor(g1), y, state)
    d2 = ngrad.encode(cb, m.Image.from_tensor(g2), y, state)
    run(cb)
    for g, d in ((g1, d1), (g2, d2)):
        assert torch.equal(bits(d.tensor), bits(activation_backward(neuron.params, g, z.tensor)))
    assert state._relu_mask is not None


def test_a_graph_step_consumes_the_slope_in_place(monkeypatch) -> None:
    """In a graph's step the ReLU's gradient runs inside the convolution gradient and nothing
    else reads the slope: the product is written into it (no new tensor), with the bits of a
    fresh product (the step records of tests/graph check whole trainings)."""
    from mpsnn.cnn import neuron as cnn_neuron
    from tests.graph._helpers import DEV, ce_loss, conv_ds, encode, gen, sgd1, training

    fresh = []
    real = cnn_neuron.relu_mask_backward

    def spy(g, mask):
        fresh.append(True)
        return real(g, mask)

    monkeypatch.setattr(cnn_neuron, "relu_mask_backward", spy)
    g = gen(31)
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, conv_ds(g, 3, 3, 1, 4, sgd1()))
    relu = m.NeuronReLUNode(c1.result_image)
    c2 = m.FullyConnectedNode(relu.result_image, conv_ds(g, 3, 3, 4, 3, sgd1()))
    graph, _ = training(ce_loss(c2.result_image, 2), needed=False)
    assert graph.plan.pre_gradient  # the ReLU's gradient runs inside c2's gradient
    images = torch.randn(2, 1, 1, 1, dtype=torch.float64, generator=g).expand(2, 1, 3, 3)
    for _ in range(2):
        encode(graph, [images.contiguous()], [m.LossLabels(DEV, torch.tensor([[[0]], [[2]]]))])
    assert fresh == []  # consumed in place, never a fresh product
