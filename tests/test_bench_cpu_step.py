"""`benchmarks.bench_cpu_step`: ``mpsnn train``'s CPU step against PyTorch's, in pairs."""

from __future__ import annotations

import pytest

from benchmarks import bench_cpu_step


def test_cpu_step_pairs_report_pytorch_over_mpsnn() -> None:
    r = bench_cpu_step.measure(pairs=2, steps=1)
    assert (r["model"], r["batch"], r["dtype"], r["optimizer"]) == ("cnn", 64, "float32", "adam")
    assert len(r["mpsnn_ms"]) == len(r["torch_ms"]) == len(r["ratios"]) == 2
    assert all(v > 0 for v in r["mpsnn_ms"] + r["torch_ms"])
    pairs = zip(r["mpsnn_ms"], r["torch_ms"], strict=True)
    assert r["ratios"] == pytest.approx([t / m for m, t in pairs])
    assert r["median_ratio"] == pytest.approx(sum(r["ratios"]) / 2)
    line = bench_cpu_step.summary("after", r)
    assert line.startswith("after    cnn b64 cpu") and "over 2 pairs" in line
