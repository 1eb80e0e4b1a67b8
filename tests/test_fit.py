"""`mpsnn.fit`: training from Python on tensors, NumPy arrays, a Dataset and a DataLoader, with
an augmentation hook; the same steps as ``mpsnn train`` (bit for bit on the CPU); and its
errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import mpsnn as m
from mpsnn.data import input_statistics, standardize
from mpsnn.models import LeNet5, SmallCNN
from tests.own_data import easy_arrays

DEV = m.Device("cpu")


def _model(seed: int = 0, **kwargs: object) -> SmallCNN:
    opt = m.Adam(DEV, descriptor=m.OptimizerDescriptor(learning_rate=1e-3))
    return SmallCNN(DEV, opt, seed=seed, input_shape=(3, 16, 16), classes=3, **kwargs)


@pytest.fixture(scope="module")
def arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """NCHW uint8 images and int64 labels: 180 training and 60 test images."""
    x, y, vx, vy = easy_arrays()
    return x.transpose(0, 3, 1, 2).copy(), y, vx.transpose(0, 3, 1, 2).copy(), vy


def _standardized(arrays):
    x, y, vx, vy = (torch.from_numpy(a) for a in arrays)
    stats = input_statistics(x)
    return (standardize(x, *stats), y), (standardize(vx, *stats), vy)


def test_fit_on_tensors_learns_and_reports_each_epoch(arrays) -> None:
    train, test = _standardized(arrays)
    seen: list[dict] = []
    steps: list[tuple] = []
    history = m.fit(_model(), train, test, epochs=2, batch_size=16, on_epoch=seen.append,
                    progress=lambda *a: steps.append(a))  # fmt: skip
    assert isinstance(history, m.History) and len(history) == 2 and seen == history.records
    assert [r["epoch"] for r in history] == [1, 2]
    assert history.test_accuracy[-1] >= 0.9, history.records
    assert history.train_loss[1] < history.train_loss[0]
    assert set(history[0]) == {"epoch", "lr", "train_loss", "train_accuracy", "test_accuracy",
                                "train_seconds", "images_per_second"}  # fmt: skip
    assert history[0]["lr"] == pytest.approx(1e-3)
    # 180 // 16 = 11 steps an epoch: progress after step 11 (the last) of each
    assert [(s[0], s[1]) for s in steps] == [(11, 11), (11, 11)]


def test_fit_on_numpy_arrays_without_a_test_set(arrays) -> None:
    """uint8 arrays go in as bytes (read as k / 255); ``lr`` as a function of the epoch."""
    x, y, _, _ = arrays
    model = _model()
    rates: list[float] = []
    history = m.fit(model, (x, y), epochs=3, batch_size=32, lr=lambda e: 2e-3 / e,
                    on_epoch=lambda r: rates.append(r["lr"]))  # fmt: skip
    assert rates == pytest.approx([2e-3, 1e-3, 2e-3 / 3])
    assert history.test_accuracy == [None, None, None]
    assert history.train_accuracy[-1] >= 0.9, history.records


def test_fit_on_a_dataset_calls_the_augmentation_hook(arrays) -> None:
    train, test = _standardized(arrays)
    calls: list[tuple] = []

    def augment(batch: torch.Tensor) -> torch.Tensor:
        calls.append((tuple(batch.shape), batch.device, batch.dtype))
        half = len(batch) // 2  # half of each batch flipped horizontally: the same classes
        return torch.cat([torch.flip(batch[:half], dims=[3]), batch[half:]])

    history = m.fit(_model(), TensorDataset(*train), TensorDataset(*test), epochs=2,
                    batch_size=16, augment=augment)  # fmt: skip
    assert calls == [((16, 3, 16, 16), torch.device("cpu"), torch.float32)] * 22
    assert history.test_accuracy[-1] >= 0.9, history.records


def test_fit_on_a_data_loader_keeps_its_last_partial_batch(arrays) -> None:
    train, test = _standardized(arrays)
    calls: list[int] = []

    def augment(batch: torch.Tensor) -> torch.Tensor:
        calls.append(len(batch))
        return batch + 0.01 * torch.randn_like(batch)

    loader = DataLoader(TensorDataset(*train), batch_size=32, shuffle=True,
                        generator=torch.Generator().manual_seed(0))  # fmt: skip
    history = m.fit(_model(), loader, DataLoader(TensorDataset(*test), batch_size=25),
                    epochs=2, augment=augment)  # fmt: skip
    assert calls == [32, 32, 32, 32, 32, 20] * 2  # 180 images: the last batch has 20
    assert history.test_accuracy[-1] >= 0.9, history.records
    assert 0 <= history.train_accuracy[0] <= 1


def test_fit_runs_the_steps_of_mpsnn_train(arrays, tmp_path: Path) -> None:
    """The same model, data, order, batch and schedule: `fit` and ``mpsnn train`` give the same
    weights, bit for bit on the CPU (the command's loop is `TrainingLoop`, as fit's)."""
    from click.testing import CliRunner

    from mpsnn.cli import main

    x, y, vx, vy = arrays
    path = tmp_path / "data.npz"
    np.savez(path, x_train=x, y_train=y, x_test=vx, y_test=vy)
    run = tmp_path / "run"
    result = CliRunner().invoke(main, ["train", "--dataset", str(path), "--epochs", "2",
                                       "--batch-size", "32", "--device", "cpu",
                                       "--checkpoint-dir", str(run)])  # fmt: skip
    assert result.exit_code == 0, result.output
    train, test = _standardized(arrays)
    model = _model()
    history = m.fit(model, train, test, epochs=2, batch_size=32, lr=lambda e: 1e-3 * 0.6 ** (e - 1))
    ckpt = m.load(run / "checkpoint.mpsnn")
    for saved, ds in zip(ckpt["data_sources"], model.data_sources, strict=True):
        assert torch.equal(saved.weights(), ds.weights())
        assert torch.equal(saved.bias_terms(), ds.bias_terms())
    for key in ("train_loss", "train_accuracy", "test_accuracy", "lr"):
        assert [r[key] for r in ckpt["history"]] == history.column(key), key


def test_lenet_adapts_and_trains(arrays) -> None:
    train, test = _standardized(arrays)
    opt = m.SGD(DEV, momentum_scale=0.9, descriptor=m.OptimizerDescriptor(learning_rate=0.05))
    model = LeNet5(DEV, opt, input_shape=(3, 16, 16), classes=3)
    history = m.fit(model, train, test, epochs=3, batch_size=16)
    assert history.test_accuracy[-1] >= 0.9, history.records


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda d: m.fit(SmallCNN(DEV, input_shape=(3, 16, 16), classes=3), d), ValueError,
         r"\[fit\] the model's layers must hold an optimizer to train, got none"),
        (lambda d: m.fit(_model(), (d[0][:, :1], d[1])), ValueError,
         r"\[fit\] train's images must be \(N, C, H, W\) = \(N, 3, 16, 16\) \(the model's "
         r"input_shape\), got \(180, 1, 16, 16\)"),
        (lambda d: m.fit(_model(), (d[0], d[1] + 1)), ValueError,
         r"\[fit\] train's labels must be from 0 to 2 \(the model's classes\), got 3"),
        (lambda d: m.fit(_model(), (d[0], d[1].float())), ValueError,
         r"\[fit\] train's labels must be integers, got torch.float32"),
        (lambda d: m.fit(_model(), (d[0], d[1][:5])), ValueError,
         r"\[fit\] train's labels must be one per image \(180,\), got \(5,\)"),
        (lambda d: m.fit(_model(), d, batch_size=200), ValueError,
         r"\[fit\] batch_size must be <= the 180 training images, got 200"),
        (lambda d: m.fit(_model(), d, epochs=0), ValueError,
         r"\[fit\] epochs must be an int >= 1, got 0"),
        (lambda d: m.fit(_model(), d, epochs=2, lr=lambda e: 1e-3 if e == 1 else float("nan")),
         ValueError, r"\[fit\] lr must be a finite number > 0 or a function of the epoch "
         r"returning one, got nan for epoch 2"),
        (lambda d: m.fit(_model(), d, augment=lambda b: b[:, :2]), ValueError,
         r"\[fit\] augment must return a batch of shape \(64, 3, 16, 16\), got "
         r"\(64, 2, 16, 16\)"),
        (lambda d: m.fit(_model(), d[0]), TypeError,
         r"\[fit\] train must be \(images, labels\) tensors or NumPy arrays, a "
         r"torch.utils.data.Dataset or a DataLoader, got Tensor"),
        (lambda d: m.fit(_model(), (d[0], list(range(180)))), TypeError,
         r"\[fit\] train's labels must be a tensor or a NumPy array, got list"),
        (lambda d: m.fit(_model(), DataLoader(TensorDataset(*d), batch_size=8), batch_size=16),
         ValueError, r"\[fit\] batch_size must be the DataLoader's \(8\) or None, got 16"),
    ],
    ids=["no optimizer", "shape", "label range", "float labels", "label count", "batch",
         "epochs", "lr", "augment", "not a pair", "labels type", "loader batch"],
)  # fmt: skip
def test_fit_errors(arrays, call, error: type, message: str) -> None:
    x, y = torch.from_numpy(arrays[0]), torch.from_numpy(arrays[1])
    with pytest.raises(error, match=message):
        call((x, y))


def test_the_documented_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/training.md's example (its first Python block) runs and learns."""
    import re

    doc = (Path(__file__).resolve().parents[1] / "docs" / "training.md").read_text()
    code = re.search(r"```python\n(.*?)```", doc, re.S).group(1)  # type: ignore[union-attr]
    exec(compile(code, "docs/training.md", "exec"), {})
    assert "epoch 3: test accuracy" in capsys.readouterr().out
