"""The standard benchmark table and its regression guard, in one command.

    python -m benchmarks.suite                      # the device's table, compared with its baseline
    python -m benchmarks.suite --check              # exit 1 when a row regressed
    python -m benchmarks.suite --update             # record this run as the device's baseline
    python -m benchmarks.suite --device cpu --quick # tiny sizes: a smoke run

Every row times one piece of work through mpsnn and the same work through PyTorch in the same
run, with the measurement functions of the ``bench_*`` scripts (warm-up, then the median of
several trials, interleaved between the two sides, the device synchronized around each):

* convolution 3x3, 64->64 channels, 56x56, batch 64 (CPU: 8): forward, gradient, and step
  (both), bfloat16 and float32 (`benchmarks.bench_convolution`);
* batch normalization + ReLU in training, 256x64x56x56 (CPU: 4x...): forward and backward,
  with the bytes of the copy floor and each side's fraction of it
  (`benchmarks.bench_normalization`);
* one Adam update over ResNet-18's 62 parameter tensors against ``torch.optim.Adam`` (fused on
  CUDA, foreach) (`benchmarks.bench_optim`);
* CUDA: the LeNet-5 training step (batch 256, float32, Adam) eager and replayed, and the
  CIFAR ResNet-18 step (batch 512, bfloat16, SGD) replayed, with peak memory, against PyTorch
  eager (`mpsnn.cli.bench.measure`); the eager step in alternating pairs of runs
  (`benchmarks.bench_eager_pairs`);
* CPU: the main job's step (`mpsnn train`'s network, batch 64, Adam) eager, in alternating
  pairs against PyTorch eager, with the command's own data and trainer when Fashion-MNIST is
  installed (`benchmarks.bench_cpu_step`).

A row's ``ratio`` is mpsnn's time over PyTorch's (above 1: mpsnn is slower). A row regressed
when its ratio AND mpsnn's own time are both more than ``--tolerance`` (5%) above the
baseline's: a slower or busier host moves both sides of a ratio alike, and a PyTorch side that
drifts alone (PyTorch's eager steps are bound by the host's Python, the replayed mpsnn steps are
not) moves the ratio but not mpsnn's time; either change alone is reported as "drift". The
groups of regressed rows are measured once more and the better run kept, so one noisy trial is
not a regression. The eager steps on CUDA, host-bound on both sides, vary from process to
process by more than that and allow 30%. Baselines are JSON files, one per device, in
``benchmarks/results/`` (``<device-slug>.json``; ``<device-slug>-quick.json`` for ``--quick``),
committed with the code; each run also writes its own results (``--json``, by default
``<device-slug>.last.json`` there, ignored by git).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.suite_compare import (
    SCHEMA,
    TOLERANCE,
    baseline_notes,
    baseline_path,
    compare_rows,
    keep_better,
    load,
    merged_baseline,
    table,
    validate,
)

#: the eager training step on CUDA: host-bound on both sides, see `eager_row`
EAGER_CUDA_TOLERANCE = 0.3
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Plan:
    """Problem sizes and repetitions of one run."""

    conv: tuple[int, int, int]  # batch, channels, height = width
    conv_dtypes: tuple[str, ...]
    bn_batch: int
    bn_dtypes: tuple[str, ...]
    adam_shapes: tuple[tuple[int, ...], ...] | None  # None: ResNet-18's parameters
    iters: int  # kernel calls per trial
    trials: int
    copy_numel: int | None  # None: the bench scripts' large copy
    replays: dict[str, tuple[int, int, int]]  # model -> batch, steps, trials of a replay row
    pairs: dict[str, tuple[int, int, int]]  # model -> batch, pairs, steps of an eager row


def plan_for(device: str, quick: bool) -> Plan:
    """The standard sizes on ``device`` ("cuda..." or "cpu"), or tiny ones for ``quick``.
    Every group has sizes on every device; `DEFAULT_GROUPS` picks the ones a run times."""
    if quick:
        tiny = ((16, 8, 3, 3), (16,), (16,), (16, 16, 3, 3), (10, 16), (10,))
        return Plan(
            conv=(2, 8, 16), conv_dtypes=("float32", "bfloat16"), bn_batch=1,
            bn_dtypes=("float32",), adam_shapes=tiny, iters=1, trials=2, copy_numel=1 << 16,
            replays={"lenet": (16, 2, 2), "resnet18": (4, 1, 2)},
            pairs={"lenet": (16, 2, 2), "cnn": (8, 2, 1)},
        )  # fmt: skip
    if device.startswith("cuda"):
        return Plan(
            conv=(64, 64, 56), conv_dtypes=("bfloat16", "float32"), bn_batch=256,
            bn_dtypes=("float32", "bfloat16"), adam_shapes=None, iters=50, trials=11,
            copy_numel=None, replays={"lenet": (256, 50, 9), "resnet18": (512, 20, 9)},
            pairs={"lenet": (256, 21, 50), "cnn": (64, 21, 50)},
        )  # fmt: skip
    return Plan(
        conv=(8, 64, 56), conv_dtypes=("float32", "bfloat16"), bn_batch=4,
        bn_dtypes=("float32", "bfloat16"), adam_shapes=None, iters=2, trials=5,
        copy_numel=None, replays={"lenet": (256, 5, 3), "resnet18": (64, 2, 3)},
        pairs={"lenet": (256, 5, 5), "cnn": (64, 7, 20)},
    )  # fmt: skip


# -- the rows ------------------------------------------------------------------------------


def precision_of(dtype: str) -> dict[str, Any]:
    """A row's precision: the storage dtype, and for float32 which arithmetic each side ran
    (mpsnn's `get_float32_matmul_precision` switch and PyTorch's TF32 flags)."""
    if dtype != "float32":
        return {"dtype": dtype}
    try:
        from mpsnn.core.precision import describe
    except ImportError:  # a tree without the switch: mpsnn ran under PyTorch's flags
        return {"dtype": dtype, "torch_cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                "torch_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32}  # fmt: skip
    return {"dtype": dtype, **describe()}


def make_row(
    group: str, name: str, mpsnn_ms: float, pytorch_ms: float, dtype: str, **extra: Any
) -> dict[str, Any]:
    """One row: ``ratio`` = ``mpsnn_ms / pytorch_ms``; the run's metadata is added later."""
    return {"group": group, "name": name, "mpsnn_ms": float(mpsnn_ms),
            "pytorch_ms": float(pytorch_ms), "ratio": float(mpsnn_ms) / float(pytorch_ms),
            "dtype": dtype, "precision": precision_of(dtype), **extra}  # fmt: skip


def _bandwidth(device: str, plan: Plan, cache: dict[str, float]) -> float:
    from benchmarks.bench_layers import copy_bandwidth

    if "copy" not in cache:
        cache["copy"] = copy_bandwidth(device, plan.copy_numel)
    return cache["copy"]


def conv_rows(device: str, plan: Plan, cache: dict[str, float]) -> list[dict[str, Any]]:
    from benchmarks.bench_convolution import bench_standard

    n, c, hw = plan.conv
    rows = []
    for dt in plan.conv_dtypes:
        for r in bench_standard(device, getattr(torch, dt), n, c, hw, plan.iters, plan.trials,
                                clamp_offset=False):  # fmt: skip
            name = f"conv3x3 {c}->{c} {hw}x{hw} b{n} {dt} {r['case']}"
            rows.append(make_row("conv", name, r["mpsnn_ms"], r["torch_ms"], dt,
                                 mpsnn_tflops=r["tflops"]))  # fmt: skip
    return rows


def bn_rows(device: str, plan: Plan, cache: dict[str, float]) -> list[dict[str, Any]]:
    from benchmarks.bench_normalization import CHANNELS, SIZE, bench_batch_norm

    bw = _bandwidth(device, plan, cache)
    shape = f"{plan.bn_batch}x{CHANNELS}x{SIZE}x{SIZE}"
    rows = []
    for dt in plan.bn_dtypes:
        out = bench_batch_norm(device, plan.bn_batch, getattr(torch, dt), plan.iters,
                               plan.trials, bw)  # fmt: skip
        for part in ("forward", "backward"):
            case = f"bn+relu {part} {dt}"
            t = next(r for r in out if r["case"] == case and r["impl"] == "torch")
            m = next(r for r in out if r["case"] == case and r["impl"] == "mpsnn")
            rows.append(make_row(
                "bn", f"bn+relu {part} {shape} {dt}", m["ms"], t["ms"], dt,
                floor_bytes=m["bytes"], copy_gbps=bw / 1e9,
                mpsnn_floor_fraction=m["floor_fraction"],
                pytorch_floor_fraction=t["floor_fraction"],
                max_rel_error=m["max_rel_error"],
            ))  # fmt: skip
    return rows


def adam_rows(device: str, plan: Plan, cache: dict[str, float]) -> list[dict[str, Any]]:
    from benchmarks.bench_optim import bench_adam

    bw = _bandwidth(device, plan, cache)
    shapes = None if plan.adam_shapes is None else list(plan.adam_shapes)
    out = bench_adam(device, plan.iters, plan.trials, bw, shapes)
    timed = {r["impl"]: r for r in out if "ms" in r}
    mine = timed["mpsnn adam_update"]
    what = mine["case"].removeprefix("Adam step, ")
    rows = []
    for impl in ("torch Adam fused", "torch Adam foreach"):
        if impl in timed:
            rows.append(make_row(
                "adam", f"adam update, {what}, vs {impl.removeprefix('torch Adam ')}",
                mine["ms"], timed[impl]["ms"], "float32", floor_bytes=mine["bytes"],
                copy_gbps=bw / 1e9, mpsnn_floor_fraction=mine["floor_fraction"],
            ))  # fmt: skip
    return rows


def replay_row(model: str, device: str, batch: int, steps: int, trials: int) -> dict[str, Any]:
    """The model's replayed (CUDA graph; on the CPU, compiled) training step against PyTorch
    eager, with each side's peak memory (CUDA)."""
    from benchmarks.bench_graph import CASES
    from mpsnn.cli.bench import measure

    case = {**CASES[model], "batch": batch}
    out = measure(device=device, steps=steps, trials=trials, compile_modes=(),
                  variants=("mpsnn-replay", "torch-eager"), **case)  # fmt: skip
    mine = next(r for r in out["rows"] if r["variant"].startswith("mpsnn graph"))
    theirs = next(r for r in out["rows"] if r["variant"] == "pytorch eager")
    kind = mine["variant"].removeprefix("mpsnn graph, ")
    name = f"{model} b{batch} {case['dtype']} {case['optimizer']} step {kind}"
    peaks = {"mpsnn_peak_mib": mine["peak_mib"], "pytorch_peak_mib": theirs["peak_mib"]}
    return make_row(model, name, mine["ms"], theirs["ms"], case["dtype"], **peaks)


def pairs_row(
    group: str, name: str, times: dict[str, list[float]], dtype: str, **extra: Any
) -> dict[str, Any]:
    """A row of alternating pairs of runs (``times``: each side's ms per pair): the median of
    each side's times, and as the ratio the median over the pairs of mpsnn's time over
    PyTorch's in the pair."""
    mine, theirs = times["mpsnn_ms"], times["torch_ms"]
    row = make_row(group, name, statistics.median(mine), statistics.median(theirs), dtype, **extra)
    row["ratio"] = statistics.median(m / t for m, t in zip(mine, theirs, strict=True))
    return row


def eager_row(
    group: str, model: str, device: str, batch: int, pairs: int, steps: int
) -> dict[str, Any]:
    """The model's eager step against PyTorch eager in alternating pairs of runs; the ratio is
    the median over the pairs of mpsnn's time over PyTorch's in the pair. On CUDA both sides
    are bound by the host's Python and launch speed, which differs from process to process
    (the median ratio moved by 26% between three runs on one H200), so such a row carries
    a tolerance of its own (`EAGER_CUDA_TOLERANCE`)."""
    from benchmarks.bench_eager_pairs import CASES, measure

    _, dtype, opt, _, _ = CASES[model]
    r = measure(model, device, pairs, steps, batch)
    extra = {"tolerance": EAGER_CUDA_TOLERANCE} if device.startswith("cuda") else {}
    return pairs_row(group, f"{model} b{batch} {dtype} {opt} step eager", r, dtype,
                     pairs=pairs, steps=steps, **extra)  # fmt: skip


def graph_rows(model: str) -> Callable[[str, Plan, dict[str, float]], list[dict[str, Any]]]:
    def rows(device: str, plan: Plan, cache: dict[str, float]) -> list[dict[str, Any]]:
        out = []
        if model in plan.pairs:
            out.append(eager_row(model, model, device, *plan.pairs[model]))
        if model in plan.replays:
            out.append(replay_row(model, device, *plan.replays[model]))
        return out

    return rows


def main_job_rows(device: str, plan: Plan, cache: dict[str, float]) -> list[dict[str, Any]]:
    """``mpsnn train``'s step as the command runs it (`benchmarks.bench_cpu_step`: its own
    trainer, Fashion-MNIST read and standardized, which sets the host allocator's state: on a
    process that read no data, fresh pages made mpsnn's step 10-20% slower), when the data is
    installed; else the same network on synthetic images (`eager_row`)."""
    batch, pairs, steps = plan.pairs["cnn"]
    from benchmarks.bench_cpu_step import measure
    from mpsnn.cli.common import UserError

    try:
        r = measure(pairs, steps, batch)
    except (FileNotFoundError, UserError) as exc:
        if "Fashion-MNIST" not in str(exc):
            raise
        return [eager_row("main", "cnn", device, batch, pairs, steps)]  # no data here
    return [pairs_row("main", f"cnn b{batch} float32 adam step eager", r, "float32",
                      pairs=pairs, steps=steps, data="fashion-mnist")]  # fmt: skip


GroupFn = Callable[[str, Plan, dict[str, float]], list[dict[str, Any]]]
GROUPS: dict[str, GroupFn] = {
    "conv": conv_rows,
    "bn": bn_rows,
    "adam": adam_rows,
    "lenet": graph_rows("lenet"),
    "resnet18": graph_rows("resnet18"),
    "main": main_job_rows,
}
DEFAULT_GROUPS = {
    "cuda": ("conv", "bn", "adam", "lenet", "resnet18"),
    "cpu": ("conv", "bn", "adam", "main"),
}


def run_groups(
    device: str, plan: Plan, groups: list[str], log: Callable[[str], None] = print
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Each group's rows, and the groups that raised (name -> the error's last line)."""
    rows: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    cache: dict[str, float] = {}
    start = time.perf_counter()
    for g in groups:
        try:
            got = GROUPS[g](device, plan, cache)
            bad = [r["name"] for r in got if not 0 < r["ratio"] < float("inf")]
            if bad:
                raise ValueError(f"[suite] a ratio must be finite and > 0, got one for {bad}")
        except Exception as e:  # a failed group is reported; the others still run
            traceback.print_exc()
            errors[g] = f"{type(e).__name__}: {e}"
            log(f"[{time.perf_counter() - start:5.0f} s] {g}: FAILED ({errors[g]})")
            continue
        rows += got
        log(f"[{time.perf_counter() - start:5.0f} s] {g}: {len(got)} rows")
    return rows, errors


# -- the run's identity ----------------------------------------------------------------------


def device_name(device: str) -> str:
    """The device's name: the GPU's, or ``cpu <model>, <threads> threads``."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    model = platform.processor() or platform.machine()
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = next(ln.split(":", 1)[1].strip() for ln in text.splitlines()
                     if ln.startswith("model name"))  # fmt: skip
    except (OSError, StopIteration):
        pass
    return f"cpu {model}, {torch.get_num_threads()} threads"


def slug(name: str) -> str:
    """A file name for a device name: lower case, runs of other characters as one ``-``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


def git_commit() -> str | None:
    """HEAD's short hash, ``-dirty`` when tracked files differ from it; None outside git."""

    def git(*args: str) -> str:
        return subprocess.run(["git", "--no-optional-locks", "-C", str(REPO), *args],
                              capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()  # fmt: skip

    try:
        head = git("rev-parse", "--short=12", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def environment(device: str) -> dict[str, Any]:
    """The metadata every row and the file carry."""
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    name = device_name(device)
    return {"device": name, "slug": slug(name), "torch": torch.__version__,
            "triton": triton_version,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": git_commit()}  # fmt: skip


# -- the command -----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.suite",
                                description=__doc__.splitlines()[0])  # fmt: skip
    add = p.add_argument
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--quick", action="store_true", help="tiny sizes, few trials: a smoke run")
    add("--only", default=None, help=f"comma-separated groups of {', '.join(GROUPS)}")
    add("--json", type=Path, help="this run's results [default: <results-dir>/<slug>.last.json]")
    add("--results-dir", default=RESULTS_DIR, type=Path, help="where the baselines are")
    add("--check", action="store_true", help="exit 1 when a row regressed")
    add(
        "--update",
        action="store_true",
        help="make this run the baseline (<results-dir>/<slug>.json)",
    )
    add("--tolerance", type=float, default=TOLERANCE, help="allowed growth [default: 0.05]")
    add("--no-confirm", action="store_true", help="do not measure regressed groups again")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run, compare, write; returns the exit status: 0, 1 (``--check`` and a row regressed)
    or 2 (a group failed to run)."""
    p = _parser()
    a = p.parse_args(argv)
    kind = "cuda" if a.device.startswith("cuda") else "cpu"
    groups = a.only.split(",") if a.only else list(DEFAULT_GROUPS[kind])
    unknown = [g for g in groups if g not in GROUPS]
    if unknown:
        p.error(f"--only must name groups of {', '.join(GROUPS)}, got {', '.join(unknown)}")
    plan = plan_for(a.device, a.quick)
    env = environment(a.device)
    started = time.perf_counter()
    print(f"# {env['device']} | torch {env['torch']} | triton {env['triton']} | commit "
          f"{env['commit']} | {'quick' if a.quick else 'standard'} sizes", flush=True)  # fmt: skip
    rows, errors = run_groups(a.device, plan, groups)
    base_file = baseline_path(a.results_dir, env["slug"], a.quick)
    baseline = load(base_file)
    old_all = baseline["rows"] if baseline else []
    old = [r for r in old_all if r["group"] in groups]  # --only: compare the groups run
    comparison = compare_rows(rows, old, a.tolerance)
    flagged = sorted({c["group"] for c in comparison if c["status"] == "regressed"})
    if flagged and not a.no_confirm:
        print(f"# measuring {', '.join(flagged)} again: a row regressed")
        again, more = run_groups(a.device, plan, flagged)
        errors.update(more)
        rows = keep_better(rows, again)
        comparison = compare_rows(rows, old, a.tolerance)
    meta = {k: env[k] for k in ("device", "torch", "triton", "date", "commit")}
    rows = [{**r, **meta} for r in rows]
    doc = {"schema": SCHEMA, **env, "quick": a.quick, "groups": groups,
           "tolerance": a.tolerance, "seconds": time.perf_counter() - started,
           "errors": errors, "rows": rows}  # fmt: skip
    validate(doc)
    out = a.json or base_file.with_suffix(".last.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    notes = [f"# results: {out}", *baseline_notes(base_file, baseline, env, a.tolerance)]
    if a.update and errors:
        notes.append(f"# baseline NOT updated: {', '.join(errors)} failed")
    elif a.update:
        updated = {**doc, "rows": merged_baseline(rows, old_all, groups)}
        validate(updated)
        base_file.parent.mkdir(parents=True, exist_ok=True)
        base_file.write_text(json.dumps(updated, indent=1) + "\n")
        notes.append(f"# baseline updated: {base_file}")
    notes += [f"# {g} FAILED: {e}" for g, e in errors.items()]
    regressed = [c for c in comparison if c["status"] == "regressed"]
    notes.append(f"# {len(regressed)} of {len(rows)} rows regressed; "
                 f"{time.perf_counter() - started:.0f} s")  # fmt: skip
    print("\n".join(notes))
    print(table(comparison))
    if errors:
        return 2
    return 1 if a.check and regressed else 0


if __name__ == "__main__":
    sys.exit(main())
