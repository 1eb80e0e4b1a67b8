"""Shared pieces of the save/load tests: a round trip through a file, bit-for-bit equality,
one forward encode, a file's structure and tensors (to read and rewrite them), and one
training step of a convolution."""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch
from safetensors import safe_open

import mpsnn as m
from tests.helpers import run

CPU = m.Device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def _roundtrip(obj, tmp_path: Path, device="cpu"):
    path = tmp_path / "obj.safetensors"
    m.save(obj, path)
    return m.load(path, device)


def _equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit for bit: same dtype, shape and values (None equals None)."""
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _forward(kernel, x: torch.Tensor) -> torch.Tensor:
    cb = CPU.new_command_queue().command_buffer()
    y = kernel.encode_batch(cb, m.ImageBatch.from_tensor(x))
    run(cb)
    return y.tensor


def _parts(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The structure and the tensors of a saved file."""
    with safe_open(path, "pt") as f:
        structure = json.loads(f.metadata()["mpsnn"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    return structure, tensors


def _write(path: Path, structure: dict, tensors: dict[str, torch.Tensor]) -> None:
    safetensors.torch.save_file(tensors, path, metadata={"mpsnn": json.dumps(structure)})


def _object(structure: dict, type_name: str) -> dict:
    return next(o for o in structure["objects"] if o["type"] == type_name)


def _conv_step(ds, conv, grad, gen, path: str) -> None:
    """One training step of a 3x3 convolution: forward, gradient, the data source's update
    (``cpu``: after completion; ``gpu``: encoded), the kernel's reload."""
    desc = ds.descriptor()
    dtype = ds.weights().dtype
    x = torch.randn(2, desc.input_feature_channels, 5, 5, generator=gen, dtype=torch.float64)
    g = torch.randn(2, desc.output_feature_channels, 5, 5, generator=gen, dtype=torch.float64)
    xb, gb = m.ImageBatch.from_tensor(x.to(dtype)), m.ImageBatch.from_tensor(g.to(dtype))
    cb = CPU.new_command_queue().command_buffer()
    st = conv.result_state_batch(xb)
    conv.encode_batch(cb, xb, destination_states=st)
    grad.encode_batch(cb, gb, xb, st)
    if path == "gpu":
        conv.reload_weights_and_biases(cb, ds.update(cb, st[0], None))
        run(cb)
    else:
        run(cb)
        assert ds.update_on_cpu(st[0], None)
        conv.reload_weights_and_biases_from_data_source()
