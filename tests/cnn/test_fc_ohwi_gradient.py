"""A fully connected layer whose data source holds its weights in OHWI memory (MPS's order,
as Apple's sample does) gets its weight gradient in that order on the CPU: the same values as
the default (c, h, w) order, laid out so that the update reads it without a copy."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
import mpsnn.cnn.convolution.gradients as conv_gradients
from benchmarks.bench_apple_step import _port
from mpsnn.core.layout import channels_last_only
from mpsnn.ops.convolution import fc_backward


@pytest.mark.parametrize(
    ("n", "o", "c", "h", "k"),
    [(40, 1024, 64, 7, 7), (3, 5, 4, 6, 4), (2, 7, 3, 3, 3), (5, 6, 1, 4, 4), (4, 9, 8, 1, 1)],
)
@pytest.mark.parametrize("channels_last", [False, True])
def test_the_ohwi_order_holds_the_same_values(n, o, c, h, k, channels_last) -> None:
    gen = torch.Generator().manual_seed(n * o + c)
    x = torch.randn(n, c, h, h, generator=gen)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    g = torch.randn(n, o, 1, 1, generator=gen)
    w = torch.randn(o, c, k, k, generator=gen)
    want = fc_backward(g, x, w)
    got = fc_backward(g, x, w, ohwi=True)
    assert torch.equal(got[1], want[1])  # the same sums, bit for bit
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])
    if k * k > 1 and c > 1:
        assert channels_last_only(got[1])  # OHWI memory
    else:  # one pixel or one channel: the two orders are one memory order
        assert got[1].is_contiguous()


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


def test_apples_program_trains_to_the_same_bits(monkeypatch) -> None:
    """The port's data sources hold contiguous OHWI weights: three training steps with the
    OHWI-ordered gradients end on the weights of the default order, bit for bit."""
    got, ohwi = _train(3, True, monkeypatch)
    want, none = _train(3, False, monkeypatch)
    assert (ohwi, none) == (3, 0)  # the first fully connected layer's, once per step
    assert len(got) == len(want) == 8
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
