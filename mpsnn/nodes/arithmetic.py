"""The arithmetic nodes (MPS ``MPSNNAdditionNode``, ``MPSNNSubtractionNode``,
``MPSNNMultiplicationNode``, ``MPSNNDivisionNode``) and their gradient node
(``MPSNNArithmeticGradientNode``, one per input)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mpsnn.cnn.arithmetic as arith
from mpsnn.cnn.arithmetic import Add, Subtract
from mpsnn.cnn.normalization import BatchNormalization
from mpsnn.core.device import Device
from mpsnn.core.image_batch import ImageBatch
from mpsnn.graph.nodes import (
    FilterNode,
    GradientFilterNode,
    ImageNode,
    register_gradient_nodes,
    register_gradient_sum,
)
from mpsnn.graph.step import _shape_only, _Step

__all__ = [
    "AdditionNode",
    "ArithmeticGradientNode",
    "DivisionNode",
    "MultiplicationNode",
    "SubtractionNode",
]


class _ArithmeticNode(FilterNode):
    """Binary arithmetic (MPS ``MPSNNBinaryArithmeticNode``): ``left`` is the primary source.
    The kernel's scales, bias, clamp and strides are set through the node's attributes of the
    same names (``primary_scale``, ``secondary_scale``, ``bias``, ``minimum_value``,
    ``maximum_value``, ``primary_stride_in_feature_channels``, ...)."""

    _kernel_class: type = arith.Add
    fuses_neuron = True
    _properties = (
        "primary_scale", "secondary_scale", "bias", "minimum_value", "maximum_value",
        "primary_stride_in_feature_channels", "secondary_stride_in_feature_channels",
        "primary_stride_in_pixels_x", "primary_stride_in_pixels_y",
        "secondary_stride_in_pixels_x", "secondary_stride_in_pixels_y",
    )  # fmt: skip

    def __init__(self, left: ImageNode, right: ImageNode) -> None:
        super().__init__([left, right])
        self.properties: dict[str, Any] = {}

    @classmethod
    def from_sources(cls, sources: Sequence[ImageNode]) -> _ArithmeticNode:
        if len(sources) != 2:
            raise ValueError(f"[{cls.__name__}] needs 2 sources, got {len(sources)}")
        return cls(sources[0], sources[1])

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._properties:
            self.properties[name] = value
        else:
            object.__setattr__(self, name, value)

    def _make_kernel(self, device: Device) -> Any:
        k = self._kernel_class(device)
        for name, value in self.properties.items():
            setattr(k, name, value)
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device, secondary: bool) -> Any:
        from mpsnn.core.registry import gradient_kernels_of

        (grad,) = gradient_kernels_of(self._kernel_class)
        return grad(device, secondary)

    def _plain_sum(self) -> bool:
        # the ReLU gradient is applied by this class's `_run` and `Add`'s command: a subclass
        # that makes or runs its kernel otherwise keeps the ReLU gradient apart
        own = type(self)
        return (
            self._kernel_class is arith.Add
            and own._run is _ArithmeticNode._run
            and own._make_kernel is _ArithmeticNode._make_kernel
            and not self.properties
            and self.padding_policy is None
        )

    def _run(self, step: _Step, kernel: Any) -> None:
        fusion = step.graph._plan.fusion
        a, b = step.image(self._sources[0]), step.image(self._sources[1])
        bn = fusion.normalized_sums.get(self._id)
        normalized = None if bn is None else self._normalize(step, bn, a, b)
        if normalized is not None and normalized[0] is None:  # normalized by its own command
            a, b = normalized[1]
            normalized = None
        states = kernel.result_state_batch(a, b) if step.training(self) else None
        # a gradient sum whose ReLU gradient runs in this command reads the ReLU's result
        relu = fusion.sum_gradients.get(self._id)
        mask = None if relu is None else step.image(relu.inference_node.result_image).image
        kernel._gradient_mask = mask
        kernel._normalized = normalized
        try:
            y = kernel.encode_batch(step.cb, a, b, destination_states=states)
        finally:
            kernel._gradient_mask = kernel._normalized = None
        step.set_image(self.result_image, y)
        if states is not None:
            step.set_state(self.result_state, states)

    def _normalize(self, step: _Step, bn: Any, a: ImageBatch, b: ImageBatch) -> Any:
        """The operand ``bn`` makes, planned to be normalized inside this command
        (`mpsnn.graph.plan_passes._normalized_sums`): ``(operand index, its source, state,
        forward record)`` for the command (the normalization's record written into its state
        as its own encode would), or ``(None, (a, b))`` with the normalization encoded now
        where the command could not give its encode's values: the other operand or the
        source in another shape or format than the graph's result, a kernel that is not the
        plain `BatchNormalization` (a subclass encodes its own way) or one that reads or
        writes part of an image."""
        kernel, x, state = step.deferred.pop(bn._id)
        i = 0 if self._sources[0] is bn.result_image else 1
        other, source = (b, a)[i].image, x.image
        fmt = step.graph.format  # the normalization's result, the addition's and its operands'
        if (
            other._shape == source._shape
            and other._fmt is fmt
            and source._fmt is fmt
            and type(kernel) is BatchNormalization
            and kernel._whole_images()
        ):
            kernel._record_only(source, [state])
            return i, source, state, state._forward.params  # its BatchNormalizationRecord
        y = kernel.encode_batch(step.cb, x, state)
        step.set_image(bn.result_image, y)
        return None, ((y, b) if i == 0 else (a, y))


class AdditionNode(_ArithmeticNode):
    """``left + right`` (MPS ``MPSNNAdditionNode``)."""

    sums_gradients_with_relu_gradient = True
    fuses_normalization_of_operand = True

    _kernel_class = arith.Add


class SubtractionNode(_ArithmeticNode):
    """``left - right`` (MPS ``MPSNNSubtractionNode``)."""

    _kernel_class = arith.Subtract


class MultiplicationNode(_ArithmeticNode):
    """``left * right`` (MPS ``MPSNNMultiplicationNode``)."""

    _kernel_class = arith.Multiply


class DivisionNode(_ArithmeticNode):
    """``left / right`` (MPS ``MPSNNDivisionNode``; its gradient is an mpsnn extension)."""

    _kernel_class = arith.Divide


class ArithmeticGradientNode(GradientFilterNode):
    """One input's gradient of an arithmetic node (MPS ``MPSNNArithmeticGradientNode``):
    ``is_secondary_source_filter`` selects the input. Add and subtract read the input they
    differentiate, multiply and divide the other one.

    Add and subtract need only the *shape* of their input (``dx = scale * g``, reduced over
    broadcast axes): their kernel gets a storage-less stand-in of the same shape, and the input
    image is not kept alive for them. In a residual network that frees every block's last
    normalization output right after the addition instead of at the block's backward."""

    def __init__(self, source_gradient: ImageNode, forward: Any, secondary: bool) -> None:
        self._reads_other = not issubclass(forward._kernel_class, Add | Subtract)
        which = (not secondary) if self._reads_other else secondary
        super().__init__(
            [source_gradient, forward.source_images[int(which)]], forward, forward.result_state
        )
        self.is_secondary_source_filter = secondary

    def _content_sources(self) -> list[ImageNode]:
        return self._sources if self._reads_other else self._sources[:1]

    def _make_kernel(self, device: Device) -> Any:
        return self._forward._gradient_kernel(device, self.is_secondary_source_filter)

    def _run(self, step: _Step, kernel: Any) -> None:
        g, x = step.image(self._sources[0]), step.image(self._sources[1])
        states = step.state(self._state)
        if not self._reads_other:
            if self._passes_on(step, kernel, g, states):
                step.share(self.result_image, self._sources[0])
                return
            x = _shape_only(x)
        step.set_image(self.result_image, kernel.encode_batch(step.cb, g, x, states))

    def _passes_on(self, step: _Step, kernel: Any, g: ImageBatch, states: Any) -> bool:
        """Whether this node holds its incoming gradient's image instead of a copy: the
        kernel's gradient is that image (`ArithmeticGradient._passes_gradient_on`), the
        graph would store it in the same format, and the result is the graph's own
        intermediate (not a result, an export, or an image of a user's allocator), and the
        incoming gradient is not a source of the graph."""
        graph, result = step.graph, self.result_image
        passes = getattr(kernel, "_passes_gradient_on", None)
        return (
            passes is not None
            # a user's source: its planned read count counts this node's one read
            and self._sources[0]._id not in graph._plan.topology.source_ids
            and result._id not in graph._plan.modes.kept
            and result.image_allocator is None
            and graph._plan.liveness.alloc_nodes.get(result._id) is result
            and (result.format or graph.format) is g.image._fmt
            and passes(g.image, states)
        )


register_gradient_nodes(
    _ArithmeticNode,
    lambda f, g: [ArithmeticGradientNode(g[0], f, secondary) for secondary in (False, True)],
)
register_gradient_sum(AdditionNode)
