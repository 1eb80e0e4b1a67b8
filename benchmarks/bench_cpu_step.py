"""``mpsnn train``'s CPU step against PyTorch eager's, in alternating pairs in one process.

The step is the one ``mpsnn train`` runs, set up by its own `mpsnn.cli.trainer.Trainer`
(``--model cnn``, batch 64, float32, Adam, Fashion-MNIST read and standardized, the rate of
epoch 1): `mpsnn.training.TrainingLoop.train_step` on the batches of epoch 1's order (the
compiled step, which is eager on the CPU: ``graph.encode_batch`` and a commit), the loss and
the correct predictions summed on the device. PyTorch's step is `mpsnn.cli.torch_baseline`'s:
the model's twin from the same initial weights, its optimizer and loss
(`torch_optimizer`, `torch_loss`), ``zero_grad(set_to_none=True)``, forward, backward, step,
and the same two sums. Reading the data as the command does matters: the host allocator's
state (how much freed memory it keeps) follows the process's history, and fresh pages cost a
page fault each. The thread count is torch's default, as in ``mpsnn train`` (which does not
set it); ``--threads N`` sets it (``torch.set_num_threads``) for both sides, e.g. 1 on a shared
host where other processes take cores (a multi-threaded step then waits for the descheduled
thread at every operator).

For each of ``--pairs`` pairs, ``--steps`` steps of one side then of the other (the order
swapped every pair): a shared host whose speed drifts slows both sides of a pair alike, so
the per-pair ratio is steadier than two separate timings. The result is the median over the
pairs of PyTorch's step time over mpsnn's (above 1: mpsnn is faster).

    python -m benchmarks.bench_cpu_step                       # this tree
    python -m benchmarks.bench_cpu_step --against <old tree>  # both trees, alternating runs

``--against`` runs this script ``--rounds`` times per tree in fresh processes (the trees
alternate, the first one swapped every round; ``PYTHONPATH`` selects the tree) and reports
each tree's median ratio over all its pairs. Uses only APIs today's trees have (`Trainer`,
`TrainingLoop`, `mpsnn.cli.torch_baseline`). Needs the Fashion-MNIST files (see
docs/training.md).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_eager_pairs import timed_pairs

BATCH = 64


def measure(pairs: int, steps: int, batch: int = BATCH) -> dict[str, Any]:
    """``{"mpsnn_ms": [...], "torch_ms": [...], "ratios": [...], "median_ratio": ...}``: per
    pair, each side's mean step time and PyTorch's over mpsnn's."""
    from mpsnn.cli.torch_baseline import torch_loss, torch_optimizer
    from mpsnn.cli.trainer import TrainConfig, Trainer

    # `mpsnn train`'s own setup: the data read and standardized, the model, its training loop
    # (compiled: eager on the CPU), the rate of epoch 1; the process's memory as in a run
    trainer = Trainer(TrainConfig(model="cnn", batch_size=batch, device="cpu"))
    c = trainer.config
    loop = trainer.loop
    trainer.optimizer.learning_rate = lr = trainer.learning_rate(1)
    order = trainer.order(1)
    sums = loop.new_sums()

    twin = copy.deepcopy(trainer.model.twin)  # `train_torch`'s model, optimizer and loss
    opt = torch_optimizer(c, twin.parameters(), lr, False)
    criterion = torch_loss(c)
    loss_sum = torch.zeros((), dtype=torch.float64)
    correct = torch.zeros((), dtype=torch.int64)
    where = [0, 0]
    count = len(order) // batch

    def batch_of(side: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = where[side] = (where[side] + 1) % count
        idx = order[i * batch : (i + 1) * batch]
        return trainer.train_x[idx], trainer.train_y[idx]

    def mine() -> None:
        x, y = batch_of(0)
        loop.train_step(x, y, sums)

    def theirs() -> None:
        nonlocal loss_sum, correct
        x, y = batch_of(1)
        opt.zero_grad(set_to_none=True)
        logits = twin(x)
        loss = criterion(logits.float(), y)
        loss.backward()
        opt.step()
        loss_sum += loss.detach()
        correct += (logits.argmax(1) == y).sum()

    a, b, ratios = timed_pairs(mine, theirs, steps, pairs)
    return {"model": "cnn", "batch": batch, "dtype": "float32", "optimizer": c.optimizer,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "steps": steps,
            "mpsnn_ms": a, "torch_ms": b, "ratios": ratios,
            "median_ratio": statistics.median(ratios)}  # fmt: skip


def summary(label: str, r: dict[str, Any]) -> str:
    q = sorted(r["ratios"])
    return (
        f"{label:8s} cnn b{r['batch']} cpu ({r['threads']} threads): mpsnn "
        f"{statistics.median(r['mpsnn_ms']):.3f} ms, PyTorch {statistics.median(r['torch_ms']):.3f}"
        f" ms per step; PyTorch/mpsnn per pair: median {statistics.median(q):.3f}x, range "
        f"{q[0]:.2f}-{q[-1]:.2f}x over {len(q)} pairs"
    )


def compare(
    against: str, rounds: int, pairs: int, steps: int, threads: int | None = None
) -> dict[str, Any]:
    """Run this script in fresh processes, alternating the tree at ``against`` ("before") and
    this one ("after"); each tree's ratios over all its pairs."""
    here = str(Path(__file__).resolve().parents[1])
    trees = {"before": str(Path(against).resolve()), "after": here}
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for r in range(rounds):
        names = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for name in names:
            env = {**os.environ, "PYTHONPATH": trees[name]}
            cmd = [sys.executable, str(Path(__file__).resolve()), "--pairs", str(pairs),
                   "--steps", str(steps), "--print-json"]  # fmt: skip
            if threads is not None:
                cmd += ["--threads", str(threads)]
            out = subprocess.run(cmd, env=env, cwd=trees[name], check=True,
                                 capture_output=True, text=True)  # fmt: skip
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(summary(name, runs[name][-1]), flush=True)
    result: dict[str, Any] = {}
    for name, rs in runs.items():
        merged = {k: [v for x in rs for v in x[k]] for k in ("mpsnn_ms", "torch_ms", "ratios")}
        merged.update({k: rs[0][k] for k in ("batch", "threads", "torch", "steps")})
        merged["median_ratio"] = statistics.median(merged["ratios"])
        result[name] = merged
        print(summary(f"{name}*", merged))
    gain = statistics.median(result["before"]["mpsnn_ms"]) / statistics.median(
        result["after"]["mpsnn_ms"]
    )
    print(f"mpsnn step: before/after {gain:.3f}x (medians over all pairs)")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=11)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--against", default=None, help="an older tree: compare both")
    p.add_argument("--rounds", type=int, default=3, help="runs per tree with --against")
    p.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)"
    )
    p.add_argument("--json", default=None)
    p.add_argument("--print-json", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.against:
        result = compare(a.against, a.rounds, a.pairs, a.steps, a.threads)
    else:
        if a.threads is not None:
            torch.set_num_threads(a.threads)
        result = measure(a.pairs, a.steps)
        if a.print_json:
            print(json.dumps(result))
            return
        print(summary("", result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
