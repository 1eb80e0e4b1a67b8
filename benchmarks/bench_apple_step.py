"""The training step of Apple's MPS sample, as `examples/apple_mnist.py` ports it, against the
same network and loop in PyTorch, in alternating runs in one process.

The mpsnn side is the sample's program: data sources that hold their own OHWI weights and
encode Adam themselves (`AdamDataSource.update`: the graph exports each layer's weights, the
data source updates into its own memory, the graph reloads it), 40 images (UNORM8) and 40
`LossLabels` per step, one ``encode_batch`` and a commit. Such a graph is not lowered to a
step program (its data sources run code of their own at every encode), so every step is a
full encode. PyTorch's side is the port's `TorchNet` with ``torch.optim.Adam``. Both start from
the same weights; the batch is one random batch reused.

For each of ``--pairs`` pairs, ``--steps`` steps of one side then of the other (the order
swapped every pair), the device synchronized around each run; the result is the median over
the pairs of mpsnn's step time over PyTorch's (below 1: mpsnn is faster).

    python -m benchmarks.bench_apple_step --device cpu --storage float32
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import mpsnn as m

_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "apple_mnist.py"


def _port() -> Any:
    """`examples/apple_mnist.py` as a module (the examples are not a package)."""
    spec = importlib.util.spec_from_file_location("apple_mnist", _EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _steps(device: str, storage: str, seed: int = 0) -> tuple[Callable[[], None], ...]:
    """(mpsnn's step, PyTorch's step, a device synchronization)."""
    a = _port()
    dev = m.Device(device)
    params = a.initial_parameters(seed)
    names = ("conv1", "conv2", "fc1", "fc2")
    sources = [a.AdamDataSource(dev, w, b, n) for (w, b), n in zip(params, names, strict=True)]
    exits = a.build_network(sources, training=True).training_graph(None, a.gradients_in_float32)
    graph = m.Graph(dev, exits[0].result_image, True)
    graph.format = getattr(m.FeatureChannelFormat, storage.upper())
    queue = dev.new_command_queue()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (a.BATCH, 1, 28, 28), dtype=torch.uint8, generator=gen)
    y = torch.randint(0, a.CLASSES, (a.BATCH,), generator=gen)
    onehot = torch.zeros(a.BATCH, a.LABEL_CHANNELS, 1, 1)
    onehot[torch.arange(a.BATCH), y] = 1.0
    x, y, onehot = x.to(dev.torch_device), y.to(dev.torch_device), onehot.to(dev.torch_device)
    last: list[Any] = [None]

    def mpsnn_step() -> None:
        images = m.ImageBatch.from_tensor(x)
        labels = m.StateBatch(m.LossLabels(dev, onehot[i]) for i in range(a.BATCH))
        cb = queue.command_buffer()
        graph.encode_batch(cb, [images], [labels])
        cb.commit()
        last[0] = cb

    net = a.TorchNet(params).to(dev.torch_device)
    opt = torch.optim.Adam(net.parameters(), lr=a.LR, betas=(a.BETA1, a.BETA2), eps=a.EPS)
    xf = x.float() / 255

    def torch_step() -> None:
        loss = F.cross_entropy(net(xf), y, reduction="sum") / a.BATCH
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    def sync() -> None:
        if last[0] is not None:
            last[0].wait_until_completed()
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    return mpsnn_step, torch_step, sync


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--storage", choices=("float16", "float32"), default="float32",
                   help="the graph's storage format (the sample uses float16)")  # fmt: skip
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--steps", type=int, default=40,
                   help="steps a side per pair (fewer: each switch between the two sides' "
                        "allocations weighs more)")  # fmt: skip
    args = p.parse_args(argv)
    mpsnn_step, torch_step, sync = _steps(args.device, args.storage)
    for fn in (mpsnn_step, torch_step):
        for _ in range(3):
            fn()
        sync()
    ratios, times = [], {"mpsnn": [], "torch": []}
    for k in range(args.pairs):
        order = [("mpsnn", mpsnn_step), ("torch", torch_step)]
        per: dict[str, float] = {}
        for name, fn in order if k % 2 == 0 else order[::-1]:
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn()
            sync()
            per[name] = (time.perf_counter() - t0) / args.steps * 1e3
            times[name].append(per[name])
        ratios.append(per["mpsnn"] / per["torch"])
    print(f"Apple's sample step, {m.Device(args.device).name}, {args.storage} storage, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"mpsnn {statistics.median(times['mpsnn']):.2f} ms, PyTorch "
          f"{statistics.median(times['torch']):.2f} ms per step (medians); mpsnn / PyTorch per "
          f"pair: median {statistics.median(ratios):.2f} "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}) over {args.pairs} pairs")  # fmt: skip


if __name__ == "__main__":
    main()
