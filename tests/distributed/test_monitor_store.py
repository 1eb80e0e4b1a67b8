"""`RankMonitor` against a rendezvous store that stops answering (its host stopped or frozen):
every store call of the monitor is bounded by the timeout, a stalled store ends the rank with
one line naming the store, and a diagnosis blames the store rather than the ranks. In memory,
with a store whose calls block while its gate is closed; every test opens the gate again."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

import mpsnn as m


class GatedStore:
    """A `HashStore` whose calls wait while the gate is closed (a stopped store host: the
    connection stays open, nothing answers)."""

    def __init__(self) -> None:
        self.inner = dist.HashStore()
        self.gate = threading.Event()
        self.gate.set()

    def _call(self, name: str, *args: Any) -> Any:
        self.gate.wait()
        return getattr(self.inner, name)(*args)

    def add(self, key: str, value: int) -> int:
        return self._call("add", key, value)

    def set(self, key: str, value: str) -> None:
        self._call("set", key, value)

    def get(self, key: str) -> bytes:
        return self._call("get", key)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", keys)


@pytest.fixture
def store() -> Iterator[GatedStore]:
    s = GatedStore()
    yield s
    s.gate.set()  # releases every blocked call


def _wait(lines: list[str], seconds: float) -> float:
    start = time.monotonic()
    while not lines and time.monotonic() - start < seconds:
        time.sleep(0.01)
    return time.monotonic() - start


def test_a_store_that_stops_answering_ends_the_rank_after_the_timeout(store: GatedStore) -> None:
    lines: list[str] = []
    mon = m.RankMonitor(store, 0, 1, timeout=0.8, interval=0.05, abort=lines.append).start()
    try:
        time.sleep(0.3)
        assert lines == []  # a healthy store: nothing judged
        store.gate.clear()  # the store host stops
        waited = _wait(lines, 10)
    finally:
        mon.stop()
    assert lines, "the monitor never noticed that the store stopped answering"
    assert re.fullmatch(
        r"mpsnn: \[rank 0\] the rendezvous store has not answered for 0\.[89]\d* s \(its host: "
        r"the launcher, torchrun's agent or rank 0, is stopped, hung, gone or unreachable\); "
        r"ending this rank",
        lines[0],
    ), lines
    assert 0.8 - 0.05 - 0.02 <= waited < 0.8 + 0.5, waited  # silent since its last answer


def test_the_store_address_is_named(store: GatedStore) -> None:
    lines: list[str] = []
    mon = m.RankMonitor(store, 1, 2, timeout=0.3, interval=0.05, abort=lines.append,
                        store_address="host0:29400")  # fmt: skip
    store.gate.clear()
    mon.start()  # the first heartbeat, on the calling thread, is bounded too
    try:
        _wait(lines, 10)
    finally:
        mon.stop()
    assert lines and lines[0].startswith(
        "mpsnn: [rank 1] the rendezvous store at host0:29400 has not answered for"
    ), lines


def test_diagnose_blames_a_stalled_store_not_the_ranks(store: GatedStore) -> None:
    """A stalled store freezes every heartbeat this rank reads: that is no rank's fault."""
    lines: list[str] = []
    a, b = (m.RankMonitor(store, r, 2, timeout=30, interval=0.05, abort=lines.append)
            for r in range(2))  # fmt: skip
    a.start(), b.start()
    try:
        time.sleep(0.3)
        store.gate.clear()
        time.sleep(0.5)  # > 4 intervals: every other rank's heartbeat looks stale here
        why = a.diagnose(wait=2)
    finally:
        store.gate.set()
        a.stop(), b.stop()
    assert why.startswith("the rendezvous store has not answered for"), why
    assert "the heartbeats cannot tell which rank failed" in why, why
    assert "rank 1" not in why
    assert lines == []


def test_reporting_a_failure_to_a_stalled_store_returns(store: GatedStore) -> None:
    mon = m.RankMonitor(store, 0, 2, timeout=30, interval=0.1, abort=lambda line: None)
    store.gate.clear()
    done = threading.Event()
    thread = threading.Thread(
        target=lambda: (mon.report_failure("[rank 0] out of memory"), done.set()), daemon=True
    )
    start = time.monotonic()
    thread.start()
    done.wait(10)
    assert done.is_set(), "report_failure blocked on a store that does not answer"
    assert time.monotonic() - start < 1.0 + 2 * 0.1 + 0.5


def test_an_ended_rank_leaves_whom_it_blames_for_the_launcher() -> None:
    from mpsnn.distributed.monitor import read_blame

    store = dist.HashStore()
    lines: list[str] = []
    a = m.RankMonitor(store, 0, 2, timeout=0.3, interval=0.05, abort=lines.append).start()
    try:
        _wait(lines, 10)  # rank 1 never beats
    finally:
        a.stop()
    assert lines and "rank 1 stopped" in lines[0]
    culprits, text = read_blame(store, 0) or ([], "")
    assert culprits == [1]
    assert text.startswith("rank 1 stopped: no heartbeat for"), text
    assert read_blame(store, 1) is None


def test_a_rank_that_ends_itself_gets_no_second_line_from_its_monitor() -> None:
    """The main thread's own error claims the end (`claim_end`): the monitor, whose verdict
    would come meanwhile, prints nothing more."""
    lines: list[str] = []
    a = m.RankMonitor(dist.HashStore(), 0, 2, timeout=0.2, interval=0.05, abort=lines.append)
    a.start()
    a.claim_end()
    time.sleep(0.6)  # rank 1 never beats: a verdict would be due after 0.2 s
    a.stop()
    assert lines == []
