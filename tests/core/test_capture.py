"""Capture and replay: a command buffer's work recorded once as a CUDA graph and replayed with
new input data must equal encoding the same work again, bit for bit, including what changes
from step to step on the device (dropout keys, accumulated gradients, in-place weights)."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from tests.helpers import float32_reference

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
RELU = m.NeuronDescriptor(m.NeuronType.RELU)
LR = 0.05
B = 8


def test_capture_is_refused_on_the_cpu() -> None:
    cb = m.Device("cpu").new_command_queue().command_buffer()
    with pytest.raises(m.UnsupportedError, match=r"\[CommandBuffer\] capture\(\) records CUDA"):
        cb.capture()
    assert cb.status is m.CommandBufferStatus.NOT_ENQUEUED


class Net:
    """conv 5x5 1->4 + fused ReLU, max pool 2x2, dropout, fully connected -> 10, log-softmax,
    with the gradient of the mean negative log-likelihood and SGD on the command buffer."""

    def __init__(self, dev: m.Device) -> None:
        gen = torch.Generator().manual_seed(0)
        self.layers = []
        for kind, grad_kind, desc in (
            (
                m.Convolution,
                m.ConvolutionGradient,
                m.ConvolutionDescriptor(5, 5, 1, 4, fused_neuron_descriptor=RELU),
            ),
            (m.FullyConnected, m.FullyConnectedGradient, m.ConvolutionDescriptor(6, 6, 4, 10)),
        ):
            w = torch.randn(desc.weights_shape, generator=gen) * 0.2
            b = torch.randn(desc.output_feature_channels, generator=gen)
            ds = m.TensorConvolutionDataSource(desc, w, b)
            self.layers.append((kind(dev, ds), grad_kind(dev, ds)))
        self.pool, self.pool_grad = (
            m.PoolingMax(dev, 2, 2, 2, 2),
            m.PoolingMaxGradient(dev, 2, 2, 2, 2),
        )
        self.relu_grad = m.NeuronGradient(dev, RELU)
        self.drop, self.drop_grad = m.Dropout(dev, 0.7, seed=5), m.DropoutGradient(dev, 0.7, seed=5)
        self.lsm, self.lsm_grad = m.LogSoftMax(dev), m.LogSoftMaxGradient(dev)

    def encode_step(self, cb: m.CommandBuffer, x: m.ImageBatch, onehot: torch.Tensor):
        (conv, conv_grad), (fc, fc_grad) = self.layers
        s1 = conv.result_state_batch(x)
        a = conv.encode_batch(cb, x, destination_states=s1)
        sp = self.pool.result_state_batch(a)
        p = self.pool.encode_batch(cb, a, destination_states=sp)
        sd = self.drop.result_state_batch(p)
        d = self.drop.encode_batch(cb, p, destination_states=sd)
        s2 = fc.result_state_batch(d)
        logits = fc.encode_batch(cb, d, destination_states=s2)
        sl = self.lsm.result_state_batch(logits)
        logp = self.lsm.encode_batch(cb, logits, destination_states=sl)
        dlogp = m.ImageBatch.from_tensor(torch.empty_like(onehot))
        cb.record("loss gradient", lambda: dlogp.tensor.copy_(-onehot / B))
        g = self.lsm_grad.encode_batch(cb, dlogp, logp, sl)
        g = fc_grad.encode_batch(cb, g, d, s2)
        g = self.drop_grad.encode_batch(cb, g, p, sd)
        g = self.pool_grad.encode_batch(cb, g, a, sp)
        g = self.relu_grad.encode_batch(cb, g, a, s1)
        conv_grad.encode_batch(cb, g, x, s1)
        for kernel, st in ((conv, s1[0]), (fc, s2[0])):
            self._sgd(cb, kernel, st)
        return logp, d

    @staticmethod
    def _sgd(cb: m.CommandBuffer, kernel: m.Convolution, state: m.ConvolutionGradientState):
        w, b = kernel.weights, kernel.biases  # the master tensors, updated in place

        def run() -> None:
            w.sub_(LR * state.gradient_for_weights)
            b.sub_(LR * state.gradient_for_biases)

        cb.record("sgd", run)


def _batches(steps: int):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(B, 1, 16, 16, generator=gen).cuda()
        labels = torch.randint(0, 10, (B,), generator=gen)
        onehot = torch.nn.functional.one_hot(labels, 10).float().view(B, 10, 1, 1).cuda()
        yield x, onehot


@needs_cuda
def test_replayed_training_steps_equal_eager_steps_bit_for_bit() -> None:
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    dev = m.Device("cuda")
    steps = 5
    eager, net = [], Net(dev)
    q = dev.new_command_queue()
    for x, onehot in _batches(steps):
        cb = q.command_buffer()
        logp, d = net.encode_step(cb, m.ImageBatch.from_tensor(x), onehot)
        cb.commit()
        cb.wait_until_completed()
        eager.append((logp.tensor.clone(), d.tensor.clone(), net.layers[1][0].weights.clone()))

    replayed, net = [], Net(dev)
    q = dev.new_command_queue()
    data = list(_batches(steps))
    x0, onehot0 = data[0]
    cb = q.command_buffer()  # step 0 eager: warms up cuDNN, Triton and the constants
    logp, d = net.encode_step(cb, m.ImageBatch.from_tensor(x0), onehot0)
    cb.commit()
    cb.wait_until_completed()
    replayed.append((logp.tensor.clone(), d.tensor.clone(), net.layers[1][0].weights.clone()))
    x_static = m.ImageBatch.from_tensor(torch.empty_like(x0))
    onehot_static = torch.empty_like(onehot0)
    cb = q.command_buffer()
    logp, d = net.encode_step(cb, x_static, onehot_static)
    step = cb.capture()
    for x, onehot in data[1:]:
        x_static.tensor.copy_(x)  # static inputs, refilled in place
        onehot_static.copy_(onehot)
        step.replay()
        step.wait_until_completed()
        replayed.append((logp.tensor.clone(), d.tensor.clone(), net.layers[1][0].weights.clone()))
    assert step.replays == steps - 1
    for k, (e, r) in enumerate(zip(eager, replayed, strict=True)):
        for what, a, b in zip(
            ("log-probabilities", "dropout output", "fc weights"), e, r, strict=True
        ):
            assert torch.equal(a, b), f"step {k}: {what} differ between eager and replay"
    masks = [(r[1] != 0) for r in replayed]
    assert all(not torch.equal(masks[i], masks[i + 1]) for i in range(steps - 1)), (
        "dropout masks must change from step to step"
    )


@needs_cuda
def test_replay_reads_new_inputs_and_keeps_output_storage() -> None:
    dev = m.Device("cuda")
    desc = m.ConvolutionDescriptor(3, 3, 2, 2)
    ds = m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape), torch.randn(2))
    conv = m.Convolution(dev, ds)
    q = dev.new_command_queue()
    x = m.Image.from_tensor(torch.randn(1, 2, 6, 6, device="cuda"))
    cb = q.command_buffer()
    conv.encode(cb, x)
    cb.commit()
    cb.wait_until_completed()
    cb = q.command_buffer()
    y = conv.encode(cb, x)
    captured = cb.capture()
    for _ in range(3):
        new = torch.randn(1, 2, 6, 6, device="cuda")
        x.tensor.copy_(new)
        captured.replay()
        got = y.numpy()  # reading waits for the replay
        with float32_reference():  # mpsnn's float32 is float32: no TF32 in the reference
            ref = torch.nn.functional.conv2d(
                new, ds.weights().permute(0, 3, 1, 2).cuda(), ds.bias_terms().cuda(), padding=1
            )
        torch.testing.assert_close(torch.from_numpy(got).cuda(), ref, rtol=1e-5, atol=1e-5)
