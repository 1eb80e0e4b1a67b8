"""Where a training step's time goes: the CUDA kernels of an mpsnn graph step (replayed) and
of the PyTorch twin (eager), grouped by kernel name, and the host time of an eager mpsnn step
split into encode and commit, with the hottest Python functions of each.

    python -m benchmarks.tools.profile_step --model resnet18 --batch 512 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.tools.twin import mpsnn_graph_step, torch_twin_step
from mpsnn.cli.common import model_class, parse_device


def _kernels(fn, steps: int, top: int, title: str) -> None:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) / steps
    print(f"\n# {title}: {total / 1e3:.3f} ms of kernels per step")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:top]:
        t = e.device_time_total / steps
        print(f"{t / 1e3:8.3f} ms {100 * t / total:5.1f}% {e.count // steps:4d}x  {e.key[:90]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="resnet18")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--top", type=int, default=22)
    p.add_argument("--lines", type=int, default=14, help="hottest host functions listed")
    p.add_argument("--device", default="cuda", help="cpu: the host profile only (a smoke test)")
    args = p.parse_args()
    dev = parse_device(args.device)
    cuda = dev.torch_device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    shape = model_class(args.model).input_shape
    x = torch.randn(args.batch, *shape, device=dev.torch_device)
    y = torch.randint(0, 10, (args.batch,), device=dev.torch_device)
    run = mpsnn_graph_step(args.model, dev, x, y, args.dtype, args.optimizer)
    queue, eager = run.queue, run.step

    for _ in range(3):
        eager()
    sync()
    # host: encode and commit separately, cProfile of each
    enc, com = cProfile.Profile(), cProfile.Profile()
    t_enc = t_com = 0.0
    for _ in range(5):
        cb = queue.command_buffer()
        t0 = time.perf_counter()
        enc.enable()
        run.encode(cb)
        enc.disable()
        t1 = time.perf_counter()
        com.enable()
        cb.commit()
        com.disable()
        t_com += time.perf_counter() - t1
        t_enc += t1 - t0
        sync()
    enc_ms, com_ms = t_enc / 5 * 1e3, t_com / 5 * 1e3
    print(f"# host per eager step: encode {enc_ms:.2f} ms, commit {com_ms:.2f} ms")
    for name, pr in (("encode", enc), ("commit", com)):
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.lines)
        print(f"\n# {name}: hottest functions (profiled, 5 steps)")
        print("\n".join(s.getvalue().splitlines()[6 : 10 + args.lines]))
    if not cuda:
        return
    compiled = run.graph.compile(queue)
    for _ in range(3):
        compiled(run.images, run.labels)
    _kernels(lambda: compiled(run.images, run.labels), 5, args.top, "mpsnn replayed")
    torch_step = torch_twin_step(args.model, dev, x, y, args.dtype, args.optimizer)
    for _ in range(3):
        torch_step()
    _kernels(torch_step, 5, args.top, "pytorch eager")


if __name__ == "__main__":
    main()
