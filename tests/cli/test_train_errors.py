"""User mistakes of ``mpsnn train`` and ``mpsnn check`` end as one ``Error:`` line with exit
status 2, found before any training work where they can be: numbers, output paths, a full
disk, corrupt dataset files, sizes that cannot be allocated."""

from __future__ import annotations

import errno
import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

import mpsnn.cli.trainer as trainer_module
from tests.cli._helpers import no_training  # noqa: F401  (a fixture)
from tests.cli._helpers import run_cli as _run

SMALL = ["--dataset", "synthetic", "--limit", "64", "--test-limit", "32", "--batch-size", "32",
         "--device", "cpu"]  # fmt: skip


def _one_error(out: str) -> str:
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), out
    return lines[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lr", "inf"], "Error: --lr must be a finite number > 0, got inf"),
        (["--lr", "nan"], "Error: --lr must be a finite number > 0, got nan"),
        (["--lr-decay", "inf"], "Error: --lr-decay must be a finite number > 0, got inf"),
        (["--lr-decay", "1e200", "--epochs", "3"],
         "Error: --lr-decay 1e+200 makes the learning rate of epoch 3 (lr · decay^(epoch-1)) "
         "overflow: it must stay finite for every epoch"),
        (["--seed", "99999999999999999999999"],
         "Error: Invalid value for '--seed': 99999999999999999999999 is not in the range "
         "0<=x<=4294967295."),
        (["--seed", "-1"], "Error: Invalid value for '--seed': -1 is not in the range"),
        (["--plot", "curves.xyz"], "Error: --plot must name a file of a format matplotlib writes"),
    ],
    ids=["lr-inf", "lr-nan", "decay-inf", "decay-overflow", "seed-huge", "seed-negative",
         "plot-format"],
)  # fmt: skip
@pytest.mark.usefixtures("no_training")
def test_bad_numbers_are_refused_before_training(args: list[str], message: str) -> None:
    code, out = _run("train", *SMALL, *args)
    assert code == 2, out
    assert _one_error(out).startswith(message)


@pytest.mark.parametrize("option", ["--checkpoint-dir", "--metrics", "--plot"])
@pytest.mark.usefixtures("no_training")
def test_unwritable_paths_are_refused_before_training(tmp_path: Path, option: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where a directory must be")
    target = blocker / "sub" / ("run" if option == "--checkpoint-dir" else "out.png")
    code, out = _run("train", *SMALL, option, str(target))
    assert code == 2, out
    line = _one_error(out)
    assert line.startswith(f"Error: {option} {target} must be a")
    assert line.endswith("Not a directory"), line
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]  # the check left nothing


def test_path_checks_leave_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Checking that the metrics log and the plot can be written creates neither file (their
    directories stay: the run writes there)."""
    from mpsnn.cli.common import UserError

    def stop(*args: object) -> None:
        raise UserError("stopped before loading the data")

    monkeypatch.setattr(trainer_module, "load_dataset", stop)
    log, plot = tmp_path / "m" / "log.jsonl", tmp_path / "p" / "curves.png"
    code, out = _run("train", *SMALL, "--metrics", str(log), "--plot", str(plot))
    assert code == 2 and _one_error(out) == "Error: stopped before loading the data"
    assert log.parent.is_dir() and plot.parent.is_dir()
    assert not log.exists() and not plot.exists()


def test_a_full_disk_for_the_metrics_log(tmp_path: Path) -> None:
    code, out = _run("train", *SMALL, "--epochs", "1", "--metrics", "/dev/full")
    assert code == 2, out
    assert out.strip().splitlines()[-1] == (
        "Error: writing the metrics log /dev/full failed: No space left on device"
    )


def _disk_full(*args: object, **kwargs: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_for_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mpsnn.io.files

    monkeypatch.setattr(mpsnn.io.files, "_write_all", _disk_full)
    folder = tmp_path / "run"
    code, out = _run("train", *SMALL, "--epochs", "1", "--checkpoint-dir", str(folder))
    assert code == 2, out
    assert out.strip().splitlines()[-1] == (
        f"Error: writing the checkpoint {folder / 'checkpoint.mpsnn'} failed: No space left on "
        "device"
    )
    assert [p.name for p in folder.iterdir()] == []  # no temporary file left


def test_a_full_disk_for_the_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.figure import Figure

    monkeypatch.setattr(Figure, "savefig", _disk_full)
    plot = tmp_path / "p.png"
    code, out = _run("train", *SMALL, "--epochs", "1", "--plot", str(plot))
    assert code == 2, out
    assert out.strip().splitlines()[-1] == (
        f"Error: writing the plot {plot} failed: No space left on device"
    )


# -- dataset files ---------------------------------------------------------------------------


def _idx(magic: int, shape: tuple[int, ...], data: np.ndarray) -> bytes:
    return struct.pack(">I", magic) + struct.pack(f">{len(shape)}I", *shape) + data.tobytes()


def _dataset(root: Path, edit: dict[str, bytes] | None = None) -> Path:
    """Small Fashion-MNIST files (64 train, 32 test images) in ``root/fashion-mnist``; ``edit``
    replaces a file's bytes (written as they are: no gzip)."""
    folder = root / "fashion-mnist"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 64), ("t10k", 32)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        files = {f"{prefix}-images-idx3-ubyte.gz": _idx(2051, (n, 28, 28), images),
                 f"{prefix}-labels-idx1-ubyte.gz": _idx(2049, (n,), labels)}  # fmt: skip
        for name, raw in files.items():
            if edit and name in edit:
                (folder / name).write_bytes(edit[name])
            else:
                (folder / name).write_bytes(gzip.compress(raw))
    return root


def _labels(values: list[int], count: int | None = None) -> bytes:
    n = len(values) if count is None else count
    return gzip.compress(_idx(2049, (n,), np.array(values, dtype=np.uint8)))


def test_small_dataset_files_train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPSNN_DATA", str(_dataset(tmp_path)))
    code, out = _run("train", "--batch-size", "32", "--epochs", "1", "--device", "cpu")
    assert code == 0, out
    assert "(64 train / 32 test images)" in out


_TRAIN_IMAGES = "train-images-idx3-ubyte.gz"
_TRAIN_LABELS = "train-labels-idx1-ubyte.gz"
_TEST_LABELS = "t10k-labels-idx1-ubyte.gz"
_WHOLE = gzip.compress(_idx(2051, (64, 28, 28), np.zeros((64, 28, 28), np.uint8)))


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        (_TRAIN_IMAGES, b"plain text, not gzip",
         "must be a complete gzip-compressed idx file, got BadGzipFile: Not a gzipped file"),
        (_TRAIN_IMAGES, _WHOLE[: len(_WHOLE) // 2],
         "must be a complete gzip-compressed idx file, got EOFError: Compressed file ended"),
        (_TRAIN_LABELS, gzip.compress(_idx(2051, (64,), np.zeros(64, np.uint8))),
         "must be an idx file with magic 2049, got 2051"),
        (_TRAIN_LABELS, _labels([1] * 60),
         "must hold one label per image of train-images-idx3-ubyte.gz (64), got 60"),
        (_TRAIN_LABELS, _labels([1] * 64, count=70),
         "must hold the 70 bytes of its header's shape (70,), got 64"),
        (_TEST_LABELS, _labels([3, 12] + [0] * 30), "must hold labels 0 to 9, got 12 at index 1"),
        (_TRAIN_LABELS, gzip.compress(b"\x00\x00"), "must hold an idx header of 8 bytes, got 2"),
    ],
    ids=["not-gzip", "truncated-gzip", "magic", "fewer-labels", "short", "label-12", "header"],
)  # fmt: skip
def test_corrupt_dataset_files_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, data: bytes, message: str
) -> None:
    root = _dataset(tmp_path, {name: data})
    monkeypatch.setenv("MPSNN_DATA", str(root))
    code, out = _run("train", "--batch-size", "32", "--epochs", "1", "--device", "cpu")
    assert code == 2, out
    line = _one_error(out)
    assert line.startswith(f"Error: {root / 'fashion-mnist' / name} {message}"), line


# -- mpsnn check -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["convolution", "--size", "100000x100000x1000"],
         "Error: this configuration needs more memory than can be allocated here (a tensor of "
         "149,011.6 GiB): use smaller sizes"),
        (["pad", "--pad-before", "1000000000,1000000000,0"],
         "Error: this configuration needs more memory than can be allocated here (a tensor of "
         "sizes [2, 4, 1000000009, 1000000010], more bytes than an address can count)"),
        (["convolution", "--seed", "99999999999999999999"],
         "Error: Invalid value for '--seed': 99999999999999999999 is not in the range"),
    ],
)  # fmt: skip
def test_check_with_sizes_that_cannot_be_allocated(args: list[str], message: str) -> None:
    code, out = _run("check", *args)
    assert code == 2, out
    assert _one_error(out).startswith(message)


def test_bench_refuses_an_unwritable_json_path_before_timing(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    target = blocker / "out.json"
    code, out = _run("bench", "--model", "lenet", "--device", "cpu", "--json", str(target),
                     "--variants", "mpsnn-eager", "--steps", "1", "--trials", "1")  # fmt: skip
    assert code == 2, out
    assert _one_error(out) == (
        f"Error: --json {target} must be a file mpsnn can write, got: {blocker} is not a directory"
    )
