"""Shared plumbing of the 1x1-window kernels (neuron, softmax, dropout) and their gradients.

The source block is read through the window model with a 1x1 window: destination pixel ``x``
reads source pixel ``offset.x + (x - clip.origin.x)``, outside the source by the edge mode. When
every read is inside the source (the usual case) the block is a view; otherwise a copy. The
gradient applies the adjoint of that read (`mpsnn.ops.window.apply_extract_adjoint`), so pixels
read twice (CLAMP) sum their gradients and pixels read as ZERO pass none back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mpsnn.core.binary import GradientKernel
from mpsnn.core.cnn_kernel import CNNKernel, Forward, Records
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.geometry import Window
from mpsnn.core.gradient_command import Backward
from mpsnn.core.state import ForwardRecord
from mpsnn.ops.window import ExtractPlan, apply_extract, apply_extract_adjoint, plan_extract

__all__ = ["PointwiseGradient", "PointwiseKernel", "PointwiseRecord"]

Pointwise = Callable[[torch.Tensor], torch.Tensor]
PointwiseBackward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True, eq=False)
class PointwiseRecord:
    """What a 1x1-window forward hands its gradient: how it read the source (families add
    their parameters in subclasses)."""

    plan: ExtractPlan


class PointwiseKernel(CNNKernel):
    """A 1x1-window forward kernel; subclasses implement ``_pointwise``."""

    def _extract_plan(self, window: Window, memo: dict[str, Any]) -> ExtractPlan:
        plan = memo.get("extract")
        if plan is None:
            plan = plan_extract(window.y, window.x, self._edge_mode, allow_pad=False)
            memo["extract"] = plan
        return plan

    def _pointwise(self, window: Window, records: Records) -> Pointwise:
        """The elementwise math on the extracted block (``records``: see `_make_forward`)."""
        raise NotImplementedError

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        plan = self._extract_plan(window, memo)
        fn = self._pointwise(window, records)
        return lambda x: fn(apply_extract(x, plan))

    def _record_params(self, window: Window, memo: dict[str, Any]) -> PointwiseRecord:
        return PointwiseRecord(self._extract_plan(window, memo))


class PointwiseGradient(GradientKernel):
    """Gradient of a `PointwiseKernel`; subclasses implement ``_pointwise_backward``, a function
    of the incoming gradient block and the (extracted) secondary block."""

    def _pointwise_backward(self, record: ForwardRecord, states: list[Any]) -> PointwiseBackward:
        raise NotImplementedError

    def _make_backward(
        self, cb: CommandBuffer, record: ForwardRecord, window: Window, states: list[Any]
    ) -> Backward:
        plan: ExtractPlan = record.params.plan
        fn = self._pointwise_backward(record, states)
        if self._secondary_is_result:  # the secondary block is already the written region
            return lambda g, y: apply_extract_adjoint(fn(g, y), plan)
        return lambda g, x: apply_extract_adjoint(fn(g, apply_extract(x, plan)), plan)
