"""``mpsnn export`` and ``mpsnn predict`` from a checkpoint alone: a run trained on an ``.npz``
file records its input standardization, so after the file is moved away the exported weights,
their metadata and the predictions are those of before; a checkpoint of an older version
(without the standardization) still works while its data is there; and the messages of these
commands name no option they lack (``--dataset``, ``--overwrite``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import mpsnn as m
from mpsnn.cli import main
from mpsnn.cli.trained import open_checkpoint
from mpsnn.data import input_statistics

CLASS_NAMES = ["ant", "bee", "cat"]


def _run(*args: object) -> tuple[int, str, str]:
    result = CliRunner(env={"COLUMNS": "200"}).invoke(main, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def _error(code: int, out: str, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("Error: "), err
    return lines[0]


def _npz(path: Path, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (80, 1, 16, 16), generator=g, dtype=torch.uint8)
    y = torch.randint(0, 3, (80,), generator=g)
    np.savez(path, x_train=x[:64].numpy(), y_train=y[:64].numpy(), x_test=x[64:].numpy(),
             y_test=y[64:].numpy(), class_names=np.array(CLASS_NAMES))  # fmt: skip
    return path


def _pngs(folder: Path, data: Path) -> list[Path]:
    from PIL import Image

    images = np.load(data)["x_test"][:4]
    files = [folder / f"{i}.png" for i in range(len(images))]
    for f, image in zip(files, images, strict=True):
        Image.fromarray(image[0], "L").save(f)
    return files


def _outputs(folder: Path, out: Path, files: list[Path]) -> dict[str, object]:
    """What export (.pt, .safetensors) and predict give for the run in ``folder``."""
    from safetensors import safe_open

    result: dict[str, object] = {}
    for suffix in (".pt", ".safetensors"):
        code, text, err = _run("export", folder, out / f"model{suffix}")
        assert code == 0 and err == "", err
        result[suffix + " line"] = text.replace(str(out), "OUT")
    result["pt"] = torch.load(out / "model.pt", weights_only=True)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        result["meta"] = f.metadata()
        result["st"] = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    code, text, err = _run("predict", folder, *files, "--json")
    assert code == 0 and err == "", err
    result["predict"] = json.loads(text)
    return result


def _same(a: dict[str, object], b: dict[str, object]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if key in ("pt", "st"):
            assert a[key].keys() == b[key].keys()  # type: ignore[attr-defined]
            for name in a[key]:  # type: ignore[attr-defined]
                assert torch.equal(a[key][name], b[key][name]), name  # type: ignore[index]
        else:
            assert a[key] == b[key], key


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 1-epoch run on an .npz file: (its checkpoint directory, the file)."""
    root = tmp_path_factory.mktemp("checkpoint_only")
    data = _npz(root / "data.npz")
    folder = root / "run"
    code, out, err = _run("train", "--dataset", data, "--model", "cnn", "--epochs", "1",
                          "--batch-size", "16", "--device", "cpu", "--checkpoint-dir", folder)  # fmt: skip
    assert code == 0, out + err
    return folder, data


def test_the_checkpoint_records_the_input_standardization(trained: tuple[Path, Path]) -> None:
    folder, data = trained
    ckpt = m.load(folder / "checkpoint.mpsnn")
    x = torch.from_numpy(np.load(data)["x_train"])
    mean, std = input_statistics(x)
    assert ckpt["inputs"] == {"mean": float(mean), "std": float(std)}
    assert all(type(v) is float for v in ckpt["inputs"].values())


def test_export_and_predict_need_only_the_checkpoint(
    trained: tuple[Path, Path], tmp_path: Path
) -> None:
    folder, data = trained
    files = _pngs(tmp_path, data)
    (tmp_path / "before").mkdir()
    (tmp_path / "after").mkdir()
    before = _outputs(folder, tmp_path / "before", files)
    assert before["predict"][0]["class_name"] in CLASS_NAMES  # type: ignore[index]
    assert json.loads(before["meta"]["class_names"]) == CLASS_NAMES  # type: ignore[index]
    moved = tmp_path / "moved.npz"
    data.rename(moved)
    try:
        after = _outputs(folder, tmp_path / "after", files)
        run = open_checkpoint(folder, "cpu", read_data=False)
        assert not run.has_data and run.class_names == CLASS_NAMES
        assert run.input_shape == (1, 16, 16)
        # eval on the moved data: the run's own test images there, its recorded accuracy
        code, out, err = _run("eval", folder, "--dataset", moved, "--json")
        assert code == 0, err
        recorded = m.load(folder / "checkpoint.mpsnn")["history"][-1]["test_accuracy"]
        assert json.loads(out)["accuracy"] == recorded and json.loads(out)["count"] == 16
    finally:
        moved.rename(data)
    _same(before, after)


def _older(folder: Path, tmp_path: Path) -> Path:
    """The run's checkpoint as an older mpsnn wrote it: without ``inputs``."""
    ckpt = m.load(folder / "checkpoint.mpsnn")
    del ckpt["inputs"]
    old = tmp_path / "old"
    old.mkdir()
    m.save(ckpt, old / "checkpoint.mpsnn")
    return old


def test_an_older_checkpoint_reads_its_data(trained: tuple[Path, Path], tmp_path: Path) -> None:
    folder, data = trained
    old = _older(folder, tmp_path)
    files = _pngs(tmp_path, data)
    for name in ("out_new", "out_old"):
        (tmp_path / name).mkdir()
    _same(_outputs(folder, tmp_path / "out_new", files),
          _outputs(old, tmp_path / "out_old", files))  # fmt: skip
    moved = tmp_path / "moved.npz"
    data.rename(moved)
    try:
        for args in (["export", old, tmp_path / "x.pt"], ["predict", old, files[0]]):
            line = _error(*_run(*args))
            assert line.startswith(
                f"Error: {old / 'checkpoint.mpsnn'} records no input standardization (a "
                "checkpoint of an older mpsnn), so the data it trained on must be readable "
                f"where it was to compute it, got: '{data}' must be"
            ), line
            assert "--dataset" not in line and "--overwrite" not in line
        _npz(data, seed=1)  # other data where the run's was
        for args in (["export", old, tmp_path / "x.pt"], ["predict", old, files[0]]):
            line = _error(*_run(*args))
            assert line.startswith(f"Error: the data at {data} must be the data the run saved"), (
                line
            )
            assert line.endswith("; restore that data"), line
            assert "--dataset" not in line and "--overwrite" not in line
    finally:
        moved.replace(data)


@pytest.mark.parametrize(
    "inputs",
    [
        {"mean": 0.5},
        {"mean": 0.5, "std": 0.0},
        {"mean": "0.5", "std": 1.0},
        {"mean": float("nan"), "std": 1.0},
        [0.5, 1.0],
    ],
)
def test_a_broken_input_standardization_is_refused(
    trained: tuple[Path, Path], tmp_path: Path, inputs: object
) -> None:
    folder, _ = trained
    ckpt = m.load(folder / "checkpoint.mpsnn")
    ckpt["inputs"] = inputs
    m.save(ckpt, tmp_path / "checkpoint.mpsnn")
    line = _error(*_run("export", tmp_path, tmp_path / "x.pt"))
    assert line.startswith(
        f"Error: {tmp_path / 'checkpoint.mpsnn'} is not a usable checkpoint: its inputs must "
        "be the input standardization {'mean': a finite number, 'std': a finite number > 0}"
    ), line
