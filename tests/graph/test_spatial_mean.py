"""The spatial mean (`ReduceSpatialMean`, `ReduceSpatialMeanGradient`, `ReductionSpatialMeanNode`,
`ReductionSpatialMeanGradientNode`): the forward against torch.mean in float64 (whole images, a
source clip rect, a channel range), the gradient against autograd and the adjoint test with
random cotangents, a training graph that walks through the node against PyTorch autograd
(weights included), and save/load round trips of the kernels and of that training graph."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from tests.graph._helpers import (
    DEV,
    F64,
    TOL,
    TorchConv,
    assert_close,
    conv_sandwich,
    encode,
    gen,
    mse_reference,
    rand,
    training_seen,
)
from tests.io._helpers import _roundtrip


def _forward_and_gradient(k, x: torch.Tensor, g: torch.Tensor | None = None):
    """(result, data gradient for the incoming gradient ``g``) of one forward + gradient."""
    cb = DEV.new_command_queue().command_buffer()
    src = m.Image.from_tensor(x)
    state = k.result_state(src)
    y = k.encode(cb, src, destination_state=state)
    dx = None
    if g is not None:
        dx = m.ReduceSpatialMeanGradient(DEV).encode(cb, m.Image.from_tensor(g), src, state)
    cb.commit()
    cb.wait_until_completed()
    return y.tensor, (None if dx is None else dx.tensor)


REGIONS = [
    None,  # the whole source
    ((1, 2, 0), (3, 2, 1)),  # x 1..3, y 2..3, image 0
    ((-2, 1, 1), (4, 9, 5)),  # clipped by the source: x 0..1, y 1..5, images 1..2
]


@pytest.mark.parametrize("region", REGIONS)
def test_forward_and_gradient_against_torch_mean_and_autograd(region) -> None:
    g = gen(3)
    x = rand(g, 3, 5, 6, 4)
    k = m.ReduceSpatialMean(DEV)
    k.source_feature_channel_offset = 1
    k.source_feature_channel_max_count = 3
    rows, cols, images = slice(0, 6), slice(0, 4), slice(0, 3)
    if region is not None:
        (ox, oy, oz), (w, h, d) = region
        k.clip_rect_source = m.Region(m.Origin(ox, oy, oz), m.Size(w, h, d))
        rows = slice(max(oy, 0), min(oy + h, 6))
        cols = slice(max(ox, 0), min(ox + w, 4))
        images = slice(oz, min(oz + d, 3))
    n = images.stop - images.start
    cot = rand(g, n, 3, 1, 1)
    y, dx = _forward_and_gradient(k, x, cot)

    xr = x.clone().requires_grad_()
    want = xr[images, 1:4, rows, cols].mean((2, 3), keepdim=True)
    assert y.shape == (n, 3, 1, 1)
    assert_close(y, want.detach(), "spatial mean", TOL)
    want.backward(cot)
    assert dx.shape == x.shape  # the gradient of the whole source: 0 on images not read
    assert_close(dx, xr.grad, "dL/dx", TOL)
    assert dx[:, 0].abs().max() == 0 and dx[:, 4].abs().max() == 0  # channels not read
    if region is not None:  # 0 outside the region read
        outside = torch.ones(6, 4, dtype=torch.bool)
        outside[rows, cols] = False
        assert dx[:, :, outside].abs().max() == 0


def test_adjoint_with_random_cotangents() -> None:
    g = gen(4)
    k = m.ReduceSpatialMean(DEV)
    k.clip_rect_source = m.Region(m.Origin(1, 0, 0), m.Size(3, 4, 2))
    x, v = rand(g, 2, 3, 5, 6), rand(g, 2, 3, 5, 6)
    w = rand(g, 2, 3, 1, 1)
    _, gw = _forward_and_gradient(k, x, w)
    # the forward is linear: J v is the forward of v
    jv, _ = _forward_and_gradient(k, v)
    lhs, rhs = float((jv * w).sum()), float((v * gw).sum())
    assert lhs != 0 and abs(lhs - rhs) <= 1e-12 * max(abs(lhs), abs(rhs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_low_precision_accumulates_in_float32(dtype) -> None:
    g = gen(5)
    x = rand(g, 2, 4, 9, 7)
    cot = rand(g, 2, 4, 1, 1)
    y, dx = _forward_and_gradient(m.ReduceSpatialMean(DEV), x.to(dtype), cot.to(dtype))
    xq = x.to(dtype).double()
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    assert_close(y.double(), xq.mean((2, 3), keepdim=True), "mean", tol)
    want = (cot.to(dtype).double() / 63).expand_as(x)
    assert dx.dtype == dtype
    assert_close(dx.double(), want, "gradient", tol)


def test_the_result_pixel_is_at_the_clip_rect_origin_which_must_be_inside() -> None:
    k = m.ReduceSpatialMean(DEV)
    x = rand(gen(10), 1, 2, 3, 3)
    k.clip_rect = m.Region(m.Origin(1, 0, 0), m.Size(1, 1, 1))
    dst = m.Image.from_tensor(torch.zeros(1, 2, 2, 2, dtype=torch.float64))
    cb = DEV.new_command_queue().command_buffer()
    k.encode(cb, m.Image.from_tensor(x), dst)
    cb.commit()
    cb.wait_until_completed()
    want = torch.zeros(1, 2, 2, 2, dtype=torch.float64)
    want[:, :, 0, 1] = x.mean((2, 3))
    assert_close(dst.tensor, want, "the mean at the clip rect's origin", TOL)
    k.clip_rect = m.Region(m.Origin(-1, 0, 0), m.Size(3, 1, 1))
    cb = DEV.new_command_queue().command_buffer()
    with pytest.raises(ValueError, match=r"\[ReduceSpatialMean\] the clip rect's x origin must"):
        k.encode(cb, m.Image.from_tensor(x), dst)


def _graph(g: torch.Generator):
    def middle(h: m.ImageNode) -> m.ImageNode:
        return m.ReductionSpatialMeanNode(h).result_image

    return conv_sandwich(g, (3, 3, 2, 4), middle, (1, 1, 4, 3))


def test_training_graph_walks_through_the_node_against_autograd() -> None:
    g = gen(6)
    _, (d1, d2), loss = _graph(g)
    t1, t2 = TorchConv(d1), TorchConv(d2)
    graph, terminals, seen = training_seen(loss)
    assert "ReductionSpatialMeanGradientNode" in seen
    assert [type(t).__name__ for t in terminals] == ["ConvolutionGradientNode"]

    xt, target = rand(g, 3, 2, 6, 5), rand(g, 3, 3, 1, 1)
    out = encode(graph, [xt], [m.LossLabels(DEV, target)])
    xr = xt.clone().requires_grad_()
    mse_reference(t2(t1(xr).mean((2, 3), keepdim=True)), target).backward()
    assert_close(out.tensor, xr.grad, "dL/dx through the spatial mean", TOL)
    t1.check_step("conv before the mean")
    t2.check_step("conv after the mean")


def test_the_node_has_a_gradient_unlike_the_other_reductions() -> None:
    x = m.ImageNode("x")
    (node,) = m.ReductionSpatialMeanNode(x).gradient_filters([m.ImageNode("g")])
    assert type(node) is m.ReductionSpatialMeanGradientNode
    with pytest.raises(ValueError, match=r"\[ReductionRowMeanNode\] this filter has no gradient"):
        m.ReductionRowMeanNode(x).gradient_filters([m.ImageNode("g")])


def test_kernels_round_trip(tmp_path) -> None:
    k = m.ReduceSpatialMean(DEV)
    k.clip_rect_source = m.Region(m.Origin(1, 1, 0), m.Size(2, 3, 5))
    k.source_feature_channel_offset = 1
    k.label = "mine"
    grad = m.ReduceSpatialMeanGradient(DEV)
    grad.label = "its gradient"
    k2, grad2 = _roundtrip([k, grad], tmp_path)
    assert type(k2) is m.ReduceSpatialMean and type(grad2) is m.ReduceSpatialMeanGradient
    assert (k2.clip_rect_source, k2.source_feature_channel_offset, k2.label) == (
        k.clip_rect_source, 1, "mine",
    )  # fmt: skip
    assert grad2.label == "its gradient"
    x, cot = rand(gen(7), 2, 3, 5, 4), rand(gen(8), 2, 2, 1, 1)
    assert torch.equal(_forward_and_gradient(k2, x)[0], _forward_and_gradient(k, x)[0])
    cb = DEV.new_command_queue().command_buffer()
    src = m.Image.from_tensor(x)
    state = k.result_state(src)
    k.encode(cb, src, destination_state=state)
    a = grad.encode(cb, m.Image.from_tensor(cot), src, state)
    b = grad2.encode(cb, m.Image.from_tensor(cot), src, state)
    cb.commit()
    cb.wait_until_completed()
    assert torch.equal(a.tensor, b.tensor) and a.tensor.abs().max() > 0


def test_a_training_graph_through_the_node_reloads_and_steps_the_same(tmp_path) -> None:
    g = gen(9)
    _, (d1, d2), loss = _graph(g)
    (terminal,) = loss.training_graph()
    graph = m.Graph(DEV, terminal.result_image, True)
    graph.format = F64
    path = tmp_path / "train.safetensors"
    m.save(graph, path)
    graph2 = m.load(path)
    names = {type(f).__name__ for f in graph2._plan.order}
    assert {"ReductionSpatialMeanNode", "ReductionSpatialMeanGradientNode"} <= names
    for _ in range(2):
        xt, target = rand(g, 2, 2, 5, 5), rand(g, 2, 3, 1, 1)
        outs, losses = [], []
        for gr in (graph, graph2):
            labels = m.LossLabels(DEV, target.clone())
            outs.append(encode(gr, [xt], [labels]).tensor.clone())
            losses.append(labels.loss_image().tensor.clone())
        assert torch.equal(outs[0], outs[1]) and torch.equal(losses[0], losses[1])
    loaded = [f.data_source for f in graph2._plan.order if isinstance(f, m.ConvolutionNode)]
    for ds, ds2 in zip((d1, d2), loaded, strict=True):  # the steps updated both the same
        assert torch.equal(ds.weights(), ds2.weights())
        assert torch.equal(ds.bias_terms(), ds2.bias_terms())
