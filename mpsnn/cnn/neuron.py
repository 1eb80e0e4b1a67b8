"""The neuron family: `Neuron` and `NeuronGradient` (MPS ``MPSCNNNeuron``,
``MPSCNNNeuronGradient``).

``y = f(x)`` elementwise, ``dx = g * f'(x)`` with ``x`` the forward *source* (secondary image);
formulas, kink conventions and domains in `mpsnn.ops.neuron`. The window model applies with a
1x1 window (offset, clip rect, edge mode, channel ranges), see `mpsnn.cnn._pointwise`.

A convolution with a fused neuron (``ConvolutionDescriptor.fused_neuron_descriptor``) applies it
after the bias. For training, MPS prescribes the neuron gradient as a separate step before the
convolution gradient: `NeuronGradient.encode` accepts the convolution's gradient state (the
convolution keeps its pre-activation there when it runs with a state) and returns dL/d(pre-
activation), shaped like the convolution's destination, for `ConvolutionGradient`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from mpsnn.cnn._pointwise import (
    Pointwise,
    PointwiseBackward,
    PointwiseGradient,
    PointwiseKernel,
    PointwiseRecord,
)
from mpsnn.cnn.neuron_descriptor import FusedNeuron, NeuronDescriptor, NeuronType
from mpsnn.core.cnn_kernel import Records
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.descriptor import ImageDescriptor, _result_format
from mpsnn.core.device import Device
from mpsnn.core.encode import Encoding
from mpsnn.core.geometry import Window
from mpsnn.core.image import Image
from mpsnn.core.registry import gradient_of
from mpsnn.core.saved import Field
from mpsnn.core.state import ForwardRecord, GradientState, _unique
from mpsnn.ops.neuron import (
    activation,
    activation_backward,
    relu_backward_of_result,
    relu_mask_backward,
)

__all__ = [
    "Neuron",
    "NeuronGradient",
]


@dataclass(frozen=True, slots=True, eq=False)
class NeuronRecord(PointwiseRecord):
    """What a neuron encode hands its gradient: how it read the source, and the neuron."""

    descriptor: NeuronDescriptor


def _check_descriptor(who: str, desc: Any) -> NeuronDescriptor:
    if not isinstance(desc, NeuronDescriptor):
        raise TypeError(
            f"[{who}] neuron_descriptor must be a NeuronDescriptor, got {type(desc).__name__}"
        )
    return desc


class _NeuronProperties:
    _descriptor: NeuronDescriptor

    @property
    def neuron_descriptor(self) -> NeuronDescriptor:
        return self._descriptor

    @property
    def neuron_type(self) -> NeuronType:
        return self._descriptor.neuron_type

    @property
    def a(self) -> float:
        return self._descriptor.a

    @property
    def b(self) -> float:
        return self._descriptor.b

    @property
    def c(self) -> float:
        return self._descriptor.c

    @property
    def data(self) -> torch.Tensor | None:
        return self._descriptor.data


class Neuron(_NeuronProperties, PointwiseKernel):
    """``y = f(x)`` for a `NeuronDescriptor` (MPS ``MPSCNNNeuron``).

    Args:
        device: the kernel's device.
        neuron_descriptor: type and parameters.

    Raises:
        ValueError (at encode): PRELU slopes whose count is not the number of channels read.
    """

    _gradient_state_class = GradientState
    saved_fields = (Field("neuron_descriptor", NeuronDescriptor),)

    def __init__(self, device: Device, neuron_descriptor: NeuronDescriptor) -> None:
        super().__init__(device)
        self._descriptor = _check_descriptor("Neuron", neuron_descriptor)

    def _destination_channels(self, source_channels: int) -> int:
        _check_prelu("Neuron", self._descriptor, source_channels)
        return source_channels

    def _record_params(self, window: Window, memo: dict[str, Any]) -> NeuronRecord:
        return NeuronRecord(self._extract_plan(window, memo), self._descriptor)

    def _pointwise(self, window: Window, records: Records) -> Pointwise:
        params = self._descriptor.params
        return lambda x: activation(params, x)


def _check_prelu(who: str, desc: NeuronDescriptor, channels: int) -> None:
    if desc.data is not None and desc.data.numel() != channels:
        raise ValueError(
            f"[{who}] PRELU needs one slope per channel read ({channels}), "
            f"got {desc.data.numel()} slopes"
        )


@gradient_of(Neuron)
class NeuronGradient(_NeuronProperties, PointwiseGradient):
    """``dx = g * f'(x)`` (MPS ``MPSCNNNeuronGradient``); ``x`` is the forward source.

    Args:
        device: the kernel's device.
        neuron_descriptor: must equal the forward neuron's.

    Given the state of a kernel that fused a neuron (a convolution with a
    ``fused_neuron_descriptor``: its record carries a `FusedNeuron` and the state keeps the
    neuron's input), the encode differentiates that fused neuron: ``source_gradient`` and
    ``source_image`` are shaped like the convolution's destination (``source_image`` is its
    result, checked for shape only), and the result dL/d(pre-activation) has that shape too,
    ready for `ConvolutionGradient`. The state's read count drops here and again in the
    convolution gradient, as MPS prescribes for the two steps.
    """

    _state_class = GradientState

    def __init__(self, device: Device, neuron_descriptor: NeuronDescriptor) -> None:
        super().__init__(device)
        self._descriptor = _check_descriptor("NeuronGradient", neuron_descriptor)

    def _check_forward_kernel(self, record: ForwardRecord) -> None:
        if _fused(record) is None:
            super()._check_forward_kernel(record)

    def _check_forward(self, record: ForwardRecord) -> None:
        fused = _fused(record)
        if fused is not None:
            want, what = fused.descriptor, "the convolution's fused neuron"
        elif isinstance(record.params, NeuronRecord):
            want, what = record.params.descriptor, "the forward neuron's"
        else:
            raise ValueError(
                "[NeuronGradient] a convolution gradient state needs a convolution with a "
                "fused neuron, got one without"
            )
        if want != self._descriptor:
            raise ValueError(
                f"[NeuronGradient] neuron_descriptor must equal {what} ({want!r}), "
                f"got {self._descriptor!r}"
            )

    def _pointwise_backward(self, record: ForwardRecord, states: list[Any]) -> PointwiseBackward:
        params = self._descriptor.params
        return lambda g, x: activation_backward(params, g, x)

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
        fused = _fused(record)
        if fused is None:
            return super()._plan_gradient(cb, grad, src, record, states, dst, batch)
        return self._plan_fused(grad, src, record, fused, states, dst)

    def _plan_fused(
        self,
        grad: Image,
        result: Image,
        record: ForwardRecord,
        fused: FusedNeuron,
        states: list[Any],
        dst: Image | None,
    ) -> Encoding:
        """dL/d(pre-activation) of a kernel's fused neuron, shaped like that kernel's result;
        zero outside the region the forward wrote."""
        who = "NeuronGradient"
        shape = _check_fused(states, record, ((grad, "source_gradient"), (result, "source_image")))
        if dst is not None and dst._shape[1:] != shape[1:]:
            raise ValueError(
                f"[{who}] destination_gradient must have the convolution destination's shape, "
                f"got {dst.width}x{dst.height}x{dst.feature_channels}"
            )
        w = record.window
        out = dst if dst is not None else ImageDescriptor._make(
            _result_format(grad._fmt), shape[3], shape[2], shape[1], grad.number_of_images
        )  # fmt: skip
        region, whole = _region(w, grad._shape)
        backward = self._fused_backward(fused, states[0], result, region, whole)

        def run(out: Image) -> None:
            g = grad._read()
            dz = backward(g if whole else g[region])
            if dz.shape != out._shape:  # outside what the forward wrote: no gradient
                full = dz.new_zeros(out._shape)
                full[region] = dz
                dz = full
            out._write_block(dz, 0, 0, 0, 0, grad._data())

        return Encoding(run, (out,), (grad, result, states[0]))

    def _fused_backward(
        self,
        fused: FusedNeuron,
        state: Any,
        result: Image,
        region: tuple,
        whole: bool,
        consume: bool = False,
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """``g -> g f'(z)`` of a fused neuron, from the pre-activation ``z`` the forward kept
        in its state, or from the slope a plain ReLU kept there instead (the same bits:
        `relu_mask_backward`); ``result`` is the forward's destination. ``consume``: nothing
        reads the slope after this gradient (a graph's step), so the product is written into
        it (no new tensor: on the CPU a fresh one costs its pages' first-touch faults)."""

        def backward(g: torch.Tensor) -> torch.Tensor:
            mask = getattr(state, "_relu_mask", None)
            if mask is not None:
                if consume and mask.dtype is g.dtype and mask.shape == g.shape:
                    state._relu_mask = None  # consumed: it holds the product now
                    return mask.mul_(g)  # m g, as relu_mask_backward computes it
                return relu_mask_backward(g, mask)
            return fused.backward(g, state._preactivation)

        return backward

    def _incoming_transform(
        self, states: list[Any], result: Image
    ) -> tuple[Callable[[torch.Tensor], torch.Tensor], Image]:
        """This gradient as a step of the convolution gradient after it (a graph fuses the
        two when nothing else reads this gradient's result): ``g -> g f'`` on the region the
        convolution wrote, which is the block of the incoming gradient the convolution
        gradient reads, and the image that function reads at run time. Checked as an encode
        of this kernel would be; the convolution gradient records it
        (``GradientKernel._incoming_gradient``). The values are this kernel's: the same
        function on the same elements (a mask product, exact in any dtype)."""
        record = states[0]._require_forward("NeuronGradient")
        _check_fused(states, record, ((result, "source_image"),))  # one state, the shape
        self._check_forward(record)  # the state's kernel fused this very neuron
        fused = _fused(record)
        region, whole = _region(record.window, result._shape)
        # in a graph's step nothing else reads the slope the forward kept: consumed in place
        backward = self._fused_backward(fused, states[0], result, region, whole, consume=True)
        return backward, result


class ReLUGradientOfResult(NeuronGradient):
    """The plain ReLU's gradient (``a = +0.0``) from the forward *result* ``y`` instead of its
    source: ``dx = g`` where ``y > 0``, else 0 (`relu_backward_of_result`; it equals
    `NeuronGradient` except at ``x = 0``, where it gives 0, PyTorch's choice, and MPS's rule 1;
    and at a NaN ``x``, where ``g`` passes on).
    Internal: the graph uses
    it for a ReLU that is not fused into the filter before it, so that the ReLU's input need
    not be kept for the backward (the result is kept anyway, for the next layer's gradient).
    ``source_image`` is the forward's destination."""

    _secondary_is_result = True

    def __init__(self, device: Device, neuron_descriptor: NeuronDescriptor) -> None:
        super().__init__(device, neuron_descriptor)
        p = self._descriptor
        if p.neuron_type is not NeuronType.RELU or p.a != 0.0 or math.copysign(1.0, p.a) < 0:
            raise ValueError(
                f"[ReLUGradientOfResult] the neuron must be a ReLU with a = +0.0, got {p!r}"
            )

    def _pointwise_backward(self, record: ForwardRecord, states: list[Any]) -> PointwiseBackward:
        return relu_backward_of_result

    def _fused_backward(
        self,
        fused: FusedNeuron,
        state: Any,
        result: Image,
        region: tuple,
        whole: bool,
        consume: bool = False,
    ) -> Callable[[torch.Tensor], torch.Tensor]:
        """A ReLU fused into a convolution: from the convolution's *result* (the region the
        forward wrote), so the forward need not keep its pre-activation (a graph turns that
        off: `_keep_preactivation`). It reads no slope: ``consume`` changes nothing."""

        def backward(g: torch.Tensor) -> torch.Tensor:
            y = result._read()
            return relu_backward_of_result(g, y if whole else y[region])

        return backward


def _check_fused(states: list[Any], record: ForwardRecord, images: tuple) -> tuple[int, ...]:
    """Raise unless ``states`` repeat one state and each ``(image, name)`` has the shape of the
    convolution's destination (``record``); returns that shape."""
    who = "NeuronGradient"
    if len(_unique(states)) != 1:
        raise ValueError(
            f"[{who}] gradient_states must repeat one state (see result_state_batch), "
            f"got {len(_unique(states))} distinct states"
        )
    shape = record.destination_shape
    for image, name in images:
        if image._shape[1:] != shape[1:]:
            raise ValueError(
                f"[{who}] {name} must have the convolution destination's shape "
                f"{shape[3]}x{shape[2]}x{shape[1]}, got "
                f"{image.width}x{image.height}x{image.feature_channels}"
            )
    return shape


def _region(w: Any, shape: tuple[int, ...]) -> tuple[tuple[slice, ...], bool]:
    """The block of an image of ``shape`` the forward window ``w`` wrote, and whether that
    is the whole image (then no view is made of it, at every step)."""
    region = (
        slice(w.dst_image, w.dst_image + w.images),
        slice(w.dst_channel, w.dst_channel + w.dst_channels),
        slice(w.dst_y, w.dst_y + w.y.count),
        slice(w.dst_x, w.dst_x + w.x.count),
    )
    start = (w.dst_image, w.dst_channel, w.dst_y, w.dst_x)
    whole = start == (0, 0, 0, 0) and (w.images, w.dst_channels, w.y.count, w.x.count) == shape
    return region, whole


def _fused(record: ForwardRecord) -> FusedNeuron | None:
    """The fused neuron of the kernel that wrote ``record`` (None for none)."""
    return getattr(record.params, "neuron", None)
