"""Fashion-MNIST from its idx files (Debian package ``dataset-fashion-mnist``).

The files are looked up in ``root``, then ``$MPSNN_DATA/fashion-mnist``, then
``/usr/share/datasets/fashion-mnist``; nothing is downloaded.
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import torch

__all__ = ["CLASSES", "find_fashion_mnist", "load_fashion_mnist"]

CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
_SEARCH = ("/usr/share/datasets/fashion-mnist",)


def find_fashion_mnist(root: str | os.PathLike[str] | None = None) -> Path:
    """The folder holding the four idx files; raises FileNotFoundError with the fix."""
    candidates = [Path(root)] if root is not None else []
    if os.environ.get("MPSNN_DATA"):
        candidates.append(Path(os.environ["MPSNN_DATA"]) / "fashion-mnist")
    candidates += [Path(p) for p in _SEARCH]
    for folder in candidates:
        if all((folder / f).is_file() for pair in _FILES.values() for f in pair):
            return folder
    raise FileNotFoundError(
        "[load_fashion_mnist] the Fashion-MNIST idx files must be in one of "
        f"{[str(c) for c in candidates]}, got none there; install them with "
        "`apt-get install dataset-fashion-mnist` or pass root="
    )


def _read_idx(path: Path, magic: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    got, count = struct.unpack(">II", data[:8])
    if got != magic:
        raise ValueError(
            f"[load_fashion_mnist] {path} must be an idx file with magic {magic}, got {got}"
        )
    if magic == 2051:
        rows, cols = struct.unpack(">II", data[8:16])
        return np.frombuffer(data, dtype=np.uint8, offset=16).reshape(count, rows, cols)
    return np.frombuffer(data, dtype=np.uint8, offset=8).reshape(count)


def load_fashion_mnist(
    split: str = "train", root: str | os.PathLike[str] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``(N, 1, 28, 28)`` uint8 and labels ``(N,)`` int64 of ``split`` ("train"/"test")."""
    if split not in _FILES:
        raise ValueError(f"[load_fashion_mnist] split must be 'train' or 'test', got {split!r}")
    folder = find_fashion_mnist(root)
    images_file, labels_file = _FILES[split]
    images = _read_idx(folder / images_file, 2051)
    labels = _read_idx(folder / labels_file, 2049)
    return torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))
