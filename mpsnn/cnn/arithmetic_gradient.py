"""Arithmetic gradient kernels (MPS ``MPSCNNAddGradient``, ``SubtractGradient``,
``MultiplyGradient``; ``DivideGradient`` is an mpsnn extension: MPS has none).

One kernel per forward input (``is_secondary_source_filter``). Formulas and the broadcast sums
are in `mpsnn.ops.arithmetic`; the clamp mask of the forward zeroes the gradient where it clamped.

``source_image`` (the secondary input of the gradient encode) is, as in MPS:

* Add / Subtract: the forward input this kernel differentiates (its shape is checked);
* Multiply / Divide: the *other* forward input (``y`` for the primary filter, ``x`` for the
  secondary one), whose values the derivative needs. DivideGradient's secondary filter also
  needs the divisor ``y``: the state keeps a copy of the block the forward read.

Gradient geometry (offsets, strides, clamp range, scales) comes from the state; the scale and
clamp properties report the forward's values.
"""

from __future__ import annotations

from typing import Any

import torch

from mpsnn.cnn.arithmetic import (
    FLT_MAX,
    Add,
    ArithmeticGradientState,
    ArithmeticRecord,
    Divide,
    Multiply,
    Subtract,
    scaled,
)
from mpsnn.core._checks import check_type
from mpsnn.core.binary import GradientKernel
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.descriptor import ImageDescriptor, _result_format
from mpsnn.core.device import Device
from mpsnn.core.encode import Encoding
from mpsnn.core.image import Image
from mpsnn.core.registry import gradient_of
from mpsnn.core.state import _unique
from mpsnn.ops._dtypes import acc_dtype
from mpsnn.ops.arithmetic import (
    ADD,
    DIVIDE,
    MULTIPLY,
    SUBTRACT,
    read_source,
    read_source_adjoint,
    unpack_bits,
)

__all__ = [
    "AddGradient",
    "ArithmeticGradient",
    "DivideGradient",
    "MultiplyGradient",
    "SubtractGradient",
]


class ArithmeticGradient(GradientKernel):
    """Base of the arithmetic gradients (MPS ``MPSCNNArithmeticGradient``).

    Args:
        device: the kernel's device.
        is_secondary_source_filter: False for d/d(primary), True for d/d(secondary).
    """

    _state_class = ArithmeticGradientState
    _shared_state_batch = True

    def __init__(self, device: Device, is_secondary_source_filter: bool) -> None:
        super().__init__(device)
        self._secondary_filter = check_type(
            type(self).__name__, "is_secondary_source_filter", is_secondary_source_filter, bool
        )
        self._last: ArithmeticRecord | None = None

    @property
    def is_secondary_source_filter(self) -> bool:
        return self._secondary_filter

    def _reported(self, index: int, default: float) -> float:
        return default if self._last is None else (*self._last.scales, *self._last.clamp)[index]

    @property
    def primary_scale(self) -> float:
        return self._reported(0, 1.0)

    @property
    def secondary_scale(self) -> float:
        return self._reported(1, 1.0)

    @property
    def bias(self) -> float:
        """Reported; a bias does not enter the gradient."""
        return self._reported(2, 0.0)

    @property
    def minimum_value(self) -> float:
        return self._reported(3, -FLT_MAX)

    @property
    def maximum_value(self) -> float:
        return self._reported(4, FLT_MAX)

    def _plan_gradient(
        self,
        cb: CommandBuffer,
        grad: Image,
        other: Image,
        record: Any,
        states: list[Any],
        dst: Image | None,
        batch: bool,
    ) -> Encoding:
        who = type(self).__name__
        unique = _unique(states)
        if len(unique) != 1:
            raise ValueError(
                f"[{who}] gradient_states must repeat one state (see result_state_batch), "
                f"got {len(unique)} distinct states"
            )
        state = unique[0]
        this = 1 if self._secondary_filter else 0
        needs_other = record.op in (MULTIPLY, DIVIDE)
        pz, sz, dz, count = record.images
        kind = "encode_batch" if record.batch else "encode"
        if batch != record.batch:
            raise ValueError(
                f"[{who}] the gradient of an {kind} must use {kind}, got the other form"
            )
        _check(who, "source_gradient", grad, record.shapes[2], "destination")
        names = ("primary", "secondary")
        sec = (1 - this) if needs_other else this
        _check(who, "source_image", other, record.shapes[sec], f"{names[sec]} source")
        n, c, h, w = record.shapes[this]
        if dst is not None and dst._shape != (n, c, h, w):
            raise ValueError(
                f"[{who}] destination_gradient must have the {names[this]} source's shape "
                f"{(n, c, h, w)}, got {dst._shape}"
            )
        fmt = _result_format(grad._fmt)
        out = dst if dst is not None else ImageDescriptor._make(fmt, w, h, c, n)
        z_this, z_other = (pz, sz)[this], (pz, sz)[sec]
        c0, nc, y0, ny, x0, nx = record.out
        ps, ss, _ = record.scales
        op = record.op
        this_read, other_read = record.reads[this], record.reads[1 - this]

        def run(out: Image) -> None:
            g = grad._read()[dz : dz + count, c0 : c0 + nc, y0 : y0 + ny, x0 : x0 + nx]
            if state._mask is not None:
                g = g * unpack_bits(state._mask, state._mask_shape).to(g.dtype)
            if needs_other:  # the other input, as the forward read it
                v = read_source(other._read()[z_other : z_other + count], other_read)
                if v.dtype != g.dtype:  # mixed formats: compute in the wider one
                    wide = torch.promote_types(g.dtype, v.dtype)
                    g, v = g.to(wide), v.to(wide)
            if op == MULTIPLY:
                d = g * (v * (ps * ss))
            elif op == DIVIDE and this == 0:  # d/dx of ps x / (ss y): ps / (ss y)
                d = g * (ps / (v * ss))
            elif op == DIVIDE:  # d/dy: -ps x / (ss y^2), y as the forward read it (its state)
                yv = state._divisor.to(g.dtype)
                d = -g * (ps * v / (ss * yv * yv))
            else:  # add, subtract: the scale (no pass when it is 1), negated for -y
                d = scaled(g, ss if this else ps)
                if op == SUBTRACT and this:
                    d = -d
            if d.shape != (count, nc, ny, nx):  # broadcast_to would make a view even when equal
                d = torch.broadcast_to(d, (count, nc, ny, nx))
            dsrc = read_source_adjoint(d, this_read, c, acc_dtype(d.dtype)).to(out._read_dtype)
            out._write_block(dsrc, z_this, 0, 0, 0, grad._data())

        return Encoding(run, (out,), (grad, other, state), (), {"_last": record}, batch)

    def _passes_gradient_on(self, grad: Image, states: list[Any]) -> bool:
        """Whether this gradient is ``grad`` itself, value for value and in its format: an
        addition's gradient (or a subtraction's primary one) at scale 1, with no clamp, whose
        forward read and wrote whole images of one shape (no offset, clip, channel range or
        broadcast). A graph then lets the gradient node hold ``grad``'s image instead of a
        copy (the kernel itself never aliases its source). Checks nothing else: the graph
        calls it with the state its own forward node wrote."""
        unique = _unique(states)
        if len(unique) != 1 or unique[0]._forward is None:
            return False
        record: ArithmeticRecord = unique[0]._forward
        this = 1 if self._secondary_filter else 0
        if record.op not in (ADD, SUBTRACT) or (record.op == SUBTRACT and this):
            return False
        if record.scales[this] != 1.0 or record.clamp != (-FLT_MAX, FLT_MAX):
            return False
        n, c, h, w = shape = record.shapes[this]
        read = record.reads[this]
        return (
            shape == record.shapes[2] == grad._shape
            and record.images == (0, 0, 0, n)
            and record.out == (0, c, 0, h, 0, w)
            and read.plan.identity
            and read.channel == 0
            and read.channels == c
            and not any(read.broadcast)
            and _result_format(grad._fmt) is grad._fmt
        )


def _check(who: str, name: str, image: Image, want: tuple[int, ...], what: str) -> None:
    if image._shape[1:] != tuple(want[1:]) or image.number_of_images < want[0]:
        raise ValueError(
            f"[{who}] {name} must have the forward {what}'s shape {tuple(want)}, got {image._shape}"
        )


@gradient_of(Add)
class AddGradient(ArithmeticGradient):
    """Gradient of `Add`: ``g ps`` (primary), ``g ss`` (secondary), summed over broadcasts."""


@gradient_of(Subtract)
class SubtractGradient(ArithmeticGradient):
    """Gradient of `Subtract`: ``g ps`` (primary), ``-g ss`` (secondary)."""


@gradient_of(Multiply)
class MultiplyGradient(ArithmeticGradient):
    """Gradient of `Multiply`: ``g ps ss y`` (primary), ``g ps ss x`` (secondary);
    ``source_image`` is the other input."""


@gradient_of(Divide)
class DivideGradient(ArithmeticGradient):
    """Gradient of `Divide` (an mpsnn extension, MPS has no divide gradient):
    ``g ps / (ss y)`` (primary; ``source_image`` = y) and ``-g ps x / (ss y^2)`` (secondary;
    ``source_image`` = x, and the divisor comes from the state)."""
