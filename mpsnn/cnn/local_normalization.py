"""Local normalizations (MPS ``MPSCNNCrossChannelNormalization``,
``MPSCNNSpatialNormalization``, ``MPSCNNLocalContrastNormalization`` and their gradients).

The math, forward and exact adjoint, is in `mpsnn.ops.local_norm`; here it is placed on the MPS
window model. Per destination pixel, with ``K = kernel_width * kernel_height``:

* cross channel (window of ``N = kernel_size`` channels, over the channels read)::

      L_k = delta + alpha / N  Σ_{q = k - N//2}^{k + (N-1)//2} x_q^2      y_k = x_k L_k^(-beta)

* spatial::      ``y = x (delta + alpha / K Σ_window x^2)^(-beta)``
* local contrast::

      M = 1/K Σ_window x      VAR = max(1/K Σ_window x^2 - M^2, 0)
      y = pm + ps (x - p0 M) (delta + alpha VAR)^(-beta)

Geometry. Cross-channel normalization is spatially a 1x1-window kernel (like `SoftMax`):
destination pixel ``u`` reads source pixel ``offset + (u - clip.origin)`` through the edge mode,
and its channel window runs over the channels read (``source_feature_channel_offset`` and
``..._max_count``; cut at their ends, the divisor stays ``N``). Spatial and local contrast
normalization are stride-1 windowed kernels: destination pixel ``u`` is computed at source
pixel ``c = offset + (u - clip.origin)`` from the taps ``c - k//2 + j`` (``j = 0 .. k-1`` per
axis: even windows lean top-left); taps outside the source read 0 (ZERO, still counted in
``K``) or the edge pixel (CLAMP). The default padding policy (centred, SIZE_SAME) gives
offset 0 and a destination the size of the source.

How: the source block the written region needs (margins ``k//2`` before and ``(k-1)//2``
after) is extracted through `mpsnn.ops.window` with the kernel's edge mode, so out-of-image taps
hold 0 or the edge pixel; the op runs on that block (edge ZERO) and the interior is kept: those
outputs' windows lie wholly in the block and never see the op's own padding. The gradient is
the exact adjoint of that composition: the incoming gradient embedded in a zero block, the op's
backward, then the extraction's adjoint (a clamped tap's gradient lands on the edge pixel).

Gradients are the exact vector-Jacobian products (adjoints) of the forwards: MPS's own
documentation of these backward passes is loose, so mpsnn follows the forward's true derivative.
Their secondary image is the forward **source**. Their parameters (kernel size, alpha, beta,
delta, p0, pm, ps) must equal the forward's, checked at encode against the forward's record.

Layout: images are (images, channels, height, width) tensors, every channel dense; float16 and
bfloat16 storage is computed in float32 and rounded once at the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Real
from typing import Any

import torch

from mpsnn.cnn._pointwise import (
    Pointwise,
    PointwiseBackward,
    PointwiseGradient,
    PointwiseKernel,
    PointwiseRecord,
)
from mpsnn.core._checks import check_positive
from mpsnn.core.binary import GradientKernel
from mpsnn.core.cnn_kernel import CNNKernel, Forward, Records
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.device import Device
from mpsnn.core.geometry import EdgeMode, Window
from mpsnn.core.gradient_command import Backward
from mpsnn.core.registry import gradient_of
from mpsnn.core.state import ForwardRecord, GradientState
from mpsnn.ops._dtypes import widen
from mpsnn.ops.local_norm import (
    cross_channel_norm_backward,
    cross_channel_norm_forward,
    local_contrast_norm_backward,
    local_contrast_norm_forward,
    spatial_norm_backward,
    spatial_norm_forward,
)
from mpsnn.ops.window import ExtractPlan, apply_extract, apply_extract_adjoint, plan_extract

__all__ = [
    "CrossChannelNormalization",
    "CrossChannelNormalizationGradient",
    "LocalContrastNormalization",
    "LocalContrastNormalizationGradient",
    "SpatialNormalization",
    "SpatialNormalizationGradient",
]


# -- records ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class CrossChannelNormalizationRecord(PointwiseRecord):
    """What a cross-channel encode hands its gradient: how it read the source (``plan``) and
    its parameters."""

    kernel_size: int
    alpha: float
    beta: float
    delta: float


@dataclass(frozen=True, slots=True, eq=False)
class SpatialNormalizationRecord:
    """What a spatial normalization encode hands its gradient: the extraction of the source
    block it read (``plan``), its window and parameters."""

    plan: ExtractPlan
    kernel_width: int
    kernel_height: int
    alpha: float
    beta: float
    delta: float


@dataclass(frozen=True, slots=True, eq=False)
class LocalContrastNormalizationRecord:
    """What a local contrast encode hands its gradient: the extraction of the source block it
    read (``plan``), its window and parameters."""

    plan: ExtractPlan
    kernel_width: int
    kernel_height: int
    alpha: float
    beta: float
    delta: float
    p0: float
    pm: float
    ps: float


# -- parameters -------------------------------------------------------------------------------


def _check_float(who: str, name: str, value: Any, minimum: float | None) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"[{who}] {name} must be a real number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"[{who}] {name} must be finite, got {v}")
    if minimum is not None and v < minimum:
        raise ValueError(f"[{who}] {name} must be >= {minimum:g}, got {v}")
    return v


def _float_property(name: str, doc: str, minimum: float | None = None) -> property:
    attr = "_" + name

    def get(self: Any) -> float:
        return getattr(self, attr)

    def set_(self: Any, value: float) -> None:
        setattr(self, attr, _check_float(type(self).__name__, name, value, minimum))

    return property(get, set_, doc=doc)


class _Parameters:
    """The settable float parameters of a family (``_defaults``: name → MPS default)."""

    _defaults: tuple[tuple[str, float], ...] = ()

    def _init_parameters(self) -> None:
        for name, value in self._defaults:
            setattr(self, "_" + name, value)

    def _parameters(self) -> dict[str, float]:
        return {name: getattr(self, "_" + name) for name, _ in self._defaults}


class _PowerParameters(_Parameters):
    """``alpha``, ``beta``, ``delta`` of the cross-channel and spatial normalizations."""

    _defaults = (("alpha", 1.0), ("beta", 5.0), ("delta", 1.0))
    alpha = _float_property("alpha", "Scale of the sum of squares (>= 0; default 1).", 0.0)
    beta = _float_property("beta", "Exponent of the normalizing base (default 5).")
    delta = _float_property("delta", "Offset of the normalizing base (default 1).")


class _ContrastParameters(_Parameters):
    """``alpha``, ``beta``, ``delta``, ``p0``, ``pm``, ``ps`` of local contrast normalization."""

    _defaults = (
        ("alpha", 0.0), ("beta", 0.5), ("delta", 1.0 / 1024), ("p0", 1.0), ("pm", 0.0), ("ps", 1.0),
    )  # fmt: skip
    alpha = _float_property("alpha", "Scale of the window variance (>= 0; default 0).", 0.0)
    beta = _float_property("beta", "Exponent of the normalizing base (default 0.5).")
    delta = _float_property("delta", "Offset of the normalizing base (default 1/1024).")
    p0 = _float_property("p0", "Weight of the window mean subtracted from x (default 1).")
    pm = _float_property("pm", "Added to the result (default 0).")
    ps = _float_property("ps", "Scale of the result (default 1).")


def _check_matches(who: str, record: Any, mine: dict[str, Any]) -> None:
    """Every parameter of a gradient kernel must equal the forward's (its typed record)."""
    for name, value in mine.items():
        theirs = getattr(record, name)
        if theirs != value:
            raise ValueError(f"[{who}] {name} must equal the forward's ({theirs}), got {value}")


# -- cross channel ----------------------------------------------------------------------------


class CrossChannelNormalization(_PowerParameters, PointwiseKernel):
    """Local response normalization across feature channels (MPS
    ``MPSCNNCrossChannelNormalization``).

    Per pixel, over the channels read (``C`` of them)::

        Q(k) = [max(0, k - N//2), min(C - 1, k + (N-1)//2)]
        L_k  = delta + alpha / N  Σ_{q in Q(k)} x_q^2        y_k = x_k L_k^(-beta)

    with ``N = kernel_size`` (the divisor stays ``N`` where ``Q(k)`` is cut by the channel
    ends): ``torch.nn.functional.local_response_norm(x, N, alpha, beta, k=delta)``. Spatially a
    1x1-window kernel (offset, clip rect, edge mode, channel ranges: see the module docstring).

    Args:
        device: the kernel's device.
        kernel_size: ``N``, the channel window (odd or even; even leans to lower channels).

    Properties: ``kernel_size`` (read-only), ``alpha`` (1.0, >= 0), ``beta`` (5.0), ``delta``
    (1.0), finite floats.
    """

    _gradient_state_class = GradientState

    def __init__(self, device: Device, kernel_size: int = 5) -> None:
        super().__init__(device)
        self._kernel_size = check_positive(type(self).__name__, "kernel_size", kernel_size)
        self._init_parameters()

    @property
    def kernel_size(self) -> int:
        """``N``, the number of channels in each window."""
        return self._kernel_size

    def _record_params(self, window: Window, memo: dict[str, Any]) -> Any:
        return CrossChannelNormalizationRecord(
            plan=self._extract_plan(window, memo),
            kernel_size=self._kernel_size,
            **self._parameters(),
        )

    def _pointwise(self, window: Window, records: Records) -> Pointwise:
        # Values taken now: the kernel may change between encode and commit.
        n, p = self._kernel_size, self._parameters()
        return lambda x: cross_channel_norm_forward(x, n, p["alpha"], p["beta"], p["delta"])


@gradient_of(CrossChannelNormalization)
class CrossChannelNormalizationGradient(_PowerParameters, PointwiseGradient):
    """Gradient of `CrossChannelNormalization` (MPS ``MPSCNNCrossChannelNormalizationGradient``).

    The exact adjoint of the forward (``source_image`` is the forward **source** ``x``)::

        dx_j = g_j L_j^(-beta)
               - (2 alpha beta / N) x_j Σ_{k: j in Q(k)} g_k x_k L_k^(-beta-1)

    Args:
        device: the kernel's device.
        kernel_size: must equal the forward's, as must ``alpha``, ``beta`` and ``delta``
            (checked at encode).
    """

    _state_class = GradientState

    def __init__(self, device: Device, kernel_size: int) -> None:
        super().__init__(device)
        self._kernel_size = check_positive(type(self).__name__, "kernel_size", kernel_size)
        self._init_parameters()

    @property
    def kernel_size(self) -> int:
        return self._kernel_size

    def _check_forward(self, record: ForwardRecord) -> None:
        mine = {"kernel_size": self._kernel_size, **self._parameters()}
        _check_matches(type(self).__name__, record.params, mine)

    def _pointwise_backward(self, record: ForwardRecord, states: list[Any]) -> PointwiseBackward:
        p: CrossChannelNormalizationRecord = record.params
        n, alpha, beta, delta = p.kernel_size, p.alpha, p.beta, p.delta
        return lambda g, x: cross_channel_norm_backward(g, x, n, alpha, beta, delta)


# -- spatial windows --------------------------------------------------------------------------

# op(t, record) on an extracted block (edge ZERO); op(g, t, record) for the backward.
_BlockForward = Callable[[torch.Tensor, Any], torch.Tensor]
_BlockBackward = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


def _interior(kw: int, kh: int, window: Window) -> tuple[slice, slice]:
    """Rows and columns of the extracted block whose windows lie wholly inside it."""
    y0, x0 = kh // 2, kw // 2
    return slice(y0, y0 + window.y.count), slice(x0, x0 + window.x.count)


class _WindowedNormalization(CNNKernel):
    """Shared by spatial and local contrast normalization: a stride-1 ``kernel_width`` x
    ``kernel_height`` window around each pixel."""

    _gradient_state_class = GradientState
    _record_class: type = SpatialNormalizationRecord
    _init_parameters: Callable[[], None]
    _parameters: Callable[[], dict[str, float]]

    def __init__(self, device: Device, kernel_width: int, kernel_height: int) -> None:
        super().__init__(device, kernel_width=kernel_width, kernel_height=kernel_height)
        self._init_parameters()

    @staticmethod
    def _block_forward(t: torch.Tensor, p: Any) -> torch.Tensor:
        raise NotImplementedError

    def _extract_plan(self, window: Window, memo: dict[str, Any]) -> ExtractPlan:
        plan = memo.get("extract")
        if plan is None:
            # allow_pad=False: the block holds every tap (0 or the edge pixel), so the op can
            # run on it with its own ZERO edge and the interior never sees that padding.
            plan = plan_extract(window.y, window.x, self._edge_mode, allow_pad=False)
            memo["extract"] = plan
        return plan

    def _record_params(self, window: Window, memo: dict[str, Any]) -> Any:
        return self._record_class(
            plan=self._extract_plan(window, memo),
            kernel_width=self._kw,
            kernel_height=self._kh,
            **self._parameters(),
        )

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        p = self._record_params(window, memo)  # the parameters now, not at commit
        rows, cols = _interior(self._kw, self._kh, window)
        op = self._block_forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            return op(apply_extract(x, p.plan), p)[:, :, rows, cols]

        return forward


class _WindowedNormalizationGradient(GradientKernel):
    """Shared by the spatial and local contrast gradients."""

    _state_class = GradientState
    _init_parameters: Callable[[], None]
    _parameters: Callable[[], dict[str, float]]

    def __init__(self, device: Device, kernel_width: int, kernel_height: int) -> None:
        who = type(self).__name__
        check_positive(who, "kernel_width", kernel_width)
        check_positive(who, "kernel_height", kernel_height)
        super().__init__(device, secondary_kernel=(kernel_width, kernel_height))
        self._init_parameters()

    @property
    def kernel_width(self) -> int:
        return self._secondary_kernel[0]

    @property
    def kernel_height(self) -> int:
        return self._secondary_kernel[1]

    @staticmethod
    def _block_backward(g: torch.Tensor, t: torch.Tensor, p: Any) -> torch.Tensor:
        raise NotImplementedError

    def _check_forward(self, record: ForwardRecord) -> None:
        kw, kh = self._secondary_kernel
        mine = {"kernel_width": kw, "kernel_height": kh, **self._parameters()}
        _check_matches(type(self).__name__, record.params, mine)

    def _make_backward(
        self, cb: CommandBuffer, record: ForwardRecord, window: Window, states: list[Any]
    ) -> Backward:
        p = record.params
        rows, cols = _interior(p.kernel_width, p.kernel_height, window)
        op = self._block_backward

        def backward(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            t = apply_extract(x, p.plan)
            # The forward kept the block's interior: its adjoint embeds g in zeros. Wide
            # (float32 at least) until the end, so the edge sums of CLAMP round once.
            gw = widen(g)
            block = gw.new_zeros(t.shape)
            block[:, :, rows, cols] = gw
            return apply_extract_adjoint(op(block, t, p), p.plan).to(g.dtype)

        return backward


class SpatialNormalization(_PowerParameters, _WindowedNormalization):
    """Spatial normalization (MPS ``MPSCNNSpatialNormalization``), per channel::

        y = x (delta + alpha / K  Σ_window x^2)^(-beta),   K = kernel_width * kernel_height

    over the ``kernel_width`` x ``kernel_height`` window around each pixel (window model and
    edges in the module docstring; ZERO taps count in ``K``).

    Args:
        device: the kernel's device.
        kernel_width, kernel_height: the window (odd or even). MPS requires them equal; mpsnn
            also accepts ``kernel_width != kernel_height``.

    Properties: ``alpha`` (1.0, >= 0), ``beta`` (5.0), ``delta`` (1.0), finite floats.
    """

    _record_class = SpatialNormalizationRecord

    @staticmethod
    def _block_forward(t: torch.Tensor, p: Any) -> torch.Tensor:
        kw, kh = p.kernel_width, p.kernel_height
        return spatial_norm_forward(t, kw, kh, p.alpha, p.beta, p.delta, EdgeMode.ZERO)


class LocalContrastNormalization(_ContrastParameters, _WindowedNormalization):
    """Local contrast normalization (MPS ``MPSCNNLocalContrastNormalization``), per channel::

        M   = 1/K Σ_window x            VAR = max(1/K Σ_window x^2 - M^2, 0)
        y   = pm + ps (x - p0 M) (delta + alpha VAR)^(-beta),   K = kernel_width * kernel_height

    over the ``kernel_width`` x ``kernel_height`` window around each pixel (window model and
    edges in the module docstring; ZERO taps count in ``K``).

    Args:
        device: the kernel's device.
        kernel_width, kernel_height: the window (odd or even). MPS requires them equal; mpsnn
            also accepts ``kernel_width != kernel_height``.

    Properties: ``alpha`` (0.0, >= 0), ``beta`` (0.5), ``delta`` (1/1024), ``p0`` (1.0),
    ``pm`` (0.0), ``ps`` (1.0), finite floats.
    """

    _record_class = LocalContrastNormalizationRecord

    @staticmethod
    def _block_forward(t: torch.Tensor, p: Any) -> torch.Tensor:
        kw, kh, ZERO = p.kernel_width, p.kernel_height, EdgeMode.ZERO
        return local_contrast_norm_forward(
            t, kw, kh, p.alpha, p.beta, p.delta, p.p0, p.pm, p.ps, ZERO
        )


@gradient_of(SpatialNormalization)
class SpatialNormalizationGradient(_PowerParameters, _WindowedNormalizationGradient):
    """Gradient of `SpatialNormalization` (MPS ``MPSCNNSpatialNormalizationGradient``).

    The exact adjoint of the forward (``source_image`` is the forward **source** ``x``), with
    ``T = delta + alpha / K Σ_window x^2`` and ``A`` the adjoint of the window sum (every
    output's value added back to each tap it read, a clamped tap to its edge pixel)::

        dx = g T^(-beta) - (2 alpha beta / K) x A(g x T^(-beta-1))

    Args:
        device: the kernel's device.
        kernel_width, kernel_height: must equal the forward's, as must ``alpha``, ``beta`` and
            ``delta`` (checked at encode).
    """

    @staticmethod
    def _block_backward(g: torch.Tensor, t: torch.Tensor, p: Any) -> torch.Tensor:
        kw, kh = p.kernel_width, p.kernel_height
        return spatial_norm_backward(g, t, kw, kh, p.alpha, p.beta, p.delta, EdgeMode.ZERO)


@gradient_of(LocalContrastNormalization)
class LocalContrastNormalizationGradient(_ContrastParameters, _WindowedNormalizationGradient):
    """Gradient of `LocalContrastNormalization` (MPS
    ``MPSCNNLocalContrastNormalizationGradient``).

    The exact adjoint of the forward (``source_image`` is the forward **source** ``x``), through
    the window mean and the variance (derivation in `mpsnn.ops.local_norm`); where the variance
    is clamped at 0 it passes no gradient.

    Args:
        device: the kernel's device.
        kernel_width, kernel_height: must equal the forward's, as must ``alpha``, ``beta``,
            ``delta``, ``p0``, ``pm`` and ``ps`` (checked at encode).
    """

    @staticmethod
    def _block_backward(g: torch.Tensor, t: torch.Tensor, p: Any) -> torch.Tensor:
        kw, kh, ZERO = p.kernel_width, p.kernel_height, EdgeMode.ZERO
        return local_contrast_norm_backward(
            g, t, kw, kh, p.alpha, p.beta, p.delta, p.p0, p.pm, p.ps, ZERO
        )
