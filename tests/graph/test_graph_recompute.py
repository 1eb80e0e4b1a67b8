"""Recomputed normalization results (`Graph.recompute_normalization_results`): a training-mode
batch normalization's result that a gradient reads again (a convolution's weight gradient reads
its source) is freed after its last forward reader and computed again before its first gradient
reader. The step's values do not change (bit for bit against keeping the image, and against
PyTorch autograd in float64); the planned peak falls; what must not be recomputed is not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.graph._helpers import (
    DEV,
    F32,
    TOL,
    RecordingAllocator,
    TorchConv,
    assert_close,
    conv_ds,
    encode,
    gen,
    mse_loss,
    mse_reference,
    new_cb,
    peak_and_total,
    rand,
    resnet18_two_steps,
    sgd1,
    training,
)


def _chain(g: torch.Generator, blocks: int = 2, channels: int = 4, dtype=torch.float64, opt=sgd1):
    """``x -> [conv -> BN -> ReLU] * blocks -> conv``: each BN + ReLU result is read by the next
    convolution (forward) and by that convolution's weight gradient (backward)."""
    x = m.ImageNode("x")
    img, convs, bns = x, [], []
    for _ in range(blocks):
        # no bias before batch normalization: its gradient is zero up to rounding
        ds = conv_ds(g, 3, 3, channels, channels, opt(), bias=False, dtype=dtype)
        bn_ds = m.TensorBatchNormalizationDataSource(
            channels,
            gamma=(1 + rand(g, channels, scale=0.2)).to(dtype),
            beta=rand(g, channels, scale=0.2).to(dtype),
            optimizer=opt(),
        )
        bn = m.BatchNormalizationNode(m.ConvolutionNode(img, ds).result_image, bn_ds)
        img = m.NeuronReLUNode(bn.result_image).result_image
        convs.append(ds)
        bns.append(bn)
    last = conv_ds(g, 3, 3, channels, channels, opt(), dtype=dtype)
    convs.append(last)
    out = m.ConvolutionNode(img, last).result_image
    return x, out, convs, bns


def _consumers(out: m.ImageNode) -> list:
    """The filter nodes from ``out`` back to the sources, nearest last."""
    nodes, img = [], out
    while img.producer is not None:
        nodes.append(img.producer)
        img = img.producer.source_images[0]
    return nodes[::-1]


def check_step_against_autograd(g: torch.Generator, graph: m.Graph, convs, bns) -> None:
    """One step of `_chain`'s training ``graph`` on random data equals PyTorch autograd in
    float64: the input gradient, every convolution's step and gamma/beta's gradients."""
    twins = [TorchConv(ds) for ds in convs]
    affine = [
        tuple(
            t.detach().clone().requires_grad_()
            for t in (bn.data_source.gamma(), bn.data_source.beta())
        )
        for bn in bns
    ]  # before the step updates them
    xt, target = rand(g, 2, 4, 7, 6), rand(g, 2, 4, 7, 6)
    dx = encode(graph, [xt], [m.LossLabels(DEV, target)])
    xr = xt.clone().requires_grad_()
    h = xr
    for tconv, bn, (gamma, beta) in zip(twins[:-1], bns, affine, strict=True):
        eps = bn.data_source.epsilon
        z = F.batch_norm(tconv(h), None, None, gamma, beta, training=True, eps=eps)
        h = F.relu(z)
    mse_reference(twins[-1](h), target).backward()
    assert_close(dx.tensor, xr.grad, "dL/dx", TOL)
    for i, tconv in enumerate(twins):
        tconv.check_step(f"convolution {i}")
    for i, (bn, (gamma, beta)) in enumerate(zip(bns, affine, strict=True)):
        ds = bn.data_source
        assert_close(gamma.detach() - ds.gamma(), gamma.grad, f"gamma {i}", TOL)
        assert_close(beta.detach() - ds.beta(), beta.grad, f"beta {i}", TOL)


def _planned(graph: m.Graph) -> list[m.BatchNormalizationNode]:
    return [r.node for plans in graph._plan.recompute.before.values() for r in plans]


def test_the_chain_recomputes_every_normalization_result_and_matches_autograd() -> None:
    g = gen(71)
    _, out, convs, bns = _chain(g)
    graph, _ = training(mse_loss(out))
    assert graph.recompute_normalization_results is True  # the default
    assert _planned(graph) == bns
    listing = graph.debug_description()
    assert listing.count("until recomputed") == 2 and listing.count("first;") == 2

    check_step_against_autograd(g, graph, convs, bns)


def _small_sgd() -> m.SGD:
    return m.SGD(DEV, descriptor=m.OptimizerDescriptor(learning_rate=0.01))


def _run_steps(recompute: bool, fmt: m.FeatureChannelFormat, steps: int = 3):
    g = gen(72)
    _, out, convs, bns = _chain(g, blocks=3, channels=8, dtype=torch.float32, opt=_small_sgd)
    graph, _ = training(mse_loss(out), fmt=fmt)
    graph.recompute_normalization_results = recompute
    results = []
    for _ in range(steps):
        xt, target = rand(g, 4, 8, 16, 16).float(), rand(g, 4, 8, 16, 16).float()
        dx = encode(graph, [xt], [m.LossLabels(DEV, target)])
        results.append(dx.tensor.clone())
    weights = [ds.weights().clone() for ds in convs]
    gammas = [bn.data_source.gamma().clone() for bn in bns]
    return graph, results, weights, gammas


@pytest.mark.parametrize("fmt", [F32, m.FeatureChannelFormat.BFLOAT16])
def test_recomputing_changes_no_value_and_lowers_the_planned_peak(fmt) -> None:
    kept, dx_kept, w_kept, gamma_kept = _run_steps(False, fmt)
    freed, dx_freed, w_freed, gamma_freed = _run_steps(True, fmt)
    for a, b in zip(dx_kept + w_kept + gamma_kept, dx_freed + w_freed + gamma_freed, strict=True):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    peak_kept, peak_freed = (g._last_plan_report["peak_bytes"] for g in (kept, freed))
    total_kept, total_freed = (g._total(g._last_plan_report["images"]) for g in (kept, freed))
    # three 4x8x16x16 results are freed at the top of the backward; one is made again at a time
    image = 4 * 8 * 16 * 16 * (4 if fmt is F32 else 2)
    assert peak_freed <= peak_kept - 2 * image, (peak_kept, peak_freed)
    assert total_freed == total_kept + 3 * image  # the recomputed images
    assert peak_and_total(freed)[0] < peak_and_total(kept)[0]  # and debug_description says so
    assert "until recomputed" not in kept.debug_description()


def test_a_recomputed_result_is_released_after_its_last_gradient_reader() -> None:
    g = gen(73)
    _, out, _, bns = _chain(g, blocks=1)
    graph, _ = training(mse_loss(out))
    (plan,) = [r for plans in graph._plan.recompute.before.values() for r in plans]
    # read in the forward by the fused ReLU (an alias) and the next convolution; in the
    # backward by that convolution's gradient only (the ReLU's gradient passes its incoming
    # gradient on: batch normalization's gradient applies the ReLU's)
    assert graph._plan.recompute.reads[plan.key] == 2 and plan.reads == 1
    listing = graph.debug_description()
    assert "3 ConvolutionNode [Convolution] (t2) -> t3  (training; frees t2 until recomputed)" in (
        listing
    )
    assert "(t4, t2) -> t5  (recomputes t2 first; frees t4, t2)" in listing
    assert "[_PassGradient] (t5, t1) -> t6\n" in listing
    xt, target = rand(g, 2, 4, 5, 5), rand(g, 2, 4, 5, 5)
    kernel = graph._plan.kernels[bns[0]._id][1]  # (statistics, normalization)
    made = []

    def recording(*args):
        made.append(type(kernel).encode_batch(kernel, *args).image)
        return m.ImageBatch(made[-1])

    kernel.encode_batch = recording
    cb = new_cb()
    graph.encode_batch(cb, [m.ImageBatch.from_tensor(xt)], [m.LossLabels(DEV, target)])
    forward_image, recomputed = made  # the normalization ran twice: forward, then recomputed
    assert recomputed is not forward_image
    cb.commit()
    cb.wait_until_completed()
    with pytest.raises(m.StaleResourceError):
        forward_image.tensor  # noqa: B018 - freed after the forward
    with pytest.raises(m.StaleResourceError):
        recomputed.tensor  # noqa: B018 - freed after its last gradient reader


def test_kept_results_sources_and_inference_graphs_are_not_recomputed() -> None:
    g = gen(74)
    # an exported normalization result is kept: the graph never frees it
    _, out, _, bns = _chain(g, blocks=2)
    bns[0].result_image.export_from_graph = True
    graph, _ = training(mse_loss(out))
    assert _planned(graph) == [bns[1]]
    # a (fused ReLU's) result with an allocator of its own: that allocator makes the image
    _, out, _, bns = _chain(g, blocks=2)
    relu = [n for n in _consumers(out) if isinstance(n, m.NeuronReLUNode)][-1]
    allocator = RecordingAllocator()
    relu.result_image.image_allocator = allocator
    graph, _ = training(mse_loss(out))
    assert _planned(graph) == [bns[0]]
    encode(graph, [rand(g, 2, 4, 5, 5)], [m.LossLabels(DEV, rand(g, 2, 4, 5, 5))])
    assert len(allocator.images) == 1  # used once: the graph neither fuses it away nor remakes it
    # a normalization of a graph source: recomputing would read the source again, and a
    # source's read count is the caller's
    x = m.ImageNode("x")
    bn = m.BatchNormalizationNode(x, m.TensorBatchNormalizationDataSource(4, optimizer=sgd1()))
    relu = m.NeuronReLUNode(bn.result_image)
    conv = m.ConvolutionNode(relu.result_image, conv_ds(g, 3, 3, 4, 4, sgd1()))
    graph, _ = training(mse_loss(conv.result_image))
    assert _planned(graph) == []
    assert graph.read_count_for_source_image(0) == 4  # statistics, normalization, 2 gradients
    # inference: no gradient reads anything
    _, out, _, _ = _chain(g)
    assert _planned(m.Graph(DEV, out)) == []


def test_the_option_must_be_a_bool() -> None:
    g = gen(75)
    _, out, _, _ = _chain(g, blocks=1)
    graph, _ = training(mse_loss(out))
    graph.recompute_normalization_results = 1
    xt, target = rand(g, 1, 4, 5, 5), rand(g, 1, 4, 5, 5)
    cb = new_cb()
    with pytest.raises(
        TypeError, match=r"^\[Graph\] recompute_normalization_results must be a bool, got 1$"
    ):
        graph.encode_batch(cb, [m.ImageBatch.from_tensor(xt)], [m.LossLabels(DEV, target)])


def test_resnet18_steps_are_the_same_with_and_without_recomputing() -> None:
    def flag(value: bool):
        return lambda graph: setattr(graph, "recompute_normalization_results", value)

    (_, on), (_, off) = resnet18_two_steps(flag(True)), resnet18_two_steps(flag(False))
    assert all(torch.equal(a, b) for a, b in zip(on, off, strict=True))


def _bn_ds(g: torch.Generator, c: int) -> m.TensorBatchNormalizationDataSource:
    gamma, beta = 1 + rand(g, c, scale=0.2), rand(g, c, scale=0.2)
    return m.TensorBatchNormalizationDataSource(c, gamma=gamma, beta=beta, optimizer=sgd1())


def _on_and_off(build) -> list[m.Graph]:
    """The same network trained one step with recomputing on and off: equal bit for bit."""
    graphs, results = [], []
    for flag in (True, False):
        g = gen(76)
        graph = build(g)
        graph.recompute_normalization_results = flag
        dx = encode(graph, [rand(g, 2, 4, 5, 5)], [m.LossLabels(DEV, rand(g, 2, 4, 5, 5))])
        graphs.append(graph)
        results.append(dx.tensor)
    assert torch.equal(results[0], results[1])
    return graphs


def test_a_normalization_of_a_recomputed_result_is_not_recomputed_itself() -> None:
    bns = []

    def build(g):
        x = m.ImageNode("x")
        c = m.ConvolutionNode(x, conv_ds(g, 3, 3, 4, 4, sgd1(), bias=False))
        b1 = m.BatchNormalizationNode(c.result_image, _bn_ds(g, 4))
        b2 = m.BatchNormalizationNode(m.NeuronReLUNode(b1.result_image).result_image, _bn_ds(g, 4))
        out = m.ConvolutionNode(m.NeuronReLUNode(b2.result_image).result_image,
                                conv_ds(g, 3, 3, 4, 4, sgd1()))  # fmt: skip
        bns.append(b1)
        return training(mse_loss(out.result_image))[0]

    on, _ = _on_and_off(build)
    # recomputing the second would read the first's result while it is freed
    assert _planned(on) == [bns[0]]  # the first build's (recomputing on)


def test_every_node_that_shows_the_result_gets_the_recomputed_image() -> None:
    def build(g):
        x = m.ImageNode("x")
        c = m.ConvolutionNode(x, conv_ds(g, 3, 3, 4, 4, sgd1(), bias=False))
        r = m.NeuronReLUNode(m.BatchNormalizationNode(c.result_image, _bn_ds(g, 4)).result_image)
        a = m.ConvolutionNode(r.result_image, conv_ds(g, 3, 3, 4, 4, sgd1()))
        drop = m.DropoutNode(r.result_image, 0.5)  # no gradient: the identity, same image
        drop.result_image.stop_gradient = True
        b = m.ConvolutionNode(drop.result_image, conv_ds(g, 3, 3, 4, 4, sgd1()))
        out = m.AdditionNode(a.result_image, b.result_image)
        exits = mse_loss(out.result_image).training_graph(None, None)
        first = [e for e in exits if e.inference_node.source_images[0].producer is None]
        ordered = first + [e for e in exits if e not in first]
        graph = m.Graph.from_results(DEV, [e.result_image for e in ordered])
        graph.format = m.FeatureChannelFormat.FLOAT64
        return graph

    on, _ = _on_and_off(build)
    (plan,) = [r for plans in on._plan.recompute.before.values() for r in plans]
    assert len(plan.ids) == 3  # the normalization's, the fused ReLU's and the dropout's


def test_a_result_only_a_passed_on_gradient_lists_is_not_recomputed() -> None:
    def build(g):
        x = m.ImageNode("x")
        c = m.ConvolutionNode(x, conv_ds(g, 3, 3, 4, 4, sgd1(), bias=False))
        r = m.NeuronReLUNode(m.BatchNormalizationNode(c.result_image, _bn_ds(g, 4)).result_image)
        d = m.ConvolutionNode(x, conv_ds(g, 3, 3, 4, 4, sgd1()))
        return training(mse_loss(m.AdditionNode(r.result_image, d.result_image).result_image))[0]

    on, _ = _on_and_off(build)
    # the ReLU's gradient runs inside the normalization's and reads nothing: nothing to remake
    assert _planned(on) == [] and "recomputes" not in on.debug_description()
