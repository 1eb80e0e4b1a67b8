"""Arithmetic math: reading a broadcast source, the four operations, and bit-packed masks.

With ``x`` the primary and ``y`` the secondary source (each read through its own offset, edge
mode and 0/1 strides), ``z = clamp(op(ps x, ss y) + bias, min, max)`` where op is ``+``, ``-``,
``*`` or ``/``. Gradients, per input, multiplied by the clamp mask ``min < z_unclamped < max``
(0 where the forward clamped, boundaries included)::

    add:       dx = g ps              dy = g ss
    subtract:  dx = g ps              dy = -g ss
    multiply:  dx = g ps ss y         dy = g ps ss x
    divide:    dx = g ps / (ss y)     dy = -g ps x / (ss y^2)

then summed over every axis along which that input was broadcast (stride 0), and passed through
the adjoint of the read (pixels read twice under CLAMP add up; ZERO reads pass nothing back).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mpsnn.core.geometry import AxisWindow, EdgeMode
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.batch_norm import bn_forward
from mpsnn.ops.batch_norm_params import BatchNormParams
from mpsnn.ops.neuron import NeuronParams, activation, plain_relu, relu_backward_of_result
from mpsnn.ops.window import ExtractPlan, apply_extract, apply_extract_adjoint, plan_extract

__all__ = [
    "ReadGeometry",
    "pack_bits",
    "read_geometry",
    "read_source",
    "read_source_adjoint",
    "unpack_bits",
]

ADD, SUBTRACT, MULTIPLY, DIVIDE = range(4)


class ReadGeometry(NamedTuple):
    """How one source is read: its extraction plan (a broadcast axis reads one pixel) and the
    channel range ``[channel, channel + channels)`` (1 channel when broadcast)."""

    plan: ExtractPlan
    channel: int
    channels: int
    broadcast: tuple[bool, bool, bool]  # channels, y, x


def read_geometry(
    ay: AxisWindow, ax: AxisWindow, edge: EdgeMode, channel: int, channels: int,
    broadcast: tuple[bool, bool, bool],
) -> ReadGeometry:  # fmt: skip
    return ReadGeometry(plan_extract(ay, ax, edge, allow_pad=False), channel, channels, broadcast)


def read_source(x: torch.Tensor, geom: ReadGeometry) -> torch.Tensor:
    """The block ``(N, C or 1, ny or 1, nx or 1)`` that broadcasts against the output block."""
    return apply_extract(x[:, geom.channel : geom.channel + geom.channels], geom.plan)


def read_source_adjoint(
    d: torch.Tensor, geom: ReadGeometry, source_channels: int, acc: torch.dtype
) -> torch.Tensor:
    """Adjoint of `read_source`: sum ``d`` (the output block) over broadcast axes, undo the read,
    and place it at the channels read; returns ``(N, source_channels, H, W)``."""
    dims = [i + 1 for i, b in enumerate(geom.broadcast) if b]
    if dims:
        d = d.sum(dims, keepdim=True, dtype=acc)
    d = apply_extract_adjoint(d, geom.plan)
    if geom.channels == source_channels:
        return d
    full = d.new_zeros((d.shape[0], source_channels, d.shape[2], d.shape[3]))
    full[:, geom.channel : geom.channel + geom.channels] = d
    return full


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A boolean tensor as uint8 bytes, 8 elements per byte (little-endian bit order)."""
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)  # made on the device
    return (flat.view(-1, 8).to(torch.uint8) << shifts).sum(1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of `pack_bits`."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    n = 1
    for s in shape:
        n *= s
    return bits.reshape(-1)[:n].view(shape).bool()


def add_relu_gradient_of_result(a: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """The plain ReLU's gradient, from its result ``r``, of the sum of two incoming gradients:
    ``relu_backward_of_result(a + b, r)`` (``a + b`` where ``r > 0``, else +0.0), with those
    bits. One Triton pass on CUDA tensors of one layout and dtype, else the addition and then
    the gradient."""
    fast = fast_paths.sum_relu_gradient(a, b, r)
    if fast is not None:
        return fast
    return relu_backward_of_result(a + b, r)


def add_activation(x: torch.Tensor, y: torch.Tensor, neuron: NeuronParams) -> torch.Tensor:
    """``f(x + y)`` (a residual block's addition with the ReLU after it fused): one Triton
    pass for the plain ReLU on CUDA tensors of one layout (the bits of the sum rounded to the
    dtype, then MPS's ``(z >= 0) z``), else the addition and then `activation`."""
    if plain_relu(neuron, x):
        fast = fast_paths.add_relu(x, y)
        if fast is not None:
            return fast
    return activation(neuron, x + y)


def normalized_add_activation(
    x: torch.Tensor, p: BatchNormParams, y: torch.Tensor, neuron: NeuronParams, first: bool = True
) -> torch.Tensor:
    """``f(bn(x) + y)``: a residual block's last normalization, its addition and the ReLU
    after it, with the bits of `add_activation` applied to `mpsnn.ops.batch_norm.bn_forward`'s
    result (``bn(x)`` rounded to ``x``'s dtype, then the sum rounded, then ``f``). On CUDA, for
    channels-last ``x`` and ``y`` of one layout and the plain ReLU, one Triton pass that never
    writes ``bn(x)``: it reads two tensors and writes one, where the two passes read three and
    write two. ``first``: ``bn(x)`` is the sum's first operand (else ``f(y + bn(x))``, in
    that order: the layout and a NaN's payload follow the first)."""
    if p.neuron is None and plain_relu(neuron, x):
        fast = fast_paths.batch_norm_add_relu(x, p, y, first)
        if fast is not None:
            return fast
    z = bn_forward(x, p)
    return add_activation(z, y, neuron) if first else add_activation(y, z, neuron)
