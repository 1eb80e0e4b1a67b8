"""`RankMonitor` verdicts on an in-memory store (no processes), and the weight check's naming
of the diverging ranks."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import mpsnn as m
from mpsnn.distributed.data_parallel import _compare


def _monitors(world: int, timeout: float) -> tuple[list[m.RankMonitor], list[str]]:
    store = dist.HashStore()
    lines: list[str] = []
    mons = [m.RankMonitor(store, r, world, timeout, 0.05, abort=lines.append) for r in range(world)]
    return mons, lines


def _wait(lines: list[str], seconds: float = 5.0) -> None:
    end = time.monotonic() + seconds
    while not lines and time.monotonic() < end:
        time.sleep(0.02)


def test_a_rank_that_never_beats_is_named_after_the_timeout() -> None:
    (a, _), lines = _monitors(2, 0.3)
    a.start()
    try:
        _wait(lines)
    finally:
        a.stop()
    assert lines and lines[0].startswith("mpsnn: [rank 0] rank 1 stopped: no heartbeat for")


def test_a_reported_failure_ends_the_others_and_diagnose_names_it() -> None:
    (a, b), lines = _monitors(2, 30)
    a.start(), b.start()
    try:
        b.report_failure("[rank 1] out of memory\nsecond line")
        assert a.diagnose(wait=2) == "rank 1 failed: [rank 1] out of memory"
        _wait(lines)
    finally:
        a.stop(), b.stop()
    assert lines == ["mpsnn: [rank 0] rank 1 failed: [rank 1] out of memory; ending this rank"]


def test_a_rank_without_progress_names_the_laggard() -> None:
    (a, b), lines = _monitors(2, 0.4)
    a.start(), b.start()
    try:
        for _ in range(3):
            a.progress()  # rank 0 moves on, rank 1 never does: both judge rank 1
        _wait(lines)
    finally:
        a.stop(), b.stop()
    assert lines, "no verdict"
    assert all("rank 1" in line and "is behind" in line for line in lines), lines


def test_stopped_monitors_judge_nothing() -> None:
    (a, _), lines = _monitors(2, 0.1)
    a.start()
    a.stop()
    time.sleep(0.3)
    assert lines == []
    assert "fresh" in m.RankMonitor(dist.HashStore(), 0, 1, 1.0).diagnose(wait=0)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        m.RankMonitor(dist.HashStore(), 2, 2)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        m.RankMonitor(dist.HashStore(), 0, 2, 0)


def test_the_weight_check_names_the_minority() -> None:
    rows = torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 4, dtype=torch.float64)
    _compare(rows.clone(), ["a weights", "b weights"], 5, 0)  # equal: no error
    rows[2, 3] = 4.5
    with pytest.raises(m.DistributedError, match=r"after step 5: rank 2 differs from rank 0 "
                       r"\(first difference: b weights"):  # fmt: skip
        _compare(rows, ["a weights", "b weights"], 5, 0)
    rows = torch.tensor([[1.0, 2.0], [1.0, 2.5], [1.0, 2.5]], dtype=torch.float64)
    with pytest.raises(m.DistributedError, match="rank 0 differs from rank 1"):
        _compare(rows, ["w"], 1, 1)
    nan = torch.full((2, 2), float("nan"), dtype=torch.float64)
    _compare(nan, ["w"], 1, 0)  # identical NaNs are equal bits
