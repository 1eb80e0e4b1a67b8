"""A training graph skips the bias sums of a convolution without biases when its update is
mpsnn's own (nothing reads them): the weights still follow autograd, no channel sum runs, and
the state refuses to report a bias gradient it did not compute. Layers with biases, and data
sources with an update of their own, keep MPS's sums."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
import mpsnn.ops.convolution as conv_ops
from tests.graph._helpers import (
    DEV,
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


def _count_channel_sums(monkeypatch) -> list[int]:
    count = [0]
    real = conv_ops._channel_sums

    def spy(g, dtype):
        count[0] += 1
        return real(g, dtype)

    monkeypatch.setattr(conv_ops, "_channel_sums", spy)
    return count


class _OwnUpdate(m.TensorConvolutionDataSource):
    """A data source with an update of its own, which reads the bias gradient (at encode
    time: the tensor that the gradient's sums go into when the work runs)."""

    seen: list[torch.Tensor]

    def update(self, command_buffer, gradient_state, source_state):
        self.seen.append(gradient_state.gradient_for_biases)
        return super().update(command_buffer, gradient_state, source_state)


@pytest.mark.parametrize("case", ["bias-less", "with bias", "own update"])
def test_bias_sums_are_skipped_only_where_nothing_reads_them(monkeypatch, case) -> None:
    sums = _count_channel_sums(monkeypatch)
    g = gen(71)
    plain = conv_ds(g, 3, 3, 2, 3, sgd1(), bias=case == "with bias")
    ds = plain
    if case == "own update":
        ds = _OwnUpdate(plain.descriptor(), plain.weights(), None, optimizer=sgd1())
        ds.seen = []
    conv = m.ConvolutionNode(m.ImageNode("x"), ds)
    graph, _ = training(mse_loss(conv.result_image))
    xt, target = rand(g, 2, 2, 5, 4), rand(g, 2, 3, 5, 4)
    tconv = TorchConv(ds)
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    assert sums[0] == (0 if case == "bias-less" else 1)
    xr = xt.clone().requires_grad_()
    y = tconv(xr)
    mse_reference(y, target).backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
    tconv.check_step(case)
    if case == "own update":  # the sums MPS defines, for a data source that reads them
        assert_close(ds.seen[0], (y - target).sum((0, 2, 3)), "bias gradient", TOL)


def test_a_skipped_bias_gradient_refuses_to_be_read() -> None:
    g = gen(72)
    ds = conv_ds(g, 3, 3, 2, 3, sgd1(), bias=False)
    fwd, grad = m.Convolution(DEV, ds), m.ConvolutionGradient(DEV, ds)
    grad._bias_sums = False  # what a training graph sets
    cb = DEV.new_command_queue().command_buffer()
    src = m.Image.from_tensor(rand(g, 1, 2, 5, 4))
    state = fwd.result_state(src)
    fwd.encode(cb, src, destination_state=state)
    grad.encode(cb, m.Image.from_tensor(rand(g, 1, 3, 5, 4)), src, state)
    cb.commit()
    cb.wait_until_completed()
    assert state.gradient_for_weights.abs().sum() > 0
    with pytest.raises(ValueError, match=r"\[ConvolutionGradientState\] gradient_for_biases must"):
        state.gradient_for_biases  # noqa: B018
    # nothing made for the skipped sums: the state holds the weights' sums alone
    assert len(state._slots[0]) == 1
    # a data source given biases after the gradient ran updates them with the sums of no
    # bias (zeros): plain SGD leaves them as they were, and moves the weights
    biases = rand(g, 3)
    before = ds.weights().clone()
    ds.set_weights_and_biases(before, biases)
    cb = DEV.new_command_queue().command_buffer()
    ds.update(cb, state, None)
    cb.commit()
    cb.wait_until_completed()
    assert torch.equal(ds.bias_terms(), biases)
    assert not torch.equal(ds.weights(), before)
    # the kernel on its own keeps MPS's sums for a bias-less layer
    state2 = fwd.result_state(src)
    cb = DEV.new_command_queue().command_buffer()
    fwd.encode(cb, src, destination_state=state2)
    gt = rand(g, 1, 3, 5, 4)
    m.ConvolutionGradient(DEV, ds).encode(cb, m.Image.from_tensor(gt), src, state2)
    cb.commit()
    cb.wait_until_completed()
    assert_close(state2.gradient_for_biases, gt.sum((0, 2, 3)), "bias gradient", TOL)


@pytest.mark.parametrize("layer", ["fc", "conv"])
def test_an_exported_bias_less_state_read_before_the_work_runs(layer) -> None:
    """A training graph's exported gradient state of a bias-less layer, read at encode time
    (MPS: the tensor the gradient adds into): the work adds the weights' sums into it, and
    the state holds those alone (a fully connected layer sums the bias anyway, unstored)."""
    g = gen(73)
    ds = m.TensorConvolutionDataSource(m.ConvolutionDescriptor(3, 3, 2, 4),
                                       rand(g, 4, 3, 3, 2), None, optimizer=sgd1())  # fmt: skip
    node = (m.FullyConnectedNode if layer == "fc" else m.ConvolutionNode)(m.ImageNode("x"), ds)
    node.result_state.export_from_graph = True
    graph, _ = training(mse_loss(node.result_image))
    tgt = rand(g, 2, 4, 1, 1) if layer == "fc" else rand(g, 2, 4, 3, 3)
    cb = DEV.new_command_queue().command_buffer()
    graph.encode_batch(cb, [m.ImageBatch.from_tensor(rand(g, 2, 2, 3, 3))],
                       [m.LossLabels(DEV, tgt)])  # fmt: skip
    state = graph.result_states[0][0]
    early = state.gradient_for_weights
    cb.commit()
    cb.wait_until_completed()
    assert cb.error is None
    assert early.abs().sum() > 0
    assert len(state._slots[0]) == 1


def test_sums_of_other_lengths_in_one_state() -> None:
    """Zeros made by a read before the gradient's encode skipped the bias sums, then a write
    that sums the bias into the same state: each adds what it has, the missing side counting
    as zeros, and the state reports the bias sums once a write made them."""
    g = gen(74)
    ds = conv_ds(g, 3, 3, 2, 3, sgd1(), bias=False)
    fwd, grad = m.Convolution(DEV, ds), m.ConvolutionGradient(DEV, ds)
    src = m.Image.from_tensor(rand(g, 1, 2, 5, 4))
    state = fwd.result_state(src)
    cb = DEV.new_command_queue().command_buffer()
    fwd.encode(cb, src, destination_state=state)
    early = state.gradient_for_weights  # zeros with a bias slot: nothing skipped yet
    g1, g2 = rand(g, 1, 3, 5, 4), rand(g, 1, 3, 5, 4)
    grad._bias_sums = False  # what a training graph sets: the first write skips the bias
    grad.encode(cb, m.Image.from_tensor(g1), src, state)
    cb.commit()
    cb.wait_until_completed()
    assert cb.error is None and early.abs().sum() > 0
    first = early.clone()
    grad._bias_sums = True  # the second sums the bias into the same state
    cb = DEV.new_command_queue().command_buffer()
    fwd.encode(cb, src, destination_state=state)
    grad.encode(cb, m.Image.from_tensor(g2), src, state)
    cb.commit()
    cb.wait_until_completed()
    assert cb.error is None
    assert not torch.equal(state.gradient_for_weights, first)  # added into
    assert_close(state.gradient_for_biases, g2.sum((0, 2, 3)), "bias gradient", TOL)


def test_a_bias_less_fully_connected_layer_sums_no_bias(monkeypatch) -> None:
    """The fully connected gradient is told the bias sums are skipped and computes none."""
    import mpsnn.cnn.convolution.gradients as grads

    seen = []
    real = grads.fc_backward

    def spy(*args):
        out = real(*args)
        seen.append((args[6], out[2]))  # need_bias
        return out

    monkeypatch.setattr(grads, "fc_backward", spy)
    g = gen(75)
    ds = m.TensorConvolutionDataSource(m.ConvolutionDescriptor(3, 3, 2, 4),
                                       rand(g, 4, 3, 3, 2), None, optimizer=sgd1())  # fmt: skip
    node = m.FullyConnectedNode(m.ImageNode("x"), ds)
    graph, _ = training(mse_loss(node.result_image))
    out = encode(graph, [rand(g, 2, 2, 3, 3)], [m.LossLabels(DEV, rand(g, 2, 4, 1, 1))])
    assert out is not None
    assert seen and all(need is False and db is None for need, db in seen)
