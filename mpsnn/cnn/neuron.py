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

from collections.abc import Sequence
from typing import Any

import torch

from mpsnn.cnn._pointwise import Pointwise, PointwiseBackward, PointwiseGradient, PointwiseKernel
from mpsnn.cnn.neuron_descriptor import NeuronDescriptor, NeuronType
from mpsnn.core.descriptor import ImageDescriptor
from mpsnn.core.device import CommandBuffer, Device
from mpsnn.core.geometry import Window
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.state import ForwardRecord, GradientState
from mpsnn.ops.neuron import neuron_derivative, neuron_forward

__all__ = ["Neuron", "NeuronGradient", "apply_neuron", "neuron_slope"]

# Types whose formula loses precision in float16/bfloat16 arithmetic: computed in float32.
_TRANSCENDENTAL = {
    NeuronType.SIGMOID, NeuronType.TANH, NeuronType.SOFT_PLUS, NeuronType.SOFT_SIGN,
    NeuronType.ELU, NeuronType.POWER, NeuronType.EXPONENTIAL, NeuronType.LOGARITHM,
    NeuronType.GELU,
}  # fmt: skip


def _upcast(desc: NeuronDescriptor, x: torch.Tensor) -> torch.Tensor:
    if desc.neuron_type in _TRANSCENDENTAL and x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    return x


def apply_neuron(desc: NeuronDescriptor, x: torch.Tensor) -> torch.Tensor:
    """``f(x)`` in ``x``'s dtype (transcendental types computed in float32)."""
    y = neuron_forward(int(desc.neuron_type), _upcast(desc, x), desc.a, desc.b, desc.c, desc.data)
    return y.to(x.dtype)


def neuron_slope(desc: NeuronDescriptor, x: torch.Tensor) -> torch.Tensor:
    """``f'(x)`` in ``x``'s dtype (transcendental types computed in float32)."""
    kind, xc = int(desc.neuron_type), _upcast(desc, x)
    return neuron_derivative(kind, xc, desc.a, desc.b, desc.c, desc.data).to(x.dtype)


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

    def __init__(self, device: Device, neuron_descriptor: NeuronDescriptor) -> None:
        super().__init__(device)
        self._descriptor = _check_descriptor("Neuron", neuron_descriptor)

    def _destination_channels(self, source_channels: int) -> int:
        _check_prelu("Neuron", self._descriptor, source_channels)
        return source_channels

    def _pointwise(self, window: Window, states: list[Any]) -> Pointwise:
        desc = self._descriptor
        return lambda x: apply_neuron(desc, x)


def _check_prelu(who: str, desc: NeuronDescriptor, channels: int) -> None:
    if desc.data is not None and desc.data.numel() != channels:
        raise ValueError(
            f"[{who}] PRELU needs one slope per channel read ({channels}), "
            f"got {desc.data.numel()} slopes"
        )


class NeuronGradient(_NeuronProperties, PointwiseGradient):
    """``dx = g * f'(x)`` (MPS ``MPSCNNNeuronGradient``); ``x`` is the forward source.

    Args:
        device: the kernel's device.
        neuron_descriptor: must equal the forward neuron's.

    With the `ConvolutionGradientState` of a convolution that fused this neuron, ``encode``
    differentiates the fused neuron: ``source_gradient`` and ``source_image`` are shaped like the
    convolution's destination (``source_image`` is its result, checked for shape only), and the
    result dL/d(pre-activation) has that shape too, ready for `ConvolutionGradient`. The state's
    read count drops here and again in the convolution gradient.
    """

    _state_class = GradientState
    _forward_class = Neuron
    _forward_exact = False

    def __init__(self, device: Device, neuron_descriptor: NeuronDescriptor) -> None:
        super().__init__(device)
        self._descriptor = _check_descriptor("NeuronGradient", neuron_descriptor)

    def _check_forward(self, record: ForwardRecord) -> None:
        fwd = record.kernel
        if fwd._descriptor != self._descriptor:
            raise ValueError(
                "[NeuronGradient] neuron_descriptor must equal the forward neuron's "
                f"({fwd._descriptor!r}), got {self._descriptor!r}"
            )

    def _pointwise_backward(self, record: ForwardRecord, states: list[Any]) -> PointwiseBackward:
        desc = self._descriptor
        return lambda g, x: g * neuron_slope(desc, x)

    def encode(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_gradient: Image,
        source_image: Image,
        gradient_state: GradientState,
        destination_gradient: Image | None = None,
    ) -> Image | None:
        """Like `GradientKernel.encode`; see the class for the fused-convolution form."""
        args = (command_buffer, source_gradient, source_image, gradient_state, destination_gradient)
        if getattr(gradient_state, "_fused_neuron_state", False):
            return self._encode_fused(*args)
        return super().encode(*args)

    def encode_batch(  # type: ignore[override]
        self,
        command_buffer: CommandBuffer,
        source_gradients: ImageBatch,
        source_images: ImageBatch,
        gradient_states: Sequence[GradientState],
        destination_gradients: ImageBatch | None = None,
    ) -> ImageBatch | None:
        """Like `GradientKernel.encode_batch`; see the class for the fused-convolution form."""
        state = gradient_states[0] if len(gradient_states) else None
        if getattr(state, "_fused_neuron_state", False):
            cb = command_buffer
            g = self._check_batch(cb, source_gradients, "source_gradients")
            x = self._check_batch(cb, source_images, "source_images")
            self._check_state_batch(
                cb,
                gradient_states,
                "gradient_states",
                GradientState,
                len(source_gradients),
                shared=True,  # a convolution's state serves its whole batch
            )
            d = None
            if destination_gradients is not None:
                d = self._check_batch(cb, destination_gradients, "destination_gradients")
            out = self._encode_fused(cb, g, x, state, d)
            return destination_gradients if destination_gradients is not None else ImageBatch(out)
        return super().encode_batch(
            command_buffer, source_gradients, source_images, gradient_states, destination_gradients
        )

    def _encode_fused(
        self,
        cb: CommandBuffer,
        grad: Image,
        result: Image,
        state: Any,
        dst: Image | None,
    ) -> Image:
        who = "NeuronGradient"
        self._check_command_buffer(cb)
        self._check_image(cb, grad, "source_gradient")
        self._check_image(cb, result, "source_image")
        self._check_state(cb, state, "gradient_state", GradientState)
        record = state._require_forward(who)
        fused = record.kernel.fused_neuron_descriptor
        if fused is None or fused.neuron_type is NeuronType.NONE:
            raise ValueError(
                f"[{who}] a convolution gradient state needs a convolution with a fused neuron, "
                "got one without"
            )
        if fused != self._descriptor:
            raise ValueError(
                f"[{who}] neuron_descriptor must equal the convolution's fused neuron "
                f"({fused!r}), got {self._descriptor!r}"
            )
        shape = record.destination_shape
        for image, name in ((grad, "source_gradient"), (result, "source_image")):
            if image._shape[1:] != shape[1:]:
                raise ValueError(
                    f"[{who}] {name} must have the convolution destination's shape "
                    f"{shape[3]}x{shape[2]}x{shape[1]}, got "
                    f"{image.width}x{image.height}x{image.feature_channels}"
                )
        if dst is not None:
            self._check_image(cb, dst, "destination_gradient")
            if dst._shape[1:] != shape[1:]:
                raise ValueError(
                    f"[{who}] destination_gradient must have the convolution destination's shape, "
                    f"got {dst.width}x{dst.height}x{dst.feature_channels}"
                )
        # -- validation is over --
        w = record.window
        n = shape[0]
        desc_out = ImageDescriptor._make(grad._fmt, shape[3], shape[2], shape[1], n)
        out = dst if dst is not None else self._allocator.image(cb, desc_out, self)
        desc = self._descriptor

        region = (
            slice(w.dst_image, w.dst_image + w.images),
            slice(w.dst_channel, w.dst_channel + w.dst_channels),
            slice(w.dst_y, w.dst_y + w.y.count),
            slice(w.dst_x, w.dst_x + w.x.count),
        )

        def run() -> None:
            dz = grad._data()[region] * neuron_slope(desc, state._preactivation)
            if dz.shape != out._shape:  # outside what the convolution wrote: no gradient
                full = dz.new_zeros(out._shape)
                full[region] = dz
                dz = full
            out._write_block(dz, 0, 0, 0, 0)

        cb.record(who, run)
        out._note_writer(cb)
        grad._root()._consume_read(cb, who)
        result._root()._consume_read(cb, who)
        state._consume_read(cb, who)
        return out
