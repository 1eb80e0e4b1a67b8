"""`ConvolutionGradientState` and `ConvolutionTransposeGradientState`."""

from __future__ import annotations

from typing import Any

import torch

from mpsnn.core.descriptor import ImageDescriptor
from mpsnn.core.device import CommandBuffer, Device
from mpsnn.core.geometry import Offset
from mpsnn.core.state import GradientState
from mpsnn.ops._dtypes import acc_dtype

__all__ = ["ConvolutionGradientState", "ConvolutionTransposeGradientState"]


class ConvolutionGradientState(GradientState):
    """Weight and bias gradients of one batch (MPS ``MPSCNNConvolutionGradientState``).

    Written by: the forward `Convolution` / `FullyConnected` encode (geometry, weights used) and
    the gradient kernel (``gradient_for_weights`` and ``gradient_for_biases``, **summed** over
    every image and every gradient encode that receives this state; never averaged).
    Read by: weight updates (data source ``update`` / ``update_on_cpu``, reloads), and by
    `ConvolutionTranspose` to size its result (MPS ``MPSImageSizeEncodingState``).

    Accumulators are float32 (float64 when the images are float64, for verification).
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
        # Allocated by the first gradient write (which stores its result as it is: no zero
        # fill, no extra add), or as zeros when read before any write.
        self._grad_w: torch.Tensor | None = None
        self._grad_b: torch.Tensor | None = None
        self._writers = 0  # gradient encodes recorded so far (encode time)
        self._preactivation: torch.Tensor | None = None  # fused neuron input, kept for training

    @property
    def _fused_neuron_state(self) -> bool:
        """True when the forward fused a neuron: `NeuronGradient` then reads this state."""
        fwd = self._forward
        return fwd is not None and getattr(fwd.kernel, "_neuron", None) is not None

    @property
    def convolution(self) -> Any:
        """The kernel that made this state."""
        return self._convolution

    @property
    def gradient_for_weights(self) -> torch.Tensor:
        """dL/dW in the OHWI layout ``[O][kH][kW][I / groups]`` (a view of the accumulator)."""
        self._check_live(None)
        if self._grad_w is None:
            o, kh, kw, ig = self._convolution._descriptor.weights_shape
            self._grad_w = torch.zeros((o, ig, kh, kw), device=self._device.torch_device)
        return self._grad_w.permute(0, 2, 3, 1)

    @property
    def gradient_for_biases(self) -> torch.Tensor:
        """dL/db, ``(O,)``."""
        self._check_live(None)
        if self._grad_b is None:
            o = self._convolution._descriptor.output_feature_channels
            self._grad_b = torch.zeros((o,), device=self._device.torch_device)
        return self._grad_b

    @property
    def gradient_for_weights_layout(self) -> str:
        return "OHWI"

    def resources(self) -> list[torch.Tensor]:
        return [t for t in (self._grad_w, self._grad_b, self._preactivation) if t is not None]

    def _free_storage(self) -> None:
        self._grad_w = None
        self._grad_b = None
        self._preactivation = None

    def _claim_write(self) -> bool:
        """Called by a gradient encode (encode time): True for the first writer."""
        self._writers += 1
        return self._writers == 1

    def _accumulate(self, dw: torch.Tensor | None, db: torch.Tensor | None, first: bool) -> None:
        """Add a gradient encode's contribution (execution time; dw/db are fresh tensors)."""
        acc_w, acc_b = self._grad_w, self._grad_b
        if (
            dw is not None and db is not None and acc_w is not None and acc_b is not None
            and acc_w.dtype == acc_dtype(dw.dtype) and acc_b.dtype == db.dtype
        ):  # fmt: skip
            torch._foreach_add_([acc_w, acc_b], [dw, db])  # one launch for both on CUDA
            return
        if dw is not None:
            self._grad_w = _sum_into(acc_w, dw, first)
        if db is not None:
            self._grad_b = _sum_into(acc_b, db, first)

    def destination_image_descriptor(
        self, source_images: Any, source_states: Any, kernel: Any, suggested_descriptor: Any
    ) -> Any:
        """Size a paired `ConvolutionTranspose` to undo this convolution exactly.

        The transpose gets the convolution's source size and the kernel offset that makes it
        the adjoint of the convolution's data map (inventory §2.4):
        ``T = s * dst_x - start - E + 1 + E // 2`` per axis, with ``start`` the first tap of the
        convolution's first output and ``dst_x`` where that output was written.
        """
        from mpsnn.cnn.convolution.kernels import ConvolutionTranspose

        if not isinstance(kernel, ConvolutionTranspose):
            return suggested_descriptor
        record = self._require_forward("ConvolutionTranspose")
        fw = record.window
        who = "ConvolutionTranspose"
        for axis, a, k, s, d in (
            ("x", fw.x, kernel.kernel_width, kernel.stride_in_pixels_x, kernel.dilation_rate_x),
            ("y", fw.y, kernel.kernel_height, kernel.stride_in_pixels_y, kernel.dilation_rate_y),
        ):
            if (a.kernel, a.stride, a.dilation) != (k, s, d):
                raise ValueError(
                    f"[{who}] a transpose paired with a convolution state must use the "
                    f"convolution's kernel, stride and dilation along {axis} "
                    f"({a.kernel}, {a.stride}, {a.dilation}), got ({k}, {s}, {d})"
                )

        def t(a: Any, dst: int) -> int:
            e = a.extent
            return a.stride * dst - a.start - e + 1 + e // 2

        kernel._offset = Offset(0, 0, kernel._offset.z)
        kernel._kernel_offset_x = t(fw.x, fw.dst_x)
        kernel._kernel_offset_y = t(fw.y, fw.dst_y)
        _, _, h, w = record.source_shape
        desc: ImageDescriptor = suggested_descriptor.copy()
        desc.width, desc.height = w, h
        return desc


def _sum_into(acc: torch.Tensor | None, value: torch.Tensor, first: bool) -> torch.Tensor:
    """Accumulate in float32 (float64 for float64 values); ``value`` may be low precision."""
    want = acc_dtype(value.dtype)
    if acc is None and first:
        return value.to(want)  # the first write is the sum so far (no copy when float32)
    if acc is None:
        raise RuntimeError("[ConvolutionGradientState] internal error: accumulator missing")
    if want == torch.float64 and acc.dtype != torch.float64:
        acc = acc.double()  # float64 verification runs accumulate in float64
    return acc.add_(value)  # one kernel: add_ promotes a bfloat16/float16 value itself


class ConvolutionTransposeGradientState(ConvolutionGradientState):
    """Weight and bias gradients of a `ConvolutionTranspose` (MPS
    ``MPSCNNConvolutionTransposeGradientState``), laid out as for a convolution."""

    @property
    def convolution_transpose(self) -> Any:
        return self._convolution
