"""`ConvolutionGradientState` and `ConvolutionTransposeGradientState`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpsnn.cnn.convolution.descriptor import ConvolutionDescriptor
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.device import Device
from mpsnn.core.state import AccumulatorState

__all__ = ["ConvolutionGradientState", "ConvolutionTransposeGradientState"]


class ConvolutionGradientState(AccumulatorState):
    """Weight and bias gradients of one batch (MPS ``MPSCNNConvolutionGradientState``).

    Written by: the forward `Convolution` / `FullyConnected` encode (its `ConvolutionRecord`,
    and the fused neuron's input when it has one and a `NeuronGradient` needs it) and the
    gradient kernel
    (``gradient_for_weights`` and ``gradient_for_biases``, **summed** over every image and
    every gradient encode that ran with this state; never averaged). Read by: weight updates
    (data source ``update`` / ``update_on_cpu``, optimizers, reloads), `NeuronGradient` (a
    fused neuron), and `ConvolutionTranspose` to size its result (MPS
    ``MPSImageSizeEncodingState``).

    Sums are float32 (float64 when the images are float64, for verification), accumulated as
    the work runs (see `AccumulatorState`); `reset` clears them. A sum read before any
    gradient ran is the tensor later gradients add into, except where float64 images meet
    float32 master weights: there the first float64 gradient replaces it (read it after the
    work ran).
    """

    def __init__(
        self,
        device: Device,
        convolution: Any,
        *,
        command_buffer: CommandBuffer | None = None,
        label: str | None = None,
    ) -> None:
        super().__init__(device, command_buffer=command_buffer, label=label)
        self._convolution = convolution
        # mpsnn's kernels: their own descriptor, read in place (the public property copies it,
        # at every training step of every layer)
        desc = getattr(convolution, "_descriptor", None)
        if not isinstance(desc, ConvolutionDescriptor):
            desc = convolution.descriptor
        o, kh, kw, ig = desc.weights_shape
        self._oihw = (o, ig, kh, kw)
        self._preactivation: torch.Tensor | None = None  # fused neuron input (run time)
        # or, for a plain ReLU on the CPU, its slope instead (`mpsnn.ops.neuron.relu_in_place`)
        self._relu_mask: torch.Tensor | None = None
        # a graph's layer without biases: no bias sums computed or stored (`_sum`)
        self._bias_sums_skipped = False

    @property
    def convolution(self) -> Any:
        """The kernel that made this state."""
        return self._convolution

    @property
    def gradient_for_weights(self) -> torch.Tensor:
        """dL/dW in the OHWI layout ``[O][kH][kW][I / groups]`` (a view of the sum; zeros
        before any gradient ran, which later gradients add into)."""
        self._check_live(None)
        return self._sum(0).permute(0, 2, 3, 1)

    @property
    def gradient_for_biases(self) -> torch.Tensor:
        """dL/db, ``(O,)`` (zeros before any gradient ran, which later gradients add into).

        Raises:
            ValueError: the layer has no biases and the training graph that made this state
                skipped their sums (its update never reads them).
        """
        self._check_live(None)
        if self._bias_sums_skipped:
            raise ValueError(
                "[ConvolutionGradientState] gradient_for_biases must have been computed, got "
                "a state of a layer without biases whose training graph skipped the bias sums"
            )
        return self._sum(1)

    def _zeros(self) -> list[torch.Tensor]:
        # float64 for float64 master weights (verification runs), so that a sum read before
        # the gradient ran is the tensor the gradient adds into (not replaced when widened)
        weights = getattr(getattr(self._convolution, "_weights", None), "weight", None)
        dtype = torch.float64 if getattr(weights, "dtype", None) == torch.float64 else None
        dev = self._device.torch_device
        zeros = [torch.zeros(self._oihw, device=dev, dtype=dtype)]
        if not self._bias_sums_skipped:
            zeros.append(torch.zeros(self._oihw[0], device=dev, dtype=dtype))
        return zeros

    def _accumulate(
        self,
        cb: CommandBuffer,
        values: Sequence[torch.Tensor],
        merge: Callable[[list[torch.Tensor], Sequence[torch.Tensor]], None] | None = None,
        *,
        fresh: bool = True,
        slot: int = 0,
    ) -> None:
        """`AccumulatorState._accumulate`, where the sums and the values may differ in length
        by the bias sums: zeros made before an encode skipped them (a sum read early), or bias
        sums that begin (a layer given biases since the state was written) add zeros for what
        the other side lacks."""
        sums = self._slots.get(slot)
        if sums is not None and len(values) != len(sums):
            if len(values) < len(sums):
                values = (*values, *(torch.zeros_like(s) for s in sums[len(values) :]))
            else:
                sums.extend(torch.zeros_like(v, dtype=sums[0].dtype) for v in values[len(sums) :])
        super()._accumulate(cb, values, merge, fresh=fresh, slot=slot)

    def _sum(self, index: int, slot: int = 0) -> torch.Tensor:
        """Sum ``index`` (0: weights, 1: biases). A layer whose training graph skipped the bias
        sums stores the weights' alone; a reader of its bias sums after all (a data source
        given biases since the gradient was encoded) gets zeros, the sums of no bias."""
        sums = self._slots.get(slot)
        if index == 1 and self._bias_sums_skipped and (sums is None or len(sums) == 1):
            w = super()._sum(0, slot)
            return w.new_zeros(w.shape[0])
        return super()._sum(index, slot)

    @property
    def gradient_for_weights_layout(self) -> str:
        return "OHWI"

    def resources(self) -> list[torch.Tensor]:
        kept = (self._preactivation, self._relu_mask)
        return super().resources() + [t for t in kept if t is not None]

    def _free_storage(self) -> None:
        super()._free_storage()
        self._preactivation = self._relu_mask = None

    def destination_image_descriptor(
        self, source_images: Any, source_states: Any, kernel: Any, suggested_descriptor: Any
    ) -> Any:
        """Size a paired `ConvolutionTranspose` to undo this convolution exactly."""
        pair = getattr(kernel, "_pair_with_convolution", None)
        if pair is None:
            return suggested_descriptor
        return pair(self._require_forward(type(kernel).__name__), suggested_descriptor)


class ConvolutionTransposeGradientState(ConvolutionGradientState):
    """Weight and bias gradients of a `ConvolutionTranspose` (MPS
    ``MPSCNNConvolutionTransposeGradientState``), laid out as for a convolution."""

    @property
    def convolution_transpose(self) -> Any:
        return self._convolution
