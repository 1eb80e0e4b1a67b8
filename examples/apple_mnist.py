"""A port of Apple's MPS training sample ("Training a Neural Network with Metal Performance
Shaders", an MNIST classifier trained with ``MPSNNGraph``), run on Fashion-MNIST, side by side
with the same network and loop in plain PyTorch.

The sample's structure, reproduced with mpsnn's graph API:

* Network (graph nodes): UNORM8 input 28x28x1 (raw bytes, read as k/255, no normalization)
  -> convolution 5x5 1->32 (padding ADD_REMAINDER_TO_TOP_LEFT | ALIGN_CENTERED | SIZE_SAME on
  the node) -> ReLU -> max pool 2/2 (padding ``DefaultPadding.tensorflow_average_pooling()``)
  -> convolution 5x5 32->64 (same padding) -> ReLU -> max pool -> fully connected
  7x7x64->1024 -> ReLU -> dropout (keep 0.5, seed 1; training graph only) -> fully connected
  1024->10 -> loss (SOFTMAX_CROSS_ENTROPY, reduction SUM, weight 1/40) for training, softmax
  for inference. Weights uniform in [-0.2, 0.2), biases 0.1.
* Labels: one-hot, 12 channels wide for 10 classes (MPS's "closest multiple of 4"), one
  `LossLabels` per image. Each loss image (1x1x1) includes the weight 1/40, so the batch's sum
  of loss images is the mean cross entropy; the sample prints that sum divided by the batch
  size once more (mean cross entropy / 40: about 0.6 at iteration 0), and so does this port.
* Training graph: ``loss_node.training_graph(None, handler)`` where the handler makes every
  gradient node's result FLOAT32; intermediates are FLOAT16 (``graph.format``). It has one
  exit point, the first convolution's gradient (dL/d input), and is built as
  ``Graph(device, exit.result_image, True)``. One step is one ``encode_batch`` of 40 images
  drawn at random with replacement, the labels being the graph's single state source; at most
  two steps are in flight.
* Each layer has its own data source (`AdamDataSource`, a `ConvolutionDataSource` subclass)
  written as the sample's Objective-C one: it allocates its own weight (OHWI) and bias
  buffers and wraps them in a ``ConvolutionWeightsAndBiasesState`` (``initWithWeights:biases:``
  wraps, it does not copy), keeps Adam's momentum and velocity vectors and its own step count
  ``_t``. The GPU update path, ``update(command_buffer, gradient_state, source_state)``,
  counts the step, encodes Adam (lr 1e-3, beta1 0.9, beta2 0.999, eps 1e-8, time step from 0)
  from the gradient state and the weights the kernel used into that wrapping state (out of
  place), asserts that Adam's ``time_step`` counted the same, and returns the state;
  ``weights()`` returns the data source's own buffers, which are the memory Adam writes.
* Inference graph: the same recipe without dropout, ending in softmax, sharing the four data
  sources; ``reload_from_data_sources()`` before each evaluation; prediction = argmax of the 10
  channels (FLOAT16 storage). Evaluation on the test set before iterations 0, 100, 200 and
  after 300, then training goes on to one epoch (60000 / 40 = 1500 iterations) and evaluates
  once more.

The PyTorch twin (`TorchNet`, float32) starts from the same weights and sees the same batches;
its dropout masks differ. MPS's Adam puts epsilon before the bias correction, so the exact
torch.optim.Adam equivalent has epsilon ``1e-8 / sqrt(1 - beta2^t)`` at step t (set each step).
The storage stays FLOAT16 on every device, as in the sample; on the CPU PyTorch has no fast
half-precision convolution, so there the mpsnn run is several times slower than the torch one.

    python examples/apple_mnist.py                          # both frameworks, default device
    python examples/apple_mnist.py --device cpu --eval-limit 2000   # a CPU run: ~20-30 min
    python examples/apple_mnist.py --device cpu --iterations 20 --epoch-iterations 40  # a check
    python examples/apple_mnist.py --framework mpsnn --compile   # CUDA: replays a CUDA graph
"""

from __future__ import annotations

import argparse
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mpsnn as m
from mpsnn.data import load_fashion_mnist

BATCH, CLASSES, LABEL_CHANNELS = 40, 10, 12
LR, BETA1, BETA2, EPS = 1e-3, 0.9, 0.999, 1e-8
EVAL_EVERY = 100
#: OHWI weight shapes of conv1, conv2, fc1, fc2.
SHAPES = ((32, 5, 5, 1), (64, 5, 5, 32), (1024, 7, 7, 64), (10, 1, 1, 1024))
F16, F32 = m.FeatureChannelFormat.FLOAT16, m.FeatureChannelFormat.FLOAT32


def initial_parameters(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """OHWI weights uniform in [-0.2, 0.2) and biases 0.1, shared by both frameworks."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.rand(s, generator=gen) * 0.4 - 0.2, torch.full((s[0],), 0.1)) for s in SHAPES]


# -- mpsnn: the sample's data source and graphs ----------------------------------------------


class AdamDataSource(m.ConvolutionDataSource):
    """A layer's weights and its Adam, updated on the command buffer (the GPU update path),
    as the sample's ``ConvDataSource``: its own buffers, wrapped by the state Adam writes."""

    def __init__(
        self, device: m.Device, weights: torch.Tensor, biases: torch.Tensor, label: str
    ) -> None:
        o, kh, kw, i = weights.shape
        self._descriptor = m.ConvolutionDescriptor(kw, kh, i, o)
        self._label = label
        dev = device.torch_device
        # the data source's own buffers (the sample's weight and bias vectors), OHWI and (O,)
        self._weights = torch.empty((o, kh, kw, i), device=dev)
        self._weights.copy_(weights)
        self._biases = torch.empty(o, device=dev)
        self._biases.copy_(biases)
        # initWithWeights:biases: wraps the buffers: Adam's result state writes them in place
        self._state = m.ConvolutionWeightsAndBiasesState(self._weights, self._biases)
        desc = m.OptimizerDescriptor(learning_rate=LR)
        self.adam = m.Adam(device, BETA1, BETA2, EPS, time_step=0, descriptor=desc)
        self._momentum = [torch.zeros_like(self._weights), torch.zeros_like(self._biases)]
        self._velocity = [torch.zeros_like(self._weights), torch.zeros_like(self._biases)]
        self._t = 0  # updates encoded (a replayed CUDA graph does not call `update`)

    def descriptor(self) -> m.ConvolutionDescriptor:
        return self._descriptor

    def weights(self) -> torch.Tensor:
        return self._weights  # the data source's own buffer: the memory Adam writes

    def bias_terms(self) -> torch.Tensor | None:
        return self._biases

    @property
    def label(self) -> str | None:
        return self._label

    def update(
        self, command_buffer: m.CommandBuffer, gradient_state: Any, source_state: Any
    ) -> m.ConvolutionWeightsAndBiasesState:
        self._t += 1
        self.adam.encode(
            command_buffer,
            convolution_gradient_state=gradient_state,
            convolution_source_state=source_state,
            input_momentum_vectors=self._momentum,
            input_velocity_vectors=self._velocity,
            result_state=self._state,
        )
        assert self._t == self.adam.time_step, (self._label, self._t, self.adam.time_step)
        return self._state


def build_network(sources: list[AdamDataSource], training: bool) -> m.FilterNode:
    """The sample's node recipe: the loss node (training) or the softmax node (inference)."""
    same = m.DefaultPadding(
        m.PaddingMethod.ADD_REMAINDER_TO_TOP_LEFT
        | m.PaddingMethod.ALIGN_CENTERED
        | m.PaddingMethod.SIZE_SAME
    )
    x = m.ImageNode("image")
    for data in sources[:2]:
        conv = m.ConvolutionNode(x, data)
        conv.padding_policy = same
        relu = m.NeuronReLUNode(conv.result_image, a=0.0)
        pool = m.PoolingMaxNode(relu.result_image, 2, 2)
        pool.padding_policy = m.DefaultPadding.tensorflow_average_pooling()
        x = pool.result_image
    fc1 = m.FullyConnectedNode(x, sources[2])
    x = m.NeuronReLUNode(fc1.result_image, a=0.0).result_image
    if training:
        x = m.DropoutNode(
            x, keep_probability=0.5, seed=1, mask_stride_in_pixels=m.Size(1, 1, 1)
        ).result_image
    fc2 = m.FullyConnectedNode(x, sources[3])
    if not training:
        return m.SoftMaxNode(fc2.result_image)
    desc = m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM, 1 / BATCH)
    return m.LossNode(fc2.result_image, desc)


def gradients_in_float32(
    gradient_node: Any, inference_node: Any, inference_source: Any, gradient_source: Any
) -> None:
    """The sample's node handler: every gradient node's result image is FLOAT32."""
    gradient_node.result_image.format = F32


def run_mpsnn(
    args: argparse.Namespace,
    data: dict[str, torch.Tensor],
    params: list[tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, float]:
    dev = m.Device(args.device)
    sources = [
        AdamDataSource(dev, w, b, name)
        for (w, b), name in zip(params, ("conv1", "conv2", "fc1", "fc2"), strict=True)
    ]
    exits = build_network(sources, training=True).training_graph(None, gradients_in_float32)
    assert len(exits) == 1, f"the training graph must have one exit point, got {exits}"
    train = m.Graph(dev, exits[0].result_image, True)
    train.format = F16
    infer = m.Graph(dev, build_network(sources, training=False).result_image, True)
    infer.format = F16
    print(f"[mpsnn] storage of intermediates: {train.format.name} (gradients FLOAT32)")
    queue = dev.new_command_queue()
    compiled = train.compile(queue) if args.compile else None
    if compiled is not None and compiled.eager_reason is not None:
        print(f"[mpsnn] --compile: steps run eagerly ({compiled.eager_reason})")

    def evaluate() -> float:
        infer.reload_from_data_sources()
        correct = 0
        for i in range(0, data["test_x"].shape[0], 1000):
            cb = queue.command_buffer()
            probs = infer.encode_batch(cb, [m.ImageBatch.from_tensor(data["test_x"][i : i + 1000])])
            cb.commit()
            cb.wait_until_completed()
            pred = probs.tensor.flatten(1)[:, :CLASSES].argmax(1)  # FLOAT16 softmax
            correct += int((pred == data["test_y"][i : i + 1000]).sum())
        return correct / data["test_x"].shape[0]

    def step(idx: torch.Tensor) -> tuple[Any, list[m.LossLabels]]:
        images = m.ImageBatch.from_tensor(data["train_x"][idx])  # uint8: a UNORM8 batch
        onehot = data["train_onehot"][idx]
        labels = m.StateBatch(m.LossLabels(dev, onehot[i]) for i in range(BATCH))
        if compiled is not None:
            compiled([images], [labels])
            return compiled, compiled.source_states[0]
        cb = queue.command_buffer()
        train.encode_batch(cb, [images], [labels])
        cb.commit()  # no wait: the next step is encoded while this one runs (on CUDA)
        return cb, labels

    return train_loop("mpsnn", args, data, step, evaluate, sources)


# -- PyTorch: the same network and loop ---------------------------------------------------------


class TorchNet(nn.Module):
    def __init__(self, params: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        self.fc1 = nn.Linear(7 * 7 * 64, 1024)
        self.fc2 = nn.Linear(1024, CLASSES)
        self.dropout = nn.Dropout(0.5)
        with torch.no_grad():
            for layer, (w, b) in zip(
                (self.conv1, self.conv2, self.fc1, self.fc2), params, strict=True
            ):
                oihw = w.permute(0, 3, 1, 2)  # flattening OIHW matches x.flatten(1) of NCHW
                layer.weight.copy_(oihw if layer.weight.dim() == 4 else oihw.flatten(1))
                layer.bias.copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.dropout(F.relu(self.fc1(x.flatten(1))))
        return self.fc2(x)


def run_torch(
    args: argparse.Namespace,
    data: dict[str, torch.Tensor],
    params: list[tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, float]:
    net = TorchNet(params).to(args.device)
    opt = torch.optim.Adam(net.parameters(), lr=LR, betas=(BETA1, BETA2), eps=EPS)
    t = 0

    def step(idx: torch.Tensor) -> tuple[None, torch.Tensor]:
        nonlocal t
        t += 1
        opt.param_groups[0]["eps"] = EPS / math.sqrt(1 - BETA2**t)  # MPS's epsilon, exactly
        net.train()
        logits = net(data["train_x"][idx].float() / 255)
        loss = F.cross_entropy(logits, data["train_y"][idx], reduction="sum") / BATCH
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return None, loss.detach()

    @torch.no_grad()
    def evaluate() -> float:
        net.eval()
        correct = 0
        for i in range(0, data["test_x"].shape[0], 1000):
            pred = net(data["test_x"][i : i + 1000].float() / 255).argmax(1)
            correct += int((pred == data["test_y"][i : i + 1000]).sum())
        return correct / data["test_x"].shape[0]

    return train_loop("torch", args, data, step, evaluate, [])


# -- the loop both share ----------------------------------------------------------------------


def batch_loss(labels: Any) -> float:
    """The sample's printed loss: the batch's sum of loss images (each includes the weight
    1/40), divided by the batch size (torch: its loss is that sum already)."""
    if isinstance(labels, torch.Tensor):
        return float(labels) / BATCH
    return float(torch.stack([lab.loss_image().tensor.sum() for lab in labels]).sum()) / BATCH


def train_loop(
    name: str,
    args: argparse.Namespace,
    data: dict[str, torch.Tensor],
    step: Callable[[torch.Tensor], tuple[Any, Any]],
    evaluate: Callable[[], float],
    sources: list[AdamDataSource],
) -> dict[str, float]:
    """Train ``total`` steps on the pre-drawn batches, evaluating on the sample's schedule."""
    in_flight: deque[Any] = deque()  # command buffers (or the compiled step) not waited for

    def drain() -> None:
        while in_flight:
            in_flight.popleft().wait_until_completed()

    total = max(args.iterations, args.epoch_iterations)
    order = data["order"]
    result: dict[str, float] = {}
    eval_time = 0.0
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for it in range(total + 1):
        if it in (args.iterations, args.epoch_iterations) or (
            it < args.iterations and it % EVAL_EVERY == 0
        ):
            drain()
            t0 = time.perf_counter()
            acc = evaluate()
            eval_time += time.perf_counter() - t0
            print(f"[{name}] test accuracy before iteration {it}: {100 * acc:.2f}%")
            if it == args.iterations:
                result["acc_iters"] = acc
            if it == args.epoch_iterations:
                result["acc_epoch"] = acc
        if it == total:
            break
        if len(in_flight) == 2:  # the sample keeps at most two steps in flight
            in_flight.popleft().wait_until_completed()
        handle, labels = step(order[it])
        if handle is not None:
            in_flight.append(handle)
        if it % EVAL_EVERY == 0:
            if handle is not None:
                handle.wait_until_completed()
            print(f"[{name}] iteration {it}: training loss {batch_loss(labels):.4f}")
    drain()
    sync()
    seconds = time.perf_counter() - start
    for ds in sources:  # Adam's time step (device memory) rose by exactly one per step
        assert ds.adam.time_step == total, (ds.label, ds.adam.time_step)
        assert args.compile or ds._t == total, (ds.label, ds._t)
    result.update(train_s=seconds - eval_time, total_s=seconds)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("mpsnn", "torch", "both"), default="both")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument(
        "--epoch-iterations",
        type=int,
        default=60000 // BATCH,
        help="go on to this many iterations (one epoch) and evaluate again",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--eval-limit", type=int, default=None, help="evaluate on the first N test images only"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="mpsnn: train with graph.compile() (a CUDA graph; eager on CPU)",
    )
    args = parser.parse_args()
    args.epoch_iterations = max(args.epoch_iterations, args.iterations)

    torch.manual_seed(args.seed)
    dev = torch.device(args.device)
    train_x, train_y = load_fashion_mnist("train")
    test_x, test_y = load_fashion_mnist("test")
    if args.eval_limit:
        test_x, test_y = test_x[: args.eval_limit], test_y[: args.eval_limit]
    gen = torch.Generator().manual_seed(args.seed)
    onehot = F.one_hot(train_y, LABEL_CHANNELS).float().view(-1, LABEL_CHANNELS, 1, 1)
    data = {
        "train_x": train_x.to(dev),
        "train_y": train_y.to(dev),
        "train_onehot": onehot.to(dev),
        "test_x": test_x.to(dev),
        "test_y": test_y.to(dev),
        # every image drawn at random with replacement; both frameworks see the same batches
        "order": torch.randint(
            0, train_x.shape[0], (args.epoch_iterations, BATCH), generator=gen
        ).to(dev),
    }
    params = initial_parameters(args.seed)
    runs = ("mpsnn", "torch") if args.framework == "both" else (args.framework,)
    results = {}
    for name in runs:
        print(
            f"== {name} on {args.device}: {args.iterations} iterations, then "
            f"{args.epoch_iterations} (one epoch), batch {BATCH}, "
            f"{test_x.shape[0]} test images"
        )
        torch.manual_seed(args.seed)  # the dropout masks of the torch run
        results[name] = (run_mpsnn if name == "mpsnn" else run_torch)(args, data, params)
    print(
        f"\n| framework | device | acc@{args.iterations} | acc@{args.epoch_iterations} "
        "| train s | total s |\n|---|---|---|---|---|---|"
    )
    for name, r in results.items():
        label = name + (" (compile)" if name == "mpsnn" and args.compile else "")
        print(
            f"| {label} | {args.device} | {100 * r['acc_iters']:.2f}% "
            f"| {100 * r['acc_epoch']:.2f}% | {r['train_s']:.1f} | {r['total_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
