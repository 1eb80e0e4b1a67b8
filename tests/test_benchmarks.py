"""The benchmark helpers that decide what a reported ratio means."""

from __future__ import annotations

import pytest

from benchmarks import bench_eager_pairs


def test_eager_pairs_alternate_and_swap_the_order() -> None:
    calls: list[str] = []

    def mine() -> None: ...

    def theirs() -> None: ...

    def timed(step) -> float:  # a clock that advances with every run
        calls.append("mine" if step is mine else "theirs")
        return (2.0 if step is mine else 3.0) + len(calls) * 1e-3

    a, b = bench_eager_pairs.alternate(mine, theirs, timed, 3)
    assert calls == ["mine", "theirs", "theirs", "mine", "mine", "theirs"]
    assert a == pytest.approx([2.001, 2.004, 2.005])
    assert b == pytest.approx([3.002, 3.003, 3.006])


def test_eager_pairs_measure_on_the_cpu() -> None:
    r = bench_eager_pairs.measure("lenet", "cpu", pairs=2, steps=1)
    assert len(r["mpsnn_ms"]) == len(r["torch_ms"]) == len(r["ratios"]) == 2
    assert all(v > 0 for v in r["mpsnn_ms"] + r["torch_ms"])
    pairs = zip(r["mpsnn_ms"], r["torch_ms"], strict=True)
    assert r["ratios"] == pytest.approx([t / m for m, t in pairs])
    assert r["median_ratio"] == pytest.approx(sum(r["ratios"]) / 2)
