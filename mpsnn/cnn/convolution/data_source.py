"""Convolution data sources, weight states, and the master weights kernels encode with.

Weights cross the data-source boundary in the MPS OHWI layout, float32 (float64 is kept as
float64, for verification). Each kernel keeps OIHW master tensors (`ConvWeights`) on its
device and updates them in place.
"""

from __future__ import annotations

import abc
from typing import Any

import numpy as np
import torch

from mpsnn.cnn.convolution.descriptor import ConvolutionDescriptor
from mpsnn.core.device import CommandBuffer, Device
from mpsnn.core.state import State
from mpsnn.errors import UnsupportedError
from mpsnn.ops._dtypes import widen

__all__ = [
    "ConvolutionDataSource",
    "ConvolutionWeightsAndBiasesState",
    "TensorConvolutionDataSource",
    "ConvWeights",
]


def _as_float_tensor(who: str, name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        t = value.detach()
    else:
        try:
            t = torch.as_tensor(np.asarray(value))
        except Exception as exc:
            raise TypeError(
                f"[{who}] {name} must be a tensor or an array, got {type(value).__name__}"
            ) from exc
    if not t.is_floating_point():
        raise TypeError(f"[{who}] {name} must hold floating-point values, got {t.dtype}")
    return widen(t)


def check_weights(
    who: str, descriptor: ConvolutionDescriptor, weights: Any, biases: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate OHWI weights and (O,) biases against ``descriptor``; returns float tensors."""
    w = _as_float_tensor(who, "weights", weights)
    want = descriptor.weights_shape
    if tuple(w.shape) != want:
        raise ValueError(
            f"[{who}] weights must have the OHWI shape {want} "
            "(output channels, kernel height, kernel width, input channels / groups), "
            f"got {tuple(w.shape)}"
        )
    b = None
    if biases is not None:
        b = _as_float_tensor(who, "biases", biases)
        if tuple(b.shape) != (want[0],):
            raise ValueError(f"[{who}] biases must have shape ({want[0]},), got {tuple(b.shape)}")
    return w, b


class ConvolutionDataSource(abc.ABC):
    """Where a convolution gets its weights (MPS ``MPSCNNConvolutionDataSource``).

    Required: `descriptor`, `weights` (OHWI float32 array or tensor), `bias_terms` (``(O,)`` or
    None). Optional: `load`/`purge` (balanced around reads), `label`, and the update hooks
    `update` (GPU style: encode an update into the command buffer and return the new
    `ConvolutionWeightsAndBiasesState`, or None) and `update_on_cpu` (after completion; return
    True when the weights changed, and the kernels then reload from the data source).
    """

    @abc.abstractmethod
    def descriptor(self) -> ConvolutionDescriptor: ...

    @abc.abstractmethod
    def weights(self) -> Any: ...

    @abc.abstractmethod
    def bias_terms(self) -> Any | None: ...

    def load(self) -> bool:
        return True

    def purge(self) -> None:
        return None

    @property
    def label(self) -> str | None:
        return None

    def update(
        self, command_buffer: CommandBuffer, gradient_state: Any, source_state: Any
    ) -> ConvolutionWeightsAndBiasesState | None:
        return None

    def update_on_cpu(self, gradient_state: Any, source_state: Any) -> bool:
        return False


class TensorConvolutionDataSource(ConvolutionDataSource):
    """A data source that holds its weights (the common case needs no subclass).

    Args:
        descriptor: the convolution's shape.
        weights: OHWI ``(O, kH, kW, I / groups)`` weights, array or tensor.
        biases: ``(O,)`` biases, or None for no bias.
        optimizer: reserved for the optimizer family (SPEC §8); must be None for now.
        label: a name.

    Raises:
        ValueError: weights or biases of the wrong shape.
    """

    def __init__(
        self,
        descriptor: ConvolutionDescriptor,
        weights: Any,
        biases: Any = None,
        optimizer: Any = None,
        label: str | None = None,
    ) -> None:
        who = "TensorConvolutionDataSource"
        if not isinstance(descriptor, ConvolutionDescriptor):
            raise TypeError(
                f"[{who}] descriptor must be a ConvolutionDescriptor, "
                f"got {type(descriptor).__name__}"
            )
        descriptor.validate(who)
        if optimizer is not None:
            raise UnsupportedError(
                f"[{who}] optimizers arrive with the optimizer family (SPEC §8); optimizer must "
                f"be None for now, got {type(optimizer).__name__}"
            )
        self._descriptor = descriptor.copy()
        self._weights, self._biases = check_weights(who, self._descriptor, weights, biases)
        self._label = label

    def descriptor(self) -> ConvolutionDescriptor:
        return self._descriptor

    def weights(self) -> torch.Tensor:
        """The OHWI weights (the held tensor, not a copy)."""
        return self._weights

    def bias_terms(self) -> torch.Tensor | None:
        return self._biases

    @property
    def label(self) -> str | None:
        return self._label

    def set_weights_and_biases(self, weights: Any, biases: Any = None) -> None:
        """Replace the held values (CPU update path: then reload the kernels)."""
        self._weights, self._biases = check_weights(
            "TensorConvolutionDataSource", self._descriptor, weights, biases
        )

    def __repr__(self) -> str:
        return f"TensorConvolutionDataSource({self._descriptor!r}, label={self._label!r})"


class ConvWeights:
    """A kernel's master weights: OIHW ``weight`` and ``(O,)`` ``bias`` on its device, float32
    (float64 when the data source gives float64), updated **in place** by reloads and
    optimizers, so that anything recorded earlier (a captured CUDA graph, an optimizer's
    multi-tensor list) keeps reading the current values.

    Low-precision copies for float16/bfloat16 images are made when a command runs and cached
    against the master's version counter (any in-place change, also through a view, bumps it);
    while a CUDA graph is being captured they are always made, so that the graph recomputes
    them at every replay. A copy is therefore never stale.
    """

    __slots__ = ("_casts", "bias", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        self._casts: dict[torch.dtype, tuple[int, torch.Tensor, torch.Tensor | None]] = {}

    @classmethod
    def from_ohwi(
        cls, weights: torch.Tensor, biases: torch.Tensor | None, device: Device
    ) -> ConvWeights:
        dev = device.torch_device
        w = weights.to(dev).permute(0, 3, 1, 2).contiguous()
        # The biases take the weights' dtype: float64 verification runs are float64 throughout.
        b = biases.to(dev, w.dtype).clone() if biases is not None else None
        return cls(w, b)

    def load_ohwi(self, weights: torch.Tensor, biases: torch.Tensor | None) -> None:
        """Copy new OHWI values into the masters, in place (now, on the current stream)."""
        self.weight.copy_(weights.permute(0, 3, 1, 2))
        if biases is not None:
            if self.bias is None:
                self.bias = torch.zeros_like(
                    biases, dtype=self.weight.dtype, device=self.weight.device
                )
            self.bias.copy_(biases)

    def _version(self) -> int:
        v = self.weight._version
        return v if self.bias is None else v + (self.bias._version << 32)

    def cast(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Weights and bias in ``dtype`` (run time: see the class docstring)."""
        if dtype == self.weight.dtype:
            return self.weight, self.bias
        if self.weight.is_cuda and torch.cuda.is_current_stream_capturing():
            b = self.bias.to(dtype) if self.bias is not None else None
            return self.weight.to(dtype), b
        version = self._version()
        got = self._casts.get(dtype)
        if got is None or got[0] != version:
            b = self.bias.to(dtype) if self.bias is not None else None
            got = (version, self.weight.to(dtype), b)
            self._casts[dtype] = got
        return got[1], got[2]

    @property
    def ohwi(self) -> torch.Tensor:
        return self.weight.permute(0, 2, 3, 1)


class ConvolutionWeightsAndBiasesState(State):
    """Weights (OHWI) and biases as a state (MPS ``MPSCNNConvolutionWeightsAndBiasesState``).

    Used to reload a convolution on the command buffer (`Convolution.reload_weights_and_biases`),
    as the result of `Convolution.export_weights_and_biases`, and as optimizer output.

    Args:
        weights: OHWI tensor.
        biases: ``(O,)`` tensor or None.
        command_buffer: given, the state is temporary.
    """

    def __init__(
        self,
        weights: torch.Tensor,
        biases: torch.Tensor | None = None,
        *,
        command_buffer: CommandBuffer | None = None,
        label: str | None = None,
    ) -> None:
        who = "ConvolutionWeightsAndBiasesState"
        if not isinstance(weights, torch.Tensor) or weights.dim() != 4:
            raise TypeError(
                f"[{who}] weights must be a 4-D OHWI tensor, got {type(weights).__name__}"
            )
        if biases is not None and (
            not isinstance(biases, torch.Tensor) or tuple(biases.shape) != (weights.shape[0],)
        ):
            raise ValueError(
                f"[{who}] biases must be a ({weights.shape[0]},) tensor, got {biases!r}"
            )
        super().__init__(Device(weights.device), command_buffer=command_buffer, label=label)
        self._weights: torch.Tensor | None = weights
        self._biases: torch.Tensor | None = biases

    @classmethod
    def from_descriptor(
        cls,
        device: Device,
        descriptor: ConvolutionDescriptor,
        *,
        with_biases: bool = True,
        dtype: torch.dtype = torch.float32,
        command_buffer: CommandBuffer | None = None,
    ) -> ConvolutionWeightsAndBiasesState:
        """Zero weights (and biases) of the descriptor's shape (MPS
        ``initWithDevice:cnnConvolutionDescriptor:``)."""
        dev = device.torch_device
        w = torch.zeros(descriptor.weights_shape, device=dev, dtype=dtype)
        o = descriptor.output_feature_channels
        b = torch.zeros(o, device=dev, dtype=dtype) if with_biases else None
        return cls(w, b, command_buffer=command_buffer)

    @classmethod
    def temporary(
        cls, command_buffer: CommandBuffer, descriptor: ConvolutionDescriptor
    ) -> ConvolutionWeightsAndBiasesState:
        """A temporary state for ``command_buffer`` (MPS ``temporaryCNNConvolutionWeights…``)."""
        return cls.from_descriptor(command_buffer.device, descriptor, command_buffer=command_buffer)

    @property
    def weights(self) -> torch.Tensor:
        self._check_live(None)
        assert self._weights is not None
        return self._weights

    @property
    def biases(self) -> torch.Tensor | None:
        self._check_live(None)
        return self._biases

    def resources(self) -> list[torch.Tensor]:
        return [t for t in (self._weights, self._biases) if t is not None]

    def _free_storage(self) -> None:
        self._weights = None
        self._biases = None
