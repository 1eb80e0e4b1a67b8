"""The labels of a loss (MPS ``MPSCNNLossLabels``): labels, weights and, after the loss ran,
the loss image. The loss kernel is `mpsnn.cnn.loss.Loss`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from mpsnn.core._checks import check_int, check_type
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.device import Device
from mpsnn.core.geometry import Size
from mpsnn.core.image import Image
from mpsnn.core.state import State

__all__ = [
    "LossLabels",
]


def _as_tensor(who: str, name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    try:
        return torch.as_tensor(np.asarray(value))
    except Exception as exc:
        raise TypeError(f"[{who}] {name} must be a tensor or an array, got {type(value)}") from exc


class LossLabels(State):
    """Labels, optional per-element weights and, after the loss ran, the loss (MPS
    ``MPSCNNLossLabels``).

    Args:
        device: where the labels live.
        labels: a float image ``(C, H, W)`` (one image) or ``(N, C, H, W)``; or, for the two
            cross entropies, int64 class indices ``(H, W)`` or ``(N, H, W)``. Float labels may
            have more channels than the predictions: the extra ones take no part.
        weights: per-element weights of the labels' shape (for index labels: one per pixel,
            ``(H, W)``/``(N, H, W)``, or per class ``(C, H, W)``/``(N, C, H, W)``), or None.
        loss_image_size: optional check of the loss image's size: the predictions' size for
            ReductionType.NONE, ``Size(1, 1, 1)`` otherwise (MPS's parameter; mpsnn sizes the
            loss image from the reduction).
        command_buffer: given, the labels are temporary on that command buffer.
        label: a name.
        max_index: for class-index labels, a bound the indices are known to respect (e.g.
            classes − 1): the constructor then trusts it instead of scanning the labels for
            their range — a scan of a GPU tensor waits for the device, which a training loop
            feeding labels from device memory wants to avoid. An index outside ``[0, C)`` that
            reaches a loss anyway is found on the device: that encode's command buffer fails
            (see `mpsnn.cnn.loss.Loss`).

    Labels image ``i`` labels the ``i``-th image a `mpsnn.cnn.loss.Loss` encode covers: the
    ``i``-th of a batch, or source image ``offset.z + i`` of a multi-image `Image`, so one
    `LossLabels` holds exactly as many images as that encode covers.

    After the encode's command buffer completed, `loss_image` holds the loss (including the
    descriptor's weight).
    """

    def __init__(
        self,
        device: Device,
        labels: Any,
        weights: Any = None,
        loss_image_size: Size | None = None,
        *,
        command_buffer: CommandBuffer | None = None,
        label: str | None = None,
        max_index: int | None = None,
    ) -> None:
        super().__init__(device, command_buffer=command_buffer, label=label)
        who = "LossLabels"
        t = _as_tensor(who, "labels", labels)
        self._index = not t.is_floating_point()
        single = t.dim() == (2 if self._index else 3)  # one image, without the N axis
        if self._index:
            if t.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
                raise TypeError(
                    f"[{who}] labels must be float or int64 class indices, got {t.dtype}"
                )
            if t.dim() == 2:
                t = t.unsqueeze(0)
            if t.dim() != 3 or t.numel() == 0:
                raise ValueError(
                    f"[{who}] index labels must have shape (H, W) or (N, H, W), "
                    f"got {tuple(t.shape)}"
                )
            if max_index is None:
                # construction time, so the encode stays sync-free (but a scan of a device
                # tensor waits for the device: pass max_index to skip it)
                lo, hi = int(t.min()), int(t.max())
                if lo < 0:
                    raise ValueError(f"[{who}] class indices must be >= 0, got {lo}")
            else:
                hi = check_int(who, "max_index", max_index, 0)
            self._max_index = hi
            t = t.to(device.torch_device, torch.int64)
        else:
            if t.dim() == 3:
                t = t.unsqueeze(0)
            if t.dim() != 4 or t.numel() == 0:
                raise ValueError(
                    f"[{who}] labels must have shape (C, H, W) or (N, C, H, W), "
                    f"got {tuple(t.shape)}"
                )
            self._max_index = -1
            dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
            t = t.to(device.torch_device, dtype)
        self._labels = t
        self._weights: torch.Tensor | None = None
        if weights is not None:
            self._weights = self._check_weights(_as_tensor(who, "weights", weights), single)
        if loss_image_size is not None:
            check_type(who, "loss_image_size", loss_image_size, Size)
        self._loss_size = loss_image_size
        self._loss: Image | None = None
        self._classes: int | None = None  # the predictions' channels at the last encode

    def _check_weights(self, wt: torch.Tensor, single: bool) -> torch.Tensor:
        """Weights as ``(N, C, H, W)`` (or ``(N, H, W)`` per pixel for index labels)."""
        who = "LossLabels"
        if not wt.is_floating_point():
            raise TypeError(f"[{who}] weights must hold floats, got {wt.dtype}")
        if single:
            wt = wt.unsqueeze(0)
        t = self._labels
        per_class = self._index and wt.dim() == 4 and wt.shape[0] == t.shape[0]
        if tuple(wt.shape) != tuple(t.shape) and not (per_class and wt.shape[2:] == t.shape[1:]):
            want = tuple(t.shape[1:] if single else t.shape)
            extra = " (one per pixel) or (C, H, W) per class" if self._index else ""
            raise ValueError(
                f"[{who}] weights must have the labels' shape {want}{extra}, "
                f"got {tuple(wt.shape[1:] if single else wt.shape)}"
            )
        dtype = torch.float64 if wt.dtype == torch.float64 else torch.float32
        return wt.to(self._device.torch_device, dtype)

    @property
    def number_of_images(self) -> int:
        return self._labels.shape[0]

    @property
    def is_index_labels(self) -> bool:
        return self._index

    def labels_image(self) -> Image | None:
        """The float labels as an image (None for class-index labels)."""
        self._check_live(None)
        return None if self._index else Image.from_tensor(self._labels)

    def weights_image(self) -> Image | None:
        """The weights as an image (None without weights)."""
        self._check_live(None)
        w = self._weights
        if w is None:
            return None
        return Image.from_tensor(w if w.dim() == 4 else w.unsqueeze(1))

    def loss_image(self) -> Image:
        """The loss the last encode wrote (read it after its command buffer completed):
        ``(N, 1, 1, 1)`` per image, or the weighted per-element losses for NONE."""
        self._check_live(None)
        if self._loss is None:
            raise ValueError(
                "[LossLabels] loss_image needs a Loss encode that used these labels, got none"
            )
        return self._loss

    def resources(self) -> list[torch.Tensor]:
        return [t for t in (self._labels, self._weights) if t is not None]

    # -- refilling in place (what a compiled graph step reads) ----------------------------

    def _static_copy(self) -> LossLabels:
        """Permanent labels of the same layout (values written by `_refill`)."""
        copy = LossLabels.__new__(LossLabels)
        State.__init__(copy, self._device, label=self.label)
        copy._index = self._index
        copy._max_index = self._max_index
        copy._labels = torch.empty_like(self._labels)
        copy._weights = None if self._weights is None else torch.empty_like(self._weights)
        copy._loss_size = self._loss_size
        copy._loss = None
        copy._classes = None
        return copy

    def _check_refill(self, who: str, other: Any) -> None:
        """Raise unless ``other``'s values can be copied into these labels."""
        if not isinstance(other, LossLabels):
            raise TypeError(f"[{who}] labels must be LossLabels, got {type(other).__name__}")
        other._check_live(who)
        if (
            other._index != self._index
            or other._labels.shape != self._labels.shape
            or (other._weights is None) != (self._weights is None)
            or (other._weights is not None and other._weights.shape != self._weights.shape)
        ):
            raise ValueError(
                f"[{who}] labels must have the recorded step's layout ({self._layout()}), "
                f"got {other._layout()}"
            )
        classes = getattr(self, "_classes", None)
        if self._index and classes is not None and other._max_index >= classes:
            raise ValueError(
                f"[{who}] class indices must be < the {classes} channels of the predictions, "
                f"got {other._max_index}"
            )

    def _layout(self) -> str:
        kind = "class indices" if self._index else "float labels"
        weights = "no weights" if self._weights is None else f"weights {tuple(self._weights.shape)}"
        return f"{kind} {tuple(self._labels.shape)}, {weights}"

    def _refill(self, other: LossLabels) -> None:
        """Copy ``other``'s labels and weights into this state's tensors (on the current
        stream)."""
        self._labels.copy_(other._labels, non_blocking=True)
        if self._weights is not None:
            self._weights.copy_(other._weights, non_blocking=True)
        self._max_index = max(self._max_index, other._max_index)

    def _free_storage(self) -> None:
        self._weights = None
