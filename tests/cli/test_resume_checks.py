"""``mpsnn train --resume`` checks the checkpoint it reads: its keys, the types and ranges of
its config, epoch and history, and its data sources and dropout counters against the model;
each mistake is one ``Error:`` line with exit status 2."""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import mpsnn as m
from tests.cli._helpers import run_cli as _run

SMALL = ["--dataset", "synthetic", "--limit", "64", "--test-limit", "32", "--batch-size", "32",
         "--device", "cpu"]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint of epoch 1 of a 2-epoch run (written once for the module)."""
    folder = tmp_path_factory.mktemp("trained")
    code, out = _run("train", *SMALL, "--epochs", "1", "--checkpoint-dir", str(folder))
    assert code == 0, out
    ckpt = m.load(folder / "checkpoint.mpsnn")
    ckpt["config"]["epochs"] = 2
    m.save(ckpt, folder / "checkpoint.mpsnn")
    return folder


def _pop(key: str) -> Callable[[dict], None]:
    return lambda c: c.pop(key)


def _set(key: str, value: object) -> Callable[[dict], None]:
    return lambda c: c.__setitem__(key, value)


def _config(key: str, value: object) -> Callable[[dict], None]:
    return lambda c: c["config"].__setitem__(key, value)


_CASES = {
    "no config": (_pop("config"), "it must hold the keys ['config', 'data_sources', 'dropout', "
                  "'epoch', 'history', 'kind'] (and optionally 'dataset', 'device', 'inputs'), "
                  "got ['data_sources', 'dataset', 'device', 'dropout', 'epoch', 'history', "
                  "'inputs', 'kind']"),
    "no dropout": (_pop("dropout"), "it must hold the keys"),
    "extra key": (_set("notes", "hi"), "it must hold the keys"),
    "extra config key": (_config("nesterov", True), "its config must hold the options "
                         "['batch_size', 'compile', 'dataset', 'device', 'dtype', 'epochs', "
                         "'limit', 'lr', 'lr_decay', 'model', 'optimizer', 'seed', 'test_limit'] "
                         "(and may hold ['clip_grad', 'label_smoothing', 'momentum', 'schedule', "
                         "'step_epochs', 'warmup_epochs', 'weight_decay']), got ['batch_size', "
                         "'clip_grad', 'compile', 'dataset', 'device', 'dtype', 'epochs', "
                         "'label_smoothing', 'limit', 'lr', 'lr_decay', 'model', 'momentum', "
                         "'nesterov',"),
    "a config key missing": (lambda c: c["config"].pop("seed"), "its config must hold the "
                             "options"),
    "config not a dict": (_set("config", [1]), "its config must hold the options"),
    "schedule": (_config("schedule", "linear"), "its config's schedule must be one of constant, "
                 "step, exponential, cosine, got 'linear'"),
    "momentum": (_config("momentum", 1.0), "its config's momentum must be null or a number in "
                 "[0, 1), got 1.0"),
    "clip_grad": (_config("clip_grad", 0.0), "its config's clip_grad must be null or a finite "
                  "number > 0, got 0.0"),
    "history=5": (_set("history", 5), "its history must be a list of one record per epoch done "
                  "(1), got 5"),
    "history too long": (lambda c: c["history"].append(c["history"][0]),
                         "its history must be a list of one record per epoch done (1), got 2 "
                         "records"),
    "history record": (lambda c: c["history"][0].pop("lr"),
                       "its history's record 0 must hold the numbers"),
    "epoch=inf": (_set("epoch", math.inf), "its epoch must be an int from 1 to the run's 2 "
                  "epochs, got inf"),
    "epoch=-3": (_set("epoch", -3), "its epoch must be an int from 1 to the run's 2 epochs, "
                 "got -3"),
    "epoch='3'": (_set("epoch", "3"), "its epoch must be an int from 1 to the run's 2 epochs, "
                  "got '3'"),
    "epoch=True": (_set("epoch", True), "its epoch must be an int from 1 to the run's 2 epochs, "
                   "got True"),
    "epoch past the run": (_set("epoch", 3), "its epoch must be an int from 1 to the run's 2 "
                           "epochs, got 3"),
    "epochs=0": (_config("epochs", 0), "its config's epochs must be an int >= 1, got 0"),
    "model": (_config("model", "vgg"), "its config's model must be one of cnn, lenet, "
              "apple-mnist, resnet18, got 'vgg'"),
    "lr": (_config("lr", -1.0), "its config's lr must be null or a finite number > 0, got -1.0"),
    "lr_decay": (_config("lr_decay", math.inf), "its config's lr_decay must be a finite number "
                 "> 0, got inf"),
    "seed": (_config("seed", 2**70), "its config's seed must be an int from 0 to 4294967295"),
    "batch_size": (_config("batch_size", 2.5), "its config's batch_size must be an int >= 1, "
                   "got 2.5"),
    "compile": (_config("compile", "yes"), "its config's compile must be a boolean, got 'yes'"),
    "device": (_set("device", 3), "its device must be a string, got 3"),
    "data sources reversed": (lambda c: c["data_sources"].reverse(),
                              "its data source 0 must match layer 0 of --model cnn "
                              "(TensorConvolutionDataSource, weights (32, 3, 3, 1) float32), "
                              "got TensorConvolutionDataSource, weights (10, 1, 1, 128) float32"),
    "a data source missing": (lambda c: c["data_sources"].pop(),
                              "it must hold the 4 layers of --model cnn, got 3"),
    "data sources not a list": (_set("data_sources", {"a": 1}),
                                "its data_sources must be a list, got dict"),
    "dropout counters": (_set("dropout", [torch.zeros(2, dtype=torch.int64)]),
                         "its dropout must hold the graph's 0 counters [], got "
                         "[((2,), torch.int64)]"),
    "dropout not tensors": (_set("dropout", [1]), "its dropout must be a list of tensors, got [1]"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_CASES))
def test_a_malformed_checkpoint_is_one_line(trained: Path, tmp_path: Path, case: str) -> None:
    edit, message = _CASES[case]
    folder = tmp_path / "run"
    shutil.copytree(trained, folder)
    ckpt = m.load(folder / "checkpoint.mpsnn")
    edit(ckpt)
    m.save(ckpt, folder / "checkpoint.mpsnn")
    code, out = _run("train", "--resume", "--checkpoint-dir", str(folder))
    assert code == 2, out
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    prefix = f"Error: {folder / 'checkpoint.mpsnn'} is not a usable checkpoint: "
    assert lines[0].startswith(prefix + message), lines[0]


def test_the_unedited_checkpoint_resumes(trained: Path, tmp_path: Path) -> None:
    folder = tmp_path / "run"
    shutil.copytree(trained, folder)
    code, out = _run("train", "--resume", "--checkpoint-dir", str(folder))
    assert code == 0, out
    assert m.load(folder / "checkpoint.mpsnn")["epoch"] == 2


def test_an_unreadable_checkpoint_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "checkpoint.mpsnn").mkdir()
    code, out = _run("train", "--resume", "--checkpoint-dir", str(tmp_path))
    assert code == 2, out
    assert len(out.strip().splitlines()) == 1 and out.startswith("Error: "), out
