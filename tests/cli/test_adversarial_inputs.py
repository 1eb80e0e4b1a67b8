"""Inputs an adversarial user can hand the loaders and the commands: each is refused with one
clear error (never a raw traceback, a hang, or a silent change of the run)."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import mpsnn
from mpsnn.cli.common import UserError
from mpsnn.errors import CheckpointError


def _file(path: Path, header: dict, data: bytes = b"") -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _doc(root: object) -> dict:
    meta = {"format": "mpsnn", "version": 1, "root": root, "objects": []}
    return {"__metadata__": {"mpsnn": json.dumps(meta)}}


def _ref(name: str, dtype: object, shape: list) -> dict:
    return {"$tensor": name, "dtype": dtype, "shape": shape}


@pytest.mark.parametrize(
    "header",
    [
        {**_doc(None), "a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}},
        {**_doc(_ref("a", ["float32"], [1])),
         "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
        {**_doc(_ref("a", "float32", [0, 2**70])),
         "a": {"dtype": "F32", "shape": [0, 2**70], "data_offsets": [0, 0]}},
        {**_doc(_ref("a", "float32", [0, 2**62, 2**62])),
         "a": {"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}},
    ],
    ids=["list-dtype-in-header", "list-dtype-in-reference", "huge-dimension", "huge-product"],
)  # fmt: skip
def test_crafted_checkpoints_are_refused_with_a_checkpoint_error(tmp_path, header) -> None:
    path = _file(tmp_path / "crafted.mpsnn", header, b"\0" * 4)
    with pytest.raises(CheckpointError, match=r"\[load\]"):
        mpsnn.load(path)


def test_a_temporary_file_with_an_impossible_pid_is_not_a_live_writers() -> None:
    from mpsnn.io.files import _writing

    assert _writing(10**20, "/nonexistent/.checkpoint.mpsnn.x.tmp") is False


def _npz(path: Path, **arrays: np.ndarray) -> Path:
    rng = np.random.default_rng(0)
    base = {
        "x_train": rng.integers(0, 256, (8, 4, 4), dtype=np.uint8),
        "y_train": np.arange(8) % 2,
        "x_test": rng.integers(0, 256, (4, 4, 4), dtype=np.uint8),
        "y_test": np.arange(4) % 2,
    }
    np.savez(path, **{**base, **arrays})
    return path


def test_npz_labels_that_wrap_or_are_huge_are_refused(tmp_path) -> None:
    from mpsnn.data.npz import load_npz

    wrap = np.arange(8, dtype=np.uint64) % 2
    wrap[3] = np.iinfo(np.uint64).max
    with pytest.raises(ValueError, match=r"\[load_npz\].*y_train must hold labels < 65536"):
        load_npz(_npz(tmp_path / "wrap.npz", y_train=wrap))
    huge = np.arange(8) % 2
    huge[0] = 2**40
    with pytest.raises(
        ValueError, match=r"\[load_npz\].*must hold labels < 65536, got 1099511627776"
    ):
        load_npz(_npz(tmp_path / "huge.npz", y_train=huge))


def test_a_fifo_is_refused_at_once_as_a_dataset_and_as_an_image(tmp_path) -> None:
    from mpsnn.cli.predict import read_image
    from mpsnn.data.npz import load_npz

    fifo = tmp_path / "data.npz"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"\[load_npz\].*must be a regular \.npz file"):
        load_npz(fifo)
    with pytest.raises(UserError, match="must be an image file, got a directory or a special"):
        read_image(fifo, (1, 4, 4))


def test_predict_refuses_16_bit_images_as_the_dataset_reader_does(tmp_path) -> None:
    from PIL import Image

    from mpsnn.cli.predict import read_image

    path = tmp_path / "deep.png"
    Image.fromarray(np.full((4, 4), 40000, dtype=np.uint16)).save(path)
    with pytest.raises(UserError, match="must be an 8-bit grayscale or colour image"):
        read_image(path, (1, 4, 4))


def test_constant_training_images_are_centred_not_divided_by_zero() -> None:
    from mpsnn.data.dataset import input_statistics

    mean, std = input_statistics(torch.zeros(5, 1, 4, 4, dtype=torch.uint8))
    assert float(mean) == 0.0 and float(std) == 1.0
    mean, std = input_statistics(torch.full((1, 1, 1, 1), 0.5))  # one value: no spread
    assert float(mean) == 0.5 and float(std) == 1.0


def test_metrics_or_plot_on_the_checkpoint_is_refused(tmp_path) -> None:
    from mpsnn.cli.runs import CHECKPOINT, check_outputs

    with pytest.raises(UserError, match=r"--metrics must name a file of its own.*the checkpoint"):
        check_outputs(tmp_path, tmp_path / CHECKPOINT, None)
    with pytest.raises(UserError, match=r"--plot must name a file of its own.*--metrics"):
        check_outputs(tmp_path, tmp_path / "m.png", tmp_path / "m.png")


def test_a_writer_error_of_torch_save_is_one_error_line(tmp_path) -> None:
    from mpsnn.cli.export import _atomically

    out = tmp_path / "model.pt"
    with pytest.raises(UserError, match=f"writing {out} failed: no space"), _atomically(out):
        raise RuntimeError("no space left on device")
    assert not list(tmp_path.iterdir())  # the temporary file removed
