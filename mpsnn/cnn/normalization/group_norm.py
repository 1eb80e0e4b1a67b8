"""Instance and group normalization (MPS ``MPSCNNInstanceNormalization``,
``MPSCNNGroupNormalization``, their gradients and gradient states).

Per image ``n`` and group ``g`` of ``C/G`` consecutive channels (instance normalization: one
channel per group), over the group's values: ``xhat = (x - mean)/sqrt(var + eps)`` (biased
variance), ``y = gamma[c] xhat + beta[c]``. The gradient is the true derivative (`mpsnn.ops.
group_norm` derives it; the common shorthand that multiplies by gamma outside the group means
is wrong when gamma varies inside a group).

States, as in MPS: ``result_state_batch`` (and the temporary form) give **one gradient state
per image**; the gradient's ``encode_batch`` takes that batch, and each state's
``gradient_for_gamma`` and ``gradient_for_beta`` are its own image's (summed over the image's
pixels). The batch's gradient is the sum over the states: the data source's
``update_gamma_and_beta(command_buffer, state_batch)`` receives the batch (mpsnn's ``Tensor*``
data sources sum it when their update runs; `InstanceNormalizationGradientState.
summed_gradients` sums it after completion). One state repeated over a batch (or given to
``encode`` for a multi-image image) sums that batch's images. Each field is stable storage
written in place by the gradient (`mpsnn.cnn.normalization.states.StableSums`): read at encode
time, client work can be encoded on it.

The statistics are of the block the kernel reads (the 1x1-window model: offset, clip rect,
edge mode, channel offsets), computed in float32 for half-precision storage, precise for a
mean far from zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
from mpsnn.cnn.normalization.states import StableSums
from mpsnn.core.cnn_kernel import Records
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.device import Device
from mpsnn.core.encode import Encoding
from mpsnn.core.geometry import Window
from mpsnn.core.registry import gradient_of
from mpsnn.core.state import ForwardRecord, _unique
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


class _NormalizationGradientState(StableSums):
    """One image's gamma/beta gradients (or the images' it was repeated for; summed at run
    time) and the statistics the forward computed for them."""

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
        self._statistics: tuple[torch.Tensor, torch.Tensor] | None = None  # (n, G), run time
        self._gradients_encoded = False

    def _slot_sizes(self, slot: int) -> tuple[int, ...]:
        c = self._kernel._channels
        return (c, c)

    @property
    def gamma(self) -> torch.Tensor:
        """The kernel's gamma (the values the forward used)."""
        return self._kernel._affine.first

    @property
    def beta(self) -> torch.Tensor:
        return self._kernel._affine.second

    def _gradient(self, index: int) -> torch.Tensor | None:
        if self._released_by is None and self._gradients_encoded:
            return self._storage(0)[index]
        sums = self._slots.get(0)
        return None if sums is None else sums[index]

    @property
    def gradient_for_gamma(self) -> torch.Tensor | None:
        """dL/dgamma of this state's image(s), (C,): the storage the gradient writes (None
        before a gradient was encoded)."""
        return self._gradient(0)

    @property
    def gradient_for_beta(self) -> torch.Tensor | None:
        """dL/dbeta of this state's image(s), (C,) (None before a gradient was encoded)."""
        return self._gradient(1)

    @classmethod
    def summed_gradients(cls, state_batch: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dL/dgamma, dL/dbeta)`` of a batch: the sum over its distinct states (a state
        repeated counts once), read after the gradient's command buffer completed."""
        states = _unique(list(state_batch))
        if not states:
            raise ValueError(f"[{cls.__name__}] state_batch must hold states, got none")
        sums = []
        for st in states:
            if not isinstance(st, _NormalizationGradientState):
                raise TypeError(
                    f"[{cls.__name__}] state_batch must hold instance or group "
                    f"normalization gradient states, got {type(st).__name__}"
                )
            st._check_live(cls.__name__)
            if st._slots.get(0) is None:
                raise ValueError(
                    f"[{cls.__name__}] every state must hold gamma/beta gradients "
                    "that ran (encode the gradient kernel and commit its command buffer "
                    "first), got one without"
                )
            sums.append(st._slots[0])
        if len(sums) == 1:
            return sums[0][0].clone(), sums[0][1].clone()
        return (
            torch.stack([t[0] for t in sums]).sum(0),
            torch.stack([t[1] for t in sums]).sum(0),
        )

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


def _image_groups(states: list[Any]) -> list[tuple[Any, Any]]:
    """Each distinct state of a batch with the images it stands for, in first-appearance
    order: ``rows`` is None (every image: one state for the batch), a slice, or an index
    tensor. Made at encode time; the commands use it when they run."""
    unique = _unique(states)
    if len(unique) == 1:
        return [(unique[0], None)]
    where: dict[int, list[int]] = {}
    for i, st in enumerate(states):
        where.setdefault(id(st), []).append(i)
    out = []
    for st in unique:
        idx = where[id(st)]
        if idx == list(range(idx[0], idx[-1] + 1)):
            out.append((st, slice(idx[0], idx[-1] + 1)))
        else:
            out.append((st, torch.tensor(idx)))
    return out


def _rows(t: torch.Tensor, rows: Any) -> torch.Tensor:
    if rows is None or isinstance(rows, slice):
        return t if rows is None else t[rows]
    return t.index_select(0, rows.to(t.device))


class InstanceNormalizationGradientState(_NormalizationGradientState):
    """MPS ``MPSCNNInstanceNormalizationGradientState``: one per image (see the module)."""

    @property
    def instance_normalization(self) -> Any:
        return self._kernel


class GroupNormalizationGradientState(_NormalizationGradientState):
    """MPS ``MPSCNNGroupNormalizationGradientState``: one per image (see the module)."""

    @property
    def group_normalization(self) -> Any:
        return self._kernel


class _GroupNormalizationBase(AffineChannels, PointwiseKernel):
    """Shared forward: data source, master gamma/beta, reloads, the record."""

    _data_source_kind: type = NormalizationDataSource
    _reused_across_batch = False  # one gradient state per image, as in MPS

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

    def _records(
        self, window: Window, memo: dict[str, Any], src: Any, dst_shape: Any, batch: bool,
        states: list[Any],
    ) -> Records:  # fmt: skip
        """The record for every image's state, in image order (the forward hands each state
        its own images' statistics)."""
        unique = super()._records(window, memo, src, dst_shape, batch, states)
        record = unique[0][1]
        return [(st, record) for st in states]

    def _pointwise(self, window: Window, records: Records) -> Pointwise:
        groups, eps, affine = self._groups, self.epsilon, self._affine
        parts = _image_groups([state for state, _ in records]) if records else []

        def forward(x: torch.Tensor) -> torch.Tensor:
            y, mean, var = group_norm_forward(x, groups, affine.first, affine.second, eps)
            for state, rows in parts:
                state._statistics = (_rows(mean, rows), _rows(var, rows))
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
    """dL/dx, and each image's dL/dgamma, dL/dbeta into its state (summed into a state that
    stands for several images)."""

    def _make_backward(
        self, cb: CommandBuffer, record: ForwardRecord, window: Window, states: list[Any]
    ) -> Any:
        p: GroupNormalizationRecord = record.params
        parts = _image_groups(states)
        shared = len(parts) == 1
        in_order = all(isinstance(rows, slice) for _, rows in parts)  # runs, first-appearance

        def statistics(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            if shared:
                return parts[0][0]._statistics
            if in_order:
                return (torch.cat([st._statistics[0] for st, _ in parts]),
                        torch.cat([st._statistics[1] for st, _ in parts]))  # fmt: skip
            first = parts[0][0]._statistics[0]
            mean = first.new_empty((n, first.shape[1]))
            var = first.new_empty((n, first.shape[1]))
            for st, rows in parts:
                index = rows.to(first.device)
                mean.index_copy_(0, index, st._statistics[0])
                var.index_copy_(0, index, st._statistics[1])
            return mean, var

        def backward(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            mean, var = statistics(x.shape[0])
            xb = apply_extract(x, p.plan)
            dx, dgamma, dbeta = group_norm_backward(
                g, xb, p.groups, mean, var, p.affine.first, p.epsilon, per_image=not shared
            )
            if shared:
                parts[0][0]._accumulate(cb, (dgamma, dbeta))
            else:
                for st, rows in parts:
                    if isinstance(rows, slice) and rows.stop - rows.start == 1:
                        st._accumulate(cb, (dgamma[rows.start], dbeta[rows.start]))
                    else:
                        st._accumulate(cb, (_rows(dgamma, rows).sum(0), _rows(dbeta, rows).sum(0)))
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
        enc = super()._plan_gradient(cb, grad, src, record, states, dst, batch)
        unique = _unique(states)
        wide = torch.float64 in (grad._dtype, src._dtype)

        def note() -> None:
            for state in unique:
                state._gradients_encoded = True
                state._note_dtype(0, wide)

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
