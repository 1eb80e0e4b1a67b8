"""A trained model from an ``mpsnn train`` checkpoint, ready for inference: what ``mpsnn
export``, ``mpsnn eval`` and ``mpsnn predict`` share.

The checkpoint's config names the run (model, dataset, seed, limits, dtype). The run is
rebuilt as ``mpsnn train`` built it — its model for the dataset's image shape and classes, the
checkpoint's data sources in the model's layers — so that the inference graph computes what
the run's evaluation after its last epoch computed, on the same test images.

The checkpoint alone is enough for inference (``mpsnn export``, ``mpsnn predict``): it records
the dataset's image shape and class names (its fingerprint) and the input standardization
(``inputs``), so the data may have moved or gone. The dataset is read only for its test split
(``mpsnn eval`` on the run's own data), or for a checkpoint of an older version that lacks the
standardization (computed again from the first ``--limit`` training images, which must then be
the data the run trained on).

Input of the network (and of its PyTorch twin): ``(pixel / 255 - mean) / std`` per value, with
the mean and deviation of the run's training images (``mean = 0, std = 1`` for models fed
UNORM8 bytes, such as ``apple-mnist``, whose kernels read ``pixel / 255`` themselves).
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import torch

from mpsnn.cli.common import UserError, parse_device
from mpsnn.cli.runs import CHECKPOINT, check_checkpoint

__all__ = ["TrainedModel", "open_checkpoint"]

#: images per inference-graph call (the batch of the run's own evaluation)
BATCH = 1000


@dataclasses.dataclass
class TrainedModel:
    """A run rebuilt from its checkpoint (see the module docstring).

    Attributes:
        path: the checkpoint file.
        checkpoint: the loaded checkpoint.
        trainer: the run's `Trainer` (its data, model, device and inference graph); it never
            trains here.
        has_data: whether the run's dataset was read (``trainer.data`` holds its images);
            else ``trainer.data`` holds none, only the class names and image shape.
    """

    path: Path
    checkpoint: dict[str, Any]
    trainer: Any
    has_data: bool = True

    @property
    def config(self) -> Any:
        return self.trainer.config

    @property
    def model(self) -> Any:
        return self.trainer.model

    @property
    def epoch(self) -> int:
        return int(self.checkpoint["epoch"])

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.trainer.data.input_shape)  # type: ignore[return-value]

    @property
    def classes(self) -> int:
        return int(self.trainer.data.classes)

    @property
    def class_names(self) -> list[str]:
        """The dataset's class names: those its loader gives (a folder per class), the ten
        Fashion-MNIST names, else the class indices as text."""
        names = getattr(self.trainer.data, "class_names", None)
        if names:
            return [str(n) for n in names]
        if self.config.dataset == "fashion-mnist":
            from mpsnn.data.fashion_mnist import CLASSES

            return list(CLASSES)
        return [str(i) for i in range(self.classes)]

    @property
    def normalization(self) -> tuple[float, float]:
        """``(mean, std)`` of the network's input ``(pixel / 255 - mean) / std`` (module
        docstring), as the run computed them."""
        if self.trainer.unorm8:
            return 0.0, 1.0
        return self.trainer.statistics

    def prepare(self, images: torch.Tensor) -> torch.Tensor:
        """Raw ``(N, C, H, W)`` uint8 images as the network's input on the run's device (the
        run's own preparation of its test images)."""
        return self.trainer._prepare(images).to(self.trainer.torch_device)

    def logits(self, prepared: torch.Tensor) -> torch.Tensor:
        """The inference graph's logits ``(N, classes)`` of prepared images, in batches of
        `BATCH` as the run evaluated (float32, or the run's ``--dtype`` widened)."""
        t = self.trainer
        t.inference.reload_from_data_sources()
        out = []
        for i in range(0, len(prepared), BATCH):
            cb = t.queue.command_buffer()
            result = t.inference.encode_batch(cb, [t._batch(prepared[i : i + BATCH])])
            cb.commit()
            out.append(result.tensor.flatten(1).to(torch.float32, copy=True))
        if not out:
            return torch.zeros(0, self.classes, device=t.torch_device)
        return torch.cat(out)


def checkpoint_path(path: Path) -> Path:
    """``path`` itself, or ``path/checkpoint.mpsnn`` for a checkpoint directory."""
    return path / CHECKPOINT if path.is_dir() else path


def open_checkpoint(
    path: Path, device: str | None = None, *, read_data: bool = True
) -> TrainedModel:
    """Load the checkpoint at ``path`` (a file, or the ``--checkpoint-dir`` holding
    ``checkpoint.mpsnn``) and rebuild its run on ``device`` (None: the device the run trained
    on where it is here, else what ``auto`` picks; ``mpsnn train --resume``'s rule).
    ``read_data``: read the run's dataset (its test split); False: only where the checkpoint
    lacks the input standardization (an older version). Every problem is a `UserError`: a
    missing or unreadable file, another kind of file, a checkpoint that does not match its
    model, a dataset that is needed and not there (or not the run's)."""
    from mpsnn.cli.trainer import TrainConfig, Trainer, _own_device
    from mpsnn.errors import CheckpointError
    from mpsnn.io import load

    path = checkpoint_path(path)
    if not os.path.lexists(path):
        raise UserError(
            f"CHECKPOINT must be a checkpoint written by mpsnn train (or the --checkpoint-dir "
            f"holding {CHECKPOINT}), got no such file: {path}"
        )
    fields = tuple(f.name for f in dataclasses.fields(TrainConfig))
    target = None if device is None else parse_device(device)
    try:
        ckpt = load(path, target or parse_device("cpu"))
        check_checkpoint(ckpt, path, fields)
        if target is None:
            target = _own_device(ckpt)
            if target.type != "cpu":
                ckpt = load(path, target)
    except CheckpointError as exc:
        raise UserError(f"{path} is not a usable checkpoint: {exc}") from None
    except OSError as exc:
        raise UserError(f"{path} cannot be read: {exc.strerror or exc}") from None
    config = dict(ckpt["config"])
    config["device"] = str(target.torch_device)
    config["compile"] = False  # no training step runs here
    saved = ckpt.get("inputs")
    if read_data or saved is None or ckpt.get("dataset") is None:
        data, statistics = _read_data(config, ckpt, path, read_data), None
    else:
        data, statistics = _stand_in(ckpt["dataset"]), (saved["mean"], saved["std"])
    trainer = Trainer(TrainConfig(**config), ckpt, origin=path, data=data,
                      statistics=statistics)  # fmt: skip
    return TrainedModel(path, ckpt, trainer, has_data=statistics is None)


def _stand_in(record: dict[str, Any]) -> Any:
    """A dataset without images with the fingerprint ``record``'s class names, image shape
    and dtype: what building the run's model and preparing images need."""
    from mpsnn.data import ImageDataset

    dtype = torch.uint8 if record["dtype"] == "uint8" else torch.float32
    images = torch.zeros((0, *record["shape"]), dtype=dtype)
    labels = torch.zeros(0, dtype=torch.int64)
    return ImageDataset(images, labels, images.clone(), labels.clone(),
                        tuple(record["class_names"]), record["source"], record["kind"])  # fmt: skip


def _read_data(config: dict[str, Any], ckpt: dict[str, Any], path: Path, test: bool) -> Any:
    """The run's dataset, checked against the checkpoint's fingerprint; ``test``: read for its
    test split (eval), else for the input standardization an older checkpoint lacks."""
    from mpsnn.cli.common import model_class
    from mpsnn.cli.runs import check_dataset
    from mpsnn.data import load_dataset

    try:
        data = load_dataset(config["dataset"], seed=config["seed"],
                            shape=model_class(config["model"]).input_shape)  # fmt: skip
    except (ValueError, OSError) as exc:  # missing (with the fix), unreadable, corrupt
        reason = re.sub(r"^\[\w+\] ", "", str(exc))  # the loader's name: not the user's
        if test:
            raise UserError(
                f"the test split of the run's dataset must be readable (or give --dataset), "
                f"got: {reason}"
            ) from None
        raise UserError(
            f"{path} records no input standardization (a checkpoint of an older mpsnn), so the "
            f"data it trained on must be readable where it was to compute it, got: {reason}"
        ) from None
    check_dataset(ckpt.get("dataset"), data.fingerprint(), path, training=False)
    return data
