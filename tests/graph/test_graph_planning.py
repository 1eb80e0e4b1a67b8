"""What a `Graph` plans and reports: results (needed or not, several, fused), exported images,
temporaries freed after their last reader, peak memory, handles and read counts, reloads and
asynchronous execution."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.graph._helpers import (
    DEV,
    F32,
    F64,
    TOL,
    RecordingAllocator,
    TorchConv,
    assert_close,
    ce_loss,
    conv_ds,
    encode,
    gen,
    new_cb,
    peak_and_total,
    rand,
    training,
)


def _chain(g: torch.Generator, depth: int, channels: int, optimizer=None, *, relu: bool = False):
    """``depth`` same-size convolutions (optionally each followed by a ReLU)."""
    x = m.ImageNode("x")
    nodes, img = [], x
    for _ in range(depth):
        node = m.ConvolutionNode(img, conv_ds(g, 3, 3, channels, channels, optimizer))
        nodes.append(node)
        img = node.result_image
        if relu:
            img = m.NeuronReLUNode(img).result_image
    return nodes, img


# -- results ----------------------------------------------------------------------------------


def test_result_not_needed_returns_none_and_updates_weights_identically() -> None:
    def run(needed: bool):
        g = gen(30)
        opt = m.SGD(DEV, momentum_scale=0.5, descriptor=m.OptimizerDescriptor(learning_rate=0.1))
        d1, d2 = conv_ds(g, 3, 3, 2, 3, opt), conv_ds(g, 3, 3, 3, 4, opt)
        x = m.ImageNode("x")
        c1 = m.ConvolutionNode(x, d1)
        fc = m.FullyConnectedNode(m.PoolingMaxNode(c1.result_image, 2).result_image, d2)
        graph, _ = training(ce_loss(fc.result_image, 2), needed=needed)
        assert graph.result_image_is_needed is needed
        outs = []
        for _ in range(2):
            xt = rand(g, 2, 2, 6, 6)
            labels = torch.randint(0, 4, (2, 1, 1), generator=g)
            outs.append(encode(graph, [xt], [m.LossLabels(DEV, labels)]))
        return outs, [d1.weights(), d1.bias_terms(), d2.weights(), d2.bias_terms()]

    outs_needed, w_needed = run(True)
    outs_not, w_not = run(False)
    assert all(o is not None for o in outs_needed) and outs_not == [None, None]
    for a, b in zip(w_needed, w_not, strict=True):
        assert torch.equal(a, b)


def test_several_results_and_exported_images() -> None:
    g = gen(31)
    d1, d2, d3 = conv_ds(g, 3, 3, 2, 3), conv_ds(g, 3, 3, 3, 3), conv_ds(g, 1, 1, 3, 2)
    t1, t2, t3 = TorchConv(d1), TorchConv(d2), TorchConv(d3)
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, d1)
    c2 = m.ConvolutionNode(c1.result_image, d2)
    c2.result_image.export_from_graph = True
    c2.result_image.handle = "h2"
    c3 = m.ConvolutionNode(c2.result_image, d3)
    c1.result_image.handle = "h1"
    c3.result_image.handle = "out"
    graph = m.Graph.from_results(DEV, [c3.result_image, c1.result_image], [True, True])
    graph.format = F64
    assert graph.result_handle == "out"
    assert graph.intermediate_image_handles == ["h1", "h2"]  # extra results, then exports
    xt = rand(g, 2, 2, 5, 5)
    out = encode(graph, [xt])
    h1, h2 = graph.intermediate_images
    ref1 = t1(xt)
    assert_close(out.tensor, t3(t2(ref1)), "first result", TOL)
    assert_close(h1.tensor, ref1, "second result", TOL)
    assert_close(h2.tensor, t2(ref1), "exported image", TOL)
    assert not any(b.image.is_temporary for b in (out, h1, h2))
    # each encode gives new images: the last ones stay valid
    encode(graph, [xt * 2])
    assert_close(h2.tensor, t2(ref1), "exported image of the first encode", TOL)
    assert_close(graph.intermediate_images[1].tensor, t2(t1(xt * 2)), "second encode", TOL)


def test_fused_neuron_result_is_a_permanent_image_from_the_result_allocator() -> None:
    g = gen(32)
    d1 = conv_ds(g, 3, 3, 2, 3)
    t1 = TorchConv(d1)
    x = m.ImageNode("x")
    relu = m.NeuronReLUNode(m.ConvolutionNode(x, d1).result_image)
    relu.result_image.format = F32
    graph = m.Graph(DEV, relu.result_image)
    graph.format = F64
    assert "fused RELU" in graph.debug_description()
    alloc = RecordingAllocator(m.Image.default_allocator())
    graph.destination_image_allocator = alloc
    xt = rand(g, 2, 2, 5, 5)
    out = encode(graph, [xt])
    assert len(alloc.images) == 1 and out.image is alloc.images[0]
    assert not out.image.is_temporary
    assert out.feature_channel_format is F32  # the result node's own format
    assert_close(out.tensor, F.relu(t1(xt)), "fused result", 2e-6)


def test_exported_fused_neuron_result_is_permanent() -> None:
    g = gen(33)
    d1, d2 = conv_ds(g, 3, 3, 2, 3), conv_ds(g, 3, 3, 3, 2)
    t1, t2 = TorchConv(d1), TorchConv(d2)
    x = m.ImageNode("x")
    relu = m.NeuronReLUNode(m.ConvolutionNode(x, d1).result_image)
    relu.result_image.export_from_graph = True
    graph = m.Graph(DEV, m.ConvolutionNode(relu.result_image, d2).result_image)
    graph.format = F64
    assert "fused RELU" in graph.debug_description()
    xt = rand(g, 2, 2, 5, 5)
    out = encode(graph, [xt])
    (h,) = graph.intermediate_images
    assert not h.image.is_temporary
    assert_close(h.tensor, F.relu(t1(xt)), "exported fused image", TOL)
    assert_close(out.tensor, t2(F.relu(t1(xt))), "result", TOL)


# -- temporaries and memory ---------------------------------------------------------------------


def test_debug_description_frees_each_intermediate_after_its_last_reader() -> None:
    g = gen(34)
    _, out = _chain(g, 3, 2)
    graph = m.Graph(DEV, out)
    lines = graph.debug_description().splitlines()[1:]
    assert "frees" not in lines[0]
    assert lines[1].endswith("(t0) -> t1  (frees t0)")
    assert lines[2].endswith("(t1) -> t2  (frees t1)")  # t2 is the result: kept
    # training: a forward image is freed by the gradient that reads it last
    g = gen(34)
    _, out = _chain(g, 2, 2)
    train, _ = training(ce_loss(m.PoolingAverageNode(out, 6).result_image, 2))
    text = train.debug_description()
    assert "ConvolutionGradientNode [ConvolutionGradient] (t4, t0) -> t5  (frees t4, t0" in text, (
        text
    )


def test_intermediate_with_a_temporary_allocator_is_freed_after_its_last_reader() -> None:
    g = gen(35)
    (c1, c2, c3), out = _chain(g, 3, 2)
    alloc = RecordingAllocator(m.TemporaryImage.default_allocator())
    c1.result_image.image_allocator = alloc  # read by c2 only
    graph = m.Graph(DEV, out)
    graph.format = F64
    ts = [TorchConv(c.data_source) for c in (c1, c2, c3)]
    xt = rand(g, 2, 2, 5, 5)
    y = encode(graph, [xt])
    assert_close(y.tensor, ts[2](ts[1](ts[0](xt))), "result", TOL)
    assert len(alloc.images) == 1, "the node's image_allocator was not used"
    (tmp,) = alloc.images
    assert tmp.is_temporary
    with pytest.raises(m.StaleResourceError, match="read_count reached 0"):
        tmp.tensor  # noqa: B018


def test_intermediate_with_a_permanent_allocator_stays_readable() -> None:
    g = gen(36)
    (c1, _), out = _chain(g, 2, 2)
    alloc = RecordingAllocator(m.Image.default_allocator())
    c1.result_image.image_allocator = alloc
    train, _ = training(ce_loss(m.PoolingAverageNode(out, 4).result_image, 2))
    xt = rand(g, 2, 2, 4, 4)
    ref = TorchConv(c1.data_source)(xt)
    encode(train, [xt], [m.LossLabels(DEV, torch.tensor([[[0]], [[1]]]))])
    assert len(alloc.images) == 1, "the node's image_allocator was not used"
    assert not alloc.images[0].is_temporary
    assert_close(alloc.images[0].tensor, ref, "kept intermediate", TOL)


def test_peak_memory_is_below_the_sum_of_the_intermediates() -> None:
    # 8 channels of 64x64, 2 images, float32: 0.25 MiB per image
    g = gen(37)
    _, out = _chain(g, 8, 8)
    graph = m.Graph(DEV, out)
    xt = torch.randn(2, 8, 64, 64, generator=g)
    encode(graph, [xt])
    peak, total = peak_and_total(graph)
    assert total == 2.0  # 8 images, the result included
    assert peak == 0.5  # two alive at a time: each freed after the next layer read it
    # training a shallower chain: the forward images live until their gradients
    g = gen(37)
    _, out = _chain(g, 4, 8)
    train, _ = training(ce_loss(m.PoolingAverageNode(out, 64).result_image, 2), fmt=F32)
    encode(train, [xt], [m.LossLabels(DEV, torch.tensor([[[0]], [[5]]]))])
    peak, total = peak_and_total(train)
    assert 0 < peak < total, train.debug_description()


def test_total_memory_counts_each_image_once_with_fused_neurons() -> None:
    g = gen(38)
    _, out = _chain(g, 4, 8, relu=True)
    graph = m.Graph(DEV, out)
    assert graph.debug_description().count("fused RELU") == 4
    encode(graph, [torch.randn(2, 8, 64, 64, generator=g)])
    peak, total = peak_and_total(graph)
    assert peak == 0.5
    assert total == 1.0, graph.debug_description()  # 4 images of 0.25 MiB were allocated


# -- handles, read counts, reloads, asynchronous execution -----------------------------------------


def test_source_handles_and_read_counts() -> None:
    g = gen(39)
    a, b = m.ImageNode("a"), m.ImageNode("b")
    ca = m.ConvolutionNode(a, conv_ds(g, 3, 3, 2, 2))
    cb_ = m.ConvolutionNode(b, conv_ds(g, 1, 1, 2, 2))
    also_a = m.ConvolutionNode(a, conv_ds(g, 1, 1, 2, 2))
    s = m.AdditionNode(
        m.AdditionNode(ca.result_image, cb_.result_image).result_image, also_a.result_image
    )
    graph = m.Graph(DEV, s.result_image)
    assert graph.source_image_handles == ["a", "b"]
    assert [graph.read_count_for_source_image(i) for i in range(2)] == [2, 1]
    assert graph.source_state_handles == []

    bn = m.BatchNormalizationNode(b, m.TensorBatchNormalizationDataSource(2))
    assert m.Graph(DEV, bn.result_image).read_count_for_source_image(0) == 2  # stats + normalize
    loss = ce_loss(m.PoolingAverageNode(bn.result_image, 4).result_image, 2)
    loss.input_labels.handle = "labels"
    train, _ = training(loss)
    assert train.source_image_handles == ["b"]
    assert train.source_state_handles == ["labels"]
    assert train.read_count_for_source_image(0) == 4  # forward 2, gradient 2
    assert train.read_count_for_source_state(0) == 1

    conv_train, _ = training(ce_loss(m.PoolingAverageNode(ca.result_image, 4).result_image, 2))
    assert conv_train.read_count_for_source_image(0) == 2  # the convolution and its gradient


def test_reload_from_data_sources() -> None:
    g = gen(40)
    d1, d2 = conv_ds(g, 3, 3, 2, 3), conv_ds(g, 3, 3, 3, 2)
    x = m.ImageNode("x")
    c2 = m.ConvolutionNode(m.ConvolutionNode(x, d1).result_image, d2)
    graph = m.Graph(DEV, c2.result_image)
    graph.format = F64
    xt = rand(g, 2, 2, 5, 5)
    old = TorchConv(d2)(TorchConv(d1)(xt))
    assert_close(encode(graph, [xt]).tensor, old, "before", TOL)
    d1.set_weights_and_biases(rand(g, *d1.weights().shape), rand(g, 3))
    assert_close(encode(graph, [xt]).tensor, old, "changed data source, no reload", TOL)
    graph.reload_from_data_sources()
    new = TorchConv(d2)(TorchConv(d1)(xt))
    assert not torch.allclose(new, old)
    assert_close(encode(graph, [xt]).tensor, new, "after reload", TOL)


def test_execute_async_calls_the_completion_handler() -> None:
    g = gen(41)
    d1 = conv_ds(g, 3, 3, 2, 3)
    x = m.ImageNode("x")
    graph = m.Graph(
        DEV, m.NeuronTanHNode(m.ConvolutionNode(x, d1).result_image, 1.0, 1.0).result_image
    )
    graph.format = F64
    xt = rand(g, 2, 2, 5, 5)
    done = threading.Event()
    got: list[object] = []

    def handler(result, error):
        got.extend([result, error])
        done.set()

    out = graph.execute_async([m.Image.from_tensor(xt)], handler)
    assert done.wait(10)
    assert got[0] is out and got[1] is None
    assert isinstance(out, m.Image)
    assert_close(out.tensor, torch.tanh(TorchConv(d1)(xt)), "execute_async result", TOL)


def test_encode_of_single_images_matches_encode_batch() -> None:
    g = gen(42)
    x = m.ImageNode("x")
    fc = m.FullyConnectedNode(
        m.ConvolutionNode(x, conv_ds(g, 3, 3, 2, 3)).result_image, conv_ds(g, 4, 4, 3, 3)
    )
    graph, _ = training(ce_loss(fc.result_image, 2))
    xt = rand(g, 2, 2, 4, 4)
    labels = torch.tensor([[[2]], [[0]]])
    cb = new_cb()
    single = graph.encode(cb, [m.Image.from_tensor(xt)], [m.LossLabels(DEV, labels)])
    cb.commit()
    cb.wait_until_completed()
    assert isinstance(single, m.Image)
    batch = encode(graph, [xt], [m.LossLabels(DEV, labels)])
    assert torch.equal(single.tensor, batch.tensor)


def test_transpose_convolution_undoes_a_convolution_size_in_an_inference_graph() -> None:
    """A forward node reading a convolution's state makes that convolution keep its state in
    a graph without gradients (MPS's convolution-transpose node of a convolution state)."""
    g = gen(71)
    x = m.ImageNode("x")
    c = m.ConvolutionNode(x, conv_ds(g, 3, 3, 2, 3))
    c.padding_policy = m.DefaultPadding(m.PaddingMethod.SIZE_VALID_ONLY)
    t = m.ConvolutionTransposeNode(c.result_image, c.result_state, conv_ds(g, 3, 3, 3, 2))
    graph = m.Graph(DEV, t.result_image)
    graph.format = m.FeatureChannelFormat.FLOAT64
    xt = rand(g, 2, 2, 7, 7)
    out = encode(graph, [xt])
    assert out.shape == (2, 2, 7, 7)  # 7 -> 5 -> 7: the transpose reads the convolution's size
    w1 = c.data_source.weights().permute(0, 3, 1, 2)
    w2 = t.data_source.weights().permute(0, 3, 1, 2)
    h = F.conv2d(xt, w1, c.data_source.bias_terms())
    ref = F.conv_transpose2d(h, w2.transpose(0, 1).flip(2, 3), t.data_source.bias_terms())
    assert_close(out.tensor, ref, "transpose of a convolution", TOL)
