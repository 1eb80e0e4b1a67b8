"""What ``mpsnn train`` prints: a header, per-epoch progress, one line per epoch, a per-epoch
table and a summary, for a terminal or for a pipe.

In a terminal (stdout a TTY) the progress is rich's live bar, and the tables are rich tables.
Anywhere else (a pipe, a file, a job scheduler's log) every line is plain text written as is
(never wrapped, no box-drawing characters, no control sequences): a progress line every
``--log-every`` steps (``mpsnn epoch 2/5 step 300/937 loss 0.4123 acc 0.861 lr 6.00e-04
1,234 img/s``: the epoch's running loss and accuracy, the step's rate), and tables in aligned
columns. Either way every ``--log-every`` steps makes a step record for the metrics log
(`mpsnn.cli.metrics_log`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import click

from mpsnn.cli.metrics_log import MetricsLog

__all__ = ["Display", "default_log_every"]

#: progress(step, steps, running mean loss, running accuracy): the trainer's callback
Progress = Callable[[int, int, float, float], None]
#: due(step, steps): whether the trainer calls the progress callback after ``step`` steps
Due = Callable[[int, int], bool]

_BAR_EVERY = 20  # steps between two updates of the live bar


def default_log_every(steps: int) -> int:
    """About ten progress lines and step records per epoch."""
    return max(1, steps // 10)


class Display:
    """The output of one ``mpsnn train`` run.

    Args:
        log: the metrics log that receives the step records.
        log_every: steps between two progress lines and step records (None: about ten per
            epoch, `default_log_every`).
        terminal: whether stdout is a terminal (None: ask rich).
    """

    def __init__(
        self, log: MetricsLog | None = None, log_every: int | None = None,
        terminal: bool | None = None,
    ) -> None:  # fmt: skip
        from rich.console import Console

        self.console = Console()
        self.terminal = self.console.is_terminal if terminal is None else terminal
        self.log = log or MetricsLog()
        self.log_every = log_every

    # -- lines ---------------------------------------------------------------------------

    def print(self, text: str, markup: str | None = None) -> None:
        """One line; ``markup``: the same with rich markup, for a terminal."""
        if self.terminal:
            self.console.print(markup or text, markup=markup is not None, highlight=False)
        else:
            click.echo(text)

    def header(self, trainer: Any) -> None:
        """The model, data, device and training options, on three lines."""
        from mpsnn.cli.schedules import describe_training

        t, c = trainer, trainer.config
        params = sum(p.numel() for p in t.model.twin.parameters())
        mode = "replayed CUDA graph" if t.step is not None and t.device.type == "cuda" else "eager"
        why = None if t.step is None or t.device.type != "cuda" else t.step.eager_reason
        if why is not None:
            mode = f"eager ({why})"
        where = t.device.name
        if t.dist is not None:
            local = not getattr(t.graph.data_parallel, "sync_batch_norm", True)
            where = (f"{t.world} ranks ({t.dist.backend}, {t.device.type}"
                     f"{', local batch norm' if local else ''})")  # fmt: skip
        data = f"{c.dataset} ({len(t.train_x):,} train / {len(t.test_x):,} test images)"
        self.print(
            f"mpsnn train: {c.model} ({params:,} parameters) on {data}",
            f"mpsnn train: [bold]{c.model}[/] ({params:,} parameters) on {data}",
        )
        resumed = f", resumed after epoch {t.epoch}" if t.epoch else ""
        self.print(f"  {where}, {c.dtype}, batch {c.batch_size}, steps {mode}{resumed}")
        self.print(f"  {describe_training(c, t.schedule)}")

    # -- epochs --------------------------------------------------------------------------

    def epoch(self, trainer: Any, name: str = "mpsnn") -> dict[str, Any]:
        """Train ``trainer``'s next epoch, showing its progress."""
        return self.run_epoch(
            name, trainer.epoch + 1, trainer.config.epochs, trainer.config.batch_size,
            trainer.learning_rate, trainer.train_epoch,
        )  # fmt: skip

    def run_epoch(
        self,
        name: str,
        epoch: int,
        epochs: int,
        batch: int,
        rate: Callable[[int, int], float],
        body: Callable[[Progress, Due], dict[str, Any]],
    ) -> dict[str, Any]:
        """Run ``body(progress, due)`` (one epoch of ``batch`` images per step, whose step
        ``s`` (0-based) has the rate ``rate(epoch, s)``), with the progress display and the
        step records; then print the epoch's line."""
        t0 = time.perf_counter()
        last = [0, 0.0, 0.0]  # the previous step record's step, loss sum and hits

        def every(steps: int) -> int:
            return self.log_every or default_log_every(steps)

        def record(step: int, steps: int, loss: float, acc: float) -> float:
            seconds = time.perf_counter() - t0
            images = step * batch / seconds if seconds > 0 else 0.0
            if step % every(steps) == 0:
                n, loss_sum, hits = last
                window = step - n
                self.log.step(name, {
                    "epoch": epoch, "step": step, "steps": steps,
                    "global_step": (epoch - 1) * steps + step, "lr": rate(epoch, step - 1),
                    "loss": (loss * step - loss_sum) / window,
                    "accuracy": (acc * step - hits) / window,
                    "images_per_second": images, "seconds": seconds,
                })  # fmt: skip
                last[:] = [step, loss * step, acc * step]
            return images

        if self.terminal:
            result = self._bar_epoch(name, epoch, epochs, every, record, body)
        else:

            def progress(step: int, steps: int, loss: float, acc: float) -> None:
                images = record(step, steps, loss, acc)
                if step % every(steps) == 0:
                    click.echo(
                        f"{name} epoch {epoch}/{epochs} step {step}/{steps} loss {loss:.4f} "
                        f"acc {acc:.3f} lr {rate(epoch, step - 1):.2e} {images:,.0f} img/s"
                    )

            result = body(progress, lambda step, steps: step % every(steps) == 0)
        self.print(
            f"{name} epoch {result['epoch']:>3}  loss {result['train_loss']:.4f}  "
            f"train acc {result['train_accuracy']:.4f}  test acc {result['test_accuracy']:.4f}  "
            f"{result['images_per_second']:,.0f} img/s  {result['train_seconds']:.1f} s"
        )
        return result

    def _bar_epoch(
        self,
        name: str,
        epoch: int,
        epochs: int,
        every: Callable[[int], int],
        record: Callable[[int, int, float, float], float],
        body: Callable[[Progress, Due], dict[str, Any]],
    ) -> dict[str, Any]:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = (
            TextColumn(f"{name} epoch {epoch}/{epochs}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f} acc {task.fields[acc]:.3f} "
                       "{task.fields[rate]:,.0f} img/s"),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        )  # fmt: skip
        with Progress(*columns, console=self.console, transient=True) as bar:
            task = bar.add_task("train", total=None, loss=0.0, acc=0.0, rate=0.0)

            def progress(step: int, steps: int, loss: float, acc: float) -> None:
                images = record(step, steps, loss, acc)
                bar.update(task, completed=step, total=steps, loss=loss, acc=acc, rate=images)

            def due(step: int, steps: int) -> bool:
                return step % _BAR_EVERY == 0 or step % every(steps) == 0 or step == steps

            return body(progress, due)

    # -- tables --------------------------------------------------------------------------

    def _table(self, title: str, columns: Sequence[str], rows: list[Sequence[str]]) -> None:
        """Right-aligned columns: a rich table in a terminal, plain text elsewhere."""
        if self.terminal:
            from rich.table import Table

            table = Table(title=title)
            for col in columns:
                table.add_column(col, justify="right")
            for row in rows:
                table.add_row(*row)
            self.console.print(table)
            return
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        click.echo(title)
        for row in (columns, *rows):
            click.echo("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))

    def table(self, history: list[dict[str, Any]], title: str = "mpsnn") -> None:
        """The per-epoch table of one framework's run."""
        rows = [
            (str(r["epoch"]), f"{r['lr']:.2e}", f"{r['train_loss']:.4f}",
             f"{r['train_accuracy']:.4f}", f"{r['test_accuracy']:.4f}",
             f"{r['images_per_second']:,.0f}", f"{r['train_seconds']:.1f}")
            for r in history
        ]  # fmt: skip
        self._table(f"{title}: per epoch", ("epoch", "lr", "train loss", "train acc",
                                            "test acc", "img/s", "seconds"), rows)  # fmt: skip

    def summary(self, results: dict[str, tuple[float, float, float | None]], target: float) -> None:
        """Final accuracy, wall time and time to ``target`` of each framework."""
        rows = [
            (name, f"{acc:.4f}", f"{wall:.1f}",
             "not reached" if reached is None else f"{reached:.1f}")
            for name, (acc, wall, reached) in results.items()
        ]  # fmt: skip
        self._table("summary", ("framework", "final test acc", "wall seconds",
                                f"seconds to {target:.0%}"), rows)  # fmt: skip
