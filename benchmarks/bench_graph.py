"""One LeNet-5 training step (forward, softmax cross-entropy, backward, Adam) at batch 256,
float32, 28×28×1: an mpsnn training graph encoded eagerly and replayed (`Graph.compile`),
against the same network in PyTorch eager and under ``torch.compile``, in one run.

Rows: milliseconds per step in steady state (a run of steps back to back, then one
synchronization, divided by the steps: what a training loop pays), and the host time of one
eager ``encode_batch`` (encode only, no commit). Every variant starts from the same weights
(the model's PyTorch twin) and trains on the same batch; the loss after the timed steps is
printed for each as a check that they all trained.

    python -m benchmarks.bench_graph --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import mpsnn as m
from mpsnn.models import LeNet5


def _ms_per_step(step: Callable[[], None], sync: Callable[[], None], steps: int,
                 trials: int) -> float:  # fmt: skip
    runs = []
    for _ in range(trials):
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()
        runs.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(runs)


def measure(device: str, batch: int, steps: int, trials: int, compile_modes: list[str]) -> dict:
    dev = m.Device(device)
    tdev = dev.torch_device
    cuda = tdev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 1, 28, 28, generator=gen).to(tdev)
    y = torch.randint(0, 10, (batch,), generator=gen).to(tdev)
    rows: dict[str, float] = {}
    losses: dict[str, float] = {}

    # -- mpsnn: the training graph, eager and replayed ----------------------------------
    def mpsnn_graph() -> m.Graph:
        model = LeNet5(dev, m.Adam(dev, descriptor=m.OptimizerDescriptor(learning_rate=1e-3)))
        return model.training_graph(batch)

    graph = mpsnn_graph()
    queue = dev.new_command_queue()
    images = [m.ImageBatch.from_tensor(x)]
    labels = [m.LossLabels(dev, y.view(-1, 1, 1))]

    def eager() -> None:
        cb = queue.command_buffer()
        graph.encode_batch(cb, images, labels)
        cb.commit()

    for _ in range(3):
        eager()
    rows["mpsnn graph eager"] = _ms_per_step(eager, sync, steps, trials)
    losses["mpsnn graph eager"] = labels[0].loss_image().tensor.sum().item()

    def encode_only() -> float:
        cb = queue.command_buffer()
        t0 = time.perf_counter()
        graph.encode_batch(cb, images, labels)
        t = time.perf_counter() - t0
        cb.commit()
        return t

    rows["mpsnn eager encode_batch (host only)"] = 1e3 * statistics.median(
        encode_only() for _ in range(max(steps, 20))
    )
    sync()
    report = graph.debug_description().splitlines()[-1].strip()

    graph2 = mpsnn_graph()
    compiled = graph2.compile(dev.new_command_queue())
    for _ in range(3):
        compiled(images, labels)

    def replay() -> None:
        compiled(images, labels)

    rows["mpsnn graph replayed" if compiled.is_captured else "mpsnn graph compiled (eager)"] = (
        _ms_per_step(replay, sync, steps, trials)
    )
    compiled.wait_until_completed()
    losses["mpsnn graph replayed"] = compiled.source_states[0][0].loss_image().tensor.sum().item()

    # -- PyTorch: the model's twin, eager and compiled ----------------------------------
    def torch_variant(mode: str | None) -> tuple[Callable[[], None], Callable[[], float]]:
        net = LeNet5(dev).torch_module().to(tdev)
        opt = torch.optim.Adam(net.parameters(), lr=1e-3, **({"fused": True} if cuda else {}))
        fwd = net if mode is None else torch.compile(net, mode=None if mode == "default" else mode)
        last = [torch.zeros((), device=tdev)]

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(fwd(x), y)
            loss.backward()
            opt.step()
            last[0] = loss.detach()

        return step, lambda: float(last[0])

    step, loss_of = torch_variant(None)
    for _ in range(3):
        step()
    rows["torch eager"] = _ms_per_step(step, sync, steps, trials)
    losses["torch eager"] = loss_of()
    for mode in compile_modes:
        step, loss_of = torch_variant(mode)
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        sync()
        name = f"torch.compile ({mode})"
        print(f"  {name}: compiled and warmed up in {time.perf_counter() - t0:.1f} s")
        rows[name] = _ms_per_step(step, sync, steps, trials)
        losses[name] = loss_of()
    return {"rows": rows, "losses": losses, "memory": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument(
        "--compile-modes", default="default", help="comma-separated torch.compile modes ('' none)"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.device == "cpu":  # keep a CPU run short
        args.steps, args.trials = min(args.steps, 5), min(args.trials, 3)
    modes = [s for s in args.compile_modes.split(",") if s]
    out = measure(args.device, args.batch, args.steps, args.trials, modes)
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"# LeNet-5 training step, batch {args.batch} float32, {name}, torch {torch.__version__}")
    print(f"# mpsnn intermediates: {out['memory']}")
    rows = out["rows"]
    ref = rows["torch eager"]
    print(f"{'variant':<40}{'ms/step':>10}{'vs torch eager':>16}{'loss':>10}")
    for k, v in rows.items():
        loss = out["losses"].get(k, out["losses"].get(k.replace("compiled (eager)", "replayed")))
        ratio = f"{ref / v:.2f}x" if "host only" not in k else ""
        shown = f"{loss:.4f}" if loss is not None else ""
        print(f"{k:<40}{v:>10.3f}{ratio:>16}{shown:>10}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, **out}, f, indent=1)


if __name__ == "__main__":
    main()
