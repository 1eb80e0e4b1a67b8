"""Losses (MPS ``MPSCNNLoss``, ``MPSCNNLossDescriptor``); the labels they read
(``MPSCNNLossLabels``) are `mpsnn.cnn.loss_labels.LossLabels`.

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
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpsnn.cnn.loss_labels import LossLabels
from mpsnn.core._checks import check_enum, check_type
from mpsnn.core.cnn_kernel import CNNKernel
from mpsnn.core.command_buffer import CommandBuffer, running_buffer
from mpsnn.core.descriptor import FeatureChannelFormat, ImageDescriptor, _result_format
from mpsnn.core.device import Device
from mpsnn.core.encode import Encoding
from mpsnn.core.geometry import Size
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.kernel import image_sequences, resolve_images
from mpsnn.core.saved import Field
from mpsnn.errors import CommandBufferError, UnsupportedError
from mpsnn.ops.loss import (
    LossParams,
    loss_forward_backward,
    new_index_bounds,
    read_index_bounds,
)

__all__ = [
    "Loss",
    "LossDescriptor",
    "LossType",
    "ReductionType",
]


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
_EMPTY_RANGE = -(2**63)  # what `new_index_bounds` holds: the identity of the running maxima

#: a loss's math: ``(predictions, labels, weights) -> (loss image, gradient)``
_Compute = Callable[
    [torch.Tensor, torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]
]


def _finite(
    who: str, name: str, value: Any, minimum: float | None = None, positive: bool = False
) -> float:
    """``value`` as a float: a finite real number (not a bool), ``>= minimum`` when given,
    ``> 0`` when ``positive``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"[{who}] {name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"[{who}] {name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"[{who}] {name} must be > 0, got {value}")
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
        self.epsilon = _finite(who, "epsilon", epsilon, positive=True)
        self.delta = _finite(who, "delta", delta, positive=True)

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


class _LabelsLoss(CNNKernel):
    """The encode of a loss whose labels are `LossLabels` (`Loss`, `mpsnn.cnn.yolo.YOLOLoss`):
    the gradient image is the destination and each `LossLabels` gets its images of the loss
    image. A subclass names itself in ``_who`` and checks its labels in `_prepare`."""

    _who = "Loss"

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

    @image_sequences("source_images", destinations=("destination_images",))
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
                    f"[{self._who}] labels_batch must be a LossLabels or a sequence of them, "
                    f"got {type(labels_batch).__name__}"
                )
            lab = [self._check_state(cb, s, "labels_batch", LossLabels) for s in labels_batch]
        dst = None
        if destination_images is not None:
            dst = self._check_batch(cb, destination_images, "destination_images")
        out = self._encode_loss(cb, src, lab, dst, True)
        return destination_images if destination_images is not None else ImageBatch(out)

    def _prepare(
        self, c: int, h: int, w: int, labels: list[LossLabels]
    ) -> tuple[tuple[int, int, int], _Compute, Callable[[CommandBuffer], None] | None]:
        """Checks the labels against predictions of ``c`` channels and ``h x w``; returns the
        loss image's ``(C, H, W)``, the math ``(y, labels, weights) -> (loss, gradient)`` and
        what to do once the command is encoded (or None)."""
        raise NotImplementedError

    def _encode_loss(
        self,
        cb: CommandBuffer,
        src: Image,
        labels: list[LossLabels],
        dst: Image | None,
        batch: bool,
    ) -> Image:
        who = self._who
        n, c, h, w = src._shape
        clip = self._clip
        if (
            self._offset[:2] != (0, 0)
            or clip.origin[:2] != (0, 0)
            or clip.size.width < w
            or clip.size.height < h
            or self._sco != 0
            or self._dco != 0
        ):
            raise UnsupportedError(
                f"[{who}] a loss reads whole images: offset.x/y, the clip rect's x and y range "
                "and the channel offsets must keep their defaults, got "
                f"offset={self._offset} clip_rect={clip} "
                f"channel offsets {self._sco}/{self._dco}"
            )
        if batch:
            first, dz, count = 0, 0, n
        else:  # the images the clip rect covers, as every kernel (`resolve_images`)
            dst_n = dst._shape[0] if dst is not None else max(1, n - self._offset.z)
            first, dz, count = resolve_images(who, n, dst_n, self._offset.z, clip, False)
        total = sum(lab.number_of_images for lab in labels)
        if total != count:
            covers = (
                ""
                if batch
                else f" the encode covers ({count}: images {first}..{first + count - 1} of the "
                f"{n}-image source)"
            )
            raise ValueError(
                f"[{who}] the labels must hold one image per source image"
                f"{covers or f' ({count})'}, got {total}"
            )
        lshape, compute, finish = self._prepare(c, h, w, labels)
        if dst is not None:
            self._check_destination(cb, dst, "destination_image", src)
            if dst._shape[1:] != (c, h, w) or dst._shape[0] < dz + count:
                raise ValueError(
                    f"[{who}] the destination must be {w}x{h}x{c} like the source, got "
                    f"{dst.width}x{dst.height}x{dst.feature_channels}"
                )
        gfmt = _result_format(src._fmt)
        images = count if batch else max(1, n - first)  # a returned destination: every kernel's
        grad_out = dst if dst is not None else ImageDescriptor._make(gfmt, w, h, c, images)
        fmt = src._fmt if src._fmt is FeatureChannelFormat.FLOAT64 else FeatureChannelFormat.FLOAT32
        loss_desc = ImageDescriptor._make(fmt, lshape[2], lshape[1], lshape[0], count)
        several = len(labels) > 1
        has_weights = labels[0]._weights is not None  # `_prepare` checked they all agree
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
            value, g = compute(y, t, wt)
            grad._write_block(g, dz, 0, 0, 0, y)
            loss._write_block(value, 0, 0, 0, 0)

        loss_image = Image._make(self._device, loss_desc)
        views = _split(loss_image, [lab.number_of_images for lab in labels])
        outs = self._apply(
            cb, Encoding(run, (grad_out, loss_image), (src, *labels), (), None, batch)
        )
        if finish is not None:
            finish(cb)
        for lab, view in zip(labels, views, strict=True):
            lab._loss = view
        return outs[0]  # type: ignore[return-value]


class Loss(_LabelsLoss):
    """A loss and its gradient in one encode (MPS ``MPSCNNLoss``).

    Args:
        device: the kernel's device.
        loss_descriptor: a `LossDescriptor` (copied).

    ``encode(command_buffer, source_image, labels, destination_image=None)`` returns the
    gradient of the loss with respect to ``source_image`` (the predictions; for the softmax and
    sigmoid cross entropies, logits) and writes the loss into ``labels``. The loss reads whole
    images: ``offset.x/y``, the clip rect's x and y range (it may cover the image exactly) and
    the channel offsets keep their defaults.

    **Images.** As every kernel, ``encode`` on a multi-image `Image` covers ``k = min(
    clip_rect.size.depth, source images - offset.z, destination images - clip_rect.origin.z)``
    images: source image ``offset.z + i`` gives destination image ``clip_rect.origin.z + i``
    (a returned destination holds the source's images from ``offset.z`` on; the ones outside
    the clip rect are zeros). ``labels`` then holds exactly ``k`` images, its image ``i``
    labelling source image ``offset.z + i``, and its loss image gets ``k`` images.
    ``encode_batch`` covers every image of the batch (``offset.z`` and the clip rect's z range
    do not apply), with one `LossLabels` for the batch or one per image.

    **Class indices** outside ``[0, C)`` (a trusted ``max_index``, labels changed in place)
    are found on the device, without a wait at encode: the command never addresses memory
    with them, and the command buffer fails with a `CommandBufferError` naming this kernel
    and the indices' range once its work completed (``wait_until_completed`` raises it).
    """

    saved_fields = (Field("loss_descriptor", LossDescriptor, attr="_desc"),)

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

    # -- encode (`_LabelsLoss`) ------------------------------------------------------------

    def _prepare(
        self, c: int, h: int, w: int, labels: list[LossLabels]
    ) -> tuple[tuple[int, int, int], _Compute, Callable[[CommandBuffer], None] | None]:
        who = "Loss"
        kinds = {lab._index for lab in labels}
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
        _check_loss_size(who, labels, lshape, self._desc.reduction_type)
        params = self._params
        if not index:
            return lshape, lambda y, t, wt: loss_forward_backward(y, t, wt, params), None
        # class indices: their range, folded by the command into a small int64 tensor and read
        # by the command buffer's completion check (`_index_check`). Each buffer keeps its own
        # (`running_buffer`): runs of one command in several buffers (a step program's eager
        # steps) overlap, and each buffer checks its own runs (two in one buffer fold into one
        # range). On CUDA the range is copied into pinned host memory on the queue's stream, so
        # the check reads host memory: no device read, no wait. A captured step's replays all
        # run the recorded copy into one host buffer, and replays run two deep: they fold into
        # one device range made here (outside any capture), which the check resets when it
        # reports.
        cuda = self._device.torch_device.type == "cuda"
        replayed = new_index_bounds(self._device.torch_device) if cuda else None
        replayed_host = _pinned_range() if cuda else None
        spare: list[torch.Tensor] = []  # pinned ranges that checks have read
        key = object()  # this command's value in a buffer's run values

        def compute(
            y: torch.Tensor, t: torch.Tensor, wt: torch.Tensor | None
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if replayed is not None and torch.cuda.is_current_stream_capturing():
                value, g = loss_forward_backward(y, t, wt, params, index_bounds=replayed)
                replayed_host.copy_(replayed, non_blocking=True)  # type: ignore[union-attr]
                return value, g
            buffer = running_buffer()
            kept = None if buffer is None else buffer._run_value(key)
            bounds = new_index_bounds(t.device) if kept is None else kept[0]
            value, g = loss_forward_backward(y, t, wt, params, index_bounds=bounds)
            host = None
            if bounds.is_cuda:
                host = (spare.pop() if spare else _pinned_range()) if kept is None else kept[1]
                host.copy_(bounds, non_blocking=True)
            if buffer is not None and kept is None:
                buffer._keep_run_value(key, (bounds, host))
            return value, g

        check = _index_check(key, replayed, replayed_host, spare, c)
        return lshape, compute, lambda cb: cb._check_after_last(check)


def _check_loss_size(
    who: str, labels: list[LossLabels], lshape: tuple[int, int, int], reduction: ReductionType
) -> None:
    """Each label's ``loss_image_size``, when given, must be the loss image's ``(C, H, W)``."""
    for lab in labels:
        size = lab._loss_size
        if size is not None and (size.depth, size.height, size.width) != lshape:
            raise ValueError(
                f"[{who}] loss_image_size must be {Size(lshape[2], lshape[1], lshape[0])} "
                f"for {reduction.name}, got {size}"
            )


def _index_check(
    key: object,
    replayed: torch.Tensor | None,
    replayed_host: torch.Tensor | None,
    spare: list[torch.Tensor],
    classes: int,
) -> Any:
    """The completion check of a loss command with class indices: the range must lie in
    ``[0, classes)``. An eager buffer's range is the one its runs kept for it (``key``: the
    device range and, on CUDA, its pinned copy, which goes back to ``spare`` once read). A
    captured step's replays fold into ``replayed`` (read from its copy ``replayed_host``): a
    bad range is reported once, after waiting for the device (replays still in flight fold
    into the range it reports), and both are then reset to the empty range."""

    def check(buffer: Any) -> CommandBufferError | None:
        if buffer._captured:
            if replayed is None or replayed_host is None:
                return None
            lo, hi = read_index_bounds(replayed_host)
            if lo < 0 or hi >= classes:  # every replay launched so far folds and copies first
                torch.cuda.synchronize(replayed.device)
                lo, hi = read_index_bounds(replayed_host)
                replayed.fill_(_EMPTY_RANGE)
                torch.cuda.synchronize(replayed.device)
                replayed_host.fill_(_EMPTY_RANGE)
        else:
            kept = buffer._run_value(key)
            if kept is None:  # read already (the command ran twice in this buffer)
                return None
            bounds, host = kept
            lo, hi = read_index_bounds(bounds if host is None else host)
            if host is not None:  # the buffer completed: its pinned range may serve again
                buffer._run_values.pop(key)
                spare.append(host)
        if lo >= 0 and hi < classes:
            return None
        return CommandBufferError(
            f"[Loss] class indices must lie in [0, {classes}) (the predictions' channels), "
            f"got {lo} to {hi}"
        )

    return check


def _pinned_range() -> torch.Tensor:
    """Pinned host memory for a copy of an ``index_bounds`` range, holding the empty range."""
    return torch.empty(2, dtype=torch.int64, pin_memory=True).fill_(_EMPTY_RANGE)


def _split(image: Image, counts: list[int]) -> list[Image]:
    """Views of consecutive images of ``image``, ``counts[i]`` images each (one loss image per
    `LossLabels`)."""
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
