"""Losses (MPS ``MPSCNNLoss``, ``MPSCNNLossDescriptor``, ``MPSCNNLossLabels``).

One encode does the forward and the backward: the **destination is the gradient** of the
loss with respect to the predictions, and the loss goes into the labels (``loss_image()``).
The math, and the derivation of every gradient, are in `mpsnn.ops.loss`; in short:

* the reduction is per image: SUM, MEAN (divisor ``C·H·W``, or ``H·W`` for the cross
  entropies and cosine distance, whose channels are classes) and SUM_BY_NON_ZERO_WEIGHTS give
  one value per image, NONE the weighted per-element losses;
* the loss image includes the descriptor's ``weight`` (with SUM and ``weight = 1/B`` the
  per-image loss is the cross entropy divided by B, as in Apple's training sample);
* the gradient is the true derivative of the sum of the loss image over the batch, weights and
  divisors included (MPS documents several gradients wrongly: softmax cross entropy is
  ``softmax(y)·Σt' - t'``, Huber is ``(y - t)`` inside ``delta``, hinge maps 0/1 labels to
  ±1, Kullback-Leibler is taken with respect to log-probabilities);
* labels may have **more channels than the predictions** (Apple's sample pads 10 classes to
  12): the extra channels take no part; the two cross entropies also take int64 class indices.

Note:
    ``number_of_classes=None`` means the predictions' channel count. MPS's default of 1 would
    add the whole label smoothing to every class; pass an explicit count to get that.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mpsnn.core._checks import check_enum, check_int, check_type
from mpsnn.core.cnn_kernel import CNNKernel
from mpsnn.core.descriptor import FeatureChannelFormat, ImageDescriptor, _result_format
from mpsnn.core.device import CommandBuffer, Device
from mpsnn.core.encode import Encoding
from mpsnn.core.geometry import RECT_NO_CLIP, Size
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.state import State
from mpsnn.errors import UnsupportedError
from mpsnn.ops.loss import LossParams, loss_forward_backward

__all__ = ["Loss", "LossDescriptor", "LossLabels", "LossType", "ReductionType"]


class LossType(enum.IntEnum):
    """MPS ``MPSCNNLossType`` (values as MPS)."""

    MEAN_ABSOLUTE_ERROR = 0
    MEAN_SQUARED_ERROR = 1
    SOFTMAX_CROSS_ENTROPY = 2
    SIGMOID_CROSS_ENTROPY = 3
    CATEGORICAL_CROSS_ENTROPY = 4
    HINGE = 5
    HUBER = 6
    COSINE_DISTANCE = 7
    LOG = 8
    KULLBACK_LEIBLER_DIVERGENCE = 9


class ReductionType(enum.IntEnum):
    """MPS ``MPSCNNReductionType``: per image, NONE keeps the per-element losses."""

    NONE = 0
    SUM = 1
    MEAN = 2
    SUM_BY_NON_ZERO_WEIGHTS = 3


_INDEX_LABELS = (LossType.SOFTMAX_CROSS_ENTROPY, LossType.CATEGORICAL_CROSS_ENTROPY)
_PER_PIXEL = (*_INDEX_LABELS, LossType.COSINE_DISTANCE)


def _finite(who: str, name: str, value: Any, minimum: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"[{who}] {name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"[{who}] {name} must be finite, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"[{who}] {name} must be >= {minimum}, got {value}")
    return float(value)


class LossDescriptor:
    """What a `Loss` computes (MPS ``MPSCNNLossDescriptor``).

    Args:
        loss_type: a `LossType`.
        reduction_type: a `ReductionType`.
        weight: multiplies every loss and gradient (e.g. ``1/B`` with SUM for a batch mean).
        label_smoothing: ``>= 0``; the cross entropies use ``t' = (1 - ls) t + ls / K``,
            sigmoid cross entropy ``t' = (1 - ls) t + ls / 2``.
        number_of_classes: ``K`` for label smoothing (None: the predictions' channel count).
        epsilon: used by LOG (``log(y + eps)``) and categorical cross entropy
            (``log(max(y, eps))``); ``> 0``.
        delta: the Huber threshold, ``> 0``.
    """

    __slots__ = (
        "delta",
        "epsilon",
        "label_smoothing",
        "loss_type",
        "number_of_classes",
        "reduction_type",
        "weight",
    )

    def __init__(
        self,
        loss_type: LossType,
        reduction_type: ReductionType,
        weight: float = 1.0,
        label_smoothing: float = 0.0,
        number_of_classes: int | None = None,
        epsilon: float = 1e-7,
        delta: float = 1.0,
    ) -> None:
        who = "LossDescriptor"
        self.loss_type = check_enum(who, "loss_type", loss_type, LossType)
        self.reduction_type = check_enum(who, "reduction_type", reduction_type, ReductionType)
        self.weight = _finite(who, "weight", weight)
        self.label_smoothing = _finite(who, "label_smoothing", label_smoothing, 0.0)
        if number_of_classes is not None and (
            isinstance(number_of_classes, bool)
            or not isinstance(number_of_classes, int)
            or number_of_classes < 1
        ):
            raise ValueError(
                f"[{who}] number_of_classes must be None or a positive int, "
                f"got {number_of_classes!r}"
            )
        self.number_of_classes = number_of_classes
        self.epsilon = _finite(who, "epsilon", epsilon)
        if self.epsilon <= 0:
            raise ValueError(f"[{who}] epsilon must be > 0, got {epsilon}")
        self.delta = _finite(who, "delta", delta)
        if self.delta <= 0:
            raise ValueError(f"[{who}] delta must be > 0, got {delta}")

    def _params(self) -> LossParams:
        return LossParams(
            int(self.loss_type), int(self.reduction_type), self.weight, self.label_smoothing,
            self.number_of_classes, self.epsilon, self.delta,
        )  # fmt: skip

    def copy(self) -> LossDescriptor:
        return LossDescriptor(
            self.loss_type, self.reduction_type, self.weight, self.label_smoothing,
            self.number_of_classes, self.epsilon, self.delta,
        )  # fmt: skip

    def __repr__(self) -> str:
        return (
            f"LossDescriptor({self.loss_type.name}, {self.reduction_type.name}, "
            f"weight={self.weight}, label_smoothing={self.label_smoothing}, "
            f"number_of_classes={self.number_of_classes}, epsilon={self.epsilon}, "
            f"delta={self.delta})"
        )


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
            feeding labels from device memory wants to avoid. Indices outside ``[0, C)`` are
            then the caller's responsibility.

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


class Loss(CNNKernel):
    """A loss and its gradient in one encode (MPS ``MPSCNNLoss``).

    Args:
        device: the kernel's device.
        loss_descriptor: a `LossDescriptor` (copied).

    ``encode(command_buffer, source_image, labels, destination_image=None)`` returns the
    gradient of the loss with respect to ``source_image`` (the predictions; for the softmax and
    sigmoid cross entropies, logits) and writes the loss into ``labels``. The loss reads whole
    images: ``offset``, ``clip_rect`` and the channel offsets keep their defaults.
    """

    def __init__(self, device: Device, loss_descriptor: LossDescriptor) -> None:
        super().__init__(device)
        check_type("Loss", "loss_descriptor", loss_descriptor, LossDescriptor)
        self._desc = loss_descriptor.copy()
        self._params = self._desc._params()

    # -- the descriptor's fields, read-only (MPS) ---------------------------------------

    @property
    def loss_type(self) -> LossType:
        return self._desc.loss_type

    @property
    def reduction_type(self) -> ReductionType:
        return self._desc.reduction_type

    @property
    def weight(self) -> float:
        return self._desc.weight

    @property
    def label_smoothing(self) -> float:
        return self._desc.label_smoothing

    @property
    def number_of_classes(self) -> int | None:
        return self._desc.number_of_classes

    @property
    def epsilon(self) -> float:
        return self._desc.epsilon

    @property
    def delta(self) -> float:
        return self._desc.delta

    # -- encode ---------------------------------------------------------------------------

    def encode(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_image: Image,
        labels: LossLabels,
        destination_image: Image | None = None,
    ) -> Image:
        """The gradient image; the loss goes into ``labels`` (see the class)."""
        self._check_command_buffer(command_buffer)
        self._check_image(command_buffer, source_image, "source_image")
        lab = [self._check_state(command_buffer, labels, "labels", LossLabels)]
        return self._encode_loss(command_buffer, source_image, lab, destination_image, False)

    def encode_batch(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_images: ImageBatch,
        labels_batch: LossLabels | Sequence[LossLabels],
        destination_images: ImageBatch | None = None,
    ) -> ImageBatch:
        """Batch form: ``labels_batch`` is one `LossLabels` per image (a StateBatch), or one
        `LossLabels` holding the whole batch."""
        cb = command_buffer
        self._check_command_buffer(cb)
        src = self._check_batch(cb, source_images, "source_images")
        if isinstance(labels_batch, LossLabels):
            lab = [self._check_state(cb, labels_batch, "labels_batch", LossLabels)]
        else:
            if not isinstance(labels_batch, Sequence) or isinstance(labels_batch, str | bytes):
                raise TypeError(
                    "[Loss] labels_batch must be a LossLabels or a sequence of them, "
                    f"got {type(labels_batch).__name__}"
                )
            lab = [self._check_state(cb, s, "labels_batch", LossLabels) for s in labels_batch]
        dst = None
        if destination_images is not None:
            dst = self._check_batch(cb, destination_images, "destination_images")
        out = self._encode_loss(cb, src, lab, dst, True)
        return destination_images if destination_images is not None else ImageBatch(out)

    def _encode_loss(
        self,
        cb: CommandBuffer,
        src: Image,
        labels: list[LossLabels],
        dst: Image | None,
        batch: bool,
    ) -> Image:
        who = "Loss"
        if (
            self._offset[:2] != (0, 0)
            or self._clip != RECT_NO_CLIP
            or self._sco != 0
            or self._dco != 0
        ):
            raise UnsupportedError(
                "[Loss] a loss reads whole images: offset, clip_rect and the channel offsets "
                "must keep their defaults, got "
                f"offset={self._offset} clip_rect={self._clip} "
                f"channel offsets {self._sco}/{self._dco}"
            )
        n, c, h, w = src._shape
        first = 0 if batch else self._offset.z
        count = n - first if batch else 1
        if not 0 <= first < n:
            raise ValueError(f"[{who}] offset.z must select an image of the {n}, got {first}")
        kinds = {lab._index for lab in labels}
        total = sum(lab.number_of_images for lab in labels)
        if total != count:
            raise ValueError(
                f"[{who}] the labels must hold one image per source image ({count}), got {total}"
            )
        if len(kinds) != 1:
            raise ValueError(f"[{who}] labels must all be float or all class indices, got both")
        index = kinds.pop()
        kind = self._desc.loss_type
        for lab in labels:
            t = lab._labels
            if index:
                if kind not in _INDEX_LABELS:
                    raise ValueError(
                        f"[{who}] class-index labels need a cross entropy loss, got {kind.name}"
                    )
                if t.shape[1:] != (h, w):
                    raise ValueError(
                        f"[{who}] index labels must be {h}x{w} (the source), got "
                        f"{t.shape[2]}x{t.shape[1]}"
                    )
                if lab._max_index >= c:
                    raise ValueError(
                        f"[{who}] class indices must be < the {c} channels of the predictions, "
                        f"got {lab._max_index}"
                    )
                lab._classes = c  # what a refilled copy must stay below (compiled steps)
            elif t.shape[1] < c or t.shape[2:] != (h, w):
                raise ValueError(
                    f"[{who}] labels must be {w}x{h} with at least the predictions' {c} channels, "
                    f"got {t.shape[3]}x{t.shape[2]}x{t.shape[1]}"
                )
        weighted = {None if lab._weights is None else lab._weights.dim() for lab in labels}
        if len(weighted) != 1:
            raise ValueError(
                f"[{who}] labels must all have weights of one kind or all none, got a mix"
            )
        per_pixel = kind in _PER_PIXEL
        none = self._desc.reduction_type is ReductionType.NONE
        lshape = ((c if not per_pixel else 1), h, w) if none else (1, 1, 1)
        for lab in labels:
            size = lab._loss_size
            if size is not None and (size.depth, size.height, size.width) != lshape:
                raise ValueError(
                    f"[{who}] loss_image_size must be {Size(lshape[2], lshape[1], lshape[0])} "
                    f"for {self._desc.reduction_type.name}, got {size}"
                )
        if dst is not None:
            self._check_destination(cb, dst, "destination_image", src)
            if dst._shape[1:] != (c, h, w) or dst._shape[0] < (count if batch else 1):
                raise ValueError(
                    f"[{who}] the destination must be {w}x{h}x{c} like the source, got "
                    f"{dst.width}x{dst.height}x{dst.feature_channels}"
                )
        gfmt = _result_format(src._fmt)
        grad_out = dst if dst is not None else ImageDescriptor._make(gfmt, w, h, c, count)
        fmt = src._fmt if src._fmt is FeatureChannelFormat.FLOAT64 else FeatureChannelFormat.FLOAT32
        loss_desc = ImageDescriptor._make(fmt, lshape[2], lshape[1], lshape[0], count)
        params = self._params
        several = len(labels) > 1
        has_weights = weighted.pop() is not None
        dz = 0 if batch else self._clip.origin.z

        whole = first == 0 and count == n  # no slice to make (a batch encode)

        def run(grad: Image, loss: Image) -> None:
            y = src._read()
            if not whole:
                y = y[first : first + count]
            if several:
                t = torch.cat([lab._labels for lab in labels])
                wt = torch.cat([lab._weights for lab in labels]) if has_weights else None
            else:
                t, wt = labels[0]._labels, labels[0]._weights
            value, g = loss_forward_backward(y, t, wt, params)
            grad._write_block(g, dz, 0, 0, 0, y)
            loss._write_block(value, 0, 0, 0, 0)

        loss_image = Image._make(self._device, loss_desc)
        views = _split(loss_image, [lab.number_of_images for lab in labels])
        outs = self._apply(
            cb, Encoding(run, (grad_out, loss_image), (src, *labels), (), None, batch)
        )
        for lab, view in zip(labels, views, strict=True):
            lab._loss = view
        return outs[0]  # type: ignore[return-value]


def _split(image: Image, counts: list[int]) -> list[Image]:
    """Views of consecutive images of ``image``, ``counts[i]`` images each."""
    if len(counts) == 1:
        return [image]
    batch = ImageBatch(image)
    out, start = [], 0
    for k in counts:
        if k == 1:
            out.append(batch[start])
        else:
            view = Image.__new__(Image)
            _, c, h, w = image.shape
            Image.__init__(view, image.device, ImageDescriptor._make(image._fmt, w, h, c, k))
            view._base, view._index = image, start
            out.append(view)
        start += k
    return out
