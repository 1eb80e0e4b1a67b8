"""Instance and group normalization (MPS ``MPSCNNInstanceNormalization``,
``MPSCNNGroupNormalization``, their gradients and gradient states).

Per image ``n`` and group ``g`` of ``C/G`` consecutive channels (instance normalization: one
channel per group), over the group's values: ``xhat = (x - mean)/sqrt(var + eps)`` (biased
variance), ``y = gamma[c] xhat + beta[c]``. The gradient is the true derivative (`mpsnn.ops.
group_norm` derives it; the common shorthand that multiplies by gamma outside the group means
is wrong when gamma varies inside a group). ``gradient_for_gamma`` and ``gradient_for_beta``
are summed over the batch into one gradient state shared by the batch (MPS keeps one state
per image and leaves the sum to the data source; mpsnn sums as it goes, the same result).

The statistics are of the block the kernel reads (the 1x1-window model: offset, clip rect,
edge mode, channel offsets), computed in float32 for half-precision storage, precise for a
mean far from zero.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mpsnn.cnn._pointwise import Pointwise, PointwiseGradient, PointwiseKernel, PointwiseRecord
from mpsnn.cnn.normalization.batch_norm_forward import (
    AffineChannels,
    MasterPair,
    read_normalization_vectors,
)
from mpsnn.cnn.normalization.data_sources import (
    GroupNormalizationDataSource,
    InstanceNormalizationDataSource,
    NormalizationDataSource,
)
from mpsnn.core.cnn_kernel import Records
from mpsnn.core.device import CommandBuffer, Device
from mpsnn.core.encode import Encoding
from mpsnn.core.geometry import Window
from mpsnn.core.registry import gradient_of
from mpsnn.core.state import AccumulatorState, ForwardRecord, _unique
from mpsnn.ops.group_norm import group_norm_backward, group_norm_forward
from mpsnn.ops.window import apply_extract, apply_extract_adjoint

__all__ = [
    "GroupNormalization",
    "GroupNormalizationGradient",
    "GroupNormalizationGradientState",
    "InstanceNormalization",
    "InstanceNormalizationGradient",
    "InstanceNormalizationGradientState",
]


@dataclass(frozen=True, slots=True, eq=False)
class GroupNormalizationRecord(PointwiseRecord):
    """What an instance/group normalization forward hands its gradient."""

    groups: int
    epsilon: float
    affine: MasterPair


class _NormalizationGradientState(AccumulatorState):
    """The batch's gamma/beta gradients (summed over images, run time) and the per-image
    statistics the forward computed."""

    def __init__(
        self,
        device: Device,
        kernel: Any,
        *,
        command_buffer: CommandBuffer | None = None,
        label: str | None = None,
    ) -> None:
        super().__init__(device, command_buffer=command_buffer, label=label)
        self._kernel = kernel
        self._statistics: tuple[torch.Tensor, torch.Tensor] | None = None  # (N, G), run time
        self._gradients_encoded = False

    @property
    def gamma(self) -> torch.Tensor:
        """The kernel's gamma (the values the forward used)."""
        return self._kernel._affine.first

    @property
    def beta(self) -> torch.Tensor:
        return self._kernel._affine.second

    @property
    def gradient_for_gamma(self) -> torch.Tensor | None:
        """dL/dgamma summed over the batch (None before any gradient ran)."""
        sums = self._slots.get(0)
        return None if sums is None else sums[0]

    @property
    def gradient_for_beta(self) -> torch.Tensor | None:
        sums = self._slots.get(0)
        return None if sums is None else sums[1]

    def reset(self) -> None:
        super().reset()
        self._gradients_encoded = False

    def _gamma_beta_gradients(self, who: str) -> Callable[[], list[torch.Tensor]]:
        if not self._gradients_encoded:
            raise ValueError(
                f"[{who}] the state must hold gamma/beta gradients (encode the gradient kernel "
                "first), got none"
            )
        return lambda: self._slots[0]

    def resources(self) -> list[torch.Tensor]:
        return super().resources() + list(self._statistics or ())

    def _free_storage(self) -> None:
        super()._free_storage()
        self._statistics = None


class InstanceNormalizationGradientState(_NormalizationGradientState):
    """MPS ``MPSCNNInstanceNormalizationGradientState`` (one state for the batch)."""

    @property
    def instance_normalization(self) -> Any:
        return self._kernel


class GroupNormalizationGradientState(_NormalizationGradientState):
    """MPS ``MPSCNNGroupNormalizationGradientState`` (one state for the batch)."""

    @property
    def group_normalization(self) -> Any:
        return self._kernel


class _GroupNormalizationBase(AffineChannels, PointwiseKernel):
    """Shared forward: data source, master gamma/beta, reloads, the record."""

    _data_source_kind: type = NormalizationDataSource
    _reused_across_batch = True

    def __init__(self, device: Device, data_source: Any) -> None:
        super().__init__(device)
        who = type(self).__name__
        if not isinstance(data_source, self._data_source_kind):
            raise TypeError(
                f"[{who}] data_source must be a {self._data_source_kind.__name__}, "
                f"got {type(data_source).__name__}"
            )
        g, b = read_normalization_vectors(who, data_source, ("gamma", "beta"))
        self._data_source = data_source
        self._channels = g.shape[0]
        self._groups = self._groups_of(data_source)
        self.epsilon = float(data_source.epsilon)
        self._affine = MasterPair(g, b, device)

    def _groups_of(self, data_source: Any) -> int:
        return self._channels

    def _new_state(self, cb: CommandBuffer | None) -> Any:
        return self._gradient_state_class(self._device, self, command_buffer=cb)

    def _destination_channels(self, source_channels: int) -> int:
        if source_channels != self._channels:
            raise ValueError(
                f"[{type(self).__name__}] the source must provide number_of_feature_channels="
                f"{self._channels} channels (after source_feature_channel_offset={self._sco}), "
                f"got {source_channels}"
            )
        return source_channels

    def _record_params(self, window: Window, memo: dict[str, Any]) -> GroupNormalizationRecord:
        return GroupNormalizationRecord(
            self._extract_plan(window, memo), self._groups, self.epsilon, self._affine
        )

    def _pointwise(self, window: Window, records: Records) -> Pointwise:
        groups, eps, affine = self._groups, self.epsilon, self._affine
        keep = [state for state, _ in records]

        def forward(x: torch.Tensor) -> torch.Tensor:
            y, mean, var = group_norm_forward(x, groups, affine.first, affine.second, eps)
            for state in keep:
                state._statistics = (mean, var)
            return y

        return forward


class InstanceNormalization(_GroupNormalizationBase):
    """Instance normalization (MPS ``MPSCNNInstanceNormalization``): per image and channel.

    Args:
        device: the kernel's device.
        data_source: an `InstanceNormalizationDataSource` (gamma, beta, epsilon).
    """

    _data_source_kind = InstanceNormalizationDataSource
    _gradient_state_class = InstanceNormalizationGradientState


class GroupNormalization(_GroupNormalizationBase):
    """Group normalization (MPS ``MPSCNNGroupNormalization``): per image and group of
    ``C/G`` consecutive channels; gamma and beta per channel.

    Args:
        device: the kernel's device.
        data_source: a `GroupNormalizationDataSource` (gamma, beta, epsilon, number_of_groups).
    """

    _data_source_kind = GroupNormalizationDataSource
    _gradient_state_class = GroupNormalizationGradientState

    def _groups_of(self, data_source: Any) -> int:
        g = int(data_source.number_of_groups)
        if g < 1 or self._channels % g:
            raise ValueError(
                f"[GroupNormalization] the data source's number_of_groups must divide its "
                f"{self._channels} channels, got {g}"
            )
        return g

    @property
    def number_of_groups(self) -> int:
        return self._groups


class _GroupNormalizationGradientBase(PointwiseGradient):
    """dL/dx, and dL/dgamma, dL/dbeta summed into the state."""

    def _make_backward(
        self, cb: CommandBuffer, record: ForwardRecord, window: Window, states: list[Any]
    ) -> Any:
        p: GroupNormalizationRecord = record.params
        state = states[0]

        def backward(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            mean, var = state._statistics
            xb = apply_extract(x, p.plan)
            dx, dgamma, dbeta = group_norm_backward(
                g, xb, p.groups, mean, var, p.affine.first, p.epsilon
            )
            state._accumulate(cb, (dgamma, dbeta))
            return apply_extract_adjoint(dx, p.plan)

        return backward

    def _plan_gradient(
        self,
        cb: CommandBuffer,
        grad: Any,
        src: Any,
        record: ForwardRecord,
        states: list[Any],
        dst: Any,
        batch: bool,
    ) -> Encoding:
        if len(_unique(states)) != 1:
            raise ValueError(
                f"[{type(self).__name__}] gradient_states must repeat one state (see "
                f"result_state_batch), got {len(_unique(states))} distinct states"
            )
        enc = super()._plan_gradient(cb, grad, src, record, states, dst, batch)
        state = states[0]

        def note() -> None:
            state._gradients_encoded = True

        enc.after = note
        return enc


@gradient_of(InstanceNormalization)
class InstanceNormalizationGradient(_GroupNormalizationGradientBase):
    """Gradient of `InstanceNormalization` (MPS ``MPSCNNInstanceNormalizationGradient``)."""

    _state_class = InstanceNormalizationGradientState


@gradient_of(GroupNormalization)
class GroupNormalizationGradient(_GroupNormalizationGradientBase):
    """Gradient of `GroupNormalization` (MPS ``MPSCNNGroupNormalizationGradient``)."""

    _state_class = GroupNormalizationGradientState
