"""Round trips of the split loss (`ForwardLoss`, `LossGradient`, `InitialGradient` and their
nodes): the configuration comes back and the loaded kernels compute the same float64 results
bit for bit; a training graph that starts at an `InitialGradientNode` (two forward losses
summed, labels made by a filter, a weights image) reloads and its next step equals the unsaved
graph's bit for bit; a loss callback is code and is refused."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from tests.io._graphs import DEV, F64, conv_ds, gen, rand, run, same
from tests.io._helpers import _object, _parts, _roundtrip, _write

LT, RT = m.LossType, m.ReductionType
B = m.ImageBatch.from_tensor


def _desc() -> m.LossDescriptor:
    return m.LossDescriptor(LT.HUBER, RT.SUM_BY_NON_ZERO_WEIGHTS, weight=0.5, delta=0.75)


def _data(seed: int) -> tuple[torch.Tensor, ...]:
    g = gen(seed)
    y, t = rand(g, 3, 2, 4, 5), rand(g, 3, 3, 4, 5)  # labels with an extra channel
    wt = torch.rand(3, 3, 4, 5, generator=g, dtype=torch.float64)
    wt[wt < 0.25] = 0
    return y, t, wt, rand(g, 3, 1, 1, 1)  # the last: an incoming gradient of the loss image


def _split(fwd, grads, y, t, wt, g) -> list[torch.Tensor]:
    """The loss image, then each gradient kernel's result for the incoming gradient ``g``
    (through the forward's gradient state)."""
    cb = DEV.new_command_queue().command_buffer()
    states = fwd.result_state_batch(B(y))
    loss = fwd.encode_batch(cb, B(y), B(t), B(wt), states)
    outs = [k.encode_batch(cb, B(g), B(y), B(t), B(wt), states) for k in grads]
    cb.commit()
    cb.wait_until_completed()
    return [loss.tensor, *(o.tensor for o in outs)]


_LOSS_FIELDS = (
    "loss_type", "reduction_type", "number_of_classes", "reduce_across_batch", "weight",
    "label_smoothing", "epsilon", "delta",
)  # fmt: skip


# -- kernels ------------------------------------------------------------------------------------


def test_forward_loss_and_loss_gradients_round_trip_and_compute_the_same(tmp_path) -> None:
    fwd = m.ForwardLoss(DEV, _desc(), reduce_across_batch=True)
    fwd.weight, fwd.delta = 0.25, 0.5  # set after construction: the kernel's own copy
    fwd.label_smoothing, fwd.epsilon = 0.125, 1e-6
    fwd.label = "loss"
    fwd.options = m.KernelOptions.ALLOW_REDUCED_PRECISION
    preds = m.LossGradient(DEV, _desc(), reduce_across_batch=True)
    labels = m.LossGradient(DEV, _desc(), reduce_across_batch=True, compute_label_gradients=True)
    for k in (preds, labels):
        k.weight, k.delta, k.label_smoothing, k.epsilon = 0.25, 0.5, 0.125, 1e-6
    labels.label = "labels"
    fwd2, preds2, labels2 = _roundtrip([fwd, preds, labels], tmp_path)
    for a, b in ((fwd, fwd2), (preds, preds2), (labels, labels2)):
        assert type(b) is type(a)
        for name in (*_LOSS_FIELDS, "label", "options"):
            assert getattr(b, name) == getattr(a, name), name
            assert type(getattr(b, name)) is type(getattr(a, name)), name
    assert (preds2.compute_label_gradients, labels2.compute_label_gradients) == (False, True)
    assert fwd2.weight == 0.25 and fwd2.delta == 0.5
    y, t, wt, g = _data(1)
    first, second = (
        _split(fwd, [preds, labels], y, t, wt, g),
        _split(fwd2, [preds2, labels2], y, t, wt, g),
    )
    assert [tuple(o.shape) for o in first] == [(3, 1, 1, 1), (3, 2, 4, 5), (3, 3, 4, 5)]
    for a, b in zip(first, second, strict=True):
        assert a.dtype == torch.float64 and torch.equal(a, b)
        assert bool(a.abs().sum() > 0)
    # without a gradient state the gradient uses its own (saved) parameters
    cb = DEV.new_command_queue().command_buffer()
    outs = [k.encode_batch(cb, B(g), B(y), B(t), B(wt)) for k in (preds, preds2)]
    cb.commit()
    cb.wait_until_completed()
    assert torch.equal(outs[0].tensor, outs[1].tensor)


def test_loss_gradient_geometry_and_initial_gradient_round_trip(tmp_path) -> None:
    lg = m.LossGradient(DEV, m.LossDescriptor(LT.MEAN_SQUARED_ERROR, RT.NONE))
    lg.primary_edge_mode = m.EdgeMode.CLAMP  # geometry the kernel keeps (and reads at encode)
    lg.secondary_stride_in_pixels_x = 2
    lg.destination_feature_channel_offset = 0
    init = m.InitialGradient(DEV)
    init.offset = m.Offset(1, -1, 0)
    init.clip_rect = m.Region.make(1, 0, 3, 2, 0, 4)
    init.destination_feature_channel_offset = 1
    init.source_feature_channel_max_count = 2
    init.edge_mode = m.EdgeMode.CLAMP
    init.label = "ones"
    init.padding = m.DefaultPadding(m.PaddingMethod.SIZE_SAME, label="policy")
    lg2, init2 = _roundtrip((lg, init), tmp_path)
    assert lg2.primary_edge_mode is m.EdgeMode.CLAMP and lg2.secondary_stride_in_pixels_x == 2
    assert (lg2.loss_type, lg2.reduction_type) == (LT.MEAN_SQUARED_ERROR, RT.NONE)
    assert type(init2) is m.InitialGradient
    for name in ("offset", "clip_rect", "destination_feature_channel_offset",
                 "source_feature_channel_max_count", "edge_mode", "label"):  # fmt: skip
        assert getattr(init2, name) == getattr(init, name), name
    assert init2.padding.padding_method == m.PaddingMethod.SIZE_SAME
    assert init2.padding.label == "policy"
    x = rand(gen(2), 2, 3, 4, 5)
    outs = []
    for k in (init, init2):
        dst = m.Image.from_tensor(torch.full((2, 4, 4, 5), -7.0, dtype=torch.float64))
        cb = DEV.new_command_queue().command_buffer()
        k.encode(cb, m.Image.from_tensor(x), dst)
        cb.commit()
        cb.wait_until_completed()
        outs.append(dst.tensor)
    assert torch.equal(outs[0], outs[1])
    assert set(outs[0].unique().tolist()) == {-7.0, 1.0}


def test_malformed_split_loss_fields_are_rejected(tmp_path) -> None:
    path = tmp_path / "k.safetensors"
    m.save(m.ForwardLoss(DEV, _desc()), path)
    structure, tensors = _parts(path)
    _object(structure, "ForwardLoss")["fields"]["reduce_across_batch"] = 1
    _write(path, structure, tensors)
    with pytest.raises(m.CheckpointError, match="field 'reduce_across_batch' must be a boolean"):
        m.load(path)
    m.save(m.LossGradient(DEV, m.LossDescriptor(LT.KULLBACK_LEIBLER_DIVERGENCE, RT.SUM)), path)
    structure, tensors = _parts(path)
    _object(structure, "LossGradient")["fields"]["compute_label_gradients"] = True
    _write(path, structure, tensors)
    with pytest.raises(m.CheckpointError, match=r"rebuildable .* compute_label_gradients needs a"):
        m.load(path)


# -- nodes and graphs -----------------------------------------------------------------------


def test_forward_loss_and_initial_gradient_nodes_round_trip(tmp_path) -> None:
    x, t, w = m.ImageNode("x"), m.ImageNode("t"), m.ImageNode("w")
    desc = _desc()
    loss = m.ForwardLossNode(x, t, desc, w, reduce_across_batch=True)
    loss.label = "huber"
    plain = m.ForwardLossNode(x, t, desc)  # no weights; shares the descriptor
    start = m.InitialGradientNode(loss.result_image)
    start.result_image.export_from_graph = True
    loaded = _roundtrip({"loss": loss, "plain": plain, "start": start}, tmp_path)
    loss2, plain2, start2 = loaded["loss"], loaded["plain"], loaded["start"]
    assert type(loss2) is m.ForwardLossNode and type(start2) is m.InitialGradientNode
    assert loss2.reduce_across_batch and not plain2.reduce_across_batch
    assert loss2.label == "huber" and loss2.descriptor is plain2.descriptor
    assert (loss2.descriptor.loss_type, loss2.descriptor.delta) == (LT.HUBER, 0.75)
    assert [s.handle for s in loss2.source_images] == ["x", "t", "w"]
    assert loss2.input_weights is not None and plain2.input_weights is None
    assert loss2.input_labels is plain2.input_labels
    assert start2.source_images[0] is loss2.result_image
    assert start2.result_image.export_from_graph


def _network(seed: int) -> tuple[m.InitialGradientNode, list]:
    """x -> conv -> ReLU (shared) -> conv -> MSE (MEAN, weights image) against labels made by a
    1x1 convolution of z; and -> max pool -> fully connected -> softmax cross entropy (SUM,
    the batch's value); the two loss images added, then the initial gradient."""
    g = gen(seed)
    adam = m.Adam(DEV, descriptor=m.OptimizerDescriptor(learning_rate=0.05))
    d1, d2 = conv_ds(g, 3, 2, 3, adam, torch.float64), conv_ds(g, 3, 3, 2, adam, torch.float64)
    d3, d4 = conv_ds(g, 1, 2, 2, adam, torch.float64), conv_ds(g, 3, 3, 4, adam, torch.float64)
    x, z, w, lb = m.ImageNode("x"), m.ImageNode("z"), m.ImageNode("w"), m.ImageNode("lb")
    h = m.NeuronReLUNode(m.ConvolutionNode(x, d1).result_image).result_image
    a = m.ConvolutionNode(h, d2).result_image
    labels = m.ConvolutionNode(z, d3).result_image  # made by a filter: differentiated
    b = m.FullyConnectedNode(m.PoolingMaxNode(h, 2).result_image, d4).result_image
    mse = m.LossDescriptor(LT.MEAN_SQUARED_ERROR, RT.MEAN, weight=0.5)
    ce = m.LossDescriptor(LT.SOFTMAX_CROSS_ENTROPY, RT.SUM, weight=0.25, label_smoothing=0.1)
    loss_a = m.ForwardLossNode(a, labels, mse, w)
    loss_b = m.ForwardLossNode(b, lb, ce, reduce_across_batch=True)
    total = m.AdditionNode(loss_a.result_image, loss_b.result_image)
    total.result_image.export_from_graph = True
    return m.InitialGradientNode(total.result_image), [d1, d2, d3, d4]


def _inputs(g: torch.Generator) -> dict[str, torch.Tensor]:
    classes = torch.randint(0, 4, (4,), generator=g)
    w = torch.rand(4, 2, 6, 6, generator=g, dtype=torch.float64)
    w[w < 0.2] = 0
    return {
        "x": rand(g, 4, 2, 6, 6), "z": rand(g, 4, 2, 6, 6), "w": w,
        "lb": torch.nn.functional.one_hot(classes, 4).double().view(4, 4, 1, 1),
    }  # fmt: skip


def _step(graph: m.Graph, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    out = run(graph, [inputs[h] for h in graph.source_image_handles])
    return [out.tensor.clone(), *(b.tensor.clone() for b in graph.intermediate_images)]


def _sources(graph: m.Graph) -> list:
    return [n.data_source for n in graph._plan.order if hasattr(n, "data_source")]


def test_a_two_loss_training_graph_from_an_initial_gradient_reloads_and_steps_the_same(
    tmp_path,
) -> None:
    start, _ = _network(3)
    made: list[str] = []
    terminals = start.training_graph(None, lambda node, *_: made.append(type(node).__name__))
    assert made.count("LossGradientNode") == 3  # the predictions' twice, the labels' once
    assert not any(isinstance(n, m.LossGradientNode) for n in terminals)  # convs read them
    graph = m.Graph.from_results(DEV, [t.result_image for t in terminals])
    graph.format = F64
    graph.label = "two losses"
    g = gen(4)
    _step(graph, _inputs(g))  # the optimizer has moments to save
    path = tmp_path / "train.safetensors"
    m.save(graph, path)
    structure = _parts(path)[0]
    types = [o["type"] for o in structure["objects"]]
    assert types.count("LossGradientNode") == 3 and types.count("ForwardLossNode") == 2
    assert types.count("InitialGradientNode") == 1
    (call,) = [o for o in structure["objects"] if o["type"] == "TrainingGraph"]
    assert structure["objects"][call["fields"]["node"]["$obj"]]["type"] == "InitialGradientNode"
    assert call["fields"]["source_gradient"] is None
    graph2 = m.load(path)
    assert graph2.label == "two losses"
    assert graph2.source_image_handles == graph.source_image_handles
    loaded = [n for n in graph2._plan.order if isinstance(n, m.LossGradientNode)]
    assert sorted(n.is_labels_gradient_filter for n in loaded) == [False, False, True]
    for step in range(2):
        inputs = _inputs(g)
        outs, outs2 = _step(graph, inputs), _step(graph2, inputs)
        assert len(outs) == len(outs2) == len(terminals) + 1  # and the exported total
        for a, b in zip(outs, outs2, strict=True):
            assert same(a, b), step
        for ds, ds2 in zip(_sources(graph), _sources(graph2), strict=True):
            assert same(ds.weights(), ds2.weights()) and same(ds.bias_terms(), ds2.bias_terms())
    assert len(_sources(graph2)) == 4


def test_a_training_call_that_mixes_up_its_start_is_rejected(tmp_path) -> None:
    start, _ = _network(5)
    (terminal, *_) = start.training_graph()
    path = tmp_path / "train.safetensors"
    m.save(terminal, path)
    structure, tensors = _parts(path)
    call = _object(structure, "TrainingGraph")["fields"]
    call["source_gradient"] = {"$obj": call["node"]["$obj"] - 1}  # an image saved before it
    assert structure["objects"][call["source_gradient"]["$obj"]]["type"] == "ImageNode"
    _write(path, structure, tensors)
    with pytest.raises(
        m.CheckpointError,
        match=r"must start at a loss or initial gradient node without a source gradient, or "
        r"at a forward node with one, got a InitialGradientNode with a source gradient",
    ):
        m.load(path)


def test_a_loss_callback_is_code_and_is_refused(tmp_path) -> None:
    class Weight:
        def scalar_weight(self, source_image, destination_descriptor):
            return 0.5

    loss = m.ForwardLossNode(m.ImageNode("x"), m.ImageNode("t"), _desc())
    loss.property_call_back = Weight()
    path = tmp_path / "code.safetensors"
    with pytest.raises(
        TypeError,
        match=r"ForwardLossNode\.property_call_back must be None to be saved \(it is code, which "
        r"a file does not hold: set it again after loading\), got Weight",
    ):
        m.save(m.Graph(DEV, m.InitialGradientNode(loss.result_image).result_image), path)
    assert not path.exists()
