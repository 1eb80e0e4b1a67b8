"""Recomputed input convolution results (`Graph.recompute_input_convolution_results`): the result
of a convolution that reads one of the graph's source images is freed after its last forward
reader and computed again, by the same kernel from the same source and weights, before the first
gradient that reads it. The step's values do not change (bit for bit against keeping the image,
in every combination with the normalization recompute, and against PyTorch autograd in
float64); the planned peak falls; the source's read count includes the extra read."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from mpsnn.graph.plan_recompute import INPUT_CONVOLUTION, NORMALIZATION
from tests.graph._helpers import (
    DEV,
    F32,
    conv_ds,
    encode,
    gen,
    mse_loss,
    new_cb,
    rand,
    resnet18_two_steps,
    sgd1,
    training,
)
from tests.graph.test_graph_recompute import (
    _chain,
    _consumers,
    _small_sgd,
    check_step_against_autograd,
)

_COMBOS = [(False, False), (True, False), (False, True), (True, True)]


def _set(graph: m.Graph, normalization: bool, inputs: bool) -> m.Graph:
    graph.recompute_normalization_results = normalization
    graph.recompute_input_convolution_results = inputs
    return graph


def test_the_first_convolution_is_planned_and_runs_before_the_normalization_it_feeds() -> None:
    g = gen(81)
    _, out, _, bns = _chain(g, blocks=2)
    graph, _ = training(mse_loss(out))
    assert graph.recompute_input_convolution_results is False  # the default
    nodes = _consumers(out)
    first = nodes[0]
    assert isinstance(first, m.ConvolutionNode)
    rec = graph._plan.recompute
    (inp,) = [r for rs in rec.inputs.values() for r in rs]
    assert (inp.node, inp.kind, inp.source, inp.reads) == (first, INPUT_CONVOLUTION, 0, 1)
    assert rec.input_reads[inp.key] == 1  # read in the forward by the normalization only
    # alone, it runs before its own first gradient reader: the first normalization's gradient
    (at,) = [i for i, rs in rec.inputs.items() if inp in rs]
    order = graph._plan.order
    bn_gradient = order[[n._id for n in order].index(at)]
    assert isinstance(bn_gradient, m.GradientFilterNode)
    assert bn_gradient.inference_node is bns[0]
    # with the normalization recompute, that normalization's result is recomputed from it
    # earlier (before the next convolution's gradient): the convolution runs first, there
    (bn0,) = [r for rs in rec.before.values() for r in rs if r.node is bns[0]]
    (both_at,) = [i for i, rs in rec.both.items() if inp in rs]
    assert rec.both[both_at][:2] == (inp, bn0) and bn0.kind == NORMALIZATION
    assert [n._id for n in order].index(both_at) < [n._id for n in order].index(at)
    assert rec.selected(False, False) == {} and rec.selected(True, False) is rec.before
    assert rec.selected(False, True) is rec.inputs and rec.selected(True, True) is rec.both
    # the listing follows the settings
    assert "recomputes t0 first" not in graph.debug_description()
    _set(graph, True, True)
    listing = graph.debug_description()
    assert "0 ConvolutionNode [Convolution] (in0('x')) -> t0  (training)\n" in listing
    assert "(t0) -> t1  (training; fused RELU; frees t0 until recomputed)" in listing
    assert "frees t0 until recomputed" in listing
    assert "(recomputes t0 first; recomputes t2 first;" in listing


def test_the_step_matches_autograd_with_both_recomputes() -> None:
    g = gen(82)
    _, out, convs, bns = _chain(g)
    graph, _ = training(mse_loss(out))
    _set(graph, True, True)
    check_step_against_autograd(g, graph, convs, bns)


def _run_steps(normalization: bool, inputs: bool, fmt: m.FeatureChannelFormat, steps: int = 3):
    g = gen(83)
    _, out, convs, bns = _chain(g, blocks=2, channels=8, dtype=torch.float32, opt=_small_sgd)
    graph, _ = training(mse_loss(out), fmt=fmt)
    _set(graph, normalization, inputs)
    results = []
    for _ in range(steps):  # the later steps run the step program the first one lowered
        xt, target = rand(g, 4, 8, 16, 16).float(), rand(g, 4, 8, 16, 16).float()
        dx = encode(graph, [xt], [m.LossLabels(DEV, target)])
        results.append(dx.tensor.clone())
    values = results + [ds.weights().clone() for ds in convs]
    values += [bn.data_source.gamma().clone() for bn in bns]
    return graph, values


@pytest.mark.parametrize("fmt", [F32, m.FeatureChannelFormat.BFLOAT16])
def test_every_combination_gives_the_same_bits_and_the_input_recompute_lowers_the_peak(
    fmt,
) -> None:
    runs = {combo: _run_steps(*combo, fmt) for combo in _COMBOS}
    reference = runs[(False, False)][1]
    for combo, (_, values) in runs.items():
        for a, b in zip(reference, values, strict=True):
            assert torch.isfinite(a).all() and torch.equal(a, b), combo
    image = 4 * 8 * 16 * 16 * (4 if fmt is F32 else 2)  # the first convolution's result
    for normalization in (False, True):
        kept = runs[(normalization, False)][0]._last_plan_report
        freed = runs[(normalization, True)][0]._last_plan_report
        assert freed["peak_bytes"] <= kept["peak_bytes"] - image, normalization
        kept_graph, freed_graph = runs[(normalization, False)][0], runs[(normalization, True)][0]
        total_kept = kept_graph._total(kept["images"])
        assert freed_graph._total(freed["images"]) == total_kept + image  # made again once


def test_changing_the_setting_lowers_the_step_again() -> None:
    g = gen(84)
    _, out, _, _ = _chain(g, blocks=1, dtype=torch.float32, opt=_small_sgd)
    graph, _ = training(mse_loss(out), fmt=F32)
    data = [(rand(g, 2, 4, 6, 6).float(), rand(g, 2, 4, 6, 6).float()) for _ in range(4)]
    for xt, target in data[:2]:
        encode(graph, [xt], [m.LossLabels(DEV, target)])
    assert len(graph._programs) == 1
    graph.recompute_input_convolution_results = True
    for xt, target in data[2:]:
        encode(graph, [xt], [m.LossLabels(DEV, target)])
    assert len(graph._programs) == 2  # the first program read the old setting
    assert "frees t0 until recomputed" in graph.debug_description()


def test_the_source_read_count_includes_the_recompute() -> None:
    g = gen(85)
    _, out, _, _ = _chain(g, blocks=1)
    graph, _ = training(mse_loss(out))
    reads = graph.read_count_for_source_image(0)
    graph.recompute_input_convolution_results = True
    assert graph.read_count_for_source_image(0) == reads + 1
    xt, target = rand(g, 2, 4, 5, 5), rand(g, 2, 4, 5, 5)

    def temporary_source(cb: m.CommandBuffer, count: int) -> m.TemporaryImage:
        t = m.TemporaryImage(cb, m.ImageDescriptor(m.FeatureChannelFormat.FLOAT64, 5, 5, 4, 2))
        for i in range(2):
            t.write_bytes(xt[i].numpy(), m.DataLayout.FEATURE_CHANNELS_HEIGHT_WIDTH, i)
        t.read_count = count
        return t

    cb = new_cb()
    src = temporary_source(cb, reads + 1)
    out_batch = graph.encode_batch(cb, [m.ImageBatch(src)], [m.LossLabels(DEV, target)])
    assert src.read_count == 0  # the last read released it
    cb.commit()
    cb.wait_until_completed()
    assert out_batch is not None and torch.isfinite(out_batch.tensor).all()
    # the count without the recompute's read: the source is released before the recompute
    cb = new_cb()
    src = temporary_source(cb, reads)
    with pytest.raises(m.StaleResourceError):
        graph.encode_batch(cb, [m.ImageBatch(src)], [m.LossLabels(DEV, target)])


def test_what_is_not_recomputed() -> None:
    g = gen(86)

    def planned(graph: m.Graph) -> list:
        return [r.node for rs in graph._plan.recompute.inputs.values() for r in rs]

    # only the convolution that reads a graph source: the chain's later ones read images
    _, out, _, _ = _chain(g, blocks=2)
    graph, _ = training(mse_loss(out))
    assert planned(graph) == [_consumers(out)[0]]
    # an exported result is kept
    _, out, _, _ = _chain(g, blocks=1)
    _consumers(out)[0].result_image.export_from_graph = True
    graph, _ = training(mse_loss(out))
    assert planned(graph) == []
    # a convolution straight into another: the second's weight gradient reads the first's
    # result (planned), the first's reads the source again (one read more with the setting)
    c1 = m.ConvolutionNode(m.ImageNode("x"), conv_ds(g, 3, 3, 4, 4, sgd1()))
    c2 = m.ConvolutionNode(c1.result_image, conv_ds(g, 3, 3, 4, 4, sgd1()))
    graph, _ = training(mse_loss(c2.result_image))
    assert planned(graph) == [c1] and graph.read_count_for_source_image(0) == 2
    graph.recompute_input_convolution_results = True
    assert graph.read_count_for_source_image(0) == 3
    # a frozen first layer (no weight gradient): its result is still read by the second
    # layer's weight gradient, and the source is read once more for it
    c1.trainable = False
    graph, _ = training(mse_loss(c2.result_image))
    reads = graph.read_count_for_source_image(0)
    graph.recompute_input_convolution_results = True
    assert planned(graph) == [c1] and graph.read_count_for_source_image(0) == reads + 1
    # inference: nothing reads anything in a backward
    _, out, _, _ = _chain(g)
    assert planned(m.Graph(DEV, out)) == []


def test_a_first_convolution_with_a_fused_relu_before_a_pooling_is_recomputed() -> None:
    """LeNet's first layer: convolution + ReLU (fused) -> max pooling, whose gradient reads the
    pooling's source again: recomputed, the same bits on and off."""

    def run(inputs: bool) -> list[torch.Tensor]:
        g = gen(87)
        conv = m.ConvolutionNode(m.ImageNode("x"), conv_ds(g, 3, 3, 2, 4, sgd1()))
        relu = m.NeuronReLUNode(conv.result_image)
        pool = m.PoolingMaxNode(relu.result_image, 2)
        last = m.ConvolutionNode(pool.result_image, conv_ds(g, 3, 3, 4, 3, sgd1()))
        graph, _ = training(mse_loss(last.result_image))
        graph.recompute_input_convolution_results = inputs
        (r,) = [r for rs in graph._plan.recompute.inputs.values() for r in rs]
        assert r.node is conv and relu.result_image._id in r.ids
        out = []
        for _ in range(2):
            xt, target = rand(g, 2, 2, 8, 8), rand(g, 2, 3, 4, 4)
            out.append(encode(graph, [xt], [m.LossLabels(DEV, target)]).tensor.clone())
        if inputs:
            assert "(t1) -> t2  (training; frees t1 until recomputed)" in graph.debug_description()
        return out

    on, off = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def test_the_option_must_be_a_bool() -> None:
    g = gen(88)
    _, out, _, _ = _chain(g, blocks=1)
    graph, _ = training(mse_loss(out))
    graph.recompute_input_convolution_results = "yes"
    xt, target = rand(g, 1, 4, 5, 5), rand(g, 1, 4, 5, 5)
    with pytest.raises(
        TypeError,
        match=r"^\[Graph\] recompute_input_convolution_results must be a bool, got 'yes'$",
    ):
        graph.encode_batch(new_cb(), [m.ImageBatch.from_tensor(xt)], [m.LossLabels(DEV, target)])


def test_resnet18_recomputes_its_stem_and_trains_the_same() -> None:
    def configure(inputs: bool):
        def apply(graph: m.Graph) -> None:
            assert graph.recompute_input_convolution_results is True  # the model's choice
            (r,) = [r for rs in graph._plan.recompute.inputs.values() for r in rs]
            assert r.node is graph._plan.order[0]  # the stem
            graph.recompute_input_convolution_results = inputs

        return apply

    (_, on), (_, off) = resnet18_two_steps(configure(True)), resnet18_two_steps(configure(False))
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def test_a_forward_reader_after_the_normalization_recompute_keeps_the_first_result() -> None:
    """A second result reads the first convolution's result after the backward has begun
    (a graph of several results): when the normalization recompute needs that result, it is
    still the forward image (its last forward reader has not run), so nothing runs early and
    every combination of the settings gives the same values."""
    from tests.graph._helpers import F64

    def run(normalization: bool, inputs: bool) -> list[torch.Tensor]:
        g = gen(89)
        _, out, _, bns = _chain(g, blocks=1)
        conv1 = bns[0].source_images[0].producer
        (term,) = mse_loss(out).training_graph(None, None)
        conv2_gradient = term
        for _ in range(3):  # loss gradient -> ... -> the second convolution's gradient
            conv2_gradient = conv2_gradient.source_images[0].producer
        assert isinstance(conv2_gradient, m.ConvolutionGradientNode)
        side = m.NeuronReLUNode(conv1.result_image)  # a forward reader of the first result
        graph = m.Graph.from_results(
            DEV, [conv2_gradient.result_image, side.result_image, term.result_image]
        )
        graph.format = F64
        _set(graph, normalization, inputs)
        data = gen(5)
        xt, target = rand(data, 2, 4, 6, 6), rand(data, 2, 4, 6, 6)
        result = encode(graph, [xt], [m.LossLabels(DEV, target)])
        return [result.tensor.clone()] + [i.tensor.clone() for i in graph.intermediate_images]

    reference = run(False, False)
    for combo in _COMBOS[1:]:
        got = run(*combo)
        assert all(torch.equal(a, b) for a, b in zip(reference, got, strict=True)), combo


def test_a_convolution_transpose_is_not_recomputed() -> None:
    """A transpose's encode reads its paired convolution's state (the size it undoes), which a
    recompute would not pass: it keeps its result."""
    g = gen(90)
    x, z = m.ImageNode("x"), m.ImageNode("z")
    conv = m.ConvolutionNode(x, conv_ds(g, 3, 3, 2, 3, sgd1()))
    conv.padding_policy = m.DefaultPadding(m.PaddingMethod.SIZE_VALID_ONLY)  # 7x7 -> 5x5
    transpose = m.ConvolutionTransposeNode(z, conv.result_state, conv_ds(g, 3, 3, 3, 2, sgd1()))
    last = m.ConvolutionNode(transpose.result_image, conv_ds(g, 3, 3, 2, 2, sgd1()))
    graph, _ = training(mse_loss(last.result_image))
    graph.recompute_input_convolution_results = True
    planned = [r.node for rs in graph._plan.recompute.inputs.values() for r in rs]
    assert transpose not in planned
    data = gen(5)
    by_handle = {"x": rand(data, 2, 2, 7, 7), "z": rand(data, 2, 3, 5, 5)}
    images = [by_handle[h] for h in graph.source_image_handles]
    out = encode(graph, images, [m.LossLabels(DEV, rand(data, 2, 2, 7, 7))])
    assert torch.isfinite(out.tensor).all()  # ran: the transpose kept its size
