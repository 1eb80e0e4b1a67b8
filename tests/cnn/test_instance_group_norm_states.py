"""The MPS contracts of instance and group normalization: one gradient state per image, each
holding that image's gamma/beta gradient; a shared state still sums the batch; data sources
(the tensor ones and a user's, public API only) update from the batch of states, explicitly
and in a graph; and every image's state reaches a data-parallel run's collectives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.cnn._normalization_helpers import (
    DEV,
    KINDS,
    ClientInstanceDataSource,
    Collectives,
    data,
    gn_reference,
    make_batches,
    norm,
    training_graph,
)
from tests.helpers import assert_close, run


@pytest.mark.parametrize("kind,groups", KINDS)
def test_one_gradient_state_per_image(kind, groups) -> None:
    x, g, gamma, beta = data(n=3, c=4, h=3, w=5, seed=11)
    _, fwd, grad = norm(kind, 4, gamma, beta, groups)
    xb, gb = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(g)
    cb = DEV.new_command_queue().command_buffer()
    st = fwd.result_state_batch(xb)
    temp = fwd.temporary_result_state_batch(cb, xb)
    assert len(st.unique()) == 3 and len(temp.unique()) == 3
    temp.increment_read_count(-1)  # not used
    fwd.encode_batch(cb, xb, destination_states=st)
    dx = grad.encode_batch(cb, gb, xb, st)
    run(cb)
    rdx, rdg, rdb = gn_reference(x, g, gamma, beta, groups)
    assert_close(dx.tensor, rdx, f"{kind} dL/dx")
    for i, state in enumerate(st):  # image i's own gradient: the loss of image i alone
        gi = torch.zeros_like(g)
        gi[i] = g[i]
        _, dgi, dbi = gn_reference(x, gi, gamma, beta, groups)
        assert_close(state.gradient_for_gamma, dgi, f"{kind} image {i} dL/dgamma")
        assert_close(state.gradient_for_beta, dbi, f"{kind} image {i} dL/dbeta")
    dgamma, dbeta = type(st[0]).summed_gradients(st)
    assert_close(dgamma, rdg, f"{kind} dL/dgamma summed over the batch")
    assert_close(dbeta, rdb, f"{kind} dL/dbeta summed over the batch")


@pytest.mark.parametrize("kind,groups", KINDS)
def test_a_shared_state_still_sums_the_batch(kind, groups) -> None:
    x, g, gamma, beta = data(n=3, c=4, h=3, w=5, seed=12)
    _, fwd, grad = norm(kind, 4, gamma, beta, groups)
    xb, gb = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(g)
    cb = DEV.new_command_queue().command_buffer()
    shared = fwd.result_state(xb[0])
    fwd.encode_batch(cb, xb, destination_states=[shared] * 3)
    dx = grad.encode_batch(cb, gb, xb, [shared] * 3)
    run(cb)
    rdx, rdg, rdb = gn_reference(x, g, gamma, beta, groups)
    assert_close(dx.tensor, rdx, "dL/dx")
    assert_close(shared.gradient_for_gamma, rdg, "dL/dgamma")
    assert_close(shared.gradient_for_beta, rdb, "dL/dbeta")


@pytest.mark.parametrize("kind,groups", KINDS)
@pytest.mark.parametrize("path", ["gpu", "cpu"])
def test_data_source_updates_from_the_batch_of_states(kind, groups, path) -> None:
    x, g, gamma, beta = data(n=3, c=4, h=3, w=5, seed=13)
    opt = m.SGD(DEV, descriptor=m.OptimizerDescriptor(learning_rate=0.5))
    ds, fwd, grad = norm(kind, 4, gamma, beta, groups, opt)
    xb, gb = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(g)
    cb = DEV.new_command_queue().command_buffer()
    st = fwd.result_state_batch(xb)
    fwd.encode_batch(cb, xb, destination_states=st)
    grad.encode_batch(cb, gb, xb, st)
    if path == "gpu":
        fwd.reload_gamma_and_beta(cb, ds.update_gamma_and_beta(cb, st))
        run(cb)
    else:
        run(cb)
        assert ds.update_gamma_and_beta_on_cpu(st)
        fwd.reload_gamma_and_beta_from_data_source()
    _, rdg, rdb = gn_reference(x, g, gamma, beta, groups)
    assert_close(ds.gamma(), gamma - 0.5 * rdg, "gamma after SGD on the summed gradient")
    assert_close(fwd.beta, beta - 0.5 * rdb, "beta reloaded")


@pytest.mark.parametrize("client", [False, True], ids=["tensor-data-source", "client"])
def test_graph_updates_instance_normalization_from_the_state_batch(client) -> None:
    n, c, h, w, lr = 3, 4, 3, 4, 0.1
    _, _, gamma, beta = data(c=c, seed=14)
    if client:
        ds = ClientInstanceDataSource(c, gamma, beta, lr)
    else:
        opt = m.SGD(DEV, descriptor=m.OptimizerDescriptor(learning_rate=lr))
        ds = m.TensorInstanceNormalizationDataSource(c, gamma, beta, 1e-5, opt)
    node = m.InstanceNormalizationNode(m.ImageNode("x"), ds)
    graph = training_graph(node)
    batches = make_batches(n, c, h, w, 2, seed=15)
    for x, target in batches:
        cb = DEV.new_command_queue().command_buffer()
        graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)], [m.LossLabels(DEV, target)])
        run(cb)
    ga, be = gamma.clone().requires_grad_(), beta.clone().requires_grad_()
    for x, target in batches:
        y = F.instance_norm(x, weight=ga, bias=be, eps=1e-5)
        dg, db = torch.autograd.grad(0.5 * ((y - target) ** 2).sum(), (ga, be))
        with torch.no_grad():
            ga -= lr * dg
            be -= lr * db
    if client:
        assert ds.batches == [n, n]  # the data source received one state per image
    assert_close(ds.gamma(), ga.detach(), "gamma after two graph steps")
    assert_close(ds.beta(), be.detach(), "beta after two graph steps")
    assert_close(graph._plan.kernels[node._id].gamma, ga.detach(), "the kernel reloaded gamma")


def test_every_images_state_reaches_the_collectives() -> None:
    x, _, gamma, beta = data(n=3, c=4, h=3, w=4, seed=16)
    ds = m.TensorInstanceNormalizationDataSource(4, gamma, beta, 1e-5, m.SGD(DEV))
    node = m.InstanceNormalizationNode(m.ImageNode("x"), ds)
    graph = training_graph(node)
    graph.data_parallel = hooks = Collectives()
    cb = DEV.new_command_queue().command_buffer()
    graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)], [m.LossLabels(DEV, torch.zeros_like(x))])
    run(cb)
    (states,) = hooks.summed
    assert len(set(map(id, states))) == 3  # the three images' gradient states, in one call


def test_folding_the_per_image_states_keeps_the_update() -> None:
    """What `mpsnn.DataParallel` does before its all-reduce: the batch's per-image sums are
    folded into the first state on the device (one exchange per layer, not one per image);
    the data source's update, which sums the batch of states, gives the same gamma/beta."""
    from mpsnn.distributed.collectives import _fold, _sums

    x, _, gamma, beta = data(n=3, c=4, h=3, w=4, seed=16)
    results, seen = [], {}
    for fold in (False, True):
        ds = m.TensorInstanceNormalizationDataSource(4, gamma, beta, 1e-5, m.SGD(DEV))
        node = m.InstanceNormalizationNode(m.ImageNode("x"), ds)
        graph = training_graph(node)
        graph.data_parallel = hooks = Collectives()
        if fold:

            def before(hooks=hooks) -> None:
                def run_fold() -> None:
                    states = hooks.summed[0]
                    seen["total"] = [sum(t) for t in zip(*(_sums(s) for s in states), strict=True)]
                    _fold(states[0], states[1:], 0)
                    seen["first"] = [t.clone() for t in _sums(states[0])]
                    seen["others"] = [t.clone() for s in states[1:] for t in _sums(s)]

                hooks.step.cb.record("fold", run_fold)

            hooks.before_updates = before
        cb = DEV.new_command_queue().command_buffer()
        labels = [m.LossLabels(DEV, torch.zeros_like(x))]
        graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)], labels)
        run(cb)
        results.append((ds.gamma().clone(), ds.beta().clone()))
    for got, want in zip(seen["first"], seen["total"], strict=True):
        assert torch.equal(got, want)
    assert all(not t.any() for t in seen["others"])
    assert not torch.equal(results[0][0], gamma)  # the update moved gamma: a real comparison
    for a, b in zip(*results, strict=True):
        assert_close(b, a, "gamma/beta after the folded update", 1e-12)
