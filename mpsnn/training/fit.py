"""`fit`: train a model on your own data from Python — tensors, NumPy arrays, a
``torch.utils.data.Dataset`` or a ``DataLoader`` — with the steps ``mpsnn train`` runs
(`TrainingLoop`).

Data: images ``(N, C, H, W)`` of the model's ``input_shape`` and integer labels ``(N,)`` from 0
to ``model.classes - 1``. Images go to the model as given: float images as they are, ``uint8``
images as MPS reads UNORM8 (``k / 255``); standardizing them is the caller's choice
(`mpsnn.data.standardize`, or the ``augment`` hook). Tensors and arrays are copied to the
model's device once; a Dataset's or a DataLoader's batches are moved batch by batch.

Order: tensors, arrays and Datasets are visited in the order of `epoch_order` (seeded with
``(seed, epoch)``, the order ``mpsnn train`` uses) or in index order (``shuffle=False``), in
batches of ``batch_size`` with the last partial batch dropped; a DataLoader's own batches are
used as they come (a smaller last batch is trained on with its own batch mean).

Augmentation: ``augment(images) -> images`` is called on each training batch, on the device,
after it is moved there and before the step; it returns a batch of the same shape. (Per-sample
transforms belong in the Dataset.) Evaluation batches are not augmented.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

from mpsnn.core.descriptor import FeatureChannelFormat
from mpsnn.training.loop import TrainingLoop, epoch_order

__all__ = ["History", "fit"]

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class History:
    """The records of a `fit`, one per epoch: ``epoch`` (1-based), ``lr``, ``train_loss`` (the
    mean of the steps' batch-mean losses), ``train_accuracy``, ``test_accuracy`` (None without
    a test set), ``train_seconds``, ``images_per_second``."""

    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.records[i]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.records)

    def column(self, key: str) -> list[Any]:
        """``key``'s value of every epoch."""
        return [r[key] for r in self.records]

    @property
    def train_loss(self) -> list[float]:
        return self.column("train_loss")

    @property
    def train_accuracy(self) -> list[float]:
        return self.column("train_accuracy")

    @property
    def test_accuracy(self) -> list[float | None]:
        return self.column("test_accuracy")


def _fail(message: str) -> ValueError:
    return ValueError(f"[fit] {message}")


def _tensor(v: Any, what: str) -> torch.Tensor:
    if isinstance(v, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(v))
    if isinstance(v, torch.Tensor):
        return v
    raise TypeError(f"[fit] {what} must be a tensor or a NumPy array, got {type(v).__name__}")


class _Data:
    """One split, as batches on the device. Kinds: tensors (whole on the device), a Dataset
    (batched by a DataLoader over an epoch's order), a DataLoader (its own batches)."""

    def __init__(self, data: Any, what: str, model: Any, device: torch.device) -> None:
        self.what = what
        self.shape = tuple(model.input_shape)
        self.classes = model.classes
        self.device = device
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None
        self.dataset: Any = None
        self.loader: DataLoader | None = None
        if isinstance(data, DataLoader):
            self.loader = data
        elif isinstance(data, TorchDataset):
            self.dataset = data
        elif isinstance(data, tuple | list) and len(data) == 2:
            x, y = self._checked(_tensor(data[0], f"{what}'s images"),
                                 _tensor(data[1], f"{what}'s labels"))  # fmt: skip
            self.x, self.y = x.to(device), y.to(device)
        else:
            raise TypeError(
                f"[fit] {what} must be (images, labels) tensors or NumPy arrays, a "
                f"torch.utils.data.Dataset or a DataLoader, got {type(data).__name__}"
            )

    def __len__(self) -> int:
        if self.x is not None:
            return len(self.x)
        if self.dataset is not None:
            return len(self.dataset)
        return len(self.loader.dataset)  # type: ignore[union-attr, arg-type]

    def _checked(self, x: torch.Tensor, y: torch.Tensor) -> Batch:
        """Images ``(n, *input_shape)`` uint8 or float, labels ``(n,)`` integers in range."""
        if x.dim() != 4 or tuple(x.shape[1:]) != self.shape:
            c, h, w = self.shape
            raise _fail(
                f"{self.what}'s images must be (N, C, H, W) = (N, {c}, {h}, {w}) (the model's "
                f"input_shape), got {tuple(x.shape)}"
            )
        if x.dtype != torch.uint8 and not x.dtype.is_floating_point:
            raise _fail(f"{self.what}'s images must be uint8 or floating point, got {x.dtype}")
        if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool:
            raise _fail(f"{self.what}'s labels must be integers, got {y.dtype}")
        if y.dim() != 1 or len(y) != len(x):
            raise _fail(
                f"{self.what}'s labels must be one per image ({len(x)},), got {tuple(y.shape)}"
            )
        if len(y):
            low, high = int(y.min()), int(y.max())
            if low < 0 or high >= self.classes:
                bad = low if low < 0 else high
                raise _fail(
                    f"{self.what}'s labels must be from 0 to {self.classes - 1} (the model's "
                    f"classes), got {bad}"
                )
        return x, y.to(torch.int64)

    def _moved(self, batch: Any) -> Batch:
        if not isinstance(batch, tuple | list) or len(batch) != 2:
            raise TypeError(
                f"[fit] {self.what}'s batches must be (images, labels) pairs, got "
                f"{type(batch).__name__}"
            )
        x, y = self._checked(_tensor(batch[0], f"{self.what}'s images"),
                             _tensor(batch[1], f"{self.what}'s labels"))  # fmt: skip
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def steps(self, batch_size: int) -> int | None:
        if self.loader is not None:
            return len(self.loader) if hasattr(self.loader, "__len__") else None
        return len(self) // batch_size

    def batches(self, order: torch.Tensor | None, batch_size: int) -> Iterator[Batch]:
        """An epoch's training batches (``order``: the permutation, None for index order)."""
        if self.loader is not None:
            for batch in self.loader:
                yield self._moved(batch)
            return
        n = len(self)
        order = torch.arange(n) if order is None else order
        if self.x is not None:
            order = order.to(self.device)
            for i in range(n // batch_size):
                idx = order[i * batch_size : (i + 1) * batch_size]
                yield self.x[idx], self.y[idx]  # type: ignore[index]
            return
        loader = DataLoader(self.dataset, batch_size, sampler=order.tolist(), drop_last=True)
        for batch in loader:
            yield self._moved(batch)

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        if self.x is not None:
            for i in range(0, len(self.x), batch_size):
                yield self.x[i : i + batch_size], self.y[i : i + batch_size]  # type: ignore[index]
            return
        loader = self.loader or DataLoader(self.dataset, batch_size)
        for batch in loader:
            yield self._moved(batch)


def _optimizers(model: Any) -> list[Any]:
    found = {id(ds.optimizer): ds.optimizer for ds in model.data_sources
             if getattr(ds, "optimizer", None) is not None}  # fmt: skip
    if not found:
        raise _fail(
            "the model's layers must hold an optimizer to train, got none: build the model "
            "with one, e.g. SmallCNN(device, mpsnn.Adam(device))"
        )
    return list(found.values())


def _rate(lr: Any, epoch: int) -> float:
    rate = lr(epoch) if callable(lr) else lr
    if (
        isinstance(rate, bool)
        or not isinstance(rate, int | float)
        or not (math.isfinite(rate) and rate > 0)
    ):
        raise _fail(
            f"lr must be a finite number > 0 or a function of the epoch returning one, got "
            f"{rate!r} for epoch {epoch}"
        )
    return float(rate)


def fit(
    model: Any,
    train: Any,
    test: Any = None,
    *,
    epochs: int = 1,
    batch_size: int | None = None,
    lr: float | Callable[[int], float] | None = None,
    augment: Callable[[torch.Tensor], torch.Tensor] | None = None,
    on_epoch: Callable[[dict[str, Any]], None] | None = None,
    progress: Callable[[int, int | None, float, float], None] | None = None,
    seed: int = 0,
    shuffle: bool = True,
    storage: FeatureChannelFormat = FeatureChannelFormat.FLOAT32,
    compiled: bool = True,
    eval_batch_size: int = 1000,
) -> History:
    """Train ``model`` on ``train`` for ``epochs`` epochs, evaluating on ``test`` after each
    (see the module docstring for the data, the order and augmentation).

    Args:
        model: a `mpsnn.models.Model` built with an optimizer (its data sources update with
            it), on the device training runs on.
        train, test: ``(images, labels)`` tensors or NumPy arrays, a
            ``torch.utils.data.Dataset`` of ``(image, label)`` items, or a ``DataLoader``
            yielding ``(images, labels)`` batches. ``test`` may be None.
        epochs: the number of epochs (>= 1).
        batch_size: images per step (default 64); a DataLoader's own by default, and a
            different one is refused.
        lr: the learning rate of every optimizer of the model: a number, or ``lr(epoch)`` for
            epoch 1, 2, ...; None keeps the optimizers' rates.
        augment: ``augment(images) -> images`` on each training batch (on the device).
        on_epoch: called with each epoch's record (see `History`) once it is complete.
        progress: ``progress(step, steps, mean_loss, accuracy)`` every 20 steps and after an
            epoch's last (``steps`` None where a DataLoader has no length).
        seed: the seed of the epochs' orders.
        shuffle: False: index order every epoch.
        storage: the format of the graphs' intermediates (weights keep their dtype).
        compiled: record the step once and replay it (a CUDA graph on GPUs; eager on the CPU).
        eval_batch_size: images per evaluation batch (tensors and Datasets).

    Returns:
        The `History` of the epochs.
    """
    for name, v, low in (("epochs", epochs, 1), ("eval_batch_size", eval_batch_size, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise _fail(f"{name} must be an int >= {low}, got {v!r}")
    if augment is not None and not callable(augment):
        raise TypeError(f"[fit] augment must be callable or None, got {type(augment).__name__}")
    optimizers = _optimizers(model)
    device = model.device.torch_device
    data = _Data(train, "train", model, device)
    held = _Data(test, "test", model, device) if test is not None else None
    if data.loader is not None and data.loader.batch_size is not None:
        if batch_size is not None and batch_size != data.loader.batch_size:
            raise _fail(
                f"batch_size must be the DataLoader's ({data.loader.batch_size}) or None, got "
                f"{batch_size}"
            )
        batch_size = data.loader.batch_size
    batch_size = 64 if batch_size is None else batch_size
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise _fail(f"batch_size must be an int >= 1, got {batch_size!r}")
    if data.loader is None and len(data) < batch_size:
        raise _fail(f"batch_size must be <= the {len(data)} training images, got {batch_size}")
    for epoch in range(1, epochs + 1):  # every rate checked before the first step
        if lr is not None:
            _rate(lr, epoch)
    loop = TrainingLoop(model, batch_size, storage=storage)
    if compiled:
        loop.compile()
    history = History()
    steps = data.steps(batch_size)
    for epoch in range(1, epochs + 1):
        if lr is not None:
            for opt in optimizers:
                opt.learning_rate = _rate(lr, epoch)
        order = epoch_order(seed, epoch, len(data)) if shuffle and data.loader is None else None
        batches = data.batches(order, batch_size)
        if augment is not None:
            batches = _augmented(batches, augment, model.input_shape)

        def report(step: int, sums: Any) -> None:
            progress(step, steps, float(sums.loss) / step, int(sums.correct) / sums.images)

        t0 = time.perf_counter()
        sums = loop.run_epoch(batches, None if progress is None else report, steps=steps)
        if sums.steps == 0:
            raise _fail(f"train must give at least one batch an epoch, got none in epoch {epoch}")
        loss, correct = float(sums.loss), int(sums.correct)  # waits for the epoch's steps
        seconds = time.perf_counter() - t0
        record = {
            "epoch": epoch,
            "lr": float(optimizers[0].learning_rate),
            "train_loss": loss / sums.steps,
            "train_accuracy": correct / sums.images,
            "test_accuracy": None if held is None else _accuracy(loop, held, eval_batch_size),
            "train_seconds": seconds,
            "images_per_second": sums.images / seconds if seconds > 0 else math.inf,
        }
        history.records.append(record)
        if on_epoch is not None:
            on_epoch(record)
    return history


def _augmented(batches: Iterator[Batch], augment: Callable[[torch.Tensor], torch.Tensor],
               shape: tuple[int, ...]) -> Iterator[Batch]:  # fmt: skip
    for x, y in batches:
        out = augment(x)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (len(x), *shape):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise _fail(f"augment must return a batch of shape {(len(x), *shape)}, got {got}")
        yield out, y


def _accuracy(loop: TrainingLoop, held: _Data, batch: int) -> float:
    if held.x is not None:
        return int(loop.count_correct(held.x, held.y, batch)) / max(len(held.x), 1)  # type: ignore[arg-type]
    loop.reload_weights()
    correct = torch.zeros((), device=loop.torch_device, dtype=torch.int64)
    count = 0
    for x, y in held.eval_batches(batch):
        correct += (loop.logits(x).argmax(1) == y).sum()
        count += len(x)
    return int(correct) / max(count, 1)
