"""mpsnn.save / mpsnn.load of graphs: a training graph continues bit for bit after a load
(float32 and float64, Adam in the data sources), formats a node handler set come back, an
inference and a training graph saved together share their nodes and data sources, batch norm
and dropout continue (the dropout counter is saved: the next masks, not a replay), training
graphs with branches (inserted additions, arithmetic and concatenation gradients) and from a
source gradient, and every forward node type with its attributes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import mpsnn as m
from mpsnn.io import registered_types
from tests.io._graphs import (
    DEV,
    F32,
    F64,
    batches,
    cnn,
    conv_ds,
    gen,
    layers,
    listing,
    rand,
    run,
    same,
    step,
    training,
    values,
)


def _roundtrip(obj, tmp_path: Path):
    path = tmp_path / "graph.safetensors"
    m.save(obj, path)
    return m.load(path, "cpu")


def _structure(path: Path) -> dict:
    with safe_open(path, "pt") as f:
        return json.loads(f.metadata()["mpsnn"])


def _all_same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_a_training_graph_continues_bit_for_bit_after_a_load(tmp_path, dtype) -> None:
    net = cnn(1, dtype)
    graph = training(net.loss, dtype)
    data = batches(2, 4, dtype)
    for batch in data[:2]:
        step(graph, batch)
    before = [t.clone() for t in values(graph) if t is not None]
    loaded = _roundtrip(graph, tmp_path)
    assert type(loaded) is m.Graph and loaded is not graph
    assert listing(loaded) == listing(graph)
    assert (loaded.format, loaded.label, loaded.result_image_is_needed) == (
        graph.format, "training", False,
    )  # fmt: skip
    assert loaded.source_image_handles == ["x"] and _all_same(values(loaded), values(graph))
    conv, fc = layers(loaded)
    assert conv.data_source.optimizer is fc.data_source.optimizer  # one Adam, still shared
    assert conv.data_source.optimizer.time_step == 2
    losses = [[step(g, batch) for batch in data[2:]] for g in (graph, loaded)]
    assert _all_same(losses[0], losses[1])
    assert _all_same(values(loaded), values(graph))
    assert conv.data_source.optimizer.time_step == 4
    assert not same(values(graph)[0], before[0])  # the steps did train


def test_formats_and_labels_a_node_handler_set_come_back(tmp_path) -> None:
    net = cnn(3, torch.float64)

    def handler(gnode, fnode, source, gsource) -> None:
        if isinstance(gnode, m.PoolingMaxGradientNode | m.NeuronGradientNode):
            gnode.result_image.format = F32
        gnode.label = f"gradient of {type(fnode).__name__}"

    graph = training(net.loss, torch.float64, handler)
    data = batches(4, 3, torch.float64)
    step(graph, data[0])
    loaded = _roundtrip(graph, tmp_path)
    made = [n for n in loaded._plan.order if isinstance(n, m.GradientFilterNode)]
    assert [n.result_image.format for n in made] == [None, F32, F32, None]
    assert [n.label for n in made] == [
        "gradient of FullyConnectedNode", "gradient of PoolingMaxNode",
        "gradient of NeuronReLUNode", "gradient of ConvolutionNode",
    ]  # fmt: skip
    assert all(g.inference_node in loaded._plan.order for g in made)
    for batch in data[1:]:
        assert same(step(loaded, batch), step(graph, batch))
    assert _all_same(values(loaded), values(graph))


def test_an_inference_and_a_training_graph_saved_together_share_nodes_and_data_sources(
    tmp_path,
) -> None:
    net = cnn(5, torch.float32, batch_norm=True)
    train = training(net.loss, torch.float32)
    infer = m.Graph(DEV, net.fc.result_image)
    infer.label = "inference"
    data = batches(6, 3, torch.float32)
    x = data[0][0]
    for batch in data[:2]:
        step(train, batch)
    out = _roundtrip({"train": train, "infer": infer, "adam": net.adam, "epoch": 2}, tmp_path)
    train2, infer2 = out["train"], out["infer"]
    assert out["epoch"] == 2 and infer2.label == "inference" and infer2.result_image_is_needed
    assert all(
        any(n is t for t in train2._plan.order) for n in infer2._plan.order
    )  # the same nodes
    for a, b in zip(layers(infer2), layers(train2), strict=True):
        assert a is b and a.data_source.optimizer is out["adam"]
    # the inference graph's kernels were not reloaded: their stale weights came back
    stale = run(infer, [x]).tensor
    assert same(run(infer2, [x]).tensor, stale)
    infer.reload_from_data_sources()
    infer2.reload_from_data_sources()
    assert not same(run(infer, [x]).tensor, stale)
    assert same(run(infer2, [x]).tensor, run(infer, [x]).tensor)
    assert same(step(train2, data[2]), step(train, data[2]))
    infer.reload_from_data_sources()
    infer2.reload_from_data_sources()
    assert same(run(infer2, [x]).tensor, run(infer, [x]).tensor)


def test_graphs_of_one_training_graph_call_share_its_gradient_nodes(tmp_path) -> None:
    net = cnn(16, torch.float32)
    made = []
    (terminal,) = net.loss.training_graph(None, lambda gnode, *_: made.append(gnode))
    whole = m.Graph(DEV, terminal.result_image, False)
    part = m.Graph.from_results(DEV, [made[1].result_image])  # up to the pooling's gradient
    (other,) = net.loss.training_graph()  # a second call makes gradient nodes of its own
    again = m.Graph(DEV, other.result_image, False)
    part2, whole2, again2 = _roundtrip([part, whole, again], tmp_path)
    ids = {id(n) for n in whole2._plan.order}
    assert len(part2._plan.order) == 7 and all(id(n) in ids for n in part2._plan.order)
    shared = [type(n).__name__ for n in again2._plan.order if id(n) in ids]
    assert shared == [
        "ConvolutionNode", "NeuronReLUNode", "PoolingMaxNode", "FullyConnectedNode", "LossNode",
    ]  # fmt: skip
    data = batches(17, 2, torch.float32)
    for batch in data:
        assert same(step(whole2, batch), step(whole, batch))
    assert _all_same(values(whole2), values(whole))


def _dropout_kernel(graph: m.Graph) -> m.Dropout:
    (node,) = [n for n in graph._plan.order if isinstance(n, m.DropoutNode)]
    return graph._plan.kernels[node._id]


def test_batch_norm_and_dropout_graphs_continue_with_the_next_masks(tmp_path) -> None:
    net = cnn(7, torch.float32, batch_norm=True, dropout=True)
    graph = training(net.loss, torch.float32)
    data = batches(8, 4, torch.float32)
    for batch in data[:2]:
        step(graph, batch)
    path = tmp_path / "graph.safetensors"
    m.save(graph, path)
    structure = _structure(path)
    (entry,) = [o for o in structure["objects"] if o["type"] == "Graph"]
    kernels = [k for k in entry["fields"]["kernels"] if k is not None]
    assert [sorted(k) for k in kernels] == [["counter"]]  # the other kernels agree with theirs
    loaded, replayed = m.load(path), m.load(path)
    assert int(_dropout_kernel(loaded)._counter) == int(_dropout_kernel(graph)._counter) == 2
    assert "BatchNormalizationNode" in listing(loaded) and listing(loaded) == listing(graph)
    assert _all_same(values(loaded), values(graph))
    _dropout_kernel(replayed)._counter.zero_()  # as if the counter had not been saved
    replay = step(replayed, data[2])
    losses = [[step(g, batch) for batch in data[2:]] for g in (graph, loaded)]
    assert _all_same(losses[0], losses[1])
    assert not same(replay, losses[0][0])  # the masks drawn are the next ones, not a replay
    assert _all_same(values(loaded), values(graph))
    assert int(_dropout_kernel(loaded)._counter) == 4


def test_a_training_graph_with_branches_round_trips(tmp_path) -> None:
    """``h`` feeds a convolution, an addition and a concatenation: the training graph inserts
    additions to sum its gradients, arithmetic and concatenation gradient nodes."""
    g = gen(9)
    adam = m.Adam(DEV, descriptor=m.OptimizerDescriptor(learning_rate=0.1))
    x = m.ImageNode("x")
    h = m.ConvolutionNode(x, conv_ds(g, 3, 2, 3, adam, torch.float64)).result_image
    c1 = m.ConvolutionNode(h, conv_ds(g, 3, 3, 3, adam, torch.float64))
    add = m.AdditionNode(m.NeuronTanHNode(c1.result_image, 1.5, 0.5).result_image, h)
    add.primary_scale = 0.5
    cat = m.ConcatenationNode([add.result_image, h])
    fc = m.FullyConnectedNode(cat.result_image, conv_ds(g, 6, 6, 4, adam, torch.float64))
    desc = m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM, weight=0.25)
    graph = training(m.LossNode(fc.result_image, desc), torch.float64)
    names = [type(n).__name__ for n in graph._plan.order]
    assert names.count("AdditionNode") == 3 and "ConcatenationGradientNode" in names
    assert "ArithmeticGradientNode" in names
    data = batches(10, 3, torch.float64)
    step(graph, data[0])
    path = tmp_path / "graph.safetensors"
    m.save(graph, path)
    saved = [o for o in _structure(path)["objects"] if o["type"] == "AdditionNode"]
    assert sorted("training" in o["fields"] for o in saved) == [False, True, True]
    loaded = m.load(path)
    assert listing(loaded) == listing(graph)
    m.save(loaded, tmp_path / "again.safetensors")  # saving a loaded graph writes the same
    assert _structure(tmp_path / "again.safetensors") == _structure(path)
    (add2,) = [n for n in loaded._plan.order if isinstance(n, m.AdditionNode) and n.properties]
    assert add2.properties == {"primary_scale": 0.5}
    for batch in data[1:]:
        assert same(step(loaded, batch), step(graph, batch))
    assert _all_same(values(loaded), values(graph))


def test_a_training_graph_from_a_source_gradient_round_trips(tmp_path) -> None:
    x, dy = m.ImageNode("x"), m.ImageNode({"name": "dy", "shape": (2, 3)})
    drop = m.DropoutNode(x, 0.6, 11)
    drop.result_image.handle = "y"
    (grad,) = drop.training_graph(dy)
    graph = m.Graph.from_results(DEV, [grad.result_image, drop.result_image])
    graph.format = F64
    g = gen(12)
    images = [rand(g, 2, 3, 5, 5), rand(g, 2, 3, 5, 5)]
    run(graph, images)
    loaded = _roundtrip({"graph": graph}, tmp_path)["graph"]
    assert loaded.source_image_handles == [{"name": "dy", "shape": (2, 3)}, "x"]
    assert loaded.intermediate_image_handles == ["y"]
    for _ in range(2):
        assert same(run(loaded, images).tensor, run(graph, images).tensor)
        assert same(loaded.intermediate_images[0].tensor, graph.intermediate_images[0].tensor)
    # a gradient node saved alone comes back with the forward nodes it needs
    alone = _roundtrip(grad, tmp_path)
    assert type(alone) is m.DropoutGradientNode and type(alone.inference_node) is m.DropoutNode
    assert alone.source_images[0].handle == {"name": "dy", "shape": (2, 3)}


def test_a_convolution_transpose_keeps_the_convolution_whose_size_it_undoes(tmp_path) -> None:
    g = gen(15)
    conv = m.ConvolutionNode(m.ImageNode("x"), conv_ds(g, 3, 4, 2, None, torch.float32))
    pair = conv_ds(g, 3, 2, 4, None, torch.float32)
    tr = m.ConvolutionTransposeNode(conv.result_image, conv.result_state, pair)
    loaded = _roundtrip(tr, tmp_path)
    conv2 = loaded.source_images[0].producer
    assert type(loaded) is m.ConvolutionTransposeNode and type(conv2) is m.ConvolutionNode
    assert loaded.source_states == [conv2.result_state]
    assert same(loaded.data_source.weights(), pair.weights())


# ---------------------------------------------------------------------------------------------
# every forward node type


def _norm_sources(g):
    bn = m.TensorBatchNormalizationDataSource(
        4, 1 + rand(g, 4) * 0.1, rand(g, 4) * 0.1, rand(g, 4) * 0.1, 1 + rand(g, 4).abs() * 0.1
    )
    inorm = m.TensorInstanceNormalizationDataSource(4, 1 + rand(g, 4) * 0.1, rand(g, 4) * 0.1)
    gnorm = m.TensorGroupNormalizationDataSource(4, 2, 1 + rand(g, 4) * 0.1, rand(g, 4) * 0.1)
    return bn, inorm, gnorm


def _every_node():
    """Branches from one 4x8x8 input through every forward node type, with attributes set."""
    g = gen(13)
    x = m.ImageNode(("x", 0))
    one = m.ConvolutionNode(x, conv_ds(g, 3, 4, 4, None, torch.float64))
    one.label, one.trainable = "conv", False
    one.padding_policy = m.DefaultPadding(m.PaddingMethod.SIZE_SAME, label="same")
    prelu = m.NeuronPReLUNode(one.result_image, [0.1, 0.2, 0.3, 0.4])
    prelu.result_image.export_from_graph = True
    prelu.result_image.handle = "prelu"
    pool = m.PoolingAverageNode(prelu.result_image, 2)
    pool.edge_mode, pool.kernel_height = m.EdgeMode.ZERO, 3
    up = m.UpsamplingNearestNode(pool.result_image, 2, 2)
    sub = m.SubtractionNode(x, up.result_image)
    sub.bias = 0.25
    mul = m.MultiplicationNode(sub.result_image, x)
    div = m.DivisionNode(mul.result_image, m.NeuronLinearNode(x, 0.0, 2.0).result_image)
    add = m.AdditionNode(div.result_image, x)
    add.secondary_scale = -1.0
    sl = m.SliceNode(add.result_image, 1, 2)
    cat = m.ConcatenationNode([sl.result_image, x])
    pad = m.PadNode(cat.result_image, m.ImageCoordinate(1, 0, 1), None, m.EdgeMode.ZERO, [1.0] * 7)
    reshape = m.ReshapeNode(pad.result_image, 9, 8, 7)
    bn_ds, in_ds, gn_ds = _norm_sources(g)
    bn = m.BatchNormalizationNode(x, bn_ds)
    inorm = m.InstanceNormalizationNode(bn.result_image, in_ds)
    gnorm = m.GroupNormalizationNode(inorm.result_image, gn_ds)
    gnorm.result_image.format = F32
    spatial = m.SpatialNormalizationNode(gnorm.result_image, 3, 3, alpha=0.5)
    lcn = m.LocalContrastNormalizationNode(spatial.result_image, 3, 3, pm=0.25)
    cross = m.CrossChannelNormalizationNode(lcn.result_image, 3, beta=0.75)
    soft = m.LogSoftMaxNode(m.SoftMaxNode(cross.result_image).result_image)
    drop = m.DropoutNode(x, 0.5, 3, m.Size(1, 1, 0))
    dil = m.DilatedPoolingMaxNode(drop.result_image, 2, 1, 2)
    l2 = m.PoolingL2NormNode(dil.result_image, 2, 2)
    bil = m.UpsamplingBilinearNode(l2.result_image, 2, 3, True)
    mx = m.PoolingMaxNode(bil.result_image, 2)
    mx.stride_in_pixels_y = 1
    elu = m.NeuronNode(mx.result_image, m.NeuronDescriptor(m.NeuronType.ELU, a=0.5))
    fc = m.FullyConnectedNode(x, conv_ds(g, 8, 4, 3, None, torch.float64))
    fc.accumulator_precision = m.ConvolutionAccumulatorPrecisionOption.FLOAT
    tr = m.ConvolutionTransposeNode(x, None, conv_ds(g, 3, 4, 2, None, torch.float64))
    results = [reshape, soft, elu, fc, tr]
    for i, node in enumerate(results):
        node.result_image.handle = f"out{i}"
    return x, [r.result_image for r in results]


_IDENTITY = {"_sources", "result_image", "result_state", "_id", "_data_source", "padding_policy"}


def _describe(node) -> dict:
    """A node's attributes, comparable across two node graphs."""
    out = {k: repr(v) for k, v in vars(node).items() if k not in _IDENTITY}
    img = node.result_image
    out["image"] = (img.handle, img.format, img.export_from_graph, img.stop_gradient)
    pad = node.padding_policy
    out["padding"] = pad and (pad.padding_method, pad.label, pad._sets_clamp)
    out["trainable"] = node.trainable
    if hasattr(node, "data_source"):
        ds = node.data_source
        out["data_source"] = (type(ds).__name__, *map(repr, vars(ds).items()))
    return out


def test_every_forward_node_type_round_trips_with_its_attributes(tmp_path) -> None:
    _, results = _every_node()
    graph = m.Graph.from_results(DEV, results)
    graph.format = F64
    loaded = _roundtrip(graph, tmp_path)
    assert len(loaded._plan.order) == len(graph._plan.order) == 29
    for a, b in zip(graph._plan.order, loaded._plan.order, strict=True):
        assert type(a) is type(b)
        assert _describe(a) == _describe(b), type(a).__name__
        index = {id(n.result_image): i for i, n in enumerate(graph._plan.order)}
        index2 = {id(n.result_image): i for i, n in enumerate(loaded._plan.order)}
        assert [index.get(id(s)) for s in a.source_images] == [
            index2.get(id(s)) for s in b.source_images
        ]
    image = rand(gen(14), 2, 4, 8, 8)
    outs = [run(g, [image]) for g in (graph, loaded)]
    assert same(outs[0].tensor, outs[1].tensor)
    assert loaded.intermediate_image_handles == graph.intermediate_image_handles
    for a, b in zip(graph.intermediate_images, loaded.intermediate_images, strict=True):
        assert same(a.tensor, b.tensor)
    assert loaded.source_image_handles == [("x", 0)]


def test_every_node_type_is_registered() -> None:
    names = registered_types()
    classes = [getattr(m.graph, n) for n in m.graph.__all__]
    classes += [getattr(m.nodes, n) for n in m.nodes.__all__]
    nodes = [
        c for c in classes
        if isinstance(c, type) and issubclass(c, m.FilterNode)
        and c not in (m.FilterNode, m.GradientFilterNode)
    ]  # fmt: skip
    assert len(nodes) > 60
    for cls in [*nodes, m.ImageNode, m.Graph]:
        assert names.get(cls.__name__) is cls, cls.__name__
    assert names["TrainingGraph"].__name__ == "TrainingCall"


@pytest.mark.parametrize(
    ("name", "default", "bad"),
    [("recompute_normalization_results", True, "yes"),
     ("recompute_input_convolution_results", False, 1)],
)  # fmt: skip
def test_the_recompute_options_round_trip_and_default_for_older_files(
    tmp_path, name, default, bad
) -> None:
    from tests.io._helpers import _parts, _write

    net = cnn(7, torch.float32, batch_norm=True)
    graph = training(net.loss, torch.float32)
    assert getattr(graph, name) is default
    setattr(graph, name, not default)
    path = tmp_path / "graph.safetensors"
    m.save(graph, path)
    assert getattr(m.load(path), name) is not default
    structure, tensors = _parts(path)
    (entry,) = [o for o in structure["objects"] if o["type"] == "Graph"]
    assert entry["fields"].pop(name) is not default
    _write(path, structure, tensors)  # as written before the option existed
    assert getattr(m.load(path), name) is default
    entry["fields"][name] = bad
    _write(path, structure, tensors)
    with pytest.raises(m.CheckpointError, match=f"field '{name}' must be"):
        m.load(path)
