"""The spatial mean and its gradient: the kernels behind MPS's
``MPSNNReductionSpatialMeanNode`` and ``MPSNNReductionSpatialMeanGradientNode``.

MPS has these two graph nodes but no public kernel for them; `ReduceSpatialMean` and
`ReduceSpatialMeanGradient` are mpsnn's, named as the other reductions (``MPSNNReduce*``).

`ReduceSpatialMean` is a unary reduction (`ReduceUnary`): ``clip_rect_source`` is the source
region read (its z range selects images; it replaces ``offset``), and for each image and
channel read (``source_feature_channel_offset``, ``source_feature_channel_max_count``)::

    y[n, c, 0, 0] = 1 / (h·w) · sum_{y, x in the region} x[n, c, y, x]

``h x w`` the region's size: a 1x1 result per image with one channel per channel read, written
from ``destination_feature_channel_offset`` (a returning encode allocates exactly that). Sums
accumulate in at least float32.

Unlike the other reductions it has a gradient: `ReduceSpatialMeanGradient`, ``dL/dx[n, c, y, x]
= dL/dy[n, c, 0, 0] / (h·w)`` on every pixel of the region the forward read, 0 on the other
pixels and on the channels it did not read. It reads the forward source (for its shape) and
the forward's gradient state.
"""

from __future__ import annotations

from typing import Any

from mpsnn.cnn.reduce import _CHANNELS, _UNARY_FIELDS, ReduceUnary
from mpsnn.core.binary import GradientKernel
from mpsnn.core.cnn_kernel import Forward, Records
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.geometry import Window
from mpsnn.core.gradient_command import Backward
from mpsnn.core.registry import gradient_of
from mpsnn.core.state import ForwardRecord, GradientState
from mpsnn.ops.reduce import spatial_mean, spatial_mean_backward

__all__ = [
    "ReduceSpatialMean",
    "ReduceSpatialMeanGradient",
]


class ReduceSpatialMean(ReduceUnary):
    """The mean over x and y of each channel of each image: a 1x1 result per image (see the
    module docstring; the kernel of MPS's ``MPSNNReductionSpatialMeanNode``)."""

    _gradient_state_class = GradientState
    saved_fields = _UNARY_FIELDS

    def _reduces(self, dim: int) -> bool:
        return dim != _CHANNELS  # y and x

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        ay, ax = window.y, window.x
        rows, cols = slice(ay.start, ay.start + ay.kernel), slice(ax.start, ax.start + ax.kernel)
        return lambda x: spatial_mean(x[:, :, rows, cols])


@gradient_of(ReduceSpatialMean)
class ReduceSpatialMeanGradient(GradientKernel):
    """Gradient of `ReduceSpatialMean` (the kernel of MPS's
    ``MPSNNReductionSpatialMeanGradientNode``): the incoming 1x1 gradient divided by the
    number of pixels averaged, on each of them (see the module docstring).

    Args:
        device: the kernel's device.
    """

    _state_class = GradientState
    saved_fields = ()

    def _make_backward(
        self, cb: CommandBuffer, record: ForwardRecord, window: Window, states: list[Any]
    ) -> Backward:
        rows, cols = (window.y.start, window.y.kernel), (window.x.start, window.x.kernel)
        return lambda g, x: spatial_mean_backward(g, x, rows, cols)
