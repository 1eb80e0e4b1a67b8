"""``mpsnn eval CHECKPOINT``: a trained model's accuracy and loss on a test split.

By default the test split the run evaluated after every epoch (its dataset, its first
``--test-limit`` images), through the same inference graph, batches and input preparation: the
accuracy equals the ``test_accuracy`` the run recorded for the checkpoint's epoch. With
``--dataset``, the run's own data is not read (the checkpoint records the input
standardization): the run's data may have moved there. The loss is the mean softmax
cross-entropy (natural logarithm) of the logits, computed in float64 from them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import click
import torch
import torch.nn.functional as F

from mpsnn.cli.common import OneLineCommand, UserError

__all__ = ["evaluate", "evaluate_run"]


@click.command(cls=OneLineCommand)
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option(
    "--dataset",
    default=None,
    help="The dataset whose test split to evaluate (a name mpsnn train --dataset takes) "
    "[default: the run's].",
)
@click.option(
    "--test-limit",
    type=click.IntRange(min=1),
    default=None,
    help="Evaluate the first N test images [default: the run's --test-limit on its own "
    "dataset, all images of another].",
)
@click.option(
    "--device",
    default=None,
    help="auto, cpu, cuda or cuda:N [default: the device the run trained on, where it is "
    "here; else auto].",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
def evaluate(
    checkpoint: Path,
    dataset: str | None,
    test_limit: int | None,
    device: str | None,
    as_json: bool,
) -> None:
    """Accuracy and loss of a trained model on a test split. CHECKPOINT: a checkpoint.mpsnn
    written by mpsnn train, or the --checkpoint-dir holding it."""
    from mpsnn.cli.trained import open_checkpoint

    run = open_checkpoint(checkpoint, device, read_data=dataset is None)
    result = evaluate_run(run, dataset, test_limit)
    if as_json:
        click.echo(json.dumps(result))
        return
    click.echo(
        f"{result['model']} after epoch {result['epoch']} on the {result['dataset']} test split "
        f"({result['count']:,} images): accuracy {result['accuracy']:.4f} "
        f"({result['correct']:,}/{result['count']:,}), loss {result['loss']:.4f}"
    )


def evaluate_run(run: Any, dataset: str | None = None, limit: int | None = None) -> dict[str, Any]:
    """``{"accuracy", "loss", "correct", "count", "dataset", "model", "epoch",
    "checkpoint"}`` of the `TrainedModel` ``run`` on the test split of ``dataset`` (None: the
    run's own test images), its first ``limit`` images."""
    t = run.trainer
    name = run.config.dataset if dataset is None else dataset
    own = dataset is None or dataset == run.config.dataset
    if own and limit is None:
        limit = run.config.test_limit  # the run's own test images
    if own and run.has_data and limit == run.config.test_limit:
        x, y = t.test_x, t.test_y  # the run's own, prepared: its evaluation exactly
    else:
        x, y = _test_split(run, name, limit)
    if len(x) == 0:
        raise UserError(f"the {name} test split must hold images to evaluate, got none")
    logits = run.logits(x)
    correct = int((logits.argmax(1) == y).sum())
    loss = float(F.cross_entropy(logits.double(), y, reduction="sum")) / len(y)
    return {
        "accuracy": correct / len(y),
        "loss": loss,
        "correct": correct,
        "count": len(y),
        "dataset": str(name),
        "model": run.config.model,
        "epoch": run.epoch,
        "checkpoint": str(run.path),
    }


def _test_split(run: Any, name: str, limit: int | None) -> tuple[torch.Tensor, ...]:
    """The test split of the dataset ``name`` (its first ``limit`` images), prepared as the
    run prepares its images (with its own training set's statistics), checked against the
    model's image shape and classes."""
    from mpsnn.data import load_dataset

    try:
        data = load_dataset(name, seed=run.config.seed, shape=run.input_shape)
    except (ValueError, OSError) as exc:  # missing (with the fix), unreadable, not a dataset
        reason = re.sub(r"^\[\w+\] ", "", str(exc))  # the loader's name: not the user's
        raise UserError(f"--dataset {name}: {reason}") from None
    shape = tuple(data.test_x.shape[1:])
    if shape != run.input_shape:
        raise UserError(
            f"--dataset {name} must hold images of the model's shape "
            f"{'x'.join(map(str, run.input_shape))} (C x H x W), got {'x'.join(map(str, shape))}"
        )
    if data.classes != run.classes:
        raise UserError(
            f"--dataset {name} must have the model's {run.classes} classes, got {data.classes}"
        )
    x, y = data.test_x[:limit], data.test_y[:limit]
    return run.prepare(x), y.to(run.trainer.torch_device)
