"""Where a training step's time goes: the CUDA kernels of an mpsnn graph step (replayed) and
of the PyTorch twin (eager), grouped by kernel name, and the host time of an eager mpsnn step:
encode and commit (unprofiled medians), each command's share (unprofiled), the PyTorch
operations and CUDA runtime calls (torch profiler, overall and per command), and the hottest
Python functions of encode and commit (cProfile).

    python -m benchmarks.tools.profile_step --model resnet18 --batch 512 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.tools.twin import mpsnn_graph_step, torch_twin_step
from mpsnn.cli.common import model_class, parse_device
from mpsnn.core import command_buffer as command_buffer_module


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


@contextlib.contextmanager
def _wrapped_commands(wrap: Callable[[Callable[[], Any], str], Callable[[], Any]]):
    """Within the block, every committed command runs as ``wrap(fn, name)()``; the commands
    get their own functions back after each commit (a step program reuses them)."""
    cls = command_buffer_module.CommandBuffer
    plain = cls._run

    def run(self: Any) -> None:
        cmds = list(self._commands)
        plain_fns = [cmd.fn for cmd in cmds]
        for cmd in cmds:
            cmd.fn = wrap(cmd.fn, cmd.name)
        try:
            plain(self)
        finally:
            for cmd, fn in zip(cmds, plain_fns, strict=True):
                cmd.fn = fn

    cls._run = run
    try:
        yield
    finally:
        cls._run = plain


def _command_host_times(run, sync, steps: int, top: int) -> None:
    """Host time of each command of an eager step, unprofiled: every command's function timed
    on its own (the GPU runs behind, as in a real step), summed per command name. The time a
    commit spends between commands (releases, checks) is not in these."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])

    def timed(fn: Callable[[], Any], name: str) -> Callable[[], None]:
        def call() -> None:
            t0 = time.perf_counter()
            try:
                fn()
            finally:
                entry = totals[name]
                entry[0] += time.perf_counter() - t0
                entry[1] += 1

        return call

    with _wrapped_commands(timed):
        for _ in range(steps):
            run.step()
            sync()
    total = sum(v[0] for v in totals.values()) / steps
    print(f"\n# commit host time per step, by command: {total * 1e3:.2f} ms in commands")
    for name, (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        per, calls = t / steps, n // steps
        print(f"{per * 1e3:8.3f} ms {calls:4d}x {per / max(1, calls) * 1e6:7.1f} us  {name}")


def _host_ops(run, sync, steps: int, top: int) -> None:
    """Self host time of the PyTorch operations and CUDA runtime calls of eager steps (where
    a step waits for the device, ``cudaStreamSynchronize`` or a blocking copy shows here)."""
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run.step()
        sync()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / steps
    print(f"\n# host operations of an eager step (self time, torch profiler): {total / 1e3:.2f} ms")
    for e in events[:top]:
        t, calls = e.self_cpu_time_total / steps, e.count // steps
        print(f"{t / 1e3:8.3f} ms {calls:5d}x {t / max(1, calls):7.1f} us  {e.key[:80]}")


def _command_ops(run, sync, top: int) -> None:
    """The PyTorch operations and launches each command of one eager step makes, by command
    name (the direct children of the command in the torch profiler's tree)."""

    def marked(fn: Callable[[], Any], name: str) -> Callable[[], None]:
        def call() -> None:
            with torch.profiler.record_function("cmd:" + name):
                fn()

        return call

    sync()
    with _wrapped_commands(marked), profile(activities=[ProfilerActivity.CPU]) as prof:
        run.step()
        sync()
    calls: dict[str, int] = collections.Counter()
    ops: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in prof.events():
        if e.name.startswith("cmd:"):
            calls[e.name[4:]] += 1
            for child in e.cpu_children:
                ops[e.name[4:]][child.name] += 1
    print("\n# operations per command call (one eager step)")
    for name, n in calls.most_common(top):
        parts = ", ".join(f"{k} {v / n:g}" for k, v in ops[name].most_common())
        print(f"{name} ({n}x): {parts}")


def _back_to_back(
    steps: dict[str, Any], sync, n: int = 30, synced_steps: int = 15, cuda: bool = True
) -> None:
    """Whether an eager step waits for the device: the synchronizing calls of one step (PyTorch's
    sync debug mode, CUDA), then each step's host time synchronized and back to back, and the
    wall time per step back to back (host-bound when it equals the host time)."""
    import warnings

    for name, fn in steps.items():
        sync()
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
        waits = [w for w in caught if "synchroniz" in str(w.message).lower()]
        synced, b2b = [], []
        for _ in range(synced_steps):
            sync()
            t0 = time.perf_counter()
            fn()
            synced.append(time.perf_counter() - t0)
        sync()
        start = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            b2b.append(time.perf_counter() - t0)
        sync()
        wall = (time.perf_counter() - start) / n
        calls = f"{len(waits)} synchronizing calls in a step" if cuda else "CPU"
        # one write with its newline: several processes may share this stdout
        print(f"# {name}: {calls}; host per step "
              f"{statistics.median(synced) * 1e3:.2f} ms synchronized, "
              f"{statistics.median(b2b) * 1e3:.2f} ms back to back; wall per step "
              f"{wall * 1e3:.2f} ms\n", end="", flush=True)  # fmt: skip


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
    # host, unprofiled: encode and commit of each step (medians: a shared host stalls at times)
    encodes, commits = [], []
    for _ in range(21):
        cb = queue.command_buffer()
        t0 = time.perf_counter()
        run.encode(cb)
        t1 = time.perf_counter()
        cb.commit()
        commits.append(time.perf_counter() - t1)
        encodes.append(t1 - t0)
        sync()
    print(f"# host per eager step, unprofiled (median of 21; min): encode "
          f"{statistics.median(encodes) * 1e3:.2f} ms ({min(encodes) * 1e3:.2f}), commit "
          f"{statistics.median(commits) * 1e3:.2f} ms ({min(commits) * 1e3:.2f})")  # fmt: skip
    _command_host_times(run, sync, 5, args.top)
    if cuda:
        twin = torch_twin_step(args.model, dev, x, y, args.dtype, args.optimizer)
        for _ in range(3):
            twin()
        _back_to_back({"mpsnn eager": run.step, "pytorch eager": twin}, sync)
        _host_ops(run, sync, 3, args.top)
    _command_ops(run, sync, args.top)
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
