"""`NeuronType`, `NeuronDescriptor` (MPS ``MPSCNNNeuronType``, ``MPSNNNeuronDescriptor``) and
`FusedNeuron`, the one mechanism by which other kernels apply a neuron to their result.

Kept apart from the neuron kernels so that the convolution and batch normalization can fuse a
neuron without importing the neuron family.
"""

from __future__ import annotations

import enum
import math
from typing import Any

import numpy as np
import torch

from mpsnn.ops.neuron import NeuronParams, activation, activation_backward

__all__ = [
    "FusedNeuron",
    "NeuronDescriptor",
    "NeuronType",
]


class NeuronType(enum.IntEnum):
    """The 16 neuron types, with MPS's enum values (formulas in `mpsnn.ops.neuron`)."""

    NONE = 0
    RELU = 1
    LINEAR = 2
    SIGMOID = 3
    HARD_SIGMOID = 4
    TANH = 5
    ABSOLUTE = 6
    SOFT_PLUS = 7
    SOFT_SIGN = 8
    ELU = 9
    PRELU = 10
    RELU_N = 11
    POWER = 12
    EXPONENTIAL = 13
    LOGARITHM = 14
    GELU = 15


# Defaults when a parameter is not given (the usual defaults of each type). RELU_N uses
# a = 0 so that b = 6 is ReLU6.
_DEFAULTS: dict[NeuronType, tuple[float, float, float]] = {
    NeuronType.LINEAR: (1.0, 0.0, 0.0),
    NeuronType.HARD_SIGMOID: (0.2, 0.5, 0.0),
    NeuronType.TANH: (1.0, 1.0, 0.0),
    NeuronType.SOFT_PLUS: (1.0, 1.0, 0.0),
    NeuronType.ELU: (1.0, 0.0, 0.0),
    NeuronType.RELU_N: (0.0, 6.0, 0.0),
    NeuronType.POWER: (1.0, 0.0, 1.0),
    NeuronType.EXPONENTIAL: (1.0, 0.0, -1.0),
    NeuronType.LOGARITHM: (1.0, 0.0, -1.0),
}


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"[NeuronDescriptor] {name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"[NeuronDescriptor] {name} must be finite, got {value}")
    return float(value)


class NeuronDescriptor:
    """A neuron's type and parameters (MPS ``MPSNNNeuronDescriptor``).

    Args:
        neuron_type: a `NeuronType`.
        a, b, c: the type's parameters (None: the type's default, see the source).
        data: PRELU only: the per-channel slopes ``a[c]`` (array or tensor, one per channel).

    Raises:
        ValueError: PRELU without ``data`` (or ``data`` for another type); an EXPONENTIAL base
            ``c`` that is not -1 (e) or positive; a LOGARITHM base that is not -1 (e) or a
            positive number other than 1.

    Note:
        No gradient is computed for the parameters (MPS neurons have no trainable parameters).
    """

    __slots__ = ("_a", "_b", "_c", "_data", "_type")

    def __init__(
        self,
        neuron_type: NeuronType,
        a: float | None = None,
        b: float | None = None,
        c: float | None = None,
        data: Any = None,
    ) -> None:
        if not isinstance(neuron_type, NeuronType):
            raise TypeError(
                "[NeuronDescriptor] neuron_type must be a NeuronType, "
                f"got {type(neuron_type).__name__}"
            )
        da, db, dc = _DEFAULTS.get(neuron_type, (0.0, 0.0, 0.0))
        self._type = neuron_type
        self._a = da if a is None else _number("a", a)
        self._b = db if b is None else _number("b", b)
        self._c = dc if c is None else _number("c", c)
        if neuron_type is NeuronType.PRELU:
            if data is None:
                raise ValueError(
                    "[NeuronDescriptor] PRELU needs data (one slope per channel), got None"
                )
            t = torch.as_tensor(np.asarray(data) if not isinstance(data, torch.Tensor) else data)
            if t.dim() != 1 or t.numel() < 1 or not t.is_floating_point():
                raise ValueError(
                    f"[NeuronDescriptor] PRELU data must be a 1-D float array of slopes, got shape "
                    f"{tuple(t.shape)} and dtype {t.dtype}"
                )
            # A host copy, as MPS descriptors keep: comparing descriptors never syncs a GPU.
            self._data: torch.Tensor | None = t.detach().to("cpu", torch.float32).clone()
        elif data is not None:
            raise ValueError(
                f"[NeuronDescriptor] data is for PRELU only, got data for {neuron_type.name}"
            )
        else:
            self._data = None
        if neuron_type is NeuronType.EXPONENTIAL and not (self._c == -1 or self._c > 0):
            raise ValueError(
                "[NeuronDescriptor] the EXPONENTIAL base c must be -1 (e) or positive, "
                f"got {self._c}"
            )
        if neuron_type is NeuronType.LOGARITHM and not (
            self._c == -1 or (self._c > 0 and self._c != 1)
        ):
            raise ValueError(
                "[NeuronDescriptor] the LOGARITHM base c must be -1 (e) or positive and not 1, "
                f"got {self._c}"
            )

    @property
    def neuron_type(self) -> NeuronType:
        return self._type

    @property
    def a(self) -> float:
        return self._a

    @property
    def b(self) -> float:
        return self._b

    @property
    def c(self) -> float:
        return self._c

    @property
    def data(self) -> torch.Tensor | None:
        """PRELU slopes (float32 on the CPU, one per channel), else None."""
        return self._data

    @property
    def params(self) -> NeuronParams:
        """The neuron as `mpsnn.ops.neuron` takes it."""
        return NeuronParams(int(self._type), self._a, self._b, self._c, self._data)

    def _key(self) -> tuple[Any, ...]:
        data = None if self._data is None else tuple(self._data.tolist())
        return (int(self._type), self._a, self._b, self._c, data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NeuronDescriptor) and other._key() == self._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        extra = "" if self._data is None else f", data=<{self._data.numel()} slopes>"
        return f"NeuronDescriptor({self._type.name}, a={self._a}, b={self._b}, c={self._c}{extra})"


class FusedNeuron:
    """A neuron applied to another kernel's result (a convolution after its bias, batch
    normalization after gamma and beta), and its gradient, with the math of
    `mpsnn.ops.neuron`: ``y = f(z)`` forward, ``dz = dy * f'(z)`` backward, where ``z`` is the
    pre-activation (kept by the convolution's state, recomputed by batch normalization).

    `of` validates a descriptor for fusion: NONE means no neuron, and PRELU is refused (MPS
    fuses only neurons whose parameters are shared by all channels).
    """

    __slots__ = ("descriptor", "params")

    def __init__(self, descriptor: NeuronDescriptor) -> None:
        self.descriptor = descriptor
        self.params = descriptor.params

    @classmethod
    def of(cls, who: str, descriptor: Any) -> FusedNeuron | None:
        """The fused neuron of ``descriptor`` (None for None or NONE)."""
        if descriptor is None:
            return None
        if not isinstance(descriptor, NeuronDescriptor):
            raise TypeError(
                f"[{who}] fused_neuron_descriptor must be a NeuronDescriptor or None, "
                f"got {type(descriptor).__name__}"
            )
        if descriptor.neuron_type is NeuronType.PRELU:
            raise ValueError(
                f"[{who}] a fused neuron must have parameters shared by all channels, got PRELU"
            )
        return None if descriptor.neuron_type is NeuronType.NONE else cls(descriptor)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        """``f(z)`` in ``z``'s dtype."""
        return activation(self.params, z)

    def backward(self, g: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``g * f'(z)`` in ``g``'s dtype."""
        return activation_backward(self.params, g, z)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FusedNeuron) and other.descriptor == self.descriptor

    def __hash__(self) -> int:
        return hash(self.descriptor)

    def __repr__(self) -> str:
        return f"FusedNeuron({self.descriptor!r})"
