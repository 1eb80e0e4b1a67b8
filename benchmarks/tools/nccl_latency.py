"""Latency of a small collective through ``torch.distributed`` and through mpsnn's direct NCCL
communicator (`mpsnn.distributed.nccl.NcclComm`), eagerly and inside a CUDA graph.

    python -m benchmarks.tools.nccl_latency [--gpus 2] [--values 1537] [--repeat 40]

Each variant runs ``--repeat`` times (a small kernel, then the collective) back to back; µs
per collective: the wall time with a synchronization at the end, the host time of issuing
them, and the wall time of a CUDA graph that recorded them. The last line says whether both
paths gave the same values (all-reduce and all-gather).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _timed(fn: Callable[[], None], reps: int) -> tuple[float, float]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda.synchronize()
    host = []
    start = time.perf_counter()
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / reps
    return wall, sorted(host)[len(host) // 2]


def _graphed(fn: Callable[[], None]) -> Callable[[], None]:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def _rank(rank: int, world: int, values: int, repeat: int, port: int) -> None:
    from mpsnn.distributed.nccl import NcclComm

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    comm = NcclComm.create(None, device)
    if comm is None:
        raise SystemExit("no usable NCCL library")
    x = torch.randn(values, device=device)
    out = torch.empty(world * values, device=device)

    def loop(collective: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(repeat):
                x.mul_(0.5)
                collective()

        return run

    variants = {
        "kernel alone": loop(lambda: None),
        "torch.distributed all-gather": loop(
            lambda: dist.all_gather_into_tensor(out, x, async_op=True).wait()
        ),
        "torch.distributed all-reduce": loop(lambda: dist.all_reduce(x, async_op=True).wait()),
        "direct all-gather": loop(lambda: comm.all_gather_(out, x)),
        "direct all-reduce": loop(lambda: comm.all_reduce_(x)),
    }
    rows = []
    for name, fn in variants.items():
        wall, host = _timed(fn, 20)
        graph_wall, _ = _timed(_graphed(fn), 20)
        rows.append((name, wall / repeat * 1e6, host / repeat * 1e6, graph_wall / repeat * 1e6))
    gen = torch.Generator(device).manual_seed(rank)
    a = torch.randn(values, device=device, generator=gen)
    b = a.clone()
    dist.all_reduce(a)
    comm.all_reduce_(b)
    g1, g2 = torch.empty_like(out), torch.empty_like(out)
    dist.all_gather_into_tensor(g1, a)
    comm.all_gather_(g2, a)
    flag = torch.tensor([int(torch.equal(a, b) and torch.equal(g1, g2))], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank's comparison
    same = bool(flag.item())
    if rank == 0:
        version = ".".join(map(str, torch.cuda.nccl.version()))
        name = torch.cuda.get_device_name(0)
        print(f"{world} x {name}, torch {torch.__version__}, NCCL {version}, {values} float32")
        print("| path | eager wall µs | eager host µs | CUDA graph µs |")
        print("|---|---:|---:|---:|")
        for name, wall, host, graph in rows:
            print(f"| {name} | {wall:.1f} | {host:.1f} | {graph:.1f} |")
        print(f"same values through both paths, on every rank: {same}")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--values", type=int, default=1537)
    parser.add_argument("--repeat", type=int, default=40)
    parser.add_argument("--port", type=int, default=29561)
    a = parser.parse_args()
    if torch.cuda.device_count() < a.gpus:
        raise SystemExit(f"needs {a.gpus} GPUs, found {torch.cuda.device_count()}")
    mp.spawn(_rank, args=(a.gpus, a.values, a.repeat, a.port), nprocs=a.gpus)


if __name__ == "__main__":
    main()
