"""The split loss (MPS ``MPSNNForwardLoss``, ``MPSNNLossGradient``, ``MPSNNInitialGradient``).

Where `mpsnn.cnn.loss.Loss` computes the loss and its gradient in one encode, the split form
makes backpropagation start from an arbitrary image, so a network can sum several losses:

* `ForwardLoss` computes the **loss image** only (the same values as `Loss` writes into its
  labels: per image for SUM, MEAN and SUM_BY_NON_ZERO_WEIGHTS, the weighted per-element losses
  for NONE, the descriptor's ``weight`` included). Labels and weights are plain images.
* `InitialGradient` makes an image of ones the size of its source (``dL/dL = 1``), the start of
  backpropagation.
* `LossGradient` takes the incoming gradient ``g`` of the loss image (a loss-shaped image,
  normally the ones) and returns ``d <g, loss image> / d predictions``: with ``g`` all ones
  this is `Loss`'s gradient. With ``compute_label_gradients`` it returns the gradient with
  respect to the labels **instead** (as MPS: the filter computes the gradient of its primary
  source, the predictions, or of its secondary one, the labels).

The math and its derivations are in `mpsnn.ops.loss` (losses, weights, reductions) and
`mpsnn.ops.loss_split` (the batch reduction, label gradients).

**reduce_across_batch** (MPS ``reduceAcrossBatch``, default False): with a reduction other
than NONE, the batch's loss is one value written into image 0 of the loss image; the other
images hold 0. MEAN then divides by ``N`` times an image's unit count, SUM_BY_NON_ZERO_WEIGHTS
by the batch's non-zero weights. It has no effect with NONE.

**Labels** are float images ``(N, Cl, H, W)`` with ``Cl >= C`` (the extra channels take no
part; one-hot images for the cross entropies: class indices are a `LossLabels` feature of the
fused `Loss`); **weights** (optional) have the labels' shape.

**The gradient state** (MPS: an optional ``MPSNNGradientState`` "carrying dynamically computed"
parameters): a `ForwardLoss` encode given ``destination_state(s)`` records the parameters it
used; a `LossGradient` given that state as ``gradient_state`` / ``source_states`` uses the
forward's ``weight``, ``label_smoothing``, ``epsilon`` and ``delta`` instead of its own (a
graph's ``property_call_back`` weight reaches the gradient that way), and checks that the
forward had its loss type, reduction, class count and batch reduction, and the predictions'
shape. Without a state it uses its own properties.

Both loss kernels read whole images (MPS: "non-default offset or cliprects" are not
supported): ``offset``, the clip rect and the channel offsets keep their defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mpsnn.cnn.loss import _PER_PIXEL, LossDescriptor, LossType, ReductionType, _finite
from mpsnn.core._checks import check_type
from mpsnn.core.binary import BinaryKernel
from mpsnn.core.cnn_kernel import CNNKernel, Forward, Records
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.descriptor import FeatureChannelFormat, ImageDescriptor, _result_format
from mpsnn.core.device import Device
from mpsnn.core.encode import Encoding
from mpsnn.core.geometry import RECT_NO_CLIP, Offset, Window
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.saved import Field
from mpsnn.core.state import ForwardRecord, GradientState, State, _unique
from mpsnn.errors import UnsupportedError
from mpsnn.ops.loss import LossParams
from mpsnn.ops.loss_split import (
    LABEL_GRADIENT_TYPES,
    forward_loss,
    label_gradient,
    prediction_gradient,
)

__all__ = [
    "ForwardLoss",
    "InitialGradient",
    "LossGradient",
]


@dataclass(frozen=True, slots=True, eq=False)
class ForwardLossRecord:
    """What a `ForwardLoss` encode hands its `LossGradient` through the gradient state: the
    parameters it used and whether it reduced across the batch."""

    params: LossParams
    reduce_across_batch: bool


def loss_image_shape(
    loss_type: LossType, reduction: ReductionType, shape: tuple[int, int, int, int]
) -> tuple[int, int, int, int]:
    """``(N, C, H, W)`` of the loss image of predictions of ``shape``."""
    n, c, h, w = shape
    if reduction is not ReductionType.NONE:
        return (n, 1, 1, 1)
    return (n, 1 if loss_type in _PER_PIXEL else c, h, w)


class _LossProperties:
    """The descriptor's fields on the split loss kernels: ``loss_type``, ``reduction_type``,
    ``number_of_classes`` and ``reduce_across_batch`` read-only, ``weight``,
    ``label_smoothing``, ``epsilon`` and ``delta`` read-write (as MPS)."""

    _desc: LossDescriptor
    _across: bool

    def _init_loss(self, loss_descriptor: Any, reduce_across_batch: Any) -> None:
        who = type(self).__name__
        check_type(who, "loss_descriptor", loss_descriptor, LossDescriptor)
        check_type(who, "reduce_across_batch", reduce_across_batch, bool)
        self._desc = loss_descriptor.copy()
        self._across = reduce_across_batch

    @property
    def loss_type(self) -> LossType:
        return self._desc.loss_type

    @property
    def reduction_type(self) -> ReductionType:
        return self._desc.reduction_type

    @property
    def number_of_classes(self) -> int | None:
        return self._desc.number_of_classes

    @property
    def reduce_across_batch(self) -> bool:
        """Whether a reduced loss is one value for the whole batch (image 0)."""
        return self._across

    @property
    def weight(self) -> float:
        return self._desc.weight

    @weight.setter
    def weight(self, value: float) -> None:
        self._desc.weight = _finite(type(self).__name__, "weight", value)

    @property
    def label_smoothing(self) -> float:
        return self._desc.label_smoothing

    @label_smoothing.setter
    def label_smoothing(self, value: float) -> None:
        self._desc.label_smoothing = _finite(
            type(self).__name__, "label_smoothing", value, minimum=0.0
        )

    @property
    def epsilon(self) -> float:
        return self._desc.epsilon

    @epsilon.setter
    def epsilon(self, value: float) -> None:
        self._desc.epsilon = _finite(type(self).__name__, "epsilon", value, positive=True)

    @property
    def delta(self) -> float:
        return self._desc.delta

    @delta.setter
    def delta(self, value: float) -> None:
        self._desc.delta = _finite(type(self).__name__, "delta", value, positive=True)

    def _loss_params(self) -> LossParams:
        return self._desc._params()

    def _check_inputs(
        self, src: Image, labels: Any, weights: Any, who_labels: str, who_weights: str
    ) -> None:
        """Labels: an image of the source's batch and size with at least its channels;
        weights: None or an image of the labels' shape."""
        who = type(self).__name__
        n, c, h, w = src._shape
        ln, lc, lh, lw = labels._shape
        if ln != n or (lh, lw) != (h, w) or lc < c:
            raise ValueError(
                f"[{who}] {who_labels} must be {n} image(s) of {w}x{h} with at least the "
                f"predictions' {c} channels, got {ln} of {lw}x{lh}x{lc}"
            )
        if weights is not None and weights._shape != labels._shape:
            raise ValueError(
                f"[{who}] {who_weights} must have the labels' shape {labels._shape}, "
                f"got {weights._shape}"
            )


def _check_whole(who: str, offsets: Sequence[Offset], clip: Any, channel_offsets: Any) -> None:
    if any(o != Offset() for o in offsets) or clip != RECT_NO_CLIP or any(channel_offsets):
        raise UnsupportedError(
            f"[{who}] the split loss reads whole images: offsets, clip rect and channel offsets "
            f"must keep their defaults, got offsets {list(offsets)} clip_rect={clip} channel "
            f"offsets {list(channel_offsets)}"
        )


def _batch(
    kernel: Any, cb: CommandBuffer, value: Any, name: str, *, destination: bool = False
) -> Image:
    who = type(kernel).__name__
    batch = ImageBatch._of(cb, who, name, value, destination=destination)
    return kernel._check_batch(cb, batch, name)


def _check_arguments(
    kernel: Any,
    cb: CommandBuffer,
    batch: bool,
    images: Sequence[tuple[Any, str]],
    weights: Any,
    state: tuple[Any, str],
    destination: tuple[Any, str],
    *,
    alias_weights: bool,
) -> tuple[list[Image], Image | None, list[Any], Image | None]:
    """The split loss encodes' argument checks, in this order: each of ``images`` (``(value,
    name)`` pairs, the predictions and the labels last), the optional weights, the optional
    gradient state (with ``batch``: one per predicted image) and the optional destination,
    which must not alias those images (nor the weights, with ``alias_weights``). With
    ``batch`` the images are `ImageBatch` es or sequences of images (see `ImageBatch._of`).
    Returns the checked images, the weights, the states (a list) and the destination."""

    def check(value: Any, name: str) -> Image:
        return _batch(kernel, cb, value, name) if batch else kernel._check_image(cb, value, name)

    checked = [check(value, name) for value, name in images]
    wt = None if weights is None else check(weights, "weights")
    states: list[Any] = []
    value, name = state
    if value is not None and batch:
        count = checked[-2]._shape[0]
        states = kernel._check_state_batch(cb, value, name, GradientState, count)
    elif value is not None:
        states = [kernel._check_state(cb, value, name, GradientState)]
    dst = None
    value, name = destination
    if value is not None:
        if batch:
            value = _batch(kernel, cb, value, name, destination=True)
        inputs = (*checked, wt) if alias_weights else checked
        dst = kernel._check_destination(cb, value, name, *inputs)
    return checked, wt, states, dst


class ForwardLoss(_LossProperties, CNNKernel):
    """The loss image of predictions, labels and weights (MPS ``MPSNNForwardLoss``; see the
    module docstring).

    Args:
        device: the kernel's device.
        loss_descriptor: a `LossDescriptor` (copied).
        reduce_across_batch: one loss value for the whole batch (MPS ``reduceAcrossBatch``).

    ``encode(command_buffer, source_image, labels, weights=None, destination_state=None,
    destination_image=None)`` returns the loss image of the (possibly multi-image)
    ``source_image``: ``(N, 1, 1, 1)`` for a reduction, ``(N, C, H, W)`` (``(N, 1, H, W)`` for
    the cross entropies and cosine distance) for NONE; FLOAT64 for FLOAT64 predictions,
    FLOAT32 otherwise. ``encode_batch(command_buffer, source_images, labels, weights=None,
    destination_states=None, destination_images=None)`` takes `ImageBatch` es.
    """

    _gradient_state_class = GradientState
    saved_fields = (
        Field("loss_descriptor", LossDescriptor, attr="_desc"),
        Field("reduce_across_batch", bool),
    )

    def __init__(
        self, device: Device, loss_descriptor: LossDescriptor, *, reduce_across_batch: bool = False
    ) -> None:
        super().__init__(device)
        self._init_loss(loss_descriptor, reduce_across_batch)

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        raise NotImplementedError  # pragma: no cover  (the loss has its own encode)

    def _policy(
        self, source_images: Sequence[Image], source_states: Any
    ) -> tuple[ImageDescriptor, Offset]:
        """The loss image's descriptor (what `destination_image_descriptor` answers)."""
        src = source_images[0]
        n, c, h, w = loss_image_shape(self.loss_type, self.reduction_type, src.shape)
        fmt = src.feature_channel_format
        if fmt is not FeatureChannelFormat.FLOAT64:
            fmt = FeatureChannelFormat.FLOAT32
        return ImageDescriptor(fmt, w, h, c, n), Offset()

    def encode(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_image: Image,
        labels: Image,
        weights: Image | None = None,
        destination_state: State | None = None,
        destination_image: Image | None = None,
    ) -> Image:
        """The loss image (see the class)."""
        cb = command_buffer
        self._check_command_buffer(cb)
        (src, lab), wt, states, dst = _check_arguments(
            self, cb, False, [(source_image, "source_image"), (labels, "labels")], weights,
            (destination_state, "destination_state"), (destination_image, "destination_image"),
            alias_weights=False,
        )  # fmt: skip
        return self._encode_loss(cb, src, lab, wt, states, dst, False)

    def encode_batch(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_images: ImageBatch,
        labels: ImageBatch,
        weights: ImageBatch | None = None,
        destination_states: Sequence[State] | None = None,
        destination_images: ImageBatch | None = None,
    ) -> ImageBatch:
        """Batch form (MPS ``encodeBatchToCommandBuffer:sourceImages:labels:weights:
        destinationStates:destinationImages:``): the loss batch."""
        cb = command_buffer
        self._check_command_buffer(cb)
        mark = cb._mark()
        try:  # sequences of images may record a stacking copy before the checks
            (src, lab), wt, states, dst = _check_arguments(
                self, cb, True, [(source_images, "source_images"), (labels, "labels")], weights,
                (destination_states, "destination_states"),
                (destination_images, "destination_images"), alias_weights=False,
            )  # fmt: skip
            out = self._encode_loss(cb, src, lab, wt, states, dst, True)
        except BaseException:
            cb._rollback(mark)
            raise
        return ImageBatch(out)

    def _encode_loss(
        self,
        cb: CommandBuffer,
        src: Image,
        labels: Image,
        weights: Image | None,
        states: list[Any],
        dst: Image | None,
        batch: bool,
    ) -> Image:
        who = type(self).__name__
        c = src._shape[1]
        _check_whole(who, [self._offset], self._clip, [self._sco, self._dco])
        if self._smax < c:
            raise UnsupportedError(
                f"[{who}] the split loss reads every channel: source_feature_channel_max_count "
                f"must be at least the source's {c}, got {self._smax}"
            )
        self._check_inputs(src, labels, weights, "labels", "weights")
        shape = loss_image_shape(self.loss_type, self.reduction_type, src._shape)
        if dst is not None and dst._shape != shape:
            raise ValueError(
                f"[{who}] the destination must have the loss image's shape {shape}, "
                f"got {dst._shape}"
            )
        params = self._loss_params()
        across = self._across
        fmt = src._fmt if src._fmt is FeatureChannelFormat.FLOAT64 else FeatureChannelFormat.FLOAT32
        out: Any = dst if dst is not None else ImageDescriptor._make(fmt, shape[3], shape[2],
                                                                    shape[1], shape[0])  # fmt: skip
        record = ForwardRecord(
            self, None, self._edge_mode, self._offset, self._clip, src._shape, shape,
            ForwardLossRecord(params, across), batch,
        )  # fmt: skip
        records = [(st, record) for st in _unique(states)]

        def run(loss: Image) -> None:
            t = labels._read()
            wt = None if weights is None else weights._read()
            loss._write_block(forward_loss(src._read(), t, wt, params, across), 0, 0, 0, 0)

        reads = (src, labels) if weights is None else (src, labels, weights)
        enc = Encoding(run, (out,), reads, records, None, batch)
        return self._apply(cb, enc)[0]  # type: ignore[return-value]


class LossGradient(_LossProperties, BinaryKernel):
    """The gradient of a `ForwardLoss` (MPS ``MPSNNLossGradient``; see the module docstring).

    Args:
        device: the kernel's device.
        loss_descriptor: a `LossDescriptor` (copied).
        reduce_across_batch: as the forward's.
        compute_label_gradients: return ``d <g, loss> / d labels`` instead of the gradient with
            respect to the predictions (MPS ``computeLabelGradients``, default False). Defined
            for every loss type but KULLBACK_LEIBLER_DIVERGENCE (``d(t log t)/dt`` is infinite
            at ``t = 0``); the formulas are in `mpsnn.ops.loss_split`.

    ``encode(command_buffer, source_gradient, source_image, labels, weights=None,
    gradient_state=None, destination_image=None)``: ``source_gradient`` has the loss image's
    shape; the result has the predictions' shape and format (the labels' with label
    gradients). ``encode_batch(command_buffer, source_gradients, source_images, labels,
    weights=None, source_states=None, destination_gradients=None)`` takes `ImageBatch` es.
    """

    saved_fields = (
        Field("loss_descriptor", LossDescriptor, attr="_desc"),
        Field("reduce_across_batch", bool),
        Field("compute_label_gradients", bool),
    )

    def __init__(
        self,
        device: Device,
        loss_descriptor: LossDescriptor,
        *,
        reduce_across_batch: bool = False,
        compute_label_gradients: bool = False,
    ) -> None:
        super().__init__(device)
        self._init_loss(loss_descriptor, reduce_across_batch)
        self._labels_grad = False
        self.compute_label_gradients = compute_label_gradients

    @property
    def compute_label_gradients(self) -> bool:
        """Whether the result is the gradient with respect to the labels (default False)."""
        return self._labels_grad

    @compute_label_gradients.setter
    def compute_label_gradients(self, value: bool) -> None:
        who = type(self).__name__
        check_type(who, "compute_label_gradients", value, bool)
        if value and int(self.loss_type) not in LABEL_GRADIENT_TYPES:
            raise ValueError(
                f"[{who}] compute_label_gradients needs a loss type with a label gradient (not "
                f"KULLBACK_LEIBLER_DIVERGENCE: d(t log t)/dt is infinite at t = 0), "
                f"got {self.loss_type.name}"
            )
        self._labels_grad = value

    def encode(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_gradient: Image,
        source_image: Image,
        labels: Image,
        weights: Image | None = None,
        gradient_state: State | None = None,
        destination_image: Image | None = None,
    ) -> Image:
        """The gradient (see the class)."""
        cb = command_buffer
        self._check_command_buffer(cb)
        images = [(source_gradient, "source_gradient"), (source_image, "source_image"),
                  (labels, "labels")]  # fmt: skip
        (g, src, lab), wt, states, dst = _check_arguments(
            self, cb, False, images, weights, (gradient_state, "gradient_state"),
            (destination_image, "destination_image"), alias_weights=True,
        )  # fmt: skip
        return self._encode_gradient(cb, g, src, lab, wt, states, dst, False)

    def encode_batch(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_gradients: ImageBatch,
        source_images: ImageBatch,
        labels: ImageBatch,
        weights: ImageBatch | None = None,
        source_states: Sequence[State] | None = None,
        destination_gradients: ImageBatch | None = None,
    ) -> ImageBatch:
        """Batch form (MPS ``encodeBatchToCommandBuffer:sourceGradients:sourceImages:labels:
        weights:sourceStates:destinationGradients:``)."""
        cb = command_buffer
        self._check_command_buffer(cb)
        mark = cb._mark()
        images = [(source_gradients, "source_gradients"), (source_images, "source_images"),
                  (labels, "labels")]  # fmt: skip
        try:  # sequences of images may record a stacking copy before the checks
            (g, src, lab), wt, states, dst = _check_arguments(
                self, cb, True, images, weights, (source_states, "source_states"),
                (destination_gradients, "destination_gradients"), alias_weights=True,
            )  # fmt: skip
            out = self._encode_gradient(cb, g, src, lab, wt, states, dst, True)
        except BaseException:
            cb._rollback(mark)
            raise
        return ImageBatch(out)

    def _forward_params(self, states: list[Any], src: Image) -> LossParams:
        """The parameters to use: the forward's (from its state) or this kernel's."""
        who = type(self).__name__
        own = self._loss_params()
        unique = _unique(states)
        if not unique:
            return own
        records = [st._require_forward(who) for st in unique]
        for record in records:
            if not isinstance(record.params, ForwardLossRecord):
                raise ValueError(
                    f"[{who}] the gradient state must come from a ForwardLoss encode, got one "
                    f"written by {type(record.kernel).__name__}"
                )
        record = records[0]
        if any(r is not record for r in records[1:]):
            raise ValueError(
                f"[{who}] the gradient states must all come from one ForwardLoss encode, got "
                f"states of {len({id(r) for r in records})} encodes"
            )
        theirs: ForwardLossRecord = record.params
        p = theirs.params
        mine = (own.kind, own.reduction, own.number_of_classes, self._across)
        forward = (p.kind, p.reduction, p.number_of_classes, theirs.reduce_across_batch)
        if mine != forward:
            raise ValueError(
                f"[{who}] loss type, reduction, number_of_classes and reduce_across_batch must "
                f"equal the forward's {_describe(*forward)}, got {_describe(*mine)}"
            )
        if record.source_shape != src._shape:
            raise ValueError(
                f"[{who}] source_image must have the forward's shape {record.source_shape}, "
                f"got {src._shape}"
            )
        return p

    def _encode_gradient(
        self,
        cb: CommandBuffer,
        g: Image,
        src: Image,
        labels: Image,
        weights: Image | None,
        states: list[Any],
        dst: Image | None,
        batch: bool,
    ) -> Image:
        who = type(self).__name__
        _check_whole(
            who,
            [self._primary_offset, self._secondary_offset],
            self._clip,
            [
                self._dco,
                self._primary_source_feature_channel_offset,
                self._secondary_source_feature_channel_offset,
            ],
        )
        self._check_inputs(src, labels, weights, "labels", "weights")
        params = self._forward_params(states, src)
        shape = loss_image_shape(self.loss_type, self.reduction_type, src._shape)
        if g._shape != shape:
            raise ValueError(
                f"[{who}] the incoming gradient must have the loss image's shape {shape}, "
                f"got {g._shape}"
            )
        of_labels = self._labels_grad
        target = labels if of_labels else src
        if dst is not None and dst._shape != target._shape:
            what = "labels'" if of_labels else "predictions'"
            raise ValueError(
                f"[{who}] the destination must have the {what} shape {target._shape}, "
                f"got {dst._shape}"
            )
        n, c, h, w = target._shape
        out: Any = (
            dst
            if dst is not None
            else ImageDescriptor._make(_result_format(target._fmt), w, h, c, n)
        )
        across = self._across
        math_of = label_gradient if of_labels else prediction_gradient

        def run(result: Image) -> None:
            wt = None if weights is None else weights._read()
            y = src._read()
            d = math_of(g._read(), y, labels._read(), wt, params, across)
            result._write_block(d, 0, 0, 0, 0)

        reads: tuple[Any, ...] = (g, src, labels) + (() if weights is None else (weights,))
        enc = Encoding(run, (out,), reads + tuple(_unique(states)), (), None, batch)
        return self._apply(cb, enc)[0]  # type: ignore[return-value]


def _describe(kind: int, reduction: int, classes: int | None, across: bool) -> str:
    return (
        f"({LossType(kind).name}, {ReductionType(reduction).name}, {classes}, "
        f"reduce_across_batch={across})"
    )


class InitialGradient(CNNKernel):
    """The start of backpropagation (MPS ``MPSNNInitialGradient``): an image of ones the size
    of its source (``d x / d x = 1``), in the source's format (FLOAT32 for UNORM8).

    ``encode(command_buffer, source_image, destination_image=None)`` and ``encode_batch``
    follow every unary kernel's geometry (offset, clip rect, channel offsets, images): every
    destination position the encode covers gets 1, whatever the source holds (NaN included);
    the source is read for its size only.
    """

    saved_fields = ()

    def __init__(self, device: Device) -> None:
        super().__init__(device)

    def _make_forward(self, window: Window, records: Records, memo: dict[str, Any]) -> Forward:
        shape = (window.dst_channels, window.y.count, window.x.count)
        return lambda x: x.new_ones((x.shape[0], *shape))
