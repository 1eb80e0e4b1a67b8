"""States of the normalization family that carry parameters (MPS
``MPSCNNNormalizationGammaAndBetaState``, ``MPSCNNNormalizationMeanAndVarianceState``), and
the master gamma/beta every normalization kernel owns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.device import Device
from mpsnn.core.state import AccumulatorState, State

__all__ = [
    "NormalizationGammaAndBetaState",
    "NormalizationMeanAndVarianceState",
    "StableSums",
    "channel_vector",
]


def channel_vector(who: str, name: str, value: Any, channels: int, default: float) -> torch.Tensor:
    """A ``(channels,)`` float32 (float64 stays float64) host tensor from ``value`` (None:
    ``default`` everywhere)."""
    if value is None:
        return torch.full((channels,), float(default))
    t = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
    if not t.is_floating_point():
        raise TypeError(f"[{who}] {name} must hold floats, got {t.dtype}")
    if tuple(t.shape) != (channels,):
        raise ValueError(f"[{who}] {name} must have shape ({channels},), got {tuple(t.shape)}")
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32).clone()


class StableSums(AccumulatorState):
    """An `AccumulatorState` whose sums are stable storage: the tensors a field returns at
    encode time (made then, zeros) are the ones the work writes in place when it runs; when
    nothing read them first, the first write's results are adopted as the storage (no copy).
    The first write since the state was made or `reset` stores, later ones merge or add, as
    in `AccumulatorState`; a reset keeps the storage. Subclasses give each slot's sizes."""

    def __init__(self, device: Any, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self._dtypes: dict[int, torch.dtype] = {}  # per slot: the sums' dtype (encode time)
        self._held: dict[int, list[torch.Tensor]] = {}  # per slot: its storage, once made

    def _slot_sizes(self, slot: int) -> tuple[int, ...]:
        raise NotImplementedError

    def _note_dtype(self, slot: int, wide: bool) -> None:
        """An encode that writes ``slot`` was recorded (``wide``: float64 sums)."""
        if wide or slot not in self._dtypes:
            self._dtypes[slot] = torch.float64 if wide else torch.float32

    def _storage(self, slot: int) -> list[torch.Tensor]:
        """The storage of ``slot``: what the work wrote, or zeros it will write into."""
        held = self._held.get(slot)
        if held is None:
            dev, dt = self.device.torch_device, self._dtypes.get(slot, torch.float32)
            held = [torch.zeros(k, dtype=dt, device=dev) for k in self._slot_sizes(slot)]
            self._held[slot] = held
        return held

    def _accumulate(
        self,
        cb: CommandBuffer,
        values: Sequence[torch.Tensor],
        merge: Callable[[list[torch.Tensor], Sequence[torch.Tensor]], None] | None = None,
        *,
        fresh: bool = True,
        slot: int = 0,
    ) -> None:
        """`AccumulatorState._accumulate` into the slot's storage (see the class)."""
        held = self._held.get(slot)
        if held is None or slot in self._slots:
            super()._accumulate(cb, values, merge, fresh=fresh, slot=slot)
            self._held[slot] = self._slots[slot]
            return
        q = cb._queue  # the ordering of `AccumulatorState._accumulate`
        prev = self._writer_queue
        if prev is not None and prev is not q and q._stream is not None and not cb._captured:
            q._stream.wait_stream(prev._stream)
        self._writer_queue = q
        for s, v in zip(held, values, strict=True):
            s.copy_(v.reshape(s.shape) if v.numel() == s.numel() else v)
        self._slots[slot] = held

    def _free_storage(self) -> None:
        super()._free_storage()
        self._held = {}

    def resources(self) -> list[torch.Tensor]:
        out = {id(t): t for held in self._held.values() for t in held}
        out.update({id(t): t for t in super().resources()})
        return list(out.values())


class _PairState(State):
    """A state holding two ``(C,)`` tensors."""

    _names: tuple[str, str] = ("first", "second")

    def __init__(
        self,
        first: torch.Tensor,
        second: torch.Tensor,
        *,
        command_buffer: CommandBuffer | None = None,
        label: str | None = None,
    ) -> None:
        who = type(self).__name__
        for name, t in zip(self._names, (first, second), strict=True):
            if not isinstance(t, torch.Tensor) or t.dim() != 1:
                raise TypeError(f"[{who}] {name} must be a 1-D tensor, got {type(t).__name__}")
        if first.shape != second.shape or first.device != second.device:
            raise ValueError(
                f"[{who}] {self._names[0]} and {self._names[1]} must have one shape and device, "
                f"got {tuple(first.shape)} on {first.device} and {tuple(second.shape)} on "
                f"{second.device}"
            )
        super().__init__(Device(first.device), command_buffer=command_buffer, label=label)
        self._pair: tuple[torch.Tensor, torch.Tensor] | None = (first, second)

    @classmethod
    def temporary(
        cls, command_buffer: CommandBuffer, number_of_feature_channels: int
    ) -> _PairState:
        """A zero-filled temporary state (MPS ``temporaryStateWithCommandBuffer:
        numberOfFeatureChannels:``)."""
        dev = command_buffer.device.torch_device
        z = torch.zeros(number_of_feature_channels, device=dev)
        return cls(z, z.clone(), command_buffer=command_buffer)

    @property
    def number_of_feature_channels(self) -> int:
        return self._get()[0].shape[0]

    def _get(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_live(None)
        assert self._pair is not None  # live states hold their tensors
        return self._pair

    def resources(self) -> list[torch.Tensor]:
        return list(self._pair or ())

    def _free_storage(self) -> None:
        self._pair = None


class NormalizationGammaAndBetaState(_PairState):
    """``gamma`` and ``beta`` (C,) as a state (MPS ``MPSCNNNormalizationGammaAndBetaState``):
    what a data source's GPU update returns and a normalization kernel reloads."""

    _names = ("gamma", "beta")

    @property
    def gamma(self) -> torch.Tensor:
        return self._get()[0]

    @property
    def beta(self) -> torch.Tensor:
        return self._get()[1]


class NormalizationMeanAndVarianceState(_PairState):
    """``mean`` and ``variance`` (C,) as a state (MPS
    ``MPSCNNNormalizationMeanAndVarianceState``): running statistics for inference."""

    _names = ("mean", "variance")

    @property
    def mean(self) -> torch.Tensor:
        return self._get()[0]

    @property
    def variance(self) -> torch.Tensor:
        return self._get()[1]
