"""What the ranks of the distributed tests run: ``python -m tests.distributed._workers CASE
OUT`` with torchrun's environment (set by `tests.distributed._helpers.spawn`)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import mpsnn as m
from mpsnn.core.layout import channels_last_only
from tests.distributed import _nets


def float32_ohwi(out: Path, run: m.DistributedRun) -> None:
    """The float32 graph (data sources in OHWI memory: the fully connected layer's masters and
    weight gradient in that order) after the steps, and which kernels' masters lie in OHWI
    memory."""
    graph, sources = _nets.build(False, "adam", dtype=torch.float32)
    graph.data_parallel = m.DataParallel(bucket_mib=0.0)
    _nets.train(graph, run.rank, run.world_size)
    torch.save(_nets.values(sources), out / f"float32-rank{run.rank}.pt")
    kernels = [
        k for ks in graph._plan.kernels.values() for k in (ks if isinstance(ks, tuple) else (ks,))
    ]
    ohwi = {type(k).__name__ for k in kernels if hasattr(k, "_weights")
            and channels_last_only(k._weights.weight)}  # fmt: skip
    (out / f"float32-ohwi-masters-rank{run.rank}.txt").write_text(" ".join(sorted(ohwi)))


def equivalence(out: Path, run: m.DistributedRun) -> None:
    """Each case's values after the steps, then a planted divergence caught by the check."""
    for name, bn, opt, dropout, mib in _nets.CASES:
        graph, sources = _nets.build(bn, opt, dropout)
        graph.data_parallel = m.DataParallel(bucket_mib=mib)
        _nets.train(graph, run.rank, run.world_size)
        torch.save(_nets.values(sources), out / f"{name}-rank{run.rank}.pt")
        uses = sum(p.uses for p in graph._programs)  # steps run from the lowered program
        # the same steps encoded in full every time (no step program)
        graph, sources = _nets.build(bn, opt, dropout)
        graph.data_parallel = m.DataParallel(bucket_mib=mib)
        graph.reuse_step = False
        _nets.train(graph, run.rank, run.world_size)
        torch.save(_nets.values(sources), out / f"{name}-full-rank{run.rank}.pt")
        (out / f"{name}-uses-rank{run.rank}.txt").write_text(f"{uses} {graph._programs}")
    for suffix, reuse in (("", True), ("-full", False)):  # step programs; full encodes
        graph, sources = _nets.build(True, "sgd")
        graph.data_parallel = m.DataParallel(check_every=1)
        graph.reuse_step = reuse
        _nets.train(graph, run.rank, run.world_size, steps=1)  # checked: equal
        if run.rank == 1:  # one rank's weights drift
            sources[0].weights().add_(1e-9)  # a view of the data source's values
            graph.reload_from_data_sources()
        try:
            _nets.train(graph, run.rank, run.world_size, steps=1)
            message = "no error"
        except m.DistributedError as exc:
            message = str(exc)
        (out / f"diverge{suffix}-rank{run.rank}.txt").write_text(message)
    # local batch normalization (each rank's own statistics), one step
    graph, sources = _nets.build(True, "sgd")
    graph.data_parallel = m.DataParallel(sync_batch_norm=False, bucket_mib=0)
    _nets.train(graph, run.rank, run.world_size, steps=1)
    torch.save(_nets.values(sources), out / f"localbn-rank{run.rank}.pt")
    # the host work of a replayed step (`DataParallel.replayed`): counted, and checked when due
    graph, sources = _nets.build(False, "sgd")
    dp = graph.data_parallel = m.DataParallel(check_every=2)
    _nets.train(graph, run.rank, run.world_size, steps=1)  # step 1: not due
    dp.replayed()  # step 2: due, equal
    if run.rank == 1:
        sources[0].weights().add_(1e-9)
        graph.reload_from_data_sources()
    try:
        dp.replayed(new_step=False)  # the same step again (a capture's first replay): checked
        message = "no error"
    except m.DistributedError as exc:
        message = str(exc)
    (out / f"replayed-rank{run.rank}.txt").write_text(
        f"capturable={dp.capturable} backend={dp.backend} steps={dp.steps}\n{message}"
    )


def die(out: Path, run: m.DistributedRun) -> None:
    """Rank 1 dies (os._exit) at its third step; rank 0 must end with a message naming it."""
    graph, _ = _nets.build(True, "sgd")
    graph.data_parallel = m.DataParallel()
    start = time.monotonic()
    try:
        for step in range(1000):
            if run.rank == 1 and step == 2:
                os._exit(17)
            if run.rank == 0 and step == 2:
                start = time.monotonic()
            _nets.train(graph, run.rank, run.world_size, steps=1)
        message = "no error"
    except m.DistributedError as exc:
        message = str(exc)
    (out / f"die-rank{run.rank}.txt").write_text(f"{time.monotonic() - start:.2f}\n{message}")
    os._exit(0)


def hang(out: Path, run: m.DistributedRun) -> None:
    """Rank 1 hangs (sleeps, its heartbeat thread alive) at its second step; the monitors end
    both ranks after the timeout."""
    graph, _ = _nets.build(False, "sgd")
    graph.data_parallel = m.DataParallel()
    for step in range(1000):
        if run.rank == 1 and step == 1:
            time.sleep(3600)
        _nets.train(graph, run.rank, run.world_size, steps=1)


def nccl_replay(out: Path, run: m.DistributedRun) -> None:
    """CUDA, NCCL: a ResNet-18 graph with `DataParallel` stepped eagerly and the same graph
    compiled (warm-up, capture, replays) from the same weights on the same shards: the weights
    after every step equal bit for bit; then a planted divergence caught by a replay's check."""
    from mpsnn.cli.common import build_model

    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    dev, n, world = run.device, 16, run.world_size
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(6, n * world, 3, 32, 32, generator=g)
    ys = torch.randint(0, 10, (6, n * world), generator=g)
    shard = slice(run.rank * n, (run.rank + 1) * n)

    def model() -> tuple[Any, Any]:
        sgd = m.SGD(dev, momentum_scale=0.9, descriptor=m.OptimizerDescriptor(learning_rate=0.05))
        net = build_model("resnet18", dev, sgd, seed=0)
        return net, net.training_graph(n * world, storage=m.FeatureChannelFormat.FLOAT32)

    def batch(i: int) -> tuple[list[Any], list[Any]]:
        x, y = xs[i, shard].to(dev.torch_device), ys[i, shard].to(dev.torch_device)
        return [m.ImageBatch.from_tensor(x)], [m.LossLabels(dev, y.view(-1, 1, 1), max_index=9)]

    def weights(graph: Any) -> list[torch.Tensor]:
        return [t.detach().clone() for _, t in _weights_of(graph)]

    _, eager = model()
    # the eager graph's collectives through torch.distributed, the compiled graph's (eager
    # warm-up, then recorded) through the direct NCCL communicator: the same bits
    eager.data_parallel = m.DataParallel(direct_nccl=False)
    queue = dev.new_command_queue()
    _, graph = model()
    dp = graph.data_parallel = m.DataParallel(check_every=2)
    compiled = graph.compile()
    lines = [f"eager_reason={compiled.eager_reason}"]
    for i in range(4):
        cb = queue.command_buffer()
        eager.encode_batch(cb, *batch(i))
        cb.commit()
        cb.wait_until_completed()
        compiled(*batch(i))
        compiled.wait_until_completed()
        same = all(torch.equal(a, b) for a, b in
                   zip(weights(eager), weights(graph), strict=True))  # fmt: skip
        lines.append(f"step {i + 1} captured={compiled.is_captured} same={same}")
    if run.rank == 1:  # one rank's weights drift: the check of step 6 (a replay) names it
        node = next(n for n in graph._plan.order if getattr(n, "_forward", None) is not None)
        node._forward.data_source.weights().add_(1e-6)  # a view of the data source's values
        graph.reload_from_data_sources()  # in place: the recorded step reads them
        torch.cuda.synchronize()  # ordered before the next replay (on the queue's stream)
    try:
        for i in (4, 5):
            compiled(*batch(i))
        compiled.wait_until_completed()
        message = "no error"
    except m.DistributedError as exc:
        message = str(exc)
    lines += [
        f"replays={compiled.replays} steps={dp.steps}",
        message,
        f"direct={type(dp._direct).__name__} other={eager.data_parallel._direct}",
    ]
    (out / f"nccl-rank{run.rank}.txt").write_text("\n".join(lines))


def _weights_of(graph: Any) -> list[tuple[str, torch.Tensor]]:
    """The master tensors of a graph's trainable layers (what the weight check compares)."""
    from types import SimpleNamespace

    from mpsnn.distributed.collectives import _weights

    updates = [(node, graph._plan.kernels[node._forward._id], None) for node in graph._plan.order
               if getattr(node, "_forward", None) is not None and node.trainable]  # fmt: skip
    return _weights(SimpleNamespace(updates=updates))  # what `_weights` reads of a step


def main() -> None:
    case, out = sys.argv[1], Path(sys.argv[2])
    timeout = float(os.environ.get("TEST_TIMEOUT", "30"))
    run = m.init_distributed("cuda" if case.startswith("nccl") else "cpu", timeout=timeout)
    assert run is not None
    cases = {"equivalence": equivalence, "die": die, "hang": hang, "nccl_replay": nccl_replay,
             "float32_ohwi": float32_ohwi}  # fmt: skip
    cases[case](out, run)
    run.close()


if __name__ == "__main__":
    main()
