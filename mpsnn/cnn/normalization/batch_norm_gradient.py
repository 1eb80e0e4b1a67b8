"""The batch-normalization gradient kernels (MPS ``MPSCNNBatchNormalizationStatisticsGradient``,
``MPSCNNBatchNormalizationGradient``): the gradient sums ``Σ gy·xhat`` and ``Σ gy`` accumulated
into the state over every sub-batch, then ``dL/dx`` from the whole batch's statistics and sums;
the fused neuron's gradient is applied first in both.

They read what the forward side left in the `BatchNormalizationState` and its
`BatchNormalizationRecord` (`mpsnn.cnn.normalization.batch_norm_forward`), and are registered
as the gradients of `BatchNormalization` here. `mpsnn.cnn.normalization` describes the
training step as a whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mpsnn.cnn._pointwise import PointwiseBackward, PointwiseGradient
from mpsnn.cnn.neuron_descriptor import FusedNeuron
from mpsnn.cnn.normalization.batch_norm_forward import (
    BatchNormalization,
    BatchNormalizationRecord,
    _check_bn_state,
    check_channels_read,
)
from mpsnn.cnn.normalization.batch_norm_state import _GRADS, _STATS, BatchNormalizationState
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.device import Device
from mpsnn.core.encode import Encoding
from mpsnn.core.geometry import Window
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.kernel import image_sequences
from mpsnn.core.registry import gradient_of
from mpsnn.core.state import ForwardRecord
from mpsnn.ops.batch_norm import bn_backward, bn_gradient_sums
from mpsnn.ops.batch_norm_params import BatchNormSums
from mpsnn.ops.window import apply_extract

__all__ = ["BatchNormalizationGradient", "BatchNormalizationStatisticsGradient"]


class _BatchNormalizationGradientBase(PointwiseGradient):
    """Shared by the two gradient kernels: the fused neuron, the state checks, MPS's encode
    signature (the state third)."""

    _state_class = BatchNormalizationState

    def __init__(self, device: Device, fused_neuron_descriptor: Any = None) -> None:
        super().__init__(device)
        who = type(self).__name__
        self._neuron = FusedNeuron.of(who, fused_neuron_descriptor)
        self._fused_descriptor = fused_neuron_descriptor

    @property
    def fused_neuron_descriptor(self) -> Any:
        return self._fused_descriptor

    def _check_forward(self, record: ForwardRecord) -> None:
        who = type(self).__name__
        theirs = record.params.neuron
        if theirs != self._neuron:
            show = None if theirs is None else theirs.descriptor
            raise ValueError(
                f"[{who}] fused_neuron_descriptor must equal the forward batch normalization's "
                f"({show!r}), got {self._fused_descriptor!r}"
            )

    def _states_for(self, cb: CommandBuffer, state: Any, n: int) -> list[Any]:
        st = _check_bn_state(self, cb, state, "batch_normalization_state")
        if not st._statistics_encoded:
            st._batch(type(self).__name__)  # raises: the gradients need batch statistics
        return [st] * n

    def _encode_on(self, cb: CommandBuffer, st: Any, source: Any, encode: Callable[[], Any]) -> Any:
        """Run ``encode`` (the base class's encode) on the state ``st``. A state that only the
        statistics kernel updated (no `BatchNormalization` encode, as MPS allows) gets the
        record the state's kernel would write for ``source`` (its geometry, epsilon, neuron
        and gamma/beta) for the duration of the encode, and keeps it if the encode succeeds."""
        if not isinstance(st, BatchNormalizationState) or st._forward is not None:
            return encode()
        who = type(self).__name__
        image = source._image if isinstance(source, ImageBatch) else source
        if not isinstance(image, Image):
            return encode()  # the base class's checks raise the type error
        bn = st._kernel
        check_channels_read(who, bn, image.feature_channels, st._channels)
        bn._record_only(image, [st])
        try:
            return encode()
        except BaseException:
            st._forward = None  # a failed encode leaves the state as it was
            raise


@gradient_of(BatchNormalization)
class BatchNormalizationStatisticsGradient(_BatchNormalizationGradientBase):
    """Accumulates ``Σ gy·xhat`` and ``Σ gy`` per channel into the state (MPS
    ``MPSCNNBatchNormalizationStatisticsGradient``): ``gradient_for_gamma`` and
    ``gradient_for_beta``, complete once every sub-batch ran. ``gy = g f'(z)``: the fused
    neuron's gradient is applied first (``z`` recomputed from ``x`` and the statistics).

    The state must hold batch statistics (`BatchNormalizationStatistics` encoded into it);
    a `BatchNormalization` encode is not needed (MPS: the state "previously updated using a
    MPSCNNBatchNormalizationStatistics kernel and the source images"): without one, the
    state's kernel supplies the geometry (its channel offset and count, which must select the
    state's channels of the sources), epsilon, fused neuron (which must equal this kernel's)
    and gamma/beta."""

    _runs_beside = True  # reads its sources, writes its state's sums only

    @image_sequences("source_gradients", "source_images")
    def encode_batch(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_gradients: ImageBatch,
        source_images: ImageBatch,
        batch_normalization_state: BatchNormalizationState,
    ) -> None:
        """Add this sub-batch's gradient sums to ``batch_normalization_state``."""
        cb = command_buffer
        n = len(source_images) if isinstance(source_images, ImageBatch) else 1
        states = self._states_for(cb, batch_normalization_state, n)
        self._encode_on(
            cb, states[0], source_images,
            lambda: super(BatchNormalizationStatisticsGradient, self).encode_batch(
                cb, source_gradients, source_images, states
            ),
        )  # fmt: skip

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            "[BatchNormalizationStatisticsGradient] encode is not available (as in MPS): use "
            "encode_batch(command_buffer, source_gradients, source_images, "
            "batch_normalization_state)"
        )

    def _wants_data_gradient(self) -> bool:
        return False

    def _pointwise_backward(self, record: ForwardRecord, states: list[Any]) -> PointwiseBackward:
        raise AssertionError("unused: _make_backward is overridden")  # pragma: no cover

    def _make_backward(
        self, cb: CommandBuffer, record: ForwardRecord, window: Window, states: list[Any]
    ) -> Any:
        p: BatchNormalizationRecord = record.params
        state = states[0]

        def backward(g: torch.Tensor, x: torch.Tensor) -> None:
            xb = apply_extract(x, p.plan)
            sums = bn_gradient_sums(g, xb, p.params(*state._mean_variance()))
            state._accumulate(cb, (sums[1], sums[0]), slot=_GRADS)  # [dgamma, dbeta]
            return

        return backward

    def _plan_gradient(
        self,
        cb: CommandBuffer,
        grad: Image,
        src: Image,
        record: ForwardRecord,
        states: list[Any],
        dst: Image | None,
        batch: bool,
    ) -> Encoding:
        enc = super()._plan_gradient(cb, grad, src, record, states, dst, batch)
        state = states[0]
        wide = torch.float64 in (grad._dtype, src._dtype)

        def note() -> None:
            state._note_encoded(_GRADS, wide)

        enc.after = note
        return enc


@gradient_of(BatchNormalization)
class BatchNormalizationGradient(_BatchNormalizationGradientBase):
    """``dL/dx = gamma/sqrt(var + eps) (gy - Σgy/m - xhat Σgy·xhat/m)`` (MPS
    ``MPSCNNBatchNormalizationGradient``), from the whole batch's statistics and gradient sums
    (encode `BatchNormalizationStatisticsGradient` over every sub-batch first); the fused
    neuron's gradient is applied first. Like the statistics gradient, it needs no forward
    encode."""

    def encode(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_gradient: Image,
        source_image: Image,
        batch_normalization_state: BatchNormalizationState,
        destination_gradient: Image | None = None,
    ) -> Image:
        """dL/d(source_image) for one (multi-image) image."""
        cb, st = command_buffer, batch_normalization_state
        self._require_gradients(st)
        if isinstance(st, BatchNormalizationState):
            self._states_for(cb, st, 1)
        return self._encode_on(
            cb, st, source_image,
            lambda: super(BatchNormalizationGradient, self).encode(
                cb, source_gradient, source_image, st, destination_gradient
            ),
        )  # fmt: skip

    @image_sequences("source_gradients", "source_images", destinations=("destination_gradients",))
    def encode_batch(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_gradients: ImageBatch,
        source_images: ImageBatch,
        batch_normalization_state: BatchNormalizationState,
        destination_gradients: ImageBatch | None = None,
    ) -> ImageBatch:
        """dL/d(source_images) for a (sub-)batch."""
        cb = command_buffer
        n = len(source_images) if isinstance(source_images, ImageBatch) else 1
        states = self._states_for(cb, batch_normalization_state, n)
        self._require_gradients(states[0])
        return self._encode_on(
            cb, states[0], source_images,
            lambda: super(BatchNormalizationGradient, self).encode_batch(
                cb, source_gradients, source_images, states, destination_gradients
            ),
        )  # fmt: skip

    def _require_gradients(self, state: Any) -> None:
        if isinstance(state, BatchNormalizationState) and not state._gradients_encoded:
            raise ValueError(
                "[BatchNormalizationGradient] the state must hold the gradient sums (encode "
                "BatchNormalizationStatisticsGradient over the batch first), got none"
            )

    def _pointwise_backward(self, record: ForwardRecord, states: list[Any]) -> PointwiseBackward:
        p: BatchNormalizationRecord = record.params
        state = states[0]

        def backward(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            count = state._slots[_STATS][0]
            dgamma, dbeta = state._slots[_GRADS]
            sums = BatchNormSums(sum_gy=dbeta, sum_gy_xhat=dgamma, count=count)
            return bn_backward(g, x, p.params(*state._mean_variance()), sums)

        return backward
