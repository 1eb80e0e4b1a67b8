"""``mpsnn train --nproc 2`` end to end on the CPU (Gloo): rank 0 alone prints and writes,
the checkpoint resumes on another number of ranks, and misuse is one line with status 2."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import mpsnn as m
from mpsnn.cli import main
from tests.distributed._helpers import ROOT, env

SMALL = ["--limit", "128", "--test-limit", "100", "--batch-size", "16", "--optimizer", "sgd",
         "--device", "cpu", "--timeout", "60"]  # fmt: skip


def _mpsnn(*args: str, deadline: float = 90) -> subprocess.CompletedProcess[str]:
    """``python -m mpsnn ...`` in a subprocess (the ranks print to its stdout and stderr)."""
    return subprocess.run([sys.executable, "-m", "mpsnn", *args], env=env(COLUMNS="250"),
                          cwd=ROOT, capture_output=True, text=True, timeout=deadline)  # fmt: skip


def _in_process(*args: str) -> tuple[int, str]:
    result = CliRunner(env={"COLUMNS": "200"}).invoke(main, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def _values(folder: Path) -> list[torch.Tensor]:
    ckpt = m.load(folder / "checkpoint.mpsnn")
    out = []
    for ds in ckpt["data_sources"]:
        out += [ds.weights(), ds.bias_terms()]
        for vectors in (ds.optimizer_state or {}).values():
            out += vectors
    return out


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    folder = tmp_path_factory.mktemp("two-ranks")
    done = _mpsnn("train", *SMALL, "--nproc", "2", "--epochs", "2", "--checkpoint-dir",
                  str(folder), "--check-every", "3", "--local-batch-norm")  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return folder, done.stdout


def test_two_ranks_print_once_and_rank_0_writes(two_epochs: tuple[Path, str]) -> None:
    folder, out = two_epochs
    assert out.count("mpsnn train: cnn (421,642 parameters)") == 1, out
    assert "2 ranks (gloo, cpu, local batch norm)" in out and "steps eager" in out
    assert out.count("mpsnn epoch   1  loss") == 1 and out.count("mpsnn epoch   2  loss") == 1
    assert out.count("per epoch") == 1 and out.count("summary") == 1
    records = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [1, 2]
    ckpt = m.load(folder / "checkpoint.mpsnn")
    assert ckpt["epoch"] == 2 and ckpt["config"]["batch_size"] == 16


def test_two_ranks_then_one_continue_the_run(two_epochs: tuple[Path, str], tmp_path: Path) -> None:
    """2 ranks for 2 epochs == 2 ranks for epoch 1, then 1 process resuming for epoch 2 (up
    to float32 rounding: the batch's gradient summed over two halves, or in one piece)."""
    whole, _ = two_epochs
    done = _mpsnn("train", *SMALL, "--nproc", "2", "--epochs", "1", "--checkpoint-dir",
                  str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    first = m.load(tmp_path / "checkpoint.mpsnn")["history"][0]
    reference = m.load(whole / "checkpoint.mpsnn")["history"][0]
    for key in ("train_loss", "train_accuracy", "test_accuracy"):
        assert first[key] == reference[key], key  # the same 2-rank computation, bit for bit
    code, out = _in_process("train", "--resume", "--epochs", "2", "--checkpoint-dir",
                            str(tmp_path), "--device", "cpu")  # fmt: skip
    assert code == 0, out
    assert "resumed after epoch 1" in out
    a, b = _values(whole), _values(tmp_path)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-6)
    last = m.load(tmp_path / "checkpoint.mpsnn")["history"][1]
    assert last["train_loss"] == pytest.approx(
        m.load(whole / "checkpoint.mpsnn")["history"][1]["train_loss"], rel=1e-5
    )


def test_an_indivisible_batch_is_one_line_and_status_2() -> None:
    code, out = _in_process("train", *SMALL[:-2], "--nproc", "3", "--batch-size", "16")
    assert code == 2, out
    assert out.strip() == (
        "Error: --batch-size 16 (the global batch) must be divisible by the 3 ranks: each "
        "rank trains on batch-size / ranks images"
    )


def test_a_rank_launched_by_torchrun_refuses_it_too() -> None:
    extra = {"WORLD_SIZE": "3", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": "1"}  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "mpsnn", "train", *SMALL], env=env(**extra),
                          cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "Error: --batch-size 16 (the global batch) must be divisible by the 3 ranks: each "
        "rank trains on batch-size / ranks images"
    ]
    assert done.stdout == ""


def test_the_launcher_names_a_killed_rank_and_stops_the_others() -> None:
    script = (
        "import os, signal, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c",
         "import sys; from mpsnn.distributed import launch_local; "
         f"sys.exit(launch_local(2, [sys.executable, '-c', {script!r}], grace=1.0))"],
        env=env(), cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "mpsnn: rank 1 was killed by SIGKILL; stopping the other ranks" in done.stderr
    assert time.monotonic() - start < 20


def test_resume_into_an_empty_folder_starts_a_fresh_run_on_two_ranks(tmp_path: Path) -> None:
    """One command line serves a first start and a restart (``torchrun --max-restarts``):
    ``--resume`` where no checkpoint is yet starts fresh, also with ``--nproc``."""
    folder = tmp_path / "new"
    done = _mpsnn("train", *SMALL, "--nproc", "2", "--epochs", "1", "--resume",
                  "--checkpoint-dir", str(folder))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "starting a fresh run" in done.stdout + done.stderr
    assert m.load(folder / "checkpoint.mpsnn")["epoch"] == 1


def test_resume_of_a_malformed_checkpoint_with_nproc_is_one_line(tmp_path: Path) -> None:
    m.save({"kind": "mpsnn-train", "config": {"batch_size": "16"}}, tmp_path / "checkpoint.mpsnn")
    code, out = _in_process("train", *SMALL, "--nproc", "2", "--resume",
                            "--checkpoint-dir", str(tmp_path))  # fmt: skip
    assert code == 2, out
    assert out.startswith("Error: ") and out.count("\n") == 1, out
    assert "is not a usable checkpoint" in out
