"""Where an eager data-parallel step's time goes on the host: on each of N GPUs (one process
each, NCCL), ResNet-18's eager graph step with `DataParallel` (synchronized and local batch
normalization), and on rank 0 the same step on one GPU without it. For each: the synchronizing
calls of one step, the host time per step synchronized and back to back, and the wall time per
step (`benchmarks.tools.profile_step`'s report). ``--device cpu`` runs N processes with Gloo
(float32; a smoke run).

    python -m benchmarks.tools.dp_host_time --gpus 2
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.tools.profile_step import _back_to_back


def _step(graph: Any, dev: Any, batch: int, rank: int, warmup: int) -> Any:
    import mpsnn as m

    q = dev.new_command_queue()
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, 3, 32, 32, generator=g).to(dev.torch_device)
    y = torch.randint(0, 10, (batch,), generator=g).to(dev.torch_device)
    images = [m.ImageBatch.from_tensor(x)]
    labels = [m.LossLabels(dev, y.view(-1, 1, 1), max_index=9)]

    def step() -> None:
        cb = q.command_buffer()
        graph.encode_batch(cb, images, labels)
        cb.commit()

    for _ in range(warmup):
        step()
    if dev.torch_device.type == "cuda":
        torch.cuda.synchronize()
    return step


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    cuda = args.device == "cuda"
    if cuda:
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on the device machines
        torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=120))  # fmt: skip
    extra: dict[str, Any] = {"device_id": torch.device("cuda", rank)} if cuda else {}
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank,
                            world_size=world, **extra)  # fmt: skip
    import mpsnn as m
    from mpsnn.models.resnet import ResNet18

    dev = m.Device(f"cuda:{rank}" if cuda else "cpu")
    fmt = m.FeatureChannelFormat.BFLOAT16 if cuda else m.FeatureChannelFormat.FLOAT32
    sgd = m.SGD(dev, momentum_scale=0.9, descriptor=m.OptimizerDescriptor(learning_rate=0.05))
    net = ResNet18(dev, sgd, seed=0)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    batch, n, synced = args.batch_per_gpu, args.steps, max(1, args.steps * 3 // 4)
    if not cuda:
        torch.set_num_threads(1)  # the processes share the host's cores
    where, one = ("GPUs", "GPU") if cuda else ("processes", "process")
    for sync_bn in (True, False):
        graph = net.training_graph(batch * world, storage=fmt)
        graph.data_parallel = m.DataParallel(sync_batch_norm=sync_bn)
        step = _step(graph, dev, batch, rank, args.warmup)
        dist.barrier()
        bn = "synchronized" if sync_bn else "local"
        _back_to_back({f"rank {rank}, {world} {where}, {bn} BN": step}, sync, n, synced, cuda)
        dist.barrier()
    if rank == 0:
        step = _step(net.training_graph(batch, storage=fmt), dev, batch, 0, args.warmup)
        _back_to_back({f"rank 0, one {one}": step}, sync, n, synced, cuda)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--batch-per-gpu", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="timed back to back, per variant")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} GPUs, found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.gpus, port, args), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
