"""Where an eager data-parallel step's time goes on the host: on each of N GPUs (one process
each, NCCL), ResNet-18's eager graph step with `DataParallel` (synchronized and local batch
normalization), and on rank 0 the same step on one GPU without it. For each: the synchronizing
calls of one step, the host time per step synchronized and back to back, and the wall time per
step (`benchmarks.tools.profile_step`'s report).

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


def _step(graph: Any, dev: Any, batch: int, rank: int) -> Any:
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

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    return step


def _worker(rank: int, world: int, port: int, batch: int) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on the device machines
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=120))  # fmt: skip
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))  # fmt: skip
    import mpsnn as m
    from mpsnn.models.resnet import ResNet18

    dev = m.Device(f"cuda:{rank}")
    sgd = m.SGD(dev, momentum_scale=0.9, descriptor=m.OptimizerDescriptor(learning_rate=0.05))
    net = ResNet18(dev, sgd, seed=0)
    sync = torch.cuda.synchronize
    for sync_bn in (True, False):
        graph = net.training_graph(batch * world, storage=m.FeatureChannelFormat.BFLOAT16)
        graph.data_parallel = m.DataParallel(sync_batch_norm=sync_bn)
        step = _step(graph, dev, batch, rank)
        dist.barrier()
        bn = "synchronized" if sync_bn else "local"
        _back_to_back({f"rank {rank}, {world} GPUs, {bn} BN": step}, sync, n=20)
        dist.barrier()
    if rank == 0:
        graph = net.training_graph(batch, storage=m.FeatureChannelFormat.BFLOAT16)
        _back_to_back({"rank 0, one GPU": _step(graph, dev, batch, 0)}, sync, n=20)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--batch-per-gpu", type=int, default=256)
    args = p.parse_args()
    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"needs {args.gpus} GPUs, found {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(args.gpus, port, args.batch_per_gpu), nprocs=args.gpus, join=True)


if __name__ == "__main__":
    main()
