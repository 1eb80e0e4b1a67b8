"""`RankMonitor`: every rank's heartbeat and progress in the rendezvous store, and the judge of
which rank failed when a distributed run cannot go on.

Each rank runs one daemon thread. Every ``interval`` seconds it

1. adds 1 to its heartbeat counter ``hb/<rank>`` and publishes its progress
   ``progress/<rank>`` (how many `progress` marks its main thread made: one per training step
   and per evaluation batch in ``mpsnn train``);
2. reads every rank's counters. A heartbeat that did not change for ``s`` seconds, measured on
   this rank's monotonic clock (no clocks are compared across machines), is **stale** for
   ``s`` seconds: the rank is dead, or hung with the interpreter lock held;
3. reads the failure reports: a rank whose code raised writes ``failed/<rank>`` (its one-line
   message) before it exits (`report_failure`).

It ends this process (one line on stderr, then ``os._exit(1)``: the main thread may be blocked
inside a collective that nothing else interrupts) when, for ``timeout`` seconds, a rank's
heartbeat is stale, this rank made no progress (it waits for a rank that hung), or the store is
unreachable; and ``2 interval`` seconds after another rank reported a failure (time for this
rank's own error to surface first). So no rank outlives a dead or hung one by more than about
``timeout + interval`` seconds.

When a collective raises (Gloo: a peer closed its connections, or the process group's timeout
passed), `diagnose` names the culprits: reported failures first, then ranks whose heartbeat
has been silent for ``4 interval`` seconds (it waits up to ``8 interval + 1`` seconds for a
dead rank's heartbeat to go silent that long), then the ranks that lag in progress.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["RankMonitor", "report_failure"]


class RankMonitor:
    """Heartbeats and failure reports of one rank (see the module docstring).

    Args:
        store: a ``torch.distributed`` store every rank reaches (e.g. a ``PrefixStore`` over
            the rendezvous ``TCPStore``); the monitor's thread is its only user.
        rank, world_size: this rank and the number of ranks.
        timeout: seconds of silence (stale heartbeat, no progress, unreachable store) after
            which the run is ended.
        interval: seconds between heartbeats (default ``clamp(timeout / 20, 0.1, 2)``).
        abort: called with the one-line message instead of printing it and ending the process
            (for tests and embedding).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout: float = 300.0,
        interval: float | None = None,
        *,
        abort: Callable[[str], None] | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"[RankMonitor] rank must be in [0, {world_size}), got {rank}")
        if not timeout > 0:
            raise ValueError(f"[RankMonitor] timeout must be > 0 seconds, got {timeout}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.interval = float(interval) if interval else min(2.0, max(0.1, self.timeout / 20))
        self._abort_fn = abort
        self._progress = 0  # written by the main thread only
        self._published = 0
        now = time.monotonic()
        # rank -> (heartbeat value, when it last changed); progress -> (value, when changed)
        self._beats: dict[int, tuple[int, float]] = {r: (-1, now) for r in range(world_size)}
        self._marks: dict[int, int] = dict.fromkeys(range(world_size), 0)
        self._own_progress = (0, now)
        self._failures: dict[int, tuple[str, float]] = {}
        self._failure_count = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- main thread -------------------------------------------------------------------------

    def start(self) -> RankMonitor:
        """Publish the first heartbeat and start the thread (returns self)."""
        if self._thread is None:
            self._beat()
            self._thread = threading.Thread(
                target=self._loop, name=f"mpsnn-monitor-rank{self.rank}", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread (a normal end: nothing is judged afterwards)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(1.0, 2 * self.interval))

    def progress(self) -> None:
        """This rank made progress (a step or a batch): cheap, no store access."""
        self._progress += 1

    def report_failure(self, message: str) -> None:
        """Tell the other ranks this rank failed (they end with ``message`` named after it)."""
        report_failure(self.store, self.rank, message)

    def stale_ranks(self, seconds: float) -> list[tuple[int, float]]:
        """``(rank, seconds since its heartbeat changed)`` of the other ranks silent for more
        than ``seconds``."""
        now = time.monotonic()
        return [
            (r, now - t)
            for r, (_, t) in sorted(self._beats.items())
            if r != self.rank and now - t > seconds
        ]

    def diagnose(self, wait: float | None = None) -> str:
        """Why a collective failed, naming ranks where the heartbeats tell (waits up to
        ``wait`` seconds, default ``8 interval + 1``, for a dead rank's heartbeat to be
        silent for ``4 interval``)."""
        window = 4 * self.interval
        deadline = time.monotonic() + (2 * window + 1.0 if wait is None else wait)
        while True:
            verdict = self._reported() or self._silent(window)
            if verdict is not None:
                return verdict
            if time.monotonic() >= deadline or self._thread is None:
                break
            time.sleep(self.interval / 2)
        lag = self._laggards()
        if lag:
            return lag
        return "every rank's heartbeat is fresh (a network or backend failure?)"

    # -- the thread --------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception as exc:
                self._store_lost(exc)
                return
            verdict = self._verdict()
            if verdict is not None:
                self._abort(verdict)

    def _store_lost(self, exc: Exception) -> None:
        """The store failed (a broken connection does not come back): the rank goes on
        unwatched for ``timeout`` seconds — enough for a run that is ending anyway — then
        ends, since its launcher (or the rank hosting the store) is gone."""
        since = time.monotonic()
        if self._stop.wait(self.timeout):
            return
        text = str(exc).strip()
        first = text.splitlines()[0] if text else ""
        self._abort(
            f"the rendezvous store has been unreachable for {time.monotonic() - since:.1f} s "
            f"(the launcher or the rank hosting it ended?): {type(exc).__name__} {first}"[:400]
        )

    def _beat(self) -> None:
        store, now = self.store, time.monotonic()
        store.add(f"hb/{self.rank}", 1)
        done = self._progress
        if done != self._published:
            store.add(f"progress/{self.rank}", done - self._published)
            self._published = done
        for r in range(self.world_size):
            value = int(store.add(f"hb/{r}", 0))
            if value != self._beats[r][0]:
                self._beats[r] = (value, now)
            self._marks[r] = int(store.add(f"progress/{r}", 0))
        if done != self._own_progress[0]:
            self._own_progress = (done, now)
        count = int(store.add("failures", 0))
        if count != self._failure_count:
            self._failure_count = count
            for r in range(self.world_size):
                if r != self.rank and r not in self._failures and store.check([f"failed/{r}"]):
                    message = store.get(f"failed/{r}").decode(errors="replace")
                    self._failures[r] = (message, now)

    def _verdict(self) -> str | None:
        if self._stop.is_set():
            return None
        now = time.monotonic()
        for r, (message, seen) in sorted(self._failures.items()):
            if now - seen > 2 * self.interval:
                return f"rank {r} failed: {message}"
        silent = self._silent(self.timeout)
        if silent is not None:
            return silent
        done, since = self._own_progress
        if now - since > self.timeout:
            lag = self._laggards()
            if lag:
                return lag
            return (
                f"no rank made progress for {now - since:.1f} s (every rank at progress "
                f"mark {done}): a collective is stuck"
            )
        return None

    # -- verdicts ----------------------------------------------------------------------------

    def _reported(self) -> str | None:
        if self._failures:
            r, (message, _) = min(self._failures.items())
            return f"rank {r} failed: {message}"
        return None

    def _silent(self, seconds: float) -> str | None:
        stale = self.stale_ranks(seconds)
        if not stale:
            return None
        names = _ranks([r for r, _ in stale])
        age = max(a for _, a in stale)
        return (
            f"{names} stopped: no heartbeat for {age:.1f} s (dead, or hung holding the "
            "interpreter lock)"
        )

    def _laggards(self) -> str | None:
        marks = dict(self._marks)
        marks[self.rank] = self._progress
        top = max(marks.values())
        behind = sorted(r for r, v in marks.items() if v < top)
        if not behind:
            return None
        _, since = self._own_progress
        waited = time.monotonic() - since
        verb = "is" if len(behind) == 1 else "are"
        me = " (this rank)" if behind == [self.rank] else ""
        return (
            f"{_ranks(behind)}{me} {verb} behind (progress marks "
            f"{', '.join(str(marks[r]) for r in behind)} against {top}; no progress here for "
            f"{waited:.1f} s): hung or too slow"
        )

    def _abort(self, message: str) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        line = f"mpsnn: [rank {self.rank}] {message}; ending this rank"
        if self._abort_fn is not None:
            self._abort_fn(line)
            return
        try:
            sys.stdout.flush()
            print(line, file=sys.stderr, flush=True)
        finally:
            os._exit(1)

    def __repr__(self) -> str:
        return (
            f"<RankMonitor rank {self.rank}/{self.world_size}, timeout {self.timeout:g} s, "
            f"interval {self.interval:g} s>"
        )


def report_failure(store: Any, rank: int, message: str) -> None:
    """Record in ``store`` (a monitor's) that ``rank`` failed, with the first line of
    ``message``: every rank's monitor names it (`RankMonitor.report_failure`; a launcher that
    saw a rank die reports it the same way)."""
    text = message.strip()
    line = text.splitlines()[0] if text else "failed"
    try:
        store.set(f"failed/{rank}", line[:500])
        store.add("failures", 1)
    except Exception:  # the store is gone: the others find out by the heartbeats
        pass


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks))
