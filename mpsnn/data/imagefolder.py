"""Your own images in torchvision's ImageFolder layout, decoded with Pillow.

Layout::

    ROOT/train/<class>/*.png|*.jpg|*.jpeg
    ROOT/test/<class>/...        (or ROOT/val/<class>/... where there is no test/)

Rules:

* The classes are the folders of ``train/`` in sorted name order (label ``k`` is the ``k``-th);
  ``test/`` (or ``val/``) must hold the same class folders. Every class folder of both splits
  holds at least one image. Files with other suffixes, and names starting with ``.``, are
  ignored; images are read in sorted name order.
* Every image has the size of the first (width × height); images are not resized.
* Channels: when every image is grayscale (Pillow modes ``1``, ``L``, ``LA``) the dataset has
  one channel; otherwise three (RGB), and grayscale images are repeated into the three. Alpha
  is dropped (the colour values are kept as stored, not blended); palette images (``P``,
  ``PA``) are expanded through their palette; ``CMYK`` and ``YCbCr`` are converted to RGB.
  Other modes (16-bit and float images, ``LAB``, ``HSV``) are refused.
* Any violation, or a file Pillow cannot decode, is a ValueError naming the file or folder.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from mpsnn.data.dataset import ImageDataset

__all__ = ["IMAGE_SUFFIXES", "load_image_folder"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
_GRAY = {"1", "L", "LA"}
_COLOUR = {"P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr"}


def _fail(message: str) -> ValueError:
    return ValueError(f"[load_image_folder] {message}")


def _entries(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))


def _classes(split: Path) -> dict[str, list[Path]]:
    """Class name -> its image files, for one split folder."""
    out = {}
    for folder in _entries(split):
        if not folder.is_dir():
            continue
        files = [p for p in _entries(folder)
                 if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]  # fmt: skip
        if not files:
            raise _fail(
                f"{folder} must hold at least one image ({', '.join(IMAGE_SUFFIXES)}), got none"
            )
        out[folder.name] = files
    return out


def _decode(path: Path) -> np.ndarray:
    """One image as ``(H, W)`` (grayscale) or ``(H, W, 3)`` (colour) uint8."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            im.load()
            mode = im.mode
            if mode in _GRAY:
                return np.asarray(im.convert("L"))
            if mode not in _COLOUR:
                raise _fail(
                    f"{path} must be an 8-bit grayscale or colour image (Pillow modes "
                    f"{', '.join(sorted(_GRAY | _COLOUR))}), got mode {mode}"
                )
            if mode in ("P", "PA"):  # through RGBA: a palette's transparency is not a warning
                im = im.convert("RGBA")
            return np.asarray(im.convert("RGB"))
    except (OSError, SyntaxError, EOFError, struct.error, zlib.error,
            Image.DecompressionBombError) as exc:  # fmt: skip
        raise _fail(
            f"{path} must be an image Pillow can read, got {type(exc).__name__}: {exc}"
        ) from None


def load_image_folder(root: str | os.PathLike[str]) -> ImageDataset:
    """The dataset in the ImageFolder tree ``root`` (see the module docstring): ``uint8``
    images ``(N, C, H, W)`` with C = 1 or 3, int64 labels, the class names."""
    root = Path(root).expanduser().resolve()
    train = root / "train"
    if not train.is_dir():
        raise _fail(
            f"{root} must hold a train/ folder (ImageFolder layout: train/<class>/*.png and "
            f"test/<class>/*.png), got none"
        )
    test = next((root / n for n in ("test", "val") if (root / n).is_dir()), None)
    if test is None:
        raise _fail(f"{root} must hold a test/ or a val/ folder beside train/, got neither")
    splits = [_classes(train), _classes(test)]
    names = list(splits[0])
    if not names:
        raise _fail(f"{train} must hold one folder per class, got none")
    if list(splits[1]) != names:
        missing = sorted(set(names) - set(splits[1]))
        extra = sorted(set(splits[1]) - set(names))
        raise _fail(
            f"{test} must hold the class folders of train/ {names}, got {list(splits[1])} "
            f"(missing: {missing or 'none'}; not in train/: {extra or 'none'})"
        )
    size: tuple[tuple[int, int], Path] | None = None
    arrays: list[list[np.ndarray]] = [[], []]
    labels: list[list[int]] = [[], []]
    for s, classes in enumerate(splits):
        for k, name in enumerate(names):
            for path in classes[name]:
                a = _decode(path)
                hw = (a.shape[0], a.shape[1])
                if size is None:
                    size = (hw, path)
                elif hw != size[0]:
                    (h, w), first = size
                    raise _fail(
                        f"all images must have one size, that of {first} ({w}x{h}, width x "
                        f"height), got {a.shape[1]}x{a.shape[0]} in {path}"
                    )
                arrays[s].append(a)
                labels[s].append(k)
    colour = any(a.ndim == 3 for split in arrays for a in split)

    def stack(split: list[np.ndarray]) -> torch.Tensor:
        if colour:
            split = [a if a.ndim == 3 else np.repeat(a[:, :, None], 3, axis=2) for a in split]
            return torch.from_numpy(np.stack(split)).permute(0, 3, 1, 2).contiguous()
        return torch.from_numpy(np.stack(split)).unsqueeze(1)

    return ImageDataset(
        stack(arrays[0]),
        torch.tensor(labels[0], dtype=torch.int64),
        stack(arrays[1]),
        torch.tensor(labels[1], dtype=torch.int64),
        tuple(names),
        str(root),
        "imagefolder",
    )
