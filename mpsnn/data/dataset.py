"""`ImageDataset`: a classification dataset held in memory (training and test splits, class
names), and the input standardization ``mpsnn train`` applies to it. `mpsnn.data.load_dataset`
reads one from a name or a path.

Images are ``(N, C, H, W)``, either ``uint8`` (0-255) or ``float32`` intensities in [0, 1];
labels are ``(N,)`` int64 from 0 to ``classes - 1``. The fingerprint (`ImageDataset.fingerprint`)
identifies the content: a run resumed from a checkpoint refuses a dataset whose fingerprint
differs from the one it trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import torch

__all__ = ["NAMED_DATASETS", "ImageDataset", "input_statistics", "standardize"]

#: the datasets known by name (any other spec is a path)
NAMED_DATASETS = ("fashion-mnist", "synthetic")


@dataclasses.dataclass
class ImageDataset:
    """Images and labels of a training and a test split, with the class names.

    Attributes:
        train_x, test_x: ``(N, C, H, W)`` images, ``uint8`` (0-255) or ``float32`` in [0, 1].
        train_y, test_y: ``(N,)`` int64 labels, indices into ``class_names``.
        class_names: one name per class; label ``k`` is ``class_names[k]``.
        source: the spec's name (``fashion-mnist``, ``synthetic``) or the absolute path read.
        kind: ``fashion-mnist``, ``synthetic``, ``imagefolder`` or ``npz``.
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    class_names: tuple[str, ...] = tuple(str(k) for k in range(10))
    source: str = ""
    kind: str = ""

    @property
    def classes(self) -> int:
        """The number of classes (of logits a model needs)."""
        return len(self.class_names)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(channels, height, width)`` of one image."""
        return tuple(self.train_x.shape[1:])  # type: ignore[return-value]

    @property
    def train(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images, labels)`` of the training split (as `mpsnn.fit` takes them)."""
        return self.train_x, self.train_y

    @property
    def test(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images, labels)`` of the test split."""
        return self.test_x, self.test_y

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the data: its source and kind, the class names, the image shape and
        dtype, the split sizes and a SHA-256 digest of the images and labels of both splits
        (in order). JSON-compatible (checkpoints record it)."""
        digest = hashlib.sha256()
        for t in (self.train_x, self.train_y, self.test_x, self.test_y):
            digest.update(memoryview(np.ascontiguousarray(t.cpu().numpy())).cast("B"))
        return {
            "source": self.source,
            "kind": self.kind,
            "class_names": list(self.class_names),
            "shape": list(self.input_shape),
            "dtype": str(self.train_x.dtype).removeprefix("torch."),
            "train": len(self.train_x),
            "test": len(self.test_x),
            "sha256": digest.hexdigest(),
        }


def input_statistics(train_x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean and standard deviation of the training images on the [0, 1] scale (float32
    scalars): ``uint8`` images count as ``k / 255``. A standard deviation of 0 (constant
    images) or not finite (a single value) is taken as 1: the inputs are then only centred."""
    x = train_x.float()
    scale = 255 if train_x.dtype == torch.uint8 else 1
    mean = x.mean() / scale
    std = x.std() / scale if x.numel() > 1 else torch.ones((), dtype=torch.float32)
    if not bool(torch.isfinite(std)) or float(std) == 0.0:
        std = torch.ones((), dtype=torch.float32)
    return mean, std


def standardize(x: torch.Tensor, mean: Any, std: Any) -> torch.Tensor:
    """``(x - mean) / std`` in float32, ``x`` on the [0, 1] scale (``uint8`` read as
    ``k / 255``); ``mean`` and ``std`` from `input_statistics` of the training split."""
    mean = torch.as_tensor(mean, dtype=torch.float32)
    std = torch.as_tensor(std, dtype=torch.float32)
    if x.dtype == torch.uint8:
        return (x.float() / 255 - mean) / std
    return (x.float() - mean) / std
