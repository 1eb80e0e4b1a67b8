"""A batch normalization run inside the residual addition after it
(`mpsnn.graph.plan_passes._normalized_sums`): ``f(bn(x) + r)`` in the addition's command, the
normalization's result never stored. The plan takes exactly the residual case; the step's values
are those of the unfused plan bit for bit (float32, bfloat16, step programs, a fallback at encode
time); ResNet-18 fuses its eight residual additions and trains as before."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import mpsnn as m
import mpsnn.graph.plan_passes as plan_passes
from tests.graph._helpers import (
    DEV,
    F32,
    conv_ds,
    encode,
    gen,
    mse_loss,
    rand,
    resnet18_two_steps,
    sgd1,
)


@contextlib.contextmanager
def normalization_fusion(enabled: bool) -> Iterator[None]:
    saved = plan_passes.FUSE_NORMALIZATIONS
    plan_passes.FUSE_NORMALIZATIONS = enabled
    try:
        yield
    finally:
        plan_passes.FUSE_NORMALIZATIONS = saved


def _small() -> m.SGD:
    return m.SGD(DEV, descriptor=m.OptimizerDescriptor(learning_rate=0.01))


def _bn(g: torch.Generator, c: int, opt=_small) -> m.TensorBatchNormalizationDataSource:
    gamma, beta = 1 + rand(g, c, scale=0.2).float(), rand(g, c, scale=0.2).float()
    return m.TensorBatchNormalizationDataSource(c, gamma=gamma, beta=beta, optimizer=opt())


def _block(g: torch.Generator, c: int = 4, relu_after_bn: bool = False, other_format=None):
    """``x -> conv -> BN -> ReLU (h) -> conv -> BN (b) -> relu(b + h) -> conv -> loss``
    (``other_format``: the shortcut ``tanh(h)`` stored in that format instead of ``h``)."""
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, conv_ds(g, 3, 3, c, c, _small(), dtype=torch.float32))
    h = m.NeuronReLUNode(m.BatchNormalizationNode(c1.result_image, _bn(g, c)).result_image)
    shortcut = h.result_image
    if other_format is not None:  # the shortcut through a node of its own format
        tanh = m.NeuronTanHNode(h.result_image)
        tanh.result_image.format = other_format
        shortcut = tanh.result_image
    c2 = m.ConvolutionNode(h.result_image, conv_ds(g, 3, 3, c, c, _small(), dtype=torch.float32))
    b = m.BatchNormalizationNode(c2.result_image, _bn(g, c))
    last = b.result_image
    if relu_after_bn:
        last = m.NeuronReLUNode(last).result_image
    add = m.AdditionNode(last, shortcut)
    out = m.NeuronReLUNode(add.result_image)
    c3 = m.ConvolutionNode(out.result_image, conv_ds(g, 3, 3, c, c, _small(), dtype=torch.float32))
    return b, add, c3


def _training(out: m.ImageNode, fmt: m.FeatureChannelFormat) -> m.Graph:
    (term,) = mse_loss(out).training_graph(None, None)
    graph = m.Graph(DEV, term.result_image)
    graph.format = fmt
    return graph


def test_the_plan_fuses_the_residual_normalization_and_says_so() -> None:
    b, add, c3 = _block(gen(1))
    graph = _training(c3.result_image, F32)
    assert dict(graph._plan.fusion.normalized_sums) == {add._id: b}
    assert dict(graph._plan.fusion.normalized_by) == {b._id: add}
    listing = graph.debug_description()
    assert "BatchNormalizationNode [BatchNormalizationStatistics+BatchNormalization] (t3) -> t4  " \
           "(training; normalized inside t5)" in listing  # fmt: skip
    assert "AdditionNode [Add] (t4, t2) -> t5  (training; fused RELU; normalizes t4 inside" in (
        listing
    )
    with normalization_fusion(False):
        off = _training(_block(gen(1))[2].result_image, F32)
    assert not off._plan.fusion.normalized_sums and "normalizes" not in off.debug_description()


def test_what_is_not_fused() -> None:
    # a ReLU of the normalization's own before the sum: that neuron runs in the normalization
    b, add, c3 = _block(gen(2), relu_after_bn=True)
    assert not _training(c3.result_image, F32)._plan.fusion.normalized_sums
    # the normalization's result read by another node too
    b, add, c3 = _block(gen(2))
    extra = m.NeuronSigmoidNode(b.result_image)
    (term,) = mse_loss(c3.result_image).training_graph(None, None)
    graph = m.Graph.from_results(DEV, [term.result_image, extra.result_image])
    assert not graph._plan.fusion.normalized_sums
    # an exported normalization result
    b, add, c3 = _block(gen(2))
    b.result_image.export_from_graph = True
    assert not _training(c3.result_image, F32)._plan.fusion.normalized_sums
    # inference: the normalization runs on running statistics, in its own command
    b, add, c3 = _block(gen(2))
    assert not m.Graph(DEV, c3.result_image)._plan.fusion.normalized_sums
    # a normalization of a graph source: its source's read count is the caller's
    x = m.ImageNode("x")
    bn = m.BatchNormalizationNode(x, _bn(gen(2), 4))
    y = m.ImageNode("y")
    add = m.AdditionNode(bn.result_image, y)
    relu = m.NeuronReLUNode(add.result_image)
    conv = m.ConvolutionNode(relu.result_image, conv_ds(gen(2), 3, 3, 4, 4, sgd1()))
    terminals = mse_loss(conv.result_image).training_graph(None, None)
    graph = m.Graph.from_results(DEV, [t.result_image for t in terminals])
    assert len(terminals) == 2 and not graph._plan.fusion.normalized_sums


def _steps(fused: bool, fmt: m.FeatureChannelFormat, other_format=None) -> list[torch.Tensor]:
    g = gen(3)
    with normalization_fusion(fused):
        c3 = _block(g, c=8, other_format=other_format)[2]
        graph = _training(c3.result_image, fmt)
    assert bool(graph._plan.fusion.normalized_sums) is fused
    out = []
    for _ in range(3):  # the later steps run the step program the first one lowered
        xt, target = rand(g, 4, 8, 9, 9).float(), rand(g, 4, 8, 9, 9).float()
        out.append(encode(graph, [xt], [m.LossLabels(DEV, target)]).tensor.clone())
    assert graph._programs[0].uses == 2  # steps 2 and 3 ran the lowered program
    for n in graph._plan.order:
        ds = getattr(n, "data_source", None)
        for name in ("weights", "gamma", "beta", "mean", "variance"):
            if hasattr(ds, name):
                out.append(getattr(ds, name)().clone())
    return out


@pytest.mark.parametrize("fmt", [F32, m.FeatureChannelFormat.BFLOAT16])
def test_the_fused_step_gives_the_unfused_bits(fmt, monkeypatch) -> None:
    import mpsnn.cnn.arithmetic as arith

    calls = []
    real = arith.normalized_add_activation
    monkeypatch.setattr(arith, "normalized_add_activation", lambda *a: calls.append(1) or real(*a))
    fused = _steps(True, fmt)
    assert len(calls) == 3  # one fused pass a step
    unfused = _steps(False, fmt)
    assert len(calls) == 3
    assert len(fused) == len(unfused) > 3
    for a, b in zip(fused, unfused, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)


def test_an_operand_in_another_format_is_normalized_by_its_own_command(monkeypatch) -> None:
    """The plan does not look at the other operand's format; the encode then runs the
    normalization as its own command before the addition: the same values."""
    import mpsnn.cnn.arithmetic as arith

    calls = []
    real = arith.normalized_add_activation
    monkeypatch.setattr(arith, "normalized_add_activation", lambda *a: calls.append(1) or real(*a))
    fused = _steps(True, F32, other_format=m.FeatureChannelFormat.FLOAT16)
    assert calls == []  # the addition read a stored normalization
    unfused = _steps(False, F32, other_format=m.FeatureChannelFormat.FLOAT16)
    for a, b in zip(fused, unfused, strict=True):
        assert torch.equal(a, b)


def test_resnet18_fuses_its_eight_residual_additions_and_trains_the_same() -> None:
    with normalization_fusion(True):
        graph, on = resnet18_two_steps()
    assert len(graph._plan.fusion.normalized_sums) == 8
    with normalization_fusion(False):
        graph, off = resnet18_two_steps()
    assert not graph._plan.fusion.normalized_sums
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def _compare(build, steps: int = 2, setup=None) -> None:
    """``build(g)`` -> the last image node: trained with the fusion on and off (``setup(graph,
    fused)`` before the steps), equal bit for bit."""
    results = []
    for fused in (True, False):
        g = gen(4)
        with normalization_fusion(fused):
            graph = _training(build(g), F32)
        if setup is not None:
            setup(graph, fused)
        out = []
        for _ in range(steps):
            xt, target = rand(g, 4, 8, 9, 9).float(), rand(g, 4, 8, 9, 9).float()
            out.append(encode(graph, [xt], [m.LossLabels(DEV, target)]).tensor.clone())
        results.append(out)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def _conv(g: torch.Generator, source: m.ImageNode, c: int = 8) -> m.ConvolutionNode:
    return m.ConvolutionNode(source, conv_ds(g, 3, 3, c, c, _small(), dtype=torch.float32))


def test_an_input_stored_in_another_format_gets_the_normalizations_own_command() -> None:
    """The normalization's input is a ReLU fused into a convolution whose result is stored in
    float16 (the node itself names no format), and so is the shortcut: the encode sees the
    formats and runs the normalization as its own command."""

    def build(g: torch.Generator) -> m.ImageNode:
        h = m.NeuronReLUNode(m.BatchNormalizationNode(_conv(g, m.ImageNode("x")).result_image,
                                                      _bn(g, 8)).result_image)  # fmt: skip
        tanh = m.NeuronTanHNode(h.result_image)
        tanh.result_image.format = m.FeatureChannelFormat.FLOAT16
        c2 = _conv(g, h.result_image)
        c2.result_image.format = m.FeatureChannelFormat.FLOAT16
        b = m.BatchNormalizationNode(m.NeuronReLUNode(c2.result_image).result_image, _bn(g, 8))
        add = m.AdditionNode(b.result_image, tanh.result_image)
        return _conv(g, m.NeuronReLUNode(add.result_image).result_image).result_image

    _compare(build)


def test_the_normalization_as_the_second_operand() -> None:
    def build(g: torch.Generator) -> m.ImageNode:
        h = m.NeuronReLUNode(m.BatchNormalizationNode(_conv(g, m.ImageNode("x")).result_image,
                                                      _bn(g, 8)).result_image)  # fmt: skip
        b = m.BatchNormalizationNode(_conv(g, h.result_image).result_image, _bn(g, 8))
        add = m.AdditionNode(h.result_image, b.result_image)  # the shortcut first
        return _conv(g, m.NeuronReLUNode(add.result_image).result_image).result_image

    _compare(build)


def test_padding_policies_and_subclasses_keep_the_normalizations_own_command(monkeypatch) -> None:
    from mpsnn.cnn.normalization import BatchNormalization
    from mpsnn.core.geometry import PaddingMethod

    class Shift:
        """Same size, read one pixel to the right with clamped edges."""

        label = None
        padding_method = PaddingMethod.SIZE_SAME | PaddingMethod.CUSTOM

        def destination_image_descriptor(self, images, states, kernel, descriptor):
            kernel.offset = m.Offset(1, 0, 0)
            kernel.edge_mode = m.EdgeMode.CLAMP
            return descriptor

    b, _, c3 = _block(gen(5))
    b.padding_policy = Shift()
    assert not _training(c3.result_image, F32)._plan.fusion.normalized_sums

    class Subclass(m.BatchNormalizationNode):
        def _make_kernel(self, device):
            return super()._make_kernel(device)

    def build(g: torch.Generator) -> m.ImageNode:
        h = m.NeuronReLUNode(m.BatchNormalizationNode(_conv(g, m.ImageNode("x")).result_image,
                                                      _bn(g, 8)).result_image)  # fmt: skip
        b = Subclass(_conv(g, h.result_image).result_image, _bn(g, 8))
        add = m.AdditionNode(b.result_image, h.result_image)
        return _conv(g, m.NeuronReLUNode(add.result_image).result_image).result_image

    assert not _training(build(gen(5)), F32)._plan.fusion.normalized_sums

    # a kernel that is not the plain BatchNormalization, or one with an offset, at encode time
    class Counted(BatchNormalization):
        calls = 0

        def encode_batch(self, *args, **kwargs):
            type(self).calls += 1
            return super().encode_batch(*args, **kwargs)

    def swap(graph: m.Graph, fused: bool) -> None:
        (bn,) = graph._plan.fusion.normalized_sums.values() if fused else [None]
        if bn is not None:
            graph._plan.kernels[bn._id][1].__class__ = Counted

    _compare(lambda g: _block(g, c=8)[2].result_image, setup=swap)
    assert Counted.calls == 1  # the first step encoded the normalization itself (and lowered)

    def offset(graph: m.Graph, fused: bool) -> None:
        for n in graph._plan.order:
            if isinstance(n, m.BatchNormalizationNode):
                graph._plan.kernels[n._id][1].offset = m.Offset(1, 0, 0)

    _compare(lambda g: _block(g, c=8)[2].result_image, setup=offset)


def test_the_reported_memory_does_not_count_the_normalization_never_stored() -> None:
    totals = []
    for fused in (True, False):
        g = gen(6)
        with normalization_fusion(fused):
            graph = _training(_block(g, c=8)[2].result_image, F32)
        encode(graph, [rand(g, 4, 8, 9, 9).float()], [m.LossLabels(DEV, rand(g, 4, 8, 9, 9))])
        report = graph._last_plan_report
        totals.append(graph._total(report["images"]))
    assert totals[1] - totals[0] == 4 * 8 * 9 * 9 * 4  # one float32 image fewer


def test_with_the_input_convolution_recompute() -> None:
    """The normalization's input is the first layer's result, recomputed for the backward:
    it must stay live for the addition that normalizes it."""

    def build(g: torch.Generator) -> m.ImageNode:
        x = m.ImageNode("x")
        b = m.BatchNormalizationNode(_conv(g, x).result_image, _bn(g, 8))
        add = m.AdditionNode(b.result_image, x)
        return _conv(g, m.NeuronReLUNode(add.result_image).result_image).result_image

    def inputs(graph: m.Graph, fused: bool) -> None:
        graph.recompute_input_convolution_results = True
        assert bool(graph._plan.fusion.normalized_sums) is fused

    _compare(build, steps=3, setup=inputs)
