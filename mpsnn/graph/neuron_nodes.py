"""The neuron nodes (MPS ``MPSCNNNeuronNode`` and its named subclasses ``MPSCNNNeuronReLUNode``,
...): `NeuronNode` takes a `NeuronDescriptor`; the named nodes (`NeuronReLUNode`, ...) are
made from one table (`_NEURONS`: name, neuron type, parameters, formula) and build the
descriptor from their parameters with MPS's defaults.

When a graph fuses a neuron node into the filter before it, the node runs no kernel of its
own: its result (and state) are that filter's.

`mpsnn.graph.forward_nodes` re-exports these nodes and lists them in its ``__all__`` (the
graph modules and the `mpsnn.io` codecs find them there); they are defined here so that the
family has one place and that module stays to a readable size.
"""

from __future__ import annotations

from typing import Any

from mpsnn.cnn.neuron import Neuron, NeuronGradient
from mpsnn.cnn.neuron_descriptor import NeuronDescriptor, NeuronType
from mpsnn.core._checks import check_type
from mpsnn.core.device import Device
from mpsnn.graph.nodes import ImageNode, UnaryNode
from mpsnn.graph.step import _Step

__all__ = ["NeuronNode"]  # and the named neuron nodes, appended below


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


def _neuron_node(name: str, kind: NeuronType, params: tuple[str, ...], doc: str) -> type:
    """A named neuron node: ``Name(source, <params>)`` with MPS's defaults for the type."""

    def __init__(self: NeuronNode, source: ImageNode, *args: Any, **kwargs: Any) -> None:
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

    return type(name, (NeuronNode,), {"__init__": __init__, "__doc__": doc})


_NEURONS = (
    ("NeuronReLUNode", NeuronType.RELU, ("a",), "ReLU, leaky with slope ``a`` (default 0)."),
    ("NeuronLinearNode", NeuronType.LINEAR, ("a", "b"), "``a x + b``."),
    ("NeuronSigmoidNode", NeuronType.SIGMOID, (), "``1 / (1 + e^-x)``."),
    ("NeuronHardSigmoidNode", NeuronType.HARD_SIGMOID, ("a", "b"), "``clamp(a x + b, 0, 1)``."),
    ("NeuronTanHNode", NeuronType.TANH, ("a", "b"), "``a tanh(b x)``."),
    ("NeuronAbsoluteNode", NeuronType.ABSOLUTE, (), "``|x|``."),
    ("NeuronSoftPlusNode", NeuronType.SOFT_PLUS, ("a", "b"), "``a log(1 + e^(b x))``."),
    ("NeuronSoftSignNode", NeuronType.SOFT_SIGN, (), "``x / (1 + |x|)``."),
    ("NeuronELUNode", NeuronType.ELU, ("a",), "ELU with scale ``a``."),
    ("NeuronPReLUNode", NeuronType.PRELU, ("a_data",), "PReLU with per-channel slopes."),
    ("NeuronReLUNNode", NeuronType.RELU_N, ("a", "b"), "ReLU capped at ``b``."),
    ("NeuronPowerNode", NeuronType.POWER, ("a", "b", "c"), "``(a x + b)^c``."),
    ("NeuronExponentialNode", NeuronType.EXPONENTIAL, ("a", "b", "c"), "``c^(a x + b)``."),
    ("NeuronLogarithmNode", NeuronType.LOGARITHM, ("a", "b", "c"), "``log_c(a x + b)``."),
    ("NeuronGeLUNode", NeuronType.GELU, (), "``x Phi(x)``."),
)
for _name, _kind, _params, _doc in _NEURONS:
    globals()[_name] = _neuron_node(_name, _kind, _params, f"{_doc} (MPS ``MPSCNN{_name}``)")
    __all__.append(_name)
