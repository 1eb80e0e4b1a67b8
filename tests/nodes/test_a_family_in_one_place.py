"""A family added in one place: a kernel, its gradient kernel, a forward node and its gradient
node, all declared in this module, with no edit to any mpsnn module. The automatic training
graph finds the gradient node (``gradient_of=``), the trained graph matches PyTorch autograd in
float64, the gradient kernel passes the adjoint test, and the kernel and the forward node,
which declare their saved fields (``saved_fields``), are saved and loaded with no codec: a
graph using the family gives the same outputs after a load."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mpsnn as m
from mpsnn.cnn._pointwise import Pointwise, PointwiseBackward, PointwiseGradient, PointwiseKernel
from mpsnn.core.cnn_kernel import Records
from mpsnn.core.device import Device
from mpsnn.core.geometry import Window
from mpsnn.core.registry import gradient_kernels_of, gradient_of
from mpsnn.core.saved import Field
from mpsnn.core.state import ForwardRecord, GradientState
from mpsnn.graph.nodes import UnaryGradientNode, UnaryNode
from tests.graph._helpers import (
    DEV,
    F64,
    TOL,
    TorchConv,
    assert_close,
    conv_ds,
    encode,
    gen,
    mse_loss,
    mse_reference,
    rand,
    sgd1,
    training,
    training_seen,
)
from tests.helpers import assert_adjoint

# -- the family: y = factor * x**3 ----------------------------------------------------------


class ScaledCube(PointwiseKernel):
    """``y = factor * x**3`` per element."""

    _gradient_state_class = GradientState
    saved_fields = (Field("factor", float),)  # saved with the kernel configuration

    def __init__(self, device: Device, factor: float = 1.0) -> None:
        super().__init__(device)
        self.factor = float(factor)

    def _pointwise(self, window: Window, records: Records) -> Pointwise:
        factor = self.factor
        return lambda x: factor * x**3


@gradient_of(ScaledCube)
class ScaledCubeGradient(PointwiseGradient):
    """``dx = 3 * factor * x**2 * g`` (the derivative of the forward, times the incoming
    gradient; the forward's factor is the gradient kernel's own, as MPS gradient kernels are
    made with their forward's parameters)."""

    _state_class = GradientState

    def __init__(self, device: Device, factor: float = 1.0) -> None:
        super().__init__(device)
        self.factor = float(factor)

    def _pointwise_backward(self, record: ForwardRecord, states: list[Any]) -> PointwiseBackward:
        factor = self.factor
        return lambda g, x: 3.0 * factor * x * x * g


class ScaledCubeNode(UnaryNode):
    """The node of `ScaledCube`."""

    saved_fields = (Field("factor", float),)  # saved with what every node saves

    def __init__(self, source: m.ImageNode, factor: float = 1.0) -> None:
        super().__init__(source)
        self.factor = factor

    def _make_kernel(self, device: Device) -> Any:
        k = ScaledCube(device, self.factor)
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device) -> Any:
        return ScaledCubeGradient(device, self.factor)


class ScaledCubeGradientNode(UnaryGradientNode, gradient_of=ScaledCubeNode):
    """The gradient node of `ScaledCubeNode`."""


# -- what the declarations give ------------------------------------------------------------


def test_the_declarations_register_the_kernel_and_node_pairs() -> None:
    assert gradient_kernels_of(ScaledCube) == (ScaledCubeGradient,)
    x = m.ImageNode("x")
    node = ScaledCubeNode(x, 0.5)
    (grad,) = node.gradient_filters([m.ImageNode("g")])
    assert type(grad) is ScaledCubeGradientNode and grad.inference_node is node


def test_a_training_graph_through_the_new_family_matches_autograd() -> None:
    g = gen(71)
    dc = conv_ds(g, 3, 3, 2, 3, sgd1())
    x = m.ImageNode("x")
    conv = m.ConvolutionNode(x, dc)
    cube = ScaledCubeNode(conv.result_image, 0.25)
    graph, _, seen = training_seen(mse_loss(cube.result_image))
    assert "ScaledCubeGradientNode" in seen
    xt, target = rand(g, 2, 2, 5, 6), rand(g, 2, 3, 5, 6)
    tconv = TorchConv(dc)  # before the step updates the data source
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    xr = xt.clone().requires_grad_()
    mse_reference(0.25 * tconv(xr) ** 3, target).backward()
    assert_close(out.tensor, xr.grad, "dL/dx", TOL)
    tconv.check_step("convolution before the new family")


def test_the_new_gradient_kernel_is_the_adjoint_of_the_forward_linearization() -> None:
    g = gen(72)
    x0, v, w = rand(g, 2, 3, 4, 5), rand(g, 2, 3, 4, 5), rand(g, 2, 3, 4, 5)
    forward, gradient = ScaledCube(DEV, 0.75), ScaledCubeGradient(DEV, 0.75)
    cb = DEV.new_command_queue().command_buffer()
    x = m.Image.from_tensor(x0)
    state = forward.result_state(x)
    forward.encode(cb, x, destination_state=state)
    jtw = gradient.encode(cb, m.Image.from_tensor(w), x, state)
    cb.commit()
    cb.wait_until_completed()
    jv = 3.0 * 0.75 * x0 * x0 * v  # the forward's linearization at x0, applied to v
    assert_adjoint(jv, w, v, jtw.tensor, "ScaledCubeGradient")


# -- saving and loading the family ----------------------------------------------------------


def test_the_kernel_saves_and_loads_with_no_codec(tmp_path) -> None:
    k = ScaledCube(DEV, 0.375)
    k.label = "cube"
    m.save(k, tmp_path / "k.safetensors")
    back = m.load(tmp_path / "k.safetensors", "cpu")
    assert type(back) is ScaledCube and (back.factor, back.label) == (0.375, "cube")
    x = rand(gen(73), 2, 3, 4, 5)
    cb = DEV.new_command_queue().command_buffer()
    y, y_back = (kern.encode(cb, m.Image.from_tensor(x)) for kern in (k, back))
    cb.commit()
    cb.wait_until_completed()
    assert torch.equal(y.tensor, y_back.tensor)


def test_a_trained_graph_using_the_family_saves_and_loads_to_the_same_outputs(tmp_path) -> None:
    """Trained one step, then saved: the inference graph (the forward nodes and the trained
    weights) and the training graph (its gradient node is saved as its place in the training
    graph) load, with no codec registered by the family, to graphs that give the same outputs,
    bit for bit, and go on training the same."""
    assert m.io.registered_types()["ScaledCubeGradientNode"] is ScaledCubeGradientNode
    g = gen(74)
    x = m.ImageNode("x")
    conv = m.ConvolutionNode(x, conv_ds(g, 3, 3, 2, 3, sgd1()))
    cube = ScaledCubeNode(conv.result_image, 0.25)
    cube.label = "cube"
    train, _ = training(mse_loss(cube.result_image))
    batches = [(rand(g, 2, 2, 5, 6), rand(g, 2, 3, 5, 6)) for _ in range(3)]
    encode(train, [batches[0][0]], [m.LossLabels(DEV, batches[0][1])])  # one training step
    infer = m.Graph(DEV, cube.result_image, True)
    infer.format = F64
    m.save({"train": train, "infer": infer}, tmp_path / "graphs.safetensors")
    back = m.load(tmp_path / "graphs.safetensors", "cpu")
    nodes = [n for n in back["infer"]._plan.order if type(n) is ScaledCubeNode]
    assert [(n.factor, n.label) for n in nodes] == [(0.25, "cube")]
    xt = batches[1][0]
    assert torch.equal(encode(back["infer"], [xt]).tensor, encode(infer, [xt]).tensor)
    for xt, target in batches[1:]:  # the same training steps: the same gradients
        want = encode(train, [xt], [m.LossLabels(DEV, target)]).tensor
        got = encode(back["train"], [xt], [m.LossLabels(DEV, target)]).tensor
        assert torch.equal(got, want)
    assert torch.equal(encode(back["infer"], [xt]).tensor, encode(infer, [xt]).tensor)


def _gradient_node_named_twice(which: int) -> type:
    class TwiceNamedGradientNode(UnaryGradientNode):
        """A gradient node class whose name another class also has."""

    TwiceNamedGradientNode.which = which
    return TwiceNamedGradientNode


def test_a_gradient_node_name_two_classes_share_names_neither() -> None:
    from mpsnn.core.saved import declared_class

    first = _gradient_node_named_twice(1)
    assert declared_class("TwiceNamedGradientNode") is first
    _gradient_node_named_twice(2)  # the same module and qualified name: replaces the first
    assert declared_class("TwiceNamedGradientNode").which == 2

    class TwiceNamedGradientNode(UnaryGradientNode):  # another qualified name: ambiguous
        """The same name as the classes above."""

    assert declared_class("TwiceNamedGradientNode") is None
    assert "TwiceNamedGradientNode" not in m.io.registered_types()
    assert declared_class("ScaledCubeGradientNode") is ScaledCubeGradientNode


def test_a_forward_node_has_one_gradient_node_class() -> None:
    with pytest.raises(
        ValueError,
        match=r"\[OtherCubeGradientNode\] a forward node has one gradient node class: "
        r"ScaledCubeNode has ScaledCubeGradientNode, got a second",
    ):

        class OtherCubeGradientNode(UnaryGradientNode, gradient_of=ScaledCubeNode):
            """A second gradient node of the family's forward node."""

    x = m.ImageNode("x")
    (grad,) = ScaledCubeNode(x).gradient_filters([m.ImageNode("g")])
    assert type(grad) is ScaledCubeGradientNode  # the first stays


def test_a_saved_name_is_one_class_whichever_is_defined_first() -> None:
    """A gradient node class named like a class that declares its saved fields, or the other
    way round, raises when the second is defined; the first keeps the name."""
    from mpsnn.core.saved import declared_class

    class CubeWidget(ScaledCube):
        saved_fields = (Field("factor", float),)

    with pytest.raises(ValueError, match=r"\[CubeWidget\] a saved name must be declared by one"):

        def gradient_first() -> None:
            class CubeWidget(UnaryGradientNode):
                """A gradient node class of a declared class's name."""

        gradient_first()
    assert declared_class("CubeWidget") is CubeWidget

    def gradient() -> type:
        class CubeGizmo(UnaryGradientNode):
            """A gradient node class first."""

        return CubeGizmo

    made = gradient()
    with pytest.raises(ValueError, match=r"\[CubeGizmo\] a saved name must be declared by one"):

        class CubeGizmo(ScaledCube):
            saved_fields = (Field("factor", float),)

    assert declared_class("CubeGizmo") is made
