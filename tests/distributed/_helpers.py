"""Starting the ranks of a distributed test: the test process hosts the rendezvous store and
runs ``python -m tests.distributed._workers`` (or any command) with torchrun's environment,
under a hard timeout (a test never hangs)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Rank:
    code: int | None  # None: killed at the test's deadline
    out: str
    err: str


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    e.update(extra)
    return e


def spawn(case: str, out: Path, *, nproc: int = 2, deadline: float = 60.0,
          timeout: float = 30.0) -> tuple[list[Rank], float]:  # fmt: skip
    """Run worker ``case`` as ``nproc`` ranks; returns each rank's result and the seconds."""
    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=deadline))  # fmt: skip
    base = env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc), MPSNN_LAUNCHER="1", TEST_TIMEOUT=str(timeout))  # fmt: skip
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.distributed._workers", case, str(out)],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(nproc)
    ]
    results = []
    for p in procs:
        left = max(0.1, deadline - (time.monotonic() - start))
        try:
            o, e = p.communicate(timeout=left)
            results.append(Rank(p.returncode, o, e))
        except subprocess.TimeoutExpired:
            p.kill()
            o, e = p.communicate()
            results.append(Rank(None, o, e))
    for p in procs:
        if p.poll() is None:
            p.kill()
    del store
    return results, time.monotonic() - start
