"""CPU float32 storage is channels-last (`mpsnn.core.layout`): convolutions run on
channels-last operands and masters (OHWI memory, MPS's own weight order), their results,
weight gradients and optimizer state keep that layout, and disjoint max pooling of
channels-last data takes PyTorch's channels-last kernel in the bits of the NCHW tile path.
Values and shapes stay NCHW; float64 (the reference precision) stays NCHW."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from mpsnn.core.geometry import AxisWindow, EdgeMode
from mpsnn.core.layout import channels_last_preferred, storage_layout
from mpsnn.ops import pooling as P
from mpsnn.ops.optim_hyper import UpdateRule, init_state
from mpsnn.ops.pooling import PoolGeometry, pool_geometry

CPU = m.Device("cpu")
CL = torch.channels_last


def _cl(t: torch.Tensor) -> bool:
    return t.is_contiguous(memory_format=CL) and (t.shape[1] == 1 or not t.is_contiguous())


def _run(cb: m.CommandBuffer) -> None:
    cb.commit()
    cb.wait_until_completed()


def test_the_policy_is_channels_last_for_cpu_float32_only() -> None:
    cpu = torch.device("cpu")
    assert channels_last_preferred(torch.float32, cpu)
    assert storage_layout(torch.float32, cpu) is CL
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        assert not channels_last_preferred(dtype, cpu)


def _conv(cin: int, cout: int, seed: int = 0) -> tuple[m.Convolution, m.ConvolutionGradient]:
    g = torch.Generator().manual_seed(seed)
    desc = m.ConvolutionDescriptor(3, 3, cin, cout)
    ds = m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape, generator=g) * 0.2,
                                       torch.randn(cout, generator=g))  # fmt: skip
    return m.Convolution(CPU, ds), m.ConvolutionGradient(CPU, ds)


@pytest.mark.parametrize("cin", [1, 3])
def test_a_convolution_runs_on_channels_last_operands_and_keeps_them(cin: int) -> None:
    """One input channel too: NCHW memory is channels-last memory there, and the result is
    channels-last like the others (PyTorch reads the strides to choose the result's)."""
    conv, _ = _conv(cin, 8)
    assert _cl(conv._weights.weight)
    x = torch.randn(2, cin, 7, 6, dtype=torch.float64).float()  # NCHW, as a client gives it
    cb = CPU.new_command_queue().command_buffer()
    y = conv.encode(cb, m.Image.from_tensor(x))
    _run(cb)
    out = y.tensor
    assert out.shape == (2, 8, 7, 6) and _cl(out)
    ref = F.conv2d(x.double(), conv._weights.weight.double(), conv._weights.bias.double(),
                   padding=1)  # fmt: skip
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_fully_connected_masters_take_the_data_sources_order() -> None:
    """A convolution's float32 CPU masters are channels-last; a fully connected layer's take
    its data source's order (its matrix is a view of them): OHWI memory for a contiguous OHWI
    tensor, OIHW-contiguous for an OHWI view of OIHW storage (as mpsnn's models give)."""
    desc = m.ConvolutionDescriptor(3, 3, 4, 5)
    ohwi = torch.randn(desc.weights_shape)
    for weights, want_cl in ((ohwi, True), (ohwi.permute(0, 3, 1, 2).contiguous()
                                            .permute(0, 2, 3, 1), False)):  # fmt: skip
        ds = m.TensorConvolutionDataSource(desc, weights, torch.randn(5))
        fc = m.FullyConnected(CPU, ds)
        conv = m.Convolution(CPU, ds)
        assert _cl(fc._weights.weight) is want_cl
        assert fc._weights.weight.is_contiguous() is not want_cl
        assert _cl(conv._weights.weight)
        assert torch.equal(fc._weights.weight, conv._weights.weight)


def test_the_weight_gradient_keeps_the_masters_layout_and_values() -> None:
    conv, grad = _conv(3, 4, seed=1)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 3, 6, 6, generator=gen)
    gy = torch.randn(3, 4, 6, 6, generator=gen)
    q = CPU.new_command_queue()
    cb = q.command_buffer()
    src = m.ImageBatch.from_tensor(x)
    states = conv.result_state_batch(src)
    conv.encode_batch(cb, src, destination_states=states)
    grad.encode_batch(cb, m.ImageBatch.from_tensor(gy), src, states)
    _run(cb)
    state = states[0]
    dw = state._sum(0)
    assert _cl(dw)  # oneDNN's channels-last gradient, kept: no conversion back and forth
    w = conv._weights.weight.double().requires_grad_()
    F.conv2d(x.double(), w, None, padding=1).backward(gy.double())
    torch.testing.assert_close(dw.double(), w.grad, rtol=1e-5, atol=1e-5)
    # the public OHWI view of the gradient is contiguous memory
    assert state.gradient_for_weights.is_contiguous()


def test_the_optimizer_state_follows_the_weights_layout() -> None:
    w = torch.randn(4, 3, 3, 3).contiguous(memory_format=CL)
    (mom,) = init_state(UpdateRule.SGD_MOMENTUM, w)
    assert mom.stride() == w.stride() and not mom.any()
    m1, m2 = init_state(UpdateRule.ADAM, torch.randn(4, 3, 3, 3))
    assert m1.is_contiguous() and m2.is_contiguous()  # contiguous weights: contiguous state


def _geometry(h: int, w: int, k: int) -> PoolGeometry:
    """Disjoint ``k x k`` windows over the whole windows of an ``h x w`` image."""
    return pool_geometry(AxisWindow(0, h // k, k, k, 1, h), AxisWindow(0, w // k, k, k, 1, w),
                         EdgeMode.CLAMP)  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("channels", [2, 5])
def test_max_pooling_of_channels_last_data_gives_the_nchw_paths_bits(channels: int) -> None:
    """Ties, signed zeros and NaNs: the channels-last kernel and the NCHW tile path take the
    first maximum in raster order (the last NaN), and route the gradient there."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-2, 3, (2, channels, 8, 7), generator=gen).float()  # many ties
    x[0, 0, 0, 0] = -0.0
    x[0, 0, 0, 1] = 0.0
    x[1, 1, 2, 2] = float("nan")
    x[1, 1, 3, 3] = float("nan")
    geom = _geometry(8, 7, 2)
    assert P._cpu_tiles(x, geom)
    y_nchw, tap = P.max_pool_forward_argmax(x, geom)
    xc = x.contiguous(memory_format=CL)
    y_cl, index = P.max_pool_forward_argmax(xc, geom)
    assert _cl(y_cl)
    assert torch.equal(_bits(y_nchw), _bits(y_cl))
    g = torch.randn(y_nchw.shape, generator=gen)
    dx_nchw = P.max_pool_backward(g, x, geom, tap)
    dx_cl = P.max_pool_backward(g.contiguous(memory_format=CL), xc, geom, index)
    dx_again = P.max_pool_backward(g, xc, geom)  # the argmax found again
    assert torch.equal(_bits(dx_nchw), _bits(dx_cl))
    assert torch.equal(_bits(dx_nchw), _bits(dx_again))
    assert torch.equal(_bits(dx_nchw), _bits(P.max_pool_backward_portable(g, x, geom)))
