"""Small, easy datasets of your own for the tests of ``mpsnn train --dataset PATH`` and
`mpsnn.fit`: three classes of 16×16 images, each a shape of its own colour at a random place
on a dark noisy background (a filled square in red, a horizontal bar in green, a vertical bar in
blue), written as an ImageFolder tree of PNG files or as arrays."""

from __future__ import annotations

from pathlib import Path

import numpy as np

CLASSES = ("bar", "square", "stripe")  # folder names: sorted, so label k is CLASSES[k]
_COLOURS = ((40, 200, 60), (220, 40, 40), (50, 80, 230))


def easy_images(per_class: int, seed: int, size: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """``(N, size, size, 3)`` uint8 images and ``(N,)`` labels, the classes interleaved."""
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for i in range(per_class * len(CLASSES)):
        k = i % len(CLASSES)
        img = rng.integers(0, 50, (size, size, 3), dtype=np.uint8)
        r, c = rng.integers(1, size - 8, 2)
        if k == 0:  # a horizontal bar
            img[r : r + 3, 1 : size - 1] = _COLOURS[k]
        elif k == 1:  # a square
            img[r : r + 6, c : c + 6] = _COLOURS[k]
        else:  # a vertical bar
            img[1 : size - 1, c : c + 3] = _COLOURS[k]
        images.append(img)
        labels.append(k)
    return np.stack(images), np.array(labels, dtype=np.int64)


def gray(images: np.ndarray) -> np.ndarray:
    """``(N, H, W, 3)`` -> ``(N, H, W)`` uint8: the channels' maximum (the shapes stay bright)."""
    return images.max(axis=3)


def write_image_folder(
    root: Path, per_class: int = 60, test_per_class: int = 20, test: str = "test", seed: int = 0
) -> Path:
    """An ImageFolder tree under ``root``: ``train/<class>/NNN.png`` and ``<test>/<class>/...``."""
    from PIL import Image

    for split, count, s in (("train", per_class, seed), (test, test_per_class, seed + 1)):
        x, y = easy_images(count, s)
        for i, (img, k) in enumerate(zip(x, y, strict=True)):
            folder = root / split / CLASSES[k]
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(img).save(folder / f"{i:03d}.png")
    return root


def easy_arrays(per_class: int = 60, test_per_class: int = 20, seed: int = 0):
    """``(x_train, y_train, x_test, y_test)``: NHWC uint8 images and labels."""
    x, y = easy_images(per_class, seed)
    vx, vy = easy_images(test_per_class, seed + 1)
    return x, y, vx, vy
