"""The benchmark helpers that decide what a reported ratio means."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import bench_apple_step, bench_eager_pairs, suite, suite_compare
from mpsnn.data.fashion_mnist import find_fashion_mnist


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


def test_apple_step_reports_the_pairs_on_the_cpu(capsys) -> None:
    bench_apple_step.main(["--device", "cpu", "--pairs", "2", "--steps", "1"])
    out = capsys.readouterr().out
    found = re.search(r"median (\d+\.\d+) \(range (\d+\.\d+)-(\d+\.\d+)\) over 2 pairs", out)
    assert found is not None, out
    median, low, high = map(float, found.groups())
    assert 0 < low <= median <= high


# -- benchmarks.suite: the standard table and its regression guard ---------------------------


def _row(name: str, ratio: float, mpsnn_ms: float | None = None, group: str = "g", **kw) -> dict:
    """A row whose PyTorch time is 1 ms unless ``mpsnn_ms`` is given."""
    mpsnn_ms = ratio if mpsnn_ms is None else mpsnn_ms
    return {"group": group, "name": name, "mpsnn_ms": mpsnn_ms, "pytorch_ms": mpsnn_ms / ratio,
            "ratio": ratio, **kw}  # fmt: skip


def _status(comparison: list[dict]) -> dict[str, str]:
    return {c["name"]: c["status"] for c in comparison}


def test_suite_flags_a_ratio_six_percent_worse_and_not_four() -> None:
    old = [_row("a", 1.0), _row("b", 1.0), _row("c", 2.0), _row("d", 1.0)]
    new = [_row("a", 1.06), _row("b", 1.04), _row("c", 1.80), _row("d", 1.0)]
    got = suite_compare.compare_rows(new, old)
    assert _status(got) == {"a": "regressed", "b": "ok", "c": "improved", "d": "ok"}
    assert got[0]["ratio_change"] == pytest.approx(0.06)
    assert got[0]["mpsnn_change"] == pytest.approx(0.06)
    assert got[0]["baseline_ratio"] == 1.0
    assert _status(suite_compare.compare_rows(new, old, tolerance=0.1))["a"] == "ok"


def test_suite_drift_of_the_host_or_pytorch_is_no_regression() -> None:
    old = [_row(n, 1.0, mpsnn_ms=10.0) for n in ("host", "torch", "code", "both")]
    new = [
        _row("host", 1.0, mpsnn_ms=12.0),  # a slower host: both sides 20% slower
        _row("torch", 1.11, mpsnn_ms=10.0),  # PyTorch's side 10% faster, mpsnn unchanged
        _row("code", 1.07, mpsnn_ms=10.7),  # mpsnn 7% slower, PyTorch unchanged
        _row("both", 1.07, mpsnn_ms=12.84),  # mpsnn 7% slower on a 20% slower host
    ]
    got = {c["name"]: c for c in suite_compare.compare_rows(new, old)}
    assert {n: c["status"] for n, c in got.items()} == {
        "host": "drift", "torch": "drift", "code": "regressed", "both": "regressed"
    }  # fmt: skip
    assert got["host"]["mpsnn_change"] == pytest.approx(0.2)
    assert got["torch"]["ratio_change"] == pytest.approx(0.11)


def test_suite_row_tolerance_widens_the_run_tolerance() -> None:
    old = [_row("eager", 1.0), _row("worse", 1.0)]
    new = [_row("eager", 1.2, tolerance=0.3), _row("worse", 1.35, tolerance=0.3)]
    assert _status(suite_compare.compare_rows(new, old)) == {"eager": "ok", "worse": "regressed"}
    new = [_row("eager", 1.2, tolerance=0.01)]  # never narrower than the run's
    assert _status(suite_compare.compare_rows(new, old[:1], tolerance=0.25)) == {"eager": "ok"}


def test_suite_new_and_missing_rows() -> None:
    got = suite_compare.compare_rows([_row("kept", 1.0), _row("added", 9.0)],
                                     [_row("kept", 1.0), _row("gone", 1.0)])  # fmt: skip
    assert [(c["name"], c["status"]) for c in got] == [
        ("kept", "ok"), ("added", "new"), ("gone", "missing")
    ]  # fmt: skip
    assert "ratio_change" not in got[1] and got[2]["baseline_ratio"] == 1.0
    assert _status(suite_compare.compare_rows([_row("x", 5.0)], [])) == {"x": "new"}
    table = suite_compare.table(got)
    assert "gone" in table and "missing" in table and table.splitlines()[0].startswith("row")


def test_suite_keep_better_and_merged_baseline() -> None:
    first = [_row("a", 1.2), _row("b", 1.0)]
    got = suite_compare.keep_better(first, [_row("a", 1.1), _row("b", 1.3)])
    assert [(r["name"], r["ratio"], r["runs"]) for r in got] == [("a", 1.1, 2), ("b", 1.0, 2)]
    old = [_row("x", 1.0, group="conv"), _row("y", 1.0, group="adam")]
    merged = suite_compare.merged_baseline([_row("x2", 2.0, group="conv")], old, ["conv"])
    assert [r["name"] for r in merged] == ["x2", "y"]  # conv rows replaced, adam's kept


def test_suite_device_slug_and_baseline_files() -> None:
    assert suite.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert suite.slug("cpu AMD EPYC, 2 threads") == "cpu-amd-epyc-2-threads"
    root = Path("r")
    assert suite_compare.baseline_path(root, "nvidia-h200", False) == root / "nvidia-h200.json"
    assert suite_compare.baseline_path(root, "nvidia-h200", True) == root / "nvidia-h200-quick.json"
    assert suite.device_name("cpu").startswith("cpu ")


def _doc(rows: list[dict]) -> dict:
    meta = {"device": "cpu x", "torch": "2", "triton": None, "date": "d", "commit": None}
    return {"schema": suite_compare.SCHEMA, "slug": "cpu-x", "quick": True, **meta,
            "rows": [{**r, "dtype": "float32", "precision": {"dtype": "float32"}, **meta}
                     for r in rows]}  # fmt: skip


def test_suite_schema_is_validated() -> None:
    suite_compare.validate(_doc([_row("a", 1.0)]))
    bad = _doc([_row("a", 1.0)])
    del bad["rows"][0]["pytorch_ms"]
    with pytest.raises(ValueError, match="row 0 must have 'pytorch_ms'"):
        suite_compare.validate(bad)
    with pytest.raises(ValueError, match="must be unique"):
        suite_compare.validate(_doc([_row("a", 1.0), _row("a", 2.0)]))
    with pytest.raises(ValueError, match="schema must be 1"):
        suite_compare.validate({**_doc([]), "schema": 2})
    with pytest.raises(ValueError, match="'quick' must be"):
        suite_compare.validate({**_doc([]), "quick": 1})
    wrong = _doc([_row("a", 1.0)])
    wrong["rows"][0]["ratio"] = True  # a bool is no float
    with pytest.raises(ValueError, match="'ratio' must be"):
        suite_compare.validate(wrong)


class _Fake:
    """A group whose ratios are set by the test, one list entry per call."""

    def __init__(self, *ratios: float) -> None:
        self.ratios = list(ratios)
        self.calls = 0

    def __call__(self, device: str, plan: object, cache: dict) -> list[dict]:
        ratio = self.ratios[min(self.calls, len(self.ratios) - 1)]
        self.calls += 1
        return [suite.make_row("fake", "fake row", 2.0 * ratio, 2.0, "bfloat16")]


def _run(monkeypatch, tmp_path: Path, *args: str, device: str = "Fake GPU 1") -> int:
    def env(_: str) -> dict:
        return {"device": device, "slug": suite.slug(device), "torch": "t", "triton": None,
                "date": "today", "commit": "abc"}  # fmt: skip

    monkeypatch.setattr(suite, "environment", env)
    argv = ["--device", "cpu", "--quick", "--results-dir", str(tmp_path), *args]
    return suite.main([*argv, "--json", str(tmp_path / "out.json")])


def test_suite_update_then_check(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(suite.GROUPS, "fake", _Fake(1.0))
    assert _run(monkeypatch, tmp_path, "--only", "fake", "--update") == 0
    base = json.loads((tmp_path / "fake-gpu-1-quick.json").read_text())
    suite_compare.validate(base)
    assert [(r["name"], r["ratio"]) for r in base["rows"]] == [("fake row", 1.0)]
    # 6% worse twice (the confirming run too): flagged, exit 1 with --check, 0 without
    slow = _Fake(1.06, 1.06)
    monkeypatch.setitem(suite.GROUPS, "fake", slow)
    assert _run(monkeypatch, tmp_path, "--only", "fake", "--check") == 1
    assert slow.calls == 2
    assert _run(monkeypatch, tmp_path, "--only", "fake") == 0
    # worse once, then fine: the better run is kept
    monkeypatch.setitem(suite.GROUPS, "fake", _Fake(1.10, 1.01))
    assert _run(monkeypatch, tmp_path, "--only", "fake", "--check") == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["rows"][0]["ratio"] == pytest.approx(1.01) and out["rows"][0]["runs"] == 2
    # 4% worse: not flagged, measured once
    once = _Fake(1.04)
    monkeypatch.setitem(suite.GROUPS, "fake", once)
    assert _run(monkeypatch, tmp_path, "--only", "fake", "--check") == 0
    assert once.calls == 1
    # another device has no baseline: nothing to flag
    monkeypatch.setitem(suite.GROUPS, "fake", _Fake(9.0))
    assert _run(monkeypatch, tmp_path, "--only", "fake", "--check", device="Other") == 0
    assert not (tmp_path / "other-quick.json").exists()


def test_suite_failed_group_exits_2_and_keeps_the_baseline(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(suite.GROUPS, "fake", _Fake(1.0))
    assert _run(monkeypatch, tmp_path, "--only", "fake", "--update") == 0

    def broken(device: str, plan: object, cache: dict) -> list[dict]:
        raise RuntimeError("no such kernel")

    monkeypatch.setitem(suite.GROUPS, "broken", broken)
    before = (tmp_path / "fake-gpu-1-quick.json").read_text()
    assert _run(monkeypatch, tmp_path, "--only", "fake,broken", "--update") == 2
    assert (tmp_path / "fake-gpu-1-quick.json").read_text() == before
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["errors"] == {"broken": "RuntimeError: no such kernel"}
    with pytest.raises(SystemExit):
        suite.main(["--device", "cpu", "--only", "nope"])


def test_suite_quick_cpu_run_writes_the_json(tmp_path: Path, capsys) -> None:
    out = tmp_path / "cpu.json"
    argv = ["--device", "cpu", "--quick", "--results-dir", str(tmp_path), "--json", str(out)]
    assert suite.main(argv) == 0
    doc = json.loads(out.read_text())
    suite_compare.validate(doc)
    assert doc["quick"] is True and doc["groups"] == ["conv", "bn", "adam", "main"]
    assert doc["errors"] == {}
    groups = [r["group"] for r in doc["rows"]]
    assert groups == ["conv"] * 6 + ["bn"] * 2 + ["adam", "main"]
    names = [r["name"] for r in doc["rows"]]
    assert "conv3x3 8->8 16x16 b2 bfloat16 gradient" in names
    assert "bn+relu backward 1x64x56x56 float32" in names
    assert "cnn b8 float32 adam step eager" in names
    main = next(r for r in doc["rows"] if r["group"] == "main")
    # the command's own data and trainer where Fashion-MNIST is installed (scripts/setup.sh
    # installs it), synthetic images elsewhere
    try:
        find_fashion_mnist()
        installed = True
    except FileNotFoundError:
        installed = False
    assert main.get("data") == ("fashion-mnist" if installed else None)
    for r in doc["rows"]:
        if r["group"] != "main":  # main: the median of the pairs' ratios
            assert r["ratio"] == pytest.approx(r["mpsnn_ms"] / r["pytorch_ms"])
        assert r["device"] == doc["device"] and r["commit"] == doc["commit"]
        if r["dtype"] == "float32":
            assert r["precision"]["mpsnn_float32_matmul_precision"] == "highest"
            assert "torch_cudnn_allow_tf32" in r["precision"]
    bn = next(r for r in doc["rows"] if r["name"].startswith("bn+relu backward"))
    assert bn["floor_bytes"] == 5 * 64 * 56 * 56 * 4  # g and x twice, dx once
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("cnn b8 float32")


def test_suite_replayed_step_row_on_the_cpu() -> None:
    r = suite.replay_row("lenet", "cpu", batch=4, steps=1, trials=1)
    assert r["name"] == "lenet b4 float32 adam step compiled"  # no CUDA graph on the CPU
    assert r["mpsnn_peak_mib"] is None and r["pytorch_peak_mib"] is None
    assert r["ratio"] == pytest.approx(r["mpsnn_ms"] / r["pytorch_ms"])


def test_suite_eager_row_takes_the_median_of_the_pairs(monkeypatch) -> None:
    def measure(model: str, device: str, pairs: int, steps: int, batch: int) -> dict:
        assert (model, pairs, steps, batch) == ("lenet", 3, 5, 16)
        return {"mpsnn_ms": [2.0, 3.0, 9.0], "torch_ms": [1.0, 2.0, 3.0]}

    monkeypatch.setattr(bench_eager_pairs, "measure", measure)
    r = suite.eager_row("lenet", "lenet", "cuda", batch=16, pairs=3, steps=5)
    assert r["name"] == "lenet b16 float32 adam step eager"
    assert (r["mpsnn_ms"], r["pytorch_ms"]) == (3.0, 2.0)
    assert r["ratio"] == pytest.approx(2.0)  # median of 2.0, 1.5, 3.0 (not 3.0 / 2.0)
    assert r["tolerance"] == suite.EAGER_CUDA_TOLERANCE  # host-bound on CUDA
    assert "tolerance" not in suite.eager_row("lenet", "lenet", "cpu", 16, 3, 5)


def test_profile_step_reports_each_commands_host_time_and_operations(capsys) -> None:
    """The step profiler's CPU run: the unprofiled host times, every command of a LeNet-5 step
    with its host time and its PyTorch operations, and the step program's restored commands
    (a second profile of the same graph sees them unwrapped)."""
    import sys

    from benchmarks.tools import profile_step

    argv = ["profile_step", "--model", "lenet", "--batch", "2", "--device", "cpu", "--lines", "3"]
    saved, sys.argv = sys.argv, argv
    try:
        profile_step.main()
    finally:
        sys.argv = saved
    out = capsys.readouterr().out
    assert "# host per eager step, unprofiled (median of 21; min)" in out
    times = out.split("by command:")[1].split("#")[0]
    for name in ("ConvolutionGradient", "Convolution", "Loss", "Graph.bind"):
        assert f" {name}\n" in times
    ops = out.split("operations per command call")[1]
    assert "ConvolutionGradient (2x): aten::convolution_backward 1" in ops
    assert "wrapped" not in out  # the timing wrappers were taken out again


def test_dp_host_time_reports_every_variant_on_the_cpu(capfd) -> None:
    """The data-parallel host-time tool's smoke run: two Gloo processes, ResNet-18 at batch 2,
    a line per rank and variant, and the one-process step."""
    from benchmarks.tools import dp_host_time

    dp_host_time.main(["--device", "cpu", "--gpus", "2", "--batch-per-gpu", "2", "--steps", "2",
                       "--warmup", "1"])  # fmt: skip
    # the processes share the captured stdout: a line may follow another process's output on
    # the same line (a native library's message), so the reports are searched, not split
    out = capfd.readouterr().out
    lines = re.findall(r"# rank \d, [^;#\n]*;[^#\n]*", out)
    want = {f"# rank {r}, 2 processes, {bn} BN: CPU" for r in (0, 1)
            for bn in ("synchronized", "local")} | {"# rank 0, one process: CPU"}  # fmt: skip
    assert {ln.split(";")[0] for ln in lines} == want, out
    assert all("ms back to back; wall per step" in ln for ln in lines)


def test_replay_time_prints_one_line_per_case_on_the_cpu(capsys, monkeypatch) -> None:
    from benchmarks.tools import replay_time

    args = ["replay_time", "--device", "cpu", "--batch", "2", "--steps", "2", "--trials", "3",
            "--tag", "t"]  # fmt: skip
    monkeypatch.setattr("sys.argv", args)
    replay_time.main()
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[:3] for line in lines] == [["t", "lenet", "replay"],
                                                     ["t", "resnet18", "replay"]]  # fmt: skip
    for line in lines:
        trials = line.split("(")[1].rstrip(")").split(", ")
        assert len(trials) == 3 and all(float(t) > 0 for t in trials)
        assert float(line.split()[3]) == sorted(float(t) for t in trials)[1]  # the median
