"""What save refuses in a graph (handles that are not JSON-like values, allocators, custom
padding policies, gradient nodes that training_graph() does not make again) and every
malformed graph file load rejects, each with its message."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mpsnn as m
from tests.io._graphs import DEV, batches, cnn, conv_ds, gen, step, training
from tests.io._helpers import _parts, _write


@pytest.fixture
def saved(tmp_path) -> Path:
    """A training graph (conv, ReLU, dropout, pool, fully connected, loss) after one step,
    and the inference graph of the same nodes."""
    net = cnn(1, torch.float32, dropout=True)
    train = training(net.loss, torch.float32)
    step(train, batches(2, 1, torch.float32)[0])
    path = tmp_path / "graphs.safetensors"
    m.save({"train": train, "infer": m.Graph(DEV, net.fc.result_image)}, path)
    return path


def _objects(s: dict, type_name: str) -> list[dict]:
    return [o["fields"] for o in s["objects"] if o["type"] == type_name]


def _one(s: dict, type_name: str) -> dict:
    return _objects(s, type_name)[0]


def _index(s: dict, type_name: str) -> int:
    return next(i for i, o in enumerate(s["objects"]) if o["type"] == type_name)


def _train(s: dict) -> dict:
    return _objects(s, "Graph")[0]


def _set(obj: dict, key, value) -> None:
    obj[key] = value


def _replace(s: dict, obj: dict, key, value) -> None:
    """``obj[key] = value``, the old value kept referenced by the root (the file's other checks
    want every object and tensor referenced)."""
    s["root"]["$dict"][f"kept{len(s['root']['$dict'])}"] = obj[key]
    obj[key] = value


def _kernel(s: dict, t: dict, type_name: str) -> int:
    """The position of the first node of ``type_name`` in the training graph's nodes."""
    i = _index(s, type_name)
    return next(k for k, ref in enumerate(_train(s)["nodes"]) if ref == {"$obj": i})


def _reshape_counter(s: dict, t: dict) -> None:
    ref = _train(s)["kernels"][_kernel(s, t, "DropoutNode")]["counter"]
    t[ref["$tensor"]] = torch.zeros(2, dtype=torch.int64)
    ref["shape"] = [2]


def _counter_on_the_convolution(s: dict, t: dict) -> None:
    kernels = _train(s)["kernels"]
    _replace(s, kernels, _kernel(s, t, "ConvolutionNode"), kernels[_kernel(s, t, "DropoutNode")])


_CASES = {
    "made": (
        lambda s, t: _one(s, "TrainingGraph")["made"].pop(),
        r"object \d+ \(TrainingGraph\) field 'made' must list the nodes training_graph\(\) makes again from the saved forward nodes \(\[\"FullyConnectedGradientNode\", .*\), got \[\"FullyConnectedGradientNode\", .*",
    ),
    "made is no list": (
        lambda s, t: _set(_one(s, "TrainingGraph"), "made", "x"),
        r"object \d+ \(TrainingGraph\) field 'made' must be a list of type names, got 'x'",
    ),
    "recipe changed": (
        lambda s, t: _set(_one(s, "PoolingMaxNode")["result_image"], "stop_gradient", True),
        r"object \d+ \(TrainingGraph\) field 'made' must list the nodes training_graph\(\) makes again from the saved forward nodes \(\[\"FullyConnectedGradientNode\"\]\), got \[\"FullyConnectedGradientNode\", \"PoolingMaxGradientNode\", .*",
    ),
    "start": (
        lambda s, t: _set(_one(s, "TrainingGraph"), "source_gradient", {"$obj": 0}),
        r"object \d+ \(TrainingGraph\) must start at a loss or initial gradient node without a source gradient, or at a forward node with one, got a LossNode with a source gradient",
    ),
    "position out of range": (
        lambda s, t: _set(_one(s, "ConvolutionGradientNode"), "position", 99),
        r"object \d+ \(ConvolutionGradientNode\) field 'position' must name a ConvolutionGradientNode among the 5 nodes its training graph makes, got 99",
    ),
    "position of another type": (
        lambda s, t: _set(_one(s, "ConvolutionGradientNode"), "position", 0),
        r"object \d+ \(ConvolutionGradientNode\) field 'position' must name a ConvolutionGradientNode among the 5 nodes its training graph makes, got 0",
    ),
    "training is no call": (
        lambda s, t: _set(_one(s, "ConvolutionGradientNode"), "training", {"$obj": 0}),
        r"object \d+ \(ConvolutionGradientNode\) field 'training' must be an instance of TrainingCall, got ImageNode",
    ),
    "nodes out of order": (
        lambda s, t: _train(s)["nodes"].reverse(),
        r"object \d+ \(Graph\) field 'nodes' must list the filter nodes the rebuilt graph runs, in its order \(\[\"ConvolutionNode\", \"NeuronReLUNode\", .*\), got \[\"ConvolutionGradientNode\", .*",
    ),
    "nodes are no nodes": (
        lambda s, t: _set(_train(s)["nodes"], 0, {"$obj": _index(s, "Adam")}),
        r"object \d+ \(Graph\) field 'nodes\.0' must be an instance of FilterNode, got Adam",
    ),
    "kernels length": (
        lambda s, t: _replace(s, _train(s), "kernels", []),
        r"object \d+ \(Graph\) field 'kernels' must be a list of 11 entries \(one per node\), got \[\]",
    ),
    "dropout counter missing": (
        lambda s, t: _replace(s, _train(s)["kernels"], _kernel(s, t, "DropoutNode"), None),
        r"object \d+ \(Graph\) field 'kernels\.2' must hold the values \['counter'\] of the kernel Dropout, got null",
    ),
    "kernel values of another kernel": (
        _counter_on_the_convolution,
        r"object \d+ \(Graph\) field 'kernels\.0' must hold the values \['biases', 'weights'\] of the kernel Convolution or null, got",
    ),
    "values for a kernel without": (
        lambda s, t: _set(_train(s)["kernels"], _kernel(s, t, "PoolingMaxNode"), {"x": 1}),
        r"object \d+ \(Graph\) field 'kernels\.3' must be null \(the kernel PoolingMax holds no values\), got \{\"x\": 1\}",
    ),
    "kernel tensor shape": (
        _reshape_counter,
        r"object \d+ \(Graph\) field 'kernels\.2\.counter' must have the shape \[1\], got \[2\]",
    ),
    "no results": (
        lambda s, t: _replace(s, _train(s), "results", []),
        r"object \d+ \(Graph\) field 'results' must be a non-empty list, got \[\]",
    ),
    "needed flags": (
        lambda s, t: _set(_train(s), "results_are_needed", [1]),
        r"object \d+ \(Graph\) field 'results_are_needed' must hold booleans, got \[1\]",
    ),
    "needed count": (
        lambda s, t: _set(_train(s), "results_are_needed", [True, False]),
        r"object \d+ \(Graph\) field 'results_are_needed' must be a list of 1 booleans, got \[true, false\]",
    ),
    "format": (
        lambda s, t: _set(_train(s), "format", "FLOAT128"),
        r"object \d+ \(Graph\) field 'format' must be one of the FeatureChannelFormat names \(UNORM8, FLOAT16, .*\), got 'FLOAT128'",
    ),
    "result is an input": (
        lambda s, t: _replace(s, _train(s), "results", [{"$obj": 0}]),
        r"object \d+ \(Graph\) must be rebuildable from its fields, got ValueError: \[Graph\] a result image must be made by a filter node, got a source <ImageNode 'x' \(source\)>",
    ),
    "image fields": (
        lambda s, t: _set(_one(s, "ImageNode")["image"], "format", "FLOAT128"),
        r"object 0 \(ImageNode\) field 'image' must hold a handle, a format \(a FeatureChannelFormat name or null\), export_from_graph and stop_gradient \(booleans\), got",
    ),
    "image producer": (
        lambda s, t: _set(_objects(s, "ImageNode")[1], "producer", {"$obj": _index(s, "Adam")}),
        r"object \d+ \(ImageNode\) field 'producer' must be an instance of FilterNode, got Adam",
    ),
    "a state where none": (
        lambda s, t: _set(_one(s, "LossNode"), "result_state", {"handle": None, "export_from_graph": False}),
        r"object \d+ \(LossNode\) field 'result_state' must be null \(the node makes no state\), got",
    ),
    "labels": (
        lambda s, t: _set(_one(s, "LossNode"), "input_labels", {"handle": None}),
        r"object \d+ \(LossNode\) field 'input_labels' must be a handle and export_from_graph, got \{\"handle\": null\}",
    ),
    "data source type": (
        lambda s, t: _replace(s, _one(s, "ConvolutionNode"), "data_source", {"$obj": _index(s, "Adam")}),
        r"object \d+ \(ConvolutionNode\) field 'data_source' must be an instance of ConvolutionDataSource, got Adam",
    ),
    "pooling size": (
        lambda s, t: _set(_one(s, "PoolingMaxNode"), "kernel_width", 0),
        r"object \d+ \(PoolingMaxNode\) field 'kernel_width' must be an int >= 1, got 0",
    ),
    "padding policy": (
        lambda s, t: _set(_one(s, "PoolingMaxNode"), "padding_policy", {"method": "same"}),
        r"object \d+ \(PoolingMaxNode\) field 'padding_policy' must hold a method \(int\), a label \(string or null\) and sets_clamp \(boolean\), got",
    ),
    "node value": (
        lambda s, t: _set(_one(s, "DropoutNode"), "keep_probability", 2.0),
        r"object \d+ \(DropoutNode\) must be rebuildable from its fields, got ValueError: \[Dropout\] keep_probability must be in \(0, 1\), got 2\.0",
    ),
    "missing field": (
        lambda s, t: _one(s, "NeuronReLUNode").pop("trainable"),
        r"object \d+ \(NeuronReLUNode\) must have the field 'trainable', got the fields \[.*\]",
    ),
    "extra field": (
        lambda s, t: _set(_one(s, "ConvolutionGradientNode"), "format", "FLOAT16"),
        r"object \d+ \(ConvolutionGradientNode\) must have only the fields its type reads, got also \['format'\]",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_CASES))
def test_malformed_graph_files_are_rejected(saved, case) -> None:
    edit, message = _CASES[case]
    structure, tensors = _parts(saved)
    edit(structure, tensors)
    _write(saved, structure, tensors)
    with pytest.raises(m.CheckpointError, match=r"\[load\] " + message):
        m.load(saved)


def test_a_gradient_node_position_named_twice_is_rejected(tmp_path) -> None:
    g = gen(3)
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, conv_ds(g, 3, 2, 3, None, torch.float32))
    c2 = m.ConvolutionNode(c1.result_image, conv_ds(g, 3, 3, 3, None, torch.float32))
    desc = m.LossDescriptor(m.LossType.MEAN_SQUARED_ERROR, m.ReductionType.SUM)
    graph = training(m.LossNode(c2.result_image, desc), torch.float32)
    path = tmp_path / "graph.safetensors"
    m.save(graph, path)
    structure, tensors = _parts(path)
    first, second = _objects(structure, "ConvolutionGradientNode")
    second["position"] = first["position"]
    _write(path, structure, tensors)
    with pytest.raises(
        m.CheckpointError,
        match=r"\[load\] object \d+ \(ConvolutionGradientNode\) field 'position' must name a node no other object names, got \d",
    ):
        m.load(path)


# ---------------------------------------------------------------------------------------------
# what save refuses (and then writes nothing)


class _Allocator:
    def image(self, cb, descriptor, kernel):  # pragma: no cover (never used)
        raise AssertionError


def _refusals():
    """``(what to save, error, message)`` for everything save refuses in a graph."""
    net = cnn(4, torch.float32)
    anything = m.Graph(DEV, m.SoftMaxNode(m.ImageNode(object())).result_image)
    tensor = m.SoftMaxNode(m.ImageNode("x"))
    tensor.result_image.handle = ["out", torch.zeros(1)]
    loss = m.LossNode(m.SoftMaxNode(m.ImageNode("x")).result_image, net.loss.descriptor)
    loss.input_labels.handle = {1: "labels"}
    allocated = m.SoftMaxNode(m.ImageNode("x"))
    allocated.result_image.image_allocator = _Allocator()
    graph = m.Graph(DEV, m.SoftMaxNode(m.ImageNode("x")).result_image)
    graph.destination_image_allocator = _Allocator()
    padded = m.SoftMaxNode(m.ImageNode("x"))
    padded.padding_policy = _Allocator()
    labelled = m.SoftMaxNode(m.ImageNode("x"))
    labelled.label = 5
    pool = m.PoolingMaxNode(m.ImageNode("x"), 2)
    pool.kernel_width = 2.0
    train = training(net.loss, torch.float32)
    net.conv.result_image.stop_gradient = True  # after training_graph(): it makes less now
    return [
        (anything, TypeError, r"\[save\] ImageNode\.handle at root\.Graph\.ImageNode\.SoftMaxNode\.ImageNode must be a JSON-like value to be saved \(None, bool, int, float, str, or lists, tuples and dicts with str keys of them\), got object"),
        ({"g": m.Graph(DEV, tensor.result_image)}, TypeError, r"\[save\] SoftMaxNode\.result_image\.handle at root\.g\.Graph\.ImageNode\.SoftMaxNode\.1 must be a JSON-like value to be saved .*, got Tensor"),
        (loss, TypeError, r"\[save\] LossNode\.input_labels\.handle at root\.LossNode must be a JSON-like value .*, got dict"),
        (allocated, TypeError, r"\[save\] SoftMaxNode\.result_image\.image_allocator must be None to be saved \(an allocator is code\), got _Allocator at root\.SoftMaxNode"),
        (graph, TypeError, r"\[save\] Graph\.destination_image_allocator must be None to be saved \(an allocator is code\), got _Allocator at root\.Graph"),
        (padded, TypeError, r"\[save\] SoftMaxNode\.padding_policy must be a DefaultPadding to be saved \(a custom policy is code\), got _Allocator"),
        (labelled, TypeError, r"\[save\] SoftMaxNode\.label must be str or None to be saved, got int at root\.SoftMaxNode"),
        ([pool], TypeError, r"\[save\] PoolingMaxNode field 'kernel_width' must be an int, got float at root\.0\.PoolingMaxNode"),
        (train, TypeError, r"\[save\] a gradient node must be one that training_graph\(\) makes again from the saved forward nodes \(its loss or initial gradient node, or its node and source gradient\) to be saved, got a ConvolutionGradientNode that it does not make \(made some other way, or the forward graph changed after training_graph\(\)\) at root\.Graph\.ImageNode\.ConvolutionGradientNode"),
    ]  # fmt: skip


def test_save_refuses_what_it_cannot_restore(tmp_path) -> None:
    path = tmp_path / "x.safetensors"
    for value, error, message in _refusals():
        with pytest.raises(error, match=message):
            m.save(value, path)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary file left
