"""The batch-normalization state (MPS ``MPSCNNBatchNormalizationState``): the statistics of one
batch and their gradient sums, as stable storage.

Every field is a tensor that stays the same object for the life of the state: ``mean``,
``variance`` (biased), ``gradient_for_gamma`` and ``gradient_for_beta`` read at encode time
(once the work that writes them was encoded) return the storage that work writes **in place**
when it runs, as an MPS state's ``MTLBuffer`` s are. Client work recorded on the command buffer
after that work (``cb.record``, an optimizer's encode) therefore reads the values of this batch;
the contents are valid once that work ran. `BatchNormalizationState.numpy` reads a field on the
host and raises before the work that writes it ran.

Storage is made when a field is first read, or adopted from the first result when nothing
read it before (no copy in a training step nobody inspects); from then on every write (a later
sub-batch's merge, a `reset` and a new batch, a data-parallel exchange) goes into the same
tensors. The variance is derived from the sums ``(count, m2)`` by the work that changes them:
the statistics command writes it after each merge, a data-parallel exchange after it rewrote
the sums in place (`BatchNormalizationState._write_variance`), each as part of its own work on
the device (so a CUDA-graph replay of that work rewrites it too). Readers (the forward, both
gradient kernels, a data source's update) only read it: no host state tracks whether it is
current. A `reset` changes nothing on the device (the next statistics store instead of
merging, and write the variance then).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from mpsnn.cnn.normalization.states import StableSums
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.device import Device
from mpsnn.ops.batch_norm import bn_merge, bn_variance

__all__ = ["BatchNormalizationState"]

_STATS, _GRADS = 0, 1  # the state's slots: (count, mean, m2) and (Σgy·xhat, Σgy)
_FIELDS = {
    "mean": _STATS,
    "variance": _STATS,
    "gradient_for_gamma": _GRADS,
    "gradient_for_beta": _GRADS,
}


class BatchNormalizationState(StableSums):
    """Statistics of one batch and their gradients (MPS ``MPSCNNBatchNormalizationState``).

    Written by: `BatchNormalizationStatistics` (sums of the batch: count, mean, m2, slot 0;
    and the biased variance), a data-parallel exchange of statistics (the same, in place),
    `BatchNormalization` (its record: geometry, epsilon, neuron), and
    `BatchNormalizationStatisticsGradient` (Σgy·xhat and Σgy, slot 1). Read by: the forward
    (training mode), both gradient kernels, the data source's updates and optimizers.

    ``gamma``/``beta`` are the kernel's values (the source state of a gamma/beta update);
    ``mean``/``variance`` those of the batch accumulated so far (biased variance), available
    once a statistics encode was encoded into the state; the gradients None before any
    statistics gradient was encoded. Each is stable storage written in place by the work (see
    the module docstring): read it at encode time to encode work of your own on it. `reset`
    clears the sums for a new batch (the storage stays).
    """

    def __init__(
        self,
        device: Device,
        batch_normalization: Any,
        *,
        command_buffer: CommandBuffer | None = None,
        label: str | None = None,
    ) -> None:
        super().__init__(device, command_buffer=command_buffer, label=label)
        self._kernel = batch_normalization
        self._channels = batch_normalization.number_of_feature_channels
        self._statistics_encoded = False
        self._gradients_encoded = False
        self._var: torch.Tensor | None = None  # the biased variance's storage, once made

    # -- storage ------------------------------------------------------------------------------

    def _note_encoded(self, slot: int, wide: bool) -> None:
        """An encode that writes ``slot`` was recorded (``wide``: its data are float64)."""
        if slot == _STATS:
            self._statistics_encoded = True
        else:
            self._gradients_encoded = True
        self._note_dtype(slot, wide)

    def _slot_sizes(self, slot: int) -> tuple[int, ...]:
        c = self._channels
        return (1, c, c) if slot == _STATS else (c, c)

    def _merge_statistics(self, cb: CommandBuffer, stats: Sequence[torch.Tensor]) -> None:
        """The statistics command's work on the state: merge a sub-batch's ``(count, mean,
        m2, var)`` into the sums (`mpsnn.ops.batch_norm.bn_merge`; the first since the state
        was made or reset stores it) and write the variance they now give: the sub-batch's
        own ``var`` when it was stored as it came (the work that made the statistics wrote
        it), else `bn_variance` of the merged sums."""
        count, mean, m2, var = stats
        first = _STATS not in self._slots
        self._accumulate(cb, (count, mean, m2), bn_merge, slot=_STATS)
        stored = first and self._slots[_STATS][2] is m2  # not widened to float64
        self._write_variance(var if stored else None)

    def _write_variance(self, new: torch.Tensor | None = None) -> None:
        """Write the biased variance of the sums, ``m2 / count`` (`bn_variance`, or ``new``:
        it, computed by the caller's work), into its storage. Part of every work that changes
        ``count`` or ``m2``, run with it (the statistics command, a data-parallel exchange that
        rewrote the sums in place); readers never call it. When nothing read the field before,
        the first result becomes the storage (no copy); storage made under
        ``torch.inference_mode`` is replaced when written outside it (PyTorch forbids that
        write)."""
        if new is None:
            count, _, m2 = self._slots[_STATS]
            new = bn_variance(count, m2)
        var = self._var
        if var is None or (var.is_inference() and not torch.is_inference_mode_enabled()):
            self._var = new
        elif new is not var:  # (the work may have written the storage itself)
            var.copy_(new)

    def _mean_variance(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's mean and biased variance, as the work that changed the sums last wrote
        them (read when a command runs, once the statistics ran)."""
        mean, var = self._slots[_STATS][1], self._var
        if var is None:  # written with the sums, by the same work: read before the statistics
            raise RuntimeError(
                f"[{type(self).__name__}] internal error: the variance was read before the "
                "statistics ran; please report this"
            )
        return mean, var

    def _free_storage(self) -> None:
        super()._free_storage()
        self._var = None

    def resources(self) -> list[torch.Tensor]:
        return super().resources() + ([] if self._var is None else [self._var])

    # -- fields -------------------------------------------------------------------------------

    @property
    def batch_normalization(self) -> Any:
        """The kernel that made this state (a `BatchNormalization`)."""
        return self._kernel

    @property
    def number_of_feature_channels(self) -> int:
        return self._channels

    @property
    def gamma(self) -> torch.Tensor:
        return self._kernel._affine.first

    @property
    def beta(self) -> torch.Tensor:
        return self._kernel._affine.second

    def _require_statistics(self, who: str) -> None:
        self._check_live(who)
        if not self._statistics_encoded:
            raise ValueError(
                f"[{who}] the state must hold batch statistics (encode "
                "BatchNormalizationStatistics into it first), got none"
            )

    def _batch(self, who: str) -> list[torch.Tensor]:
        """The statistics sums that ran (raises when none was encoded or none ran yet)."""
        self._require_statistics(who)
        sums = self._slots.get(_STATS)
        if sums is None:
            raise ValueError(
                f"[{who}] the statistics encoded into the state must have run (commit their "
                "command buffer first), got none yet"
            )
        return sums

    @property
    def mean(self) -> torch.Tensor:
        """The batch's mean so far, (C,): the storage the statistics write (encode time on)."""
        self._require_statistics("BatchNormalizationState")
        return self._storage(_STATS)[1]

    @property
    def variance(self) -> torch.Tensor:
        """The batch's biased variance so far, (C,): the storage the statistics write."""
        self._require_statistics("BatchNormalizationState")
        if self._var is None:
            dt = self._dtypes.get(_STATS, torch.float32)
            self._var = torch.zeros(self._channels, dtype=dt, device=self.device.torch_device)
        return self._var

    def _gradient(self, index: int) -> torch.Tensor | None:
        if self._released_by is None and (self._gradients_encoded or _GRADS in self._slots):
            return self._storage(_GRADS)[index]
        sums = self._slots.get(_GRADS)
        return None if sums is None else sums[index]

    @property
    def gradient_for_gamma(self) -> torch.Tensor | None:
        """dL/dgamma = Σgy·xhat, (C,): the storage the statistics gradient writes (None before
        one was encoded)."""
        return self._gradient(0)

    @property
    def gradient_for_beta(self) -> torch.Tensor | None:
        """dL/dbeta = Σgy, (C,) (None before a statistics gradient was encoded)."""
        return self._gradient(1)

    def numpy(self, name: str) -> np.ndarray:
        """A host copy of the field ``name`` (``"mean"``, ``"variance"``,
        ``"gradient_for_gamma"`` or ``"gradient_for_beta"``). Raises ValueError before the
        work that writes it ran (its command buffer not committed yet); on a GPU waits for
        the queue that wrote it."""
        who = "BatchNormalizationState"
        slot = _FIELDS.get(name)
        if slot is None:
            raise ValueError(f"[{who}] name must be one of {sorted(_FIELDS)}, got {name!r}")
        self._check_live(who)
        if slot == _STATS:
            self._require_statistics(who)
        elif not self._gradients_encoded and _GRADS not in self._slots:
            raise ValueError(
                f"[{who}] the state must hold gamma/beta gradients (encode "
                "BatchNormalizationStatisticsGradient into it first), got none"
            )
        if slot not in self._slots:
            raise ValueError(
                f"[{who}] {name} must have been written by work that ran (commit its command "
                "buffer first), got none yet"
            )
        q = self._writer_queue
        if q is not None and q._stream is not None:
            q._stream.synchronize()
        return getattr(self, name).detach().cpu().numpy().copy()

    def reset(self) -> None:
        """Clear the statistics and their gradients (a new batch; the storage stays)."""
        super().reset()
        self._statistics_encoded = self._gradients_encoded = False

    # -- what commands read when they run -----------------------------------------------------

    def _statistics_tensors(self, who: str) -> Callable[[], list[torch.Tensor]]:
        """``(count, mean, m2)`` of the batch, read when the work runs (checked now)."""
        self._require_statistics(who)
        return lambda: self._slots[_STATS]

    def _gamma_beta_gradients(self, who: str) -> Callable[[], list[torch.Tensor]]:
        """``[dL/dgamma, dL/dbeta]``, read when the work runs (checked now)."""
        if not self._gradients_encoded:
            raise ValueError(
                f"[{who}] the state must hold gamma/beta gradients (encode "
                "BatchNormalizationStatisticsGradient into it first), got none"
            )
        return lambda: self._slots[_GRADS]
