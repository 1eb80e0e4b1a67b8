"""The one place that decides the memory layout of 4-D storage: channels-last for
float16/bfloat16 on CUDA and for float32 on the CPU, NCHW otherwise.

An image's values and shape are NCHW; how its storage is ordered is an implementation choice.
On CUDA, float16/bfloat16 convolutions run on channels-last (NHWC) operands: cuDNN's
half-precision kernels on recent GPUs are NHWC-only, and an NCHW operand costs a layout
conversion on each side of every convolution, forward and backward. So the convolutions'
operands and weight casts (`mpsnn.ops.convolution`, `mpsnn.cnn.convolution`) and the storage an
image makes itself (`mpsnn.core.image`) all follow `storage_layout`; element-wise kernels keep
their inputs' layout and batch normalization has channels-last passes, so a network's
activations stay channels-last from one convolution to the next.

On the CPU, float32 convolutions (oneDNN) convert NCHW operands to their blocked formats and
back at every call, and PyTorch's NCHW max pooling is an order of magnitude slower than its
channels-last kernel: float32 storage is channels-last there, convolution masters too
(`master_layout`, `mpsnn.cnn.convolution.weights`). float64, the reference precision, stays NCHW.
"""

from __future__ import annotations

import torch

__all__ = [
    "channels_last_only",
    "channels_last_preferred",
    "master_layout",
    "nhwc_view",
    "storage_layout",
]


def channels_last_preferred(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether 4-D ``dtype`` tensors on ``device`` are kept channels-last (float16/bfloat16 on
    CUDA, float32 on the CPU)."""
    if device.type == "cpu":
        return dtype is torch.float32
    return device.type == "cuda" and (dtype is torch.bfloat16 or dtype is torch.float16)


def storage_layout(dtype: torch.dtype, device: torch.device) -> torch.memory_format:
    """The memory format for new 4-D storage of ``dtype`` on ``device``: channels-last where
    `channels_last_preferred`, else ``preserve_format`` (a copy keeps its source's layout; new
    zeros are NCHW)."""
    if channels_last_preferred(dtype, device):
        return torch.channels_last
    return torch.preserve_format


def master_layout(dtype: torch.dtype, device: torch.device) -> torch.memory_format:
    """The memory format of a convolution's new master weights of ``dtype``: channels-last
    where the convolutions run float32 on channels-last operands (the CPU: channels-last OIHW
    is OHWI memory, MPS's own order), else contiguous."""
    if dtype is torch.float32 and channels_last_preferred(dtype, device):
        return torch.channels_last
    return torch.contiguous_format


def channels_last_only(t: torch.Tensor) -> bool:
    """Whether 4-D ``t`` lies in channels-last memory and not in NCHW memory (a tensor with one
    channel, or 1x1 pixels, is both, and counts as NCHW)."""
    if t.dim() != 4 or t.is_contiguous():
        return False
    return t.is_contiguous(memory_format=torch.channels_last)


def nhwc_view(t: torch.Tensor) -> torch.Tensor:
    """The ``(N, H, W, C)`` view of 4-D ``t``: contiguous where `channels_last_only` holds, so an
    element-wise operation may read and write ``t``'s memory through it in order."""
    return t.permute(0, 2, 3, 1)
