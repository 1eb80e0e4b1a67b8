"""Neuron family: all 16 types against PyTorch, gradients by the adjoint test and autograd, kink
conventions, domains, MPS geometry, the convolution's fused neuron in training, and errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.helpers import DEVICES, assert_adjoint, assert_close, run

T = m.NeuronType
SLOPES = torch.tensor([0.1, -0.3, 0.7])

# type -> (kwargs, independent PyTorch reference f(x))
CASES = {
    T.NONE: ({}, lambda x: x),
    T.RELU: ({"a": 0.2}, lambda x: F.leaky_relu(x, 0.2)),
    T.LINEAR: ({"a": -1.5, "b": 0.25}, lambda x: -1.5 * x + 0.25),
    T.SIGMOID: ({}, torch.sigmoid),
    T.HARD_SIGMOID: ({"a": 0.4, "b": 0.5}, lambda x: torch.clamp(0.4 * x + 0.5, 0, 1)),
    T.TANH: ({"a": 1.7, "b": 0.6}, lambda x: 1.7 * torch.tanh(0.6 * x)),
    T.ABSOLUTE: ({}, torch.abs),
    T.SOFT_PLUS: ({"a": 0.8, "b": 1.3}, lambda x: 0.8 * torch.log1p(torch.exp(1.3 * x))),
    T.SOFT_SIGN: ({}, F.softsign),
    T.ELU: ({"a": 0.9}, lambda x: F.elu(x, alpha=0.9)),
    T.PRELU: ({"data": SLOPES}, lambda x: F.prelu(x, SLOPES.to(x))),
    T.RELU_N: ({"a": 0.1, "b": 1.2}, lambda x: torch.clamp(F.leaky_relu(x, 0.1), max=1.2)),
    T.POWER: ({"a": 0.5, "b": 3.0, "c": 1.7}, lambda x: torch.pow(0.5 * x + 3.0, 1.7)),
    T.EXPONENTIAL: ({"a": 0.7, "b": -0.2, "c": 2.5}, lambda x: torch.pow(2.5, 0.7 * x - 0.2)),
    T.LOGARITHM: ({"a": 0.5, "b": 4.0, "c": 10.0}, lambda x: torch.log10(0.5 * x + 4.0)),
    T.GELU: ({}, lambda x: F.gelu(x)),
}


def _encode_pair(dev, desc, x, g=None):
    neuron, grad = m.Neuron(dev, desc), m.NeuronGradient(dev, desc)
    src = m.Image.from_tensor(x)
    cb = dev.new_command_queue().command_buffer()
    state = neuron.result_state(src)
    y = neuron.encode(cb, src, destination_state=state)
    dx = None if g is None else grad.encode(cb, m.Image.from_tensor(g), src, state)
    run(cb)
    return y.tensor, (None if dx is None else dx.tensor)


def _away_from_kinks(x: torch.Tensor) -> torch.Tensor:
    # kinks of the types above (0, the hard-sigmoid corners -1.25 and 1.25, the ReLU-N cap 1.2)
    for k in (0.0, -1.25, 1.25, 1.2):
        x = torch.where((x - k).abs() < 1e-3, x + 0.01, x)
    return x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(T), ids=lambda t: t.name)
def test_every_type_matches_torch_and_autograd(kind, device) -> None:
    gen = torch.Generator().manual_seed(61 + int(kind))
    dev = m.Device(device)
    kwargs, ref = CASES[kind]
    desc = m.NeuronDescriptor(kind, **kwargs)
    x = _away_from_kinks(torch.randn(2, 3, 5, 4, generator=gen, dtype=torch.float64) * 2)
    g = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    y, dx = _encode_pair(dev, desc, x.to(device), g.to(device))
    assert_close(y, ref(x), f"{kind.name} forward", tol=1e-13)
    xr = x.clone().requires_grad_()
    ref(xr).backward(g)
    assert_close(dx, xr.grad, f"{kind.name} gradient vs autograd", tol=1e-12)
    # adjoint test by central differences (the map is smooth away from kinks)
    v = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    eps = 1e-6
    jv = (
        _encode_pair(dev, desc, (x + eps * v).to(device))[0]
        - _encode_pair(dev, desc, (x - eps * v).to(device))[0]
    ) / (2 * eps)
    assert_adjoint(jv, g, v, dx, f"{kind.name} adjoint", tol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "kind",
    [T.RELU, T.SIGMOID, T.TANH, T.GELU, T.SOFT_PLUS, T.ELU, T.LOGARITHM],
    ids=lambda t: t.name,
)
def test_low_precision_storage(kind, dtype, device) -> None:
    gen = torch.Generator().manual_seed(62)
    kwargs, ref = CASES[kind]
    desc = m.NeuronDescriptor(kind, **kwargs)
    x = _away_from_kinks(torch.randn(2, 3, 6, 6, generator=gen)).to(dtype)
    g = torch.randn(x.shape, generator=gen).to(dtype)
    y, dx = _encode_pair(m.Device(device), desc, x.to(device), g.to(device))
    assert y.dtype == dtype and dx.dtype == dtype
    xr = x.double().requires_grad_()
    ref(xr).backward(g.double())
    assert_close(y, ref(x.double()), f"{kind.name} forward", dtype=dtype)
    assert_close(dx, xr.grad, f"{kind.name} gradient", dtype=dtype)


def test_kink_conventions() -> None:
    """x >= 0 takes the positive branch (ReLU, ELU, PReLU); |x|' = 0 at 0; the clamp
    boundaries of HardSigmoid and ReLU-N have derivative 0."""
    dev = m.Device("cpu")
    x = torch.tensor([[[[0.0, -1.25, 1.25, 1.2]]]], dtype=torch.float64)
    g = torch.tensor([[[[3.0, -2.0, 0.5, 1.5]]]], dtype=torch.float64)

    def slope(kind, **kw):
        return _encode_pair(dev, m.NeuronDescriptor(kind, **kw), x, g)[1].flatten().tolist()

    assert slope(T.RELU, a=0.2)[0] == 3.0
    assert slope(T.ELU, a=0.5)[0] == 3.0
    assert slope(T.ABSOLUTE)[0] == 0.0
    hs = slope(T.HARD_SIGMOID, a=0.4, b=0.5)  # 0.4x+0.5 is 0.5, 0, 1, 0.98
    assert hs == pytest.approx([0.4 * 3.0, 0.0, 0.0, 0.4 * 1.5], rel=1e-15)
    assert slope(T.RELU_N, a=0.1, b=1.2)[3] == 0.0  # at the cap


def test_domains_follow_torch() -> None:
    dev = m.Device("cpu")
    x = torch.tensor([[[[-8.0, -6.0, 2.0]]]], dtype=torch.float64)
    y, _ = _encode_pair(dev, m.NeuronDescriptor(T.POWER, a=0.5, b=3.0, c=1.7), x)
    assert math.isnan(y[0, 0, 0, 0]) and y[0, 0, 0, 1] == 0.0  # (-1)^1.7 is not real; 0^1.7 = 0
    x = torch.tensor([[[[-10.0, -8.0, 2.0]]]], dtype=torch.float64)  # 0.5x + 4 = -1, 0, 5
    y, _ = _encode_pair(dev, m.NeuronDescriptor(T.LOGARITHM, a=0.5, b=4.0), x)
    assert y[0, 0, 0, 1] == -math.inf and math.isclose(y[0, 0, 0, 2], math.log(5.0))
    assert math.isnan(y[0, 0, 0, 0])  # log of a negative: NaN


def test_window_geometry_and_clamp_adjoint() -> None:
    """1x1 window: destination (u, v) reads source (offset + u - clip.x, ...) by the edge rule."""
    gen = torch.Generator().manual_seed(63)
    dev = m.Device("cpu")
    desc = m.NeuronDescriptor(T.TANH, a=1.0, b=0.5)
    for edge in (m.EdgeMode.ZERO, m.EdgeMode.CLAMP):
        neuron, grad = m.Neuron(dev, desc), m.NeuronGradient(dev, desc)
        neuron.edge_mode = edge
        neuron.offset = m.Offset(-1, 2, 0)
        neuron.clip_rect = m.Region.make(1, 0, 4, 3)
        neuron.source_feature_channel_offset = 1
        neuron.source_feature_channel_max_count = 2
        neuron.destination_feature_channel_offset = 3
        x = torch.randn(1, 4, 4, 3, generator=gen, dtype=torch.float64)
        dst0 = torch.randn(1, 6, 5, 6, generator=gen, dtype=torch.float64)

        def fwd(xx, neuron=neuron, dst0=dst0):
            dst = m.Image.from_tensor(dst0.clone())
            cb = dev.new_command_queue().command_buffer()
            neuron.encode(cb, m.Image.from_tensor(xx), dst)
            run(cb)
            return dst.tensor

        want = dst0.clone()
        for u in range(1, 5):  # clip x in [1, 5) within a 6-wide destination
            for v in range(0, 3):
                sx, sy = -1 + (u - 1), 2 + v
                inside = 0 <= sx < 3 and 0 <= sy < 4
                if inside or edge is m.EdgeMode.CLAMP:
                    val = x[0, 1:3, min(max(sy, 0), 3), min(max(sx, 0), 2)]
                else:
                    val = torch.zeros(2, dtype=torch.float64)
                want[0, 3:5, v, u] = torch.tanh(0.5 * val)
        assert_close(fwd(x), want, f"neuron geometry {edge.name}", tol=1e-14)
        vdir = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        cot = torch.randn(dst0.shape, generator=gen, dtype=torch.float64)
        jv = (fwd(x + 1e-6 * vdir) - fwd(x - 1e-6 * vdir)) / 2e-6
        cb = dev.new_command_queue().command_buffer()
        state = neuron.result_state(m.Image.from_tensor(x))
        neuron.encode(cb, m.Image.from_tensor(x), m.Image.from_tensor(dst0.clone()), state)
        dx = grad.encode(cb, m.Image.from_tensor(cot), m.Image.from_tensor(x), state)
        run(cb)
        assert dx.tensor[:, [0, 3]].abs().max() == 0  # channels not read get 0
        assert_adjoint(jv, cot, vdir, dx.tensor, f"neuron geometry adjoint {edge.name}", tol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", [T.RELU, T.TANH, T.GELU], ids=lambda t: t.name)
def test_convolution_fused_neuron_trains_through_a_separate_neuron_gradient(kind, device) -> None:
    gen = torch.Generator().manual_seed(64)
    dev = m.Device(device)
    kwargs, ref = CASES[kind]
    neuron = m.NeuronDescriptor(kind, **kwargs)
    desc = m.ConvolutionDescriptor(3, 3, 2, 4, 2, 2, fused_neuron_descriptor=neuron)
    w = torch.randn(desc.weights_shape, generator=gen, dtype=torch.float64)
    b = torch.randn(4, generator=gen, dtype=torch.float64)
    ds = m.TensorConvolutionDataSource(desc, w, b)
    conv, cgrad, ngrad = (
        m.Convolution(dev, ds),
        m.ConvolutionGradient(dev, ds),
        m.NeuronGradient(dev, neuron),
    )
    x = torch.randn(2, 2, 9, 8, generator=gen, dtype=torch.float64).to(device)
    src = m.Image.from_tensor(x)
    cb = dev.new_command_queue().command_buffer()
    state = conv.result_state(src)
    y = conv.encode(cb, src, destination_state=state)
    g = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(device)
    dz = ngrad.encode(cb, m.Image.from_tensor(g), y, state)
    dx = cgrad.encode(cb, dz, src, state)
    run(cb)
    gw, gb = state.gradient_for_weights, state.gradient_for_biases
    # a temporary state is read twice: by the neuron gradient and by the convolution gradient
    cb = dev.new_command_queue().command_buffer()
    tmp = conv.temporary_result_state(cb, src)
    tmp.read_count = 2
    y2 = conv.encode(cb, src, destination_state=tmp)
    dz2 = ngrad.encode(cb, m.Image.from_tensor(g), y2, tmp)
    assert tmp.read_count == 1
    cgrad.encode(cb, dz2, src, tmp)
    assert tmp.read_count == 0
    run(cb)
    xr, wr, br = (
        x.cpu().requires_grad_(),
        w.permute(0, 3, 1, 2).clone().requires_grad_(),
        b.clone().requires_grad_(),
    )
    out = ref(F.conv2d(xr, wr, br, stride=2, padding=1))
    out.backward(g.cpu())
    assert_close(y.tensor, out.detach(), f"fused {kind.name} forward", tol=1e-13)
    assert_close(dx.tensor, xr.grad, "data gradient through the fused neuron", tol=1e-12)
    assert_close(gw, wr.grad.permute(0, 2, 3, 1), "weight gradient", tol=1e-12)
    assert_close(gb, br.grad, "bias gradient", tol=1e-12)


def test_neuron_errors() -> None:
    with pytest.raises(
        ValueError,
        match=r"\[NeuronDescriptor\] PRELU needs data \(one slope per channel\), got None",
    ):
        m.NeuronDescriptor(T.PRELU)
    with pytest.raises(
        ValueError, match=r"\[NeuronDescriptor\] data is for PRELU only, got data for RELU"
    ):
        m.NeuronDescriptor(T.RELU, data=[1.0])
    with pytest.raises(
        ValueError,
        match=r"\[NeuronDescriptor\] the EXPONENTIAL base c must be -1 \(e\) or positive, got 0.0",
    ):
        m.NeuronDescriptor(T.EXPONENTIAL, c=0.0)
    with pytest.raises(
        ValueError,
        match=r"\[NeuronDescriptor\] the LOGARITHM base c must be -1 \(e\) or positive and not 1, got 1.0",
    ):
        m.NeuronDescriptor(T.LOGARITHM, c=1.0)
    with pytest.raises(TypeError, match=r"\[NeuronDescriptor\] a must be a number, got str"):
        m.NeuronDescriptor(T.RELU, a="0.1")
    with pytest.raises(ValueError, match=r"\[NeuronDescriptor\] b must be finite, got inf"):
        m.NeuronDescriptor(T.LINEAR, b=math.inf)
    dev = m.Device("cpu")
    with pytest.raises(
        TypeError, match=r"\[Neuron\] neuron_descriptor must be a NeuronDescriptor, got NeuronType"
    ):
        m.Neuron(dev, T.RELU)
    prelu = m.Neuron(dev, m.NeuronDescriptor(T.PRELU, data=[0.1, 0.2]))
    with pytest.raises(
        ValueError, match=r"\[Neuron\] PRELU needs one slope per channel read \(3\), got 2 slopes"
    ):
        prelu.encode(
            dev.new_command_queue().command_buffer(), m.Image.from_tensor(torch.zeros(1, 3, 2, 2))
        )
    relu = m.Neuron(dev, m.NeuronDescriptor(T.RELU))
    x = m.Image.from_tensor(torch.randn(1, 2, 3, 3))
    cb = dev.new_command_queue().command_buffer()
    state = relu.result_state(x)
    y = relu.encode(cb, x, destination_state=state)
    with pytest.raises(
        ValueError, match=r"\[NeuronGradient\] neuron_descriptor must equal the forward neuron's"
    ):
        m.NeuronGradient(dev, m.NeuronDescriptor(T.RELU, a=0.1)).encode(cb, y, x, state)


def test_fused_neuron_gradient_batch_needs_the_convolutions_one_state() -> None:
    dev = m.Device("cpu")
    gen = torch.Generator().manual_seed(8)
    neuron = m.NeuronDescriptor(T.RELU)
    desc = m.ConvolutionDescriptor(3, 3, 2, 4, fused_neuron_descriptor=neuron)
    w = torch.randn(desc.weights_shape, generator=gen, dtype=torch.float64)
    conv = m.Convolution(dev, m.TensorConvolutionDataSource(desc, w))
    xb = m.ImageBatch.from_tensor(torch.randn(2, 2, 5, 5, generator=gen, dtype=torch.float64))
    cb = dev.new_command_queue().command_buffer()
    states = conv.result_state_batch(xb)
    yb = conv.encode_batch(cb, xb, destination_states=states)
    other = conv.result_state_batch(xb)
    conv.encode_batch(cb, xb, destination_states=other)
    g = m.ImageBatch.from_tensor(torch.randn(yb.shape, generator=gen, dtype=torch.float64))
    with pytest.raises(
        ValueError,
        match=r"\[NeuronGradient\] gradient_states must repeat one state "
        r"\(see result_state_batch\), got 2 distinct states",
    ):
        m.NeuronGradient(dev, neuron).encode_batch(cb, g, yb, m.StateBatch([states[0], other[0]]))
    with pytest.raises(
        TypeError, match=r"\[NeuronGradient\] destination_gradients must be an ImageBatch"
    ):
        m.NeuronGradient(dev, neuron).encode_batch(cb, g, yb, states, g.image)
    assert len(cb) == 2  # the two forwards, nothing from the refused gradients
