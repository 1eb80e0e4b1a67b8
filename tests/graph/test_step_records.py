"""Twenty training steps of LeNet-5, Apple's MNIST network and ResNet-18 (float32 and bfloat16
storage, eager and compiled) give the recorded losses, weights and logits bit for bit
(`benchmarks/tools/record_steps.py`, which made tests/data/step_records_*.json from the
execution layer these must keep matching: LeNet and Apple's network from the tree before the
graph's plan was rebuilt by passes; ResNet-18 again once its strided convolutions read whole
images, a deliberate change of rounding; the CPU records again once CPU float32 storage became
channels-last — the records' ``meta.notes`` say so). A failure names the workload and what
differs: the first step whose loss differs, then each tensor."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.tools import record_steps as rs

DATA = Path(__file__).resolve().parents[1] / "data"
NAMES = [w.name for w in rs.WORKLOADS]


def _records(device: str) -> dict[str, Any]:
    with open(DATA / f"step_records_{device}.json") as f:
        return json.load(f)


@pytest.fixture
def _recording_settings():
    """The settings the records were made under (`record_steps._prepare`), restored after."""
    saved = (
        torch.get_num_threads(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    yield
    torch.set_num_threads(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1:]


def _check(device: str, name: str) -> None:
    records = _records(device)
    (work,) = [w for w in rs.WORKLOADS if w.name == name]
    rs._prepare(device)
    new = rs.run(work, device)
    diffs = rs.differences(records["records"][name], new)
    assert not diffs, f"{device} {name}: " + "; ".join(diffs)


def _cpu_skip() -> str | None:
    """Bits are comparable only under the PyTorch version and vector instructions the records
    were made with (other kernels round differently), as the CUDA records are per GPU model."""
    meta = _records("cpu")["meta"]
    here = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    unlike = [f"{k} {meta[k]} there, {v} here" for k, v in here.items() if meta[k] != v]
    return "the CPU records were made elsewhere: " + ", ".join(unlike) if unlike else None


def _cuda_skip() -> str | None:
    if not torch.cuda.is_available():
        return "the CUDA records need a GPU"
    path = DATA / "step_records_cuda.json"
    if not path.exists():
        return "no CUDA records"
    recorded = _records("cuda")["meta"]["device_name"]
    if recorded != torch.cuda.get_device_name():  # other GPUs may pick other kernels
        return f"the CUDA records were made on {recorded}"
    return None


@pytest.mark.usefixtures("_recording_settings")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_steps_equal_the_records(device: str, name: str) -> None:
    reason = _cpu_skip() if device == "cpu" else _cuda_skip()
    if reason is not None:
        pytest.skip(reason)
    _check(device, name)


def test_the_records_cover_every_workload_over_twenty_steps() -> None:
    records = _records("cpu")
    assert records["meta"]["steps"] == rs.STEPS == 20
    assert sorted(records["records"]) == sorted(NAMES)
    for name, rec in records["records"].items():
        assert len(rec["losses"]) == 20, name
        assert len(set(rec["losses"])) == 20, f"{name}: the loss did not change every step"
        assert all(len(h) == 64 for h in rec["weights"].values()), name


def test_a_changed_record_is_reported() -> None:
    """The comparison sees one changed bit of one step's loss, and a changed tensor."""
    reference = _records("cpu")["records"]["lenet/float32/eager"]
    assert rs.differences(reference, copy.deepcopy(reference)) == []
    changed = copy.deepcopy(reference)
    loss = changed["losses"][6]
    changed["losses"][6] = loss[:-1] + format(int(loss[-1], 16) ^ 1, "x")
    key = sorted(changed["weights"])[3]
    changed["weights"][key] = "0" * 64
    diffs = rs.differences(reference, changed)
    assert len(diffs) == 2
    assert diffs[0].startswith("loss differs first at step 7")
    assert diffs[1] == f"weights {key} differ"
    changed = copy.deepcopy(reference)
    changed["logits"]["sha256"] = "0" * 64
    assert rs.differences(reference, changed) == ["last step's logits differ"]
