"""A convolution data source's file records the memory order of its weights
(``weights_memory``: ``"ohwi"`` for weights held in OHWI memory, the CPU float32 models' order;
absent for OIHW memory), and a load restores it: OHWI-memory weights come back in OHWI
memory, OIHW-memory ones in OIHW memory, and a bad value is refused with a message."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from mpsnn.errors import CheckpointError
from tests.io._helpers import _object, _parts, _write

CL = torch.channels_last


def _source(ohwi_memory: bool) -> m.TensorConvolutionDataSource:
    desc = m.ConvolutionDescriptor(3, 3, 4, 5)
    g = torch.Generator().manual_seed(0)
    oihw = torch.randn(5, 4, 3, 3, generator=g)
    weights = (
        oihw.permute(0, 2, 3, 1).contiguous() if ohwi_memory else oihw.permute(0, 2, 3, 1)
    )  # OHWI values either way; the memory order differs
    return m.TensorConvolutionDataSource(desc, weights, torch.randn(5, generator=g))


@pytest.mark.parametrize("ohwi_memory", [True, False])
def test_a_load_restores_the_memory_order_of_the_weights(tmp_path, ohwi_memory: bool) -> None:
    ds = _source(ohwi_memory)
    path = tmp_path / "ds.safetensors"
    m.save(ds, path)
    fields = _object(_parts(path)[0], "TensorConvolutionDataSource")["fields"]
    assert fields.get("weights_memory") == ("ohwi" if ohwi_memory else None)
    back = m.load(path, "cpu")
    assert torch.equal(back.weights(), ds.weights())
    held = back._state._oihw
    assert held.is_contiguous() is not ohwi_memory
    assert held.is_contiguous(memory_format=CL) or not ohwi_memory


def test_a_bad_memory_order_is_refused(tmp_path) -> None:
    path = tmp_path / "ds.safetensors"
    m.save(_source(True), path)
    structure, tensors = _parts(path)
    _object(structure, "TensorConvolutionDataSource")["fields"]["weights_memory"] = "nchw"
    _write(path, structure, tensors)
    with pytest.raises(CheckpointError, match=r"'weights_memory' must be 'oihw' or 'ohwi', got"):
        m.load(path, "cpu")
