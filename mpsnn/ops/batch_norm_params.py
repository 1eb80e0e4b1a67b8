"""The per-channel arguments of the batch-normalization passes, as frozen records: what
normalizes each channel (`BatchNormParams`), the whole batch's gradient sums the input
gradient needs (`BatchNormSums`) and one update of running statistics (`RunningUpdate`). The
portable passes (`mpsnn.ops.batch_norm`) and the Triton ones (`mpsnn.ops.triton.batch_norm`,
`mpsnn.ops.triton.batch_norm_nhwc`, `mpsnn.ops.triton.batch_norm_vectors`) take them.

A leaf module (torch only): the Triton modules import it without the portable path, and the
portable path imports it without Triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BatchNormParams", "BatchNormSums", "RunningUpdate"]


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


@dataclass(frozen=True, slots=True, eq=False)
class RunningUpdate:
    """One blend of a batch's statistics into running ones (`mpsnn.ops.batch_norm`'s
    ``bn_running_update``)::

        running_mean = (1 - momentum) running_mean + momentum mean
        running_var = (1 - momentum) running_var + momentum m2 / max(count - 1, 1)

    ``running``: the (C,) mean and variance written in place; ``count`` (1,) or (C,),
    ``mean`` and ``m2`` (C,): the batch's sums; ``momentum`` in [0, 1]. The tensors are read
    when the update runs."""

    running: tuple[torch.Tensor, torch.Tensor]
    count: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor
    momentum: float
