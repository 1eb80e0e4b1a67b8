"""Training and inference modes from one node recipe: batch normalization (batch statistics
and running averages in a training graph, the running statistics in an inference graph) and
dropout (a new mask per encode in training, the identity in inference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import mpsnn as m
from tests.graph._helpers import (
    DEV,
    F64,
    TOL,
    TorchConv,
    assert_close,
    ce_loss,
    ce_reference,
    conv_ds,
    encode,
    gen,
    rand,
    sgd1,
    training,
)

EPS, MOMENTUM = 1e-3, 0.3


def _bn_net(g: torch.Generator):
    # no bias before batch normalization: its gradient is zero up to rounding
    d1, d2 = conv_ds(g, 3, 3, 2, 3, sgd1(), bias=False), conv_ds(g, 3, 3, 3, 4, sgd1())
    bn_ds = m.TensorBatchNormalizationDataSource(
        3,
        gamma=1 + rand(g, 3, scale=0.2),
        beta=rand(g, 3, scale=0.2),
        mean=rand(g, 3, scale=0.1),
        variance=1 + rand(g, 3, scale=0.1).abs(),
        epsilon=EPS,
        momentum=MOMENTUM,
        optimizer=sgd1(),
    )
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, d1)
    bn = m.BatchNormalizationNode(c1.result_image, bn_ds)
    relu = m.NeuronReLUNode(bn.result_image)
    fc = m.FullyConnectedNode(m.PoolingAverageNode(relu.result_image, 2).result_image, d2)
    return d1, d2, bn_ds, relu, fc


class _TorchBN:
    def __init__(self, ds: m.TensorBatchNormalizationDataSource) -> None:
        self.ds = ds
        self.gamma = ds.gamma().detach().clone().requires_grad_()
        self.beta = ds.beta().detach().clone().requires_grad_()

    def train(self, h: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        """Batch statistics; ``mean`` and ``var`` (running) updated in place, as PyTorch does."""
        return F.batch_norm(h, mean, var, self.gamma, self.beta, True, MOMENTUM, EPS)


def test_batch_normalization_training_and_inference_graphs_from_one_recipe() -> None:
    g = gen(20)
    d1, d2, bn_ds, relu, fc = _bn_net(g)
    relu.result_image.export_from_graph = True
    t1, t2, tbn = TorchConv(d1), TorchConv(d2), _TorchBN(bn_ds)
    running = [bn_ds.mean().clone(), bn_ds.variance().clone()]
    graph, _ = training(ce_loss(fc.result_image, 4))
    text = graph.debug_description()
    assert "BatchNormalizationNode [BatchNormalizationStatistics+BatchNormalization]" in text
    assert "(training; fused RELU)" in text, text

    # one training step: the batch's statistics, the gradients, the running averages
    xt = rand(g, 4, 2, 6, 6)
    labels = torch.randint(0, 4, (4, 1, 1), generator=g)
    out = encode(graph, [xt], [m.LossLabels(DEV, labels)])
    xr = xt.clone().requires_grad_()
    act = F.relu(tbn.train(t1(xr), *running))
    act.retain_grad()
    ce_reference(t2.fc(F.avg_pool2d(act, 2)), labels).backward()
    (exported,) = graph.intermediate_images
    assert not exported.image.is_temporary
    assert_close(exported.tensor, act, "batch-normalized (training) activations", TOL)
    assert_close(out.tensor, xr.grad, "dL/dx through batch normalization", TOL)
    t1.check_step("conv before batch normalization")
    t2.check_step("fully connected")
    assert_close(tbn.gamma.detach() - bn_ds.gamma(), tbn.gamma.grad, "gamma gradient", TOL)
    assert_close(tbn.beta.detach() - bn_ds.beta(), tbn.beta.grad, "beta gradient", TOL)
    assert_close(bn_ds.mean(), running[0], "running mean after 1 step", TOL)
    assert_close(bn_ds.variance(), running[1], "running variance (unbiased) after 1 step", TOL)

    # a second step: the running averages move again, from the updated network
    t1, t2, tbn = TorchConv(d1), TorchConv(d2), _TorchBN(bn_ds)
    xt2 = rand(g, 4, 2, 6, 6)
    encode(graph, [xt2], [m.LossLabels(DEV, torch.randint(0, 4, (4, 1, 1), generator=g))])
    with torch.no_grad():
        tbn.train(t1(xt2), *running)
    assert_close(bn_ds.mean(), running[0], "running mean after 2 steps", TOL)
    assert_close(bn_ds.variance(), running[1], "running variance after 2 steps", TOL)

    # an inference graph of the same nodes: the running statistics, no update of anything
    infer = m.Graph(DEV, fc.result_image)
    infer.format = F64
    assert "training" not in infer.debug_description()
    t1, t2 = TorchConv(d1), TorchConv(d2)
    before = [
        bn_ds.mean().clone(),
        bn_ds.variance().clone(),
        bn_ds.gamma().clone(),
        d1.weights().clone(),
    ]
    xt3 = rand(g, 3, 2, 6, 6)
    y = encode(infer, [xt3])
    h = F.batch_norm(
        t1(xt3), bn_ds.mean(), bn_ds.variance(), bn_ds.gamma(), bn_ds.beta(), False, 0.0, EPS
    )
    ref = t2.fc(F.avg_pool2d(F.relu(h), 2))
    assert_close(y.tensor, ref, "inference through batch normalization", TOL)
    after = [bn_ds.mean(), bn_ds.variance(), bn_ds.gamma(), d1.weights()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # and the batch statistics would give something else
    h_batch = F.batch_norm(t1(xt3), None, None, bn_ds.gamma(), bn_ds.beta(), True, 0.0, EPS)
    assert not torch.allclose(t2.fc(F.avg_pool2d(F.relu(h_batch), 2)), ref)


def test_batch_normalization_inference_graph_made_before_training_reloads() -> None:
    g = gen(21)
    d1, d2, bn_ds, _relu, fc = _bn_net(g)
    infer = m.Graph(DEV, fc.result_image)  # made first: its kernels copy the current values
    infer.format = F64
    graph, _ = training(ce_loss(fc.result_image, 2))
    xt = rand(g, 2, 2, 6, 6)
    stale_ref = encode(infer, [xt]).tensor.clone()
    encode(graph, [rand(g, 2, 2, 6, 6)], [m.LossLabels(DEV, torch.tensor([[[1]], [[3]]]))])
    assert torch.equal(encode(infer, [xt]).tensor, stale_ref)  # no reload yet
    infer.reload_from_data_sources()
    t1, t2 = TorchConv(d1), TorchConv(d2)
    h = F.batch_norm(
        t1(xt), bn_ds.mean(), bn_ds.variance(), bn_ds.gamma(), bn_ds.beta(), False, 0.0, EPS
    )
    assert_close(encode(infer, [xt]).tensor, t2.fc(F.avg_pool2d(F.relu(h), 2)), "after reload", TOL)


# -- dropout ----------------------------------------------------------------------------------------


def _dropout_graph(keep: float, seed: int):
    x, dy = m.ImageNode("x"), m.ImageNode("dy")
    drop = m.DropoutNode(x, keep, seed)
    (grad,) = drop.training_graph(dy)
    assert isinstance(grad, m.DropoutGradientNode) and grad.inference_node is drop
    graph = m.Graph.from_results(DEV, [grad.result_image, drop.result_image])
    graph.format = F64
    return graph


def test_dropout_gradient_is_the_forward_mask_over_keep() -> None:
    keep = 0.6
    graph = _dropout_graph(keep, 7)
    assert graph.source_image_handles == ["dy", "x"]
    g = gen(22)
    x, dy = rand(g, 2, 3, 8, 8), rand(g, 2, 3, 8, 8)
    masks = []
    for _ in range(2):
        dx = encode(graph, [dy, x])
        (y,) = graph.intermediate_images
        mask = (y.tensor != 0).double()
        assert 0.45 < mask.mean().item() < 0.75  # about keep
        assert_close(y.tensor, x * mask / keep, "dropout forward", TOL)
        assert_close(dx.tensor, dy * mask / keep, "dropout gradient", TOL)
        masks.append(mask)
    assert not torch.equal(masks[0], masks[1])  # a new mask at every encode


def test_dropout_in_a_training_chain_matches_autograd_with_its_mask() -> None:
    g = gen(23)
    keep = 0.7
    d1, d2 = conv_ds(g, 3, 3, 2, 4, sgd1()), conv_ds(g, 3, 3, 4, 3, sgd1())
    t1, t2 = TorchConv(d1), TorchConv(d2)
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, d1)
    drop = m.DropoutNode(c1.result_image, keep, 3)
    drop.result_image.export_from_graph = True
    fc = m.FullyConnectedNode(m.PoolingMaxNode(drop.result_image, 2).result_image, d2)
    graph, _ = training(ce_loss(fc.result_image, 3))
    assert "DropoutNode [Dropout] (t0) -> t1  (training" in graph.debug_description()
    xt = rand(g, 3, 2, 6, 6)
    labels = torch.randint(0, 3, (3, 1, 1), generator=g)
    out = encode(graph, [xt], [m.LossLabels(DEV, labels)])
    mask = (graph.intermediate_images[0].tensor != 0).double()
    assert 0 < mask.mean().item() < 1
    xr = xt.clone().requires_grad_()
    ce_reference(t2.fc(F.max_pool2d(t1(xr) * mask / keep, 2)), labels).backward()
    assert_close(out.tensor, xr.grad, "dL/dx through dropout", TOL)
    t1.check_step("conv before dropout")
    t2.check_step("fully connected after dropout")


def test_dropout_is_the_identity_in_an_inference_graph() -> None:
    g = gen(24)
    d1, d2 = conv_ds(g, 3, 3, 2, 3), conv_ds(g, 3, 3, 3, 2)
    t1, t2 = TorchConv(d1), TorchConv(d2)
    x = m.ImageNode("x")
    c1 = m.ConvolutionNode(x, d1)
    drop = m.DropoutNode(c1.result_image, 0.5, 1)
    c2 = m.ConvolutionNode(drop.result_image, d2)
    xt = rand(g, 2, 2, 6, 6)
    # dropout between two filters: the second reads the first's image
    middle = m.Graph(DEV, c2.result_image)
    middle.format = F64
    assert "training" not in middle.debug_description()
    for _ in range(2):
        assert_close(encode(middle, [xt]).tensor, t2(t1(xt)), "conv, dropout, conv", TOL)
    # dropout as the result: the image it passes on is the graph's (permanent) result
    last = m.Graph(DEV, drop.result_image)
    last.format = F64
    y = encode(last, [xt])
    assert not y.image.is_temporary
    assert_close(y.tensor, t1(xt), "dropout as the result", TOL)
    # ... also when a concatenation makes that image
    cat = m.ConcatenationNode([c1.result_image, x])
    last = m.Graph(DEV, m.DropoutNode(cat.result_image, 0.5).result_image)
    last.format = F64
    y = encode(last, [xt])
    assert not y.image.is_temporary
    assert_close(y.tensor, torch.cat([t1(xt), xt], 1), "dropout of a concatenation", TOL)
    # dropout of a graph input: the input itself, no work
    only = m.Graph(DEV, m.DropoutNode(x, 0.5).result_image)
    src = m.ImageBatch.from_tensor(xt)
    cb = DEV.new_command_queue().command_buffer()
    out = only.encode_batch(cb, [src])
    assert len(cb) == 0 and torch.equal(out.tensor, xt)
