"""The per-channel arguments of the batch-normalization passes, as frozen records: what
normalizes each channel (`BatchNormParams`) and the whole batch's gradient sums the input
gradient needs (`BatchNormSums`). The portable passes (`mpsnn.ops.batch_norm`) and the Triton
ones (`mpsnn.ops.triton.batch_norm`, `mpsnn.ops.triton.batch_norm_nhwc`) take them.

A leaf module (torch only): the Triton modules import it without the portable path, and the
portable path imports it without Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BatchNormParams", "BatchNormSums"]


@dataclass(frozen=True, slots=True, eq=False)
class BatchNormParams:
    """What normalizes each channel ``c`` of an (N, C, H, W) tensor::

        z = (x - mean) gamma / sqrt(var + eps) + beta,   y = f(z)

    ``mean``, ``var`` (the whole batch's, biased), ``gamma``, ``beta``: (C,) tensors on the
    data's device; ``eps``: added to the variance; ``neuron``: the fused neuron ``f``, a
    `mpsnn.ops.neuron.NeuronParams` (None: none). The tensors are read when a pass runs."""

    mean: torch.Tensor
    var: torch.Tensor
    gamma: torch.Tensor
    beta: torch.Tensor
    eps: float
    neuron: Any = None


@dataclass(frozen=True, slots=True, eq=False)
class BatchNormSums:
    """The whole batch's sums the input gradient needs: ``sum_gy = Σ gy`` (dL/dbeta),
    ``sum_gy_xhat = Σ gy xhat`` (dL/dgamma), both (C,), and ``count``, the ``m`` elements of
    each channel (a (1,) or (C,) tensor, or a number)."""

    sum_gy: torch.Tensor
    sum_gy_xhat: torch.Tensor
    count: torch.Tensor | float
