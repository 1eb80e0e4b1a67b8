"""Geometry records shared by the portable ops and their CUDA fast paths (a leaf module: the
Triton kernels import these types without importing the ops that dispatch to them)."""

from __future__ import annotations

from typing import NamedTuple

from mpsnn.core.geometry import AxisWindow, EdgeMode
from mpsnn.ops.window import ExtractPlan

__all__ = ["DropoutGeometry", "PoolGeometry"]


class PoolGeometry(NamedTuple):
    """Windows, edge mode and how the source is prepared, made once per configuration.

    ``valid_y``/``valid_x``: the per-axis interval ``[lo, hi)`` whose taps count in an average's
    divisor (None: every tap counts). ``counts``: for each output row and column, how many taps
    lie inside it (None when every tap counts: the divisor is the window area). ``area``: the
    window area when every tap of every window counts (no ``counts``, or counts that are the
    kernel's extent everywhere), else None.
    """

    y: AxisWindow
    x: AxisWindow
    edge: EdgeMode
    plan: ExtractPlan
    valid_y: tuple[int, int] | None
    valid_x: tuple[int, int] | None
    counts: tuple[tuple[int, ...], tuple[int, ...]] | None
    area: int | None


class DropoutGeometry(NamedTuple):
    """``threshold``: keep when the hash is below it; ``scale``: ``1 / keep_probability``;
    ``strides``: the mask strides (channels, y, x), each 0 (broadcast) or 1."""

    threshold: int
    scale: float
    strides: tuple[int, int, int]
