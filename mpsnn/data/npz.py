"""Your own arrays in one ``.npz`` file (``numpy.savez``): ``x_train``, ``y_train``,
``x_test``, ``y_test``, and optionally ``class_names``.

Rules:

* Images are ``uint8`` (0-255) or floating point; both ``x`` arrays have the same kind. Float
  images are intensities in [0, 1] (as torchvision's ``ToTensor`` gives): every value finite
  and within [0, 1] (divide 0-255 values by 255 first); they are stored as float32.
* Layout by the number of axes: 3 axes are ``(N, H, W)`` (one channel); 4 axes are
  ``(N, H, W, C)`` when the last axis is 1, 3 or 4 and the second is not, else
  ``(N, C, H, W)``. (A 4×4 RGB image stored NHWC, ``(N, 4, 4, 3)``, therefore reads as NCHW:
  store NCHW to be unambiguous.) Channels are kept as they are (a fourth channel is data, not
  alpha). Both splits have the same ``(C, H, W)`` and at least one image.
* Labels are integers, ``(N,)`` or ``(N, 1)``, one per image, from 0. The classes are
  ``class_names`` (a 1-D array of strings) where given, the labels below their count; else
  ``0 .. max label`` over both splits, named by their index.
* ``allow_pickle`` is off: object arrays are refused. Any violation is a ValueError naming the
  file and the array.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch

from mpsnn.data.dataset import ImageDataset

__all__ = ["load_npz"]

_KEYS = ("x_train", "y_train", "x_test", "y_test")


def _fail(message: str) -> ValueError:
    return ValueError(f"[load_npz] {message}")


def _nchw(x: np.ndarray, where: str) -> np.ndarray:
    """``x`` as ``(N, C, H, W)`` by the layout rule of the module docstring."""
    if x.ndim == 3:
        return x[:, None]
    if x.ndim != 4:
        raise _fail(f"{where} must be images (N, H, W), (N, H, W, C) or (N, C, H, W), got shape "
                    f"{x.shape}")  # fmt: skip
    if x.shape[3] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        return x.transpose(0, 3, 1, 2)
    return x


def _images(x: np.ndarray, where: str) -> np.ndarray:
    if x.dtype != np.uint8 and not np.issubdtype(x.dtype, np.floating):
        raise _fail(f"{where} must hold uint8 or float images, got dtype {x.dtype}")
    x = _nchw(x, where)
    if x.shape[0] < 1 or min(x.shape[1:]) < 1:
        raise _fail(f"{where} must hold at least one image of at least 1x1, got shape {x.shape}")
    if x.dtype == np.uint8:
        return np.ascontiguousarray(x)
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise _fail(f"{where} must hold finite values, got NaN or infinity")
    low, high = float(x.min()), float(x.max())
    if low < 0 or high > 1:
        raise _fail(
            f"{where} must hold float intensities in [0, 1] (divide 0-255 values by 255), got "
            f"values from {low:g} to {high:g}"
        )
    return np.ascontiguousarray(x)


#: the most classes a dataset may have (a label is a class index: a stray huge label would
#: otherwise make a model, and class names, of that many classes)
MAX_CLASSES = 1 << 16


def _labels(y: np.ndarray, count: int, where: str) -> np.ndarray:
    if not (np.issubdtype(y.dtype, np.integer) and y.dtype != np.bool_):
        raise _fail(f"{where} must hold integer labels, got dtype {y.dtype}")
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or len(y) != count:
        raise _fail(f"{where} must hold one label per image ({count},), got shape {y.shape}")
    if len(y) and int(y.min()) < 0:
        raise _fail(f"{where} must hold labels >= 0, got {int(y.min())}")
    if len(y) and int(y.max()) >= MAX_CLASSES:  # (compared as Python ints: no wrap-around)
        raise _fail(f"{where} must hold labels < {MAX_CLASSES}, got {int(y.max())}")
    return y.astype(np.int64)


def _kind(path: Path) -> str:
    return "a directory" if path.is_dir() else "a special file (a FIFO, a device, a socket)"


def load_npz(path: str | os.PathLike[str]) -> ImageDataset:
    """The dataset in the ``.npz`` file ``path`` (see the module docstring)."""
    path = Path(path).expanduser().resolve()
    if path.exists() and not path.is_file():  # a FIFO or a device would block or never end
        raise _fail(f"{path} must be a regular .npz file, got {_kind(path)}")
    try:
        archive = np.load(path, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise _fail(f"{path} must be an .npz archive (numpy.savez), got one array (.npy)")
        with archive:
            missing = [k for k in _KEYS if k not in archive.files]
            if missing:
                raise _fail(
                    f"{path} must hold the arrays {list(_KEYS)}, got {sorted(archive.files)} "
                    f"(missing: {missing})"
                )
            arrays = {k: archive[k] for k in (*_KEYS, "class_names") if k in archive.files}
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise _fail(
            f"{path} must be a readable .npz file, got {type(exc).__name__}: {exc}"
        ) from None
    except ValueError as exc:
        if str(exc).startswith("[load_npz]"):
            raise
        raise _fail(f"{path} must be an .npz file of plain arrays, got: {exc}") from None
    x = {s: _images(arrays[f"x_{s}"], f"{path}: x_{s}") for s in ("train", "test")}
    if (x["train"].dtype == np.uint8) != (x["test"].dtype == np.uint8):
        raise _fail(
            f"{path}: x_train and x_test must both be uint8 or both float, got "
            f"{arrays['x_train'].dtype} and {arrays['x_test'].dtype}"
        )
    if x["train"].shape[1:] != x["test"].shape[1:]:
        raise _fail(
            f"{path}: x_test must hold images of x_train's shape (C, H, W) = "
            f"{x['train'].shape[1:]}, got {x['test'].shape[1:]}"
        )
    y = {s: _labels(arrays[f"y_{s}"], len(x[s]), f"{path}: y_{s}") for s in ("train", "test")}
    top = max(int(y["train"].max()), int(y["test"].max()))
    if "class_names" in arrays:
        names = arrays["class_names"]
        if names.ndim != 1 or names.dtype.kind not in "US" or len(names) < 1:
            raise _fail(
                f"{path}: class_names must be a 1-D array of strings, got dtype {names.dtype} "
                f"shape {names.shape}"
            )
        class_names = tuple(
            n.decode(errors="replace") if isinstance(n, bytes) else str(n) for n in names.tolist()
        )
        if top >= len(class_names):
            split = "train" if int(y["train"].max()) == top else "test"
            raise _fail(
                f"{path}: y_{split} must hold labels below the {len(class_names)} class_names, "
                f"got {top}"
            )
    else:
        class_names = tuple(str(k) for k in range(top + 1))
    return ImageDataset(
        torch.from_numpy(x["train"]),
        torch.from_numpy(y["train"]),
        torch.from_numpy(x["test"]),
        torch.from_numpy(y["test"]),
        class_names,
        str(path),
        "npz",
    )
