"""What load rejects: truncated files, wrong headers, wrong structures, wrong fields, each with
its message."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch

import mpsnn as m
from tests.io._helpers import CPU, _conv_step, _object, _parts, _write


def _header_size(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def test_truncated_files_are_rejected(saved) -> None:
    data = saved.read_bytes()
    n, size = _header_size(saved), len(data)
    assert m.load(saved)["epoch"] == 3
    cases = [
        (0, r"the file must be a safetensors file \(at least 8 bytes\), got 0 bytes"),
        (5, r"the file must be a safetensors file \(at least 8 bytes\), got 5 bytes"),
        (8, rf"the safetensors header must fit in the file \({n} bytes announced after the first 8\), got a file of 8 bytes \(truncated, or not safetensors\)"),
        (8 + n // 2, r"the safetensors header must fit in the file .* \(truncated, or not safetensors\)"),
        (8 + n, rf"the file must hold exactly the {size - 8 - n} bytes of tensor data its header announces, got 0 \(truncated\)"),
        ((8 + n + size) // 2, r"the file must hold exactly the \d+ bytes of tensor data its header announces, got \d+ \(truncated\)"),
        (size - 1, rf"the file must hold exactly the {size - 8 - n} bytes of tensor data its header announces, got {size - 9 - n} \(truncated\)"),
    ]  # fmt: skip
    for cut, message in cases:
        saved.write_bytes(data[:cut])
        with pytest.raises(m.CheckpointError, match=r"\[load\] " + message):
            m.load(saved)
    saved.write_bytes(data + b"\0\0")
    with pytest.raises(
        m.CheckpointError,
        match=rf"\[load\] the file must hold exactly the {size - 8 - n} bytes of tensor data its header announces, got {size - 6 - n}$",
    ):
        m.load(saved)


def test_files_with_a_wrong_header_are_rejected(tmp_path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"this is a text file, not a checkpoint at all")
    with pytest.raises(
        m.CheckpointError, match=r"\[load\] the safetensors header must fit in the file"
    ):
        m.load(path)
    path.write_bytes(struct.pack("<Q", 8) + b"not json")
    with pytest.raises(
        m.CheckpointError, match=r"\[load\] the safetensors header must be UTF-8 JSON, got"
    ):
        m.load(path)
    path.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(
        m.CheckpointError, match=r"\[load\] the safetensors header must be a JSON object, got \[\]"
    ):
        m.load(path)
    safetensors.torch.save_file({"a": torch.zeros(2)}, path)  # safetensors, but not ours
    with pytest.raises(
        m.CheckpointError,
        match=r"\[load\] the safetensors header's __metadata__ must hold the key 'mpsnn' \(a string\), got null",
    ):
        m.load(path)
    safetensors.torch.save_file({}, path, metadata={"mpsnn": "{not json"})
    with pytest.raises(m.CheckpointError, match=r"\[load\] the 'mpsnn' metadata must be JSON, got"):
        m.load(path)
    safetensors.torch.save_file(
        {},
        path,
        metadata={"mpsnn": '{"format": "mpsnn", "version": 1, "root": NaN, "objects": []}'},
    )
    with pytest.raises(
        m.CheckpointError, match=r"\[load\] the 'mpsnn' metadata must be JSON, got NaN is not JSON"
    ):
        m.load(path)
    safetensors.torch.save_file({}, path, metadata={"mpsnn": "[1, 2]"})
    with pytest.raises(
        m.CheckpointError,
        match=r"\[load\] the 'mpsnn' metadata must be a JSON object, got \[1, 2\]",
    ):
        m.load(path)


def _rewrite(path: Path, edit) -> None:
    structure, tensors = _parts(path)
    edit(structure, tensors)
    _write(path, structure, tensors)


def _weights_name(structure: dict) -> str:
    return _object(structure, "TensorConvolutionDataSource")["fields"]["weights"]["$tensor"]


def _set(obj: dict, key: str, value) -> None:
    obj[key] = value


_STRUCTURE_CASES = {
    "format": (
        lambda s, t: _set(s, "format", "pickle"),
        r"the format must be 'mpsnn', got 'pickle'",
    ),
    "version": (
        lambda s, t: _set(s, "version", 2),
        r"the format version must be 1 \(this mpsnn reads version 1 only\), got 2",
    ),
    "no version": (
        lambda s, t: s.pop("version"),
        r"the structure must state its version, got none",
    ),
    "missing key": (
        lambda s, t: s.pop("objects"),
        r"the structure must have exactly the keys \['format', 'objects', 'root', 'version'\], got \['format', 'root', 'version'\]",
    ),
    "unknown type": (
        lambda s, t: _set(s["objects"][0], "type", "builtins.eval"),
        r"object 0's type must be a registered type \(Adam, .*\), got 'builtins.eval'",
    ),
    "extra tensor": (
        lambda s, t: _set(t, "extra", torch.zeros(3)),
        r"the file must hold only the tensors its structure references, got unreferenced tensors \['extra'\]",
    ),
    "missing tensor": (
        lambda s, t: t.pop(_weights_name(s)),
        r"tensor '0\.TensorConvolutionDataSource\.weights' \(referenced by object \d+ \(TensorConvolutionDataSource\)\.weights\) must be in the file, got none",
    ),
    "dtype in the file": (
        lambda s, t: _set(t, _weights_name(s), t[_weights_name(s)].double()),
        r"tensor '0\.TensorConvolutionDataSource\.weights' must be float32 of shape \[2, 1, 1, 2\] as the structure states, got float64 of shape \[2, 1, 1, 2\]",
    ),
    "shape in the file": (
        lambda s, t: _set(t, _weights_name(s), t[_weights_name(s)].reshape(2, 2)),
        r"tensor '0\.TensorConvolutionDataSource\.weights' must be float32 of shape \[2, 1, 1, 2\] as the structure states, got float32 of shape \[2, 2\]",
    ),
    "forward reference": (
        lambda s, t: _set(_object(s, "TensorConvolutionDataSource")["fields"], "optimizer", {"$obj": 99}),
        r"object \d+ \(TensorConvolutionDataSource\)\.optimizer must reference an object before it \(index < \d+\), got \{\"\$obj\": 99\}",
    ),
    "unreferenced object": (
        lambda s, t: s["objects"].append(json.loads(json.dumps(s["objects"][0]))),
        r"every object must be referenced, got unreferenced objects \[\d+\]",
    ),
    "bad tag": (
        lambda s, t: _set(s["root"]["$dict"], "epoch", {"$eval": "1 + 1"}),
        r"root\.epoch must be null, a boolean, a number, a string, a list or a tagged object \(\$obj, \$tensor, \$dict, \$tuple, \$float\), got \{\"\$eval\": \"1 \+ 1\"\}",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_STRUCTURE_CASES))
def test_files_with_a_wrong_structure_are_rejected(saved, case) -> None:
    edit, message = _STRUCTURE_CASES[case]
    _rewrite(saved, edit)
    with pytest.raises(m.CheckpointError, match=r"\[load\] " + message):
        m.load(saved)


def _fields(structure: dict, type_name: str) -> dict:
    return _object(structure, type_name)["fields"]


def _retype(s: dict, t: dict, dtype: torch.dtype) -> None:
    ref = _fields(s, "TensorConvolutionDataSource")["weights"]
    t[ref["$tensor"]] = t[ref["$tensor"]].to(dtype)
    ref["dtype"] = str(dtype).removeprefix("torch.")


def _reshape_counter(s: dict, t: dict) -> None:
    ref = _fields(s, "Dropout")["counter"]
    t[ref["$tensor"]] = torch.zeros(2, dtype=torch.int64)
    ref["shape"] = [2]


def _swap_optimizer(s: dict, t: dict) -> None:
    """The data source's optimizer becomes the Adam's descriptor (Adam stays referenced)."""
    fields = _fields(s, "TensorConvolutionDataSource")
    s["root"]["$dict"]["adam"] = fields["optimizer"]
    fields["optimizer"] = _fields(s, "Adam")["descriptor"]


_FIELD_CASES = {
    "missing field": (
        lambda s, t: _fields(s, "Dropout").pop("seed"),
        r"object \d+ \(Dropout\) must have the field 'seed', got the fields \[.*\]",
    ),
    "extra field": (
        lambda s, t: _set(_fields(s, "Dropout"), "evil", 1),
        r"object \d+ \(Dropout\) must have only the fields its type reads, got also \['evil'\]",
    ),
    "wrong field type": (
        lambda s, t: _set(_fields(s, "Dropout"), "seed", "x"),
        r"object \d+ \(Dropout\) field 'seed' must be an int >= 0, got 'x'",
    ),
    "wrong enum name": (
        lambda s, t: _set(_fields(s, "Dropout"), "edge_mode", "WRAP"),
        r"object \d+ \(Dropout\) field 'edge_mode' must be one of the EdgeMode names \(ZERO, CLAMP, .*\), got 'WRAP'",
    ),
    "wrong object type": (
        _swap_optimizer,
        r"object \d+ \(TensorConvolutionDataSource\) field 'optimizer' must be an instance of Optimizer, got OptimizerDescriptor",
    ),
    "invalid value": (
        lambda s, t: _set(_fields(s, "Dropout"), "keep_probability", 1.5),
        r"object \d+ \(Dropout\) must be rebuildable from its fields, got ValueError: \[Dropout\] keep_probability must be in \(0, 1\), got 1\.5",
    ),
    "wrong dtype": (
        lambda s, t: _retype(s, t, torch.float16),
        r"object \d+ \(TensorConvolutionDataSource\) field 'weights' must have the dtype float32 or float64, got float16",
    ),
    "wrong shape": (
        _reshape_counter,
        r"object \d+ \(Dropout\) field 'counter' must have the shape \[1\], got \[2\]",
    ),
    "optimizer state names": (
        lambda s, t: _set(_fields(s, "TensorConvolutionDataSource"), "optimizer_state", {"momentum": []}),
        r"object \d+ \(TensorConvolutionDataSource\) field 'optimizer_state' must map the optimizer's state vectors \['momentum', 'velocity'\] to lists, got",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_FIELD_CASES))
def test_files_with_wrong_fields_are_rejected(saved, case) -> None:
    edit, message = _FIELD_CASES[case]
    _rewrite(saved, edit)
    with pytest.raises(m.CheckpointError, match=r"\[load\] " + message):
        m.load(saved)


def test_optimizer_state_of_the_wrong_dtype_is_rejected(tmp_path) -> None:
    desc = m.ConvolutionDescriptor(1, 1, 2, 2)
    w = torch.randn(desc.weights_shape)
    ds = m.TensorConvolutionDataSource(desc, w, torch.zeros(2), optimizer=m.SGD(CPU, 0.9))
    conv, grad = m.Convolution(CPU, ds), m.ConvolutionGradient(CPU, ds)
    _conv_step(ds, conv, grad, torch.Generator().manual_seed(0), "cpu")
    path = tmp_path / "ckpt.safetensors"
    m.save(ds, path)

    def edit(s, t):
        ref = _fields(s, "TensorConvolutionDataSource")["optimizer_state"]["momentum"][1]
        t[ref["$tensor"]] = t[ref["$tensor"]].double()
        ref["dtype"] = "float64"

    _rewrite(path, edit)
    with pytest.raises(
        m.CheckpointError,
        match=r"\[load\] object \d+ \(TensorConvolutionDataSource\) field 'optimizer_state\.momentum\.1' must have the dtype float32, got float64",
    ):
        m.load(path)
