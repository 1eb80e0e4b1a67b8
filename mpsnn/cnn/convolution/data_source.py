"""Convolution data sources, weight states, and the master weights kernels encode with.

Weights cross the data-source boundary in the MPS OHWI layout, float32 (float64 is kept as
float64, for verification), as a 4-D tensor or array or as a flat buffer of
O·kH·kW·I/groups values (MPS's weights pointer) that the descriptor shapes. Each kernel keeps
OIHW master tensors (`mpsnn.cnn.convolution.weights.ConvWeights`) on its device and updates
them in place.

Storage. A `ConvolutionWeightsAndBiasesState` built from tensors, and a
`TensorConvolutionDataSource` built from tensors or writable arrays, *wrap* them (MPS
``initWithWeights:biases:``): the client's memory is what optimizers and
``set_weights_and_biases`` write. A contiguous OHWI tensor read as OIHW
(``w.permute(0, 3, 1, 2)``) is a channels-last OIHW tensor, and that view is what the state
keeps; every reader (reloads, optimizers) works on it in place. They copy only what cannot be
wrapped (see each constructor). A kernel's masters are always its own copy: it sees new
values when it reloads them, as in MPS.
"""

from __future__ import annotations

import abc
import math
from typing import Any

import numpy as np
import torch

from mpsnn.cnn.convolution.descriptor import ConvolutionDescriptor
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.device import Device
from mpsnn.core.kernel import TrainingStyle
from mpsnn.core.state import State
from mpsnn.ops._dtypes import widen

__all__ = [
    "ConvolutionDataSource",
    "ConvolutionWeightsAndBiasesState",
    "TensorConvolutionDataSource",
]


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill one block of memory exactly once each, in some order of
    its dimensions (no gaps, no overlaps): its storage can be read flat, element by element,
    whatever the order (contiguous and channels-last tensors are; slices with steps and
    expanded tensors are not)."""
    if t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted(
        (st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n != 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _as_float_tensor(who: str, name: str, value: Any) -> torch.Tensor:
    """``value`` as a floating-point tensor: a tensor's own memory (detached), or a writable
    array's (shared); a read-only array is copied (nothing may write through it), and so is
    one with negative strides (``a[::-1]``: PyTorch has no such views);
    float16/bfloat16 are widened to float32 (a copy)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
    else:
        try:
            a = np.asarray(value)
            if not a.flags.writeable or any(st < 0 for st in a.strides):
                a = a.copy()  # read-only, or negative strides (no tensor can view them)
            t = torch.as_tensor(a)
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
    """Validate OHWI weights and (O,) biases against ``descriptor``; returns float tensors
    (the given memory where `_as_float_tensor` keeps it). Flat weights (1-D, as MPS's weights
    pointer) must hold O·kH·kW·I/groups values and are viewed as OHWI (copied only when a 1-D
    tensor with a step cannot be viewed so)."""
    w = _as_float_tensor(who, "weights", weights)
    want = descriptor.weights_shape
    if w.dim() == 1:
        n = math.prod(want)
        if w.numel() != n:
            raise ValueError(
                f"[{who}] weights given flat must hold O·kH·kW·I/groups = {n} values "
                f"(the OHWI shape {want}), got {w.numel()}"
            )
        w = w.reshape(want)
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


def read_data_source(
    who: str, data_source: Any
) -> tuple[ConvolutionDescriptor, torch.Tensor, torch.Tensor | None]:
    """Validate a data source, ``load`` it, read descriptor, weights and biases, ``purge``."""
    for name in ("descriptor", "weights", "bias_terms"):
        if not callable(getattr(data_source, name, None)):
            raise TypeError(
                f"[{who}] weights must be a ConvolutionDataSource (with descriptor(), weights() "
                f"and bias_terms()), got {type(data_source).__name__}"
            )
    if data_source.load() is False:
        raise ValueError(f"[{who}] the data source's load() must succeed, got False")
    try:
        desc = data_source.descriptor()
        if not isinstance(desc, ConvolutionDescriptor):
            raise TypeError(
                f"[{who}] the data source's descriptor() must return a ConvolutionDescriptor, "
                f"got {type(desc).__name__}"
            )
        desc.validate(who)
        w, b = check_weights(who, desc, data_source.weights(), data_source.bias_terms())
    finally:
        data_source.purge()
    return desc.copy(), w, b


class ConvolutionDataSource(abc.ABC):
    """Where a convolution gets its weights (MPS ``MPSCNNConvolutionDataSource``).

    Required: `descriptor`, `weights` (OHWI float32 array or tensor, or a flat one of the
    O·kH·kW·I/groups values, which the descriptor shapes as OHWI: MPS's weights pointer),
    `bias_terms` (``(O,)`` or None). Kernels copy what these return (a flat buffer of another
    length is refused, naming both lengths). Optional: `load`/`purge` (balanced around
    reads), `label`, and the update hooks `update` (GPU style: encode an update into the
    command buffer and return the new `ConvolutionWeightsAndBiasesState`, or None) and
    `update_on_cpu` (after completion; return True when the weights changed, and the kernels
    then reload from the data source).
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
        weights: OHWI ``(O, kH, kW, I / groups)`` weights, or a flat buffer of those
            O·kH·kW·I/groups values; tensor or array (float32; float64 is kept for
            verification).
        biases: ``(O,)`` biases, or None for no bias.
        optimizer: an mpsnn optimizer (`SGD`, `RMSProp`, `Adam`) applied by `update` and
            `update_on_cpu`; None: no update (the layer is frozen unless you update it yourself).
        label: a name.

    The values live in a permanent `ConvolutionWeightsAndBiasesState` (`state`) that **wraps**
    the given memory: a float32 (or float64) tensor, or a writable NumPy array, is what the
    optimizer and `set_weights_and_biases` write, and ``weights()`` / ``bias_terms()`` return
    views of it (OHWI; a flat buffer is viewed as OHWI). Copied instead: float16/bfloat16
    values (widened to float32), read-only arrays, other array-likes (lists), and what the
    state itself copies (weights with gaps or overlaps; biases in another dtype or on another
    device than the weights, see `ConvolutionWeightsAndBiasesState`). On the first update the
    state moves to the device of the gradient state, once: a copy on that device, which the
    data source holds from then on (the given tensor no longer changes). The optimizer's
    vectors (momentum, velocity, ...) live here too (`optimizer_state`).

    The one-launch GPU optimizer (`mpsnn.ops.optim`) reads contiguous OIHW memory: give the
    weights as an OHWI view of OIHW storage (``oihw.permute(0, 2, 3, 1)``, as `mpsnn.models`
    does) for it; a contiguous OHWI tensor (channels-last OIHW) is updated by the portable
    multi-tensor path, with the same result.

    Raises:
        ValueError: weights or biases of the wrong shape (flat weights of the wrong length).
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
        """The OHWI weights (a view of the held state, not a copy: the given memory, where
        it was wrapped)."""
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
        """Write new values into the held state, in place: into the wrapped memory (then
        reload the kernels). Weights may be OHWI or flat, as for the constructor."""
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
            return [gradient_state._sum(i) for i in range(len(values))]

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


class ConvolutionWeightsAndBiasesState(State):
    """Weights and biases as a state (MPS ``MPSCNNConvolutionWeightsAndBiasesState``).

    Used to reload a convolution on the command buffer (`Convolution.reload_weights_and_biases`),
    as the result of `Convolution.export_weights_and_biases`, and as an optimizer's result.
    The state keeps its weights as an OIHW tensor (what reloads and optimizers read and write,
    in place); ``weights`` is its OHWI view.

    Built from tensors, the state **wraps** them (MPS ``initWithWeights:biases:``): its
    ``weights`` and ``biases`` are the given memory, so an optimizer encoded with
    ``result_state=`` this state writes the caller's tensors. A contiguous OHWI tensor becomes
    a channels-last OIHW tensor (``weights.permute(0, 3, 1, 2)``), an OHWI view of contiguous
    OIHW memory a contiguous one; both are read and written where they are. Copied, because
    they cannot be wrapped:

    * weights whose memory has gaps or overlaps (a slice with a step, an expanded tensor):
      into fresh contiguous OIHW storage; likewise inference tensors (PyTorch refuses writes
      to them outside inference mode);
    * biases on another device or in another dtype than the weights, or with gaps: into fresh
      storage on the weights' device, in their dtype.

    A tensor that requires grad is wrapped through ``detach()`` (same memory; the state's
    writes are not recorded by autograd). `from_descriptor` and `temporary` make states with
    fresh contiguous OIHW storage, `Convolution.export_weights_and_biases` with fresh storage in
    the kernel's masters' memory order (OHWI memory for the CPU's float32 convolutions).

    Args:
        weights: OHWI tensor ``(O, kH, kW, I / groups)``, floating point.
        biases: ``(O,)`` tensor or None.
        command_buffer: given, the state is temporary.

    Raises:
        TypeError: weights not a 4-D floating-point tensor.
        ValueError: biases not an ``(O,)`` tensor.
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
        if not weights.is_floating_point():
            raise TypeError(f"[{who}] weights must hold floating-point values, got {weights.dtype}")
        if biases is not None and (
            not isinstance(biases, torch.Tensor) or tuple(biases.shape) != (weights.shape[0],)
        ):
            raise ValueError(
                f"[{who}] biases must be a ({weights.shape[0]},) tensor, got {biases!r}"
            )
        super().__init__(Device(weights.device), command_buffer=command_buffer, label=label)
        # The caller's memory, read and written in place (see the class docstring for what
        # is copied instead).
        oihw = weights.detach().permute(0, 3, 1, 2)
        if not is_dense(oihw) or oihw.is_inference():
            oihw = _fresh(oihw, oihw.dtype, oihw.device)
        self._oihw: torch.Tensor | None = oihw
        b = None if biases is None else biases.detach()
        if b is not None and (
            b.device != oihw.device or b.dtype != oihw.dtype or not is_dense(b) or b.is_inference()
        ):
            b = _fresh(b, oihw.dtype, oihw.device)
        self._biases: torch.Tensor | None = b

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
        """Zero weights (and biases) of the descriptor's shape, in fresh contiguous OIHW
        storage (MPS ``initWithDevice:cnnConvolutionDescriptor:``)."""
        return cls._made(device, descriptor, with_biases, dtype, command_buffer, torch.zeros)

    @classmethod
    def _made(
        cls,
        device: Device,
        descriptor: ConvolutionDescriptor,
        with_biases: bool,
        dtype: torch.dtype,
        command_buffer: CommandBuffer | None,
        make: Any,
        ohwi_memory: bool = False,
    ) -> ConvolutionWeightsAndBiasesState:
        """A state of the descriptor's shape in fresh storage made by ``make`` (contiguous
        OIHW; contiguous OHWI with ``ohwi_memory``):
        ``torch.zeros``, or ``torch.empty`` for a state whose first command writes all of it
        (`Convolution.export_weights_and_biases`: no fill of weights that the copy replaces,
        a pass over the layer's weights saved at every training step of a data source that
        updates its own weights). ``ohwi_memory``: contiguous OHWI storage instead (an export
        of masters kept in that order)."""
        dev = device.torch_device
        o, kh, kw, ig = descriptor.weights_shape
        if ohwi_memory:
            w = make((o, kh, kw, ig), device=dev, dtype=dtype)
        else:  # contiguous OIHW storage, wrapped through its OHWI view: what the one-launch
            # GPU optimizer and the reloads read fastest
            w = make((o, ig, kh, kw), device=dev, dtype=dtype).permute(0, 2, 3, 1)
        b = make(o, device=dev, dtype=dtype) if with_biases else None
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
        # drops the references only: wrapped memory stays the caller's
        self._oihw = None
        self._biases = None


def _fresh(t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A contiguous copy of ``t`` in ``dtype`` on ``device`` (storage of the state's own)."""
    return torch.empty(t.shape, dtype=dtype, device=device).copy_(t)
