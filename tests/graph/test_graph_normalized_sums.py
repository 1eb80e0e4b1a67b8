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
from tests.graph._helpers import DEV, F32, conv_ds, encode, gen, mse_loss, rand, sgd1


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
    from mpsnn.models import ResNet18

    def run(fused: bool) -> tuple[int, list[torch.Tensor]]:
        opt = m.SGD(DEV, descriptor=m.OptimizerDescriptor(learning_rate=0.1))
        with normalization_fusion(fused):
            net = ResNet18(DEV, opt, seed=3, width=4, input_shape=(3, 12, 12))
            graph = net.training_graph(4, storage=m.FeatureChannelFormat.BFLOAT16)
        data = torch.Generator().manual_seed(5)
        for _ in range(2):
            x = torch.randn(4, 3, 12, 12, generator=data)
            labels = torch.randint(0, 10, (4,), generator=data)
            onehot = torch.nn.functional.one_hot(labels, 10).double().reshape(4, 10, 1, 1)
            encode(graph, [x], [[m.LossLabels(DEV, onehot[i : i + 1]) for i in range(4)]])
        weights = [ds.weights().clone() for ds in net.data_sources if hasattr(ds, "weights")]
        return len(graph._plan.fusion.normalized_sums), weights

    (n_on, on), (n_off, off) = run(True), run(False)
    assert (n_on, n_off) == (8, 0)
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))
