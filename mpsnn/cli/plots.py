"""``mpsnn train --plot``: the training curves of a run, per epoch — training loss on the
left, training and test accuracy on the right — for mpsnn and, after ``--compare-torch``, the
PyTorch twin (dashed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mpsnn.cli.common import UserError

__all__ = ["figure", "write_plot"]

_STYLES = {"mpsnn": "-", "pytorch": "--"}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib (pip install matplotlib)") from None
    return plt


def figure(runs: dict[str, list[dict[str, Any]]], model: str) -> Any:
    """A matplotlib figure of ``runs`` (framework -> its per-epoch history): the axes hold
    one line per framework and curve, labelled ``"<framework> <curve>"``."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    epochs: set[int] = set()
    for name, history in runs.items():
        x = [r["epoch"] for r in history]
        epochs.update(x)
        style = _STYLES.get(name, ":")
        left.plot(x, [r["train_loss"] for r in history], style, marker="o", color="C0",
                  label=f"{name} train loss")  # fmt: skip
        right.plot(x, [100 * r["train_accuracy"] for r in history], style, marker="o",
                   color="C1", label=f"{name} train accuracy")  # fmt: skip
        right.plot(x, [100 * r["test_accuracy"] for r in history], style, marker="o",
                   color="C2", label=f"{name} test accuracy")  # fmt: skip
    left.set(xlabel="epoch", ylabel="training loss", title=f"{model}: training loss")
    right.set(xlabel="epoch", ylabel="accuracy (%)", title="train and test accuracy")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.set_xticks(sorted(epochs))
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def write_plot(runs: dict[str, list[dict[str, Any]]], path: Path, model: str) -> None:
    """Draw `figure` into ``path`` (its format from the suffix); a failed write is a
    `UserError`."""
    from mpsnn.cli.runs import writing

    plt = _pyplot()
    fig = figure(runs, model)
    try:
        with writing("the plot", path):
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)
