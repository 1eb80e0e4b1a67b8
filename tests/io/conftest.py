"""The fixture of the save/load tests: a small saved checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mpsnn as m
from tests.io._helpers import CPU


@pytest.fixture
def saved(tmp_path) -> Path:
    """A small checkpoint: a data source with biases and Adam, a dropout, a number."""
    desc = m.ConvolutionDescriptor(1, 1, 2, 2)
    opt = m.Adam(CPU)
    w = torch.randn(desc.weights_shape)
    ds = m.TensorConvolutionDataSource(desc, w, torch.zeros(2), optimizer=opt)
    path = tmp_path / "ckpt.safetensors"
    m.save({"ds": ds, "drop": m.Dropout(CPU, 0.5, seed=3), "epoch": 3}, path)
    return path
