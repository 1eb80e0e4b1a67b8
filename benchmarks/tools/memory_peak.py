"""What is alive at the peak of one training step: the CUDA allocations of an eager mpsnn graph
step and of the PyTorch twin's step (autocast bf16, channels-last), grouped by the line that
made them, from the caching allocator's trace.

    python -m benchmarks.tools.memory_peak --model resnet18 --batch 512
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.tools.twin import mpsnn_graph_step, torch_twin_step
from mpsnn.cli.common import parse_device


def _site(frames: list[dict[str, Any]]) -> str:
    """The first frame of mpsnn's (or of the model's) code that is not the image/queue layer."""
    for f in frames:
        name = f.get("filename", "")
        if "/mpsnn/" in name and "/core/device.py" not in name and "/core/image.py" not in name:
            return f"{name.split('/mpsnn/')[-1]}:{f.get('line')} {f.get('name')}"
    for f in frames:
        name = f.get("filename", "")
        if "torch/" not in name and "python" not in name.lower():
            return f"{name.split('/')[-1]}:{f.get('line')} {f.get('name')}"
    return frames[0].get("name", "?") if frames else "?"


def analyse(name: str, step: Callable[[], None], top: int) -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    peak = torch.cuda.max_memory_allocated()
    live: dict[int, tuple[int, str]] = {}
    cur = best = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for ev in snap["device_traces"][0]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], _site(ev.get("frames", [])))
            cur += ev["size"]
            if cur > best:
                best, at_peak = cur, dict(live)
        elif ev["action"] == "free_requested":
            size = live.pop(ev["addr"], (0, ""))[0]
            cur -= size
    by_site: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for size, where in at_peak.values():
        by_site[where] += size
        count[where] += 1
    print(
        f"== {name}: allocated before {before / 2**20:.0f} MiB, peak {peak / 2**20:.0f} MiB; "
        f"step allocations live at the peak {best / 2**20:.0f} MiB"
    )
    for where, size in by_site.most_common(top):
        print(f"  {size / 2**20:8.1f} MiB {count[where]:4d}x {where}")


def _mpsnn(a: argparse.Namespace, dev: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    run = mpsnn_graph_step(a.model, dev, x, y, a.dtype)

    def mpsnn_step() -> None:
        run.step().wait_until_completed()

    for _ in range(3):
        mpsnn_step()
    analyse("mpsnn eager graph step", mpsnn_step, a.top)
    print(run.graph.debug_description().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args()
    dev = parse_device("cuda")
    shape = (3, 32, 32) if a.model == "resnet18" else (1, 28, 28)
    x = torch.randn(a.batch, *shape, device=dev.torch_device)
    y = torch.randint(0, 10, (a.batch,), device=dev.torch_device)
    _mpsnn(a, dev, x, y)  # its graph is freed before PyTorch's step runs
    torch.cuda.empty_cache()
    torch_step = torch_twin_step(a.model, dev, x, y, a.dtype)
    for _ in range(3):
        torch_step()
    analyse("PyTorch eager step", torch_step, a.top)


if __name__ == "__main__":
    main()
