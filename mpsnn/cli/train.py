"""``mpsnn train``: train a model built with the graph API on a dataset, with a live progress
bar, a per-epoch table, a JSON metrics log, checkpoints, exact resume and a plot; on one
process, or data-parallel on several (``--nproc N``, or ``torchrun -m mpsnn train``: see
``docs/distributed.md``)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import click

from mpsnn.cli.common import DTYPES, MODELS, OPTIMIZERS, OneLineCommand, UserError

__all__ = ["train"]


@click.command(cls=OneLineCommand)
@click.option(
    "--model",
    type=click.Choice(list(MODELS)),
    default="cnn",
    show_default=True,
    help="cnn: small CNN; lenet: LeNet-5; apple-mnist: the network of Apple's MPS "
    "training sample; resnet18: CIFAR-style ResNet-18.",
)
@click.option(
    "--dataset",
    type=click.Choice(["fashion-mnist", "synthetic"]),
    default="fashion-mnist",
    show_default=True,
)
@click.option("--epochs", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--optimizer",
    type=click.Choice(list(OPTIMIZERS)),
    default="adam",
    show_default=True,
    help="One optimizer for every layer (SGD: momentum 0.9).",
)
@click.option(
    "--lr",
    type=float,
    default=None,
    help="Learning rate [default: adam 1e-3, sgd 0.05, rmsprop 1e-3].",
)
@click.option(
    "--lr-decay",
    type=click.FloatRange(min=0, min_open=True),
    default=0.6,
    show_default=True,
    help="Per-epoch factor of the learning rate.",
)
@click.option(
    "--dtype",
    type=click.Choice(list(DTYPES)),
    default="float32",
    show_default=True,
    help="Storage of the graph's intermediates (weights stay float32).",
)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="auto (CUDA when available; with --resume, the device the run was on), cpu, cuda or "
    "cuda:N.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--limit",
    type=click.IntRange(min=1),
    default=None,
    help="Train on the first N training images.",
)
@click.option(
    "--test-limit",
    type=click.IntRange(min=1),
    default=None,
    help="Evaluate on the first N test images.",
)
@click.option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write checkpoint.mpsnn (after every epoch) and metrics.jsonl here.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the run in --checkpoint-dir exactly where its checkpoint ended.",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Draw training loss and test accuracy per epoch into this PNG.",
)
@click.option(
    "--metrics",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="JSON-lines metrics log [default: <checkpoint-dir>/metrics.jsonl].",
)
@click.option("--no-compile", is_flag=True, help="Encode every step eagerly (no CUDA graph).")
@click.option(
    "--compare-torch",
    is_flag=True,
    help="Then train the same model in plain PyTorch with the same data and schedule.",
)
@click.option(
    "--target",
    type=float,
    default=0.91,
    show_default=True,
    help="Test accuracy whose wall time to reach is reported.",
)
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Data-parallel ranks on this machine (one GPU each with CUDA, else CPU processes); "
    "--batch-size stays the global batch.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=300.0,
    show_default=True,
    help="Data parallel: seconds after which a dead or hung rank ends every rank.",
)
@click.option(
    "--check-every",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Data parallel: compare the ranks' weights every N steps (0: never).",
)
@click.option(
    "--local-batch-norm",
    is_flag=True,
    help="Data parallel: normalize each rank's shard with its own batch-norm statistics (as "
    "PyTorch DDP does) instead of the global batch's; faster, no longer one process's weights.",
)
def train(**opts: Any) -> None:  # fmt: skip
    """Train a model on a dataset with an mpsnn training graph."""
    from mpsnn.cli import distributed_train as dt

    if not dt.in_launched_rank():
        if opts["nproc"] > 1:  # the parent of --nproc: start the ranks and watch them
            raise SystemExit(dt.launch_ranks(click.get_current_context(), opts))
        _train(opts, None)
        return
    run = dt.join_run(opts)
    dt.run_rank(run, lambda: _train(opts, run))


def _train(opts: dict[str, Any], run: Any) -> None:
    """The run of one process, or of one rank (``run``: its `DistributedRun`)."""
    from mpsnn.cli.trainer import METRICS, TrainConfig, Trainer, append_metrics

    folder: Path | None = opts["checkpoint_dir"]
    main = run is None or run.is_main  # prints, writes metrics, plots and checkpoints
    check = {"check_every": opts["check_every"],
             "sync_batch_norm": not opts.get("local_batch_norm", False)}  # fmt: skip
    if opts["resume"]:
        if folder is None:
            raise UserError("--resume needs --checkpoint-dir (where the checkpoint is)")
        trainer = Trainer.resume(folder, run, check, epochs=opts["epochs"],
                                 device=opts["device"])  # fmt: skip
    else:
        fields = {f.name for f in dataclasses.fields(TrainConfig)}
        config = TrainConfig(**{k: v for k, v in opts.items() if k in fields})
        config.compile = not opts["no_compile"]
        trainer = Trainer(config, None, run, check)
    metrics = opts["metrics"] or (folder / METRICS if folder is not None else None)
    if not main:
        while trainer.epoch < trainer.config.epochs:
            trainer.train_epoch()
        return
    ui = _Display(trainer)
    ui.header()
    start = time.perf_counter()
    reached = None
    while trainer.epoch < trainer.config.epochs:
        record = ui.epoch(trainer)
        record["wall_seconds"] = time.perf_counter() - start
        if reached is None and record["test_accuracy"] >= opts["target"]:
            reached = record["wall_seconds"]
        if folder is not None:
            trainer.save_checkpoint(folder)
        if metrics is not None:
            append_metrics(metrics, {"framework": "mpsnn", **record})
    ui.table(trainer.history)
    final = trainer.history[-1]["test_accuracy"]
    summary = {"mpsnn": (final, time.perf_counter() - start, reached)}
    if opts["compare_torch"]:
        from mpsnn.cli.torch_baseline import train_torch

        history = train_torch(trainer, ui)
        summary["pytorch"] = (history[-1]["test_accuracy"], history[-1]["wall_seconds"],
                              next((r["wall_seconds"] for r in history
                                    if r["test_accuracy"] >= opts["target"]), None))  # fmt: skip
        if metrics is not None:
            for record in history:
                append_metrics(metrics, {"framework": "pytorch", **record})
    ui.summary(summary, opts["target"])
    if opts["plot"] is not None:
        _plot(trainer.history, opts["plot"], trainer.config.model)
        ui.console.print(f"plot written to {opts['plot']}")


class _Display:
    """The rich progress bar and tables (plain lines when the output is not a terminal)."""

    def __init__(self, trainer: Any) -> None:
        from rich.console import Console

        self.console = Console()
        self.trainer = trainer

    def header(self) -> None:
        t, c = self.trainer, self.trainer.config
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
        self.console.print(
            f"mpsnn train: [bold]{c.model}[/] ({params:,} parameters) on {c.dataset} "
            f"({len(t.train_x):,} train / {len(t.test_x):,} test images), {where}, "
            f"{c.dtype}, batch {c.batch_size}, {c.optimizer} lr {t.learning_rate(1):g} "
            f"(x{c.lr_decay:g}/epoch), steps {mode}"
            + (f", resumed after epoch {t.epoch}" if t.epoch else "")
        )

    def epoch(self, trainer: Any, name: str = "mpsnn") -> dict[str, Any]:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        epoch, total = trainer.epoch + 1, trainer.config.epochs
        columns = (
            TextColumn(f"{name} epoch {epoch}/{total}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.4f} acc {task.fields[acc]:.3f} "
                       "{task.fields[rate]:,.0f} img/s"),
            TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
        )  # fmt: skip
        t0 = time.perf_counter()
        b = trainer.config.batch_size
        with Progress(*columns, console=self.console, transient=True) as bar:
            task = bar.add_task("train", total=None, loss=0.0, acc=0.0, rate=0.0)

            def progress(step: int, steps: int, loss: float, acc: float) -> None:
                rate = step * b / (time.perf_counter() - t0)
                bar.update(task, completed=step, total=steps, loss=loss, acc=acc, rate=rate)

            record = trainer.train_epoch(progress)
        self.console.print(
            f"{name} epoch {record['epoch']:>3}  loss {record['train_loss']:.4f}  "
            f"train acc {record['train_accuracy']:.4f}  test acc {record['test_accuracy']:.4f}  "
            f"{record['images_per_second']:,.0f} img/s  {record['train_seconds']:.1f} s"
        )
        return record

    def table(self, history: list[dict[str, Any]], title: str = "mpsnn") -> None:
        from rich.table import Table

        table = Table(title=f"{title}: per epoch")
        for col in ("epoch", "lr", "train loss", "train acc", "test acc", "img/s", "seconds"):
            table.add_column(col, justify="right")
        for r in history:
            table.add_row(
                str(r["epoch"]), f"{r['lr']:.2e}", f"{r['train_loss']:.4f}",
                f"{r['train_accuracy']:.4f}", f"{r['test_accuracy']:.4f}",
                f"{r['images_per_second']:,.0f}", f"{r['train_seconds']:.1f}",
            )  # fmt: skip
        self.console.print(table)

    def summary(self, results: dict[str, tuple[float, float, float | None]], target: float) -> None:
        from rich.table import Table

        table = Table(title="summary")
        for col in ("framework", "final test acc", "wall seconds", f"seconds to {target:.0%}"):
            table.add_column(col, justify="right")
        for name, (acc, wall, reached) in results.items():
            table.add_row(name, f"{acc:.4f}", f"{wall:.1f}",
                          "not reached" if reached is None else f"{reached:.1f}")  # fmt: skip
        self.console.print(table)


def _plot(history: list[dict[str, Any]], path: Path, model: str) -> None:
    """Training loss and test accuracy per epoch, side by side."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib (pip install matplotlib)") from None
    epochs = [r["epoch"] for r in history]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.plot(epochs, [r["train_loss"] for r in history], marker="o")
    left.set(xlabel="epoch", ylabel="training loss", title=f"{model}: training loss")
    right.plot(epochs, [100 * r["test_accuracy"] for r in history], marker="o", color="C2")
    right.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.set_xticks(epochs)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
