"""Train a CNN on Fashion-MNIST with mpsnn kernels, the MPS way (one command buffer per step).

Model: conv 3x3 1->32 + fused ReLU, 2x2 max pool, conv 3x3 32->64 + fused ReLU, 2x2 max pool,
fully connected 7x7x64 -> 128 + ReLU, fully connected 128 -> 10; softmax cross-entropy (SUM
with weight 1/batch: the batch mean). Every layer's data source holds Adam and updates on the
command buffer (MPS's GPU update path): after the gradient kernels, ``data_source.update``
encodes Adam into the data source's own weights and the kernel reloads them, all in the same
command buffer.

    python examples/train_fashion_mnist.py --epochs 5
"""

from __future__ import annotations

import argparse
import time

import torch

import mpsnn as m
from mpsnn.data import load_fashion_mnist

RELU = m.NeuronDescriptor(m.NeuronType.RELU)


class Layer:
    """A trainable convolution (or fully connected) layer whose data source applies Adam."""

    def __init__(self, dev: m.Device, kind: type, desc: m.ConvolutionDescriptor, lr: float,
                 gen: torch.Generator) -> None:  # fmt: skip
        fan_in = desc.kernel_width * desc.kernel_height * desc.input_feature_channels
        w = torch.randn(desc.weights_shape, generator=gen) * (2.0 / fan_in) ** 0.5
        adam = m.Adam(dev, descriptor=m.OptimizerDescriptor(learning_rate=lr))
        self.data = m.TensorConvolutionDataSource(
            desc, w.to(dev.torch_device), torch.zeros(desc.output_feature_channels), adam
        )
        self.forward = kind(dev, self.data)
        grad_kind = m.FullyConnectedGradient if kind is m.FullyConnected else m.ConvolutionGradient
        self.gradient = grad_kind(dev, self.data)

    def update(self, cb: m.CommandBuffer, state: m.ConvolutionGradientState) -> None:
        """MPS's GPU update path: Adam into the data source's weights, then reload them."""
        self.forward.reload_weights_and_biases(cb, self.data.update(cb, state, None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--lr-decay", type=float, default=0.6, help="per-epoch factor")
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

    c = m.ConvolutionDescriptor
    conv1 = Layer(dev, m.Convolution, c(3, 3, 1, 32, fused_neuron_descriptor=RELU), args.lr, gen)
    conv2 = Layer(dev, m.Convolution, c(3, 3, 32, 64, fused_neuron_descriptor=RELU), args.lr, gen)
    fc1 = Layer(dev, m.FullyConnected, c(7, 7, 64, 128, fused_neuron_descriptor=RELU), args.lr, gen)
    fc2 = Layer(dev, m.FullyConnected, c(1, 1, 128, 10), args.lr, gen)
    pool, pool_grad = m.PoolingMax(dev, 2, 2, 2, 2), m.PoolingMaxGradient(dev, 2, 2, 2, 2)
    relu_grad = m.NeuronGradient(dev, RELU)
    b = args.batch_size
    loss = m.Loss(
        dev, m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM, weight=1 / b)
    )
    # The first layer's input is data: its gradient kernel computes dL/dW and dL/db only.
    conv1.gradient.gradient_option = m.ConvolutionGradientOption.GRADIENT_WITH_WEIGHTS_AND_BIAS
    queue = dev.new_command_queue()

    def forward(cb: m.CommandBuffer, x: m.ImageBatch, train: bool) -> tuple[m.ImageBatch, list]:
        """Returns the logits and, for training, what the backward pass needs."""
        saved = []
        h = x
        for layer in (conv1, conv2):
            st = layer.forward.result_state_batch(h) if train else None
            a = layer.forward.encode_batch(cb, h, destination_states=st)
            pst = pool.result_state_batch(a) if train else None
            p = pool.encode_batch(cb, a, destination_states=pst)
            saved.append((layer, h, st, a, pst))
            h = p
        s1 = fc1.forward.result_state_batch(h) if train else None
        hidden = fc1.forward.encode_batch(cb, h, destination_states=s1)
        s2 = fc2.forward.result_state_batch(hidden) if train else None
        logits = fc2.forward.encode_batch(cb, hidden, destination_states=s2)
        return logits, [saved, (h, s1, hidden, s2)]

    def step(x: torch.Tensor, y: torch.Tensor) -> m.LossLabels:
        cb = queue.command_buffer()
        logits, (saved, (h, s1, hidden, s2)) = forward(cb, m.ImageBatch.from_tensor(x), True)
        labels = m.LossLabels(dev, y.view(-1, 1, 1))  # class indices, one label per image
        g = loss.encode_batch(cb, logits, labels)
        g = fc2.gradient.encode_batch(cb, g, hidden, s2)
        g = relu_grad.encode_batch(cb, g, hidden, s1)  # fc1's fused ReLU, then fc1
        g = fc1.gradient.encode_batch(cb, g, h, s1)
        for layer, inp, st, act, pst in reversed(saved):
            g = pool_grad.encode_batch(cb, g, act, pst)
            g = relu_grad.encode_batch(cb, g, act, st)
            g = layer.gradient.encode_batch(cb, g, inp, st)
        # After every gradient (the data gradients used the old weights), the updates.
        for layer, state in ((fc2, s2[0]), (fc1, s1[0]), (conv2, saved[1][2][0]),
                             (conv1, saved[0][2][0])):  # fmt: skip
            layer.update(cb, state)
        cb.commit()  # no wait: the next step is encoded while this one runs
        return labels

    def evaluate() -> float:
        correct = 0
        for i in range(0, test_x.shape[0], 1000):
            cb = queue.command_buffer()
            logits, _ = forward(cb, m.ImageBatch.from_tensor(test_x[i : i + 1000]), train=False)
            cb.commit()
            pred = logits.tensor.flatten(1).argmax(1)  # waits for the buffer
            correct += (pred == test_y[i : i + 1000]).sum().item()
        return correct / test_x.shape[0]

    n = train_x.shape[0]
    steps = n // b
    layers = (conv1, conv2, fc1, fc2)
    params = sum(lay.data.weights().numel() + lay.data.bias_terms().numel() for lay in layers)
    print(f"mpsnn {m.__version__} on {dev.name}: CNN with {params} parameters, {steps} steps/epoch")
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        for layer in layers:  # written to device memory: no wait, no new optimizer state
            layer.data.optimizer.learning_rate = args.lr * args.lr_decay ** (epoch - 1)
        order = torch.randperm(n, generator=gen).to(torch_dev)
        total, pending = 0.0, []
        for i in range(steps):
            idx = order[i * b : (i + 1) * b]
            pending.append(step(train_x[idx], train_y[idx]))
            if (i + 1) % 50 == 0 or i + 1 == steps:
                total += sum(lab.loss_image().tensor.sum().item() for lab in pending)
                pending = []
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
