"""Train a softmax classifier on Fashion-MNIST with mpsnn kernels.

The model is one `FullyConnected` layer (28x28x1 -> 10). Each step encodes the forward pass
with a gradient state, computes the softmax cross-entropy gradient ``(softmax(y) - onehot) / B``
(the loss family arrives with a later issue), encodes `FullyConnectedGradient` for the weight
and bias gradients, and updates the weights on the CPU path: a completed handler applies SGD
with momentum to the data source and reloads the kernels (MPS update path 1).

    python examples/train_fashion_mnist.py --epochs 5
"""

from __future__ import annotations

import argparse
import time

import torch

import mpsnn as m
from mpsnn.data import load_fashion_mnist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--device", default=m.Device.default().type)
    args = parser.parse_args()

    dev = m.Device(args.device)
    torch_dev = dev.torch_device
    train_x, train_y = load_fashion_mnist("train")
    test_x, test_y = load_fashion_mnist("test")
    mean, std = 0.2860, 0.3530  # Fashion-MNIST pixel statistics

    def prep(x: torch.Tensor) -> torch.Tensor:
        return ((x.float() / 255 - mean) / std).to(torch_dev)

    train_x, test_x = prep(train_x), prep(test_x)
    train_y, test_y = train_y.to(torch_dev), test_y.to(torch_dev)

    desc = m.ConvolutionDescriptor(28, 28, 1, 10)
    gen = torch.Generator().manual_seed(0)
    data = m.TensorConvolutionDataSource(
        desc, torch.randn(desc.weights_shape, generator=gen) * 0.01, torch.zeros(10), label="fc"
    )
    fc, fc_grad = m.FullyConnected(dev, data), m.FullyConnectedGradient(dev, data)
    fc_grad.gradient_option = m.ConvolutionGradientOption.GRADIENT_WITH_WEIGHTS_AND_BIAS
    queue = dev.new_command_queue()
    velocity = [torch.zeros(desc.weights_shape), torch.zeros(10)]

    def sgd_update(state: m.ConvolutionGradientState):
        def handler(_cb: m.CommandBuffer) -> None:  # runs after the gradient completed
            params = [data.weights(), data.bias_terms()]
            grads = [state.gradient_for_weights.cpu(), state.gradient_for_biases.cpu()]
            for v, g in zip(velocity, grads, strict=True):
                v.mul_(args.momentum).add_(g)
            data.set_weights_and_biases(
                *(p - args.lr * v for p, v in zip(params, velocity, strict=True))
            )
            fc.reload_weights_and_biases_from_data_source()
            fc_grad.reload_weights_and_biases_from_data_source()

        return handler

    def evaluate() -> float:
        cb = queue.command_buffer()
        logits = fc.encode_batch(cb, m.ImageBatch.from_tensor(test_x))
        cb.commit()
        cb.wait_until_completed()
        return (logits.tensor.flatten(1).argmax(1) == test_y).float().mean().item()

    n, b = train_x.shape[0], args.batch_size
    steps = n // b
    print(f"mpsnn {m.__version__} on {dev.name}: FullyConnected 784->10, {steps} steps/epoch")
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        order = torch.randperm(n, generator=gen).to(torch_dev)
        total = 0.0
        for step in range(steps):
            idx = order[step * b : (step + 1) * b]
            x = m.ImageBatch.from_tensor(train_x[idx])
            cb = queue.command_buffer()
            states = fc.result_state_batch(x)
            logits = fc.encode_batch(cb, x, destination_states=states)
            cb.commit()
            cb.wait_until_completed()
            y = logits.tensor.flatten(1)
            loss = torch.nn.functional.cross_entropy(y, train_y[idx])
            total += loss.item()
            grad = (y.softmax(1) - torch.nn.functional.one_hot(train_y[idx], 10)) / b
            cb = queue.command_buffer()
            fc_grad.encode_batch(cb, m.ImageBatch.from_tensor(grad.view(b, 10, 1, 1)), x, states)
            cb.add_completed_handler(sgd_update(states[0]))
            cb.commit()
            cb.wait_until_completed()
            if (step + 1) % 100 == 0 or step + 1 == steps:
                bar = "#" * (20 * (step + 1) // steps)
                print(
                    f"\repoch {epoch} [{bar:<20}] loss {total / (step + 1):.4f}", end="", flush=True
                )
        acc = evaluate()
        print(f"  test accuracy {acc:.4f}  ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
