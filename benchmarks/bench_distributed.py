"""Data-parallel training throughput: mpsnn (`mpsnn.DataParallel`, NCCL) beside PyTorch DDP of
the same model, on 1 GPU and on N GPUs, and the scaling efficiency of each.

    python -m benchmarks.bench_distributed --gpus 2 --json out.json
    python -m benchmarks.bench_distributed --device cpu --model lenet --gpus 2   # Gloo check

Each world size runs in fresh processes (``torch.multiprocessing`` spawn, one per GPU, NCCL,
``NCCL_NVLS_ENABLE=0`` set before anything initializes NCCL). The model is a CIFAR-style
ResNet-18 (``mpsnn.models.ResNet18``) on synthetic 32×32×3 images, ``--batch-per-gpu`` images
per GPU (the global batch grows with the GPUs: weak scaling), SGD with momentum 0.9:

* mpsnn: the training graph in bfloat16 storage (float32 master weights; the images cast to
  bfloat16 first, as ``mpsnn train`` feeds them), ``graph.data_parallel
  = DataParallel()`` on N GPUs (gradients bucketed and all-reduced while the backward runs,
  batch-norm statistics and gradient sums combined across GPUs: synchronized batch norm);
  one GPU runs the plain graph. ``--mpsnn-modes``: ``replay`` (`Graph.compile`: the step,
  NCCL collectives included, recorded once as a CUDA graph and replayed), ``replay-local``
  (the same with ``DataParallel(sync_batch_norm=False)``: each GPU's own batch-norm
  statistics, as DDP's batch norm) and ``eager`` (every step encoded and committed);
* PyTorch: the model's twin (``model.torch_module()``), channels-last, autocast bfloat16,
  ``DistributedDataParallel`` on N GPUs (its batch norm is per GPU), the plain module on one.

Throughput = N · batch-per-gpu · steps / (slowest rank's wall time over ``--steps`` steps after
``--warmup``); scaling efficiency = N-GPU throughput / (N × 1-GPU throughput). The table is
printed last; ``--json`` writes every row.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

#: set in the parent before spawning and in every worker before NCCL initializes
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}  # NVLink multicast stays off on the device machines

MODELS = {
    "resnet18": ("mpsnn.models.resnet", "ResNet18"),
    "lenet": ("mpsnn.models.lenet", "LeNet5"),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model(args: argparse.Namespace, device: Any, optimizer: Any) -> Any:
    import importlib

    module, name = MODELS[args.model]
    return getattr(importlib.import_module(module), name)(device, optimizer, seed=0)


def _timed(step: Any, sync: Any, world: int, args: argparse.Namespace) -> float:
    """Images per second of the whole job: the slowest rank's time counts."""
    for _ in range(args.warmup):
        step()
    sync()
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync()
    seconds = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    if world > 1:
        dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else None
        t = seconds.to(dev) if dev is not None else seconds
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        seconds = t.cpu()
    return world * args.batch_per_gpu * args.steps / float(seconds)


def _mpsnn(rank: int, world: int, args: argparse.Namespace, x: torch.Tensor,
           y: torch.Tensor, mode: str) -> dict[str, Any]:  # fmt: skip
    import mpsnn as m
    from mpsnn.cli.bench import _batch

    dev = m.Device(f"cuda:{rank}" if args.device == "cuda" else "cpu")
    sgd = m.SGD(dev, momentum_scale=0.9, descriptor=m.OptimizerDescriptor(learning_rate=0.05))
    model = _model(args, dev, sgd)
    storage = (
        m.FeatureChannelFormat.BFLOAT16
        if args.device == "cuda"
        else (m.FeatureChannelFormat.FLOAT32)
    )
    graph = model.training_graph(args.batch_per_gpu * world, storage=storage)
    local = mode.endswith("-local")
    if world > 1:
        # direct_nccl: the critical-path collectives on mpsnn's own NCCL communicator, which
        # `mpsnn train --nproc` gets from its rank monitor; these processes run none, so it
        # is asked for (or, with --direct-nccl off, refused) explicitly
        graph.data_parallel = m.DataParallel(bucket_mib=args.bucket_mib,
                                             sync_batch_norm=not local,
                                             direct_nccl=args.direct_nccl == "on")  # fmt: skip
    queue = dev.new_command_queue()
    images = [_batch(x, storage)]  # in the graph's format, as `mpsnn train` feeds it
    labels = [m.LossLabels(dev, y.view(-1, 1, 1), max_index=9)]
    last: list[Any] = [None]
    compiled = graph.compile(queue) if mode.startswith("replay") else None

    def step() -> None:
        if compiled is not None:
            compiled(images, labels)
            return
        cb = queue.command_buffer()
        graph.encode_batch(cb, images, labels)
        cb.commit()
        last[0] = cb

    def sync() -> None:
        if compiled is not None:
            compiled.wait_until_completed()
        elif last[0] is not None:
            last[0].wait_until_completed()

    rate = _timed(step, sync, world, args)
    states = compiled.source_states[0] if compiled is not None else labels
    loss = float(states[0].loss_image().tensor.sum()) * world
    if compiled is not None and args.device == "cuda" and not compiled.is_captured:
        raise RuntimeError(f"the compiled step ran eagerly: {compiled.eager_reason}")
    variant = "eager graph" if compiled is None else (
        "replayed graph" if compiled.is_captured else "compiled graph (runs eagerly)")  # fmt: skip
    variant += ", local BN" if local else ""
    return {"framework": "mpsnn", "variant": variant + (" + DataParallel" if world > 1 else ""),
            "gpus": world, "images_per_s": rate, "loss": loss}  # fmt: skip


def _torch(rank: int, world: int, args: argparse.Namespace, x: torch.Tensor,
           y: torch.Tensor) -> dict[str, Any]:  # fmt: skip
    import mpsnn as m

    cuda = args.device == "cuda"
    dev = m.Device(f"cuda:{rank}" if cuda else "cpu")
    net = _model(args, dev, None).torch_module().to(dev.torch_device)
    if cuda:
        net = net.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(net, device_ids=[rank] if cuda else None)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    kind = "cuda" if cuda else "cpu"
    losses: list[torch.Tensor] = []

    def step() -> None:
        with torch.autocast(kind, dtype=torch.bfloat16, enabled=cuda):
            loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses[:] = [loss.detach()]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    rate = _timed(step, sync, world, args)
    return {"framework": "pytorch", "variant": ("DDP, " if world > 1 else "") +
            ("autocast bf16, channels-last" if cuda else "float32"), "gpus": world,
            "images_per_s": rate, "loss": float(losses[0])}  # fmt: skip


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(NCCL_ENV)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        torch.backends.cudnn.benchmark = True
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                              timeout=datetime.timedelta(seconds=120))  # fmt: skip
        kwargs: dict[str, Any] = {"device_id": torch.device("cuda", rank)} if cuda else {}
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120),
                                **kwargs)  # fmt: skip
    shape = (3, 32, 32) if args.model == "resnet18" else (1, 28, 28)
    g = torch.Generator().manual_seed(1000 + rank)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    x = torch.randn(args.batch_per_gpu, *shape, generator=g).to(dev)
    y = torch.randint(0, 10, (args.batch_per_gpu,), generator=g).to(dev)
    rows = []
    runs = []
    for name in args.frameworks.split(","):
        if name == "mpsnn":
            runs += [(_mpsnn, (mode,)) for mode in args.mpsnn_modes.split(",") if mode]
        else:
            runs.append((_torch, ()))
    for fn, extra in runs:
        rows.append(fn(rank, world, args, x, y, *extra))
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _run(world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows.json")
        mp.spawn(_worker, args=(world, _free_port(), args, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def _table(rows: list[dict[str, Any]]) -> str:
    def kind(r: dict[str, Any]) -> tuple[str, str]:  # the same variant on 1 and N GPUs
        return r["framework"], r["variant"].replace(" + DataParallel", "").replace("DDP, ", "")

    single = {kind(r): r["images_per_s"] for r in rows if r["gpus"] == 1}
    lines = [f"{'framework':<10} {'variant':<50} {'GPUs':>4} {'images/s':>10} "
             f"{'per GPU':>9} {'scaling':>8}"]  # fmt: skip
    for r in rows:
        base = single.get(kind(r))
        eff = r["images_per_s"] / (r["gpus"] * base) if base and r["gpus"] > 1 else None
        r["scaling_efficiency"] = eff
        lines.append(
            f"{r['framework']:<10} {r['variant']:<50} {r['gpus']:>4} {r['images_per_s']:>10,.0f} "
            f"{r['images_per_s'] / r['gpus']:>9,.0f} " + (f"{eff:>8.1%}" if eff else f"{'':>8}")
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2, help="the largest world size")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--model", choices=tuple(MODELS), default="resnet18")
    parser.add_argument("--batch-per-gpu", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--bucket-mib", type=float, default=25.0)
    parser.add_argument("--frameworks", default="mpsnn,pytorch")
    parser.add_argument("--mpsnn-modes", default="replay,replay-local,eager",
                        help="mpsnn steps: replay (CUDA graph), replay-local (each GPU's own "
                        "batch-norm statistics) and/or eager")  # fmt: skip
    parser.add_argument("--direct-nccl", choices=("on", "off"), default="on",
                        help="the collectives a kernel waits for on mpsnn's direct NCCL "
                        "communicator (on) or on the process group (off)")  # fmt: skip
    parser.add_argument("--json", default=None, help="write the rows to this file")
    args = parser.parse_args()
    os.environ.update(NCCL_ENV)  # before anything initializes NCCL (inherited by the workers)
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" and found < args.gpus:
        parser.error(f"--gpus {args.gpus} needs that many GPUs, got {found}")
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for world in sorted({1, args.gpus}):
        rows += _run(world, args)
        print(f"[{time.perf_counter() - start:.0f} s] {world} "
              f"{'GPU' if args.device == 'cuda' else 'process'}(s) done", flush=True)  # fmt: skip
    table = _table(rows)
    from mpsnn.core.precision import describe as describe_precision  # the workers' default too

    info = {"model": args.model, "device": args.device, "batch_per_gpu": args.batch_per_gpu,
            "warmup": args.warmup, "steps": args.steps, "bucket_mib": args.bucket_mib,
            "direct_nccl": args.direct_nccl,
            "torch": torch.__version__, "seconds": time.perf_counter() - start,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            "precision": describe_precision()}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({**info, "rows": rows}, indent=2))
    print(f"\n{args.model}, {args.batch_per_gpu} images per "
          f"{'GPU' if args.device == 'cuda' else 'process'}, {args.steps} timed steps "
          f"after {args.warmup}:")  # fmt: skip
    print(table)
    print("float32 precision: " + ", ".join(f"{k}={v}" for k, v in info["precision"].items()))


if __name__ == "__main__":
    main()
