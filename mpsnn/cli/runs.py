"""The files of a training run and the rules for them: where ``mpsnn train`` writes (checked
before any training work), when a fresh run may start in a checkpoint directory, what a
resumed run takes from its checkpoint and from the command line, and what a checkpoint must
hold to be resumed.

Rules (``docs/cli.md``):

* A fresh run refuses a checkpoint directory holding a checkpoint, and a metrics log that
  already holds records (``--metrics``, or ``metrics.jsonl`` there), unless ``--overwrite``,
  which removes both (and the temporary files of dead saves) first.
* ``--resume`` continues the saved run: its options are the checkpoint's, ``--epochs`` raises
  the run's length (at least the epochs done), ``--device`` and ``--no-compile`` choose where
  and how it runs on; any other training option given on the command line must equal the
  saved value. Without a checkpoint in the directory, ``--resume`` starts a fresh run (and
  says so), so one command line serves a first start and every restart.
* A checkpoint records its dataset's fingerprint (`mpsnn.data.ImageDataset.fingerprint`: class
  names, image shape and dtype, split sizes, a digest of the content); a resumed run refuses
  data whose fingerprint differs (`check_dataset`). Your own data may move: ``--dataset`` with
  another path is accepted on ``--resume`` where the data there has the saved fingerprint.
* Every user mistake is a `UserError` (one line, exit status 2).
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import click
import torch

from mpsnn.cli.common import DTYPES, MODELS, OPTIMIZERS, SEED_MAX, SGD_MOMENTUM, UserError
from mpsnn.cli.schedules import ADDED_OPTIONS, SCHEDULES

__all__ = [
    "CHECKPOINT",
    "DATASETS",
    "METRICS",
    "check_checkpoint",
    "check_dataset",
    "check_dropout",
    "check_file",
    "check_layers",
    "check_outputs",
    "check_schedule",
    "given_options",
    "prepare_fresh_run",
    "resumed_config",
    "writing",
]

CHECKPOINT = "checkpoint.mpsnn"
METRICS = "metrics.jsonl"
#: the datasets known by name (``--dataset`` also takes a path: your own data)
DATASETS = ("fashion-mnist", "synthetic")

#: the keys of one epoch's record in a checkpoint's history (and the key the printing
#: process adds)
HISTORY_KEYS = frozenset(
    {"epoch", "lr", "train_loss", "train_accuracy", "test_accuracy", "train_seconds",
     "images_per_second"}
)  # fmt: skip
_HISTORY_EXTRA = frozenset({"wall_seconds"})
#: training options a resumed run keeps from its checkpoint (a different value is refused)
FIXED_ON_RESUME = ("model", "dataset", "batch_size", "optimizer", "lr", "lr_decay", "dtype",
                   "seed", "limit", "test_limit", *ADDED_OPTIONS)  # fmt: skip


def given_options(ctx: click.Context) -> set[str]:
    """The parameters the user gave (command line or environment), as opposed to defaults."""
    from click.core import ParameterSource

    defaults = (ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP, None)
    return {p.name for p in ctx.command.params
            if p.name and ctx.get_parameter_source(p.name) not in defaults}  # fmt: skip


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# -- numbers -----------------------------------------------------------------------------------


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def check_schedule(
    lr: float | None,
    optimizer: str,
    decay: float,
    epochs: int,
    schedule: str = "exponential",
    step_epochs: int = 2,
) -> None:
    """``--lr`` and ``--lr-decay`` finite and > 0, and every epoch's rate finite: ``lr ·
    decay^(e-1)`` (exponential) or ``lr · decay^floor((e-1)/step_epochs)`` (step) — a large
    decay overflows after some epochs; the other schedules do not exceed ``lr``."""
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        raise UserError(f"--lr must be a finite number > 0, got {lr}")
    if not (math.isfinite(decay) and decay > 0):
        raise UserError(f"--lr-decay must be a finite number > 0, got {decay}")
    if schedule not in ("exponential", "step"):
        return
    start = OPTIMIZERS.get(optimizer, 1.0) if lr is None else lr
    k = step_epochs if type(step_epochs) is int and step_epochs >= 1 else 1
    power, formula = (epochs - 1, "decay^(epoch-1)") if schedule == "exponential" else (
        (epochs - 1) // k, f"decay^floor((epoch-1)/{k})")  # fmt: skip
    try:
        last = start * decay**power
    except OverflowError:
        last = math.inf
    if not math.isfinite(last):
        raise UserError(
            f"--lr-decay {decay:g} makes the learning rate of epoch {epochs} (lr · "
            f"{formula}) overflow: it must stay finite for every epoch"
        )


# -- output paths ------------------------------------------------------------------------------


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def _check_directory(folder: Path, option: str) -> None:
    """Create ``folder`` and check that a file can be created in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".mpsnn-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(
            f"{option} {folder} must be a directory mpsnn can write to, got: {_reason(exc)}"
        ) from None


def check_file(path: Path, option: str) -> None:
    """Create ``path``'s directory and open ``path`` for appending (removed again when the
    check created it)."""
    existed = os.path.lexists(path)
    try:
        if path.is_dir():
            raise IsADirectoryError(21, "Is a directory")
        if path.parent.exists() and not path.parent.is_dir():
            raise NotADirectoryError(20, f"{path.parent} is not a directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        raise UserError(
            f"{option} {path} must be a file mpsnn can write, got: {_reason(exc)}"
        ) from None


def check_outputs(folder: Path | None, metrics: Path | None, plot: Path | None) -> None:
    """Everything a run will write, checked before any training work: the checkpoint
    directory, the metrics log and the plot (writable, a format matplotlib writes), and no two
    of them the same file."""
    if folder is not None:
        _check_directory(folder, "--checkpoint-dir")
    named = [("--metrics", metrics), ("--plot", plot)]
    taken = {(folder / CHECKPOINT).resolve(): "the checkpoint"} if folder is not None else {}
    for option, path in named:
        if path is None:
            continue
        other = taken.get(path.resolve())
        if other is not None:
            raise UserError(f"{option} must name a file of its own, got {path}, {other}")
        taken[path.resolve()] = f"the {option} file"
    if metrics is not None:
        check_file(metrics, "--metrics")
    if plot is not None:
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
        except ImportError:
            raise UserError("--plot needs matplotlib (pip install matplotlib)") from None
        formats = FigureCanvasAgg.get_supported_filetypes()
        suffix = plot.suffix.lower().lstrip(".")
        if suffix and suffix not in formats:
            raise UserError(
                f"--plot must name a file of a format matplotlib writes ({', '.join(formats)}), "
                f"got {plot}"
            )
        check_file(plot, "--plot")


@contextlib.contextmanager
def writing(what: str, path: Path) -> Iterator[None]:
    """Turn a failed write (a full disk, a file removed under the run) into a `UserError`."""
    try:
        yield
    except OSError as exc:
        raise UserError(f"writing {what} {path} failed: {_reason(exc)}") from None


# -- fresh runs --------------------------------------------------------------------------------


def _has_records(path: Path) -> bool:
    try:
        return path.is_file() and path.stat().st_size > 0
    except OSError:
        return False


def prepare_fresh_run(
    folder: Path | None, metrics: Path | None, overwrite: bool, resuming: bool = False
) -> None:
    """Refuse to start a fresh run over another run's files, or (``overwrite``) remove them:
    the checkpoint, the metrics log (a regular file only) and stale temporary files.
    ``resuming``: the fresh run of a ``--resume`` that found no checkpoint."""
    from mpsnn.io import remove_stale_temporary_files

    checkpoint = None if folder is None else folder / CHECKPOINT
    found = [p for p in (checkpoint,) if p is not None and os.path.lexists(p)]
    found += [p for p in (metrics,) if p is not None and _has_records(p)]
    if not found:
        return
    if not overwrite:
        names = " and ".join(str(p) for p in found)
        if resuming:
            raise UserError(
                f"--resume found no checkpoint in {folder}, and a fresh run must not write over "
                f"another run's files, got {names}; remove it, or start a fresh run with "
                "--overwrite instead of --resume"
            )
        raise UserError(
            f"a fresh run must not write over another run's files, got {names}; continue that "
            f"run with --resume, or remove them with --overwrite"
        )
    for path in found:
        try:
            path.unlink()
        except OSError as exc:
            raise UserError(f"--overwrite could not remove {path}: {_reason(exc)}") from None
    if checkpoint is not None:
        remove_stale_temporary_files(checkpoint)


# -- resumed runs ------------------------------------------------------------------------------


def resumed_config(
    saved: dict[str, Any], done: int, options: dict[str, Any], given: Collection[str], path: Path
) -> dict[str, Any]:
    """The configuration of a resumed run: the saved one, with ``--epochs`` (at least the
    ``done`` epochs) and ``--no-compile`` when given; any other training option given must
    equal the saved value (the learning rate compared as the rate the run uses)."""
    config = {**ADDED_OPTIONS, **saved}  # older checkpoints: what their runs used
    differ = []
    for name in FIXED_ON_RESUME:
        if name not in given:
            continue
        want, have = options[name], config[name]
        if name == "lr":
            want = OPTIMIZERS[saved["optimizer"]] if want is None else want
            have = OPTIMIZERS[saved["optimizer"]] if have is None else have
        if name == "dataset" and want not in DATASETS and have not in DATASETS:
            # your own data, perhaps moved: check_dataset compares what is there
            config["dataset"] = str(Path(want).expanduser().resolve())
            continue
        if name == "momentum" and saved["optimizer"] == "sgd":
            want = SGD_MOMENTUM if want is None else want
            have = SGD_MOMENTUM if have is None else have
        if want != have:
            differ.append(f"{_flag(name)} {options[name]} (saved: {have})")
    if differ:
        raise UserError(
            f"--resume continues the run saved in {path} with its own options, got "
            f"{', '.join(differ)}; drop them, or start a fresh run with --overwrite"
        )
    if "epochs" in given:
        if options["epochs"] < done:
            raise UserError(
                f"--epochs must be at least the {done} epochs the checkpoint {path} has trained, "
                f"got {options['epochs']}"
            )
        config["epochs"] = options["epochs"]
    if "no_compile" in given:
        config["compile"] = not options["no_compile"]
    return config


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def _choice(names: Collection[str]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, str) and v in names


def _int_from(low: int, high: int | None = None) -> Callable[[Any], bool]:
    return lambda v: type(v) is int and v >= low and (high is None or v <= high)


def _positive(v: Any) -> bool:
    return _is_number(v) and math.isfinite(v) and v > 0


#: each saved option: (what it must be, the check)
_CONFIG: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "model": (f"one of {', '.join(MODELS)}", _choice(MODELS)),
    "dataset": (f"one of {', '.join(DATASETS)} or a path",
                lambda v: isinstance(v, str) and v != ""),
    "epochs": ("an int >= 1", _int_from(1)),
    "batch_size": ("an int >= 1", _int_from(1)),
    "optimizer": (f"one of {', '.join(OPTIMIZERS)}", _choice(OPTIMIZERS)),
    "lr": ("null or a finite number > 0", lambda v: v is None or _positive(v)),
    "lr_decay": ("a finite number > 0", _positive),
    "dtype": (f"one of {', '.join(DTYPES)}", _choice(DTYPES)),
    "device": ("a string", lambda v: isinstance(v, str)),
    "seed": (f"an int from 0 to {SEED_MAX}", _int_from(0, SEED_MAX)),
    "limit": ("null or an int >= 1", lambda v: v is None or _int_from(1)(v)),
    "test_limit": ("null or an int >= 1", lambda v: v is None or _int_from(1)(v)),
    "compile": ("a boolean", lambda v: type(v) is bool),
    "schedule": (f"one of {', '.join(SCHEDULES)}", _choice(SCHEDULES)),
    "step_epochs": ("an int >= 1", _int_from(1)),
    "warmup_epochs": ("a finite number >= 0", lambda v: _positive(v) or v == 0),
    "momentum": ("null or a number in [0, 1)",
                 lambda v: v is None or (_is_number(v) and 0 <= v < 1)),
    "weight_decay": ("a finite number >= 0", lambda v: _positive(v) or v == 0),
    "clip_grad": ("null or a finite number > 0", lambda v: v is None or _positive(v)),
    "label_smoothing": ("a number in [0, 1)", lambda v: _is_number(v) and 0 <= v < 1),
}  # fmt: skip
_KEYS = {"kind", "config", "epoch", "history", "data_sources", "dropout"}
# the resolved device, the dataset's fingerprint and the input standardization (absent in
# checkpoints of older versions)
_OPTIONAL_KEYS = {"dataset", "device", "inputs"}
#: a dataset fingerprint's fields and their checks
_FINGERPRINT: dict[str, Callable[[Any], bool]] = {
    "source": lambda v: isinstance(v, str),
    "kind": lambda v: isinstance(v, str),
    "class_names": lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
    "shape": lambda v: isinstance(v, list) and len(v) == 3 and all(type(n) is int for n in v),
    "dtype": lambda v: isinstance(v, str),
    "train": lambda v: type(v) is int,
    "test": lambda v: type(v) is int,
    "sha256": lambda v: isinstance(v, str),
}


def check_checkpoint(ckpt: Any, path: Path, fields: Collection[str]) -> None:
    """The structure and types of a loaded ``mpsnn train`` checkpoint (its data sources and
    dropout counters are checked against the model when it is built). ``fields``: the
    options of `TrainConfig`, which ``config`` must hold exactly."""

    def bad(what: str) -> UserError:
        return UserError(f"{path} is not a usable checkpoint: {what}")

    if not isinstance(ckpt, dict) or ckpt.get("kind") != "mpsnn-train":
        raise UserError(f"{path} must be a checkpoint written by mpsnn train, got another file")
    keys = set(ckpt)
    if not _KEYS <= keys <= _KEYS | _OPTIONAL_KEYS:
        raise bad(
            f"it must hold the keys {sorted(_KEYS)} (and optionally 'dataset', 'device', "
            f"'inputs'), got {sorted(keys)}"
        )
    config = ckpt["config"]
    required = set(fields) - set(ADDED_OPTIONS)  # a checkpoint from before these lacks them
    if not isinstance(config, dict) or not required <= set(config) <= set(fields):
        have = sorted(config) if isinstance(config, dict) else type(config).__name__
        raise bad(
            f"its config must hold the options {sorted(required)} (and may hold "
            f"{sorted(set(fields) & set(ADDED_OPTIONS))}), got {have}"
        )
    for name, (what, ok) in _CONFIG.items():
        if name in config and not ok(config[name]):
            raise bad(f"its config's {name} must be {what}, got {_show(config[name])}")
    if "device" in ckpt and not isinstance(ckpt["device"], str):
        raise bad(f"its device must be a string, got {_show(ckpt['device'])}")
    record = ckpt.get("dataset")
    if "dataset" in ckpt and not (
        isinstance(record, dict)
        and set(record) == set(_FINGERPRINT)
        and all(ok(record[k]) for k, ok in _FINGERPRINT.items())
    ):
        raise bad(
            f"its dataset must be the fingerprint of the data it trained on (the fields "
            f"{sorted(_FINGERPRINT)}), got {_show(record)}"
        )
    inputs = ckpt.get("inputs")
    if "inputs" in ckpt and not (
        isinstance(inputs, dict)
        and set(inputs) == {"mean", "std"}
        and all(_is_number(v) and math.isfinite(v) for v in inputs.values())
        and inputs["std"] > 0
    ):
        raise bad(
            f"its inputs must be the input standardization {{'mean': a finite number, 'std': a "
            f"finite number > 0}}, got {_show(inputs)}"
        )
    epoch, epochs = ckpt["epoch"], config["epochs"]
    if type(epoch) is not int or not 1 <= epoch <= epochs:
        raise bad(
            f"its epoch must be an int from 1 to the run's {epochs} epochs, got {_show(epoch)}"
        )
    history = ckpt["history"]
    if not isinstance(history, list) or len(history) != epoch:
        have = f"{len(history)} records" if isinstance(history, list) else _show(history)
        raise bad(f"its history must be a list of one record per epoch done ({epoch}), got {have}")
    for i, record in enumerate(history):
        if (
            not isinstance(record, dict)
            or not HISTORY_KEYS <= set(record) <= HISTORY_KEYS | _HISTORY_EXTRA
            or record["epoch"] != i + 1
            or type(record["epoch"]) is not int
            or not all(_is_number(v) for v in record.values())
        ):
            raise bad(
                f"its history's record {i} must hold the numbers {sorted(HISTORY_KEYS)} of "
                f"epoch {i + 1}, got {_show(record)}"
            )
    if not isinstance(ckpt["data_sources"], list):
        raise bad(f"its data_sources must be a list, got {type(ckpt['data_sources']).__name__}")
    dropout = ckpt["dropout"]
    if not isinstance(dropout, list) or not all(isinstance(t, torch.Tensor) for t in dropout):
        raise bad(f"its dropout must be a list of tensors, got {_show(dropout)}")


_TENSORS = ("weights", "bias_terms", "gamma", "beta", "mean", "variance")
_VALUES = ("descriptor", "number_of_feature_channels", "number_of_groups")


def _describe(ds: Any) -> tuple[Any, ...]:
    """What a data source must share with the model's layer: its type, configuration, the
    shapes and dtypes of its tensors, and its optimizer's type."""
    out: list[Any] = [type(ds).__name__]
    for name in _VALUES:
        if hasattr(ds, name):
            v = getattr(ds, name)
            out.append((name, v() if callable(v) else v))
    for name in _TENSORS:
        method = getattr(ds, name, None)
        if method is not None:
            t = method()
            out.append((name, None if t is None else (tuple(t.shape), t.dtype)))
    optimizer = getattr(ds, "optimizer", None)
    out.append(("optimizer", type(optimizer).__name__))
    return tuple(out)


def check_layers(saved: Any, own: list[Any], model: str, path: Path) -> None:
    """The checkpoint's data sources against the model's own, layer by layer."""
    if len(saved) != len(own):
        raise UserError(
            f"{path} is not a usable checkpoint: it must hold the {len(own)} layers of --model "
            f"{model}, got {len(saved)}"
        )
    for i, (s, o) in enumerate(zip(saved, own, strict=True)):
        if _describe(s) != _describe(o):
            raise UserError(
                f"{path} is not a usable checkpoint: its data source {i} must match layer {i} "
                f"of --model {model} ({_describe(o)[0]}, {_short(o)}), got "
                f"{_describe(s)[0]}, {_short(s)}"
            )


def _short(ds: Any) -> str:
    for name in ("weights", "gamma"):
        method = getattr(ds, name, None)
        if method is not None:
            t = method()
            return f"{name} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
    return "no weights"


def check_dataset(
    saved: dict[str, Any] | None, own: dict[str, Any], path: Path, training: bool = True
) -> None:
    """The dataset a resumed run found against the fingerprint its checkpoint recorded
    (`mpsnn.data.ImageDataset.fingerprint`): every field but the source must be equal. A
    checkpoint without one (of an older version) is accepted for the named datasets only.
    ``training``: the check of ``mpsnn train --resume``, whose message also offers a fresh
    run (``--overwrite``); else of a command that only reads the run (export, predict, eval)."""
    fix = ", or start a fresh run (--overwrite)" if training else ""
    if saved is None:
        if own["kind"] in DATASETS:
            return
        raise UserError(
            f"{path} is not a usable checkpoint: it must record the dataset it trained on to "
            f"{'resume on' if training else 'use the data at'} {own['source']}, got none"
        )
    differ = [
        f"{name} {_show(own[name])} (saved: {_show(saved[name])})"
        for name in ("kind", "class_names", "shape", "dtype", "train", "test", "sha256")
        if own[name] != saved[name]
    ]
    if differ:
        raise UserError(
            f"the data at {own['source']} must be the data the run saved in {path} trained on, "
            f"got other data: {', '.join(differ)}; restore that data{fix}"
        )


def check_dropout(saved: list[torch.Tensor], own: list[torch.Tensor], path: Path) -> None:
    """The checkpoint's dropout counters against the graph's own."""
    shapes = [(tuple(t.shape), t.dtype) for t in saved]
    want = [(tuple(t.shape), t.dtype) for t in own]
    if shapes != want:
        raise UserError(
            f"{path} is not a usable checkpoint: its dropout must hold the graph's "
            f"{len(own)} counters {want}, got {shapes}"
        )
