"""Data sources of the normalization kernels (MPS ``MPSCNNBatchNormalizationDataSource``,
``MPSCNNInstanceNormalizationDataSource``, ``MPSCNNGroupNormalizationDataSource``) and the
``Tensor*`` data sources that hold their values and apply an optimizer, so that the common case
needs no subclassing.

Update paths, as for convolutions:

* GPU: ``update_gamma_and_beta(command_buffer, state)`` encodes the update into the command
  buffer and returns the data source's own permanent `NormalizationGammaAndBetaState` (read
  the state's gradients and current gamma/beta, write the data source's tensors: out of place,
  as Apple's sample does), or None for no GPU update; the kernel then reloads it;
* CPU: ``update_gamma_and_beta_on_cpu(state)`` after completion, returning True when the values
  changed; the kernel then reloads from the data source.

``state`` is the batch normalization's `BatchNormalizationState`; for instance and group
normalization, the **batch of per-image gradient states** (a `StateBatch`: the batch's
gradient is their sum). The state's fields (``gradient_for_gamma``, ``mean``, ...) read in the
GPU path are the storage the encoded kernels write when they run: a data source of your own
encodes its update on them (an optimizer's ``encode``, or ``command_buffer.record``).

Batch normalization's running statistics follow the same two paths
(``update_mean_and_variance`` / ``update_mean_and_variance_on_cpu``): an exponential moving
average ``running = (1 - momentum) running + momentum batch`` with the **unbiased** batch
variance for the running variance, as PyTorch does (inference then matches models ported from
it). MPS itself keeps no running statistics.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mpsnn.cnn.normalization.states import (
    NormalizationGammaAndBetaState,
    NormalizationMeanAndVarianceState,
    channel_vector,
)
from mpsnn.core._checks import check_positive
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.kernel import TrainingStyle
from mpsnn.core.state import _unique
from mpsnn.ops.batch_norm import bn_running_updates
from mpsnn.ops.batch_norm_params import RunningUpdate

__all__ = [
    "BatchNormalizationDataSource",
    "GroupNormalizationDataSource",
    "InstanceNormalizationDataSource",
    "NormalizationDataSource",
    "TensorBatchNormalizationDataSource",
    "TensorGroupNormalizationDataSource",
    "TensorInstanceNormalizationDataSource",
    "update_means_and_variances",
]


def _epsilon(who: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"[{who}] epsilon must be a finite number, got {value!r}")
    if value < 0:
        raise ValueError(f"[{who}] epsilon must be >= 0, got {value}")
    return float(value)


class NormalizationDataSource(abc.ABC):
    """What every normalization data source provides: ``number_of_feature_channels``,
    ``gamma()``, ``beta()`` (None: no bias), ``epsilon``, ``load``/``purge``/``label``, and the
    optional gamma/beta update hooks."""

    training_style: TrainingStyle = TrainingStyle.UPDATE_ON_GPU

    @property
    @abc.abstractmethod
    def number_of_feature_channels(self) -> int: ...

    @abc.abstractmethod
    def gamma(self) -> Any: ...

    @abc.abstractmethod
    def beta(self) -> Any | None: ...

    @property
    def epsilon(self) -> float:
        """MPS's default when a data source does not say: the smallest normal float32."""
        return 1.1754943508222875e-38

    def load(self) -> bool:
        return True

    def purge(self) -> None:
        return None

    @property
    def label(self) -> str | None:
        return None

    def update_gamma_and_beta(
        self, command_buffer: CommandBuffer, state: Any
    ) -> NormalizationGammaAndBetaState | None:
        return None

    def update_gamma_and_beta_on_cpu(self, state: Any) -> bool:
        return False


class BatchNormalizationDataSource(NormalizationDataSource):
    """MPS ``MPSCNNBatchNormalizationDataSource``: adds the running ``mean()`` and
    ``variance()`` (for inference, and to start a state) and their update hooks."""

    @abc.abstractmethod
    def mean(self) -> Any: ...

    @abc.abstractmethod
    def variance(self) -> Any: ...

    def update_mean_and_variance(
        self, command_buffer: CommandBuffer, state: Any
    ) -> NormalizationMeanAndVarianceState | None:
        return None

    def update_mean_and_variance_on_cpu(self, state: Any) -> bool:
        return False


class InstanceNormalizationDataSource(NormalizationDataSource):
    """MPS ``MPSCNNInstanceNormalizationDataSource``."""


class GroupNormalizationDataSource(NormalizationDataSource):
    """MPS ``MPSCNNGroupNormalizationDataSource``: adds ``number_of_groups``."""

    @property
    @abc.abstractmethod
    def number_of_groups(self) -> int: ...


@dataclass(frozen=True, slots=True, eq=False)
class _AffineArguments:
    """What every ``Tensor*`` normalization data source is given (its constructor's arguments
    of those names, unchecked): ``channels`` is ``number_of_feature_channels``."""

    channels: int
    gamma: Any
    beta: Any
    epsilon: float
    optimizer: Any
    label: str | None


class _TensorGammaBeta:
    """Gamma/beta held as a permanent state, updated by an optional optimizer."""

    _who = "TensorNormalizationDataSource"

    def _init_affine(self, a: _AffineArguments) -> None:
        """Check ``a`` and hold its gamma, beta, epsilon, optimizer and label."""
        who = self._who
        self._channels = check_positive(who, "number_of_feature_channels", a.channels)
        g = channel_vector(who, "gamma", a.gamma, self._channels, 1.0)
        b = channel_vector(who, "beta", a.beta, self._channels, 0.0).to(g.dtype)
        self._gb = NormalizationGammaAndBetaState(g, b)
        self._epsilon = _epsilon(who, a.epsilon)
        if a.optimizer is not None and not callable(getattr(a.optimizer, "_update", None)):
            raise TypeError(
                f"[{who}] optimizer must be an mpsnn optimizer (SGD, RMSProp or Adam) or None, "
                f"got {type(a.optimizer).__name__}"
            )
        self._optimizer = a.optimizer
        self._optimizer_state: list[list[torch.Tensor]] | None = None
        self._label = a.label

    @property
    def number_of_feature_channels(self) -> int:
        return self._channels

    @property
    def epsilon(self) -> float:
        return self._epsilon

    @property
    def label(self) -> str | None:
        return self._label

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    @property
    def optimizer_state(self) -> list[list[torch.Tensor]] | None:
        """The optimizer's vectors (momentum, velocity, ...) for [gamma, beta], made by the
        first update (None before)."""
        return self._optimizer_state

    def gamma(self) -> torch.Tensor:
        """The held gamma (the same memory the optimizer writes)."""
        return self._gb.gamma

    def beta(self) -> torch.Tensor:
        return self._gb.beta

    def _to(self, device: torch.device) -> None:
        """Move the held tensors to the device of the states that update them (once)."""
        if self._gb.gamma.device != device:
            self._gb = NormalizationGammaAndBetaState(
                self._gb.gamma.to(device), self._gb.beta.to(device)
            )

    def _affine_lists(self, state: Any) -> tuple[Any, ...]:
        """``(values, grads, results, optimizer state)`` of one gamma/beta update. ``state``:
        a gradient state, or a batch of them (instance and group normalization keep one per
        image): the gradients are summed over its distinct states when the update runs."""
        states = _unique(list(state)) if isinstance(state, Sequence) else [state]
        if not states:
            raise ValueError(f"[{self._who}] the state batch must hold states, got none")
        first = states[0]
        self._to(first.device.torch_device)
        values = [first.gamma, first.beta]  # the values the kernel used (source state)
        results = [self._gb.gamma, self._gb.beta]
        if self._optimizer_state is None:
            self._optimizer_state = self._optimizer._init_state(results)
        # read when the update runs
        parts = [st._gamma_beta_gradients(self._who) for st in states]
        if len(parts) == 1:
            return values, parts[0], results, self._optimizer_state

        def grads() -> list[torch.Tensor]:
            sums = [part() for part in parts]
            return [
                torch.stack([s[0] for s in sums]).sum(0),
                torch.stack([s[1] for s in sums]).sum(0),
            ]

        return values, grads, results, self._optimizer_state

    def _affine_update(self, cb: CommandBuffer | None, state: Any) -> bool:
        if self._optimizer is None:
            return False
        self._optimizer._update(cb, *self._affine_lists(state))
        return True

    def update_gamma_and_beta(
        self, command_buffer: CommandBuffer, state: Any
    ) -> NormalizationGammaAndBetaState | None:
        """GPU path: the optimizer's update encoded into ``command_buffer``, from the state's
        gradients (a state batch: their sum) and the gamma/beta the kernel used, into this data
        source's own tensors (returned as a state); None without an optimizer."""
        return self._gb if self._affine_update(command_buffer, state) else None

    def update_gamma_and_beta_on_cpu(self, state: Any) -> bool:
        """CPU path (after completion): the optimizer's update, now; False without one."""
        return self._affine_update(None, state)


class TensorBatchNormalizationDataSource(_TensorGammaBeta, BatchNormalizationDataSource):
    """A batch-normalization data source that holds gamma, beta and the running statistics.

    Args:
        number_of_feature_channels: C.
        gamma, beta: (C,) values (None: ones, zeros).
        mean, variance: (C,) running statistics (None: zeros, ones).
        epsilon: added to the variance (>= 0).
        momentum: weight of the batch statistics in the running average, in [0, 1].
        optimizer: an optimizer for gamma and beta (None: no gamma/beta update).
        label: a name.
    """

    _who = "TensorBatchNormalizationDataSource"

    def __init__(
        self,
        number_of_feature_channels: int,
        gamma: Any = None,
        beta: Any = None,
        mean: Any = None,
        variance: Any = None,
        epsilon: float = 1e-5,
        momentum: float = 0.1,
        optimizer: Any = None,
        label: str | None = None,
    ) -> None:
        who = self._who
        self._init_affine(_AffineArguments(number_of_feature_channels, gamma, beta, epsilon,
                                           optimizer, label))  # fmt: skip
        c, dtype = self._channels, self._gb.gamma.dtype
        mu = channel_vector(who, "mean", mean, c, 0.0).to(dtype)
        var = channel_vector(who, "variance", variance, c, 1.0).to(dtype)
        if (var < 0).any():
            raise ValueError(f"[{who}] variance must be >= 0, got {var.min().item()}")
        self._mv = NormalizationMeanAndVarianceState(mu, var)
        if (
            isinstance(momentum, bool)
            or not isinstance(momentum, int | float)
            or not 0 <= momentum <= 1
        ):
            raise ValueError(f"[{who}] momentum must be in [0, 1], got {momentum!r}")
        self.momentum = float(momentum)

    def mean(self) -> torch.Tensor:
        """The running mean (the same memory the updates write)."""
        return self._mv.mean

    def variance(self) -> torch.Tensor:
        """The running variance."""
        return self._mv.variance

    def _to(self, device: torch.device) -> None:
        super()._to(device)
        if self._mv.mean.device != device:
            self._mv = NormalizationMeanAndVarianceState(
                self._mv.mean.to(device), self._mv.variance.to(device)
            )

    def _running_update(self, state: Any) -> Callable[[], RunningUpdate]:
        """What the command blends: ``state``'s batch statistics into the running ones (read
        when it runs; ``state`` checked now)."""
        self._to(state.device.torch_device)
        running = (self._mv.mean, self._mv.variance)
        stats = state._statistics_tensors("TensorBatchNormalizationDataSource")
        m = self.momentum

        def update() -> RunningUpdate:  # (1 - m) running + m batch
            count, mean, m2 = stats()
            return RunningUpdate(running, count, mean, m2, m)

        return update

    def update_mean_and_variance(
        self, command_buffer: CommandBuffer, state: Any
    ) -> NormalizationMeanAndVarianceState:
        """GPU path: the running-average update as recorded work; returns the data source's
        own running statistics as a state (for ``reload_mean_and_variance``).
        `update_means_and_variances` updates several data sources as one command."""
        return update_means_and_variances(command_buffer, [(self, state)])[0]

    def update_mean_and_variance_on_cpu(self, state: Any) -> bool:
        """CPU path (after completion): the running-average update, now."""
        bn_running_updates((self._running_update(state)(),))
        return True

    @property
    def _own_running_updates(self) -> bool:
        """Whether ``update_mean_and_variance`` is this class's (not a subclass's): then a
        graph may update several such data sources in one command."""
        cls, own = type(self), TensorBatchNormalizationDataSource
        return (
            cls.update_mean_and_variance is own.update_mean_and_variance
            and cls._running_update is own._running_update
        )

    def __repr__(self) -> str:
        return (
            f"TensorBatchNormalizationDataSource({self._channels}, epsilon={self._epsilon}, "
            f"momentum={self.momentum}, label={self._label!r})"
        )


class TensorInstanceNormalizationDataSource(_TensorGammaBeta, InstanceNormalizationDataSource):
    """An instance-normalization data source holding gamma and beta.

    Args:
        number_of_feature_channels: C.
        gamma, beta: (C,) values (None: ones, zeros).
        epsilon: added to the variance (>= 0).
        optimizer: an optimizer for gamma and beta (None: no update).
        label: a name.
    """

    _who = "TensorInstanceNormalizationDataSource"

    def __init__(
        self,
        number_of_feature_channels: int,
        gamma: Any = None,
        beta: Any = None,
        epsilon: float = 1e-5,
        optimizer: Any = None,
        label: str | None = None,
    ) -> None:
        self._init_affine(_AffineArguments(number_of_feature_channels, gamma, beta, epsilon,
                                           optimizer, label))  # fmt: skip


class TensorGroupNormalizationDataSource(_TensorGammaBeta, GroupNormalizationDataSource):
    """A group-normalization data source holding gamma and beta.

    Args:
        number_of_feature_channels: C.
        number_of_groups: G, dividing C (C/G consecutive channels share statistics).
        gamma, beta: (C,) values (None: ones, zeros); per channel, also inside a group.
        epsilon: added to the variance (>= 0).
        optimizer: an optimizer for gamma and beta (None: no update).
        label: a name.
    """

    _who = "TensorGroupNormalizationDataSource"

    def __init__(
        self,
        number_of_feature_channels: int,
        number_of_groups: int,
        gamma: Any = None,
        beta: Any = None,
        epsilon: float = 1e-5,
        optimizer: Any = None,
        label: str | None = None,
    ) -> None:
        self._init_affine(_AffineArguments(number_of_feature_channels, gamma, beta, epsilon,
                                           optimizer, label))  # fmt: skip
        g = check_positive(self._who, "number_of_groups", number_of_groups)
        if self._channels % g:
            raise ValueError(
                f"[{self._who}] number_of_groups must divide number_of_feature_channels "
                f"({self._channels}), got {g}"
            )
        self._groups = g

    @property
    def number_of_groups(self) -> int:
        return self._groups


def update_means_and_variances(
    command_buffer: CommandBuffer,
    pairs: Sequence[tuple[TensorBatchNormalizationDataSource, Any]],
) -> list[NormalizationMeanAndVarianceState]:
    """``data_source.update_mean_and_variance(command_buffer, state)`` for every ``(data_source,
    state)`` pair, as mpsnn's `TensorBatchNormalizationDataSource` does it (a subclass's override
    of that method is not called: a graph groups only data sources without one), as one
    command: on CUDA one launch updates a whole network's layers
    (`mpsnn.ops.batch_norm.bn_running_updates`), where the per-layer form costs a launch and
    its host dispatch per layer at every training step. Every state is checked before anything
    is recorded; the updates behave as if made in list order (a data source listed twice
    blends twice). Returns each data source's running statistics, as its own update does."""
    makers = [ds._running_update(state) for ds, state in pairs]
    if makers:
        command_buffer.record(
            "TensorBatchNormalizationDataSource.update_mean_and_variance",
            lambda: bn_running_updates([make() for make in makers]),
        )
    return [ds._mv for ds, _ in pairs]
