"""States: temporary states and read counts, state batches, forward records."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from tests.helpers import run


def _pair(dev: m.Device, k: int = 3):
    desc = m.ConvolutionDescriptor(k, k, 2, 2)
    ds = m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape), torch.randn(2))
    return m.Convolution(dev, ds), m.ConvolutionGradient(dev, ds)


def test_temporary_state_is_consumed_by_its_gradient_and_then_stale() -> None:
    dev = m.Device("cpu")
    conv, grad = _pair(dev)
    x = m.Image.from_tensor(torch.randn(1, 2, 5, 5))
    g = m.Image.from_tensor(torch.randn(1, 2, 5, 5))
    cb = dev.new_command_queue().command_buffer()
    state = conv.temporary_result_state(cb, x)
    state.label = "conv1 grads"
    assert state.is_temporary and state.read_count == 1 and state.command_buffer is cb
    conv.encode(cb, x, destination_state=state)
    assert state.read_count == 1  # the forward writes it
    grad.encode(cb, g, x, state)
    assert state.read_count == 0
    with pytest.raises(
        m.StaleResourceError,
        match=r"\[ConvolutionGradient\] ConvolutionGradientState 'conv1 grads' must be live, but its read_count reached 0 \(released after its last read by ConvolutionGradient\)",
    ):
        grad.encode(cb, g, x, state)
    run(cb)
    assert state.resources() == []  # accumulators freed after the last reader ran
    with pytest.raises(m.StaleResourceError):
        _ = state.gradient_for_weights


def test_permanent_state_has_no_read_count() -> None:
    dev = m.Device("cpu")
    conv, _ = _pair(dev)
    state = conv.result_state(m.Image.from_tensor(torch.zeros(1, 2, 3, 3)))
    assert not state.is_temporary and state.read_count == 0
    assert state.resource_size() == 0  # accumulators are made by the first gradient
    assert state.gradient_for_weights.abs().sum() == 0  # ... or read as zeros before one
    assert state.resource_size() == (2 * 2 * 3 * 3 + 2) * 4  # weights and biases
    with pytest.raises(
        ValueError,
        match=r"\[ConvolutionGradientState\] read_count can only be set on a temporary state, got a permanent one",
    ):
        state.read_count = 2


def test_state_batch_counts_a_shared_state_once() -> None:
    dev = m.Device("cpu")
    conv, _ = _pair(dev)
    cb = dev.new_command_queue().command_buffer()
    batch = conv.temporary_result_state_batch(cb, m.ImageBatch.from_tensor(torch.zeros(4, 2, 3, 3)))
    assert isinstance(batch, m.StateBatch) and len(batch) == 4 and len(batch.unique()) == 1
    assert batch.increment_read_count(2) == 1
    assert batch[0].read_count == 3


def test_gradient_needs_a_state_written_by_the_forward() -> None:
    dev = m.Device("cpu")
    conv, grad = _pair(dev)
    x = m.Image.from_tensor(torch.randn(1, 2, 4, 4))
    state = conv.result_state(x)
    cb = dev.new_command_queue().command_buffer()
    with pytest.raises(
        ValueError,
        match=r"\[ConvolutionGradient\] the gradient state must have been written by a forward encode \(pass it as destination_state\), got a ConvolutionGradientState no forward encode wrote",
    ):
        grad.encode(cb, x, x, state)
    with pytest.raises(
        TypeError,
        match=r"\[ConvolutionGradient\] gradient_state must be a ConvolutionGradientState, got GradientState",
    ):
        grad.encode(cb, x, x, m.GradientState(dev))


def test_a_shared_state_must_see_one_geometry() -> None:
    dev = m.Device("cpu")
    conv, _ = _pair(dev)
    cb = dev.new_command_queue().command_buffer()
    state = conv.result_state(m.Image.from_tensor(torch.zeros(1, 2, 4, 4)))
    conv.encode(cb, m.Image.from_tensor(torch.zeros(1, 2, 4, 4)), destination_state=state)
    with pytest.raises(
        ValueError,
        match=r"\[Convolution\] a gradient state shared by several encodes needs the same geometry at each encode",
    ):
        conv.encode(cb, m.Image.from_tensor(torch.zeros(1, 2, 6, 6)), destination_state=state)
    assert len(cb) == 1


def test_forward_record_reports_the_source_size() -> None:
    dev = m.Device("cpu")
    conv, _ = _pair(dev)
    x = m.Image.from_tensor(torch.zeros(1, 2, 5, 7))
    state = conv.result_state(x)
    cb = dev.new_command_queue().command_buffer()
    conv.encode(cb, x, destination_state=state)
    assert (state.source_width, state.source_height) == (7, 5)
    assert state.forward.kernel is conv and state.forward.edge_mode is m.EdgeMode.ZERO


def test_reading_gradients_before_the_first_write_then_writing_adds_into_them() -> None:
    dev = m.Device("cpu")
    conv, grad = _pair(dev)
    x = m.Image.from_tensor(torch.randn(1, 2, 4, 4))
    g = m.Image.from_tensor(torch.randn(1, 2, 4, 4))
    state = conv.result_state(x)
    early = state.gradient_for_weights  # zeros, materialized before any gradient ran
    cb = dev.new_command_queue().command_buffer()
    conv.encode(cb, x, destination_state=state)
    grad.encode(cb, g, x, state)
    run(cb)
    assert early.abs().sum() > 0  # the write went into the tensor the caller already holds
    assert torch.equal(early, state.gradient_for_weights)
