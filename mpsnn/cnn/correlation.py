"""Local correlation (MPS ``MPSNNLocalCorrelation``): the correlation layer of optical-flow
networks (FlowNet). Forward only: MPS defines no gradient for it.

With ``A`` the primary and ``B`` the secondary source, each read in its clip rect
(``primary_source_clip_rect``, ``secondary_source_clip_rect``, as every `ReduceBinary`) and
over as many channels from each::

    O[b, k(m, n), y, x] = sum_c A[b, c, y, x] * B[b, c, y + N[n], x + M[m]]

with ``M[m] = (m - window_in_x) * stride_in_x`` for ``m = 0 .. 2 window_in_x``,
``N[n] = (n - window_in_y) * stride_in_y`` for ``n = 0 .. 2 window_in_y``, and
``k(m, n) = n * (2 window_in_x + 1) + m``: the x offset runs fastest, as MPS says. (MPS's header
writes ``n * (2 windowInY + 1) + m``, which collides for ``windowInX != windowInY``; the
x-fastest order it states is the one that numbers the channels ``0 .. K - 1``.) The sum is not
divided by the channel count (MPS's formula has no division; FlowNet's layer divides: scale the
result, e.g. with a `Multiply`). Coordinates are relative to each region's origin; taps of ``B``
outside its region read 0. The result has ``(2 window_in_x + 1) (2 window_in_y + 1)`` channels
and the primary region's size.
"""

from __future__ import annotations

from mpsnn.cnn.reduce import _BINARY_FIELDS, Combine, ReduceBinary
from mpsnn.core._checks import check_int
from mpsnn.core.device import Device
from mpsnn.core.saved import Field
from mpsnn.ops.reduce import local_correlation

__all__ = [
    "LocalCorrelation",
]


class LocalCorrelation(ReduceBinary):
    """The local correlation of two images (see the module docstring).

    Args:
        device: the kernel's device.
        window_in_x, window_in_y: the offsets run over ``-window .. window`` strides (>= 0,
            default 0).
        stride_in_x, stride_in_y: the pixels between two offsets (>= 1, default 1).
    """

    saved_fields = (
        *_BINARY_FIELDS,
        Field("window_in_x", int),
        Field("window_in_y", int),
        Field("stride_in_x", int),
        Field("stride_in_y", int),
    )

    def __init__(
        self,
        device: Device,
        window_in_x: int = 0,
        window_in_y: int = 0,
        stride_in_x: int = 1,
        stride_in_y: int = 1,
    ) -> None:
        super().__init__(device)
        self._window, self._stride = (0, 0), (1, 1)
        self.window_in_x = window_in_x
        self.window_in_y = window_in_y
        self.stride_in_x = stride_in_x
        self.stride_in_y = stride_in_y

    @property
    def window_in_x(self) -> int:
        return self._window[0]

    @window_in_x.setter
    def window_in_x(self, value: int) -> None:
        self._window = (check_int(type(self).__name__, "window_in_x", value, 0), self._window[1])

    @property
    def window_in_y(self) -> int:
        return self._window[1]

    @window_in_y.setter
    def window_in_y(self, value: int) -> None:
        self._window = (self._window[0], check_int(type(self).__name__, "window_in_y", value, 0))

    @property
    def stride_in_x(self) -> int:
        return self._stride[0]

    @stride_in_x.setter
    def stride_in_x(self, value: int) -> None:
        self._stride = (check_int(type(self).__name__, "stride_in_x", value, 1), self._stride[1])

    @property
    def stride_in_y(self) -> int:
        return self._stride[1]

    @stride_in_y.setter
    def stride_in_y(self, value: int) -> None:
        self._stride = (self._stride[0], check_int(type(self).__name__, "stride_in_y", value, 1))

    def _out_channels(self, channels: int) -> int:
        wx, wy = self._window
        return (2 * wx + 1) * (2 * wy + 1)

    def _combine(self) -> Combine:
        window, stride = self._window, self._stride
        return lambda a, b: local_correlation(a, b, window, stride)
