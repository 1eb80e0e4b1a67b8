"""A trained model from an ``mpsnn train`` checkpoint, ready for inference: what ``mpsnn
export``, ``mpsnn eval`` and ``mpsnn predict`` share.

The checkpoint's config names the run (model, dataset, seed, limits, dtype). The run is
rebuilt as ``mpsnn train`` built it — its dataset (whose first ``--limit`` training images give
the input standardization), its model for the dataset's image shape and classes, the
checkpoint's data sources in the model's layers — so that the inference graph computes what
the run's evaluation after its last epoch computed, on the same test images.

Input of the network (and of its PyTorch twin): ``(pixel / 255 - mean) / std`` per value, with
the mean and deviation of the run's training images (``mean = 0, std = 1`` for models fed
UNORM8 bytes, such as ``apple-mnist``, whose kernels read ``pixel / 255`` themselves).
"""

from __future__ import annotations

import dataclasses
import os
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
    """

    path: Path
    checkpoint: dict[str, Any]
    trainer: Any

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
        from mpsnn.data import input_statistics

        if self.trainer.unorm8:
            return 0.0, 1.0
        mean, std = input_statistics(self.trainer.data.train_x)
        return float(mean), float(std)

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


def open_checkpoint(path: Path, device: str | None = None) -> TrainedModel:
    """Load the checkpoint at ``path`` (a file, or the ``--checkpoint-dir`` holding
    ``checkpoint.mpsnn``) and rebuild its run on ``device`` (None: the device the run trained
    on where it is here, else what ``auto`` picks; ``mpsnn train --resume``'s rule). Every
    problem is a `UserError`: a missing or unreadable file, another kind of file, a
    checkpoint that does not match its model, a dataset that is not there."""
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
    trainer = Trainer(TrainConfig(**config), ckpt, origin=path)
    return TrainedModel(path, ckpt, trainer)
