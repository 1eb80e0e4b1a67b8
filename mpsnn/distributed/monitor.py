"""`RankMonitor`: every rank's heartbeat and progress in the rendezvous store, and the judge of
which rank failed when a distributed run cannot go on.

Each rank runs two daemon threads. The **heartbeat** thread, at least every ``interval``
seconds,

1. adds 1 to its heartbeat counter ``hb/<rank>`` and publishes its progress
   ``progress/<rank>`` (how many `progress` marks its main thread made: one per training step
   and per evaluation batch in ``mpsnn train``);
2. reads every rank's counters. A heartbeat that stayed the same in this rank's reads for
   ``s`` seconds, measured on this rank's monotonic clock (no clocks are compared across
   machines), is **stale** for ``s`` seconds: the rank is dead, stopped, or hung with the
   interpreter lock held;
3. reads the failure reports: a rank whose code raised writes ``failed/<rank>`` (its one-line
   message) before it exits (`report_failure`).

The **store watchdog** thread watches the heartbeat thread's store calls: a TCP store whose
host is stopped or frozen keeps its connections open and never answers, and the client's calls
then block forever (the store's own timeout does not bound them).

The monitor ends this process (one line on stderr, then ``os._exit(1)``: the main thread may
be blocked inside a collective that nothing else interrupts) when

* a rank's heartbeat is stale for ``timeout`` seconds, or this rank made no progress for
  ``timeout`` seconds (it waits for a rank that hung: named are then the ranks stale for
  ``4 interval`` seconds, else those behind in progress); the heartbeat thread wakes up at
  those deadlines, so this happens within ``timeout + interval`` seconds of the rank's last
  heartbeat (or this rank's last progress), plus one read of the store;
* the store has not answered for ``timeout`` seconds since its last answer (a call pending, or
  the connection broken): within ``timeout`` seconds of the store's failure;
* ``2 interval`` seconds after another rank reported a failure (time for this rank's own error
  to surface first).

Before ending, the rank records whom it blames (``blame/<rank>``: the ranks its verdict names,
`read_blame`), so that a launcher names the culprit rather than the rank that ended.

When a collective raises (Gloo: a peer closed its connections, or the process group's timeout
passed), `diagnose` names the culprits: reported failures first, then ranks whose heartbeat
has been stale for ``4 interval`` seconds (it waits up to ``8 interval + 1`` seconds for a dead
rank's heartbeat to go stale that long), then a store that has not answered for ``4 interval``
seconds (the heartbeats then cannot tell), then the ranks that lag in progress.

Every store call made on a failure path (`report_failure`, the blame) waits at most
``min(timeout, 1 + 2 interval)`` seconds for the store, in a helper thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["RankMonitor", "read_blame", "report_failure", "say"]

#: verdict: (the ranks it blames, its one-line text)
Verdict = tuple[list[int], str]


class RankMonitor:
    """Heartbeats and failure reports of one rank (see the module docstring).

    Args:
        store: a ``torch.distributed`` store every rank reaches (e.g. a ``PrefixStore`` over
            the rendezvous ``TCPStore``); the monitor's threads are its only users.
        rank, world_size: this rank and the number of ranks.
        timeout: seconds of silence (stale heartbeat, no progress, a store that does not
            answer) after which the run is ended.
        interval: seconds between heartbeats (default ``clamp(timeout / 20, 0.1, 2)``).
        abort: called with the one-line message instead of printing it and ending the process
            (for tests and embedding).
        store_address: ``host:port`` of the store, named when it stops answering.
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
        store_address: str | None = None,
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
        self.store_address = store_address
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
        # the store: when it last answered, since when a call is pending, why it broke
        self._answered = now
        self._calling: float | None = None
        self._lost: Exception | None = None
        self._blame: Verdict | None = None  # the latest verdict that named ranks
        self._stop = threading.Event()
        self._ending = threading.Lock()  # held by whoever ends the rank, until it ends
        self._claimed = False
        self._threads: list[threading.Thread] = []

    # -- main thread -------------------------------------------------------------------------

    def start(self) -> RankMonitor:
        """Start the heartbeat thread (its first heartbeat right away) and the store watchdog
        (returns self; never waits for the store)."""
        if not self._threads:
            self._answered = time.monotonic()
            for target, name in ((self._loop, "monitor"), (self._watch_store, "store-watchdog")):
                thread = threading.Thread(
                    target=target, name=f"mpsnn-{name}-rank{self.rank}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        return self

    def stop(self) -> None:
        """Stop the threads (a normal end: nothing is judged afterwards); a thread blocked in
        a store call is left behind (a daemon)."""
        self._stop.set()
        if self._claimed:  # a thread may wait for the claim: ending the rank goes on
            return
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=max(1.0, 2 * self.interval))

    def claim_end(self) -> None:
        """The main thread ends this rank itself (with its own one-line error): the monitor
        judges nothing from now on. If the monitor is already ending the rank, this waits
        (the monitor prints its line and ends the process), so a rank prints one verdict.
        The claim lasts until the process ends."""
        self._ending.acquire()
        self._claimed = True
        self._stop.set()

    def progress(self) -> None:
        """This rank made progress (a step or a batch): cheap, no store access."""
        self._progress += 1

    def report_failure(self, message: str) -> None:
        """Tell the other ranks this rank failed (they end with ``message`` named after it),
        with whom the latest diagnosis blamed; waits at most ``min(timeout, 1 + 2 interval)``
        seconds for the store."""
        report_failure(self.store, self.rank, message, blame=self._blame, wait=self._quick)

    def stale_ranks(self, seconds: float) -> list[tuple[int, float]]:
        """``(rank, seconds)`` of the other ranks whose heartbeat stayed the same for more than
        ``seconds`` in this rank's reads of the store (up to its last answer: a store that
        stopped answering makes no rank stale)."""
        read = self._answered
        return [
            (r, read - t)
            for r, (_, t) in sorted(self._beats.items())
            if r != self.rank and read - t > seconds
        ]

    def diagnose(self, wait: float | None = None) -> str:
        """Why a collective failed, naming ranks where the heartbeats tell (waits up to
        ``wait`` seconds, default ``8 interval + 1``, for a dead rank's heartbeat to be
        stale for ``4 interval``)."""
        window = 4 * self.interval
        deadline = time.monotonic() + (2 * window + 1.0 if wait is None else wait)
        while True:
            verdict = self._reported() or self._silent(window)
            if verdict is not None:
                self._blame = verdict
                return verdict[1]
            silent = self._store_silence()
            if silent > window:
                why = self._unreachable(silent)
                return f"{why}, so the heartbeats cannot tell which rank failed"
            if time.monotonic() >= deadline or not self._threads:
                break
            time.sleep(self.interval / 2)
        lag = self._laggards()
        if lag:
            self._blame = lag
            return lag[1]
        return "every rank's heartbeat is fresh (a network or backend failure?)"

    # -- the heartbeat thread ----------------------------------------------------------------

    def _loop(self) -> None:
        wait = 0.0  # the first heartbeat right away
        while not self._stop.wait(wait):
            self._calling = time.monotonic()
            try:
                self._beat()
            except Exception as exc:  # a broken connection does not come back
                self._lost = exc
                self._calling = None
                return  # the watchdog ends the rank `timeout` s after the last answer
            self._answered = time.monotonic()
            self._calling = None
            verdict = self._verdict()
            if verdict is not None:
                self._abort(verdict[1], verdict[0])
                return
            wait = self._next_wait()

    def _next_wait(self) -> float:
        """An interval, or less: until the earliest moment a verdict could fall due."""
        due = [t for r, (_, t) in self._beats.items() if r != self.rank]
        due.append(self._own_progress[1])
        left = min(due) + self.timeout - time.monotonic() + 0.002
        return min(self.interval, max(0.01, left))

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

    def _verdict(self) -> Verdict | None:
        if self._stop.is_set():
            return None
        now = time.monotonic()
        for r, (message, seen) in sorted(self._failures.items()):
            if now - seen > 2 * self.interval:
                return [r], f"rank {r} failed: {message}"
        silent = self._silent(self.timeout)
        if silent is not None:
            return silent
        done, since = self._own_progress
        if now - since > self.timeout:
            # a rank silent for a while is why (its own deadline may be a beat later)
            lag = self._silent(4 * self.interval) or self._laggards()
            if lag:
                return lag
            return [], (
                f"no rank made progress for {now - since:.1f} s (every rank at progress "
                f"mark {done}): a collective is stuck"
            )
        return None

    # -- the store watchdog ------------------------------------------------------------------

    def _watch_store(self) -> None:
        """End the rank when the store has not answered for ``timeout`` seconds while a call
        waits for it (or since it broke)."""
        while True:
            wait = self.interval
            if self._calling is not None or self._lost is not None:
                silent = time.monotonic() - self._answered
                if silent > self.timeout:
                    self._abort(self._unreachable(silent), None)
                    return
                wait = self.timeout - silent + 0.002
            if self._stop.wait(wait):
                return

    def _store_silence(self) -> float:
        """Seconds since the store last answered, when a call waits for it or it broke (0
        while it answers)."""
        if self._calling is None and self._lost is None:
            return 0.0
        return time.monotonic() - self._answered

    def _unreachable(self, silent: float) -> str:
        where = f" at {self.store_address}" if self.store_address else ""
        text = (
            f"the rendezvous store{where} has not answered for {silent:.1f} s (its host: the "
            "launcher, torchrun's agent or rank 0, is stopped, hung, gone or unreachable)"
        )
        lost = self._lost
        if lost is not None:
            first = str(lost).strip().splitlines()[0] if str(lost).strip() else ""
            text += f": {type(lost).__name__} {first}".rstrip()
        return text[:400]

    @property
    def _quick(self) -> float:
        """How long a failure path waits for the store."""
        return min(self.timeout, 1.0 + 2 * self.interval)

    # -- verdicts ----------------------------------------------------------------------------

    def _reported(self) -> Verdict | None:
        if self._failures:
            r, (message, _) = min(dict(self._failures).items())
            return [r], f"rank {r} failed: {message}"
        return None

    def _silent(self, seconds: float) -> Verdict | None:
        stale = self.stale_ranks(seconds)
        if not stale:
            return None
        ranks = [r for r, _ in stale]
        age = max(a for _, a in stale)
        return ranks, (
            f"{_ranks(ranks)} stopped: no heartbeat for {age:.1f} s (dead, stopped, or hung "
            "holding the interpreter lock)"
        )

    def _laggards(self) -> Verdict | None:
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
        return behind, (
            f"{_ranks(behind)}{me} {verb} behind (progress marks "
            f"{', '.join(str(marks[r]) for r in behind)} against {top}; no progress here for "
            f"{waited:.1f} s): hung or too slow"
        )

    def _abort(self, message: str, blame: list[int] | None) -> None:
        """End the rank with ``message``; ``blame`` (the ranks it names; None: the store does
        not answer) is recorded first, for the launcher. Holds the ending lock until the
        process ends: one line per rank, whoever ends it (`claim_end`)."""
        with self._ending:  # the heartbeat thread, the watchdog and the main thread
            if self._stop.is_set():
                return
            self._stop.set()
            if blame is not None:
                _bounded(lambda: _write_blame(self.store, self.rank, blame, message), self._quick)
            line = f"mpsnn: [rank {self.rank}] {message}; ending this rank"
            if self._abort_fn is not None:
                self._abort_fn(line)
                return
            try:
                say(line)
            finally:
                os._exit(1)

    def __repr__(self) -> str:
        return (
            f"<RankMonitor rank {self.rank}/{self.world_size}, timeout {self.timeout:g} s, "
            f"interval {self.interval:g} s>"
        )


def report_failure(
    store: Any,
    rank: int,
    message: str,
    *,
    blame: Verdict | None = None,
    wait: float = 5.0,
) -> bool:
    """Record in ``store`` (a monitor's) that ``rank`` failed, with the first line of
    ``message``: every rank's monitor names it (`RankMonitor.report_failure`; a launcher that
    saw a rank die reports it the same way). ``blame``: the ranks (and the verdict) this
    rank's failure is due to, for `read_blame`. Waits at most ``wait`` seconds for the store;
    returns whether it took the report."""
    text = message.strip()
    line = text.splitlines()[0] if text else "failed"

    def write() -> None:
        if blame is not None:
            _write_blame(store, rank, *blame)
        store.set(f"failed/{rank}", line[:500])
        store.add("failures", 1)

    return _bounded(write, wait)


def read_blame(store: Any, rank: int) -> Verdict | None:
    """The ranks ``rank`` blamed when it ended (a monitor's verdict, or the diagnosis of a
    failed collective) and that verdict's text; None when it recorded none."""
    key = f"blame/{rank}"
    if not store.check([key]):
        return None
    ranks, _, text = store.get(key).decode(errors="replace").partition("\t")
    return [int(r) for r in ranks.split(",") if r], text


def _write_blame(store: Any, rank: int, ranks: list[int], text: str) -> None:
    line = " ".join(text.split())
    store.set(f"blame/{rank}", f"{','.join(map(str, ranks))}\t{line[:500]}")


def _bounded(fn: Callable[[], None], seconds: float) -> bool:
    """Run ``fn`` (store calls) in a daemon thread; wait at most ``seconds`` for it (a store
    whose host stopped never answers). Returns whether it completed without raising."""
    ok: list[bool] = []
    done = threading.Event()

    def run() -> None:
        try:
            fn()
            ok.append(True)
        except Exception:  # the store is gone: the others find out by the heartbeats
            pass
        finally:
            done.set()

    threading.Thread(target=run, name="mpsnn-store-call", daemon=True).start()
    return done.wait(seconds) and bool(ok)


def say(line: str) -> None:
    """Print ``line`` on stderr, after what stdout holds, in one write: ranks share the
    launcher's stderr, and their lines must not interleave."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os.write(sys.stderr.fileno(), (line + "\n").encode(errors="replace"))


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(map(str, ranks))
