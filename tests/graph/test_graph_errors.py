"""Bad node graphs and bad encodes: clear messages, raised before any work is encoded."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import mpsnn as m
from tests.graph._helpers import DEV, ce_loss, conv_ds, gen, mse_loss, new_cb, rand, sgd1


def _net(seed: int = 60, optimizer=None):
    g = gen(seed)
    d1 = conv_ds(g, 3, 3, 2, 3, optimizer)
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, d1)
    fc = m.FullyConnectedNode(
        m.PoolingMaxNode(c1.result_image, 2).result_image, conv_ds(g, 2, 2, 3, 4, optimizer)
    )
    loss = ce_loss(fc.result_image, 3)
    (terminal,) = loss.training_graph()
    graph = m.Graph(DEV, terminal.result_image)
    return SimpleNamespace(graph=graph, d1=d1, c1=c1, x=x, loss=loss, terminal=terminal)


def _inputs(n: int = 3):
    g = gen(61)
    x = m.ImageBatch.from_tensor(rand(g, n, 2, 4, 4).float())
    labels = m.LossLabels(DEV, torch.randint(0, 4, (n, 1, 1), generator=g))
    return x, labels


# -- cycles --------------------------------------------------------------------------------------


def _cycle():
    g = gen(62)
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, conv_ds(g, 3, 3, 2, 2))
    relu = m.NeuronReLUNode(c1.result_image)
    c1._sources[0] = relu.result_image  # rewired: the public constructors cannot make a cycle
    return relu


def test_cycle_is_refused_by_the_graph() -> None:
    relu = _cycle()
    with pytest.raises(
        ValueError,
        match=r"\[Graph\] the node graph must have no cycle, got NeuronReLUNode -> ConvolutionNode -> NeuronReLUNode",
    ):
        m.Graph(DEV, relu.result_image)


def test_cycle_is_refused_by_the_training_graph() -> None:
    relu = _cycle()
    with pytest.raises(
        ValueError, match=r"\[training_graph\] the node graph must have no cycle, got one through"
    ):
        mse_loss(relu.result_image).training_graph()
    with pytest.raises(ValueError, match=r"\[training_graph\] the node graph must have no cycle"):
        relu.training_graph(m.ImageNode("dy"))


# -- graph construction ---------------------------------------------------------------------------


def test_graph_construction_errors() -> None:
    n = _net()
    with pytest.raises(TypeError, match=r"\[Graph\] device must be a Device, got str"):
        m.Graph("cpu", n.terminal.result_image)
    with pytest.raises(
        TypeError, match=r"\[Graph\] result images must be ImageNodes, got ConvolutionNode"
    ):
        m.Graph(DEV, n.c1)
    with pytest.raises(
        ValueError,
        match=r"\[Graph\] a result image must be made by a filter node, got a source <ImageNode 'x' \(source\)>",
    ):
        m.Graph(DEV, n.x)
    with pytest.raises(
        ValueError, match=r"\[Graph\] a graph needs at least one result image, got none"
    ):
        m.Graph.from_results(DEV, [])
    with pytest.raises(
        ValueError, match=r"results_are_needed must have one flag per result \(2\), got 1"
    ):
        m.Graph.from_results(DEV, [n.terminal.result_image, n.c1.result_image], [True])
    with pytest.raises(ValueError, match=r"\[Graph\] index must be in \[0, 1\), got 1"):
        n.graph.read_count_for_source_image(1)
    with pytest.raises(ValueError, match=r"\[Graph\] index must be in \[0, 1\), got -1"):
        n.graph.read_count_for_source_state(-1)


# -- node errors ------------------------------------------------------------------------------------


def test_node_errors() -> None:
    n = _net()
    with pytest.raises(
        TypeError,
        match=r"\[ConvolutionNode\] source 0 must be an ImageNode \(a node's result_image\), got Tensor",
    ):
        m.ConvolutionNode(torch.zeros(1), n.d1)
    with pytest.raises(
        TypeError, match=r"\[AdditionNode\] source 1 must be an ImageNode .*got ConvolutionNode"
    ):
        m.AdditionNode(n.x, n.c1)
    add = m.AdditionNode(n.c1.result_image, n.x)
    with pytest.raises(
        ValueError,
        match=r"\[AdditionNode\] a filter with 2 inputs has 2 gradient filters: use gradient_filters",
    ):
        add.gradient_filter(m.ImageNode())
    assert len(add.gradient_filters([m.ImageNode()])) == 2
    with pytest.raises(
        TypeError, match=r"\[ConvolutionNode\] incoming gradient 0 must be an ImageNode, got str"
    ):
        n.c1.gradient_filters(["dy"])
    with pytest.raises(
        ValueError,
        match=r"\[ConvolutionGradientNode\] a training graph starts at a forward node \(a loss\), got a gradient node",
    ):
        n.terminal.training_graph()
    with pytest.raises(
        ValueError, match=r"\[ConvolutionGradientNode\] gradient nodes have no gradient filters"
    ):
        n.terminal.gradient_filters([m.ImageNode()])
    with pytest.raises(
        ValueError,
        match=r"\[LossNode\] a loss node has no gradient filter: its result image is the gradient",
    ):
        n.loss.gradient_filters([m.ImageNode()])
    with pytest.raises(ValueError, match=r"\[LossNode\] a loss node has no gradient filter"):
        n.loss.gradient_filter(m.ImageNode())
    with pytest.raises(ValueError, match=r"\[FilterNode\] this filter has no gradient"):
        m.FilterNode([n.x]).gradient_filters([m.ImageNode()])
    with pytest.raises(TypeError, match=r"\[ConvolutionNode\] trainable must be a bool, got 1"):
        n.c1.trainable = 1
    with pytest.raises(
        ValueError, match=r"\[ConcatenationNode\] needs at least one source, got none"
    ):
        m.ConcatenationNode([])
    with pytest.raises(ValueError, match=r"\[SubtractionNode\] needs 2 sources, got 3"):
        m.SubtractionNode.from_sources([n.x, n.x, n.x])


def test_training_graph_errors() -> None:
    n = _net()
    with pytest.raises(
        ValueError,
        match=r"is not a loss node: source_gradient \(the gradient of its result\) must be given, got None",
    ):
        n.c1.training_graph()
    with pytest.raises(
        TypeError, match=r"\[training_graph\] source_gradient must be an ImageNode, got Tensor"
    ):
        n.c1.training_graph(torch.zeros(1))
    with pytest.raises(TypeError, match=r"\[training_graph\] node_handler must be callable, got 3"):
        n.loss.training_graph(None, 3)
    with pytest.raises(
        ValueError, match=r"\[training_graph\] the loss node's source must be made by a filter"
    ):
        ce_loss(n.x, 1).training_graph()


# -- encode errors -----------------------------------------------------------------------------------


def test_missing_or_wrong_source_states() -> None:
    graph = _net().graph
    x, labels = _inputs()
    cb = new_cb()
    for states in ([], None):
        with pytest.raises(
            ValueError,
            match=r"encode_batch needs one state batch per source state handle \(1\), got 0",
        ):
            graph.encode_batch(cb, [x], states)
    with pytest.raises(
        TypeError,
        match=r"source_states\[0\] must be a StateBatch \(one LossLabels per image\) or one LossLabels for the batch, got Tensor",
    ):
        graph.encode_batch(cb, [x], [torch.zeros(3)])
    with pytest.raises(TypeError, match=r"source_states\[0\]\[1\] must be a state, got int"):
        graph.encode_batch(cb, [x], [[labels, 3]])
    assert len(cb) == 0


def test_label_batch_of_the_wrong_size_raises_before_anything_is_encoded() -> None:
    n = _net(63, sgd1())
    graph, d1 = n.graph, n.d1
    w = d1.weights().clone()
    x, labels = _inputs(3)
    _, two = _inputs(2)
    cb = new_cb()
    with pytest.raises(
        ValueError,
        match=r"\[Graph\] the labels of source state 0 must hold one image per source image \(3\), got 2 in 1 LossLabels",
    ):
        graph.encode_batch(cb, [x], [two])
    with pytest.raises(
        ValueError, match=r"must hold one image per source image \(3\), got 4 in 2 LossLabels"
    ):
        graph.encode_batch(
            cb, [x], [m.StateBatch([labels, m.LossLabels(DEV, torch.tensor([[[1]]]))])]
        )
    assert len(cb) == 0  # nothing encoded
    cb.commit()
    cb.wait_until_completed()
    assert torch.equal(d1.weights(), w)
    cb = new_cb()  # the graph still works
    assert graph.encode_batch(cb, [x], [labels]) is not None and len(cb) > 0


def test_wrong_source_images_and_command_buffers() -> None:
    graph = _net().graph
    x, labels = _inputs()
    cb = new_cb()
    with pytest.raises(
        TypeError, match=r"\[Graph\] command_buffer must be a CommandBuffer, got NoneType"
    ):
        graph.encode_batch(None, [x], [labels])
    with pytest.raises(
        ValueError,
        match=r"encode_batch needs one ImageBatch per source image handle \(1: \['x'\]\), got 2",
    ):
        graph.encode_batch(cb, [x, x], [labels])
    with pytest.raises(
        TypeError, match=r"\[Graph\] source_images\[0\] must be an ImageBatch, got Tensor"
    ):
        graph.encode_batch(cb, [x.tensor], [labels])
    with pytest.raises(
        TypeError, match=r"\[Graph\] source_images\[0\] must be an Image, got ImageBatch"
    ):
        graph.encode(cb, [x], [labels])
    assert len(cb) == 0
    cb.commit()
    with pytest.raises(
        ValueError, match=r"\[Graph\] the command buffer must not be committed yet, got status"
    ):
        graph.encode_batch(cb, [x], [labels])


def test_stale_or_foreign_temporary_sources_and_allocated_images() -> None:
    """The graph's kernels skip the checks of the images the graph hands them, so the graph
    checks what it did not make itself: its source images (a released temporary image, one of
    another command buffer) and what an image allocator of the user's returns."""
    graph = _net().graph
    _, labels = _inputs()
    data = torch.randn(3, 2, 4, 4)
    other = new_cb()
    foreign = m.TemporaryImage(other, m.ImageDescriptor(m.FeatureChannelFormat.FLOAT32, 4, 4, 2, 3))
    cb = new_cb()
    with pytest.raises(
        ValueError,
        match=r"\[Graph\] source_images\[0\] is a TemporaryImage of another command buffer",
    ):
        graph.encode_batch(cb, [m.ImageBatch(foreign)], [labels])
    stale = m.TemporaryImage(cb, m.ImageDescriptor(m.FeatureChannelFormat.FLOAT32, 4, 4, 2, 3))
    stale.read_count = 0
    with pytest.raises(
        m.StaleResourceError, match=r"\[Graph\] TemporaryImage 3x2x4x4 must be live"
    ):
        graph.encode_batch(cb, [m.ImageBatch(stale)], [labels])
    assert len(cb) == 0

    class Foreign:
        def image(self, command_buffer, descriptor, kernel):
            return m.TemporaryImage(other, descriptor)

    net = _net()
    net.c1.result_image.image_allocator = Foreign()
    graph = m.Graph(DEV, net.terminal.result_image)
    cb = new_cb()
    with pytest.raises(ValueError, match=r"\[Graph\] .*'s image is a TemporaryImage of another"):
        graph.encode_batch(cb, [m.ImageBatch.from_tensor(data)], [labels])
    assert len(cb) == 0


def test_a_temporary_source_released_by_an_earlier_read_of_the_same_encode() -> None:
    """A temporary source image with read_count 1 that two of the graph's kernels read (the
    convolution and its gradient): the second read raises the kernel's StaleResourceError at
    encode time, and nothing is left encoded."""
    g = gen(1)
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, conv_ds(g, 3, 3, 2, 3, sgd1()))
    fc = m.FullyConnectedNode(c1.result_image, conv_ds(g, 4, 4, 3, 4, sgd1()))
    (terminal,) = ce_loss(fc.result_image, 4).training_graph()
    graph = m.Graph(DEV, terminal.result_image)
    assert graph.read_count_for_source_image(0) == 2
    cb = new_cb()
    src = m.TemporaryImage(cb, m.ImageDescriptor(m.FeatureChannelFormat.FLOAT64, 4, 4, 2, 3))
    labels = m.LossLabels(DEV, torch.randint(0, 4, (3, 1, 1)))
    with pytest.raises(
        m.StaleResourceError, match=r"\[ConvolutionGradient\] TemporaryImage 3x2x4x4 must be live"
    ):
        graph.encode_batch(cb, [m.ImageBatch(src)], [labels])
    assert len(cb) == 0


def test_a_format_that_is_not_a_feature_channel_format() -> None:
    """``Graph.format`` and ``ImageNode.format`` are plain attributes: a wrong value is refused
    before anything is encoded."""
    net = _net()
    x, labels = _inputs()
    cb = new_cb()
    for bad in (torch.float16, "float16"):
        net.c1.result_image.format = bad
        with pytest.raises(
            TypeError, match=r"\[Graph\] .*'s format must be a FeatureChannelFormat"
        ):
            net.graph.encode_batch(cb, [x], [labels])
    net.c1.result_image.format = None
    net.graph.format = "float32"
    with pytest.raises(
        TypeError, match=r"\[Graph\] format must be a FeatureChannelFormat, got str"
    ):
        net.graph.encode_batch(cb, [x], [labels])
    assert len(cb) == 0


def test_source_batches_of_different_sizes() -> None:
    g = gen(64)
    a, b = m.ImageNode("a"), m.ImageNode("b")
    graph = m.Graph(
        DEV,
        m.AdditionNode(m.ConvolutionNode(a, conv_ds(g, 1, 1, 2, 2)).result_image, b).result_image,
    )
    cb = new_cb()
    with pytest.raises(
        ValueError,
        match=r"every source ImageBatch must hold the same number of images \(2\), got 3 in source_images\[1\]",
    ):
        graph.encode_batch(
            cb,
            [
                m.ImageBatch.from_tensor(torch.zeros(2, 2, 3, 3)),
                m.ImageBatch.from_tensor(torch.zeros(3, 2, 3, 3)),
            ],
        )
    assert len(cb) == 0


def test_concatenation_of_images_of_different_sizes() -> None:
    g = gen(65)
    x = m.ImageNode("x")
    a = m.ConvolutionNode(x, conv_ds(g, 3, 3, 2, 2)).result_image
    b = m.PoolingMaxNode(x, 2).result_image
    graph = m.Graph(DEV, m.ConcatenationNode([a, b]).result_image)
    with pytest.raises(
        ValueError,
        match=r"\[ConcatenationNode\] every input must be 4x4 with 2 images, input 1 is 2x2 with 2",
    ):
        graph.encode_batch(cb := new_cb(), [m.ImageBatch.from_tensor(torch.zeros(2, 2, 4, 4))])
    # the convolution and the pooling were encoded before the concatenation raised: the
    # failed encode took them back, and the buffer still works
    assert len(cb) == 0
    good = m.Graph(DEV, m.PoolingMaxNode(x, 2).result_image)
    out = good.encode_batch(cb, [m.ImageBatch.from_tensor(torch.ones(2, 2, 4, 4))])
    cb.commit()
    cb.wait_until_completed()
    assert torch.equal(out.tensor, torch.ones(2, 2, 2, 2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a second device needs CUDA")
def test_sources_on_another_device() -> None:
    graph = _net().graph
    x, labels = _inputs()
    cuda = m.Device("cuda")
    cb = new_cb()
    with pytest.raises(
        ValueError, match=r"\[Graph\] source_images\[0\] must be on Device\('cpu'\), got"
    ):
        graph.encode_batch(cb, [m.ImageBatch.from_tensor(x.tensor.cuda())], [labels])
    with pytest.raises(
        ValueError, match=r"\[Graph\] source_states\[0\]\[0\] must be on Device\('cpu'\)"
    ):
        graph.encode_batch(cb, [x], [m.LossLabels(cuda, torch.tensor([[[0]], [[1]], [[2]]]))])
    with pytest.raises(
        ValueError, match=r"\[Graph\] the command buffer must be on Device\('cpu'\)"
    ):
        graph.encode_batch(cuda.new_command_queue().command_buffer(), [x], [labels])
    assert len(cb) == 0
