"""The neuron nodes (MPS ``MPSCNNNeuronNode`` and its named subclasses ``MPSCNNNeuronReLUNode``,
...): `NeuronNode` takes a `NeuronDescriptor`; each named node (`NeuronReLUNode`, ...) names its
neuron type and parameters, and builds the descriptor from them with MPS's defaults
(`_NamedNeuronNode`).

When a graph fuses a neuron node into the filter before it, the node runs no kernel of its
own: its result (and state) are that filter's.

The family has this one place (`mpsnn.nodes` exports its ``__all__``; the `mpsnn.io` codecs
register every class listed there).
"""

from __future__ import annotations

import math
from typing import Any

from mpsnn.cnn.neuron import Neuron, NeuronGradient, ReLUGradientOfResult
from mpsnn.cnn.neuron_descriptor import NeuronDescriptor, NeuronType
from mpsnn.core._checks import check_type
from mpsnn.core.device import Device
from mpsnn.graph.nodes import (
    FilterNode,
    ImageNode,
    UnaryGradientNode,
    UnaryNode,
)
from mpsnn.graph.step import _Step
from mpsnn.nodes.convolution import ConvolutionNode

__all__ = [
    "NeuronAbsoluteNode",
    "NeuronELUNode",
    "NeuronExponentialNode",
    "NeuronGeLUNode",
    "NeuronGradientNode",
    "NeuronHardSigmoidNode",
    "NeuronLinearNode",
    "NeuronLogarithmNode",
    "NeuronNode",
    "NeuronPReLUNode",
    "NeuronPowerNode",
    "NeuronReLUNNode",
    "NeuronReLUNode",
    "NeuronSigmoidNode",
    "NeuronSoftPlusNode",
    "NeuronSoftSignNode",
    "NeuronTanHNode",
]


class NeuronNode(UnaryNode):
    """A neuron (MPS ``MPSCNNNeuronNode``): ``NeuronNode(source, descriptor)``; the named
    nodes (`NeuronReLUNode`, ...) build the descriptor."""

    def __init__(self, source: ImageNode, descriptor: NeuronDescriptor) -> None:
        super().__init__(source)
        self.descriptor = check_type(
            type(self).__name__, "descriptor", descriptor, NeuronDescriptor
        )

    @property
    def a(self) -> float:
        return self.descriptor.a

    @property
    def b(self) -> float:
        return self.descriptor.b

    @property
    def c(self) -> float:
        return self.descriptor.c

    def _fusible_neuron(self) -> Any:
        # PReLU's per-channel slopes are not among the fused neurons the kernels apply
        return None if self.descriptor.neuron_type is NeuronType.PRELU else self.descriptor

    def _make_kernel(self, device: Device) -> Any:
        k = Neuron(device, self.descriptor)
        self._configure(k)
        return k

    def _run(self, step: _Step, kernel: Any) -> None:
        target = getattr(kernel, "target", None)
        if target is None:
            return super()._run(step, kernel)
        # fused into the filter before it: its result (and state) are this node's
        step.alias(self.result_image, target.result_image)
        if kernel.neuron is not None:  # after arithmetic: the neuron's own record, no command
            if step.training(self):
                x = step.image(self._sources[0])
                states = step.states_for(self, kernel.neuron, x)
                kernel.neuron._record_only(x.image, list(states))
                step.set_state(self.result_state, states)
        elif target.result_state is not None and target.result_state._id in step.states:
            step.set_state(self.result_state, step.state(target.result_state))
        return None

    def _gradient_kernel(self, device: Device) -> Any:
        return NeuronGradient(device, self.descriptor)


class _NamedNeuronNode(NeuronNode):
    """A neuron node named for its type: ``Name(source, <params>)`` builds the descriptor of
    type ``_kind`` from the parameters ``_params`` it takes, with MPS's defaults for the rest."""

    _kind: NeuronType
    _params: tuple[str, ...] = ()

    def __init__(self, source: ImageNode, *args: Any, **kwargs: Any) -> None:
        name = next(c for c in type(self).__mro__ if "_kind" in vars(c)).__name__
        params, kind = self._params, self._kind
        if len(args) > len(params):
            raise TypeError(f"[{name}] takes {len(params)} parameters {params}, got {len(args)}")
        values = dict(zip(params, args, strict=False)) | kwargs
        unknown = set(values) - set(params)
        if unknown:
            raise TypeError(f"[{name}] unknown parameters {sorted(unknown)}; it takes {params}")
        if kind is NeuronType.PRELU:
            desc = NeuronDescriptor(kind, data=values.get("a_data"))
        else:
            desc = NeuronDescriptor(kind, **values)
        NeuronNode.__init__(self, source, desc)


class NeuronReLUNode(_NamedNeuronNode):
    """ReLU, leaky with slope ``a`` (default 0). (MPS ``MPSCNNNeuronReLUNode``)"""

    _kind = NeuronType.RELU
    _params = ("a",)


class NeuronLinearNode(_NamedNeuronNode):
    """``a x + b``. (MPS ``MPSCNNNeuronLinearNode``)"""

    _kind = NeuronType.LINEAR
    _params = ("a", "b")


class NeuronSigmoidNode(_NamedNeuronNode):
    """``1 / (1 + e^-x)``. (MPS ``MPSCNNNeuronSigmoidNode``)"""

    _kind = NeuronType.SIGMOID


class NeuronHardSigmoidNode(_NamedNeuronNode):
    """``clamp(a x + b, 0, 1)``. (MPS ``MPSCNNNeuronHardSigmoidNode``)"""

    _kind = NeuronType.HARD_SIGMOID
    _params = ("a", "b")


class NeuronTanHNode(_NamedNeuronNode):
    """``a tanh(b x)``. (MPS ``MPSCNNNeuronTanHNode``)"""

    _kind = NeuronType.TANH
    _params = ("a", "b")


class NeuronAbsoluteNode(_NamedNeuronNode):
    """``|x|``. (MPS ``MPSCNNNeuronAbsoluteNode``)"""

    _kind = NeuronType.ABSOLUTE


class NeuronSoftPlusNode(_NamedNeuronNode):
    """``a log(1 + e^(b x))``. (MPS ``MPSCNNNeuronSoftPlusNode``)"""

    _kind = NeuronType.SOFT_PLUS
    _params = ("a", "b")


class NeuronSoftSignNode(_NamedNeuronNode):
    """``x / (1 + |x|)``. (MPS ``MPSCNNNeuronSoftSignNode``)"""

    _kind = NeuronType.SOFT_SIGN


class NeuronELUNode(_NamedNeuronNode):
    """ELU with scale ``a``. (MPS ``MPSCNNNeuronELUNode``)"""

    _kind = NeuronType.ELU
    _params = ("a",)


class NeuronPReLUNode(_NamedNeuronNode):
    """PReLU with per-channel slopes. (MPS ``MPSCNNNeuronPReLUNode``)"""

    _kind = NeuronType.PRELU
    _params = ("a_data",)


class NeuronReLUNNode(_NamedNeuronNode):
    """ReLU capped at ``b``. (MPS ``MPSCNNNeuronReLUNNode``)"""

    _kind = NeuronType.RELU_N
    _params = ("a", "b")


class NeuronPowerNode(_NamedNeuronNode):
    """``(a x + b)^c``. (MPS ``MPSCNNNeuronPowerNode``)"""

    _kind = NeuronType.POWER
    _params = ("a", "b", "c")


class NeuronExponentialNode(_NamedNeuronNode):
    """``c^(a x + b)``. (MPS ``MPSCNNNeuronExponentialNode``)"""

    _kind = NeuronType.EXPONENTIAL
    _params = ("a", "b", "c")


class NeuronLogarithmNode(_NamedNeuronNode):
    """``log_c(a x + b)``. (MPS ``MPSCNNNeuronLogarithmNode``)"""

    _kind = NeuronType.LOGARITHM
    _params = ("a", "b", "c")


class NeuronGeLUNode(_NamedNeuronNode):
    """``x Phi(x)``. (MPS ``MPSCNNNeuronGeLUNode``)"""

    _kind = NeuronType.GELU


# -- gradient node ---------------------------------------------------------------------------


class _NeuronGradientNode(UnaryGradientNode):
    """A neuron's gradient. A plain ReLU (``a = +0.0``, no padding policy) whose input is made
    by a node of the graph, with the input and the result both in the graph's format, reads
    the forward *result* (`ReLUGradientOfResult`): the ReLU's input is then freed after the
    forward instead of being kept for the backward (in a residual network: every addition's
    result). With a narrower result (a node ``format`` of its own) a tiny positive input could
    round to a zero result and lose its gradient: the source is read then. A ReLU fused into
    the filter before it differentiates through that filter's state either way. Its sources
    are MPS's (incoming gradient, forward source) in both cases."""

    def __init__(self, source_gradient: ImageNode, forward: FilterNode) -> None:
        d = forward.descriptor
        self._plain_relu = (
            d.neuron_type is NeuronType.RELU
            and d.a == 0.0
            and math.copysign(1.0, d.a) > 0
            and forward.padding_policy is None
        )
        super().__init__(source_gradient, forward)

    def _uses_result(self) -> bool:
        """Whether the gradient reads the ReLU's result (decided when a graph is planned).

        After a convolution, which may run fused with the ReLU and then computes the
        pre-activation in its *source's* dtype, that source must be in the graph's format too
        (a wider graph input would round a tiny positive pre-activation to a zero result)."""
        src, result = self._forward.source_images[0], self._forward.result_image
        if not (
            self._plain_relu
            and src.producer is not None
            and src.format is None
            and result.format is None
        ):
            return False
        if isinstance(src.producer, ConvolutionNode):
            before = src.producer.source_images[0]
            return before.producer is not None and before.format is None
        return True

    def _content_sources(self) -> list[ImageNode]:
        if self._uses_result():
            return [self._sources[0], self._forward.result_image]
        return self._sources

    def _make_kernel(self, device: Device) -> Any:
        if self._uses_result():
            return ReLUGradientOfResult(device, self._forward.descriptor)
        return super()._make_kernel(device)

    def _read_node(self, kernel: Any) -> ImageNode:
        if isinstance(kernel, ReLUGradientOfResult):
            return self._forward.result_image
        return self._sources[1]


class NeuronGradientNode(_NeuronGradientNode, gradient_of=NeuronNode):
    """The gradient node of `NeuronNode` (MPS ``MPSCNNNeuronGradientNode``)."""
