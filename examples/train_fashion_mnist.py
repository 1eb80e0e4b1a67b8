"""Train a small CNN on Fashion-MNIST with mpsnn kernels only, the MPS way.

Model (LeNet-like): conv 5x5 1->8 + fused ReLU, 2x2 max pool, conv 5x5 8->16 + fused ReLU,
2x2 max pool, fully connected 7x7x16 -> 10, log-softmax over channels.

Each step encodes, on one command buffer, the forward pass with gradient states, the loss
gradient of the mean negative log-likelihood (``-onehot / B`` with respect to the log-
probabilities; the loss family arrives with a later issue), and every gradient kernel back to
the first convolution (fused neurons differentiated by NeuronGradient first, as MPS
prescribes). A completed handler then applies SGD with momentum on the CPU path (MPS update path
1): it reads each ConvolutionGradientState, writes the data source and reloads the kernels.

    python examples/train_fashion_mnist.py --epochs 3
"""

from __future__ import annotations

import argparse
import time

import torch

import mpsnn as m
from mpsnn.data import load_fashion_mnist

RELU = m.NeuronDescriptor(m.NeuronType.RELU)


class Layer:
    """A trainable convolution (or fully connected) layer with SGD-momentum on the CPU path."""

    def __init__(
        self, dev: m.Device, kind: type, desc: m.ConvolutionDescriptor, gen: torch.Generator
    ) -> None:
        fan_in = desc.kernel_width * desc.kernel_height * desc.input_feature_channels
        w = torch.randn(desc.weights_shape, generator=gen) * (2.0 / fan_in) ** 0.5
        self.data = m.TensorConvolutionDataSource(
            desc, w, torch.zeros(desc.output_feature_channels)
        )
        self.forward = kind(dev, self.data)
        grad_kind = m.FullyConnectedGradient if kind is m.FullyConnected else m.ConvolutionGradient
        self.gradient = grad_kind(dev, self.data)
        self.velocity = [torch.zeros(desc.weights_shape), torch.zeros(desc.output_feature_channels)]

    def update(self, state: m.ConvolutionGradientState, lr: float, momentum: float) -> None:
        grads = [state.gradient_for_weights.cpu(), state.gradient_for_biases.cpu()]
        params = [self.data.weights(), self.data.bias_terms()]
        for v, g in zip(self.velocity, grads, strict=True):
            v.mul_(momentum).add_(g)
        self.data.set_weights_and_biases(
            *(p - lr * v for p, v in zip(params, self.velocity, strict=True))
        )
        self.forward.reload_weights_and_biases_from_data_source()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--limit", type=int, default=None, help="train on the first N images only")
    parser.add_argument("--device", default=m.Device.default().type)
    args = parser.parse_args()

    dev = m.Device(args.device)
    torch_dev = dev.torch_device
    gen = torch.Generator().manual_seed(0)
    train_x, train_y = load_fashion_mnist("train")
    test_x, test_y = load_fashion_mnist("test")
    if args.limit:
        train_x, train_y = train_x[: args.limit], train_y[: args.limit]

    def prep(x: torch.Tensor) -> torch.Tensor:
        return ((x.float() / 255 - 0.2860) / 0.3530).to(torch_dev)

    train_x, test_x = prep(train_x), prep(test_x)
    train_y, test_y = train_y.to(torch_dev), test_y.to(torch_dev)

    conv1 = Layer(
        dev, m.Convolution, m.ConvolutionDescriptor(5, 5, 1, 8, fused_neuron_descriptor=RELU), gen
    )
    conv2 = Layer(
        dev, m.Convolution, m.ConvolutionDescriptor(5, 5, 8, 16, fused_neuron_descriptor=RELU), gen
    )
    fc = Layer(dev, m.FullyConnected, m.ConvolutionDescriptor(7, 7, 16, 10), gen)
    pool, pool_grad = m.PoolingMax(dev, 2, 2, 2, 2), m.PoolingMaxGradient(dev, 2, 2, 2, 2)
    relu_grad = m.NeuronGradient(dev, RELU)
    logsoftmax, logsoftmax_grad = m.LogSoftMax(dev), m.LogSoftMaxGradient(dev)
    layers = (conv1, conv2, fc)
    # The first layer's input is data: its gradient kernel computes dL/dW and dL/db only.
    conv1.gradient.gradient_option = m.ConvolutionGradientOption.GRADIENT_WITH_WEIGHTS_AND_BIAS
    queue = dev.new_command_queue()

    def forward(cb: m.CommandBuffer, x: m.ImageBatch, train: bool) -> tuple[m.ImageBatch, list]:
        """Returns the log-probabilities and, for training, what the backward pass needs."""
        saved = []
        h = x
        for layer in (conv1, conv2):
            st = layer.forward.result_state_batch(h) if train else None
            a = layer.forward.encode_batch(cb, h, destination_states=st)
            pst = pool.result_state_batch(a) if train else None
            p = pool.encode_batch(cb, a, destination_states=pst)
            saved.append((layer, h, st, a, pst))
            h = p
        fst = fc.forward.result_state_batch(h) if train else None
        logits = fc.forward.encode_batch(cb, h, destination_states=fst)
        lst = logsoftmax.result_state_batch(logits) if train else None
        logp = logsoftmax.encode_batch(cb, logits, destination_states=lst)
        return logp, [saved, (h, fst, logits, lst)]

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        b = x.shape[0]
        cb = queue.command_buffer()
        logp, (saved, (h, fst, _, lst)) = forward(cb, m.ImageBatch.from_tensor(x), train=True)
        # d(mean NLL)/d(log-probabilities) = -onehot / B
        dlogp = -torch.nn.functional.one_hot(y, 10).to(x.dtype).view(b, 10, 1, 1) / b
        g = logsoftmax_grad.encode_batch(cb, m.ImageBatch.from_tensor(dlogp), logp, lst)
        g = fc.gradient.encode_batch(cb, g, h, fst)
        for layer, inp, st, act, pst in reversed(saved):
            g = pool_grad.encode_batch(cb, g, act, pst)
            g = relu_grad.encode_batch(cb, g, act, st)  # the fused ReLU, then the convolution
            g = layer.gradient.encode_batch(cb, g, inp, st)
        states = [fst[0], saved[1][2][0], saved[0][2][0]]

        def update(_cb: m.CommandBuffer) -> None:
            for layer, state in zip((fc, conv2, conv1), states, strict=True):
                layer.update(state, args.lr, args.momentum)

        cb.add_completed_handler(update)
        cb.commit()
        cb.wait_until_completed()
        return -(logp.tensor.view(b, 10).gather(1, y.view(-1, 1))).mean().item()

    def evaluate() -> float:
        correct = 0
        for i in range(0, test_x.shape[0], 1000):
            cb = queue.command_buffer()
            logp, _ = forward(cb, m.ImageBatch.from_tensor(test_x[i : i + 1000]), train=False)
            cb.commit()
            cb.wait_until_completed()
            correct += (logp.tensor.flatten(1).argmax(1) == test_y[i : i + 1000]).sum().item()
        return correct / test_x.shape[0]

    n, b = train_x.shape[0], args.batch_size
    steps = n // b
    params = sum(layer.data.weights().numel() + layer.data.bias_terms().numel() for layer in layers)
    print(f"mpsnn {m.__version__} on {dev.name}: CNN with {params} parameters, {steps} steps/epoch")
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        order = torch.randperm(n, generator=gen).to(torch_dev)
        total = 0.0
        for i in range(steps):
            idx = order[i * b : (i + 1) * b]
            total += step(train_x[idx], train_y[idx])
            if (i + 1) % 50 == 0 or i + 1 == steps:
                bar = "#" * (24 * (i + 1) // steps)
                rate = (i + 1) * b / (time.perf_counter() - t0)
                print(
                    f"\repoch {epoch} [{bar:<24}] loss {total / (i + 1):.4f} {rate:6.0f} img/s",
                    end="",
                    flush=True,
                )
        print(f"  test accuracy {evaluate():.4f} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
