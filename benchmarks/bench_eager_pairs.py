"""The eager mpsnn training step against PyTorch eager in alternating runs in one process: for
each of ``--pairs`` pairs, ``--steps`` steps of one side then of the other (the order swapped
every pair), a synchronization around each run. A host whose speed drifts (a shared machine)
slows both sides of a pair alike, so the ratio per pair is steadier than two separate timings.

    python -m benchmarks.bench_eager_pairs --model lenet --pairs 11
    PYTHONPATH=<old tree> python benchmarks/bench_eager_pairs.py --label before

Uses only APIs that earlier trees have too (``build_model``, ``training_graph``,
``encode_batch``), so the same script measures an older tree: run it once per tree, alternately,
for a before/after comparison. ``benchmarks.bench_graph --pairs`` runs it after its own table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from mpsnn.cli.bench import _batch, _labels, _torch_optimizer
from mpsnn.cli.common import DTYPES, build_model, make_optimizer, parse_device


def precision_info() -> dict:
    """Which float32 arithmetic each side ran: mpsnn's switch (TF32 only under "high" or
    "medium") and PyTorch's flags; an older tree's mpsnn ran under PyTorch's flags."""
    try:
        from mpsnn.core.precision import describe
    except ImportError:
        return {
            "mpsnn_float32_matmul_precision": None,
            "torch_cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            "torch_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        }
    return describe()


CASES = {  # model: (batch, dtype, optimizer, input shape, steps per run)
    "cnn": (64, "float32", "adam", (1, 28, 28), 20),  # `mpsnn train`'s network and batch
    "lenet": (256, "float32", "adam", (1, 28, 28), 50),
    "resnet18": (512, "bfloat16", "sgd", (3, 32, 32), 10),
}


def measure(
    model: str, device: str, pairs: int, steps: int | None = None, batch: int | None = None
) -> dict:
    """Returns ``{"mpsnn_ms": [...], "torch_ms": [...], "ratios": [...], "median_ratio": ...,
    ...}``: a ratio is PyTorch's step time over mpsnn's in one pair (above 1: mpsnn is
    faster). ``steps`` and ``batch`` default to the case's."""
    default_batch, dtype, opt, shape, default_steps = CASES[model]
    steps = steps or default_steps
    batch = batch or default_batch
    dev = parse_device(device)
    td = dev.torch_device
    cuda = td.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, *shape, generator=gen).to(td)
    y = torch.randint(0, 10, (batch,), generator=gen).to(td)
    net = build_model(model, dev, make_optimizer(opt, dev, None), seed=0, input_shape=shape)
    graph = net.training_graph(batch, storage=DTYPES[dtype])
    queue = dev.new_command_queue()
    images, labels = [_batch(x, DTYPES[dtype])], [_labels(dev, y)]

    def mine() -> None:
        cb = queue.command_buffer()
        graph.encode_batch(cb, images, labels)
        cb.commit()

    low = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    twin = build_model(model, dev, None, seed=0, input_shape=shape).torch_module().to(td)
    xs = x
    if low is not None and cuda:
        twin = twin.to(memory_format=torch.channels_last)
        xs = x.contiguous(memory_format=torch.channels_last)
    optimizer = _torch_optimizer(opt, twin.parameters(), cuda)

    def theirs() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(td.type, dtype=low or torch.bfloat16, enabled=low is not None):
            loss = F.cross_entropy(twin(xs).float(), y)
        loss.backward()
        optimizer.step()

    a, b, ratios = timed_pairs(mine, theirs, steps, pairs, sync)
    return {"model": model, "batch": batch, "dtype": dtype, "optimizer": opt,
            "device": dev.name, "torch": torch.__version__, "steps": steps, "mpsnn_ms": a,
            "torch_ms": b, "ratios": ratios, "precision": precision_info(),
            "median_ratio": statistics.median(ratios)}  # fmt: skip


def timed_pairs(
    mine: Callable[[], None],
    theirs: Callable[[], None],
    steps: int,
    pairs: int,
    sync: Callable[[], None] = lambda: None,
) -> tuple[list[float], list[float], list[float]]:
    """Both sides warmed up (three steps each, twice, alternating), then `alternate` with each
    side's mean step time in ms over ``steps`` steps (``sync`` before and after each timing):
    returns (mine's times, theirs, the per-pair ratios theirs / mine)."""

    def timed(step: Callable[[], None]) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        return (time.perf_counter() - t0) / steps * 1e3

    for step in (mine, theirs, mine, theirs):
        for _ in range(3):
            step()
    a, b = alternate(mine, theirs, timed, pairs)
    return a, b, [t / m for m, t in zip(a, b, strict=True)]


def alternate(
    mine: Callable[[], None],
    theirs: Callable[[], None],
    timed: Callable[[Callable[[], None]], float],
    pairs: int,
) -> tuple[list[float], list[float]]:
    """``timed(step)`` of each side in turn, ``pairs`` times, the order swapped every pair
    (mine first in even pairs): returns (mine's times, theirs)."""
    a: list[float] = []
    b: list[float] = []
    for i in range(pairs):
        order = ((mine, a), (theirs, b)) if i % 2 == 0 else ((theirs, b), (mine, a))
        for step, out in order:
            out.append(timed(step))
    return a, b


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=list(CASES), default="lenet")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--pairs", type=int, default=11)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--label", default="")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    r = measure(a.model, a.device, a.pairs, a.steps, a.batch)
    r["label"] = a.label
    q = sorted(r["ratios"])
    print("# float32 precision: " + ", ".join(f"{k}={v}" for k, v in r["precision"].items()))
    print(
        f"{a.label:8s} {r['model']:<9} {r['device']}: mpsnn {statistics.median(r['mpsnn_ms']):.3f}"
        f" ms, PyTorch {statistics.median(r['torch_ms']):.3f} ms per step; PyTorch/mpsnn per "
        f"pair: median {statistics.median(q):.2f}x, range {q[0]:.2f}-{q[-1]:.2f}x, "
        f"{sum(v < 1 for v in q)} of {len(q)} below 1"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
