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
from mpsnn.core.kernel import TrainingStyle
from mpsnn.core.layout import storage_layout
from mpsnn.core.state import State
from mpsnn.ops._dtypes import widen
from mpsnn.ops.convolution import fc_matrix

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

    #: Where a graph runs this layer's update (`update` on the GPU, or `update_on_cpu`).
    training_style: TrainingStyle = TrainingStyle.UPDATE_ON_GPU

    def update(
        self, command_buffer: CommandBuffer, gradient_state: Any, source_state: Any
    ) -> ConvolutionWeightsAndBiasesState | None:
        return None

    def update_on_cpu(self, gradient_state: Any, source_state: Any) -> bool:
        return False


class TensorConvolutionDataSource(ConvolutionDataSource):
    """A data source that holds its weights and applies an optimizer (the common case needs no
    subclass).

    Args:
        descriptor: the convolution's shape.
        weights: OHWI ``(O, kH, kW, I / groups)`` weights, array or tensor (float32; float64
            is kept for verification).
        biases: ``(O,)`` biases, or None for no bias.
        optimizer: an mpsnn optimizer (`SGD`, `RMSProp`, `Adam`) applied by `update` and
            `update_on_cpu`; None: no update (the layer is frozen unless you update it yourself).
        label: a name.

    The values live in a permanent `ConvolutionWeightsAndBiasesState` (`state`); ``weights()``
    and ``bias_terms()`` are views of it: the same memory the optimizer writes. On the first
    update the state moves to the device of the gradient state, once. The optimizer's vectors
    (momentum, velocity, ...) live here too (`optimizer_state`).

    Raises:
        ValueError: weights or biases of the wrong shape.
    """

    training_style = TrainingStyle.UPDATE_ON_GPU

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
        if optimizer is not None and not callable(getattr(optimizer, "_update", None)):
            raise TypeError(
                f"[{who}] optimizer must be an mpsnn optimizer (SGD, RMSProp or Adam) or None, "
                f"got {type(optimizer).__name__}"
            )
        self._descriptor = descriptor.copy()
        w, b = check_weights(who, self._descriptor, weights, biases)
        self._state = ConvolutionWeightsAndBiasesState(w, b)
        self._optimizer = optimizer
        self._optimizer_state: list[list[torch.Tensor]] | None = None
        self._label = label

    def descriptor(self) -> ConvolutionDescriptor:
        return self._descriptor

    def weights(self) -> torch.Tensor:
        """The OHWI weights (a view of the held state, not a copy)."""
        return self._state.weights

    def bias_terms(self) -> torch.Tensor | None:
        return self._state.biases

    @property
    def state(self) -> ConvolutionWeightsAndBiasesState:
        """The permanent state holding the values (what `update` returns)."""
        return self._state

    @property
    def label(self) -> str | None:
        return self._label

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    @property
    def optimizer_state(self) -> dict[str, list[torch.Tensor]] | None:
        """The optimizer's vectors by name (``momentum``, ``velocity``, ...), each a list
        ``[weights (OHWI), biases]``, made by the first update (None before)."""
        if self._optimizer_state is None:
            return None
        names = self._optimizer._state_names()
        return {
            name: [t.permute(0, 2, 3, 1) if t.dim() == 4 else t for t in vectors]
            for name, vectors in zip(names, self._optimizer_state, strict=True)
        }

    def set_weights_and_biases(self, weights: Any, biases: Any = None) -> None:
        """Write new values into the held state, in place (then reload the kernels)."""
        w, b = check_weights("TensorConvolutionDataSource", self._descriptor, weights, biases)
        st = self._state
        st._oihw.copy_(w.permute(0, 3, 1, 2))  # type: ignore[union-attr]
        if b is not None:
            if st._biases is None:
                st._biases = torch.zeros_like(b, device=st._oihw.device, dtype=st._oihw.dtype)  # type: ignore[union-attr]
            st._biases.copy_(b)

    def _to(self, device: torch.device) -> None:
        st = self._state
        if st._oihw.device != device:  # type: ignore[union-attr]
            self._state = ConvolutionWeightsAndBiasesState(
                st.weights.to(device), None if st.biases is None else st.biases.to(device)
            )

    def _update_lists(self, gradient_state: Any, source_state: Any) -> tuple[Any, ...]:
        """``(values, grads, results, optimizer state)`` of one update (``grads`` is read when
        the update runs): what `update` hands the optimizer, and what a graph gathers to update
        the layers that share an optimizer in one launch."""
        self._to(gradient_state.device.torch_device)
        src = self._state if source_state is None else source_state
        res = self._state
        with_bias = res._biases is not None
        values = [src._oihw, src._biases] if with_bias else [src._oihw]
        results = [res._oihw, res._biases] if with_bias else [res._oihw]
        if self._optimizer_state is None:
            self._optimizer_state = self._optimizer._init_state(results)
        elif self._optimizer_state and len(self._optimizer_state[0]) < len(results):
            # biases given to a layer that had none (set_weights_and_biases): their state
            # starts fresh, the weights' keeps its history
            added = self._optimizer._init_state(results[len(self._optimizer_state[0]) :])
            for kept, new in zip(self._optimizer_state, added, strict=True):
                kept.extend(new)

        def grads() -> list[torch.Tensor]:  # read when the update runs
            return [gradient_state._sum(0), gradient_state._sum(1)][: len(values)]

        return values, grads, results, self._optimizer_state

    def _apply_optimizer(
        self, cb: CommandBuffer | None, gradient_state: Any, source_state: Any
    ) -> bool:
        if self._optimizer is None:
            return False
        self._optimizer._update(cb, *self._update_lists(gradient_state, source_state))
        return True

    def update(
        self, command_buffer: CommandBuffer, gradient_state: Any, source_state: Any
    ) -> ConvolutionWeightsAndBiasesState | None:
        """GPU path: encode the optimizer's update into ``command_buffer``, reading the
        gradients of ``gradient_state`` and the weights the kernel used (``source_state``, or
        the held ones when None), writing the held state; returns it for
        ``reload_weights_and_biases``. None without an optimizer."""
        return (
            self._state
            if self._apply_optimizer(command_buffer, gradient_state, source_state)
            else None
        )

    def update_on_cpu(self, gradient_state: Any, source_state: Any) -> bool:
        """CPU path (after the gradient's command buffer completed): the optimizer's update,
        now; then reload the kernels from the data source. False without an optimizer."""
        return self._apply_optimizer(None, gradient_state, source_state)

    def __repr__(self) -> str:
        return f"TensorConvolutionDataSource({self._descriptor!r}, label={self._label!r})"

    @property
    def _own_updates(self) -> bool:
        """Whether ``update`` and ``update_on_cpu`` are this class's (not a subclass's): then a
        graph may run the optimizer itself (several layers in one launch) and skip the bias
        sums of a layer without biases, which these updates never read."""
        cls = type(self)
        return (
            cls.update is TensorConvolutionDataSource.update
            and cls.update_on_cpu is TensorConvolutionDataSource.update_on_cpu
        )


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

    __slots__ = ("_casts", "_matrix", "bias", "channels_last_casts", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        # low-precision CUDA casts in the convolutions' layout (`_low`); a fully connected
        # layer, which reads its weights as an (O, C kH kW) matrix, turns it off
        self.channels_last_casts = True
        self._casts: dict[torch.dtype, tuple[int, torch.Tensor, torch.Tensor | None]] = {}
        self._matrix: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def from_ohwi(
        cls, weights: torch.Tensor, biases: torch.Tensor | None, device: Device
    ) -> ConvWeights:
        dev = device.torch_device
        o, kh, kw, ig = weights.shape
        # Always a copy: a kernel owns its weights and sees a data source's new values only
        # when it reloads them (MPS's contract; a second kernel of the same data source, e.g.
        # an inference graph's, keeps its weights until its own reload).
        w = torch.empty((o, ig, kh, kw), dtype=weights.dtype, device=dev)
        w.copy_(weights.permute(0, 3, 1, 2))
        # The biases take the weights' dtype: float64 verification runs are float64 throughout.
        b = biases.to(dev, w.dtype, copy=True) if biases is not None else None
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
        if dtype is self.weight.dtype:  # the common case, at every forward (dtypes are singletons)
            return self.weight, self.bias
        if self.weight.is_cuda and torch.cuda.is_current_stream_capturing():
            b = self.bias.to(dtype) if self.bias is not None else None
            return self._low(dtype), b
        version = self._version()
        got = self._casts.get(dtype)
        if got is None or got[0] != version:
            b = self.bias.to(dtype) if self.bias is not None else None
            got = (version, self._low(dtype), b)
            self._casts[dtype] = got
        return got[1], got[2]

    def _low(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights in ``dtype``, in the layout the convolutions run in (`mpsnn.core.layout`)
        so that cuDNN does not convert them at every forward and backward; one cast either
        way."""
        w = self.weight
        if self.channels_last_casts and w.dim() == 4:
            return w.to(dtype, memory_format=storage_layout(dtype, w.device))
        return w.to(dtype)

    def matrix(self, w: torch.Tensor) -> torch.Tensor:
        """`fc_matrix` of ``w`` (the masters, or a cast of them from `cast`), kept while ``w``
        is the tensor it was made for: a view, so in-place updates show through it, and a
        fully connected layer makes none at every step."""
        got = self._matrix
        if got is None or got[0] is not w:
            got = self._matrix = (w, fc_matrix(w))
        return got[1]

    @property
    def ohwi(self) -> torch.Tensor:
        return self.weight.permute(0, 2, 3, 1)


class ConvolutionWeightsAndBiasesState(State):
    """Weights and biases as a state (MPS ``MPSCNNConvolutionWeightsAndBiasesState``).

    Used to reload a convolution on the command buffer (`Convolution.reload_weights_and_biases`),
    as the result of `Convolution.export_weights_and_biases`, and as an optimizer's result.
    The state keeps its weights in the OIHW layout, contiguous (what the kernels and the
    optimizers read); ``weights`` is an OHWI view of that storage.

    Args:
        weights: OHWI tensor ``(O, kH, kW, I / groups)`` (copied into the state's storage).
        biases: ``(O,)`` tensor or None (copied, in the weights' dtype).
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
        # The state owns its storage (optimizers and reloads write it in place): copies, also
        # when the OIHW view happens to be contiguous already (one input channel, 1x1 kernels).
        oihw = weights.detach().permute(0, 3, 1, 2)
        self._oihw: torch.Tensor | None = torch.empty(
            oihw.shape, dtype=oihw.dtype, device=oihw.device
        ).copy_(oihw)
        self._biases: torch.Tensor | None = (
            None if biases is None else biases.detach().to(weights.device, weights.dtype, copy=True)
        )

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
        """The weights, OHWI (a view of the state's OIHW storage)."""
        self._check_live(None)
        assert self._oihw is not None  # live states hold their tensors
        return self._oihw.permute(0, 2, 3, 1)

    @property
    def biases(self) -> torch.Tensor | None:
        self._check_live(None)
        return self._biases

    def resources(self) -> list[torch.Tensor]:
        return [t for t in (self._oihw, self._biases) if t is not None]

    def _free_storage(self) -> None:
        self._oihw = None
        self._biases = None
