"""``mpsnn train --dataset PATH``: your own data as an ImageFolder tree or an ``.npz`` file,
trained on the CPU to a high test accuracy; the loaders' rules (layouts, channels, class
names); every mistake in the data as one ``Error:`` line; the checkpoint's record of the
dataset, and ``--resume`` refusing other data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import mpsnn as m
from mpsnn.data import load_dataset, load_image_folder, load_npz
from tests.cli._helpers import run_cli as _run
from tests.own_data import CLASSES, easy_arrays, gray, write_image_folder

FAST = ["--batch-size", "16", "--device", "cpu"]


def _one_error(out: str) -> str:
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), out
    return lines[0]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("own") / "shapes")


# -- training on your own data -------------------------------------------------------------------


def test_an_image_folder_trains_to_a_high_accuracy(folder: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    code, out = _run("train", "--dataset", str(folder), "--epochs", "2", *FAST,
                     "--checkpoint-dir", str(run))  # fmt: skip
    assert code == 0, out
    assert f"on {folder} (180 train / 60 test images)" in out, out
    records = _records(run / "metrics.jsonl")
    assert records[-1]["test_accuracy"] >= 0.9, records
    ckpt = m.load(run / "checkpoint.mpsnn")
    assert ckpt["config"]["dataset"] == str(folder)
    record = ckpt["dataset"]
    assert record["kind"] == "imagefolder" and record["source"] == str(folder)
    assert record["class_names"] == list(CLASSES)
    assert record["shape"] == [3, 16, 16] and record["dtype"] == "uint8"
    assert (record["train"], record["test"]) == (180, 60) and len(record["sha256"]) == 64


@pytest.mark.parametrize("layout", ["NHW uint8", "NHWC float", "NCHW uint8"])
def test_an_npz_file_trains_to_a_high_accuracy(tmp_path: Path, layout: str) -> None:
    x, y, vx, vy = easy_arrays()
    if layout == "NHW uint8":
        x, vx = gray(x), gray(vx)
    elif layout == "NHWC float":
        x, vx = x.astype(np.float32) / 255, vx.astype(np.float64) / 255
    else:
        x, vx = x.transpose(0, 3, 1, 2), vx.transpose(0, 3, 1, 2)
    path = tmp_path / "data.npz"
    np.savez(path, x_train=x, y_train=y, x_test=vx, y_test=vy)
    metrics = tmp_path / "m.jsonl"
    code, out = _run("train", "--dataset", str(path), "--epochs", "2", *FAST,
                     "--metrics", str(metrics))  # fmt: skip
    assert code == 0, out
    assert _records(metrics)[-1]["test_accuracy"] >= 0.9, _records(metrics)


def test_every_model_adapts_to_the_data(folder: Path, tmp_path: Path) -> None:
    """Channels, image size and class count: 3×16×16 images of 3 classes (LeNet-5 needs 12×12
    at least: 8×8 images are one line naming it)."""
    for model in ("lenet", "apple-mnist", "resnet18"):
        code, out = _run("train", "--dataset", str(folder), "--model", model, "--epochs", "1",
                         *FAST, "--limit", "32", "--test-limit", "16")  # fmt: skip
        assert code == 0, out
    x, y, vx, vy = easy_arrays(8, 2)
    small = tmp_path / "small.npz"
    np.savez(small, x_train=x[:, :8, :8], y_train=y, x_test=vx[:, :8, :8], y_test=vy)
    code, out = _run("train", "--dataset", str(small), "--model", "lenet", *FAST)
    assert code == 2
    assert _one_error(out).startswith(
        "Error: --model lenet: input_shape must be (channels, height, width) with at least one "
        "channel and a height and width of at least 12 (two 2×2 poolings around a 5×5 "
        "convolution without padding), got (3, 8, 8)"
    ), out


# -- the loaders' rules ----------------------------------------------------------------------------


def test_image_folder_reads_val_and_sorts_classes_and_files(tmp_path: Path) -> None:
    root = write_image_folder(tmp_path / "d", per_class=3, test_per_class=2, test="val")
    data = load_dataset(root)
    assert data.kind == "imagefolder" and data.class_names == CLASSES
    assert data.train_x.shape == (9, 3, 16, 16) and data.train_x.dtype == torch.uint8
    assert data.test_x.shape == (6, 3, 16, 16)
    assert data.train_y.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    first = np.array(Image.open(root / "train" / CLASSES[1] / "001.png"))
    assert torch.equal(data.train_x[3], torch.from_numpy(first).permute(2, 0, 1))


def _save(path: Path, image: Image.Image) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


def test_image_folder_channel_rule(tmp_path: Path) -> None:
    """All grayscale: one channel. Any colour: RGB, grayscale repeated, alpha dropped, palettes
    expanded."""
    g = np.arange(16, dtype=np.uint8).reshape(4, 4) * 16
    rgba = np.dstack([g, 255 - g, g // 2, np.full_like(g, 7)])
    gray_root = tmp_path / "gray"
    for split in ("train", "test"):
        _save(gray_root / split / "a" / "0.png", Image.fromarray(g, "L"))
        _save(gray_root / split / "b" / "0.png", Image.fromarray(np.dstack([g, g]), "LA"))
    data = load_image_folder(gray_root)
    assert data.train_x.shape == (2, 1, 4, 4)
    assert torch.equal(data.train_x[1, 0], torch.from_numpy(g))  # LA: alpha dropped

    mixed = tmp_path / "mixed"
    palette = Image.fromarray(rgba[:, :, :3], "RGB").quantize(colors=16)
    for split in ("train", "val"):
        _save(mixed / split / "a" / "0.png", Image.fromarray(g, "L"))
        _save(mixed / split / "b" / "0.png", Image.fromarray(rgba, "RGBA"))
        _save(mixed / split / "c" / "0.png", palette)
    data = load_image_folder(mixed)
    assert data.train_x.shape == (3, 3, 4, 4)
    assert torch.equal(data.train_x[0], torch.from_numpy(g).expand(3, 4, 4))
    assert torch.equal(data.train_x[1], torch.from_numpy(rgba[:, :, :3]).permute(2, 0, 1))
    expanded = np.array(palette.convert("RGB"))
    assert torch.equal(data.train_x[2], torch.from_numpy(expanded).permute(2, 0, 1))


def test_npz_layouts_and_class_names(tmp_path: Path) -> None:
    x, y, vx, vy = easy_arrays(2, 3)  # NHWC uint8
    nchw = torch.from_numpy(x).permute(0, 3, 1, 2)
    cases = {
        "nhw": (gray(x), gray(vx), torch.from_numpy(gray(x)).unsqueeze(1)),
        "nhwc": (x, vx, nchw),
        "nchw": (x.transpose(0, 3, 1, 2), vx.transpose(0, 3, 1, 2), nchw),
        "nhwc-float": (x / 255.0, vx / 255.0, nchw.float() / 255),
    }
    for name, (a, b, want) in cases.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, x_train=a, y_train=y.reshape(-1, 1), x_test=b, y_test=vy.astype(np.uint8))
        data = load_npz(path)
        assert data.train_x.dtype == want.dtype and torch.equal(data.train_x, want), name
        assert data.train_y.dtype == torch.int64 and data.train_y.tolist() == y.tolist()
        assert data.class_names == ("0", "1", "2") and data.source == str(path)
    path = tmp_path / "named.npz"
    np.savez(path, x_train=x, y_train=y, x_test=vx, y_test=vy,
             class_names=np.array(["bar", "square", "stripe", "unused"]))  # fmt: skip
    assert load_npz(path).class_names == ("bar", "square", "stripe", "unused")


# -- mistakes in the data ------------------------------------------------------------------------


def _tree(root: Path, edit) -> Path:
    write_image_folder(root, per_class=2, test_per_class=1)
    edit(root)
    return root


def _unreadable(root: Path) -> None:
    (root / "train" / CLASSES[0] / "000.png").write_text("not an image")


def _truncated(root: Path) -> None:
    path = root / "train" / CLASSES[0] / "000.png"
    path.write_bytes(path.read_bytes()[:100])


def _sixteen_bit(root: Path) -> None:
    im = Image.fromarray(np.zeros((16, 16), dtype=np.uint16))
    im.save(root / "test" / CLASSES[2] / "000.png")


_TREES = {
    "no train": (lambda r: shutil.rmtree(r / "train"),
                 "{root} must hold a train/ folder (ImageFolder layout: train/<class>/*.png and "
                 "test/<class>/*.png), got none"),
    "no test": (lambda r: shutil.rmtree(r / "test"),
                "{root} must hold a test/ or a val/ folder beside train/, got neither"),
    "no classes": (lambda r: [shutil.rmtree(p) for p in (r / "train").iterdir()],
                   "{root}/train must hold one folder per class, got none"),
    "empty class": (lambda r: [p.unlink() for p in (r / "train" / "square").iterdir()],
                    "{root}/train/square must hold at least one image (.png, .jpg, .jpeg), got "
                    "none"),
    "classes differ": (lambda r: (r / "test" / "stripe").rename(r / "test" / "zebra"),
                       "{root}/test must hold the class folders of train/ ['bar', 'square', "
                       "'stripe'], got ['bar', 'square', 'zebra'] (missing: ['stripe']; not in "
                       "train/: ['zebra'])"),
    "mixed sizes": (lambda r: Image.new("RGB", (16, 12)).save(r / "test" / "bar" / "000.png"),
                    "all images must have one size, that of {root}/train/bar/000.png (16x16, "
                    "width x height), got 16x12 in {root}/test/bar/000.png"),
    "unreadable": (_unreadable, "{root}/train/bar/000.png must be an image Pillow can read, got "
                   "UnidentifiedImageError: cannot identify image file"),
    "truncated": (_truncated, "{root}/train/bar/000.png must be an image Pillow can read, got "
                  "OSError: "),
    "16-bit": (_sixteen_bit, "{root}/test/stripe/000.png must be an 8-bit grayscale or colour "
               "image (Pillow modes 1, CMYK, L, LA, P, PA, RGB, RGBA, RGBX, YCbCr), got mode I;16"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_TREES))
def test_a_bad_image_folder_is_one_line(tmp_path: Path, case: str) -> None:
    edit, message = _TREES[case]
    root = _tree(tmp_path / "data", edit)
    code, out = _run("train", "--dataset", str(root), *FAST)
    assert code == 2, out
    assert _one_error(out).startswith("Error: --dataset " + message.format(root=root)), out


def _arrays(**change: object) -> dict[str, object]:
    x, y, vx, vy = easy_arrays(2, 1)
    arrays: dict[str, object] = {"x_train": x, "y_train": y, "x_test": vx, "y_test": vy}
    arrays.update(change)
    return {k: v for k, v in arrays.items() if v is not None}


_FLOATS = np.full((6, 16, 16), 0.5)
_NPZ = {
    "missing keys": (_arrays(y_test=None),
                     "{path} must hold the arrays ['x_train', 'y_train', 'x_test', 'y_test'], got "
                     "['x_test', 'x_train', 'y_train'] (missing: ['y_test'])"),
    "lengths": (_arrays(y_train=np.zeros(5, dtype=np.int64)),
                "{path}: y_train must hold one label per image (6,), got shape (5,)"),
    "negative label": (_arrays(y_test=np.array([0, -1, 2])),
                       "{path}: y_test must hold labels >= 0, got -1"),
    "label past class_names": (_arrays(class_names=np.array(["a", "b"])),
                               "{path}: y_train must hold labels below the 2 class_names, got 2"),
    "float labels": (_arrays(y_train=np.zeros(6)),
                     "{path}: y_train must hold integer labels, got dtype float64"),
    "non-finite": (_arrays(x_train=np.where(np.eye(16) > 0, np.nan, _FLOATS), x_test=_FLOATS[:3]),
                   "{path}: x_train must hold finite values, got NaN or infinity"),
    "float range": (_arrays(x_train=_FLOATS * 255, x_test=_FLOATS[:3]),
                    "{path}: x_train must hold float intensities in [0, 1] (divide 0-255 values "
                    "by 255), got values from 127.5 to 127.5"),
    "int images": (_arrays(x_train=np.zeros((6, 16, 16), dtype=np.int64)),
                   "{path}: x_train must hold uint8 or float images, got dtype int64"),
    "uint8 and float": (_arrays(x_test=_FLOATS[:3, :, :, None].repeat(3, 3)),
                        "{path}: x_train and x_test must both be uint8 or both float, got uint8 "
                        "and float64"),
    "shapes differ": (_arrays(x_test=np.zeros((3, 3, 8, 8), dtype=np.uint8)),
                      "{path}: x_test must hold images of x_train's shape (C, H, W) = (3, 16, 16), "
                      "got (3, 8, 8)"),
    "not images": (_arrays(x_train=np.zeros((6, 256), dtype=np.uint8)),
                   "{path}: x_train must be images (N, H, W), (N, H, W, C) or (N, C, H, W), got "
                   "shape (6, 256)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_NPZ))
def test_a_bad_npz_file_is_one_line(tmp_path: Path, case: str) -> None:
    arrays, message = _NPZ[case]
    path = tmp_path / "data.npz"
    np.savez(path, **arrays)
    code, out = _run("train", "--dataset", str(path), *FAST)
    assert code == 2, out
    assert _one_error(out).startswith("Error: --dataset " + message.format(path=path)), out


def test_a_bad_dataset_path_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    code, out = _run("train", "--dataset", str(missing), *FAST)
    assert code == 2
    assert _one_error(out) == (
        f"Error: --dataset '{missing}' must be fashion-mnist, synthetic, an ImageFolder "
        "directory or an .npz file, got no such file or directory"
    )
    other = tmp_path / "data.csv"
    other.write_text("1,2,3")
    code, out = _run("train", "--dataset", str(other), *FAST)
    assert _one_error(out) == (
        f"Error: --dataset '{other}' must be an ImageFolder directory or an .npz file, got a "
        "file without the .npz suffix"
    )
    fake = tmp_path / "fake.npz"
    fake.write_bytes(b"PK\x03\x04 not a zip")
    code, out = _run("train", "--dataset", str(fake), *FAST)
    assert code == 2 and _one_error(out).startswith(
        f"Error: --dataset {fake} must be a readable .npz file, got BadZipFile"
    ), out
    single = tmp_path / "single.npz"
    with single.open("wb") as f:
        np.save(f, np.zeros(3))
    code, out = _run("train", "--dataset", str(single), *FAST)
    assert _one_error(out) == (
        f"Error: --dataset {single} must be an .npz archive (numpy.savez), got one array (.npy)"
    )
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, **_arrays(), class_names=np.array([{"a": 1}], dtype=object))
    code, out = _run("train", "--dataset", str(pickled), *FAST)
    assert code == 2 and _one_error(out).startswith(
        f"Error: --dataset {pickled} must be an .npz file of plain arrays, got: Object arrays "
        "cannot be loaded when allow_pickle=False"
    ), out


# -- resume ----------------------------------------------------------------------------------------


@pytest.fixture
def one_epoch(tmp_path: Path) -> tuple[Path, Path]:
    """An ImageFolder tree and the checkpoint of epoch 1 of a run on it."""
    data = write_image_folder(tmp_path / "data", per_class=8, test_per_class=2)
    run = tmp_path / "run"
    code, out = _run("train", "--dataset", str(data), "--epochs", "1", *FAST,
                     "--checkpoint-dir", str(run))  # fmt: skip
    assert code == 0, out
    return data, run


def test_resume_continues_on_the_same_data_even_moved(one_epoch: tuple[Path, Path]) -> None:
    data, run = one_epoch
    code, out = _run("train", "--resume", "--epochs", "2", "--checkpoint-dir", str(run))
    assert code == 0 and "resumed after epoch 1" in out, out
    moved = data.with_name("moved")
    data.rename(moved)
    code, out = _run("train", "--resume", "--epochs", "3", "--dataset", str(moved),
                     "--checkpoint-dir", str(run))  # fmt: skip
    assert code == 0 and "resumed after epoch 2" in out, out
    ckpt = m.load(run / "checkpoint.mpsnn")
    assert ckpt["config"]["dataset"] == str(moved) and ckpt["dataset"]["source"] == str(moved)


def test_resume_refuses_other_data(one_epoch: tuple[Path, Path], tmp_path: Path) -> None:
    data, run = one_epoch
    ckpt_path = run / "checkpoint.mpsnn"
    saved = m.load(ckpt_path)["dataset"]
    # other images at the same path: the same classes and sizes, another content
    first, second = sorted((data / "train" / CLASSES[0]).iterdir())[:2]
    shutil.copy(second, first)
    code, out = _run("train", "--resume", "--epochs", "2", "--checkpoint-dir", str(run))
    assert code == 2, out
    line = _one_error(out)
    assert line.startswith(
        f"Error: the data at {data} must be the data the run saved in {ckpt_path} trained on, "
        f"got other data: sha256 "
    ), line
    assert line.endswith("; restore that data, or start a fresh run (--overwrite)"), line
    # another dataset given on the command line: other classes
    other = tmp_path / "other.npz"
    x, y, vx, vy = easy_arrays(4, 5)
    np.savez(other, x_train=x, y_train=y % 2, x_test=vx, y_test=vy % 2)
    code, out = _run("train", "--resume", "--dataset", str(other), "--checkpoint-dir", str(run))
    assert code == 2, out
    assert (
        "kind 'npz' (saved: 'imagefolder'), class_names ['0', '1'] (saved: ['bar', 'square', "
        "'stripe'])" in _one_error(out)
    ), out
    # a named dataset instead of a path: the option differs
    code, out = _run("train", "--resume", "--dataset", "synthetic", "--checkpoint-dir", str(run))
    assert code == 2 and (
        f"got --dataset synthetic (saved: {data}); drop them" in _one_error(out)
    ), out
    # a checkpoint whose fingerprint is broken, or missing, is refused too
    ckpt = m.load(ckpt_path)
    ckpt["dataset"] = {**saved, "train": "many"}
    m.save(ckpt, ckpt_path)
    code, out = _run("train", "--resume", "--checkpoint-dir", str(run))
    assert _one_error(out).startswith(
        f"Error: {ckpt_path} is not a usable checkpoint: its dataset must be the fingerprint of "
        "the data it trained on (the fields ['class_names', 'dtype', 'kind', 'sha256', 'shape', "
        "'source', 'test', 'train']), got {"
    ), out
    del ckpt["dataset"]
    m.save(ckpt, ckpt_path)
    code, out = _run("train", "--resume", "--checkpoint-dir", str(run))
    assert _one_error(out) == (
        f"Error: {ckpt_path} is not a usable checkpoint: it must record the dataset it trained "
        f"on to resume on {data}, got none"
    ), out
