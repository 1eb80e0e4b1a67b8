"""Arithmetic kernels (MPS ``MPSCNNAdd``, ``Subtract``, ``Multiply``, ``Divide``) and their
gradient state; the gradient kernels are in `mpsnn.cnn.arithmetic_gradient`.

``z = clamp(op(primary_scale x, secondary_scale y) + bias, minimum_value, maximum_value)``, with
``x`` the primary and ``y`` the secondary source. Each source is read with its own offset, edge
mode, channel offset and max count, and strides of 0 or 1 in x, y and feature channels: 0
broadcasts that source along the axis (all zeros: a single value). Output pixel ``u`` (counted
from the clip origin) reads ``offset + stride * u`` of each source. The returning encode sizes the
destination from the sources read with stride 1 (which must agree), 1 along all-broadcast axes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mpsnn.cnn.neuron_descriptor import FusedNeuron
from mpsnn.core._checks import check_int
from mpsnn.core.binary import BinaryKernel
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.descriptor import ImageDescriptor, _result_format
from mpsnn.core.device import Device
from mpsnn.core.encode import Encoding
from mpsnn.core.geometry import AxisWindow
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.kernel import image_sequences, resolve_span
from mpsnn.core.state import BinaryGradientState, State, StateBatch
from mpsnn.ops.arithmetic import (
    ADD,
    DIVIDE,
    MULTIPLY,
    SUBTRACT,
    ReadGeometry,
    add_activation,
    add_relu_gradient_of_result,
    normalized_add_activation,
    pack_bits,
    read_geometry,
    read_source,
)
from mpsnn.ops.batch_norm import bn_forward
from mpsnn.ops.neuron import relu_backward_of_result

__all__ = [
    "Add",
    "Arithmetic",
    "ArithmeticGradientState",
    "Divide",
    "Multiply",
    "Subtract",
]

FLT_MAX = 3.4028234663852886e38


@dataclass(frozen=True, slots=True, eq=False)
class ArithmeticRecord:
    """What an arithmetic encode did, for its gradients (the state's typed record)."""

    kernel: Any
    op: int | Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # or a family's own (Compare)
    scales: tuple[float, float, float]  # primary, secondary, bias
    clamp: tuple[float, float]
    reads: tuple[ReadGeometry, ReadGeometry]  # primary, secondary
    shapes: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # primary, secondary, dst
    images: tuple[int, int, int, int]  # first primary, secondary, destination image; count
    out: tuple[int, int, int, int, int, int]  # channel, channels, y, ny, x, nx
    batch: bool


class ArithmeticGradientState(BinaryGradientState):
    """The forward's geometry, its clamp mask (bit-packed, only when it clamps) and, for
    Divide, a reference to the divisor it read (MPS ``MPSCNNArithmeticGradientState``; one
    state serves a whole batch)."""

    def __init__(
        self,
        device: Device,
        *,
        command_buffer: CommandBuffer | None = None,
        label: str | None = None,
    ) -> None:
        super().__init__(device, command_buffer=command_buffer, label=label)
        self._mask: torch.Tensor | None = None  # where the forward did not clamp, 1 bit each
        self._mask_shape: tuple[int, ...] = ()
        self._divisor: torch.Tensor | None = None

    def resources(self) -> list[torch.Tensor]:
        return [t for t in (self._mask,) if t is not None]

    def _free_storage(self) -> None:
        self._mask = None
        self._divisor = None


class _Value:
    """A float property of an arithmetic kernel."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.attr = name, "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return self if obj is None else getattr(obj, self.attr)

    def __set__(self, obj: Any, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(
                f"[{type(obj).__name__}] {self.name} must be a number, got {type(value).__name__}"
            )
        setattr(obj, self.attr, float(value))


def _stride(who: str, name: str, value: int) -> int:
    if value not in (0, 1):
        raise ValueError(f"[{who}] {name} must be 0 (broadcast) or 1, got {value}")
    return value


class Arithmetic(BinaryKernel):
    """Base of the arithmetic kernels (MPS ``MPSCNNArithmetic``); see the module docstring."""

    _op = ADD
    _reused_across_batch = True  # one state (the clamp mask, the geometry) for the batch
    primary_scale = _Value()
    secondary_scale = _Value()
    bias = _Value()
    minimum_value = _Value()
    maximum_value = _Value()

    def __init__(self, device: Device) -> None:
        super().__init__(device)
        self._primary_scale = self._secondary_scale = 1.0
        self._bias = 0.0
        self._minimum_value, self._maximum_value = -FLT_MAX, FLT_MAX
        self._cstride = [1, 1]
        # A neuron applied after the clamp: not an MPS property. A graph fuses the ReLU after
        # an arithmetic node into it (`mpsnn.graph.plan`); the gradient kernels ignore it (the
        # graph differentiates the ReLU from its result before the arithmetic gradients run).
        self._neuron: FusedNeuron | None = None
        # The result of a plain ReLU whose gradient this sum is the incoming gradient of: set
        # by a graph around one encode of a gradient sum (`mpsnn.graph.plan_passes`), which
        # then writes that gradient, ``a + b`` where the result is > 0, in one command.
        self._gradient_mask: Image | None = None
        # One operand is ``bn(x)``, normalized inside this command: ``(operand index, x, the
        # normalization's state, its forward record)``, set by a graph around one encode of a
        # residual sum (`mpsnn.graph.plan_passes._normalized_sums`); that operand's image is a
        # stand-in of its shape, never read.
        self._normalized: tuple[int, Image, Any, Any] | None = None

    @property
    def primary_stride_in_feature_channels(self) -> int:
        return self._cstride[0]

    @primary_stride_in_feature_channels.setter
    def primary_stride_in_feature_channels(self, value: int) -> None:
        self._cstride[0] = check_int(
            type(self).__name__, "primary_stride_in_feature_channels", value, 0
        )

    @property
    def secondary_stride_in_feature_channels(self) -> int:
        return self._cstride[1]

    @secondary_stride_in_feature_channels.setter
    def secondary_stride_in_feature_channels(self, value: int) -> None:
        self._cstride[1] = check_int(
            type(self).__name__, "secondary_stride_in_feature_channels", value, 0
        )

    @property
    def is_state_modified(self) -> bool:
        return True

    # -- states ---------------------------------------------------------------------------

    def result_state(
        self,
        primary_image: Image,
        secondary_image: Image,
        source_states: Any = None,
        destination_image: Image | None = None,
    ) -> State:
        return ArithmeticGradientState(self._device)

    def temporary_result_state(
        self,
        command_buffer: CommandBuffer,
        primary_image: Image,
        secondary_image: Image,
        source_states: Any = None,
        destination_image: Image | None = None,
    ) -> State:
        self._check_command_buffer(command_buffer)
        return ArithmeticGradientState(self._device, command_buffer=command_buffer)

    def result_state_batch(
        self,
        primary_images: ImageBatch,
        secondary_images: ImageBatch,
        source_states: Any = None,
        destination_images: Any = None,
    ) -> StateBatch:
        return StateBatch([ArithmeticGradientState(self._device)] * len(primary_images))

    # -- encode ---------------------------------------------------------------------------

    def encode(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        primary_image: Image,
        secondary_image: Image,
        destination_image: Image | None = None,
        destination_state: State | None = None,
    ) -> Image:
        """``z = clamp(op(ps x, ss y) + bias, min, max)``; a ``destination_state`` from
        `result_state` keeps what the gradient kernels need."""
        cb = command_buffer
        self._check_command_buffer(cb)
        self._check_image(cb, primary_image, "primary_image")
        self._check_image(cb, secondary_image, "secondary_image")
        states = (
            []
            if destination_state is None
            else [
                self._check_state(
                    cb, destination_state, "destination_state", ArithmeticGradientState
                )
            ]
        )
        return self._encode(
            cb, primary_image, secondary_image, destination_image, states, batch=False
        )

    @image_sequences("primary_images", "secondary_images", destinations=("destination_images",))
    def encode_batch(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        primary_images: ImageBatch,
        secondary_images: ImageBatch,
        destination_images: ImageBatch | None = None,
        destination_states: Sequence[State] | None = None,
    ) -> ImageBatch:
        cb = command_buffer
        self._check_command_buffer(cb)
        p = self._check_batch(cb, primary_images, "primary_images")
        s = self._check_batch(cb, secondary_images, "secondary_images")
        d = (
            None
            if destination_images is None
            else self._check_batch(cb, destination_images, "destination_images")
        )
        states: list[Any] = []
        if destination_states is not None:
            states = self._check_state_batch(
                cb,
                destination_states,
                "destination_states",
                ArithmeticGradientState,
                len(primary_images),
                shared=True,
            )
        out = self._encode(cb, p, s, d, states[:1], batch=True)
        return destination_images if destination_images is not None else ImageBatch(out)

    def _channels(self, image: Image, which: int) -> tuple[int, int]:
        who = type(self).__name__
        names = ("primary", "secondary")
        sco = (
            self._primary_source_feature_channel_offset,
            self._secondary_source_feature_channel_offset,
        )[which]
        smax = (
            self._primary_source_feature_channel_max_count,
            self._secondary_source_feature_channel_max_count,
        )[which]
        c = image.feature_channels
        if sco >= c:
            raise ValueError(
                f"[{who}] {names[which]}_source_feature_channel_offset must be < the "
                f"{names[which]} source's {c} channels, got {sco}"
            )
        return sco, (min(smax, c - sco) if self._cstride[which] else 1)

    def _encode(
        self,
        cb: CommandBuffer,
        p: Image,
        s: Image,
        dst: Image | None,
        states: list[Any],
        batch: bool,
    ) -> Image:
        who = type(self).__name__
        strides = []
        for which, name in ((0, "primary"), (1, "secondary")):
            sx = _stride(
                who, f"{name}_stride_in_pixels_x", getattr(self, f"_{name}_stride_in_pixels_x")
            )
            sy = _stride(
                who, f"{name}_stride_in_pixels_y", getattr(self, f"_{name}_stride_in_pixels_y")
            )
            sc = _stride(who, f"{name}_stride_in_feature_channels", self._cstride[which])
            strides.append((sc, sy, sx))
        (pc0, pnc), (sc0, snc) = self._channels(p, 0), self._channels(s, 1)
        channels = _agree(
            who,
            "feature channel counts",
            pnc if strides[0][0] else None,
            snc if strides[1][0] else None,
        )
        offsets = (self._primary_offset, self._secondary_offset)
        if batch:
            if p.number_of_images != s.number_of_images:
                raise ValueError(
                    f"[{who}] the primary and secondary batches must hold as many images, "
                    f"got {p.number_of_images} and {s.number_of_images}"
                )
            pz = sz = dz = 0
            count = p.number_of_images
        else:
            pz, sz = offsets[0].z, offsets[1].z
            if min(pz, sz, self._clip.origin.z) < 0:
                raise ValueError(
                    f"[{who}] the z offsets must be >= 0, got {pz}, {sz} and {self._clip.origin.z}"
                )
            dz = self._clip.origin.z
            count = min(self._clip.size.depth, p.number_of_images - pz, s.number_of_images - sz)
        dst_write = dst
        if dst is None:
            h = _agree(
                who,
                "heights",
                p.height if strides[0][1] else None,
                s.height if strides[1][1] else None,
            )
            w = _agree(
                who,
                "widths",
                p.width if strides[0][2] else None,
                s.width if strides[1][2] else None,
            )
            fmt = _result_format(p.feature_channel_format)
            desc = ImageDescriptor(fmt, w, h, channels, max(count, 1))
            dshape = desc.shape
        else:
            self._check_destination(cb, dst, "destination_image", p, s)
            desc, dshape = None, dst._shape
            if self._dco + channels > dshape[1]:
                raise ValueError(
                    f"[{who}] the destination needs destination_feature_channel_offset + "
                    f"{channels} channels = {self._dco + channels}, "
                    f"got a destination with {dshape[1]}"
                )
            if batch and dshape[0] != count:
                raise ValueError(
                    f"[{who}] the destination batch must hold {count} images, got {dshape[0]}"
                )
            if not batch:
                count = min(count, dshape[0] - dz)
        if count <= 0:
            raise ValueError(
                f"[{who}] the z offsets and clip rect must select at least one image, got none"
            )
        y0, ny = resolve_span(who, "y", self._clip.origin.y, self._clip.size.height, dshape[2])
        x0, nx = resolve_span(who, "x", self._clip.origin.x, self._clip.size.width, dshape[3])
        reads = []
        for which, image, c0, nc in ((0, p, pc0, pnc), (1, s, sc0, snc)):
            sc, sy, sx = strides[which]
            off = offsets[which]
            ay = AxisWindow(
                off.y + sy * (y0 - self._clip.origin.y), ny if sy else 1, 1, 1, 1, image.height
            )
            ax = AxisWindow(
                off.x + sx * (x0 - self._clip.origin.x), nx if sx else 1, 1, 1, 1, image.width
            )
            edge = (self._primary_edge_mode, self._secondary_edge_mode)[which]
            reads.append(read_geometry(ay, ax, edge, c0, nc, (not sc, not sy, not sx)))
        record = ArithmeticRecord(
            self, self._op, (self._primary_scale, self._secondary_scale, self._bias),
            (self._minimum_value, self._maximum_value), (reads[0], reads[1]),
            (p._shape, s._shape, dshape), (pz, sz, dz, count),
            (self._dco, channels, y0, ny, x0, nx), batch,
        )  # fmt: skip
        state = states[0] if states else None
        run = _command(record, p, s, state, self._neuron, self._gradient_mask, self._normalized)
        out = dst_write if dst_write is not None else desc
        enc = Encoding(run, (out,), (p, s), [(st, record) for st in states], None, batch)
        return self._apply(cb, enc)[0]  # type: ignore[return-value]


def _agree(who: str, what: str, a: int | None, b: int | None) -> int:
    if a is not None and b is not None and a != b:
        raise ValueError(
            f"[{who}] the sources' {what} cannot broadcast: {a} and {b} (both read with stride 1)"
        )
    return a if a is not None else (b if b is not None else 1)


def apply_op(
    op: int | Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    scales: tuple[float, float, float],
) -> torch.Tensor:
    """``(ps x) op (ss y) + bias`` (``scales = (ps, ss, bias)``), a new tensor.

    A scale of 1 and a bias of 0 are not applied: ``x * 1`` is ``x`` bit for bit, and ``z + 0``
    differs from ``z`` only in turning a -0.0 result into +0.0 (skipping it gives -0.0 there, as
    ``torch.add`` does). A residual addition is then one pass instead of four.
    """
    ps, ss, bias = scales
    a, b = scaled(x, ps), scaled(y, ss)
    if callable(op):  # a subclass's own elementwise operation of the scaled operands
        z = op(a, b)
    elif op == ADD:
        z = a + b
    elif op == SUBTRACT:
        z = a - b
    elif op == MULTIPLY:
        z = a * b
    else:
        z = a / b
    return z if bias == 0.0 else z + bias


def scaled(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``t * factor``; ``t`` itself when ``factor`` is 1 (the same bits, no pass over ``t``)."""
    return t if factor == 1.0 else t * factor


def _command(
    record: ArithmeticRecord,
    p: Image,
    s: Image,
    state: Any,
    neuron: FusedNeuron | None = None,
    mask: Image | None = None,
    normalized: tuple[int, Image, Any, Any] | None = None,
) -> Callable[[Image], None]:
    pz, sz, dz, count = record.images
    c0, nc, y0, ny, x0, nx = record.out
    lo, hi = record.clamp
    clamps = lo > -FLT_MAX or hi < FLT_MAX
    # a plain sum with the neuron after it: one pass where it can (`add_activation`)
    add_then = (
        neuron is not None and record.op == ADD and record.scales == (1.0, 1.0, 0.0) and not clamps
    )

    # a gradient sum with a plain ReLU's gradient after it (``mask``: the ReLU's result)
    plain_sum = record.op == ADD and record.scales == (1.0, 1.0, 0.0) and not clamps

    # the image whose layout the result takes (the primary's; bn(x) has x's)
    layout = normalized[1] if normalized is not None and normalized[0] == 0 else p

    def run(out: Image) -> None:
        fused = None
        if normalized is None:
            x = read_source(p._read()[pz : pz + count], record.reads[0])
            y = read_source(s._read()[sz : sz + count], record.reads[1])
        else:  # one operand is bn(t): normalized here, with the statistics of its state
            i, t_image, bn_state, bn_record = normalized
            zs = (pz, sz)
            t = read_source(t_image._read()[zs[i] : zs[i] + count], record.reads[i])
            o = read_source((s, p)[i]._read()[zs[1 - i] : zs[1 - i] + count], record.reads[1 - i])
            params = bn_record.params(*bn_state._mean_variance())
            if (
                add_then
                and t.shape == o.shape
                and t.dtype is out._read_dtype
                and o.dtype is t.dtype
            ):
                fused = normalized_add_activation(t, params, o, neuron.params, i == 0)  # type: ignore[union-attr]
            else:  # the two passes, as the unfused graph runs them
                t = bn_forward(t, params)
            x, y = (t, o) if i == 0 else (o, t)
        r = (
            None
            if mask is None
            else mask._read()[dz : dz + count, c0 : c0 + nc, y0 : y0 + ny, x0 : x0 + nx]
        )
        if fused is not None:  # f(bn(t) + o) in one pass: `add_activation`'s bits
            z = fused
            if state is not None:  # as below: only the shape to record
                state._mask, state._mask_shape, state._divisor = None, tuple(z.shape), None
        elif (
            r is not None
            and plain_sum
            and neuron is None
            and x.shape == y.shape == r.shape
            and x.dtype is out._read_dtype
        ):
            z = add_relu_gradient_of_result(x, y, r)
            r = None  # applied
        elif add_then and x.shape == y.shape and x.dtype is out._read_dtype:
            z = add_activation(x, y, neuron.params)  # type: ignore[union-attr]
            if state is not None:  # no clamp, no divisor: only the shape to record
                state._mask, state._mask_shape, state._divisor = None, tuple(z.shape), None
        else:
            z = apply_op(record.op, x, y, record.scales)
            if state is not None:
                state._mask = pack_bits((z > lo) & (z < hi)) if clamps else None
                state._mask_shape = tuple(z.shape)
                state._divisor = y.clone() if record.op == DIVIDE else None  # no input alias
            if clamps:
                z = z.clamp(lo, hi)
            if neuron is not None:  # on the stored values, as the unfused neuron reads them
                z = neuron.forward(z.to(out._read_dtype))
        if z.shape != (count, nc, ny, nx):  # materialize a broadcast (an expanded view); an
            z = torch.broadcast_to(z, (count, nc, ny, nx)).contiguous()  # equal shape keeps
        if r is not None:  # the ReLU's gradient of the stored sum, as its own command reads it
            z = relu_backward_of_result(z.to(out._read_dtype), r)
        out._write_block(z.to(out._read_dtype), dz, c0, y0, x0, layout._data())  # its layout

    return run


class Add(Arithmetic):
    """``clamp(ps x + ss y + bias, min, max)`` (MPS ``MPSCNNAdd``)."""

    _op = ADD


class Subtract(Arithmetic):
    """``clamp(ps x - ss y + bias, min, max)`` (MPS ``MPSCNNSubtract``)."""

    _op = SUBTRACT


class Multiply(Arithmetic):
    """``clamp((ps x) (ss y) + bias, min, max)`` (MPS ``MPSCNNMultiply``)."""

    _op = MULTIPLY


class Divide(Arithmetic):
    """``clamp((ps x) / (ss y) + bias, min, max)`` (MPS ``MPSCNNDivide``)."""

    _op = DIVIDE
