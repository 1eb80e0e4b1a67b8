"""Time of a compiled (replayed) training step called back to back, per model: the time a
training loop that never waits sees, host and device together.

    python -m benchmarks.tools.replay_time --tag after

Each case builds the model's training graph (`benchmarks.tools.twin.mpsnn_graph_step`: seed 0,
the images in the graph's storage format), compiles it (`Graph.compile`), calls it 5 times
(eager, recorded, replayed), then times ``--trials`` runs of ``steps`` calls each, waiting for
the last step only, and prints the median milliseconds per step and every trial, one line per
case, prefixed with ``--tag`` (to tell two trees' lines apart when they alternate in one
machine). Cases: LeNet-5 (batch 256, float32, Adam, 200 calls a trial) and ResNet-18 (batch
512, bfloat16, SGD, 50 calls). On the CPU a compiled step runs eagerly (``--device cpu
--batch 2 --steps 2`` is a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.tools.twin import mpsnn_graph_step
from mpsnn.cli.common import parse_device

CASES = {
    "lenet": (256, (1, 28, 28), "float32", "adam", 200),
    "resnet18": (512, (3, 32, 32), "bfloat16", "sgd", 50),
}


def time_replays(
    model: str, device: str, batch: int | None, trials: int, steps: int | None = None
) -> list[float]:
    """Milliseconds per step of ``trials`` runs of back-to-back calls of ``model``'s compiled
    step (see the module docstring)."""
    default_batch, shape, dtype, optimizer, default_steps = CASES[model]
    dev = parse_device(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch or default_batch, *shape, generator=gen).to(dev.torch_device)
    y = torch.randint(0, 10, (x.shape[0],), generator=gen).to(dev.torch_device)
    run = mpsnn_graph_step(model, dev, x, y, dtype, optimizer)
    compiled = run.graph.compile(run.queue)
    for _ in range(5):
        compiled(run.images, run.labels)
    compiled.wait_until_completed()
    n = steps or default_steps
    out = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(n):
            compiled(run.images, run.labels)
        compiled.wait_until_completed()
        out.append((time.perf_counter() - start) / n * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--only", default=",".join(CASES), help="comma-separated cases")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--steps", type=int, default=None, help="calls per trial (default per case)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default per case)")
    p.add_argument("--tag", default="", help="a prefix for each line")
    args = p.parse_args()
    if args.device == "cuda":
        torch.backends.cudnn.benchmark = True
    for model in args.only.split(","):
        ms = time_replays(model, args.device, args.batch, args.trials, args.steps)
        trials = ", ".join(f"{t:.4f}" for t in ms)
        print(f"{args.tag} {model} replay {statistics.median(ms):.4f} ms  ({trials})".strip())
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
