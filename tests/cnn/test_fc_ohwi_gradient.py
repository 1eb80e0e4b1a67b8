"""A fully connected layer computes in its weights' memory order. Where its data source keeps
OHWI memory (MPS's order, as Apple's sample does), the CPU's float32 masters are made
channels-last (OHWI memory): the forward reads channels-last ``x`` through a view, dx comes
out channels-last and dW in OHWI memory, so reloads, updates and gradients need no reordering
copy. The sums are the same up to their order (the two orders round apart in the last place)."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
import mpsnn.cnn.convolution.gradients as conv_gradients
from benchmarks.bench_apple_step import _port
from mpsnn.cnn.convolution.kernels import reload_weights_and_biases
from mpsnn.core.layout import channels_last_only
from mpsnn.ops.convolution import fc_backward, fc_forward, fc_matrix


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Sums of many terms in two orders: equal to float32 rounding of their size."""
    assert got.shape == want.shape
    assert (got - want).norm() <= 1e-6 * want.norm() + 1e-30


SHAPES = [(40, 1024, 64, 7, 7), (3, 5, 4, 6, 4), (2, 7, 3, 3, 3), (5, 6, 1, 4, 4), (4, 9, 8, 1, 1)]


@pytest.mark.parametrize(("n", "o", "c", "h", "k"), SHAPES)
@pytest.mark.parametrize("x_channels_last", [False, True])
def test_the_two_orders_hold_the_same_sums(n, o, c, h, k, x_channels_last) -> None:
    gen = torch.Generator().manual_seed(n * o + c)
    x = torch.randn(n, c, h, h, generator=gen)
    if x_channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    g = torch.randn(n, o, 1, 1, generator=gen)
    w = torch.randn(o, c, k, k, generator=gen)
    b = torch.randn(o, generator=gen)
    wcl = w.contiguous(memory_format=torch.channels_last)  # OHWI memory
    spread = k * k > 1 and c > 1  # else the two orders are one memory order
    assert channels_last_only(wcl) is spread
    want, got = fc_forward(x, w, b), fc_forward(x, wcl, b, fc_matrix(wcl))
    close(got, want)
    want, got = fc_backward(g, x, w), fc_backward(g, x, wcl)
    for a, e in zip(got, want, strict=True):
        close(a, e)
    assert torch.equal(got[2], want[2])  # the bias sums: one order
    if spread:
        assert channels_last_only(got[1])  # dW in OHWI memory
        assert channels_last_only(got[0]) or h == 1  # dx channels-last
        assert got[0]._base is None  # a new tensor an image adopts, not a view
    else:
        assert got[1].is_contiguous()


def _fc(ohwi_memory: bool, dtype: torch.dtype = torch.float32) -> m.FullyConnected:
    desc = m.ConvolutionDescriptor(3, 3, 4, 6)
    gen = torch.Generator().manual_seed(2)
    ohwi = torch.randn(6, 4, 3, 3, generator=gen, dtype=dtype).permute(0, 2, 3, 1)  # OIHW mem
    weights = ohwi.contiguous() if ohwi_memory else ohwi
    return m.FullyConnected(m.Device("cpu"), m.TensorConvolutionDataSource(desc, weights))


@pytest.mark.parametrize("ohwi_memory", [False, True])
def test_the_masters_take_the_data_sources_order(ohwi_memory: bool, tmp_path) -> None:
    """float32 CPU masters are channels-last where the data source keeps OHWI memory, OIHW
    otherwise (and for float64, the verification precision); reloads from states of either
    order copy the values into them where they are; a saved and loaded kernel takes its
    rebuilt data source's order."""
    fc = _fc(ohwi_memory)
    ws = fc._weights
    assert channels_last_only(ws.weight) is ohwi_memory
    assert ws.weight.is_contiguous() or ohwi_memory
    assert _fc(True, torch.float64)._weights.weight.is_contiguous()
    dev = m.Device("cpu")
    queue = dev.new_command_queue()
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(6, 3, 3, 4, generator=gen)
    states = [
        m.ConvolutionWeightsAndBiasesState(values.clone(), None),  # OHWI memory
        m.ConvolutionWeightsAndBiasesState(values.permute(0, 3, 1, 2).contiguous()
                                           .permute(0, 2, 3, 1), None),  # OIHW memory
    ]  # fmt: skip
    before = ws.weight
    for state in states:
        for grouped in (False, True):
            ws.weight.zero_()
            cb = queue.command_buffer()
            if grouped:
                reload_weights_and_biases(cb, [(fc, state)])
            else:
                fc.reload_weights_and_biases(cb, state)
            cb.commit()
            assert ws.weight is before and torch.equal(fc.weights, values)
    m.save(fc, tmp_path / "fc.mpsnn")
    loaded = m.load(tmp_path / "fc.mpsnn")
    assert channels_last_only(loaded._weights.weight) is ohwi_memory
    assert torch.equal(loaded.weights, fc.weights)


def _train(steps: int, ohwi_masters: bool, monkeypatch) -> tuple[list[torch.Tensor], int]:
    """``steps`` steps of the port of Apple's sample (its data sources keep OHWI memory and
    run Adam on it), its fully connected kernels' masters in OHWI memory (as made) or made
    OIHW-contiguous (the order before); the weights, and how many weight gradients lay in
    OHWI memory."""
    plain = conv_gradients.fc_backward
    made = []

    def spy(*a):
        out = plain(*a)
        made.append(out[1] is not None and channels_last_only(out[1]))
        return out

    monkeypatch.setattr(conv_gradients, "fc_backward", spy)
    a = _port()
    dev = m.Device("cpu")
    names = ("conv1", "conv2", "fc1", "fc2")
    params = a.initial_parameters(0)
    sources = [a.AdamDataSource(dev, w, b, nm) for (w, b), nm in zip(params, names, strict=True)]
    exits = a.build_network(sources, training=True).training_graph(None, a.gradients_in_float32)
    graph = m.Graph(dev, exits[0].result_image, True)
    graph.format = m.FeatureChannelFormat.FLOAT32
    if not ohwi_masters:  # before anything reads them
        for kernel in graph._plan.kernels.values():
            if type(kernel) is m.FullyConnected:
                kernel._weights.weight = kernel._weights.weight.contiguous()
    queue = dev.new_command_queue()
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 256, (a.BATCH, 1, 28, 28), dtype=torch.uint8, generator=gen)
        y = torch.randint(0, a.CLASSES, (a.BATCH,), generator=gen)
        onehot = torch.zeros(a.BATCH, a.LABEL_CHANNELS, 1, 1)
        onehot[torch.arange(a.BATCH), y] = 1.0
        labels = m.StateBatch(m.LossLabels(dev, onehot[i]) for i in range(a.BATCH))
        cb = queue.command_buffer()
        graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)], [labels])
        cb.commit()
        cb.wait_until_completed()
    monkeypatch.undo()
    weights = [t.clone() for s in sources for t in (s.weights(), s.bias_terms()) if t is not None]
    return weights, sum(made)


def test_apples_program_trains_alike_in_either_order(monkeypatch) -> None:
    """Three training steps of the port with its fully connected masters in its data sources'
    OHWI order and in OIHW order: the first fully connected layer's gradient lies in OHWI
    memory in the first case only, and the weights agree to float32 rounding (as Adam
    carries it)."""
    got, ohwi = _train(3, True, monkeypatch)
    want, none = _train(3, False, monkeypatch)
    assert (ohwi, none) == (3, 0)  # the first fully connected layer's, once per step
    assert len(got) == len(want) == 8
    for a, b in zip(got, want, strict=True):
        # Adam's normalized step is as sensitive as its smallest gradients: an element whose
        # gradient is near 0 may move by part of a step (the rate, 1e-3) differently
        assert (a - b).norm() <= 1e-5 * b.norm()
        assert (a - b).abs().max() <= 1e-3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_other_image_formats_read_oihw_casts(dtype: torch.dtype) -> None:
    """The casts of OHWI-memory masters for float64, float16 and bfloat16 images are
    OIHW-contiguous (such images are NCHW on the CPU): the layer computes in the (c, h, w)
    order there, the bits of a layer with OIHW masters."""
    fc_ohwi, fc_oihw = _fc(True), _fc(False)
    assert torch.equal(fc_ohwi.weights, fc_oihw.weights)
    cast, _ = fc_ohwi._weights.cast(dtype)
    assert cast.is_contiguous()
    x = torch.randn(3, 4, 3, 3, generator=torch.Generator().manual_seed(4)).to(dtype)
    outs = []
    for fc in (fc_ohwi, fc_oihw):
        cb = m.Device("cpu").new_command_queue().command_buffer()
        y = fc.encode_batch(cb, m.ImageBatch.from_tensor(x))
        cb.commit()
        cb.wait_until_completed()
        outs.append(y.tensor)
    assert torch.equal(outs[0], outs[1])


def test_vmap_over_the_input_gradient_of_ohwi_weights() -> None:
    """The input gradient for channels-last weights writes a fresh tensor through ``out=``
    (no batching rule): under a ``torch.func`` transform it takes the product's view."""
    from torch import func

    gen = torch.Generator().manual_seed(6)
    w = torch.randn(5, 4, 3, 3, generator=gen).contiguous(memory_format=torch.channels_last)
    x = torch.randn(2, 4, 3, 3, generator=gen)
    g = torch.randn(3, 2, 5, 1, 1, generator=gen)  # mapped over its first dimension
    got = func.vmap(lambda gi: fc_backward(gi, x, w, True, False)[0])(g)
    want = torch.stack([fc_backward(gi, x, w, True, False)[0] for gi in g])
    torch.testing.assert_close(got, want)
