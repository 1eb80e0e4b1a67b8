"""`launch_local`: run one command as the ranks of a data-parallel run on this machine
(``mpsnn train --nproc N``).

The parent process hosts the rendezvous store (a ``TCPStore`` on a free port of 127.0.0.1,
so it outlives any rank), starts ``N`` copies of the command with torchrun's environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, and ``MPSNN_LAUNCHER=1``), and watches them:

* all exit 0: exit status 0;
* one exits with another status while others run: one line naming it (and the signal that
  killed it), reported in the monitors' store so that the others' errors name it too; they
  get ``grace`` seconds to end on their own, then SIGTERM, then SIGKILL; exit status 1 (2
  when every failed rank exited with 2, a user error);
* Ctrl-C (SIGINT) or SIGTERM to the parent: the ranks are terminated; status 130.

The ranks share the parent's stdout and stderr: ``mpsnn train`` prints from rank 0 only, and
a failing rank prints its one-line error.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from mpsnn.distributed.monitor import report_failure
from mpsnn.distributed.runtime import monitor_store

__all__ = ["launch_local"]


def launch_local(
    nproc: int,
    command: Sequence[str],
    *,
    timeout: float = 300.0,
    env: Mapping[str, str] | None = None,
    grace: float = 2.0,
    label: str = "mpsnn",
) -> int:
    """Run ``command`` as ranks ``0 .. nproc - 1`` (see the module docstring); returns the
    exit status for the whole run.

    Args:
        nproc: the number of ranks (>= 1).
        command: the program and its arguments, the same for every rank.
        timeout: the store's timeout in seconds (a rank that cannot reach it gives up then).
        env: extra environment variables for every rank.
        grace: seconds the surviving ranks get to end by themselves after one failed.
        label: how the parent's lines begin.
    """
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"[launch_local] nproc must be an int >= 1, got {nproc!r}")
    store = dist.TCPStore(
        "127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout),
    )  # fmt: skip
    base = {**os.environ, **(env or {})}
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), MPSNN_LAUNCHER="1")  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(nproc):
            rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs.append(subprocess.Popen(list(command), env=rank_env))
        return _watch(procs, grace, label, monitor_store(store))
    except KeyboardInterrupt:
        print(f"{label}: interrupted; stopping the {nproc} ranks", file=sys.stderr, flush=True)
        _stop(procs, grace)
        return 130
    finally:
        _stop(procs, 0.5)
        del store


def _watch(procs: list[subprocess.Popen[bytes]], grace: float, label: str, store: Any) -> int:
    previous = signal.getsignal(signal.SIGTERM)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    in_main = _is_main_thread()
    if in_main:
        signal.signal(signal.SIGTERM, on_term)
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                failed = [c for c in codes if c != 0]
                if not failed:
                    return 0
                return 2 if all(c == 2 for c in failed) else 1
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                rank, code = bad[0]
                if code != 2:
                    print(f"{label}: rank {rank} {_describe(code)}; stopping the other ranks",
                          file=sys.stderr, flush=True)  # fmt: skip
                    report_failure(store, rank, _describe(code))  # their monitors name it
                _stop(procs, grace)
                codes = [p.poll() for p in procs]
                failed = [c for c in codes if c not in (None, 0)]
                return 2 if failed and all(c == 2 for c in failed) else 1
            time.sleep(0.05)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _describe(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with status {code}"


def _stop(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    """Let running ranks end within ``grace`` s, then SIGTERM, then SIGKILL."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
