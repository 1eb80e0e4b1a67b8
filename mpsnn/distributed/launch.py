"""`launch_local`: run one command as the ranks of a data-parallel run on this machine
(``mpsnn train --nproc N``).

The parent process hosts the rendezvous store (a ``TCPStore`` on a free port of 127.0.0.1,
so it outlives any rank), starts ``N`` copies of the command with torchrun's environment
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, and ``MPSNN_LAUNCHER=1``; ``TORCH_CPP_LOG_LEVEL=ERROR`` unless set: the
store client's warnings carry dozens of lines of C++ frames when the store goes away, and each
rank says what happened in one line), and watches them:

* all exit 0: exit status 0;
* one exits with another status while others run: one line naming the rank to blame (and the
  signal that killed it). A rank that ended because its monitor judged another one (stopped,
  hung, failed) recorded whom it blamed: that rank is named (``rank 1 stopped: no heartbeat
  for 5.1 s (...) (found by rank 0)``) and killed at once (it is stopped or hung). A rank that
  died is reported in the monitors' store so that the others' errors name it too. The others
  get ``grace`` seconds to end on their own, then SIGTERM (and SIGCONT, for a stopped one),
  then SIGKILL; exit status 1 (2 when every failed rank exited with 2, a user error);
* Ctrl-C (SIGINT) or SIGTERM to the parent: the ranks are terminated; status 130.

The ranks share the parent's stdout and stderr: ``mpsnn train`` prints from rank 0 only, and
a failing rank prints its one-line error.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from mpsnn.distributed.monitor import read_blame, report_failure, say
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
    base.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(nproc),
                LOCAL_WORLD_SIZE=str(nproc), MPSNN_LAUNCHER="1")  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(nproc):
            rank_env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            procs.append(subprocess.Popen(list(command), env=rank_env))
        return _watch(procs, grace, label, monitor_store(store))
    except KeyboardInterrupt:
        say(f"{label}: interrupted; stopping the {nproc} ranks")
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
                return _end_run(procs, bad, grace, label, store)
            time.sleep(0.05)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def _end_run(
    procs: list[subprocess.Popen[bytes]],
    bad: list[tuple[int, int]],
    grace: float,
    label: str,
    store: Any,
) -> int:
    """Ranks ``bad`` (rank, status) failed: name the one to blame, kill it if it still runs,
    stop the others; returns the run's status."""
    killed = [(r, c) for r, c in bad if c < 0]  # died by a signal: the cause, not a symptom
    found = None if killed else _blamed(bad, store)
    if found is not None:
        culprits, line = found
        say(f"{label}: {line}; stopping the other ranks")
        for r in culprits:  # stopped or hung for the whole timeout: nothing to wait for
            if 0 <= r < len(procs) and procs[r].poll() is None:
                procs[r].kill()
                procs[r].wait()
    else:
        rank, code = (killed or bad)[0]
        if code != 2:
            say(f"{label}: rank {rank} {_describe(code)}; stopping the other ranks")
            report_failure(store, rank, _describe(code))  # their monitors name it
    _stop(procs, grace)
    codes = [p.poll() for p in procs]
    failed = [c for c in codes if c not in (None, 0)]
    return 2 if failed and all(c == 2 for c in failed) else 1


def _blamed(bad: list[tuple[int, int]], store: Any) -> tuple[list[int], str] | None:
    """The other ranks that failed ranks blamed when they ended (their monitors' verdicts in
    the store), and the line that names them; None when none did."""
    for attempt in range(2):
        for rank, code in bad:
            if code != 1:
                continue
            try:
                blame = read_blame(store, rank)
            except Exception:
                return None
            if blame is not None:
                culprits = [r for r in blame[0] if r != rank]
                if culprits:
                    return culprits, f"{blame[1]} (found by rank {rank})"
        if attempt == 0 and any(code == 1 for _, code in bad):
            time.sleep(0.2)  # the record may still be on its way to the store
    return None


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
            p.send_signal(signal.SIGCONT)  # a stopped process acts on its SIGTERM
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
