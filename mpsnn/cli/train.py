"""``mpsnn train``: train a model built with the graph API on a dataset, with a live progress
bar, a per-epoch table, a JSON metrics log, checkpoints, exact resume and a plot; on one
process, or data-parallel on several (``--nproc N``, or ``torchrun -m mpsnn train``: see
``docs/distributed.md``)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import click

from mpsnn.cli.common import DTYPES, MODELS, OPTIMIZERS, SEED_MAX, OneLineCommand, UserError
from mpsnn.cli.metrics_log import LOGGERS
from mpsnn.cli.runs import DATASETS, given_options
from mpsnn.cli.schedules import SCHEDULES

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
    default="fashion-mnist",
    show_default=True,
    metavar="NAME|PATH",
    help=f"{' or '.join(DATASETS)}, or the path of your own data: an ImageFolder directory "
    "(train/<class>/*.png and test/ or val/) or an .npz file (x_train, y_train, x_test, "
    "y_test); see docs/training.md.",
)
@click.option("--epochs", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=64, show_default=True)
@click.option(
    "--optimizer",
    type=click.Choice(list(OPTIMIZERS)),
    default="adam",
    show_default=True,
    help="One optimizer for every layer (SGD: momentum 0.9, see --momentum).",
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
    help="Factor of the exponential (per epoch) and step schedules.",
)
@click.option(
    "--schedule",
    type=click.Choice(list(SCHEDULES)),
    default="exponential",
    show_default=True,
    help="Learning rate: constant; exponential: lr·decay^(epoch-1); step: times --lr-decay "
    "every --step-epochs epochs; cosine: per step, to 0 at the end of the run.",
)
@click.option(
    "--step-epochs",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="The step schedule's period in epochs.",
)
@click.option(
    "--warmup-epochs",
    type=float,
    default=0.0,
    show_default=True,
    help="Linear warmup over this many epochs (per step, from lr/warmup-steps to the rate).",
)
@click.option(
    "--momentum",
    type=float,
    default=None,
    help="SGD's momentum [default: 0.9] (Adam and RMSProp have none in MPS).",
)
@click.option(
    "--weight-decay",
    type=float,
    default=0.0,
    show_default=True,
    help="L2 regularization of the optimizer: the gradient gains weight-decay·w.",
)
@click.option(
    "--clip-grad",
    type=float,
    default=None,
    help="Clamp every gradient value to [-C, C] before the update [default: off].",
)
@click.option(
    "--label-smoothing",
    type=float,
    default=0.0,
    show_default=True,
    help="Label smoothing of the cross-entropy loss, in [0, 1).",
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
@click.option("--seed", type=click.IntRange(0, SEED_MAX), default=0, show_default=True)
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
    help="Continue the run in --checkpoint-dir exactly where its checkpoint ended, with its "
    "saved options (--epochs: train to that many; --device, --no-compile: run on there, so); "
    "with no checkpoint there, start a fresh run.",
)
@click.option(
    "--overwrite",
    is_flag=True,
    help="Start a fresh run even where --checkpoint-dir holds another run's checkpoint or the "
    "metrics log holds records: remove them first.",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Draw the training loss and the train and test accuracy per epoch (and the PyTorch "
    "twin's with --compare-torch) into this PNG.",
)
@click.option(
    "--metrics",
    type=click.Path(path_type=Path),
    default=None,
    help="The metrics log: a file (jsonl, csv) or a directory (tensorboard) [default: "
    "<checkpoint-dir>/metrics.jsonl, metrics.csv or tensorboard/].",
)
@click.option(
    "--logger",
    type=click.Choice(list(LOGGERS)),
    default="jsonl",
    show_default=True,
    help="Format of the metrics log: JSON lines, CSV, or TensorBoard scalars.",
)
@click.option(
    "--log-every",
    type=click.IntRange(min=1),
    default=None,
    help="Steps between two progress lines (output not a terminal) and step records "
    "[default: a tenth of an epoch].",
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

    ctx = click.get_current_context()
    given = given_options(ctx)
    if not dt.in_launched_rank():
        if opts["nproc"] > 1:  # the parent of --nproc: start the ranks and watch them
            # the ranks' command line holds the options given here, not the defaults: a rank
            # tells them apart by their source (a default on its command line is "given")
            for name in set(ctx.params) - given:
                ctx.params[name] = None
            raise SystemExit(dt.launch_ranks(ctx, opts))
        _train(opts, None, given)
        return
    run = dt.join_run(opts)
    dt.run_rank(run, lambda: _train(opts, run, given))


def _train(opts: dict[str, Any], run: Any, given: Collection[str] = ()) -> None:
    """The run of one process, or of one rank (``run``: its `DistributedRun`); ``given``:
    the options the user gave (see `mpsnn.cli.runs`). User mistakes are found before any
    training work where they can be: the numbers, then the files."""
    from mpsnn.cli.metrics_log import MetricsLog, default_log_path, open_log
    from mpsnn.cli.progress import Display
    from mpsnn.cli.runs import CHECKPOINT, check_outputs, check_schedule, prepare_fresh_run
    from mpsnn.cli.schedules import check_training_options
    from mpsnn.cli.trainer import TrainConfig, Trainer

    folder: Path | None = opts["checkpoint_dir"]
    main = run is None or run.is_main  # prints, writes metrics, plots and checkpoints
    check = {"check_every": opts["check_every"],
             "sync_batch_norm": not opts.get("local_batch_norm", False)}  # fmt: skip
    logger = opts.get("logger") or "jsonl"
    log_path = default_log_path(logger, opts["metrics"], folder)
    metrics = None if logger == "tensorboard" else log_path  # the metrics log file
    resume = opts["resume"]
    if resume and opts.get("overwrite"):
        raise UserError("--overwrite starts a fresh run: not with --resume (drop one of them)")
    if resume and folder is None:
        raise UserError("--resume needs --checkpoint-dir (where the checkpoint is)")
    fallback = resume and folder is not None and not os.path.lexists(folder / CHECKPOINT)
    if fallback:
        resume = False
    if not resume:
        check_schedule(opts["lr"], opts["optimizer"], opts["lr_decay"], opts["epochs"],
                       opts["schedule"], opts["step_epochs"])  # fmt: skip
        check_training_options(opts, given)
    log = MetricsLog()
    if main:
        check_outputs(folder, metrics, opts["plot"])
        log = open_log(logger, log_path, fresh=not resume, overwrite=bool(opts.get("overwrite")),
                       asked="logger" in given)  # fmt: skip
    if resume:
        trainer = Trainer.resume(folder, run, check, options=opts, given=given)
    else:
        if main:
            prepare_fresh_run(folder, metrics, bool(opts.get("overwrite")), fallback)
            if fallback:
                click.echo(f"no checkpoint in {folder}: starting a fresh run")
        fields = {f.name for f in dataclasses.fields(TrainConfig)}
        config = TrainConfig(**{k: v for k, v in opts.items() if k in fields})
        config.compile = not opts["no_compile"]
        trainer = Trainer(config, None, run, check)
    if not main:
        while trainer.epoch < trainer.config.epochs:
            trainer.train_epoch()
        return
    ui = Display(log, opts.get("log_every"))
    ui.header(trainer)
    start = time.perf_counter()
    reached = None
    while trainer.epoch < trainer.config.epochs:
        record = ui.epoch(trainer)
        record["wall_seconds"] = time.perf_counter() - start
        if reached is None and record["test_accuracy"] >= opts["target"]:
            reached = record["wall_seconds"]
        if folder is not None:
            trainer.save_checkpoint(folder)
        log.epoch("mpsnn", record)
    ui.table(trainer.history)
    final = trainer.history[-1]["test_accuracy"]
    summary = {"mpsnn": (final, time.perf_counter() - start, reached)}
    runs = {"mpsnn": trainer.history}
    if opts["compare_torch"]:
        from mpsnn.cli.torch_baseline import train_torch

        history = train_torch(trainer, ui)
        summary["pytorch"] = (history[-1]["test_accuracy"], history[-1]["wall_seconds"],
                              next((r["wall_seconds"] for r in history
                                    if r["test_accuracy"] >= opts["target"]), None))  # fmt: skip
        runs["pytorch"] = history
    log.close()
    ui.summary(summary, opts["target"])
    if opts["plot"] is not None:
        from mpsnn.cli.plots import write_plot

        write_plot(runs, opts["plot"], trainer.config.model)
        ui.print(f"plot written to {opts['plot']}")
