"""Train a CNN on Fashion-MNIST with an mpsnn graph, the MPS way.

Model: conv 3x3 1->32 + ReLU, 2x2 max pool, conv 3x3 32->64 + ReLU, 2x2 max pool, fully
connected 7x7x64 -> 128 + ReLU, fully connected 128 -> 10; softmax cross-entropy (SUM with
weight 1/batch: the batch mean).

The network is written once as a node recipe. The training graph is the loss node's automatic
training graph (`LossNode.training_graph`): one ``encode_batch`` runs the forward pass, the
loss, every gradient and the Adam updates that the layers' data sources hold (on the command
buffer: MPS's GPU update path). The graph fuses each ReLU into the layer before it. With
``--compile`` (the default) the step is recorded once and replayed as a CUDA graph on GPUs
(on the CPU every step runs eagerly). The inference graph is a second graph over the same
nodes, ending at the logits; it reads the trained weights after ``reload_from_data_sources``.

    python examples/train_fashion_mnist.py --epochs 5
"""

from __future__ import annotations

import argparse
import time

import torch

import mpsnn as m
from mpsnn.data import load_fashion_mnist


def layer(dev: m.Device, desc: m.ConvolutionDescriptor, adam: m.Adam,
          gen: torch.Generator) -> m.TensorConvolutionDataSource:  # fmt: skip
    """A convolution (or fully connected) layer's weights, He-initialized, trained by ``adam``."""
    fan_in = desc.kernel_width * desc.kernel_height * desc.input_feature_channels
    w = torch.randn(desc.weights_shape, generator=gen) * (2.0 / fan_in) ** 0.5
    return m.TensorConvolutionDataSource(
        desc, w.to(dev.torch_device), torch.zeros(desc.output_feature_channels), adam
    )


def network(x: m.ImageNode, layers: list[m.TensorConvolutionDataSource]) -> m.ImageNode:
    """The forward recipe: image node in, logits node out."""
    conv1, conv2, fc1, fc2 = layers
    h = m.NeuronReLUNode(m.ConvolutionNode(x, conv1).result_image).result_image
    h = m.PoolingMaxNode(h, 2).result_image
    h = m.NeuronReLUNode(m.ConvolutionNode(h, conv2).result_image).result_image
    h = m.PoolingMaxNode(h, 2).result_image
    h = m.NeuronReLUNode(m.FullyConnectedNode(h, fc1).result_image).result_image
    return m.FullyConnectedNode(h, fc2).result_image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--lr-decay", type=float, default=0.6, help="per-epoch factor")
    parser.add_argument("--limit", type=int, default=None, help="train on the first N images only")
    parser.add_argument("--device", default=m.Device.default().type)
    parser.add_argument("--no-compile", action="store_true", help="encode every step eagerly")
    parser.add_argument("--verbose", action="store_true", help="print the planned graph")
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

    b = args.batch_size
    adam = m.Adam(dev, descriptor=m.OptimizerDescriptor(learning_rate=args.lr))  # shared
    c = m.ConvolutionDescriptor
    layers = [layer(dev, d, adam, gen) for d in (c(3, 3, 1, 32), c(3, 3, 32, 64),
                                                  c(7, 7, 64, 128), c(1, 1, 128, 10))]  # fmt: skip
    image = m.ImageNode("image")
    logits = network(image, layers)
    loss = m.LossNode(
        logits,
        m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM, weight=1 / b),
    )
    (exit_node,) = loss.training_graph()  # the first convolution's gradient node
    # Nobody reads dL/d(image): the first layer computes its weight gradient only.
    training = m.Graph(dev, exit_node.result_image, result_image_is_needed=False)
    inference = m.Graph(dev, logits)
    if args.verbose:
        print(training.debug_description())
    queue = dev.new_command_queue()
    train_step = training.compile(queue) if not args.no_compile else None

    def step(x: torch.Tensor, y: torch.Tensor) -> m.LossLabels:
        batch = [m.ImageBatch.from_tensor(x)]
        labels = m.LossLabels(dev, y.view(-1, 1, 1))  # class indices for the whole batch
        if train_step is not None:
            train_step(batch, [labels])
            return train_step.source_states[0][0]  # where this step's loss is written
        cb = queue.command_buffer()
        training.encode_batch(cb, batch, [labels])
        cb.commit()  # no wait: the next step is encoded while this one runs
        return labels

    def evaluate() -> float:
        inference.reload_from_data_sources()  # the weights the training graph updated
        correct = 0
        for i in range(0, test_x.shape[0], 1000):
            cb = queue.command_buffer()
            out = inference.encode_batch(cb, [m.ImageBatch.from_tensor(test_x[i : i + 1000])])
            cb.commit()
            pred = out.tensor.flatten(1).argmax(1)  # waits for the buffer
            correct += (pred == test_y[i : i + 1000]).sum().item()
        return correct / test_x.shape[0]

    n = train_x.shape[0]
    steps = n // b
    params = sum(ds.weights().numel() + ds.bias_terms().numel() for ds in layers)
    print(f"mpsnn {m.__version__} on {dev.name}: CNN with {params} parameters, {steps} steps/epoch")
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        # written to device memory: no wait, and a replayed step reads the new rate too
        adam.learning_rate = args.lr * args.lr_decay ** (epoch - 1)
        order = torch.randperm(n, generator=gen).to(torch_dev)
        sampled = []  # the loss of every 50th step (reading a loss waits for its step)
        for i in range(steps):
            idx = order[i * b : (i + 1) * b]
            labels = step(train_x[idx], train_y[idx])
            if (i + 1) % 50 == 0 or i + 1 == steps:
                sampled.append(labels.loss_image().tensor.sum().item())
                bar = "#" * (24 * (i + 1) // steps)
                rate = (i + 1) * b / (time.perf_counter() - t0)
                print(
                    f"\repoch {epoch} [{bar:<24}] loss {sum(sampled) / len(sampled):.4f} "
                    f"{rate:6.0f} img/s",
                    end="",
                    flush=True,
                )
        print(f"  test accuracy {evaluate():.4f} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
