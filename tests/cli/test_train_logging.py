"""What ``mpsnn train`` writes: outside a terminal, plain progress lines during each epoch
(never wrapped, no box-drawing characters), step records beside the epoch records in the
metrics log, the CSV and TensorBoard loggers, and a plot of the train and test accuracy and
loss of both frameworks."""

from __future__ import annotations

import csv
import io
import json
import re
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest
from click.testing import CliRunner

import mpsnn.cli.metrics_log as metrics_log
import mpsnn.cli.trainer as trainer_module
from mpsnn.cli import main
from mpsnn.cli.metrics_log import CSV_COLUMNS, MetricsLog
from mpsnn.cli.plots import figure
from mpsnn.cli.progress import Display, default_log_every

# 320 images in batches of 32: 10 steps per epoch
SMALL = ["--dataset", "synthetic", "--model", "lenet", "--limit", "320", "--test-limit", "32",
         "--batch-size", "32", "--device", "cpu"]  # fmt: skip
_BOX = re.compile("[\u2500-\u259f]")  # box drawing and block elements
_PROGRESS = re.compile(
    r"^(mpsnn|pytorch) epoch (\d+)/(\d+) step (\d+)/10 loss \d+\.\d{4} acc \d\.\d{3} "
    r"lr \d\.\d\de[-+]\d\d [\d,]+ img/s$"
)


def _run(*args: str, columns: str | None = None) -> tuple[int, str]:
    """The command with stdout a pipe (not a terminal); no COLUMNS unless given."""
    result = CliRunner(env={"COLUMNS": columns}).invoke(main, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def _one_error(out: str) -> str:
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), out
    return lines[0]


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# -- piped output ----------------------------------------------------------------------------


def test_piped_output_is_plain_lines_with_progress_during_each_epoch(tmp_path: Path) -> None:
    log = tmp_path / "a-directory-with-a-rather-long-name-for-the-paths" / "metrics.jsonl"
    code, out = _run("train", *SMALL, "--epochs", "2", "--compare-torch", "--optimizer", "sgd",
                     "--weight-decay", "0.0001", "--clip-grad", "5", "--label-smoothing", "0.1",
                     "--schedule", "cosine", "--warmup-epochs", "0.5", "--metrics", str(log),
                     "--plot", str(tmp_path / "curves.png"))  # fmt: skip
    assert code == 0, out
    lines = out.splitlines()
    assert not _BOX.search(out) and "\x1b" not in out, out
    assert max(map(len, lines)) <= 120, max(lines, key=len)
    # the header is whole lines (rich would wrap it at 80 columns)
    assert (
        lines[0]
        == "mpsnn train: lenet (61,706 parameters) on synthetic (320 train / 32 test images)"
    )
    assert lines[2] == ("  sgd lr 0.05 cosine to 0, warmup 0.5 epochs; momentum 0.9; weight decay "
                        "0.0001; gradient clip 5; label smoothing 0.1")  # fmt: skip
    for name in ("mpsnn", "pytorch"):
        for epoch in (1, 2):
            steps = [int(m[4]) for m in map(_PROGRESS.match, lines)
                     if m and m[1] == name and m[2] == str(epoch)]  # fmt: skip
            assert steps == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], (name, epoch, out)
            # progress lines come before the epoch's line
            first = next(i for i, x in enumerate(lines) if x.startswith(f"{name} epoch {epoch}/"))
            end = next(i for i, x in enumerate(lines) if x.startswith(f"{name} epoch {epoch:>3}  "))
            assert first < end
    table = lines.index("mpsnn: per epoch")
    assert re.match(r"^epoch +lr +train loss +train acc +test acc +img/s +seconds$",
                    lines[table + 1])  # fmt: skip
    assert re.match(r"^ +1 +\d\.\d\de-\d\d +\d\.\d{4} ", lines[table + 2])
    assert "summary" in lines and lines[-1] == f"plot written to {tmp_path / 'curves.png'}"


def test_log_every_sets_the_progress_lines_and_step_records(tmp_path: Path) -> None:
    log = tmp_path / "m.jsonl"
    code, out = _run("train", *SMALL, "--epochs", "1", "--log-every", "3", "--metrics", str(log))
    assert code == 0, out
    steps = [int(m[4]) for m in map(_PROGRESS.match, out.splitlines()) if m]
    assert steps == [3, 6, 9]
    records = _records(log)
    assert [r["kind"] for r in records] == ["step", "step", "step", "epoch"]
    epoch = records[-1]
    for r, step in zip(records, (3, 6, 9), strict=False):
        assert set(r) == {"kind", "framework", "epoch", "step", "steps", "global_step", "lr",
                          "loss", "accuracy", "images_per_second", "seconds"}  # fmt: skip
        assert (r["framework"], r["epoch"], r["step"], r["steps"], r["global_step"]) == (
            "mpsnn", 1, step, 10, step)  # fmt: skip
        assert r["lr"] == 1e-3 and r["images_per_second"] > 0 and r["seconds"] > 0
    assert set(epoch) == {"kind", "framework", "epoch", "lr", "train_loss", "train_accuracy",
                          "test_accuracy", "train_seconds", "images_per_second",
                          "wall_seconds"}  # fmt: skip


def test_step_records_are_the_means_since_the_previous_record(tmp_path: Path) -> None:
    """With ``--log-every`` dividing the epoch, the step records' window means, weighted by
    their windows, are the epoch's loss and accuracy."""
    log = tmp_path / "m.jsonl"
    code, out = _run("train", *SMALL, "--epochs", "2", "--log-every", "5", "--metrics", str(log),
                     "--optimizer", "sgd")  # fmt: skip
    assert code == 0, out
    records = _records(log)
    for epoch in (1, 2):
        steps = [r for r in records if r["kind"] == "step" and r["epoch"] == epoch]
        (total,) = [r for r in records if r["kind"] == "epoch" and r["epoch"] == epoch]
        assert [r["global_step"] for r in steps] == [10 * epoch - 5, 10 * epoch]
        assert sum(r["loss"] for r in steps) / 2 == pytest.approx(total["train_loss"], rel=1e-9)
        acc = sum(r["accuracy"] for r in steps) / 2
        assert acc == pytest.approx(total["train_accuracy"], rel=1e-9)


def test_a_stopped_run_logs_only_the_epochs_of_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An epoch's step records are written with its epoch record, after its checkpoint: a run
    stopped during epoch 2 logs epoch 1 only, and its resumed run logs what an uninterrupted
    run does (once); a run stopped during epoch 1 leaves no log, so ``--resume`` starts it
    afresh."""
    whole, split = tmp_path / "whole", tmp_path / "split"
    args = [*SMALL, "--epochs", "2", "--log-every", "5"]
    assert _run("train", *args, "--checkpoint-dir", str(whole))[0] == 0
    train_epoch = trainer_module.Trainer.train_epoch

    def stop_in_epoch(epoch: int) -> Any:
        def train(self: Any, progress: Any = None, every: Any = 20) -> Any:
            if self.epoch + 1 == epoch:

                def die(step: int, steps: int, loss: float, acc: float) -> None:
                    progress(step, steps, loss, acc)
                    if step == 5:
                        raise SystemExit(9)

                return train_epoch(self, die, every)
            return train_epoch(self, progress, every)

        return train

    def kinds(folder: Path) -> list[tuple[str, int, int | None]]:
        return [(r["kind"], r["epoch"], r.get("step")) for r in _records(folder / "metrics.jsonl")]

    with monkeypatch.context() as patch:
        patch.setattr(trainer_module.Trainer, "train_epoch", stop_in_epoch(2))
        assert _run("train", *args, "--checkpoint-dir", str(split))[0] == 9
    assert kinds(split) == [("step", 1, 5), ("step", 1, 10), ("epoch", 1, None)]
    code, out = _run("train", "--resume", "--log-every", "5", "--checkpoint-dir", str(split))
    assert code == 0, out
    assert kinds(split) == kinds(whole)
    early = tmp_path / "early"
    with monkeypatch.context() as patch:
        patch.setattr(trainer_module.Trainer, "train_epoch", stop_in_epoch(1))
        assert _run("train", *args, "--checkpoint-dir", str(early))[0] == 9
    assert not (early / "metrics.jsonl").exists()
    code, out = _run("train", *args, "--resume", "--checkpoint-dir", str(early))
    assert code == 0 and "starting a fresh run" in out, out


def test_default_log_every_is_a_tenth_of_an_epoch() -> None:
    assert [default_log_every(n) for n in (937, 100, 9, 1)] == [93, 10, 1, 1]


def test_in_a_terminal_the_bar_stays_and_step_records_are_written() -> None:
    """A terminal gets rich's bar and tables; the step records follow ``--log-every`` there
    too."""
    from rich.console import Console

    class Log(MetricsLog):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def step(self, framework: str, record: dict[str, Any]) -> None:
            self.steps.append(record["step"])

    log = Log()
    ui = Display(log, 4, terminal=True)
    ui.console = Console(file=io.StringIO(), force_terminal=True, width=100)
    due_steps: list[int] = []

    def body(progress: Any, due: Any) -> dict[str, Any]:
        for step in range(1, 11):
            if due(step, 10):
                due_steps.append(step)
                progress(step, 10, 0.5, 0.25)
        return {"epoch": 1, "train_loss": 0.5, "train_accuracy": 0.25, "test_accuracy": 0.3,
                "images_per_second": 100.0, "train_seconds": 1.0, "lr": 0.1}  # fmt: skip

    record = ui.run_epoch("mpsnn", 1, 1, 8, lambda e, s: 0.1, body)
    ui.table([record])
    assert log.steps == [4, 8] and due_steps == [4, 8, 10]
    text = ui.console.file.getvalue()
    assert "mpsnn epoch   1  loss 0.5000" in text and _BOX.search(text)  # a rich table


# -- loggers ---------------------------------------------------------------------------------


def test_csv_logger_writes_the_records_in_one_file_with_a_kind_column(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    code, out = _run("train", *SMALL, "--epochs", "2", "--logger", "csv", "--log-every", "5",
                     "--checkpoint-dir", str(folder))  # fmt: skip
    assert code == 0, out
    assert not (folder / "metrics.jsonl").exists()
    with (folder / "metrics.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == CSV_COLUMNS
    table = [dict(zip(CSV_COLUMNS, row, strict=True)) for row in rows[1:]]
    assert [(r["kind"], r["epoch"], r["step"]) for r in table] == [
        ("step", "1", "5"), ("step", "1", "10"), ("epoch", "1", ""),
        ("step", "2", "5"), ("step", "2", "10"), ("epoch", "2", ""),
    ]  # fmt: skip
    import mpsnn as m

    history = m.load(folder / "checkpoint.mpsnn")["history"]
    epochs = [r for r in table if r["kind"] == "epoch"]
    for row, saved in zip(epochs, history, strict=True):
        for key in ("lr", "train_loss", "train_accuracy", "test_accuracy"):
            assert float(row[key]) == saved[key], key
    # a resumed run appends rows under the same header
    code, out = _run("train", "--resume", "--epochs", "3", "--logger", "csv",
                     "--checkpoint-dir", str(folder))  # fmt: skip
    assert code == 0, out
    with (folder / "metrics.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert sum(row == list(CSV_COLUMNS) for row in rows) == 1
    assert [row[2] for row in rows if row[0] == "epoch"] == ["1", "2", "3"]


def test_every_record_field_is_a_csv_column(tmp_path: Path) -> None:
    log = tmp_path / "m.jsonl"
    code, out = _run("train", *SMALL, "--epochs", "1", "--compare-torch", "--metrics", str(log))
    assert code == 0, out
    assert set().union(*_records(log)) <= set(CSV_COLUMNS)


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("the mistake must be found before the data is loaded")

    monkeypatch.setattr(trainer_module, "load_dataset", refuse)


def test_tensorboard_without_the_package_is_one_error_line(
    tmp_path: Path, no_training: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metrics_log.importlib.util, "find_spec", lambda name: None)
    code, out = _run("train", *SMALL, "--logger", "tensorboard", "--checkpoint-dir",
                     str(tmp_path / "run"))  # fmt: skip
    assert code == 2, out
    assert _one_error(out) == (
        "Error: --logger tensorboard needs the tensorboard package (pip install tensorboard), "
        "got none installed"
    )


def test_a_logger_given_without_a_destination_is_refused(no_training: None) -> None:
    code, out = _run("train", *SMALL, "--logger", "csv")
    assert code == 2, out
    assert (
        _one_error(out)
        == "Error: --logger csv writes to --metrics or into --checkpoint-dir, got neither"
    )


class _Writer:
    """A stand-in for torch.utils.tensorboard.SummaryWriter."""

    made: ClassVar[list[_Writer]] = []

    def __init__(self, log_dir: str) -> None:
        self.log_dir = Path(log_dir)
        self.scalars: list[tuple[str, float, int]] = []
        self.closed = False
        (self.log_dir / f"events.out.tfevents.{len(self.made)}").write_text("")
        self.made.append(self)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars.append((tag, value, step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_tensorboard(monkeypatch: pytest.MonkeyPatch) -> type[_Writer]:
    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = _Writer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    monkeypatch.setattr(metrics_log, "_tensorboard_available", lambda: True)
    _Writer.made = []
    return _Writer


def test_tensorboard_logger_writes_the_scalars(tmp_path: Path, fake_tensorboard: Any) -> None:
    folder = tmp_path / "run"
    code, out = _run("train", *SMALL, "--epochs", "2", "--logger", "tensorboard",
                     "--log-every", "5", "--checkpoint-dir", str(folder))  # fmt: skip
    assert code == 0, out
    (writer,) = fake_tensorboard.made
    assert writer.log_dir == folder / "tensorboard" and writer.closed
    tags = {(tag, step) for tag, _, step in writer.scalars}
    assert {("mpsnn/test_accuracy", 1), ("mpsnn/test_accuracy", 2), ("mpsnn/train_loss", 2),
            ("mpsnn/step/loss", 5), ("mpsnn/step/loss", 20), ("mpsnn/step/lr", 15)} <= tags  # fmt: skip
    # a fresh run refuses the event files of another run, --overwrite removes them
    code, out = _run("train", *SMALL, "--epochs", "1", "--logger", "tensorboard", "--metrics",
                     str(folder / "tensorboard"))  # fmt: skip
    assert code == 2 and "got TensorBoard event files in" in _one_error(out), out
    code, out = _run("train", *SMALL, "--epochs", "1", "--logger", "tensorboard", "--metrics",
                     str(folder / "tensorboard"), "--overwrite")  # fmt: skip
    assert code == 0, out
    assert [p.name for p in (folder / "tensorboard").iterdir()] == ["events.out.tfevents.1"]


# -- the plot --------------------------------------------------------------------------------


def _history(shift: float) -> list[dict[str, Any]]:
    return [{"epoch": e, "train_loss": 1 / e + shift, "train_accuracy": 0.5 + e / 10 + shift,
             "test_accuracy": 0.4 + e / 10 + shift} for e in (1, 2, 3)]  # fmt: skip


def test_the_plot_shows_train_and_test_accuracy_and_loss_of_both_frameworks() -> None:
    import matplotlib.pyplot as plt

    runs = {"mpsnn": _history(0.0), "pytorch": _history(0.01)}
    fig = figure(runs, "lenet")
    try:
        lines = {ln.get_label(): ln for ax in fig.axes for ln in ax.get_lines()}
        assert set(lines) == {f"{n} {c}" for n in runs for c in
                              ("train loss", "train accuracy", "test accuracy")}  # fmt: skip
        for name, history in runs.items():
            acc = lines[f"{name} train accuracy"].get_ydata()
            assert list(acc) == pytest.approx([100 * r["train_accuracy"] for r in history])
            test = lines[f"{name} test accuracy"].get_ydata()
            assert list(test) == pytest.approx([100 * r["test_accuracy"] for r in history])
            assert list(lines[f"{name} train loss"].get_xdata()) == [1, 2, 3]
    finally:
        plt.close(fig)


def test_compare_torch_puts_both_runs_on_the_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mpsnn.cli.plots as plots

    drawn: dict[str, Any] = {}
    monkeypatch.setattr(plots, "write_plot", lambda runs, path, model: drawn.update(runs))
    code, out = _run("train", *SMALL, "--epochs", "1", "--compare-torch", "--plot",
                     str(tmp_path / "p.png"))  # fmt: skip
    assert code == 0, out
    assert set(drawn) == {"mpsnn", "pytorch"}
    assert all(len(h) == 1 and "train_accuracy" in h[0] for h in drawn.values())
