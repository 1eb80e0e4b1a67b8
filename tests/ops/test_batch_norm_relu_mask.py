"""Batch normalization's portable gradient applies a fused plain ReLU through a 1.0/0.0 mask
(vectorized) instead of PyTorch's three-tensor ``where``: the same bits, special values
included; a leaky ReLU keeps the select."""

from __future__ import annotations

import pytest
import torch

from mpsnn.ops.batch_norm import _neuron_gradient
from mpsnn.ops.neuron import NeuronParams

_SPECIAL = [0.0, -0.0, 1.5, -2.25, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("slope", [0.0, 0.1])
def test_the_relu_gradient_has_the_selects_bits(dtype: torch.dtype, slope: float) -> None:
    gen = torch.Generator().manual_seed(0)
    special = torch.tensor(_SPECIAL, dtype=dtype)
    z = torch.cat([special.repeat_interleave(len(_SPECIAL)), torch.randn(500, generator=gen,
                                                                        dtype=dtype)])  # fmt: skip
    g = torch.cat([special.repeat(len(_SPECIAL)), torch.randn(500, generator=gen, dtype=dtype)])
    relu = NeuronParams(1, slope, 0.0, 0.0, None)
    want = torch.where(z >= 0, g, g * slope)
    got = _neuron_gradient(relu, g, z)
    assert torch.equal(_bits(got), _bits(want))
