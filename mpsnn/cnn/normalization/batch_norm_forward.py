"""The batch-normalization forward side (MPS ``MPSCNNBatchNormalization``,
``MPSCNNBatchNormalizationStatistics``): the statistics kernel, the forward kernel (training
mode on the state's statistics, inference mode on the running ones), the record the gradients
read, and the helpers the group/instance normalization kernels share (`MasterPair`,
`read_normalization_vectors`). The state (``MPSCNNBatchNormalizationState``) is in
`mpsnn.cnn.normalization.batch_norm_state`, the gradient kernels in
`mpsnn.cnn.normalization.batch_norm_gradient`; the training step as a whole is described in
`mpsnn.cnn.normalization`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mpsnn.cnn._pointwise import Pointwise, PointwiseKernel, PointwiseRecord
from mpsnn.cnn.neuron_descriptor import FusedNeuron
from mpsnn.cnn.normalization.batch_norm_state import _STATS, BatchNormalizationState
from mpsnn.cnn.normalization.data_sources import BatchNormalizationDataSource
from mpsnn.cnn.normalization.states import (
    NormalizationGammaAndBetaState,
    NormalizationMeanAndVarianceState,
)
from mpsnn.core.cnn_kernel import CNNKernel, Records
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.device import Device
from mpsnn.core.encode import Encoding
from mpsnn.core.geometry import Window
from mpsnn.core.grouped import check_grouped_reads, pair_copier
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.kernel import image_sequences
from mpsnn.core.state import StateBatch
from mpsnn.ops.batch_norm import bn_forward, bn_statistics_and_variance
from mpsnn.ops.batch_norm_params import BatchNormParams

__all__ = [
    "AffineChannels",
    "BatchNormalization",
    "BatchNormalizationRecord",
    "BatchNormalizationStatistics",
    "check_normalization_reloads",
    "read_normalization_vectors",
    "reload_normalization_states",
]


class MasterPair:
    """Two (C,) master tensors a kernel owns on its device (gamma/beta, or the running
    mean/variance), updated in place by reloads: work recorded earlier reads the new values."""

    __slots__ = ("first", "second")

    def __init__(self, first: torch.Tensor, second: torch.Tensor, device: Device) -> None:
        dev = device.torch_device
        dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
        self.first = first.to(dev, dtype, copy=True)
        self.second = second.to(dev, dtype, copy=True)

    def load(self, first: torch.Tensor, second: torch.Tensor) -> None:
        # one launch for both on a GPU (a training step reloads every normalization layer);
        # masters are plain storage: a source that requires grad is copied outside autograd
        if first.requires_grad or second.requires_grad:
            with torch.no_grad():
                torch._foreach_copy_([self.first, self.second], [first, second])
            return
        torch._foreach_copy_([self.first, self.second], [first, second])

    def load_from_data_source(
        self, who: str, data_source: Any, names: tuple[str, str], channels: int
    ) -> None:
        """Copy the data source's vectors ``names`` in place, now (`read_normalization_vectors`)."""
        a, b = read_normalization_vectors(who, data_source, names, channels)
        self.load(a.to(self.first.device), b.to(self.first.device))

    def encode_load(
        self, kernel: Any, cb: CommandBuffer, state: Any, kind: type, name: str
    ) -> None:
        """Copy ``state`` (a ``kind`` of the kernel's ``number_of_feature_channels`` channels)
        in place as recorded work of ``kernel`` on ``cb`` (the state's read count drops)."""
        a, b = _check_load(kernel, cb, state, kind, name)

        def run() -> None:
            self.load(a, b)

        kernel._apply(cb, Encoding(run, (), (state,)))


def _check_load(
    kernel: Any, cb: CommandBuffer, state: Any, kind: type, name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raise unless ``state`` (a ``kind``) can be loaded into ``kernel`` on ``cb``; its two
    vectors (taken now: the state may be released before the command runs)."""
    channels = kernel.number_of_feature_channels
    kernel._check_command_buffer(cb)
    kernel._check_state(cb, state, name, kind)
    if state.number_of_feature_channels != channels:
        raise ValueError(
            f"[{type(kernel).__name__}] {name} must hold {channels} channels, "
            f"got {state.number_of_feature_channels}"
        )
    return state._get()


def reload_normalization_states(
    command_buffer: CommandBuffer, pairs: Sequence[tuple[Any, Any]]
) -> None:
    """``kernel.reload_gamma_and_beta(command_buffer, state)`` (a
    `NormalizationGammaAndBetaState`) or ``kernel.reload_mean_and_variance(command_buffer,
    state)`` (a `NormalizationMeanAndVarianceState`, batch normalization) for every ``(kernel,
    state)`` pair, as one command: one multi-tensor copy (one launch on CUDA, where the
    per-kernel form costs a launch and its host dispatch per reload at every training step).
    Every pair is checked before anything is recorded, with the per-kernel messages; each pair
    drops its state's read count by one, as its own reload would (a temporary state listed
    more often than its read count allows raises), and the copies behave as if made in list
    order (`mpsnn.core.grouped.pair_copier`)."""
    pairs = list(pairs)
    masters, src = check_normalization_reloads(command_buffer, pairs)
    if not pairs:
        return
    dst = [t for pair in masters for t in (pair.first, pair.second)]
    copy = pair_copier(dst, src)

    def run() -> None:
        with torch.no_grad():  # masters are plain storage, whatever the sources require
            copy()

    command_buffer.record("reload_normalization_states", run)
    for kernel, state in pairs:
        state._consume_read(command_buffer, type(kernel).__name__)


def check_normalization_reloads(
    command_buffer: CommandBuffer, pairs: Sequence[tuple[Any, Any]]
) -> tuple[list[MasterPair], list[torch.Tensor]]:
    """Check the ``(kernel, state)`` pairs of `reload_normalization_states` (changes nothing);
    returns the masters each pair writes and the source vectors, two per pair."""
    masters: list[MasterPair] = []
    src: list[torch.Tensor] = []
    for kernel, state in pairs:
        who = type(kernel).__name__
        if isinstance(state, NormalizationMeanAndVarianceState):
            if not isinstance(kernel, BatchNormalization):
                raise TypeError(
                    f"[reload_normalization_states] a mean_and_variance_state must be "
                    f"reloaded into a BatchNormalization, got a {who}"
                )
            pair, kind, name = (
                kernel._running,
                NormalizationMeanAndVarianceState,
                "mean_and_variance_state",
            )
        elif isinstance(kernel, AffineChannels):
            pair, kind, name = (
                kernel._affine,
                NormalizationGammaAndBetaState,
                "gamma_and_beta_state",
            )
        else:
            raise TypeError(
                "[reload_normalization_states] each kernel must be a normalization kernel "
                f"(with gamma and beta), got a {who}"
            )
        src += _check_load(kernel, command_buffer, state, kind, name)
        masters.append(pair)
    check_grouped_reads([(type(kernel).__name__, state) for kernel, state in pairs])
    return masters, src


class AffineChannels:
    """What a normalization kernel with per-channel gamma/beta shows (MPS: ``dataSource``,
    ``numberOfFeatureChannels``, ``gamma``, ``beta`` and the two gamma/beta reloads), over the
    attributes it sets: ``_data_source``, ``_channels`` and ``_affine`` (a `MasterPair`)."""

    _data_source: Any
    _channels: int
    _affine: MasterPair

    @property
    def data_source(self) -> Any:
        return self._data_source

    @property
    def number_of_feature_channels(self) -> int:
        return self._channels

    @property
    def gamma(self) -> torch.Tensor:
        """The master gamma (C,), updated in place by reloads."""
        return self._affine.first

    @property
    def beta(self) -> torch.Tensor:
        return self._affine.second

    def reload_gamma_and_beta_from_data_source(self) -> None:
        """Copy the data source's gamma and beta into the kernel, in place, now."""
        self._affine.load_from_data_source(
            type(self).__name__, self._data_source, ("gamma", "beta"), self._channels
        )

    def reload_gamma_and_beta(
        self, command_buffer: CommandBuffer, gamma_and_beta_state: NormalizationGammaAndBetaState
    ) -> None:
        """Copy ``gamma_and_beta_state`` into the kernel as recorded work."""
        kind = NormalizationGammaAndBetaState
        self._affine.encode_load(self, command_buffer, gamma_and_beta_state, kind,
                                 "gamma_and_beta_state")  # fmt: skip


def read_normalization_vectors(
    who: str, data_source: Any, names: Sequence[str], channels: int | None = None
) -> list[torch.Tensor]:
    """Call ``load``, read ``names`` (methods returning (C,) vectors; beta None means 0),
    ``purge``; check the shapes."""
    if not callable(getattr(data_source, "gamma", None)):
        raise TypeError(
            f"[{who}] data_source must be a normalization data source (with gamma(), beta(), "
            f"number_of_feature_channels), got {type(data_source).__name__}"
        )
    if data_source.load() is False:
        raise ValueError(f"[{who}] the data source's load() must succeed, got False")
    try:
        c = int(data_source.number_of_feature_channels) if channels is None else channels
        out = []
        for name in names:
            v = getattr(data_source, name)()
            t = torch.zeros(c) if v is None else torch.as_tensor(v).detach()
            if tuple(t.shape) != (c,):
                raise ValueError(
                    f"[{who}] the data source's {name}() must have shape ({c},), "
                    f"got {tuple(t.shape)}"
                )
            out.append(t.to(torch.float64 if t.dtype == torch.float64 else torch.float32))
    finally:
        data_source.purge()
    return out


@dataclass(frozen=True, slots=True, eq=False)
class BatchNormalizationRecord(PointwiseRecord):
    """What a batch-normalization forward hands its gradients: the channels it normalized,
    epsilon, the fused neuron and the kernel's master gamma/beta."""

    channels: int
    epsilon: float
    neuron: FusedNeuron | None
    affine: MasterPair

    def params(self, mean: torch.Tensor, var: torch.Tensor) -> BatchNormParams:
        """The ops-level arguments of a pass over this normalization with the batch's ``mean``
        and biased ``var`` (gamma and beta: the masters' current values)."""
        return bn_params(self.affine, self.epsilon, self.neuron, mean, var)


def bn_params(
    affine: MasterPair,
    eps: float,
    neuron: FusedNeuron | None,
    mean: torch.Tensor,
    var: torch.Tensor,
) -> BatchNormParams:
    """`BatchNormParams` of a normalization with masters ``affine`` (gamma, beta: their current
    values), ``eps`` and fused ``neuron``, for the statistics ``mean`` and biased ``var``."""
    f = None if neuron is None else neuron.params
    return BatchNormParams(mean=mean, var=var, gamma=affine.first, beta=affine.second, eps=eps,
                           neuron=f)  # fmt: skip


def check_channels_read(who: str, kernel: Any, source_channels: int, channels: int) -> None:
    """Raise unless ``kernel`` reads exactly ``channels`` channels of a source of
    ``source_channels`` (from its ``source_feature_channel_offset``, at most its
    ``source_feature_channel_max_count``)."""
    read = max(0, min(kernel._smax, source_channels - kernel._sco))
    if read != channels:
        raise ValueError(
            f"[{who}] the channels read (from source_feature_channel_offset {kernel._sco}, at "
            f"most source_feature_channel_max_count) must be the state's {channels}, got "
            f"{read} of the source's {source_channels}"
        )


def _check_bn_state(kernel: Any, cb: CommandBuffer, state: Any, name: str) -> Any:
    """One `BatchNormalizationState` (a StateBatch must repeat one state)."""
    if isinstance(state, Sequence) and not isinstance(state, str | bytes):
        unique = StateBatch(state).unique()
        if len(unique) != 1:
            raise ValueError(
                f"[{type(kernel).__name__}] {name} must be one state (or a StateBatch repeating "
                f"one), got {len(unique)} distinct states"
            )
        state = unique[0]
    return kernel._check_state(cb, state, name, BatchNormalizationState)


class BatchNormalizationStatistics(CNNKernel):
    """Accumulates a batch's per-channel statistics into a state (MPS
    ``MPSCNNBatchNormalizationStatistics``), over one or several ``encode_batch`` calls
    (sub-batches). It reads whole images, channels ``source_feature_channel_offset`` on, at
    most ``source_feature_channel_max_count``: exactly the state's normalization's channels
    (a source with more or fewer raises at encode). Each run merges the sub-batch into the
    state's sums and rewrites the state's variance in place."""

    _batch_barrier = True

    @image_sequences("source_images")
    def encode_batch(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_images: ImageBatch,
        batch_normalization_state: BatchNormalizationState,
    ) -> None:
        """Add the statistics of ``source_images`` to ``batch_normalization_state``."""
        cb = command_buffer
        self._check_command_buffer(cb)
        src = self._check_batch(cb, source_images, "source_images")
        state = _check_bn_state(self, cb, batch_normalization_state, "batch_normalization_state")
        c, c0 = state._channels, self._sco
        check_channels_read("BatchNormalizationStatistics", self, src.feature_channels, c)
        wide = src._dtype == torch.float64

        def run() -> None:
            x = src._read()
            if c0 or c != x.shape[1]:
                x = x[:, c0 : c0 + c]
            state._merge_statistics(cb, bn_statistics_and_variance(x))

        def note() -> None:
            state._note_encoded(_STATS, wide)

        self._apply(cb, Encoding(run, (), (src, state), after=note))

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "[BatchNormalizationStatistics] encode is not available (as in MPS): use "
            "encode_batch(command_buffer, source_images, batch_normalization_state)"
        )


class BatchNormalization(AffineChannels, PointwiseKernel):
    """``y = f(gamma (x - mean)/sqrt(var + eps) + beta)`` per channel (MPS
    ``MPSCNNBatchNormalization``).

    Args:
        device: the kernel's device.
        data_source: a `BatchNormalizationDataSource` (gamma, beta, running mean and variance,
            epsilon), read now and at reloads only.
        fused_neuron_descriptor: a neuron applied after gamma/beta (None or NONE: none).

    ``encode(command_buffer, source_image, batch_normalization_state=None,
    destination_image=None)``: with a state holding batch statistics, training mode (the
    batch's mean and biased variance, and the state records what the gradients need);
    otherwise inference mode on the running statistics. The channels read
    (``source_feature_channel_offset`` on) must be ``number_of_feature_channels``; offsets,
    clip rect and edge mode apply as for any 1x1-window kernel.
    """

    def __init__(
        self,
        device: Device,
        data_source: BatchNormalizationDataSource,
        fused_neuron_descriptor: Any = None,
    ) -> None:
        super().__init__(device)
        who = "BatchNormalization"
        g, b, mu, var = read_normalization_vectors(
            who, data_source, ("gamma", "beta", "mean", "variance")
        )
        self._data_source = data_source
        self._channels = g.shape[0]
        self.epsilon = float(data_source.epsilon)
        self._neuron = FusedNeuron.of(who, fused_neuron_descriptor)
        self._fused_descriptor = fused_neuron_descriptor
        self._affine = MasterPair(g, b, device)
        self._running = MasterPair(mu, var.to(mu.dtype), device)

    @property
    def fused_neuron_descriptor(self) -> Any:
        return self._fused_descriptor

    @property
    def mean(self) -> torch.Tensor:
        """The running mean used in inference mode (the data source's, as of the last reload)."""
        return self._running.first

    @property
    def variance(self) -> torch.Tensor:
        return self._running.second

    # -- reloads ------------------------------------------------------------------------------

    def reload_mean_and_variance_from_data_source(self) -> None:
        """Copy the data source's running mean and variance into the kernel, now."""
        self._running.load_from_data_source(
            "BatchNormalization", self._data_source, ("mean", "variance"), self._channels
        )

    def reload_mean_and_variance(
        self,
        command_buffer: CommandBuffer,
        mean_and_variance_state: NormalizationMeanAndVarianceState,
    ) -> None:
        """Copy ``mean_and_variance_state`` into the kernel's running statistics as recorded
        work."""
        kind = NormalizationMeanAndVarianceState
        self._running.encode_load(self, command_buffer, mean_and_variance_state, kind,
                                  "mean_and_variance_state")  # fmt: skip

    # -- states ------------------------------------------------------------------------------

    def result_state(
        self, source_image: Image, source_states: Any = None, destination_image: Any = None
    ) -> BatchNormalizationState:
        """A new state for a batch (gamma/beta are the kernel's, no statistics yet)."""
        return BatchNormalizationState(self._device, self)

    def result_state_batch(
        self, source_images: ImageBatch, source_states: Any = None, destination_images: Any = None
    ) -> StateBatch:
        """One state shared by the whole batch (MPS: the state is reused across the batch)."""
        return StateBatch([BatchNormalizationState(self._device, self)] * len(source_images))

    def temporary_result_state(
        self,
        command_buffer: CommandBuffer,
        source_image: Image,
        source_states: Any = None,
        destination_image: Any = None,
    ) -> BatchNormalizationState:
        self._check_command_buffer(command_buffer)
        return BatchNormalizationState(self._device, self, command_buffer=command_buffer)

    def temporary_result_state_batch(
        self,
        command_buffer: CommandBuffer,
        source_images: ImageBatch,
        source_states: Any = None,
        destination_images: Any = None,
    ) -> StateBatch:
        """One temporary state shared by the whole batch."""
        self._check_command_buffer(command_buffer)
        state = BatchNormalizationState(self._device, self, command_buffer=command_buffer)
        return StateBatch([state] * len(source_images))

    _reused_across_batch = True

    # -- encode -----------------------------------------------------------------------------

    def encode(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_image: Image,
        batch_normalization_state: BatchNormalizationState | None = None,
        destination_image: Image | None = None,
    ) -> Image:
        """Normalize ``source_image`` (see the class); returns the destination."""
        self._check_command_buffer(command_buffer)
        self._check_image(command_buffer, source_image, "source_image")
        states = self._states(command_buffer, batch_normalization_state, 1)
        return self._encode(command_buffer, source_image, destination_image, states, batch=False)

    @image_sequences("source_images", destinations=("destination_images",))
    def encode_batch(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_images: ImageBatch,
        batch_normalization_state: BatchNormalizationState | None = None,
        destination_images: ImageBatch | None = None,
    ) -> ImageBatch:
        """Normalize a batch (one operation); returns the destination batch."""
        cb = command_buffer
        self._check_command_buffer(cb)
        src = self._check_batch(cb, source_images, "source_images")
        dst = None
        if destination_images is not None:
            dst = self._check_batch(cb, destination_images, "destination_images")
        states = self._states(cb, batch_normalization_state, len(source_images))
        out = self._encode(cb, src, dst, states, batch=True)
        return destination_images if destination_images is not None else ImageBatch(out)

    def _states(self, cb: CommandBuffer, state: Any, n: int) -> list[Any]:
        if state is None:
            return []
        st = _check_bn_state(self, cb, state, "batch_normalization_state")
        if st._kernel is not self:
            raise ValueError(
                "[BatchNormalization] batch_normalization_state must come from this kernel's "
                "result_state (it holds this kernel's gamma and beta), got one of another "
                "BatchNormalization"
            )
        return [st]

    def _destination_channels(self, source_channels: int) -> int:
        if source_channels != self._channels:
            raise ValueError(
                f"[BatchNormalization] the source must provide number_of_feature_channels="
                f"{self._channels} channels (after source_feature_channel_offset={self._sco}), "
                f"got {source_channels}"
            )
        return source_channels

    def _state_kind(self) -> type:
        return BatchNormalizationState

    def _record_params(self, window: Window, memo: dict[str, Any]) -> BatchNormalizationRecord:
        return BatchNormalizationRecord(
            self._extract_plan(window, memo), channels=self._channels, epsilon=self.epsilon,
            neuron=self._neuron, affine=self._affine,
        )  # fmt: skip

    def _pointwise(self, window: Window, records: Records) -> Pointwise:
        eps, affine, neuron = self.epsilon, self._affine, self._neuron
        training = bool(records) and records[0][0]._statistics_encoded
        if training:
            state = records[0][0]

            stats = state._mean_variance  # what the statistics wrote

        else:
            running = self._running

            def stats() -> tuple[torch.Tensor, torch.Tensor]:
                return running.first, running.second

        def forward(x: torch.Tensor) -> torch.Tensor:
            mean, var = stats()
            return bn_forward(x, bn_params(affine, eps, neuron, mean, var))

        return forward
