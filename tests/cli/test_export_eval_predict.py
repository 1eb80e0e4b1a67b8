"""``mpsnn export``, ``mpsnn eval`` and ``mpsnn predict`` on a LeNet-5 trained by ``mpsnn
train`` on 256 Fashion-MNIST images: the exported weights load into the PyTorch twin and back
into an mpsnn model with the inference graph's predictions, the ONNX network is valid and
predicts the same, eval reproduces the run's recorded test accuracy, predict classifies image
files as the inference graph does, and mistakes are one ``Error:`` line with exit status 2."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

import mpsnn as m
from mpsnn.cli import main
from mpsnn.cli.predict import read_image
from mpsnn.cli.trained import TrainedModel, open_checkpoint
from mpsnn.data.fashion_mnist import CLASSES, load_fashion_mnist
from mpsnn.models import LeNet5

TRAIN = ["--model", "lenet", "--limit", "256", "--test-limit", "200", "--batch-size", "32",
         "--epochs", "2", "--device", "cpu"]  # fmt: skip


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner(env={"COLUMNS": "200"}).invoke(main, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def _one_error(code: int, out: str, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("Error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run's checkpoint directory (checkpoint.mpsnn and metrics.jsonl)."""
    path = tmp_path_factory.mktemp("run")
    code, out, err = _run("train", *TRAIN, "--checkpoint-dir", path)
    assert code == 0, out + err
    return path


@pytest.fixture(scope="module")
def run(folder: Path) -> TrainedModel:
    return open_checkpoint(folder, "cpu")


@pytest.fixture(scope="module")
def graph_logits(run: TrainedModel) -> torch.Tensor:
    """The inference graph's logits of the run's 200 test images."""
    return run.logits(run.trainer.test_x)


def _twin_logits(state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    twin = LeNet5(m.Device("cpu"), seed=5).twin  # other initial weights: all come from state
    twin.load_state_dict(state)
    with torch.no_grad():
        return twin.eval()(x)


def test_exported_pt_and_safetensors_agree_and_predict_as_the_inference_graph(
    folder: Path, tmp_path: Path, run: TrainedModel, graph_logits: torch.Tensor
) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    pt, st = tmp_path / "lenet.pt", tmp_path / "lenet.safetensors"
    for out in (pt, st):
        code, text, err = _run("export", folder, out)
        assert code == 0 and err == "", err
        assert f"exported lenet (epoch 2, 61,706 parameters) to {out}" in text
    a, b = torch.load(pt, weights_only=True), load_file(st)
    assert list(a) == list(LeNet5(m.Device("cpu")).twin.state_dict())
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    x = run.trainer.test_x
    twin = _twin_logits(a, x)
    torch.testing.assert_close(twin, graph_logits, rtol=1e-4, atol=1e-4)
    assert torch.equal(twin.argmax(1), graph_logits.argmax(1))
    # the metadata says how to prepare images for the twin: the run's own preparation
    with safe_open(st, "pt") as f:
        meta = f.metadata()
    assert meta["model"] == "lenet" and meta["dataset"] == "fashion-mnist" and meta["epoch"] == "2"
    assert json.loads(meta["input_shape"]) == [1, 28, 28]
    assert json.loads(meta["class_names"]) == list(CLASSES)
    raw = run.trainer.data.test_x
    prepared = (raw.float() / 255 - float(meta["mean"])) / float(meta["std"])
    torch.testing.assert_close(prepared, x, rtol=1e-6, atol=1e-6)


def test_an_exported_state_dict_loads_back_into_an_mpsnn_model(
    folder: Path, tmp_path: Path, run: TrainedModel, graph_logits: torch.Tensor
) -> None:
    """The way back: the .safetensors tensors into a fresh LeNet5 give the checkpoint's
    weights exactly, hence the inference graph's logits exactly."""
    from safetensors.torch import load_file

    out = tmp_path / "lenet.safetensors"
    assert _run("export", folder, out)[0] == 0
    dev = m.Device("cpu")
    model = LeNet5(dev, seed=9)
    model.load_state_dict(load_file(out))
    for mine, saved in zip(model.data_sources, run.model.data_sources, strict=True):
        assert torch.equal(mine.weights(), saved.weights())
        assert torch.equal(mine.bias_terms(), saved.bias_terms())
    cb = dev.new_command_queue().command_buffer()
    result = model.inference_graph().encode_batch(
        cb, [m.ImageBatch.from_tensor(run.trainer.test_x)]
    )
    cb.commit()
    cb.wait_until_completed()
    assert torch.equal(result.tensor.flatten(1), graph_logits)


def test_exported_onnx_is_valid_and_predicts_as_the_inference_graph(
    folder: Path, tmp_path: Path, run: TrainedModel, graph_logits: torch.Tensor
) -> None:
    import onnx
    import onnxruntime

    out = tmp_path / "lenet.onnx"
    code, text, err = _run("export", folder, out)
    assert code == 0 and err == "", err
    assert text.count("\n") == 1 and "(ONNX inference network)" in text  # the exporter is quiet
    proto = onnx.load(str(out))
    onnx.checker.check_model(proto, full_check=True)
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta["model"] == "lenet" and json.loads(meta["class_names"]) == list(CLASSES)
    assert [i.name for i in proto.graph.input] == ["image"]
    assert [o.name for o in proto.graph.output] == ["logits"]
    assert not list(tmp_path.glob("*.data")) and not list(tmp_path.glob(".*.tmp"))
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    x = run.trainer.test_x
    for batch in (x[:1], x):  # the batch size is free
        (logits,) = session.run(None, {"image": batch.numpy()})
        want = graph_logits[: len(batch)]
        assert np.array_equal(logits.argmax(1), want.argmax(1).numpy())
        torch.testing.assert_close(torch.from_numpy(logits), want, rtol=1e-4, atol=1e-4)


def test_onnx_export_without_its_packages_names_them(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "onnx" else find(name, *a)
    )
    line = _one_error(*_run("export", folder, tmp_path / "x.onnx"))
    assert line == "Error: exporting to .onnx needs the package onnx: pip install onnx"
    assert not (tmp_path / "x.onnx").exists()


def test_eval_equals_the_test_accuracy_the_run_recorded(
    folder: Path, run: TrainedModel, graph_logits: torch.Tensor
) -> None:
    code, out, err = _run("eval", folder / "checkpoint.mpsnn", "--json")
    assert code == 0 and err == "", err
    result = json.loads(out)
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    records = [r for r in records if r.get("kind", "epoch") == "epoch"]  # (not per-step ones)
    assert (
        result["accuracy"]
        == records[-1]["test_accuracy"]
        == run.checkpoint["history"][-1]["test_accuracy"]
    )
    assert result["count"] == 200 and result["dataset"] == "fashion-mnist"
    assert result["correct"] == round(result["accuracy"] * 200) and result["epoch"] == 2
    # the inference graph's logits of this process give the same count and loss
    y = run.trainer.test_y
    assert result["correct"] == int((graph_logits.argmax(1) == y).sum())
    want = float(F.cross_entropy(graph_logits.double(), y, reduction="sum")) / len(y)
    assert result["loss"] == pytest.approx(want, rel=1e-12)
    # the loss: mean softmax cross-entropy of the logits, checked through the exported twin
    twin = _twin_logits(run.model.state_dict(), run.trainer.test_x)
    assert result["loss"] == pytest.approx(float(F.cross_entropy(twin.double(), y)), rel=1e-5)
    code, out, _ = _run("eval", folder)  # the directory works too; text output
    assert code == 0
    assert out.startswith("lenet after epoch 2 on the fashion-mnist test split (200 images): ")
    assert f"accuracy {result['accuracy']:.4f} ({result['correct']}/200), loss " in out


def test_eval_on_more_test_images_and_another_dataset(
    folder: Path, tmp_path: Path, run: TrainedModel
) -> None:
    code, out, _ = _run("eval", folder, "--test-limit", "300", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["count"] == 300
    images, labels = load_fashion_mnist("test")
    x, labels = run.prepare(images[:300]), labels[:300]
    assert result["correct"] == int((run.logits(x).argmax(1) == labels).sum())
    # a user dataset (an .npz file) holding the same 300 test images: the same hits
    npz = tmp_path / "mine.npz"
    np.savez(npz, x_train=images[:50].numpy(), y_train=labels[:50].numpy(),
             x_test=images[:300].numpy(), y_test=labels.numpy(), class_names=np.array(CLASSES))  # fmt: skip
    code, out, err = _run("eval", folder, "--dataset", npz, "--json")
    assert code == 0, err
    mine = json.loads(out)
    assert mine["count"] == 300 and mine["dataset"] == str(npz)
    assert mine["correct"] == result["correct"] and mine["loss"] == pytest.approx(result["loss"])
    code, out, _ = _run("eval", folder, "--dataset", "synthetic", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["dataset"] == "synthetic" and result["count"] == 2000
    assert 0 <= result["accuracy"] <= 1 and result["loss"] > 0


def _png(path: Path, image: torch.Tensor, mode: str = "L") -> Path:
    from PIL import Image

    gray = Image.fromarray(image.squeeze(0).numpy(), "L")
    (gray if mode == "L" else gray.convert(mode)).save(path)
    return path


def test_predict_classifies_png_files_as_the_inference_graph(
    folder: Path, tmp_path: Path, run: TrainedModel, graph_logits: torch.Tensor
) -> None:
    raw = run.trainer.data.test_x
    files = [_png(tmp_path / f"{i}.png", raw[i]) for i in range(6)]
    files.append(_png(tmp_path / "rgb.png", raw[6], "RGB"))  # gray in RGB: the same luma
    code, out, err = _run("predict", folder, *files, "--json")
    assert code == 0 and err == "", err
    rows = json.loads(out)
    want = graph_logits[:7].argmax(1).tolist()
    assert [r["file"] for r in rows] == [str(f) for f in files]
    assert [r["class_index"] for r in rows] == want
    assert [r["class_name"] for r in rows] == [CLASSES[i] for i in want]
    probabilities = torch.softmax(graph_logits[:7].double(), 1).max(1).values
    for r, p in zip(rows, probabilities.tolist(), strict=True):
        assert set(r) == {"file", "class_index", "class_name", "probability"}
        assert r["probability"] == pytest.approx(p, rel=1e-6)
    code, out, _ = _run("predict", folder, files[0], files[1])
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "file\tclass_index\tclass_name\tprobability"
    assert lines[1].split("\t")[:3] == [str(files[0]), str(want[0]), CLASSES[want[0]]]
    assert len(lines) == 3


def test_predict_refuses_another_size_unless_resize(
    folder: Path, tmp_path: Path, run: TrainedModel
) -> None:
    from PIL import Image

    big = tmp_path / "big.png"
    Image.fromarray(run.trainer.data.test_x[0, 0].numpy(), "L").resize((56, 42)).save(big)
    line = _one_error(*_run("predict", folder, big))
    assert line == (
        f"Error: {big} must be a 28x28 image (width x height, the model's input), got 56x42; "
        "or scale it with --resize"
    )
    code, out, _ = _run("predict", folder, big, "--resize", "--json")
    assert code == 0 and json.loads(out)[0]["class_name"] in CLASSES


def test_mistakes_are_one_error_line(folder: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "checkpoint.mpsnn"
    for args in (["export", missing, tmp_path / "a.pt"], ["eval", missing],
                 ["predict", missing, tmp_path / "a.png"]):  # fmt: skip
        line = _one_error(*_run(*args))
        assert line.startswith("Error: CHECKPOINT must be a checkpoint written by mpsnn train")
        assert str(missing) in line
    line = _one_error(*_run("export", folder, tmp_path / "model.h5"))
    assert (
        line
        == f"Error: OUT must end in .pt, .safetensors, .onnx (the format), got '{tmp_path / 'model.h5'}'"
    )
    assert not (tmp_path / "model.h5").exists()
    not_image = tmp_path / "notes.png"
    not_image.write_text("not an image")
    line = _one_error(*_run("predict", folder, not_image))
    assert line.startswith(f"Error: {not_image} must be an image file Pillow can read")
    blocked = not_image / "model.pt"  # a file stands where OUT's directory must be
    line = _one_error(*_run("export", folder, blocked))
    assert line.startswith(f"Error: writing {blocked} failed: ")
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    truncated = tmp_path / "cut.png"
    _png(tmp_path / "whole.png", torch.full((1, 28, 28), 7, dtype=torch.uint8))
    truncated.write_bytes((tmp_path / "whole.png").read_bytes()[:40])
    assert _one_error(*_run("predict", folder, truncated)).startswith(f"Error: {truncated} must be")
    line = _one_error(*_run("predict", folder, tmp_path / "absent.png"))
    assert line == (
        f"Error: {tmp_path / 'absent.png'} must be an image file Pillow can read (PNG, JPEG, ...), "
        "got: No such file or directory"
    )
    other = tmp_path / "weights.safetensors"
    assert _run("export", folder, other)[0] == 0
    line = _one_error(*_run("eval", other))
    assert line.startswith(f"Error: {other} is not a usable checkpoint")
    line = _one_error(*_run("eval", folder, "--dataset", "imagenet"))
    assert "imagenet" in line


def test_a_user_datasets_class_names_and_channels(tmp_path: Path) -> None:
    """A model trained on an ImageFolder tree of 12×12 RGB images: predict names the class
    folders, reads an image's colours as the tree's images were read, and eval reproduces the
    run's test accuracy."""
    from PIL import Image

    g = torch.Generator().manual_seed(0)
    root = tmp_path / "shapes"
    colours = {"blue": (0, 0, 255), "green": (0, 200, 0), "red": (255, 0, 0)}
    for split, count in (("train", 24), ("test", 6)):
        for name, rgb in colours.items():
            (root / split / name).mkdir(parents=True)
            for i in range(count):
                noise = torch.randint(0, 60, (12, 12, 3), generator=g, dtype=torch.uint8)
                pixels = (torch.tensor(rgb, dtype=torch.uint8) * 0.75).to(torch.uint8) + noise
                Image.fromarray(pixels.numpy(), "RGB").save(root / split / name / f"{i}.png")
    folder = tmp_path / "run"
    code, out, err = _run("train", "--dataset", root, "--model", "cnn", "--epochs", "3",
                          "--batch-size", "8", "--lr", "0.003", "--device", "cpu",
                          "--checkpoint-dir", folder)  # fmt: skip
    assert code == 0, out + err
    code, out, _ = _run("eval", folder, "--json")
    result = json.loads(out)
    assert result["accuracy"] == m.load(folder / "checkpoint.mpsnn")["history"][-1]["test_accuracy"]
    assert result["count"] == 18
    files = [root / "test" / name / "0.png" for name in colours]
    code, out, err = _run("predict", folder, *files, "--json")
    assert code == 0, err
    rows = json.loads(out)
    run = open_checkpoint(folder, "cpu")
    assert run.input_shape == (3, 12, 12) and run.class_names == ["blue", "green", "red"]
    images = torch.stack([run.trainer.data.test_x[6 * k] for k in range(3)])  # each class's 0.png
    for file, image in zip(files, images, strict=True):  # the same bytes as the tree's reader
        assert torch.equal(read_image(file, run.input_shape), image)
    want = run.logits(run.prepare(images)).argmax(1).tolist()
    assert [r["class_index"] for r in rows] == want
    assert [r["class_name"] for r in rows] == [run.class_names[i] for i in want]
