"""Elementwise comparison (MPS ``MPSNNCompare``, an ``MPSCNNArithmetic``): 1 where the
comparison of the primary and secondary sources holds, 0 elsewhere. Forward only: MPS defines
no gradient for it.

It is an arithmetic kernel (`Arithmetic`), with everything that brings: each source's offset,
edge mode, channel range and 0/1 broadcast strides, the scales, the bias and the clamp. With
``a = primary_scale * x`` and ``b = secondary_scale * y``, the result is
``clamp(cmp(a, b) + bias, minimum_value, maximum_value)``, which is ``cmp(a, b)`` (1.0 or 0.0)
with the defaults.

``threshold`` (default 0, >= 0) widens equality, as MPS defines it: ``a`` and ``b`` are equal
when ``a == b`` or ``|a - b| <= threshold``. MPS documents the threshold for equality only; mpsnn
applies the same equality to every comparison, so that each pair stays complementary
(NOT_EQUAL = not EQUAL, GREATER_OR_EQUAL = not LESS, LESS_OR_EQUAL = not GREATER)::

    EQUAL             a == b or |a - b| <= t
    NOT_EQUAL         not EQUAL
    LESS              a < b and not EQUAL         (a < b - t for finite values)
    LESS_OR_EQUAL     a <= b or EQUAL             (a <= b + t)
    GREATER           a > b and not EQUAL         (a > b + t)
    GREATER_OR_EQUAL  a >= b or EQUAL             (a >= b - t)

With ``threshold = 0`` these are IEEE comparisons: a NaN compares unequal to everything (1 for
NOT_EQUAL, 0 for the others), and infinities of one sign are equal.
"""

from __future__ import annotations

import enum
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpsnn.cnn.arithmetic import Arithmetic
from mpsnn.core._checks import check_enum
from mpsnn.core.binary import BinaryKernel
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.device import Device
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.saved import Field
from mpsnn.core.state import State

__all__ = [
    "Compare",
    "ComparisonType",
]


class ComparisonType(enum.IntEnum):
    """The comparison a `Compare` kernel performs (MPS ``MPSNNComparisonType``)."""

    EQUAL = 0
    NOT_EQUAL = 1
    LESS = 2
    LESS_OR_EQUAL = 3
    GREATER = 4
    GREATER_OR_EQUAL = 5


def compare(
    kind: ComparisonType, threshold: float, a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """The comparison of ``a`` and ``b`` (see the module docstring) as 1.0 / 0.0 in the
    dtype the two promote to."""
    equal = a == b
    if threshold > 0:
        equal = equal | ((a - b).abs() <= threshold)
    if kind is ComparisonType.EQUAL:
        r = equal
    elif kind is ComparisonType.NOT_EQUAL:
        r = ~equal
    elif kind is ComparisonType.LESS:
        r = (a < b) & ~equal
    elif kind is ComparisonType.LESS_OR_EQUAL:
        r = (a <= b) | equal
    elif kind is ComparisonType.GREATER:
        r = (a > b) & ~equal
    else:
        r = (a >= b) | equal
    return r.to(torch.promote_types(a.dtype, b.dtype))


class Compare(Arithmetic):
    """Elementwise comparison (see the module docstring).

    Args:
        device: the kernel's device.

    Attributes:
        comparison_type: a `ComparisonType` (default EQUAL).
        threshold: the tolerance of equality (default 0, >= 0).
    """

    saved_fields = (
        Field("primary_scale", float, init=False),
        Field("secondary_scale", float, init=False),
        Field("bias", float, init=False),
        Field("minimum_value", float, init=False),
        Field("maximum_value", float, init=False),
        Field("primary_stride_in_feature_channels", int, init=False, minimum=0),
        Field("secondary_stride_in_feature_channels", int, init=False, minimum=0),
        Field("comparison_type", ComparisonType, init=False),
        Field("threshold", float, init=False),
    )

    def __init__(self, device: Device) -> None:
        super().__init__(device)
        self._comparison_type = ComparisonType.EQUAL
        self._threshold = 0.0

    @property
    def comparison_type(self) -> ComparisonType:
        return self._comparison_type

    @comparison_type.setter
    def comparison_type(self, value: ComparisonType) -> None:
        self._comparison_type = check_enum(
            type(self).__name__, "comparison_type", value, ComparisonType
        )

    @property
    def threshold(self) -> float:
        return self._threshold

    @threshold.setter
    def threshold(self, value: float) -> None:
        who = type(self).__name__
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"[{who}] threshold must be a number, got {type(value).__name__}")
        if not value >= 0 or math.isinf(value):  # NaN fails the first test
            raise ValueError(f"[{who}] threshold must be finite and >= 0, got {value}")
        self._threshold = float(value)

    @property
    def _op(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:  # type: ignore[override]
        # what `Arithmetic` records at encode: the comparison as configured now
        return functools.partial(compare, self._comparison_type, self._threshold)

    # -- no gradient, so no state: a plain binary kernel's, not Arithmetic's -----------------

    is_state_modified = BinaryKernel.is_state_modified
    result_state = BinaryKernel.result_state

    def temporary_result_state(
        self,
        command_buffer: CommandBuffer,
        primary_image: Image,
        secondary_image: Image,
        source_states: Any = None,
        destination_image: Image | None = None,
    ) -> State | None:
        self._check_command_buffer(command_buffer)
        return None

    def result_state_batch(  # type: ignore[override]
        self,
        primary_images: ImageBatch,
        secondary_images: ImageBatch,
        source_states: Any = None,
        destination_images: Any = None,
    ) -> None:
        return None

    def _no_state(self, given: bool) -> None:
        if given:
            raise ValueError(
                f"[{type(self).__name__}] a comparison has no gradient (MPS defines none), so no "
                "destination state: it must be None, got a state"
            )

    def encode(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        primary_image: Image,
        secondary_image: Image,
        destination_image: Image | None = None,
        destination_state: State | None = None,
    ) -> Image:
        """1.0 where the comparison holds, 0.0 elsewhere (then bias and clamp)."""
        self._no_state(destination_state is not None)
        return super().encode(command_buffer, primary_image, secondary_image, destination_image)

    def encode_batch(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        primary_images: ImageBatch,
        secondary_images: ImageBatch,
        destination_images: ImageBatch | None = None,
        destination_states: Sequence[State] | None = None,
    ) -> ImageBatch:
        self._no_state(destination_states is not None)
        return super().encode_batch(
            command_buffer, primary_images, secondary_images, destination_images
        )
