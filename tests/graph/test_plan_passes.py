"""The plan's passes one by one (`mpsnn.graph.plan_passes`), and the frozen `GraphPlan` a
`Graph` keeps: each pass is a pure function of the node graph and the earlier records."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mpsnn as m
from mpsnn.graph.plan import GraphPlan, build_plan
from mpsnn.graph.plan_passes import (
    fusion_pass,
    liveness_pass,
    modes_pass,
    order_pass,
)
from mpsnn.graph.plan_recompute import recompute_pass
from tests.graph._helpers import DEV, ce_loss, conv_ds, gen, sgd1


def _net(*, bn: bool = False, prelu: bool = False):
    """x -> conv -> [bn] -> relu|prelu -> pool -> fc -> loss: the nodes and the loss."""
    g = gen(3)
    x = m.ImageNode("x")
    conv = m.ConvolutionNode(x, conv_ds(g, 3, 3, 2, 4, sgd1()))
    img = conv.result_image
    norm = None
    if bn:
        norm = m.BatchNormalizationNode(
            img, m.TensorBatchNormalizationDataSource(4, optimizer=sgd1())
        )
        img = norm.result_image
    if prelu:
        act = m.NeuronPReLUNode(img, [0.1, 0.2, 0.3, 0.4])
    else:
        act = m.NeuronReLUNode(img)
    pool = m.PoolingMaxNode(act.result_image, 2)
    fc = m.FullyConnectedNode(pool.result_image, conv_ds(g, 2, 2, 4, 3, sgd1()))
    loss = ce_loss(fc.result_image, 2)
    return x, conv, norm, act, pool, fc, loss


def _training_results(loss):
    (terminal,) = loss.training_graph(None, None)
    return [terminal.result_image], terminal


def test_order_pass_puts_producers_first_and_lists_the_sources() -> None:
    x, conv, _, act, pool, fc, loss = _net()
    topo = order_pass([fc.result_image])
    assert topo.order == (conv, act, pool, fc)
    assert topo.sources == (x,) and topo.source_ids == frozenset({x._id})
    results, _ = _training_results(loss)
    topo = order_pass(results)
    index = {n._id: i for i, n in enumerate(topo.order)}
    for n in topo.order:  # every producer before its readers
        for s in [*n.source_images, *n.source_states]:
            if s.producer is not None:
                assert index[s.producer._id] < index[n._id]
    assert len(topo.state_sources) == 1  # the loss's labels


def test_order_pass_refuses_a_source_as_result() -> None:
    with pytest.raises(ValueError, match=r"\[Graph\] a result image must be made by a filter"):
        order_pass([m.ImageNode("x")])


def test_modes_pass_trains_only_what_a_gradient_reads() -> None:
    _x, conv, norm, act, pool, fc, loss = _net(bn=True)
    inference = order_pass([fc.result_image])
    assert modes_pass(inference, [fc.result_image]).training == frozenset()
    results, _ = _training_results(loss)
    topo = order_pass(results)
    modes = modes_pass(topo, results)
    assert {conv._id, norm._id, act._id, pool._id, fc._id} <= modes.training
    assert [type(g.inference_node) for g in modes.trainable] == [
        m.FullyConnectedNode, m.BatchNormalizationNode, m.ConvolutionNode,
    ]  # fmt: skip
    assert modes.cpu_updates == frozenset() and modes.kept == frozenset({results[0]._id})


def test_modes_pass_exported_images_and_states() -> None:
    _x, conv, _, _act, pool, fc, _ = _net()
    pool.result_image.export_from_graph = True
    conv.result_state.export_from_graph = True
    topo = order_pass([fc.result_image])
    modes = modes_pass(topo, [fc.result_image])
    assert modes.exported == (pool.result_image,)
    assert modes.exported_states == (conv.result_state,)
    assert conv._id in modes.training  # it runs in training mode to make its state
    assert modes.kept == frozenset({fc.result_image._id, pool.result_image._id})


def test_fusion_pass_fuses_relu_into_conv_and_batch_norm_by_traits() -> None:
    _, conv, _, act, _, fc, loss = _net()
    topo = order_pass([fc.result_image])
    fusion = fusion_pass(topo, modes_pass(topo, [fc.result_image]))
    assert fusion.fused_into == {act._id: conv}
    assert fusion.fused == {conv._id: "RELU"}
    assert fusion.key(act.result_image._id) == act.result_image._id
    assert fusion.key(conv.result_image._id) == act.result_image._id  # one key for both

    _, conv, norm, act, _, fc, loss = _net(bn=True)
    results, _ = _training_results(loss)
    topo = order_pass(results)
    fusion = fusion_pass(topo, modes_pass(topo, results))
    assert fusion.fused_into == {act._id: norm}
    # the ReLU's gradient passes its incoming gradient on: the BN gradient applies it
    (relu_grad,) = [n for n in topo.order if getattr(n, "inference_node", None) is act]
    assert fusion.passed == frozenset({relu_grad._id})


def test_fusion_pass_leaves_prelu_and_a_source_with_its_own_neuron_alone() -> None:
    _, _, _, _, _, fc, _ = _net(prelu=True)
    topo = order_pass([fc.result_image])
    assert fusion_pass(topo, modes_pass(topo, [fc.result_image])).fused_into == {}
    # a data source whose descriptor fuses a neuron already
    g = gen(4)
    desc = m.ConvolutionDescriptor(3, 3, 2, 4)
    desc.fused_neuron_descriptor = m.NeuronDescriptor(m.NeuronType.SIGMOID)
    ds = m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape, generator=g,
                                                         dtype=torch.float64))  # fmt: skip
    relu = m.NeuronReLUNode(m.ConvolutionNode(m.ImageNode("x"), ds).result_image)
    topo = order_pass([relu.result_image])
    assert fusion_pass(topo, modes_pass(topo, [relu.result_image])).fused_into == {}


def test_fusion_pass_keeps_a_relu_whose_source_is_exported_unfused() -> None:
    _, conv, _, _act, _, fc, _ = _net()
    conv.result_image.export_from_graph = True
    results = [fc.result_image]
    topo = order_pass(results)
    assert fusion_pass(topo, modes_pass(topo, results)).fused_into == {}


def test_liveness_pass_counts_readers_and_frees_after_the_last() -> None:
    _, _conv, _, _act, _pool, _fc, loss = _net()
    results, _ = _training_results(loss)
    topo = order_pass(results)
    modes = modes_pass(topo, results)
    fusion = fusion_pass(topo, modes)
    live = liveness_pass(topo, modes, fusion, results)
    index = {n._id: i for i, n in enumerate(topo.order)}
    for k, count in live.readers.items():
        readers = [n for n in topo.order if k in live.reads_by[n._id]]
        assert len(readers) == count
        assert live.last_reader[k] == max(readers, key=lambda n: index[n._id])._id
    # the source is the caller's: never released by the step; the kept result neither
    assert all(topo.sources[0]._id not in ks for ks in live.reads_by.values())
    assert results[0]._id not in live.readers
    # the states the updates read are released after the updates, not by a node
    assert live.update_states and not (live.update_states & live.readers.keys())
    assert live.source_reads == (2,)  # the convolution and its weight gradient


def test_recompute_pass_frees_batch_norm_results_until_the_backward() -> None:
    _, _conv, norm, _act, _pool, _fc, loss = _net(bn=True)
    results, _ = _training_results(loss)
    topo = order_pass(results)
    modes = modes_pass(topo, results)
    fusion = fusion_pass(topo, modes)
    live = liveness_pass(topo, modes, fusion, results)
    rec = recompute_pass(topo, modes, fusion, live)
    ((first, (plan,)),) = rec.before.items()
    assert plan.node is norm and plan.key == fusion.key(norm.result_image._id)
    index = {n._id: i for i, n in enumerate(topo.order)}
    assert index[plan.last_forward] < index[first]
    # its forward readers: the fused ReLU node (one key with the normalization's) and the pool
    assert rec.reads[plan.key] == 2


def test_graph_plan_is_frozen_and_describes_the_graph() -> None:
    _, conv, _, _act, _, _fc, loss = _net()
    results, _ = _training_results(loss)
    graph = m.Graph(DEV, results[0], False)
    plan = graph.plan
    assert isinstance(plan, GraphPlan)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.kernels = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        plan.kernels[conv._id] = None  # type: ignore[index]
    with pytest.raises(TypeError):
        plan.fusion.fused_into[0] = conv  # type: ignore[index]
    assert plan.skips_data_gradient  # nothing reads the input's gradient
    text = graph.debug_description()
    assert "fused RELU" in text and "updates after the gradients: FullyConnectedNode" in text
    # the same passes again give the same decisions (the plan is a function of the nodes)
    again = build_plan(graph, results, [False])
    assert again.topology == plan.topology and again.fusion == plan.fusion
    assert again.liveness == plan.liveness and again.modes == plan.modes
