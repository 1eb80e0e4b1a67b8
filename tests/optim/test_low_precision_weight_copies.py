"""A kernel's float16/bfloat16 weight copies are tensors of its masters (`ConvWeights`),
rewritten in place by the work that writes the masters (reloads now and on a command buffer,
the multi-kernel reload a training step's optimizer update ends with, checkpoint loads), and
read by the forward with no version check. Each copy holds the bits of ``w.to(dtype)`` in the
layout the convolutions read."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from mpsnn.cnn.convolution.kernels import reload_weights_and_biases
from mpsnn.cnn.convolution.weights import ConvWeights
from mpsnn.core.layout import channels_last_preferred
from mpsnn.models import LeNet5
from tests.helpers import DEVICES, run

LOW = [torch.bfloat16, torch.float16]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _kernel(kind, dev: m.Device, seed: int = 0, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    desc = m.ConvolutionDescriptor(3, 3, 4, 6) if kind is m.Convolution else (
        m.ConvolutionDescriptor(2, 2, 3, 5)
    )  # fmt: skip
    w = torch.randn(desc.weights_shape, generator=gen)
    b = torch.randn(desc.output_feature_channels, generator=gen) if bias else None
    return kind(dev, m.TensorConvolutionDataSource(desc, w, b)), desc


def _expected(ws, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the copies must hold: today's cast of the current masters, bit for bit."""
    w = ws.weight
    if ws.channels_last_casts and w.dim() == 4:
        # the layout that dtype runs in on the device: NCHW for a CPU half cast, even of the
        # CPU's channels-last float32 masters
        cl = channels_last_preferred(dtype, w.device)
        want = w.to(dtype, memory_format=torch.channels_last if cl else torch.contiguous_format)
    else:  # a fully connected layer's: OIHW-contiguous, whatever its masters' order
        want = w.to(dtype, memory_format=torch.contiguous_format)
    return want, None if ws.bias is None else ws.bias.to(dtype)


def _check_copies(ws, dtype: torch.dtype) -> None:
    got_w, got_b = ws.cast(dtype)
    want_w, want_b = _expected(ws, dtype)
    assert got_w.dtype == dtype and got_w.stride() == want_w.stride()
    assert torch.equal(got_w, want_w)
    assert (got_b is None) == (want_b is None)
    if got_b is not None:
        assert torch.equal(got_b, want_b)


def _new_state(dev: m.Device, desc, seed: int, cb=None, bias: bool = True):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(desc.weights_shape, generator=gen).to(dev.torch_device)
    b = torch.randn(desc.output_feature_channels, generator=gen).to(dev.torch_device)
    return m.ConvolutionWeightsAndBiasesState(w, b if bias else None, command_buffer=cb)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("kind", [m.Convolution, m.FullyConnected], ids=lambda k: k.__name__)
def test_every_reload_rewrites_the_copies_in_place(kind, dtype, device) -> None:
    """The copy is one tensor for the kernel's life: each reload (now, recorded, several
    kernels at once) writes the new values into it, with the bits of a fresh cast."""
    dev = m.Device(device)
    k, desc = _kernel(kind, dev, seed=1)
    ws = k._weights
    w0, b0 = ws.cast(dtype)
    _check_copies(ws, dtype)
    q = dev.new_command_queue()

    k.data_source.set_weights_and_biases(_new_state(dev, desc, 2).weights.cpu(), torch.ones(
        desc.output_feature_channels
    ))  # fmt: skip
    k.reload_weights_and_biases_from_data_source()  # now
    _check_copies(ws, dtype)

    cb = q.command_buffer()
    k.reload_weights_and_biases(cb, _new_state(dev, desc, 3, cb))  # recorded
    _check_copies(ws, dtype)  # not yet run: the copies still hold the masters' values
    run(cb)
    _check_copies(ws, dtype)
    assert torch.equal(ws.weight, _new_state(dev, desc, 3).weights.permute(0, 3, 1, 2))

    cb = q.command_buffer()
    reload_weights_and_biases(cb, [(k, _new_state(dev, desc, 4, cb))])  # the multi-kernel form
    run(cb)
    _check_copies(ws, dtype)
    w1, b1 = ws.cast(dtype)
    assert w1 is w0 and b1 is b0  # the same tensors, written in place


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_the_forward_reads_the_copy_without_a_version_check(dtype) -> None:
    """An in-place write into the masters by anything but a reload (here ``kernel.weights``)
    reaches float16/bfloat16 work at the next reload, as a kernel sees its data source's new
    values at reload in MPS; float32 work reads the masters themselves."""
    dev = m.Device("cpu")
    conv, _ = _kernel(m.Convolution, dev, seed=5)
    ws = conv._weights
    x = torch.randn(2, 4, 5, 5)
    q = dev.new_command_queue()

    def forward(t: torch.Tensor) -> torch.Tensor:
        cb = q.command_buffer()
        y = conv.encode_batch(cb, m.ImageBatch.from_tensor(t))
        run(cb)
        return y.tensor

    before = forward(x.to(dtype))
    held = ws.cast(dtype)[0].clone()
    conv.weights.zero_()  # not a writer of the copies
    assert torch.equal(ws.cast(dtype)[0], held)
    assert torch.equal(forward(x.to(dtype)), before)
    b = conv.biases.view(1, -1, 1, 1).expand(2, -1, 5, 5)
    assert torch.equal(forward(x), b)  # float32 work reads the masters
    conv.reload_weights_and_biases_from_data_source()
    _check_copies(ws, dtype)
    assert torch.equal(forward(x.to(dtype)), before)  # the data source's values again


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_a_layer_gaining_or_losing_its_bias_keeps_its_copies_in_step(dtype) -> None:
    """A reload of a state with biases into a layer without (it gains one), and a checkpoint
    load of a layer without biases (``masters.bias = None``): the copies follow."""
    dev = m.Device("cpu")
    conv, desc = _kernel(m.Convolution, dev, seed=6, bias=False)
    ws = conv._weights
    assert ws.cast(dtype)[1] is None
    cb = dev.new_command_queue().command_buffer()
    conv.reload_weights_and_biases(cb, _new_state(dev, desc, 7, cb))  # gains a bias
    run(cb)
    _check_copies(ws, dtype)
    assert ws.cast(dtype)[1] is not None
    ws.load_ohwi(_new_state(dev, desc, 8).weights, None)
    ws.bias = None  # what a load of a layer saved without biases does
    _check_copies(ws, dtype)
    assert ws.cast(dtype)[1] is None


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_training_steps_keep_the_copies_equal_to_the_masters(mode, monkeypatch) -> None:
    """Steps of a bfloat16 training graph (optimizer update, then the reload of every layer):
    after each, every layer's copy holds the cast of its masters."""
    masters: list[ConvWeights] = []  # the training graph's kernels'
    made = ConvWeights.__init__

    def init(self, weight, bias) -> None:
        masters.append(self)
        made(self, weight, bias)

    monkeypatch.setattr(ConvWeights, "__init__", init)
    dev = m.Device("cpu")
    opt = m.SGD(dev, momentum_scale=0.9, descriptor=m.OptimizerDescriptor(learning_rate=0.1))
    model = LeNet5(dev, opt, seed=3)
    graph = model.training_graph(2, storage=m.FeatureChannelFormat.BFLOAT16)
    q = dev.new_command_queue()
    step = graph.compile(q) if mode == "compiled" else None
    gen = torch.Generator().manual_seed(9)
    copies: list[torch.Tensor] = []
    for _ in range(3):
        images = [m.ImageBatch.from_tensor(torch.randn(2, 1, 28, 28, generator=gen))]
        labels = [m.LossLabels(dev, torch.randint(0, 10, (2, 1, 1), generator=gen))]
        if step is None:
            cb = q.command_buffer()
            graph.encode_batch(cb, images, labels)
            run(cb)
        else:
            step(images, labels)
            step.wait_until_completed()
        if not copies:
            # every layer but the first, which reads the float32 input images
            assert sorted(torch.bfloat16 in ws._casts for ws in masters) == [False] + [True] * 4
            masters[:] = [ws for ws in masters if torch.bfloat16 in ws._casts]
            copies = [ws.cast(torch.bfloat16)[0] for ws in masters]
        for ws, copy in zip(masters, copies, strict=True):
            _check_copies(ws, torch.bfloat16)
            assert ws.cast(torch.bfloat16)[0] is copy


@needs_cuda
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_a_replayed_reload_rewrites_the_copies(dtype) -> None:
    """A captured command buffer that reloads the weights and then runs the forward: every
    replay rewrites the copies (recorded work), so the forward reads the state's new values,
    with no host check. The multi-kernel copy gives the bits of a fresh cast on CUDA too."""
    dev = m.Device("cuda")
    conv, desc = _kernel(m.Convolution, dev, seed=10)
    fc, fc_desc = _kernel(m.FullyConnected, dev, seed=11)
    q = dev.new_command_queue()
    x = m.ImageBatch.from_tensor(torch.randn(2, 4, 5, 5, device="cuda").to(dtype))
    cb = q.command_buffer()
    conv.encode_batch(cb, x)  # warm-up: makes the copies
    run(cb)
    state = _new_state(dev, desc, 12)
    fc_state = _new_state(dev, fc_desc, 13)
    cb = q.command_buffer()
    reload_weights_and_biases(cb, [(conv, state), (fc, fc_state)])
    y = conv.encode_batch(cb, x)
    captured = cb.capture()
    for seed in (14, 15):
        new = _new_state(dev, desc, seed)
        state._oihw.copy_(new._oihw)
        state._biases.copy_(new._biases)
        captured.replay()
        captured.wait_until_completed()
        _check_copies(conv._weights, dtype)
        w, b = _expected(conv._weights, dtype)
        want = F.conv2d(x.tensor, w, b, padding=1)
        assert torch.equal(y.tensor, want)
    fc._weights.cast(dtype)
    cb = q.command_buffer()
    reload_weights_and_biases(cb, [(conv, state), (fc, fc_state)])
    run(cb)
    _check_copies(fc._weights, dtype)  # the multi-tensor copy of contiguous copies
