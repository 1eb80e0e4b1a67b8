"""The pooling family (MPS ``MPSCNNPooling*``): max, average, L2 norm, dilated max, and their
gradients. The math and its conventions are in `mpsnn.ops.pooling`.

Windows follow the MPS window model: output ``x`` is centred at
``offset.x + stride * (x - clip.origin.x)`` and even windows lean top-left. The kernels default
to ZERO edges (graph pooling nodes will default to CLAMP, as in MPS). Gradient kernels take
their geometry from the forward's state and must be made with the same kernel size, strides,
dilation and zero pad; ``source_size`` limits which part of the incoming gradient contributes.

Every pooling takes dilation rates (``dilation_rate_x/y`` keywords; `DilatedPoolingMax` takes
them in MPS's argument order): the taps are ``c - E // 2 + d j`` with ``E = d (k - 1) + 1``,
as in `DilatedPoolingMax`, forward and gradient alike.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from mpsnn.core._checks import check_int, check_positive, check_type
from mpsnn.core.binary import GradientKernel
from mpsnn.core.cnn_kernel import CNNKernel, Forward, Records
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.device import Device
from mpsnn.core.geometry import (
    _HUGE,
    EdgeMode,
    PaddingMethod,
    Size,
    Window,
    forward_size,
    padding_offset,
    remainder_first,
)
from mpsnn.core.gradient_command import Backward
from mpsnn.core.registry import gradient_of
from mpsnn.core.saved import Field
from mpsnn.core.state import ForwardRecord, GradientState
from mpsnn.ops.plans import PoolGeometry
from mpsnn.ops.pooling import (
    average_pool_backward,
    average_pool_forward,
    l2_pool_backward,
    l2_pool_forward,
    max_pool_backward,
    max_pool_forward,
    max_pool_forward_argmax,
    pool_geometry,
)

__all__ = [
    "DilatedPoolingMax",
    "DilatedPoolingMaxGradient",
    "PoolingAverage",
    "PoolingAverageGradient",
    "PoolingGradient",
    "PoolingL2Norm",
    "PoolingL2NormGradient",
    "PoolingMax",
    "PoolingMaxGradient",
]

_PARAMS = (
    "kernel_width", "kernel_height", "stride_in_pixels_x", "stride_in_pixels_y",
    "dilation_rate_x", "dilation_rate_y",
)  # fmt: skip


class _Argmax:
    """The argmax a max pooling's forward command found (`max_pool_forward_argmax`: the CPU
    tile path's), handed over once to the gradient (`take`) when it reads the tensor the
    forward read (the same tensor, or a view of the same memory, shape, strides and dtype,
    while that tensor is alive); anything else, and a second gradient, gets None and
    recomputes it: the same bits either way.

    Only a graph's step uses it (`_Pooling._graph_encode_batch`): there nothing writes an image
    between its producer and its last reader, so the source the gradient reads holds what the
    forward read. A client's own encodes may write the source in between, and recompute."""

    __slots__ = ("_source", "_tap")

    def __init__(self) -> None:
        self._source: weakref.ref[torch.Tensor] | None = None
        self._tap: torch.Tensor | None = None

    def put(self, x: torch.Tensor, tap: torch.Tensor | None) -> None:
        """At the forward's run: ``tap`` for source ``x`` (None: none found). ``x`` is held
        weakly: a source the graph frees after the forward (and recomputes before the
        backward) is freed, and the gradient then finds the argmax again."""
        self._source, self._tap = (None, None) if tap is None else (weakref.ref(x), tap)

    def take(self, x: torch.Tensor) -> torch.Tensor | None:
        """At the gradient's run: the argmax for source ``x``, or None; released either way.
        While the forward's source is alive its memory cannot hold another tensor."""
        ref, tap = self._source, self._tap
        self._source = self._tap = None
        src = None if ref is None else ref()
        if src is None:
            return None
        if x is not src and (
            x.data_ptr() != src.data_ptr()
            or x.dtype != src.dtype
            or x.shape != src.shape
            or x.stride() != src.stride()
        ):
            return None
        return tap


class _InGraph:
    """Marks a kernel's encodes made by a graph's step (`_graph_encode_batch`), in which max
    pooling hands the forward's argmax to its gradient (`_Argmax`)."""

    _in_graph = False

    def _graph_encode_batch(self, *args: Any) -> Any:
        object.__setattr__(self, "_in_graph", True)
        try:
            return super()._graph_encode_batch(*args)  # type: ignore[misc]
        finally:
            object.__setattr__(self, "_in_graph", False)


@dataclass(frozen=True, slots=True, eq=False)
class PoolingRecord:
    """What a pooling encode hands its gradient: the kernel's window parameters (in the
    order of ``_PARAMS``), its zero pad (average pooling), the resolved geometry and, for max
    pooling, the argmax its command finds (`_Argmax`; None for the other poolings)."""

    window: tuple[int, int, int, int, int, int]
    zero_pad: tuple[int, int]
    geometry: PoolGeometry
    argmax: _Argmax | None = None


class _Pooling(_InGraph, CNNKernel):
    """Shared by the forward pooling kernels."""

    _gradient_state_class = GradientState
    _forward_op = staticmethod(max_pool_forward)

    def __init__(
        self,
        device: Device,
        kernel_width: int,
        kernel_height: int,
        stride_in_pixels_x: int = 1,
        stride_in_pixels_y: int = 1,
        *,
        dilation_rate_x: int = 1,
        dilation_rate_y: int = 1,
    ) -> None:
        super().__init__(
            device,
            kernel_width=kernel_width,
            kernel_height=kernel_height,
            stride_in_pixels_x=stride_in_pixels_x,
            stride_in_pixels_y=stride_in_pixels_y,
            dilation_rate_x=dilation_rate_x,
            dilation_rate_y=dilation_rate_y,
        )

    def _geometry(self, window: Window, memo: dict[str, Any]) -> PoolGeometry:
        geom = memo.get("pool")
        if geom is None:
            geom = memo["pool"] = self._pool_geometry(window)
        return geom

    def _pool_geometry(self, window: Window) -> PoolGeometry:
        return pool_geometry(window.y, window.x, self._edge_mode)

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        geom, op = self._geometry(window, memo), self._forward_op
        stash = records[0][1].params.argmax if records else None
        if stash is None:
            return lambda x: op(x, geom)

        def forward(x: torch.Tensor) -> torch.Tensor:
            y, tap = max_pool_forward_argmax(x, geom)
            stash.put(x, tap)
            return y

        return forward

    def _record_params(self, window: Window, memo: dict[str, Any]) -> PoolingRecord:
        params = (self._kw, self._kh, self._sx, self._sy, self._dx, self._dy)
        zero_pad = (getattr(self, "_zpx", 0), getattr(self, "_zpy", 0))
        # a graph's training encode of max pooling: its gradient takes the argmax the forward
        # finds
        max_pool = self._forward_op is max_pool_forward
        stash = _Argmax() if max_pool and self._in_graph else None
        return PoolingRecord(params, zero_pad, self._geometry(window, memo), stash)


#: what a pooling kernel saves: its window (the constructor's arguments)
_WINDOW_FIELDS = (
    Field("kernel_width", int, minimum=1), Field("kernel_height", int, minimum=1),
    Field("stride_in_pixels_x", int, minimum=1), Field("stride_in_pixels_y", int, minimum=1),
    Field("dilation_rate_x", int, minimum=1), Field("dilation_rate_y", int, minimum=1),
)  # fmt: skip


class PoolingMax(_Pooling):
    """Maximum over each window (MPS ``MPSCNNPoolingMax``).

    Args:
        device: the kernel's device.
        kernel_width, kernel_height: window size (odd or even).
        stride_in_pixels_x, stride_in_pixels_y: strides (default 1).

    With ZERO edges, zeros read outside the image take part in the maximum.
    """

    saved_fields = _WINDOW_FIELDS


class _DilatedArguments:
    """The MPS argument order of the dilated kernels: dilation rates before strides."""

    def __init__(
        self,
        device: Device,
        kernel_width: int,
        kernel_height: int,
        dilation_rate_x: int = 1,
        dilation_rate_y: int = 1,
        stride_in_pixels_x: int = 1,
        stride_in_pixels_y: int = 1,
    ) -> None:
        super().__init__(  # type: ignore[call-arg]  # the pooling class after this mixin
            device, kernel_width, kernel_height, stride_in_pixels_x, stride_in_pixels_y,
            dilation_rate_x=dilation_rate_x, dilation_rate_y=dilation_rate_y,
        )  # fmt: skip


class DilatedPoolingMax(_DilatedArguments, _Pooling):
    """Maximum over a dilated window (MPS ``MPSCNNDilatedPoolingMax``): taps
    ``c - E // 2 + d * j``; kernel 2 with dilation 3 reads ``c - 2`` and ``c + 1``."""

    saved_fields = _WINDOW_FIELDS


class PoolingL2Norm(_Pooling):
    """``sqrt(sum x^2)`` over each window (MPS ``MPSCNNPoolingL2Norm``), computed scaled by a
    power of two near the window's largest ``|x|`` (as ``hypot``): finite and accurate for every
    finite input, e.g. four values of 3e19 give 6e19 and a gradient of 0.5 each in float32."""

    _forward_op = staticmethod(l2_pool_forward)
    saved_fields = _WINDOW_FIELDS


class _ZeroPad:
    """``zero_pad_size_x/y`` of the average pooling kernels."""

    _zpx = 0
    _zpy = 0

    @property
    def zero_pad_size_x(self) -> int:
        """With CLAMP edges, how far the window may reach into a zero border (counted in the
        divisor). Ignored with ZERO edges."""
        return self._zpx

    @zero_pad_size_x.setter
    def zero_pad_size_x(self, value: int) -> None:
        self._zpx = check_int(type(self).__name__, "zero_pad_size_x", value, 0)

    @property
    def zero_pad_size_y(self) -> int:
        return self._zpy

    @zero_pad_size_y.setter
    def zero_pad_size_y(self, value: int) -> None:
        self._zpy = check_int(type(self).__name__, "zero_pad_size_y", value, 0)


class PoolingAverage(_ZeroPad, _Pooling):
    """Mean over each window (MPS ``MPSCNNPoolingAverage``); the divisor rules are in
    `mpsnn.ops.pooling`: ZERO divides by the whole window (its ``k_x k_y`` taps, dilated or
    not), CLAMP shrinks the window to its taps inside the image grown by
    ``zero_pad_size_x/y``, and ZERO with the EXCLUDE_EDGES padding flag counts only the image
    and the padding the policy adds (Caffe)."""

    def _valid(self, window: Window, size_y: int, size_x: int) -> tuple[Any, Any]:
        if self._edge_mode is EdgeMode.CLAMP:
            return (-self._zpy, size_y + self._zpy), (-self._zpx, size_x + self._zpx)
        method = PaddingMethod(self._padding.padding_method)
        if not method & PaddingMethod.EXCLUDE_EDGES:
            return None, None
        x_first, y_first = remainder_first(method)
        return (
            _policy_region(size_y, window.y, method, y_first),
            _policy_region(size_x, window.x, method, x_first),
        )

    _forward_op = staticmethod(average_pool_forward)
    saved_fields = (
        *_WINDOW_FIELDS,
        Field("zero_pad_size_x", int, init=False, minimum=0),
        Field("zero_pad_size_y", int, init=False, minimum=0),
    )

    def _pool_geometry(self, window: Window) -> PoolGeometry:
        vy, vx = self._valid(window, window.y.size, window.x.size)
        # Reads outside the image are zeros: CLAMP shrinks the window, it does not replicate.
        return pool_geometry(window.y, window.x, self._edge_mode, vy, vx, read_edge=EdgeMode.ZERO)


def _policy_region(size: int, a: Any, method: PaddingMethod, first: bool) -> tuple[int, int]:
    """The image plus the padding the policy adds along one axis: ``[-before, size + after)``."""
    extent, stride = a.extent, a.stride
    dst = forward_size(size, extent, stride, method.size_style)
    offset = padding_offset(size, dst, extent, stride, method.alignment, first)
    before = max(extent // 2 - offset, 0)
    after = max((dst - 1) * stride + extent - size - before, 0)
    return -before, size + after


class PoolingGradient(_InGraph, GradientKernel):
    """Base of the pooling gradients (MPS ``MPSCNNPoolingGradient``).

    Args:
        device: the kernel's device.
        kernel_width, kernel_height, stride_in_pixels_x, stride_in_pixels_y: must equal the
            forward pooling's.

    ``source_size`` (default: all of it) limits the incoming gradient that contributes to the
    first ``width x height`` outputs the forward wrote.
    """

    _state_class = GradientState
    _backward_op = staticmethod(max_pool_backward)

    def __init__(
        self,
        device: Device,
        kernel_width: int,
        kernel_height: int,
        stride_in_pixels_x: int = 1,
        stride_in_pixels_y: int = 1,
        *,
        dilation_rate_x: int = 1,
        dilation_rate_y: int = 1,
    ) -> None:
        who = type(self).__name__
        params = (
            kernel_width, kernel_height, stride_in_pixels_x, stride_in_pixels_y,
            dilation_rate_x, dilation_rate_y,
        )  # fmt: skip
        for name, value in zip(_PARAMS, params, strict=True):
            check_positive(who, name, value)
        super().__init__(
            device,
            secondary_kernel=(kernel_width, kernel_height),
            secondary_dilation=(dilation_rate_x, dilation_rate_y),
        )
        self._params = dict(zip(_PARAMS, params, strict=True))
        self._source_size = Size(_HUGE, _HUGE, _HUGE)

    @property
    def source_size(self) -> Size:
        return self._source_size

    @source_size.setter
    def source_size(self, value: Size) -> None:
        self._source_size = check_type(type(self).__name__, "source_size", value, Size)

    def _check_forward(self, record: ForwardRecord) -> None:
        who = type(self).__name__
        p: PoolingRecord = record.params
        for (name, value), theirs in zip(self._params.items(), p.window, strict=True):
            if theirs != value:
                raise ValueError(
                    f"[{who}] {name} must equal the forward pooling's ({theirs}), got {value}"
                )
        for name, theirs in zip(("zero_pad_size_x", "zero_pad_size_y"), p.zero_pad, strict=True):
            if theirs != getattr(self, name, 0):
                raise ValueError(
                    f"[{who}] {name} must equal the forward pooling's ({theirs}), "
                    f"got {getattr(self, name, 0)}"
                )

    def _make_backward(
        self, cb: CommandBuffer, record: ForwardRecord, window: Window, states: list[Any]
    ) -> Backward:
        geom: PoolGeometry = record.params.geometry
        op = self._backward_op
        stash = record.params.argmax if op is max_pool_backward and self._in_graph else None
        if stash is not None:  # max pooling: the forward's argmax, where it is still valid
            op = lambda g, x, geom: max_pool_backward(g, x, geom, stash.take(x))  # noqa: E731
        sw, sh = self._source_size.width, self._source_size.height
        if sw >= window.x.count and sh >= window.y.count:
            return lambda g, x: op(g, x, geom)

        def limited(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            g = g.clone()
            g[:, :, sh:, :] = 0
            g[:, :, :, sw:] = 0
            return op(g, x, geom)

        return limited


@gradient_of(PoolingMax)
class PoolingMaxGradient(PoolingGradient):
    """Gradient of `PoolingMax` (MPS ``MPSCNNPoolingMaxGradient``): each output's gradient goes
    to the first maximum of its window in the source it reads (on the CPU, disjoint windows
    take the argmax the forward found when that source is the tensor the forward read,
    unchanged; otherwise it is recomputed); none goes to a maximum that is a ZERO-edge padding
    value. On CUDA, disjoint windows use a one-pass Triton kernel."""


@gradient_of(DilatedPoolingMax)
class DilatedPoolingMaxGradient(_DilatedArguments, PoolingGradient):
    """Gradient of `DilatedPoolingMax` (MPS ``MPSCNNDilatedPoolingMaxGradient``)."""


@gradient_of(PoolingL2Norm)
class PoolingL2NormGradient(PoolingGradient):
    """Gradient of `PoolingL2Norm`: ``g x / y`` (computed from the scaled taps, so it is finite
    wherever the norm is), and 0 for an all-zero window."""

    _backward_op = staticmethod(l2_pool_backward)


@gradient_of(PoolingAverage)
class PoolingAverageGradient(_ZeroPad, PoolingGradient):
    """Gradient of `PoolingAverage`: ``g / N`` spread over the image pixels of each window."""

    _backward_op = staticmethod(average_pool_backward)
