"""Every gradient kernel refuses a state filled by another family's forward, with one message,
before anything is recorded (the check lives in `GradientKernel`)."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m

T = m.NeuronType


def _gradients(dev: m.Device) -> dict[str, m.GradientKernel]:
    relu = m.NeuronDescriptor(T.RELU)
    return {
        "NeuronGradient": m.NeuronGradient(dev, relu),
        "SoftMaxGradient": m.SoftMaxGradient(dev),
        "LogSoftMaxGradient": m.LogSoftMaxGradient(dev),
        "DropoutGradient": m.DropoutGradient(dev, 0.5, seed=3),
        "PoolingMaxGradient": m.PoolingMaxGradient(dev, 1, 1),
        "PoolingAverageGradient": m.PoolingAverageGradient(dev, 1, 1),
        "UpsamplingNearestGradient": m.UpsamplingNearestGradient(dev, 1, 1),
        "SliceGradient": m.SliceGradient(dev),
        "ReshapeGradient": m.ReshapeGradient(dev),
        "PadGradient": m.PadGradient(dev),
    }


FORWARD_OF = {
    "NeuronGradient": "Neuron",
    "SoftMaxGradient": "SoftMax",
    "LogSoftMaxGradient": "LogSoftMax",
    "DropoutGradient": "Dropout",
    "PoolingMaxGradient": "PoolingMax",
    "PoolingAverageGradient": "PoolingAverage",
    "UpsamplingNearestGradient": "UpsamplingNearest",
    "SliceGradient": "Slice",
    "ReshapeGradient": "Reshape",
    "PadGradient": "Pad",
}


@pytest.mark.parametrize("name", sorted(FORWARD_OF))
def test_a_state_from_another_family_is_refused(name: str) -> None:
    dev = m.Device("cpu")
    gen = torch.Generator().manual_seed(21)
    x = m.Image.from_tensor(torch.randn(1, 2, 3, 3, generator=gen, dtype=torch.float64))
    # A forward of a different family fills the state: SoftMax, or Neuron for SoftMaxGradient.
    forward = m.Neuron(dev, m.NeuronDescriptor(T.RELU)) if name == "SoftMaxGradient" else None
    forward = forward or m.SoftMax(dev)
    cb = dev.new_command_queue().command_buffer()
    # DropoutGradient takes only its own state class; another forward can still fill one.
    state = m.DropoutGradientState(dev) if name == "DropoutGradient" else forward.result_state(x)
    y = forward.encode(cb, x, destination_state=state)
    grad = _gradients(dev)[name]
    with pytest.raises(
        ValueError,
        match=rf"\[{name}\] gradient_state must come from a {FORWARD_OF[name]} encode, "
        rf"got one from {type(forward).__name__}$",
    ):
        grad.encode(cb, y, x, state)
    assert len(cb) == 1  # only the forward
