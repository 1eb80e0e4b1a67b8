"""The metrics log of ``mpsnn train`` (``--logger``): per-epoch and per-step records, as JSON
lines (the default), CSV, or TensorBoard scalars.

Records (both frameworks of ``--compare-torch``, told apart by ``framework``):

* ``kind: "epoch"``, after each epoch: ``epoch``, ``lr`` (the rate of its first step),
  ``train_loss``, ``train_accuracy``, ``test_accuracy``, ``train_seconds``,
  ``images_per_second``, ``wall_seconds``.
* ``kind: "step"``, every ``--log-every`` steps: ``epoch``, ``step`` (1-based, in the epoch),
  ``steps`` (per epoch), ``global_step``, ``lr`` (the rate of that step), ``loss`` and
  ``accuracy`` (means over the steps since the previous step record of the epoch),
  ``images_per_second`` and ``seconds`` (since the epoch began).

JSON lines: one object per record. CSV: one file, a header row of `CSV_COLUMNS` (written
when the file is empty) and one row per record, empty cells where a kind has no value.
TensorBoard: the scalars ``<framework>/<name>`` of each epoch record at step ``epoch``, and
``<framework>/step/<name>`` of each step record at its ``global_step``.

An epoch's records are written together when it ends, after its checkpoint: the log holds
the epochs the checkpoint holds, and a resumed run appends to it.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from mpsnn.cli.common import UserError
from mpsnn.cli.runs import writing

__all__ = ["CSV_COLUMNS", "LOGGERS", "MetricsLog", "default_log_path", "open_log"]

LOGGERS = ("jsonl", "csv", "tensorboard")

#: the columns of a CSV log: the union of both kinds' fields
CSV_COLUMNS = (
    "kind", "framework", "epoch", "step", "steps", "global_step", "lr", "loss", "accuracy",
    "train_loss", "train_accuracy", "test_accuracy", "train_seconds", "images_per_second",
    "seconds", "wall_seconds",
)  # fmt: skip

_DEFAULT_NAMES = {"jsonl": "metrics.jsonl", "csv": "metrics.csv", "tensorboard": "tensorboard"}
_EVENTS = "events.out.tfevents."


def default_log_path(logger: str, metrics: Path | None, folder: Path | None) -> Path | None:
    """Where a logger writes: ``--metrics`` (a file; tensorboard: a directory), else its
    default name in the checkpoint directory (``metrics.jsonl``, ``metrics.csv``,
    ``tensorboard/``), else nowhere."""
    if metrics is not None:
        return metrics
    return None if folder is None else folder / _DEFAULT_NAMES[logger]


class MetricsLog:
    """The metrics log; this base writes nothing (no ``--metrics`` and no
    ``--checkpoint-dir``). The step records of an epoch are held until its epoch record, and
    written with it: after the epoch's checkpoint, so that the log holds the epochs the
    checkpoint holds (a run stopped during an epoch leaves none of its records, and its
    resumed run writes them once)."""

    path: Path | None = None

    def __init__(self) -> None:
        self._steps: list[tuple[str, dict[str, Any]]] = []

    def step(self, framework: str, record: dict[str, Any]) -> None:
        """One step record (written with the epoch's record)."""
        self._steps.append((framework, record))

    def epoch(self, framework: str, record: dict[str, Any]) -> None:
        """The epoch's step records of ``framework``, then its epoch record."""
        mine = [r for f, r in self._steps if f == framework]
        self._steps = [(f, r) for f, r in self._steps if f != framework]
        for r in mine:
            self._write("step", framework, r)
        self._write("epoch", framework, record)

    def _write(self, kind: str, framework: str, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        """Flush and release what the log holds."""


class _JsonLines(MetricsLog):
    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def _write(self, kind: str, framework: str, record: dict[str, Any]) -> None:
        with writing("the metrics log", self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(json.dumps({"kind": kind, "framework": framework, **record}) + "\n")


class _Csv(_JsonLines):
    def _write(self, kind: str, framework: str, record: dict[str, Any]) -> None:
        with writing("the metrics log", self.path):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", newline="") as f:
                out = csv.DictWriter(f, CSV_COLUMNS, restval="", extrasaction="ignore")
                if f.tell() == 0:
                    out.writeheader()
                out.writerow({"kind": kind, "framework": framework, **record})


class _TensorBoard(MetricsLog):
    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self._writer: Any = None

    def _write(self, kind: str, framework: str, record: dict[str, Any]) -> None:
        with writing("the TensorBoard log", self.path):
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(log_dir=str(self.path))
            w = self._writer
            if kind == "step":
                for name in ("lr", "loss", "accuracy", "images_per_second"):
                    w.add_scalar(f"{framework}/step/{name}", record[name], record["global_step"])
                return
            for name, value in record.items():
                if name != "epoch" and isinstance(value, int | float):
                    w.add_scalar(f"{framework}/{name}", value, record["epoch"])
            w.flush()

    def close(self) -> None:
        if self._writer is not None:
            with writing("the TensorBoard log", self.path):
                self._writer.close()
            self._writer = None


def _tensorboard_available() -> bool:
    if importlib.util.find_spec("tensorboard") is None:
        return False
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def _event_files(folder: Path) -> list[Path]:
    try:
        return sorted(p for p in folder.iterdir() if p.name.startswith(_EVENTS))
    except OSError:
        return []


def open_log(
    logger: str,
    path: Path | None,
    *,
    fresh: bool,
    overwrite: bool = False,
    asked: bool = False,
) -> MetricsLog:
    """The log ``logger`` writes to ``path`` (None: a log that writes nothing, refused where
    ``asked``: ``--logger`` given), checked before any training work: TensorBoard needs the
    ``tensorboard`` package and a directory it can write; a fresh run refuses a directory
    holding another run's event files unless ``overwrite``, which removes them (the
    JSON-lines and CSV files are the metrics log `mpsnn.cli.runs` checks and prepares)."""
    if logger not in LOGGERS:
        raise UserError(f"--logger must be one of {', '.join(LOGGERS)}, got {logger!r}")
    if logger == "tensorboard" and not _tensorboard_available():
        raise UserError(
            "--logger tensorboard needs the tensorboard package (pip install tensorboard), "
            "got none installed"
        )
    if path is None:
        if asked:
            raise UserError(
                f"--logger {logger} writes to --metrics or into --checkpoint-dir, got neither"
            )
        return MetricsLog()
    if logger == "jsonl":
        return _JsonLines(path)
    if logger == "csv":
        return _Csv(path)
    from mpsnn.cli.runs import _check_directory

    _check_directory(path, "--metrics")
    old = _event_files(path)
    if fresh and old:
        if not overwrite:
            raise UserError(
                f"a fresh run must not write over another run's files, got TensorBoard event "
                f"files in {path}; continue that run with --resume, or remove them with "
                f"--overwrite"
            )
        for p in old:
            try:
                os.unlink(p)
            except OSError as exc:
                raise UserError(f"--overwrite could not remove {p}: {exc.strerror}") from None
    return _TensorBoard(path)
