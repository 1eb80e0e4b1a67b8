"""``mpsnn train --resume`` and fresh runs in a checkpoint directory: a resumed run keeps its
saved options (``--epochs`` raises its length; other options that differ are refused, named),
a fresh run refuses another run's checkpoint and metrics unless ``--overwrite``, and
``--resume`` without a checkpoint starts a fresh run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mpsnn as m
from tests.cli._helpers import run_cli as _run

SMALL = ["--dataset", "synthetic", "--limit", "64", "--test-limit", "32", "--batch-size", "32",
         "--device", "cpu"]  # fmt: skip


def _ckpt(folder: Path) -> dict:
    return m.load(folder / "checkpoint.mpsnn")


def _epochs_logged(folder: Path) -> list[int]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return [r["epoch"] for r in records if r["kind"] == "epoch"]  # not the step records


@pytest.fixture
def interrupted(tmp_path: Path) -> Path:
    """A run of 3 epochs whose checkpoint is that of epoch 1 (as if killed during epoch 2)."""
    folder = tmp_path / "run"
    code, out = _run("train", *SMALL, "--epochs", "1", "--checkpoint-dir", str(folder))
    assert code == 0, out
    ckpt = _ckpt(folder)
    ckpt["config"]["epochs"] = 3
    m.save(ckpt, folder / "checkpoint.mpsnn")
    return folder


def test_resume_alone_trains_to_the_saved_epochs(interrupted: Path) -> None:
    code, out = _run("train", "--resume", "--checkpoint-dir", str(interrupted))
    assert code == 0, out
    assert "resumed after epoch 1" in out and "epoch 3/3 step" in out and "/5 step" not in out
    ckpt = _ckpt(interrupted)
    assert ckpt["epoch"] == 3 and ckpt["config"]["epochs"] == 3  # not the option's default 5
    assert _epochs_logged(interrupted) == [1, 2, 3]


def test_resume_with_epochs_given_trains_to_that_many(interrupted: Path) -> None:
    """``--epochs 5`` given equals the option's default: still given (its parameter source)."""
    code, out = _run("train", "--resume", "--epochs", "5", "--checkpoint-dir", str(interrupted))
    assert code == 0, out
    ckpt = _ckpt(interrupted)
    assert ckpt["epoch"] == 5 and ckpt["config"]["epochs"] == 5


def test_resume_refuses_fewer_epochs_than_done(interrupted: Path) -> None:
    ckpt = _ckpt(interrupted)
    ckpt["epoch"], ckpt["history"] = 2, ckpt["history"] * 2
    ckpt["history"][1] = {**ckpt["history"][1], "epoch": 2}
    m.save(ckpt, interrupted / "checkpoint.mpsnn")
    code, out = _run("train", "--resume", "--epochs", "1", "--checkpoint-dir", str(interrupted))
    assert code == 2, out
    assert out.strip() == (
        f"Error: --epochs must be at least the 2 epochs the checkpoint "
        f"{interrupted / 'checkpoint.mpsnn'} has trained, got 1"
    )


def test_resume_refuses_options_that_differ_from_the_checkpoint(interrupted: Path) -> None:
    before = (interrupted / "checkpoint.mpsnn").read_bytes()
    code, out = _run("train", "--resume", "--checkpoint-dir", str(interrupted), "--model",
                     "lenet", "--lr", "0.1", "--optimizer", "sgd", "--batch-size", "64")  # fmt: skip
    assert code == 2, out
    assert len(out.strip().splitlines()) == 1, out
    assert out.startswith(
        f"Error: --resume continues the run saved in {interrupted / 'checkpoint.mpsnn'} with "
        "its own options, got --model lenet (saved: cnn), --batch-size 64 (saved: 32), "
        "--optimizer sgd (saved: adam), --lr 0.1 (saved: 0.001); drop them, or start a fresh "
        "run with --overwrite"
    ), out
    assert (interrupted / "checkpoint.mpsnn").read_bytes() == before  # untouched


def test_resume_accepts_options_equal_to_the_checkpoint(interrupted: Path) -> None:
    code, out = _run("train", "--resume", "--checkpoint-dir", str(interrupted), *SMALL,
                     "--model", "cnn", "--optimizer", "adam", "--lr", "0.001", "--seed", "0",
                     "--epochs", "2")  # fmt: skip
    assert code == 0, out
    assert _ckpt(interrupted)["epoch"] == 2


def test_a_fresh_run_refuses_another_runs_checkpoint(interrupted: Path) -> None:
    before = (interrupted / "checkpoint.mpsnn").read_bytes()
    code, out = _run("train", *SMALL, "--epochs", "1", "--checkpoint-dir", str(interrupted))
    assert code == 2, out
    assert out.strip() == (
        f"Error: a fresh run must not write over another run's files, got "
        f"{interrupted / 'checkpoint.mpsnn'} and {interrupted / 'metrics.jsonl'}; continue "
        "that run with --resume, or remove them with --overwrite"
    )
    assert (interrupted / "checkpoint.mpsnn").read_bytes() == before
    assert _epochs_logged(interrupted) == [1]


def test_overwrite_removes_the_checkpoint_and_the_metrics_first(interrupted: Path) -> None:
    stale = interrupted / ".checkpoint.mpsnn.999999999.0123456789abcdef.tmp"  # a dead save's
    stale.write_bytes(b"partial")
    code, out = _run("train", *SMALL, "--epochs", "2", "--seed", "7", "--overwrite",
                     "--checkpoint-dir", str(interrupted))  # fmt: skip
    assert code == 0, out
    ckpt = _ckpt(interrupted)
    assert ckpt["epoch"] == 2 and ckpt["config"]["seed"] == 7
    assert _epochs_logged(interrupted) == [1, 2]  # this run's records only
    assert not stale.exists()


def test_overwrite_is_not_for_a_resumed_run(interrupted: Path) -> None:
    code, out = _run("train", "--resume", "--overwrite", "--checkpoint-dir", str(interrupted))
    assert code == 2
    assert out.strip() == (
        "Error: --overwrite starts a fresh run: not with --resume (drop one of them)"
    )


def test_a_fresh_run_refuses_a_metrics_log_with_records(tmp_path: Path) -> None:
    log = tmp_path / "m.jsonl"
    log.write_text('{"epoch": 1}\n')
    code, out = _run("train", *SMALL, "--epochs", "1", "--metrics", str(log))
    assert code == 2 and f"got {log}; continue that run with --resume" in out, out
    code, out = _run("train", *SMALL, "--epochs", "1", "--metrics", str(log), "--overwrite")
    assert code == 0, out
    records = [json.loads(x) for x in log.read_text().splitlines()]
    assert [r["epoch"] for r in records if r["kind"] == "epoch"] == [1]


@pytest.mark.parametrize("exists", [True, False])
def test_resume_without_a_checkpoint_starts_a_fresh_run(tmp_path: Path, exists: bool) -> None:
    """One command line for the first start and every restart (``torchrun --max-restarts``)."""
    folder = tmp_path / "run"
    if exists:
        folder.mkdir()
    line = ["train", "--resume", *SMALL, "--epochs", "2", "--checkpoint-dir", str(folder)]
    code, out = _run(*line)
    assert code == 0, out
    assert out.splitlines()[0] == f"no checkpoint in {folder}: starting a fresh run"
    assert _ckpt(folder)["epoch"] == 2 and _ckpt(folder)["config"]["epochs"] == 2
    code, out = _run(*line)  # the same line again: the run is complete, nothing to train
    assert code == 0, out
    assert "resumed after epoch 2" in out and "no checkpoint" not in out
    assert _epochs_logged(folder) == [1, 2]


def test_resume_without_a_checkpoint_refuses_a_metrics_log_with_records(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1}\n')
    code, out = _run("train", "--resume", *SMALL, "--checkpoint-dir", str(tmp_path))
    assert code == 2, out
    assert out.strip() == (
        f"Error: --resume found no checkpoint in {tmp_path}, and a fresh run must not write "
        f"over another run's files, got {tmp_path / 'metrics.jsonl'}; remove it, or start a "
        "fresh run with --overwrite instead of --resume"
    )


def test_nproc_ranks_resume_with_the_saved_options(tmp_path: Path) -> None:
    """``--nproc 2 --resume`` alone: the ranks get the options given, not the defaults (which
    a rank would take for given options that differ from the checkpoint)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "200"}
    common = ["--checkpoint-dir", str(tmp_path), "--nproc", "2", "--device", "cpu",
              "--timeout", "60"]  # fmt: skip
    for args in ([*SMALL, "--optimizer", "sgd", "--epochs", "1"], ["--resume", "--epochs", "2"]):
        done = subprocess.run([sys.executable, "-m", "mpsnn", "train", *args, *common], cwd=root,
                              env=env, capture_output=True, text=True, timeout=240)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed after epoch 1" in done.stdout
    ckpt = _ckpt(tmp_path)
    assert ckpt["epoch"] == 2 and ckpt["config"]["optimizer"] == "sgd"
    assert ckpt["config"]["batch_size"] == 32 and ckpt["config"]["dataset"] == "synthetic"
