"""Fashion-MNIST from its idx files (Debian package ``dataset-fashion-mnist``).

The files are looked up in ``root``, then ``$MPSNN_DATA/fashion-mnist``, then
``/usr/share/datasets/fashion-mnist``; nothing is downloaded.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
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
    """An idx file (gzip-compressed): images ``(N, rows, cols)`` (magic 2051) or labels ``(N,)``
    (magic 2049), uint8. ValueError for a file that is not one: not gzip, truncated, another
    magic, or another length than its header announces."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as exc:  # BadGzipFile is an OSError
        if isinstance(exc, OSError) and not isinstance(exc, gzip.BadGzipFile) and exc.errno:
            raise  # the file cannot be read: not its content's fault
        raise ValueError(
            f"[load_fashion_mnist] {path} must be a complete gzip-compressed idx file, got "
            f"{type(exc).__name__}: {exc or 'truncated'}"
        ) from None
    head = 16 if magic == 2051 else 8
    if len(data) < head:
        raise ValueError(
            f"[load_fashion_mnist] {path} must hold an idx header of {head} bytes, got "
            f"{len(data)} bytes"
        )
    got, count = struct.unpack(">II", data[:8])
    if got != magic:
        raise ValueError(
            f"[load_fashion_mnist] {path} must be an idx file with magic {magic}, got {got}"
        )
    shape = (count, *struct.unpack(">II", data[8:16])) if magic == 2051 else (count,)
    if len(data) - head != math.prod(shape):
        raise ValueError(
            f"[load_fashion_mnist] {path} must hold the {math.prod(shape)} bytes of its header's "
            f"shape {shape}, got {len(data) - head}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=head).reshape(shape)


def load_fashion_mnist(
    split: str = "train", root: str | os.PathLike[str] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``(N, 1, 28, 28)`` uint8 and labels ``(N,)`` int64 of ``split`` ("train"/"test").

    Raises FileNotFoundError (with the fix) when the files are not found, ValueError when a
    file is not what it must be (not gzip, truncated, another magic or length, a label count
    other than the image count, a label outside 0-9).
    """
    if split not in _FILES:
        raise ValueError(f"[load_fashion_mnist] split must be 'train' or 'test', got {split!r}")
    folder = find_fashion_mnist(root)
    images_file, labels_file = _FILES[split]
    images = _read_idx(folder / images_file, 2051)
    labels = _read_idx(folder / labels_file, 2049)
    if len(images) != len(labels):
        raise ValueError(
            f"[load_fashion_mnist] {folder / labels_file} must hold one label per image of "
            f"{images_file} ({len(images)}), got {len(labels)}"
        )
    if images.shape[1:] != (28, 28):
        raise ValueError(
            f"[load_fashion_mnist] {folder / images_file} must hold 28x28 images, got "
            f"{images.shape[1]}x{images.shape[2]}"
        )
    if len(labels) and int(labels.max()) >= len(CLASSES):
        bad = int(np.argmax(labels >= len(CLASSES)))
        raise ValueError(
            f"[load_fashion_mnist] {folder / labels_file} must hold labels 0 to "
            f"{len(CLASSES) - 1}, got {int(labels[bad])} at index {bad}"
        )
    return torch.from_numpy(images.copy()).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))
