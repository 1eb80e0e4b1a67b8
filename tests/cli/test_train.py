"""``mpsnn train`` and ``mpsnn bench`` end to end on small subsets: progress and tables, the
metrics log, the plot, checkpoints, exact resume, and one-line errors with exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mpsnn as m
from tests.cli._helpers import run_cli as _run

SMALL = ["--limit", "256", "--test-limit", "200", "--batch-size", "32"]


def test_train_prints_progress_writes_metrics_checkpoint_and_plot(tmp_path: Path) -> None:
    folder, plot = tmp_path / "run", tmp_path / "curves.png"
    code, out = _run("train", *SMALL, "--epochs", "2", "--checkpoint-dir", str(folder),
                     "--plot", str(plot), "--device", "cpu")  # fmt: skip
    assert code == 0, out
    assert "mpsnn train: cnn (421,642 parameters) on fashion-mnist (256 train / 200 test" in out
    assert "mpsnn epoch   1  loss" in out and "mpsnn epoch   2  loss" in out
    assert "per epoch" in out and "summary" in out
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if r["kind"] == "epoch"]  # not "step"
    assert [r["epoch"] for r in records] == [1, 2]
    for r in records:
        assert r["framework"] == "mpsnn"
        assert 0 < r["train_loss"] < 5 and 0 <= r["test_accuracy"] <= 1
        assert r["images_per_second"] > 0 and r["lr"] > 0
    assert records[1]["lr"] == pytest.approx(records[0]["lr"] * 0.6)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    ckpt = m.load(folder / "checkpoint.mpsnn")
    assert ckpt["kind"] == "mpsnn-train" and ckpt["epoch"] == 2 and len(ckpt["history"]) == 2


def _weights(folder: Path) -> list[torch.Tensor]:
    ckpt = m.load(folder / "checkpoint.mpsnn")
    out = []
    for ds in ckpt["data_sources"]:
        out += [ds.weights(), ds.bias_terms()]
        for vectors in (ds.optimizer_state or {}).values():
            out += vectors
    return out


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_resume_continues_bit_for_bit(tmp_path: Path, optimizer: str) -> None:
    """Two epochs in one run == one epoch, then a resumed run for the second (CPU)."""
    common = [*SMALL, "--optimizer", optimizer, "--device", "cpu"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert _run("train", *common, "--epochs", "2", "--checkpoint-dir", str(whole))[0] == 0
    assert _run("train", *common, "--epochs", "1", "--checkpoint-dir", str(split))[0] == 0
    code, out = _run("train", "--resume", "--epochs", "2", "--checkpoint-dir", str(split))
    assert code == 0, out
    assert "resumed after epoch 1" in out
    a, b = _weights(whole), _weights(split)
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    ha = m.load(whole / "checkpoint.mpsnn")["history"]
    hb = m.load(split / "checkpoint.mpsnn")["history"]
    for key in ("train_loss", "train_accuracy", "test_accuracy", "lr"):
        assert [r[key] for r in ha] == [r[key] for r in hb], key
    metrics = (split / "metrics.jsonl").read_text().splitlines()
    assert [r["epoch"] for r in map(json.loads, metrics) if r["kind"] == "epoch"] == [1, 2]


def test_model_twin_keeps_its_initial_weights_while_mpsnn_trains() -> None:
    """The PyTorch twin (used by --compare-torch) must not share memory with the data
    sources that training updates in place."""
    from mpsnn.models import LeNet5

    dev = m.Device("cpu")
    model = LeNet5(dev, m.SGD(dev, descriptor=m.OptimizerDescriptor(learning_rate=0.5)))
    before = [p.detach().clone() for p in model.twin.parameters()]
    graph = model.training_graph(4)
    cb = dev.new_command_queue().command_buffer()
    x = m.ImageBatch.from_tensor(torch.randn(4, 1, 28, 28))
    graph.encode_batch(cb, [x], [m.LossLabels(dev, torch.tensor([1, 2, 3, 4]).view(4, 1, 1))])
    cb.commit()
    cb.wait_until_completed()
    assert all(torch.equal(a, b) for a, b in zip(before, model.twin.parameters(), strict=True))
    trained = model.torch_module()
    assert not all(torch.equal(a, b) for a, b in zip(before, trained.parameters(), strict=True))


def test_compare_torch_trains_the_same_run_in_pytorch(tmp_path: Path) -> None:
    code, out = _run("train", *SMALL, "--epochs", "1", "--compare-torch", "--device", "cpu",
                     "--optimizer", "sgd", "--metrics", str(tmp_path / "m.jsonl"))  # fmt: skip
    assert code == 0, out
    records = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    records = [r for r in records if r["kind"] == "epoch"]  # not the step records
    assert [r["framework"] for r in records] == ["mpsnn", "pytorch"]
    # same initial weights, data, order and SGD: the first epoch's losses agree closely
    assert records[0]["train_loss"] == pytest.approx(records[1]["train_loss"], rel=1e-3)


def test_bench_runs_on_the_cpu(tmp_path: Path) -> None:
    out_json = tmp_path / "bench.json"
    code, out = _run("bench", "--model", "lenet", "--batch-size", "8", "--device", "cpu",
                     "--steps", "2", "--trials", "1", "--compile-modes", "",
                     "--json", str(out_json))  # fmt: skip
    assert code == 0, out
    data = json.loads(out_json.read_text())
    names = [r["variant"] for r in data["rows"]]
    assert names == ["mpsnn graph, eager", "mpsnn graph, compiled", "pytorch eager"]
    losses = [r["loss"] for r in data["rows"]]
    assert max(losses) - min(losses) < 1e-3  # the same model, batch and weights
    assert data["host_encode_ms"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train", "--model", "vgg"], "Invalid value for '--model': 'vgg' is not one of"),
        (["train", "--dtype", "int8"], "Invalid value for '--dtype'"),
        (["train", "--epochs", "0"], "Invalid value for '--epochs'"),
        (["train", "--resume"], "--resume needs --checkpoint-dir"),
        (["train", "--device", "tpu", *SMALL], "--device must be auto, cpu, cuda or cuda:N"),
        (["train", "--batch-size", "999", "--limit", "100"], "--batch-size must be <= the 100"),
        (["bench", "--input-shape", "3,32"], "--input-shape must be C,H,W"),
        (["bench", "--model", "lenet", "--input-shape", "3,8,8", "--device", "cpu"],
         "--model lenet: input_shape must be (channels, height, width) with at least one "
         "channel and a height and width of at least 12"),
    ],
)  # fmt: skip
def test_misuse_is_one_line_and_exit_status_2(args: list[str], message: str) -> None:
    code, out = _run(*args)
    assert code == 2, out
    assert message in out
    assert len(out.strip().splitlines()) == 1, out


def test_resume_from_a_foreign_checkpoint(tmp_path: Path) -> None:
    """(A directory without a checkpoint starts a fresh run: tests/cli/test_run_files.py.)"""
    m.save({"kind": "something else"}, tmp_path / "checkpoint.mpsnn")
    code, out = _run("train", "--resume", "--checkpoint-dir", str(tmp_path))
    assert code == 2 and "must be a checkpoint written by mpsnn train" in out
    (tmp_path / "checkpoint.mpsnn").write_bytes(b"not a checkpoint")
    code, out = _run("train", "--resume", "--checkpoint-dir", str(tmp_path))
    assert code == 2 and "is not a usable checkpoint" in out


def test_missing_dataset_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    import mpsnn.data.fashion_mnist as fm

    monkeypatch.setattr(fm, "_SEARCH", ("/nonexistent/fashion-mnist",))
    monkeypatch.delenv("MPSNN_DATA", raising=False)
    code, out = _run("train", "--device", "cpu")
    assert code == 2
    assert "apt-get install dataset-fashion-mnist" in out
    assert len(out.strip().splitlines()) == 1


def test_resume_keeps_the_runs_device_where_auto_would_pick_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run trained with --device cpu resumes on the CPU on a machine with a GPU (the default
    --device auto means the checkpoint's device on --resume)."""
    folder = tmp_path / "run"
    common = [*SMALL, "--device", "cpu", "--checkpoint-dir", str(folder)]
    assert _run("train", *common, "--epochs", "1")[0] == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # "auto" would pick CUDA
    code, out = _run("train", "--resume", "--epochs", "2", "--checkpoint-dir", str(folder))
    assert code == 0, out
    assert "resumed after epoch 1" in out and "images)\n  cpu, float32" in out, out


def test_resume_uses_the_device_an_auto_run_resolved_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run with the default --device auto records the device it ran on (here the CPU) and
    resumes there, even where auto would now pick CUDA; a checkpoint of a GPU run resumed where
    that GPU is missing falls back to what auto picks (here the CPU)."""
    folder = tmp_path / "run"
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)  # "auto" picks the CPU
        assert _run("train", *SMALL, "--epochs", "1", "--checkpoint-dir", str(folder))[0] == 0
    ckpt = m.load(folder / "checkpoint.mpsnn")
    assert ckpt["config"]["device"] == "auto" and ckpt["device"] == "cpu"
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)  # "auto" would pick CUDA
        code, out = _run("train", "--resume", "--epochs", "2", "--checkpoint-dir", str(folder))
    assert code == 0 and "resumed after epoch 1" in out and "images)\n  cpu, float32" in out, out
    ckpt = m.load(folder / "checkpoint.mpsnn")
    ckpt["device"], ckpt["config"]["device"] = "cuda:0", "cuda"  # as a GPU run would record
    m.save(ckpt, folder / "checkpoint.mpsnn")
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)  # that GPU is missing here
        code, out = _run("train", "--resume", "--epochs", "3", "--checkpoint-dir", str(folder))
    assert code == 0 and "resumed after epoch 2" in out and "images)\n  cpu, float32" in out, out
