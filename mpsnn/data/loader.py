"""`load_dataset`: a dataset by name or path.

A dataset spec is ``fashion-mnist`` (Debian's idx files), ``synthetic`` (random bytes and
labels, for speed runs), or the path of your own data: a directory in torchvision's
ImageFolder layout (`mpsnn.data.load_image_folder`) or an ``.npz`` file
(`mpsnn.data.load_npz`). The names win over paths: a directory called ``synthetic`` is
``./synthetic``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from mpsnn.data.dataset import NAMED_DATASETS, ImageDataset
from mpsnn.data.fashion_mnist import CLASSES, load_fashion_mnist
from mpsnn.data.imagefolder import load_image_folder
from mpsnn.data.npz import load_npz

__all__ = ["load_dataset"]


def load_dataset(
    spec: str | os.PathLike[str],
    *,
    seed: int = 0,
    shape: tuple[int, int, int] | None = None,
) -> ImageDataset:
    """The dataset ``spec`` names (see the module docstring).

    Args:
        spec: ``fashion-mnist``, ``synthetic``, an ImageFolder directory or an ``.npz`` file.
        seed: the generator of ``synthetic``'s bytes and labels.
        shape: ``(C, H, W)`` of ``synthetic``'s images (default ``(1, 28, 28)``).

    Raises:
        FileNotFoundError: Fashion-MNIST is not installed (the message gives the fix), or
            ``spec`` is neither a name nor an existing path.
        ValueError: the data is not what it must be (each loader's message says what).
    """
    name = os.fspath(spec)
    if name == "fashion-mnist":
        tx, ty = load_fashion_mnist("train")
        vx, vy = load_fashion_mnist("test")
        return ImageDataset(tx, ty, vx, vy, CLASSES, "fashion-mnist", "fashion-mnist")
    if name == "synthetic":
        c, h, w = shape or (1, 28, 28)
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, 256, (12_000, c, h, w), generator=g, dtype=torch.uint8)
        y = torch.randint(0, 10, (12_000,), generator=g)
        return ImageDataset(x[:10_000], y[:10_000], x[10_000:], y[10_000:],
                            source="synthetic", kind="synthetic")  # fmt: skip
    path = Path(name).expanduser()
    if not name or not path.exists():
        raise FileNotFoundError(
            f"[load_dataset] {name!r} must be {', '.join(NAMED_DATASETS)}, an ImageFolder "
            f"directory or an .npz file, got no such file or directory"
        )
    if path.is_dir():
        return load_image_folder(path)
    if path.suffix.lower() == ".npz":
        return load_npz(path)
    raise ValueError(
        f"[load_dataset] {name!r} must be an ImageFolder directory or an .npz file, got a file "
        f"without the .npz suffix"
    )
