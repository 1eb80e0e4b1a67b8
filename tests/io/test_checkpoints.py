"""Checkpoints: plain values around the objects, the device tensors load on, no unpickling,
what save refuses, atomic writes (a failed or killed save leaves the previous file), and the
codec table."""

from __future__ import annotations

import math
import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import mpsnn as m
from mpsnn.io import register_codec, registered_types
from tests.io._helpers import CPU, ROOT, _equal, _roundtrip


def test_public_api() -> None:
    assert m.save is m.io.save and m.load is m.io.load
    assert issubclass(m.CheckpointError, ValueError)
    assert issubclass(m.CheckpointError, m.MpsnnError)
    names = set(registered_types())
    for cls in (
        m.TensorConvolutionDataSource, m.TensorBatchNormalizationDataSource,
        m.TensorInstanceNormalizationDataSource, m.TensorGroupNormalizationDataSource,
        m.SGD, m.RMSProp, m.Adam, m.Convolution, m.FullyConnected, m.ConvolutionTranspose,
        m.BatchNormalization, m.InstanceNormalization, m.GroupNormalization, m.PoolingMax,
        m.PoolingAverage, m.PoolingL2Norm, m.DilatedPoolingMax, m.Neuron, m.Dropout, m.SoftMax,
        m.LogSoftMax, m.Loss, m.ConvolutionDescriptor, m.NeuronDescriptor, m.LossDescriptor,
        m.OptimizerDescriptor,
    ):  # fmt: skip
        assert cls.__name__ in names


def test_a_training_checkpoint_dict(tmp_path) -> None:
    gen = torch.Generator().manual_seed(13)
    adam = m.Adam(CPU, time_step=4)
    desc = m.ConvolutionDescriptor(3, 3, 1, 2)
    ds = m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape), optimizer=adam)
    bnds = m.TensorBatchNormalizationDataSource(2, optimizer=adam)  # one optimizer, shared
    layers = [m.Convolution(CPU, ds), m.BatchNormalization(CPU, bnds), m.SoftMax(CPU)]
    shared = torch.arange(6.0)
    view = torch.randn(4, 3, generator=gen).t()  # not contiguous
    ckpt = {
        "layers": layers,
        "optimizer": adam,
        "epoch": 3,
        "rng": torch.get_rng_state(),
        "lr": 0.1,
        "name": "run é 1",
        "flags": (True, None, 1, 1.0),
        "floats": [math.inf, -math.inf, -0.0, 1e-308],
        "big": 1 << 70,
        "nested": {"empty": {}, "list": [], "tuple": (), "$obj": "a key like a tag"},
        "shared": [shared, shared],
        "view": view,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3, dtype=torch.int32),
        "half": torch.randn(3, generator=gen).to(torch.bfloat16),
        "mask": torch.tensor([True, False]),
    }
    out = _roundtrip(ckpt, tmp_path)
    assert list(out) == list(ckpt)
    conv, bn, soft = out["layers"]
    assert type(conv) is m.Convolution and type(bn) is m.BatchNormalization
    assert type(soft) is m.SoftMax
    assert conv.data_source.optimizer is out["optimizer"] is bn.data_source.optimizer
    assert out["optimizer"].time_step == 4
    assert out["epoch"] == 3 and type(out["epoch"]) is int
    assert out["lr"] == 0.1 and out["name"] == "run é 1"
    assert out["flags"] == (True, None, 1, 1.0) and type(out["flags"]) is tuple
    assert [type(v) for v in out["flags"]] == [bool, type(None), int, float]
    assert out["floats"][:2] == [math.inf, -math.inf]
    assert math.copysign(1, out["floats"][2]) == -1 and out["floats"][3] == 1e-308
    assert out["big"] == 1 << 70
    assert out["nested"] == {"empty": {}, "list": [], "tuple": (), "$obj": "a key like a tag"}
    assert out["shared"][0] is out["shared"][1] and _equal(out["shared"][0], shared)
    for name in ("rng", "view", "scalar", "empty", "half", "mask"):
        assert _equal(out[name], ckpt[name]), name
    nan = _roundtrip({"nan": math.nan}, tmp_path)["nan"]
    assert math.isnan(nan)


@pytest.mark.parametrize("device", ["cpu", m.Device("cpu"), torch.device("cpu")], ids=str)
def test_load_puts_every_tensor_on_the_device(tmp_path, device) -> None:
    desc = m.ConvolutionDescriptor(1, 1, 2, 2)
    opt = m.Adam(CPU)
    w, b = torch.ones(desc.weights_shape), torch.zeros(2)
    ds = m.TensorConvolutionDataSource(desc, w, b, optimizer=opt)
    out = _roundtrip({"conv": m.Convolution(CPU, ds), "t": torch.ones(2)}, tmp_path, device)
    conv = out["conv"]
    assert conv.device == CPU and conv.data_source.optimizer.device == CPU
    tensors = [
        out["t"], conv.weights, conv.biases, conv.data_source.weights(),
        conv.data_source.bias_terms(), conv.data_source.optimizer._hyper,
        conv.data_source.optimizer._step,
    ]  # fmt: skip
    assert all(t.device.type == "cpu" for t in tensors)
    # every tensor owns its memory (none is a view of the file's bytes)
    assert all(t.untyped_storage().resizable() for t in tensors)


def test_loading_never_unpickles(tmp_path, monkeypatch) -> None:
    ds = m.TensorBatchNormalizationDataSource(2, optimizer=m.Adam(CPU))
    path = tmp_path / "ckpt.safetensors"
    m.save({"bn": m.BatchNormalization(CPU, ds), "t": torch.ones(2)}, path)

    def refuse(*args, **kwargs):
        raise AssertionError("load must not unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    out = m.load(path)
    assert type(out["bn"]) is m.BatchNormalization and _equal(out["t"], torch.ones(2))


# ---------------------------------------------------------------------------------------------
# what save refuses (and then writes nothing)


class _MySource(m.TensorConvolutionDataSource):
    """A subclass: it has no codec of its own, so it cannot be saved as its base."""


class _Policy:
    padding_method = m.PaddingMethod.SIZE_SAME


def test_save_refuses_what_it_cannot_restore(tmp_path) -> None:
    path = tmp_path / "x.safetensors"
    loop: list = []
    loop.append(loop)
    desc = m.ConvolutionDescriptor(1, 1, 1, 1)
    conv = m.Convolution(CPU, m.TensorConvolutionDataSource(desc, torch.ones(1, 1, 1, 1)))
    conv.padding = _Policy()
    cases = [
        ({"a": np.zeros(2)}, TypeError, r"\[save\] values must be None, bool, int, float, str, list, tuple, dict, tensors or objects of a registered type \(.*\), got ndarray at root\.a"),
        ({1: 2}, TypeError, r"\[save\] dict keys must be str, got int 1 at root"),
        ([m.LossType.HINGE], TypeError, r"got LossType at root\.0"),
        ({"x": loop}, ValueError, r"\[save\] values must not contain themselves, got a list inside itself at root\.x\.0"),
        (conv, TypeError, r"\[save\] Convolution\.padding must be a DefaultPadding to be saved \(a custom policy is code\), got _Policy"),
        ({"ds": _MySource(desc, torch.ones(1, 1, 1, 1))}, TypeError, r"\[save\] objects must be of a registered type \(see mpsnn\.io\.register_codec\), got _MySource at root\.ds"),
        (torch.zeros(2, dtype=torch.complex64), TypeError, r"\[save\] tensors must have one of the dtypes float64, float32, .*, got complex64"),
    ]  # fmt: skip
    for value, error, message in cases:
        with pytest.raises(error, match=message):
            m.save(value, path)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary file left


# ---------------------------------------------------------------------------------------------
# atomic writes


def _only_the_file(path: Path) -> None:
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_a_failed_rename_leaves_the_previous_file(saved, monkeypatch) -> None:
    before = saved.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("rename failed")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="rename failed"):
        m.save({"epoch": 4}, saved)
    monkeypatch.undo()
    assert saved.read_bytes() == before and m.load(saved)["epoch"] == 3
    _only_the_file(saved)


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_write_interrupted_midway_leaves_the_previous_file(saved, monkeypatch, error) -> None:
    before = saved.read_bytes()
    real_write = os.write
    calls = []

    def write_half_then_fail(fd, data):
        calls.append(len(data))
        real_write(fd, bytes(data[: len(data) // 2]))
        raise error

    monkeypatch.setattr(os, "write", write_half_then_fail)
    big = {"epoch": 4, "t": torch.randn(1000)}
    with pytest.raises(type(error)):
        m.save(big, saved)
    monkeypatch.undo()
    assert calls, "the save must have started writing"
    assert saved.read_bytes() == before and m.load(saved)["epoch"] == 3
    _only_the_file(saved)
    m.save(big, saved)  # and a later save succeeds
    assert m.load(saved)["epoch"] == 4
    _only_the_file(saved)


def test_a_process_killed_mid_save_leaves_the_previous_file(saved) -> None:
    before = saved.read_bytes()
    script = (
        "import os, signal, torch, mpsnn\n"
        "os.replace = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"mpsnn.save({{'epoch': 5, 't': torch.ones(100)}}, {str(saved)!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert saved.read_bytes() == before and m.load(saved)["epoch"] == 3
    stray = [p.name for p in saved.parent.iterdir() if p != saved]
    assert len(stray) == 1 and stray[0].startswith(f".{saved.name}.")
    assert stray[0].endswith(".tmp")
    assert m.load(saved.parent / stray[0])["epoch"] == 5  # complete, just never renamed


def test_saving_replaces_and_creates_files(tmp_path) -> None:
    path = tmp_path / "new.safetensors"
    m.save(1, path)
    m.save("two", str(path))
    assert m.load(str(path)) == "two"
    _only_the_file(path)


# ---------------------------------------------------------------------------------------------
# the codec table


class _Point:
    def __init__(self, x: float, values: torch.Tensor, parent: _Point | None = None) -> None:
        self.x, self.values, self.parent = x, values, parent


def _encode_point(p: _Point, enc) -> dict:
    return {"x": p.x, "values": enc.tensor(p.values, "values"), "parent": enc.object(p.parent)}


def _decode_point(f) -> _Point:
    return _Point(
        f.get_float("x"),
        f.get_tensor("values", dtypes=(torch.float32,)),
        f.get_object("parent", _Point, optional=True),
    )


register_codec(_Point, _encode_point, _decode_point, name="tests.Point")


def test_registered_codecs_round_trip(tmp_path) -> None:
    assert registered_types()["tests.Point"] is _Point
    root = _Point(1.5, torch.ones(2))
    child = _Point(math.inf, torch.arange(3.0), root)
    out = _roundtrip({"child": child, "root": root}, tmp_path)
    assert type(out["child"]) is _Point and out["child"].parent is out["root"]
    assert out["child"].x == math.inf and _equal(out["child"].values, torch.arange(3.0))


def test_register_codec_errors() -> None:
    with pytest.raises(
        ValueError, match=r"\[register_codec\] a class must be registered once, got _Point again"
    ):
        register_codec(_Point, _encode_point, _decode_point, name="other")
    other = type("Other", (), {})
    with pytest.raises(
        ValueError,
        match=r"\[register_codec\] a name must be registered once, got 'tests.Point' again \(registered for _Point\)",
    ):
        register_codec(other, _encode_point, _decode_point, name="tests.Point")
    with pytest.raises(TypeError, match=r"\[register_codec\] cls must be a class, got str"):
        register_codec("Point", _encode_point, _decode_point)
    with pytest.raises(
        TypeError,
        match=r"\[register_codec\] encode and decode must be callable, got NoneType and function",
    ):
        register_codec(other, None, _decode_point)
    assert "Other" not in registered_types()
