"""The training loop behind ``mpsnn train``: data on the device, one graph step per batch,
metrics accumulated on the device, evaluation, checkpoints and exact resume.

One step is one call of the model's training graph — forward, loss, gradients and the
optimizer update, encoded eagerly or (``compile``) replayed as a CUDA graph. The loss and the
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
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mpsnn.cli.common import (
    DTYPES,
    OPTIMIZERS,
    UserError,
    build_model,
    make_optimizer,
    model_class,
    parse_device,
)
from mpsnn.cnn.loss import LossLabels
from mpsnn.core.descriptor import FeatureChannelFormat
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch

__all__ = ["Dataset", "TrainConfig", "Trainer", "load_dataset"]

CHECKPOINT = "checkpoint.mpsnn"
METRICS = "metrics.jsonl"


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


@dataclasses.dataclass
class Dataset:
    """Images ``(N, C, H, W)`` uint8 (raw) and labels ``(N,)`` int64, train and test."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: int = 10

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])  # type: ignore[return-value]


def load_dataset(name: str, seed: int, model_shape: tuple[int, int, int] | None) -> Dataset:
    """``fashion-mnist`` (the Debian package's idx files) or ``synthetic`` (random bytes and
    labels in the model's input shape: for speed runs)."""
    if name == "fashion-mnist":
        from mpsnn.data import load_fashion_mnist

        try:
            tx, ty = load_fashion_mnist("train")
            vx, vy = load_fashion_mnist("test")
        except FileNotFoundError as exc:
            raise UserError(str(exc).removeprefix("[load_fashion_mnist] ")) from None
        return Dataset(tx, ty, vx, vy)
    if name == "synthetic":
        c, h, w = model_shape or (1, 28, 28)
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, 256, (12_000, c, h, w), generator=g, dtype=torch.uint8)
        y = torch.randint(0, 10, (12_000,), generator=g)
        return Dataset(x[:10_000], y[:10_000], x[10_000:], y[10_000:])
    raise UserError(f"--dataset must be fashion-mnist or synthetic, got {name!r}")


class Trainer:
    """Builds the device, data, model, graphs and optimizer of a `TrainConfig`, and runs it.

    Args:
        config: the run.
        checkpoint: a loaded checkpoint to resume from (see `save_checkpoint`).
        distributed: this rank of a data-parallel run (None: one process).
        parallel: data parallel: keyword arguments of `mpsnn.DataParallel` (``check_every``,
            ``sync_batch_norm``).
    """

    def __init__(
        self,
        config: TrainConfig,
        checkpoint: dict[str, Any] | None = None,
        distributed: Any = None,
        parallel: dict[str, Any] | None = None,
    ) -> None:
        self.config = c = config
        self.dist = distributed
        self.world = 1 if distributed is None else distributed.world_size
        if c.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {c.dtype!r}")
        for name in ("epochs", "batch_size"):
            if getattr(c, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(c, name)}")
        if c.batch_size % self.world:
            raise UserError(
                f"--batch-size {c.batch_size} (the global batch) must be divisible by the "
                f"{self.world} ranks: each rank trains on batch-size / ranks images"
            )
        self.device = parse_device(c.device) if distributed is None else distributed.device
        self.torch_device = self.device.torch_device
        native = model_class(c.model).input_shape
        data = load_dataset(c.dataset, c.seed, native)
        if c.limit is not None:
            data.train_x, data.train_y = data.train_x[: c.limit], data.train_y[: c.limit]
        if c.test_limit is not None:
            data.test_x, data.test_y = data.test_x[: c.test_limit], data.test_y[: c.test_limit]
        if len(data.train_x) < c.batch_size:
            raise UserError(
                f"--batch-size must be <= the {len(data.train_x)} training images, "
                f"got {c.batch_size}"
            )
        self.data = data
        self.optimizer = make_optimizer(c.optimizer, self.device, c.lr)
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
        self.graph = self.model.training_graph(c.batch_size, storage=DTYPES[c.dtype])
        self.inference = self.model.inference_graph(storage=DTYPES[c.dtype])
        if checkpoint is not None:
            for counter, saved in zip(self._dropout_counters(), checkpoint["dropout"], strict=True):
                counter.copy_(saved)
        self.queue = self.device.new_command_queue()
        if distributed is not None:  # before compiling: NCCL steps are recorded with them
            from mpsnn.distributed import DataParallel

            self.graph.data_parallel = DataParallel(**(parallel or {}))
        self.step = self.graph.compile(self.queue) if c.compile else None

    # -- data ------------------------------------------------------------------------------

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        """Raw bytes for UNORM8 models (MPS clients feed them so); else float32 standardized
        with the training set's mean and deviation."""
        if getattr(self.model, "input_format", None) is FeatureChannelFormat.UNORM8:
            return x
        mean, std = self.data.train_x.float().mean() / 255, self.data.train_x.float().std() / 255
        return (x.float() / 255 - mean) / std

    def _batch(self, x: torch.Tensor) -> ImageBatch:
        return ImageBatch(Image.from_tensor(x))

    # -- training ----------------------------------------------------------------------------

    def learning_rate(self, epoch: int) -> float:
        """The rate of ``epoch`` (1-based): ``lr · lr_decay^(epoch - 1)``."""
        start = OPTIMIZERS[self.config.optimizer] if self.config.lr is None else self.config.lr
        return start * self.config.lr_decay ** (epoch - 1)

    def order(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.config.seed * 100_003 + epoch)
        return torch.randperm(len(self.train_x), generator=g).to(self.torch_device)

    def train_epoch(self, progress: Callable[[int, int, float, float], None] | None = None,
                    every: int = 20) -> dict[str, Any]:  # fmt: skip
        """Train one epoch; ``progress(step, steps, loss, accuracy)`` every ``every`` steps."""
        c = self.config
        epoch = self.epoch + 1
        lr = self.learning_rate(epoch)
        self.optimizer.learning_rate = lr  # device memory: replayed steps read it too
        order = self.order(epoch)
        b = c.batch_size
        steps = len(order) // b
        local = b // self.world  # this rank's slice of each global batch
        first = 0 if self.dist is None else self.dist.rank * local
        loss_sum = torch.zeros((), device=self.torch_device, dtype=torch.float64)
        correct = torch.zeros((), device=self.torch_device, dtype=torch.int64)
        t0 = time.perf_counter()
        for i in range(steps):
            idx = order[i * b + first : i * b + first + local]
            y = self.train_y[idx]
            # the classes are known: no scan of the device labels (which would wait)
            labels = LossLabels(self.device, y.view(-1, 1, 1), max_index=self.data.classes - 1)
            images = [self._batch(self.train_x[idx])]
            if self.step is not None:
                self.step(images, [labels])
                labels = self.step.source_states[0][0]
            else:
                cb = self.queue.command_buffer()
                self.graph.encode_batch(cb, images, [labels])
                cb.commit()
                if cb.error is not None:  # a failed collective (distributed) or command
                    raise cb.error
            # on the device, ordered after the step on the queue's stream: no wait here
            loss_sum += labels.loss_image().tensor.sum()
            logits = self.graph.intermediate_images[0].tensor.flatten(1)
            correct += (logits.argmax(1) == y).sum()
            if progress is not None and ((i + 1) % every == 0 or i + 1 == steps):
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
        self.inference.reload_from_data_sources()
        correct = torch.zeros((), device=self.torch_device, dtype=torch.int64)
        n = len(self.test_x)
        rank = 0 if self.dist is None else self.dist.rank
        start, stop = rank * n // self.world, (rank + 1) * n // self.world
        for i in range(start, stop, batch):
            j = min(i + batch, stop)
            cb = self.queue.command_buffer()
            out = self.inference.encode_batch(cb, [self._batch(self.test_x[i:j])])
            cb.commit()
            correct += (out.tensor.flatten(1).argmax(1) == self.test_y[i:j]).sum()
            if self.dist is not None:
                self.dist.monitor.progress()
        if self.dist is not None:
            self.dist.all_reduce_sum(correct, "the test accuracy sum")
        return int(correct) / n

    # -- checkpoints ----------------------------------------------------------------------------

    def _dropout_counters(self) -> list[torch.Tensor]:
        from mpsnn.cnn.dropout import Dropout

        kernels = [k for k in self.graph._kernels.values() if isinstance(k, Dropout)]
        return [k._counter for k in kernels]

    def save_checkpoint(self, folder: Path) -> Path:
        """``folder/checkpoint.mpsnn`` (atomic: a run killed while saving keeps the previous
        one): the config, the epoch, the history, the data sources (weights, optimizer state,
        batch-normalization statistics) and the dropout counters."""
        from mpsnn.io import save

        if self.step is not None:
            self.step.wait_until_completed()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / CHECKPOINT
        save(
            {
                "kind": "mpsnn-train",
                "config": dataclasses.asdict(self.config),
                "device": str(self.device.torch_device),  # resolved ("auto" -> "cuda:0")
                "epoch": self.epoch,
                "history": self.history,
                "data_sources": self.model.data_sources,
                "dropout": self._dropout_counters(),
            },
            path,
        )
        return path

    def _restore(self, ckpt: dict[str, Any]) -> None:
        sources = ckpt["data_sources"]
        if len(sources) != len(self.model.layers):
            raise UserError(
                f"the checkpoint must hold the {len(self.model.layers)} layers of "
                f"--model {self.config.model}, got {len(sources)}"
            )
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
        **overrides: Any,
    ) -> Trainer:
        """A trainer continuing the run whose checkpoint is in ``folder`` (``overrides``:
        settings that may change on resume, e.g. ``epochs`` to train further, ``device``), on
        one process or as a rank of a data-parallel run (any number of ranks)."""
        from mpsnn.errors import CheckpointError
        from mpsnn.io import load

        path = folder / CHECKPOINT
        if not path.is_file():
            raise UserError(f"--resume needs a checkpoint at {path}, got no such file")
        requested = overrides.get("device")
        if requested == "auto":  # (the option's default) on resume: the run's own device
            overrides = {k: v for k, v in overrides.items() if k != "device"}
            requested = None
        if distributed is not None:
            device = distributed.device
        else:  # the checkpoint's device unless another is asked for: read its config first
            device = parse_device(requested or "cpu")
        try:
            ckpt = load(path, device)
            if distributed is None and requested is None:
                own = _own_device(ckpt)
                if own.type != "cpu":
                    device = own
                    ckpt = load(path, device)
        except CheckpointError as exc:
            raise UserError(f"{path} is not a usable checkpoint: {exc}") from None
        if not isinstance(ckpt, dict) or ckpt.get("kind") != "mpsnn-train":
            raise UserError(f"{path} must be a checkpoint written by mpsnn train, got another file")
        saved = dict(ckpt["config"])
        for key, value in overrides.items():
            if value is not None:
                saved[key] = value
        if distributed is None:
            saved["device"] = str(device.torch_device)  # resolved: "auto" may mean another now
        return cls(TrainConfig(**saved), ckpt, distributed, parallel)


def _own_device(ckpt: Any) -> Any:
    """The device a checkpointed run trained on (the resolved one its checkpoint records, else
    its ``--device``), or, where that device is not here (a CUDA run resumed on a machine
    without that GPU), what ``auto`` picks."""
    name = ckpt.get("device") if isinstance(ckpt, dict) else None
    name = name or _config_of(ckpt).get("device") or "auto"
    if name.startswith("cuda"):
        index = int(name.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            name = "auto"
    return parse_device(name)


def _config_of(ckpt: Any) -> dict[str, Any]:
    """The saved training options of a loaded checkpoint ({} for another kind of file, which
    `Trainer.resume` then refuses with its own message)."""
    if isinstance(ckpt, dict) and isinstance(ckpt.get("config"), dict):
        return ckpt["config"]
    return {}


def append_metrics(path: Path, record: dict[str, Any]) -> None:
    """One JSON object per line (a log that a crash cannot leave half-parsed but for its last
    line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
