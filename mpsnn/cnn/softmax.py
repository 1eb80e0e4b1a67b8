"""Softmax over feature channels (MPS ``MPSCNNSoftMax``, ``MPSCNNLogSoftMax`` and gradients).

Per pixel, over the channels read (``source_feature_channel_offset`` ...)::

    softmax:     s_k = exp(x_k - max x) / sum_j exp(x_j - max x)
    log-softmax: l_k = x_k - max x - log sum_j exp(x_j - max x)

Both are computed in float32 for float16/bfloat16 storage, and stay finite for any finite
logits (a spread of 1000 included). The gradients read the forward **result** (secondary image
= forward destination), as MPS prescribes::

    softmax:     dx_k = s_k (g_k - sum_j g_j s_j)
    log-softmax: dx_k = g_k - exp(l_k) sum_j g_j
"""

from __future__ import annotations

from typing import Any

import torch

from mpsnn.cnn._pointwise import Pointwise, PointwiseBackward, PointwiseGradient, PointwiseKernel
from mpsnn.core.cnn_kernel import Records
from mpsnn.core.geometry import Window
from mpsnn.core.registry import gradient_of
from mpsnn.core.state import ForwardRecord, GradientState
from mpsnn.ops._dtypes import widen

__all__ = [
    "LogSoftMax",
    "LogSoftMaxGradient",
    "SoftMax",
    "SoftMaxGradient",
]


class SoftMax(PointwiseKernel):
    """``softmax`` over the feature channels of each pixel (MPS ``MPSCNNSoftMax``)."""

    _gradient_state_class = GradientState
    saved_fields = ()

    def _pointwise(self, window: Window, records: Records) -> Pointwise:
        return lambda x: torch.softmax(widen(x), 1).to(x.dtype)


class LogSoftMax(PointwiseKernel):
    """``log_softmax`` over the feature channels of each pixel (MPS ``MPSCNNLogSoftMax``)."""

    _gradient_state_class = GradientState
    saved_fields = ()

    def _pointwise(self, window: Window, records: Records) -> Pointwise:
        return lambda x: torch.log_softmax(widen(x), 1).to(x.dtype)


class _SoftMaxGradientBase(PointwiseGradient):
    _state_class = GradientState
    _secondary_is_result = True


@gradient_of(SoftMax)
class SoftMaxGradient(_SoftMaxGradientBase):
    """``dx = s (g - sum g s)``; ``source_image`` is the forward **result** ``s``."""

    def _pointwise_backward(self, record: ForwardRecord, states: list[Any]) -> PointwiseBackward:
        def backward(g: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            gw, sw = widen(g), widen(s)
            return (sw * (gw - (gw * sw).sum(1, keepdim=True))).to(g.dtype)

        return backward


@gradient_of(LogSoftMax)
class LogSoftMaxGradient(_SoftMaxGradientBase):
    """``dx = g - exp(l) sum g``; ``source_image`` is the forward **result** ``l``."""

    def _pointwise_backward(self, record: ForwardRecord, states: list[Any]) -> PointwiseBackward:
        def backward(g: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
            gw = widen(g)
            return (gw - torch.exp(widen(logp)) * gw.sum(1, keepdim=True)).to(g.dtype)

        return backward
