"""What the ranks of the distributed tests run: ``python -m tests.distributed._workers CASE
OUT`` with torchrun's environment (set by `tests.distributed._helpers.spawn`)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import mpsnn as m
from tests.distributed import _nets


def equivalence(out: Path, run: m.DistributedRun) -> None:
    """Each case's values after the steps, then a planted divergence caught by the check."""
    for name, bn, opt, dropout, mib in _nets.CASES:
        graph, sources = _nets.build(bn, opt, dropout)
        graph.data_parallel = m.DataParallel(bucket_mib=mib)
        _nets.train(graph, run.rank, run.world_size)
        torch.save(_nets.values(sources), out / f"{name}-rank{run.rank}.pt")
    graph, sources = _nets.build(True, "sgd")
    graph.data_parallel = m.DataParallel(check_every=1)
    _nets.train(graph, run.rank, run.world_size, steps=1)  # checked: equal
    if run.rank == 1:  # one rank's weights drift
        sources[0].weights().add_(1e-9)  # a view of the data source's values
        graph.reload_from_data_sources()
    try:
        _nets.train(graph, run.rank, run.world_size, steps=1)
        message = "no error"
    except m.DistributedError as exc:
        message = str(exc)
    (out / f"diverge-rank{run.rank}.txt").write_text(message)


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


def main() -> None:
    case, out = sys.argv[1], Path(sys.argv[2])
    timeout = float(os.environ.get("TEST_TIMEOUT", "30"))
    run = m.init_distributed("cpu", timeout=timeout)
    assert run is not None
    {"equivalence": equivalence, "die": die, "hang": hang}[case](out, run)
    run.close()


if __name__ == "__main__":
    main()
