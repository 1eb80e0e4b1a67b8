"""Gram matrix (MPS ``MPSNNGramMatrixCalculation``) and its gradient
(``MPSNNGramMatrixCalculationGradient``), the style statistics of neural style transfer.

For each image ``b`` and the ``C`` source channels read (``source_feature_channel_offset``,
``source_feature_channel_max_count``)::

    G[b, i, j] = alpha * sum_{y, x} src[b, i, y, x] * src[b, j, y, x]

The result is laid out as MPS lays it out (``y[b, 1, f, c]`` in MPS's ``(b, y, x, c)``
notation): a ``C`` wide, 1 high image with ``C`` feature channels; channel ``i`` at
x-coordinate ``j`` holds ``G[b, i, j]``, written from ``destination_feature_channel_offset``.
A returning encode allocates that ``C x 1 x C`` image whatever the padding policy.

MPS supports no offset or clip rect for this kernel ("a special padding policy"): an encode
with a non-zero ``offset.x``/``offset.y``, or a clip rect that does not cover the ``C x 1``
result from the origin, raises. ``offset.z`` and the clip rect's z range select images as for
every kernel.

The gradient is the exact adjoint: ``dsrc[b, k] = alpha * sum_j (dG[b, k, j] + dG[b, j, k]) *
src[b, j]`` (`mpsnn.ops.gram`). It reads the forward *source* and the forward's record in the
gradient state; its ``alpha`` must equal the forward's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mpsnn.core.binary import GradientKernel
from mpsnn.core.cnn_kernel import CNNKernel, Forward, Records
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.descriptor import ImageDescriptor
from mpsnn.core.device import Device
from mpsnn.core.geometry import AxisWindow, DestinationSpan, Offset, Window
from mpsnn.core.gradient_command import Backward
from mpsnn.core.registry import gradient_of
from mpsnn.core.saved import Field
from mpsnn.core.state import ForwardRecord, GradientState
from mpsnn.ops.gram import gram_backward, gram_forward

__all__ = [
    "GramMatrixCalculation",
    "GramMatrixCalculationGradient",
]


@dataclass(frozen=True, slots=True, eq=False)
class GramMatrixRecord:
    """What a Gram matrix encode hands its gradient: the ``alpha`` it used."""

    alpha: float


def _alpha(who: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"[{who}] alpha must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"[{who}] alpha must be finite, got {value}")
    return float(value)


class _Alpha:
    """The ``alpha`` property the forward and gradient kernels share."""

    _alpha_value: float

    @property
    def alpha(self) -> float:
        """The scale of the result (default 1)."""
        return self._alpha_value

    @alpha.setter
    def alpha(self, value: float) -> None:
        self._alpha_value = _alpha(type(self).__name__, value)


class GramMatrixCalculation(_Alpha, CNNKernel):
    """The Gram matrix of each image's feature channels (see the module docstring).

    Args:
        device: the kernel's device.
        alpha: the scale of the result (MPS ``initWithDevice:alpha:``; default 1).
    """

    _gradient_state_class = GradientState
    saved_fields = (Field("alpha", float),)

    def __init__(self, device: Device, alpha: float = 1.0) -> None:
        super().__init__(device)
        self.alpha = alpha

    def _policy(self, source_images: Any, source_states: Any) -> tuple[ImageDescriptor, Offset]:
        src = source_images[0]
        n, c = src.shape[:2]
        if self._sco >= c:
            raise ValueError(
                f"[{type(self).__name__}] source_feature_channel_offset must be < the source's "
                f"{c} channels, got {self._sco}"
            )
        channels = min(self._smax, c - self._sco)
        images = max(1, n - self._offset.z)
        desc = ImageDescriptor(src.feature_channel_format, channels, 1, channels, images)
        return desc, Offset(0, 0, self._offset.z)

    def _axis_windows(self, span: DestinationSpan) -> tuple[AxisWindow, AxisWindow]:
        # one output row whose "window" is the whole source; the columns are the channels
        return (
            AxisWindow(0, span.count_y, span.source_height, 1, 1, span.source_height),
            AxisWindow(0, span.count_x, span.source_width, 1, 1, span.source_width),
        )

    def _check_window(self, window: Window, src: Any) -> None:
        who, c = type(self).__name__, window.src_channels
        if self._offset.x or self._offset.y:
            raise ValueError(
                f"[{who}] offset must be 0 in x and y (the Gram matrix reads whole images), "
                f"got ({self._offset.x}, {self._offset.y})"
            )
        clip = self._clip
        if (clip.origin.x, clip.origin.y) != (0, 0) or window.x.count < c or window.y.count < 1:
            raise ValueError(
                f"[{who}] the clip rect must cover the {c}x1 result from the origin, got origin "
                f"({clip.origin.x}, {clip.origin.y}) and {window.x.count}x{window.y.count} "
                "pixels inside the destination"
            )

    def _window(
        self, src_shape: tuple[int, ...], dst_shape: tuple[int, ...], offset: Offset, batch: bool
    ) -> Window:
        w = super()._window(src_shape, dst_shape, offset, batch)
        # exactly the C x 1 result is written, whatever else the destination holds
        c = w.src_channels
        return w._replace(
            y=w.y._replace(count=min(w.y.count, 1)), x=w.x._replace(count=min(w.x.count, c))
        )

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        alpha = self._alpha_value
        return lambda x: gram_forward(x, alpha)

    def _record_params(self, window: Window, memo: dict[str, Any]) -> GramMatrixRecord:
        return GramMatrixRecord(self._alpha_value)


@gradient_of(GramMatrixCalculation)
class GramMatrixCalculationGradient(_Alpha, GradientKernel):
    """Gradient of `GramMatrixCalculation` (MPS ``MPSNNGramMatrixCalculationGradient``):
    ``alpha (dG + dG^T) src`` per image.

    Args:
        device: the kernel's device.
        alpha: must equal the forward's ``alpha`` at encode (default 1).
    """

    _state_class = GradientState
    saved_fields = (Field("alpha", float),)

    def __init__(self, device: Device, alpha: float = 1.0) -> None:
        super().__init__(device)
        self.alpha = alpha

    def _check_forward(self, record: ForwardRecord) -> None:
        theirs = record.params.alpha
        if theirs != self._alpha_value:
            raise ValueError(
                f"[{type(self).__name__}] alpha must equal the forward's {theirs}, "
                f"got {self._alpha_value}"
            )

    def _make_backward(
        self, cb: CommandBuffer, record: ForwardRecord, window: Window, states: list[Any]
    ) -> Backward:
        alpha = record.params.alpha
        return lambda g, x: gram_backward(g, x, alpha)
