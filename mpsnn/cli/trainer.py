"""The training loop behind ``mpsnn train``: data on the device, one graph step per batch,
metrics accumulated on the device, evaluation, checkpoints and exact resume.

One step is one call of the model's training graph — forward, loss, gradients and the
optimizer update, encoded eagerly or (``compile``) replayed as a CUDA graph — run by
`mpsnn.training.TrainingLoop`, the steps `mpsnn.fit` runs too. The loss and the
number of correct predictions are summed on the device (the training graph exports its logits)
and read only when the progress display asks, so steps are not synchronized one by one.

Determinism and resume: the order of epoch ``e`` is a permutation drawn from a generator seeded
with ``(seed, e)``, so it needs no saved state; the weights, the optimizer's moments and time
step, the batch-normalization statistics and the dropout counters are in the checkpoint. A run
resumed from the checkpoint of epoch ``e`` therefore repeats, bit for bit on the CPU, what the
uninterrupted run did after epoch ``e``. Steps per epoch: ``len(train) // batch_size`` (the
last partial batch is dropped: a compiled step has one batch shape).

Data parallelism (a `DistributedRun`, ``docs/distributed.md``): ``batch_size`` stays the global
batch; rank ``r`` of ``W`` trains on images ``[r b/W, (r + 1) b/W)`` of each global batch of
the same permutation, with the loss weight ``1 / b``, and the graph's `DataParallel` hooks sum
the gradients and combine the batch-normalization statistics, so the weights are those of one
process on the whole batch (up to rounding; ``--local-batch-norm``: each rank's own batch
statistics). On GPUs the steps are replayed with their NCCL collectives. Each rank evaluates a
contiguous shard of the test set and the counts are summed; the epoch's loss and accuracy are
summed over the ranks too. The checkpoint holds the global state only: a run resumes on any
number of ranks.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from mpsnn.cli.common import (
    DTYPES,
    SEED_MAX,
    UserError,
    build_model,
    make_optimizer,
    model_class,
    parse_device,
)
from mpsnn.cli.runs import (
    CHECKPOINT,
    DATASETS,
    check_checkpoint,
    check_dataset,
    check_dropout,
    check_layers,
    check_schedule,
    resumed_config,
    writing,
)
from mpsnn.cli.schedules import (
    Schedule,
    check_training_options,
    loss_descriptor,
    optimizer_options,
)
from mpsnn.core.descriptor import FeatureChannelFormat
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.data.dataset import ImageDataset, input_statistics, standardize
from mpsnn.training.loop import TrainingLoop, epoch_order

__all__ = ["Dataset", "TrainConfig", "Trainer", "load_dataset"]


@dataclasses.dataclass
class TrainConfig:
    """Everything that defines a run (saved in its checkpoints)."""

    model: str = "cnn"
    dataset: str = "fashion-mnist"
    epochs: int = 5
    batch_size: int = 64
    optimizer: str = "adam"
    lr: float | None = None
    lr_decay: float = 0.6
    dtype: str = "float32"
    device: str = "auto"
    seed: int = 0
    limit: int | None = None
    test_limit: int | None = None
    compile: bool = True
    # the schedule, update and loss options (`mpsnn.cli.schedules`)
    schedule: str = "exponential"
    step_epochs: int = 2
    warmup_epochs: float = 0.0
    momentum: float | None = None
    weight_decay: float = 0.0
    clip_grad: float | None = None
    label_smoothing: float = 0.0


#: a run's data (`mpsnn.data.ImageDataset`: images, labels, class names)
Dataset = ImageDataset


def load_dataset(name: str, seed: int, model_shape: tuple[int, int, int] | None) -> Dataset:
    """``fashion-mnist`` (the Debian package's idx files), ``synthetic`` (random bytes and
    labels in the model's input shape: for speed runs) or the path of your own data (an
    ImageFolder directory or an ``.npz`` file), by `mpsnn.data.load_dataset`; its errors as
    `UserError`."""
    import re

    from mpsnn.data import load_dataset as load

    try:
        return load(name, seed=seed, shape=model_shape)
    except (ValueError, OSError) as exc:  # missing (with the fix), unreadable, corrupt
        message = re.sub(r"^\[\w+\] ", "", str(exc))
        if name in DATASETS:
            raise UserError(message) from None
        raise UserError(f"--dataset {message}") from None


class Trainer:
    """Builds the device, data, model, graphs and optimizer of a `TrainConfig`, and runs it.

    Args:
        config: the run.
        checkpoint: a loaded checkpoint to resume from (see `save_checkpoint`).
        distributed: this rank of a data-parallel run (None: one process).
        parallel: data parallel: keyword arguments of `mpsnn.DataParallel` (``check_every``,
            ``sync_batch_norm``).
        origin: the checkpoint's path (for messages).
        data: the run's data, already read and checked against ``checkpoint`` by the caller
            (None: read ``config.dataset`` and check it here). For inference only
            (`mpsnn.cli.trained`) it may hold no images: then ``statistics`` must be given.
        statistics: ``(mean, std)`` of the input standardization (None: `input_statistics`
            of the training images, after ``--limit``).
    """

    def __init__(
        self,
        config: TrainConfig,
        checkpoint: dict[str, Any] | None = None,
        distributed: Any = None,
        parallel: dict[str, Any] | None = None,
        origin: Path | None = None,
        *,
        data: Dataset | None = None,
        statistics: tuple[float, float] | None = None,
    ) -> None:
        self.config = c = config
        self.dist = distributed
        self.world = 1 if distributed is None else distributed.world_size
        self.origin = origin or Path(CHECKPOINT)
        if c.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {c.dtype!r}")
        for name in ("epochs", "batch_size"):
            if getattr(c, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(c, name)}")
        if not 0 <= c.seed <= SEED_MAX:
            raise UserError(f"--seed must be from 0 to {SEED_MAX}, got {c.seed}")
        check_schedule(c.lr, c.optimizer, c.lr_decay, c.epochs, c.schedule, c.step_epochs)
        check_training_options(dataclasses.asdict(c))
        if c.batch_size % self.world:
            raise UserError(
                f"--batch-size {c.batch_size} (the global batch) must be divisible by the "
                f"{self.world} ranks: each rank trains on batch-size / ranks images"
            )
        self.device = parse_device(c.device) if distributed is None else distributed.device
        self.torch_device = self.device.torch_device
        native = model_class(c.model).input_shape
        given = data is not None
        if data is None:
            data = load_dataset(c.dataset, c.seed, native)
            self.fingerprint = data.fingerprint()  # of all the data (the limits are options)
            if checkpoint is not None:
                check_dataset(checkpoint.get("dataset"), self.fingerprint, self.origin)
        else:  # checked by the caller; a stand-in without images has the saved fingerprint
            saved = None if checkpoint is None else checkpoint.get("dataset")
            self.fingerprint = saved if saved is not None else data.fingerprint()
        c.dataset = data.source  # your own data: its absolute path
        if c.limit is not None:
            data.train_x, data.train_y = data.train_x[: c.limit], data.train_y[: c.limit]
        if c.test_limit is not None:
            data.test_x, data.test_y = data.test_x[: c.test_limit], data.test_y[: c.test_limit]
        if statistics is None:
            mean, std = input_statistics(data.train_x)
            statistics = (float(mean), float(std))
        #: ``(mean, std)`` of the input standardization (float32 values; saved in checkpoints)
        self.statistics = statistics
        if not given and len(data.train_x) < c.batch_size:
            raise UserError(
                f"--batch-size must be <= the {len(data.train_x)} training images, "
                f"got {c.batch_size}"
            )
        self.data = data
        self.optimizer = make_optimizer(c.optimizer, self.device, c.lr, **optimizer_options(c))
        self.schedule = Schedule.of(c, len(data.train_x) // c.batch_size)
        self.model = build_model(c.model, self.device, self.optimizer, seed=c.seed,
                                 input_shape=data.input_shape, classes=data.classes)  # fmt: skip
        self.epoch = 0  # epochs done
        self.history: list[dict[str, Any]] = []
        if checkpoint is not None:
            self._restore(checkpoint)
        self.unorm8 = getattr(self.model, "input_format", None) is FeatureChannelFormat.UNORM8
        t = self.torch_device
        self.train_x = self._prepare(data.train_x).to(t)
        self.test_x = self._prepare(data.test_x).to(t)
        self.train_y, self.test_y = data.train_y.to(t), data.test_y.to(t)
        loss = loss_descriptor(c.batch_size, c.label_smoothing, data.classes)
        # the steps (mpsnn.fit's): each rank's share of every batch, weighted 1 / batch_size
        self.loop = TrainingLoop(self.model, c.batch_size, loss=loss, storage=DTYPES[c.dtype],
                                 local_batch=c.batch_size // self.world)  # fmt: skip
        self.graph, self.inference = self.loop.graph, self.loop.inference
        if checkpoint is not None:
            counters = self._dropout_counters()
            check_dropout(checkpoint["dropout"], counters, self.origin)
            for counter, saved in zip(counters, checkpoint["dropout"], strict=True):
                counter.copy_(saved)
        self.queue = self.loop.queue
        if distributed is not None:  # before compiling: NCCL steps are recorded with them
            from mpsnn.distributed import DataParallel

            self.graph.data_parallel = DataParallel(**(parallel or {}))
        self.step = self.loop.compile() if c.compile else None

    # -- data ------------------------------------------------------------------------------

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Raw bytes for UNORM8 models (MPS clients feed them so; float images in [0, 1]
        rounded to bytes); else float32 standardized with the training set's mean and
        deviation (`mpsnn.data.standardize`)."""
        if getattr(self.model, "input_format", None) is FeatureChannelFormat.UNORM8:
            return x if x.dtype == torch.uint8 else (x * 255).round().to(torch.uint8)
        return standardize(x, *self.statistics)

    def _batch(self, x: torch.Tensor) -> ImageBatch:
        return ImageBatch(Image.from_tensor(x))

    # -- training ----------------------------------------------------------------------------

    def learning_rate(self, epoch: int, step: int = 0) -> float:
        """The rate of step ``step`` (0-based) of ``epoch`` (1-based): the run's `Schedule`."""
        return self.schedule.rate(epoch, step)

    def order(self, epoch: int) -> torch.Tensor:
        return epoch_order(self.config.seed, epoch, len(self.train_x)).to(self.torch_device)

    def train_epoch(self, progress: Callable[[int, int, float, float], None] | None = None,
                    every: int | Callable[[int, int], bool] = 20) -> dict[str, Any]:  # fmt: skip
        """Train one epoch; ``progress(step, steps, loss, accuracy)`` every ``every`` steps and
        after the last (or after the steps where ``every(step, steps)`` holds). The optimizer
        gets the schedule's rate before each step where it changes."""
        c = self.config
        epoch = self.epoch + 1
        lr = self.learning_rate(epoch)
        self.optimizer.learning_rate = lr  # device memory: replayed steps read it too
        order = self.order(epoch)
        b = c.batch_size
        steps = len(order) // b
        local = b // self.world  # this rank's slice of each global batch
        first = 0 if self.dist is None else self.dist.rank * local
        sums = self.loop.new_sums()
        loss_sum, correct = sums.loss, sums.correct  # the steps add to them in place
        t0 = time.perf_counter()
        per_step = self.schedule.per_step
        for i in range(steps):
            if per_step and i:  # cosine or a warmup: the rate of this step
                self.optimizer.learning_rate = self.learning_rate(epoch, i)
            idx = order[i * b + first : i * b + first + local]
            self.loop.train_step(self.train_x[idx], self.train_y[idx], sums)
            if progress is not None and (every(i + 1, steps) if callable(every)
                                         else (i + 1) % every == 0 or i + 1 == steps):  # fmt: skip
                # this rank's images (a 1/world share of the loss sum): scaled to a mean
                mean = float(loss_sum) * self.world / (i + 1)
                progress(i + 1, steps, mean, int(correct) / ((i + 1) * local))
        if self.dist is not None:  # the whole batch's loss and hits: summed over the ranks
            sums = torch.stack([loss_sum, correct.to(torch.float64)])
            self.dist.all_reduce_sum(sums, "the epoch's loss and accuracy sums")
            loss_sum, correct = sums[0], sums[1].round().to(torch.int64)
        seconds = time.perf_counter() - t0
        self.epoch = epoch
        record = {
            "epoch": epoch,
            "lr": lr,
            "train_loss": float(loss_sum) / steps,
            "train_accuracy": int(correct) / (steps * b),
            "train_seconds": seconds,
            "images_per_second": steps * b / seconds,
        }
        record["test_accuracy"] = self.evaluate()
        self.history.append(record)
        return record

    def evaluate(self, batch: int = 1000) -> float:
        """Test accuracy of the current weights (the inference graph reloads them). Data
        parallel: rank ``r`` evaluates the ``r``-th of ``world`` contiguous shards of the test
        set and the hits are summed over the ranks."""
        n = len(self.test_x)
        rank = 0 if self.dist is None else self.dist.rank
        start, stop = rank * n // self.world, (rank + 1) * n // self.world
        mark = None if self.dist is None else self.dist.monitor.progress
        correct = self.loop.count_correct(self.test_x[start:stop], self.test_y[start:stop],
                                          batch, mark)  # fmt: skip
        if self.dist is not None:
            self.dist.all_reduce_sum(correct, "the test accuracy sum")
        return int(correct) / n

    # -- checkpoints ----------------------------------------------------------------------------

    def _dropout_counters(self) -> list[torch.Tensor]:
        from mpsnn.cnn.dropout import Dropout

        kernels = [k for k in self.graph._plan.kernels.values() if isinstance(k, Dropout)]
        return [k._counter for k in kernels]

    def save_checkpoint(self, folder: Path) -> Path:
        """``folder/checkpoint.mpsnn`` (atomic: a run killed while saving keeps the previous
        one): the config, the epoch, the history, the dataset's fingerprint, the input
        standardization (``inputs``: ``{"mean", "std"}``, floats), the data sources (weights,
        optimizer state, batch-normalization statistics) and the dropout counters."""
        from mpsnn.io import save

        if self.step is not None:
            self.step.wait_until_completed()
        path = folder / CHECKPOINT
        with writing("the checkpoint", path):
            folder.mkdir(parents=True, exist_ok=True)
            save(
                {
                    "kind": "mpsnn-train",
                    "config": dataclasses.asdict(self.config),
                    "device": str(self.device.torch_device),  # resolved ("auto" -> "cuda:0")
                    "epoch": self.epoch,
                    "history": self.history,
                    "dataset": self.fingerprint,
                    "inputs": {"mean": self.statistics[0], "std": self.statistics[1]},
                    "data_sources": self.model.data_sources,
                    "dropout": self._dropout_counters(),
                },
                path,
            )
        return path

    def _restore(self, ckpt: dict[str, Any]) -> None:
        sources = ckpt["data_sources"]
        check_layers(sources, self.model.data_sources, self.config.model, self.origin)
        self.model.layers = [(mod, ds) for (mod, _), ds in zip(self.model.layers, sources,
                                                               strict=True)]  # fmt: skip
        optimizers = {id(ds.optimizer): ds.optimizer for ds in sources if ds.optimizer}
        if len(optimizers) == 1:
            self.optimizer = next(iter(optimizers.values()))
        self.epoch = int(ckpt["epoch"])
        self.history = list(ckpt["history"])

    @classmethod
    def resume(
        cls,
        folder: Path,
        distributed: Any = None,
        parallel: dict[str, Any] | None = None,
        *,
        options: dict[str, Any] | None = None,
        given: Collection[str] = (),
    ) -> Trainer:
        """A trainer continuing the run whose checkpoint is in ``folder``, on one process or
        as a rank of a data-parallel run (any number of ranks). ``options``: the command
        line's values, of which ``given`` names those the user gave (see
        `mpsnn.cli.runs.resumed_config`: ``epochs`` to train further, ``device``,
        ``no_compile``; other training options must equal the saved ones)."""
        from mpsnn.errors import CheckpointError
        from mpsnn.io import load, remove_stale_temporary_files

        path = folder / CHECKPOINT
        if not os.path.lexists(path):
            raise UserError(f"--resume needs a checkpoint at {path}, got no such file")
        remove_stale_temporary_files(path)
        options = options or {}
        requested = options.get("device") if "device" in given else None
        if requested == "auto":  # on resume: the run's own device
            requested = None
        if distributed is not None:
            device = distributed.device
        else:  # the checkpoint's device unless another is asked for: read its config first
            device = parse_device(requested or "cpu")
        try:
            ckpt = load(path, device)
            if distributed is None and requested is None:
                check_checkpoint(ckpt, path, _FIELDS)
                own = _own_device(ckpt)
                if own.type != "cpu":
                    device = own
                    ckpt = load(path, device)
        except CheckpointError as exc:
            raise UserError(f"{path} is not a usable checkpoint: {exc}") from None
        except OSError as exc:
            raise UserError(f"{path} cannot be read: {exc.strerror or exc}") from None
        check_checkpoint(ckpt, path, _FIELDS)
        saved = resumed_config(ckpt["config"], ckpt["epoch"], options, given, path)
        if distributed is None:
            saved["device"] = str(device.torch_device)  # resolved: "auto" may mean another now
        return cls(TrainConfig(**saved), ckpt, distributed, parallel, origin=path)


_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig))


def _own_device(ckpt: dict[str, Any]) -> Any:
    """The device a checkpointed run trained on (the resolved one its checkpoint records, else
    its ``--device``), or, where that device is not here (a CUDA run resumed on a machine
    without that GPU, or a name this mpsnn does not know), what ``auto`` picks."""
    name = ckpt.get("device") or ckpt["config"]["device"] or "auto"
    if name.startswith("cuda"):
        index = name.partition(":")[2] or "0"
        if (not index.isdigit() or not torch.cuda.is_available()
                or int(index) >= torch.cuda.device_count()):  # fmt: skip
            name = "auto"
    try:
        return parse_device(name)
    except UserError:
        return parse_device("auto")
