"""A fully connected layer whose data source holds its weights in OHWI memory (MPS's order,
as Apple's sample does) gets its float32 weight gradient in that order on the CPU: the same
sums over the batch, laid out so that the update reads them without a copy. The layout of the
data source is noted wherever the kernel takes its weights from it or from a state."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
import mpsnn.cnn.convolution.gradients as conv_gradients
from benchmarks.bench_apple_step import _port
from mpsnn.cnn.convolution.kernels import reload_weights_and_biases
from mpsnn.core.layout import channels_last_only
from mpsnn.ops.convolution import fc_backward

SHAPES = [(40, 1024, 64, 7, 7), (3, 5, 4, 6, 4), (2, 7, 3, 3, 3), (5, 6, 1, 4, 4), (4, 9, 8, 1, 1)]


@pytest.mark.parametrize(("n", "o", "c", "h", "k"), SHAPES)
@pytest.mark.parametrize("channels_last", [False, True])
def test_the_ohwi_order_holds_the_same_sums(n, o, c, h, k, channels_last) -> None:
    gen = torch.Generator().manual_seed(n * o + c)
    x = torch.randn(n, c, h, h, generator=gen)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    g = torch.randn(n, o, 1, 1, generator=gen)
    w = torch.randn(o, c, k, k, generator=gen)
    want = fc_backward(g, x, w)
    got = fc_backward(g, x, w, ohwi=True)
    # the same sums over the batch; the BLAS may round some elements of some shapes apart
    torch.testing.assert_close(got[1], want[1], rtol=2e-6, atol=1e-6)
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    if k * k > 1 and c > 1:
        assert channels_last_only(got[1])  # OHWI memory
    else:  # one pixel or one channel: the two orders are one memory order
        assert got[1].is_contiguous()


def test_float64_keeps_the_default_order() -> None:
    """float64, the verification precision, is computed as without the flag (bits and
    layout), so that a verification run does not depend on the data source's layout."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 16, 5, 5, generator=gen, dtype=torch.float64)
    g = torch.randn(3, 12, 1, 1, generator=gen, dtype=torch.float64)
    w = torch.randn(12, 16, 5, 5, generator=gen, dtype=torch.float64)
    got, want = fc_backward(g, x, w, ohwi=True)[1], fc_backward(g, x, w)[1]
    assert got.is_contiguous() and torch.equal(got, want)


def _fc(ohwi_source: bool) -> tuple[m.FullyConnected, m.ConvolutionDescriptor]:
    desc = m.ConvolutionDescriptor(3, 3, 4, 6)
    gen = torch.Generator().manual_seed(2)
    oihw = torch.randn(6, 4, 3, 3, generator=gen)
    weights = oihw.permute(0, 2, 3, 1)  # an OHWI view of OIHW memory
    if ohwi_source:
        weights = weights.contiguous()  # OHWI memory
    ds = m.TensorConvolutionDataSource(desc, weights, torch.zeros(6))
    return m.FullyConnected(m.Device("cpu"), ds), desc


@pytest.mark.parametrize("ohwi_source", [False, True])
def test_the_flag_follows_each_way_weights_arrive(ohwi_source: bool, tmp_path) -> None:
    fc, desc = _fc(ohwi_source)
    ws = fc._weights
    assert ws.source_ohwi is ohwi_source  # made from the data source
    dev = m.Device("cpu")
    queue = dev.new_command_queue()
    oihw_state = m.ConvolutionWeightsAndBiasesState.from_descriptor(dev, desc)
    ohwi_state = m.ConvolutionWeightsAndBiasesState(torch.zeros(6, 3, 3, 4), torch.zeros(6))
    for state, want in ((ohwi_state, True), (oihw_state, False)):
        cb = queue.command_buffer()
        fc.reload_weights_and_biases(cb, state)  # one kernel's reload
        cb.commit()
        assert ws.source_ohwi is want
        cb = queue.command_buffer()
        reload_weights_and_biases(cb, [(fc, ohwi_state if not want else oihw_state)])  # grouped
        cb.commit()
        assert ws.source_ohwi is (not want)
    fc.reload_weights_and_biases_from_data_source()  # back to the data source's order
    assert ws.source_ohwi is ohwi_source
    # a file's values are copied in; the order is the rebuilt data source's
    m.save(fc, tmp_path / "fc.mpsnn")
    loaded = m.load(tmp_path / "fc.mpsnn")
    assert loaded._weights.source_ohwi is channels_last_only(
        loaded.data_source.weights().permute(0, 3, 1, 2)
    )


def _train(steps: int, ohwi: bool, monkeypatch) -> tuple[list[torch.Tensor], int]:
    """``steps`` steps of the port of Apple's sample (its data sources hold OHWI weights and
    run Adam on them), with the OHWI-ordered weight gradients or without; the weights, and
    how many weight gradients were made in OHWI order."""
    plain = conv_gradients.fc_backward
    made = []

    def spy(*a):
        out = plain(*a) if ohwi else plain(*a[:7])
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


def test_apples_program_trains_as_with_the_default_order(monkeypatch) -> None:
    """The port's data sources hold contiguous OHWI weights: three training steps with the
    OHWI-ordered gradients end on the weights of the default order (the same bits on the
    machines tried; the BLAS's rounding allows the last place)."""
    got, ohwi = _train(3, True, monkeypatch)
    want, none = _train(3, False, monkeypatch)
    assert (ohwi, none) == (3, 0)  # the first fully connected layer's, once per step
    assert len(got) == len(want) == 8
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
