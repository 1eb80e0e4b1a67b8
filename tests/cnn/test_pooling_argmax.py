"""Max pooling's gradient on the CPU tile path takes the argmax its forward found (no second
pass over the source) in a graph's step, when it reads the tensor the forward read; a client's
own encodes, another source and a second gradient recompute it. Every case gives the bits of the portable path on the source the gradient
reads: ties (+0.0 and -0.0), NaN payloads, infinities, ``0 + g`` for a -0.0 gradient."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from mpsnn.core.geometry import AxisWindow, EdgeMode
from mpsnn.ops import pooling as P
from mpsnn.ops.pooling import (
    max_pool_backward,
    max_pool_backward_portable,
    max_pool_forward,
    max_pool_forward_argmax,
    pool_geometry,
)
from tests.helpers import run

_BITS = {8: torch.int64, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_BITS[t.element_size()])


def _source(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-2, 3, shape, generator=gen).double()  # many ties
    x[torch.rand(shape, generator=gen) < 0.3] = -0.0  # ties of +0.0 and -0.0
    x.view(-1)[3::11] = -float("inf")
    x.view(-1)[5::29] = float("inf")
    x.view(-1)[::7] = float("nan")
    x = x.to(dtype)
    pattern = -0x400000 if dtype == torch.float32 else 0x7FF8000000000001
    x.view(-1).view(_BITS[x.element_size()])[2::19] = pattern  # NaNs of another sign/payload
    return x


def _gradient(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    g[torch.rand(shape, generator=gen) < 0.2] = -0.0  # 0 + (-0.0) is +0.0
    return g.to(dtype)


def _geometry(h, w, k=2):
    return pool_geometry(AxisWindow(0, h // k, k, k, 1, h), AxisWindow(0, w // k, k, k, 1, w),
                         EdgeMode.CLAMP)  # fmt: skip


class _CountPasses:
    """Counts the tile path's passes over a source (`_window_planes`)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        real = P._window_planes

        def spy(t, geom):
            self.calls += 1
            return real(t, geom)

        monkeypatch.setattr(P, "_window_planes", spy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_the_forward_argmax_gives_the_recomputed_gradient_bit_for_bit(dtype) -> None:
    x = _source((2, 3, 9, 8), dtype, 0)  # a leftover row: its gradient is 0
    geom = _geometry(9, 8)
    y, tap = max_pool_forward_argmax(x, geom)
    assert tap is not None and tap.dtype == torch.int64 and tap.shape == y.shape
    assert torch.equal(bits(y), bits(max_pool_forward(x, geom)))
    g = _gradient(y.shape, dtype, 1)
    want = max_pool_backward_portable(g, x, geom)
    assert torch.equal(bits(max_pool_backward(g, x, geom, tap)), bits(want))


def test_paths_without_a_tile_pass_return_no_argmax() -> None:
    x = _source((1, 2, 6, 6), torch.float32, 2)
    overlapping = pool_geometry(AxisWindow(0, 5, 2, 1, 1, 6), AxisWindow(0, 5, 2, 1, 1, 6),
                                EdgeMode.CLAMP)  # fmt: skip
    assert max_pool_forward_argmax(x, overlapping)[1] is None
    assert max_pool_forward_argmax(x.half(), _geometry(6, 6))[1] is None


def _states(pool, src):
    st = pool.result_state(src)
    return st, m.StateBatch([st] * src.number_of_images)


def _encode(pool, grad, src, g, cb):
    """A graph's encodes of the forward and the gradient (`_graph_encode_batch`)."""
    _, states = _states(pool, src)
    pool._graph_encode_batch(cb, m.ImageBatch(src), states)
    return grad._graph_encode_batch(cb, m.ImageBatch(m.Image.from_tensor(g)), m.ImageBatch(src),
                                    states).image  # fmt: skip


@pytest.mark.parametrize("kind", ["max", "dilated"])
def test_the_gradient_takes_the_argmax_of_its_forward(kind, monkeypatch) -> None:
    dev = m.Device("cpu")
    if kind == "max":
        pool, grad = m.PoolingMax(dev, 2, 2, 2, 2), m.PoolingMaxGradient(dev, 2, 2, 2, 2)
    else:  # dilation 1: the same windows
        args = (dev, 2, 2, 1, 1, 2, 2)
        pool, grad = m.DilatedPoolingMax(*args), m.DilatedPoolingMaxGradient(*args)
    pool.offset = m.Offset(1, 1, 0)  # windows [2i, 2i + 2): tiles, no padding
    x = _source((2, 3, 8, 6), torch.float32, 3)
    src = m.Image.from_tensor(x)
    g = _gradient((2, 3, 4, 3), torch.float32, 4)
    passes = _CountPasses(monkeypatch)
    cb = dev.new_command_queue().command_buffer()
    dx = _encode(pool, grad, src, g, cb)
    run(cb)
    assert passes.calls == 1  # the forward's; the gradient took its argmax
    assert torch.equal(bits(dx.tensor), bits(max_pool_backward_portable(g, x, _geometry(8, 6))))


def test_a_clients_encodes_recompute_even_when_the_source_is_rewritten(monkeypatch) -> None:
    """Outside a graph the source may be written between the forward and its gradient (here
    by a neuron encoded into it on the same buffer, and in place on the host): the gradient
    reads what it reads."""
    dev = m.Device("cpu")
    pool, grad = m.PoolingMax(dev, 2, 2, 2, 2), m.PoolingMaxGradient(dev, 2, 2, 2, 2)
    pool.offset = m.Offset(1, 1, 0)
    x = _source((1, 2, 4, 4), torch.float32, 5)
    src = m.Image.from_tensor(x)
    g = _gradient((1, 2, 2, 2), torch.float32, 6)
    passes = _CountPasses(monkeypatch)
    q = dev.new_command_queue()
    cb = q.command_buffer()
    st = pool.result_state(src)
    pool.encode(cb, src, destination_state=st)
    negate = m.Neuron(dev, m.NeuronDescriptor(m.NeuronType.LINEAR, a=-1.0))
    negate.encode(cb, m.Image.from_tensor(x.clone()), src)  # other maxima, written into src
    dx = grad.encode(cb, m.Image.from_tensor(g), src, st)
    run(cb)
    assert passes.calls == 2  # the gradient recomputed from what it reads
    want = max_pool_backward_portable(g, src.tensor, _geometry(4, 4))
    assert torch.equal(bits(dx.tensor), bits(want))
    cb = q.command_buffer()
    st = pool.result_state(src)
    pool.encode(cb, src, destination_state=st)
    run(cb)
    src.tensor.copy_(_source((1, 2, 4, 4), torch.float32, 7))  # in place on the host
    cb = q.command_buffer()
    dx = grad.encode(cb, m.Image.from_tensor(g), src, st)
    run(cb)
    assert torch.equal(bits(dx.tensor), bits(max_pool_backward_portable(g, src.tensor,
                                                                        _geometry(4, 4))))  # fmt: skip


def test_a_graph_step_makes_one_pass_per_pooling(monkeypatch) -> None:
    """A training graph with max pooling: the forward's pass only, at every step (also when
    the step is re-armed)."""
    from tests.graph._helpers import DEV, ce_loss, conv_ds, encode, gen, sgd1, training

    g = gen(20)
    x = m.ImageNode("x")
    conv = m.ConvolutionNode(x, conv_ds(g, 3, 3, 1, 4, sgd1()))
    pool = m.PoolingMaxNode(conv.result_image, 2)
    fc = m.FullyConnectedNode(pool.result_image, conv_ds(g, 3, 3, 4, 3, sgd1()))
    graph, _ = training(ce_loss(fc.result_image, 2), needed=False)
    passes = _CountPasses(monkeypatch)
    images = torch.randn(2, 1, 6, 6, dtype=torch.float64, generator=g)
    labels = [m.LossLabels(DEV, torch.tensor([[[0]], [[2]]]))]
    for step in range(3):
        encode(graph, [images], [labels])
        assert passes.calls == step + 1, step


def test_another_source_and_a_second_gradient_recompute(monkeypatch) -> None:
    dev = m.Device("cpu")
    pool, grad = m.PoolingMax(dev, 2, 2, 2, 2), m.PoolingMaxGradient(dev, 2, 2, 2, 2)
    pool.offset = m.Offset(1, 1, 0)
    x, other = (_source((1, 2, 4, 6), torch.float64, s) for s in (8, 9))
    src = m.Image.from_tensor(x)
    g = _gradient((1, 2, 2, 3), torch.float64, 10)
    geom = _geometry(4, 6)
    passes = _CountPasses(monkeypatch)
    cb = dev.new_command_queue().command_buffer()
    _, states = _states(pool, src)
    pool._graph_encode_batch(cb, m.ImageBatch(src), states)

    def gradient(x_image):
        gb = m.ImageBatch(m.Image.from_tensor(g))
        return grad._graph_encode_batch(cb, gb, m.ImageBatch(x_image), states).image

    first, second, third = gradient(src), gradient(src), gradient(m.Image.from_tensor(other))
    run(cb)
    assert passes.calls == 3  # the forward, then the second and third gradients
    want = max_pool_backward_portable(g, x, geom)
    assert torch.equal(bits(first.tensor), bits(want))
    assert torch.equal(bits(second.tensor), bits(want))
    assert torch.equal(bits(third.tensor), bits(max_pool_backward_portable(g, other, geom)))


def test_inference_tensors_are_recomputed(monkeypatch) -> None:
    """Tensors made under ``torch.inference_mode``: the same hand-over, the same bits."""
    dev = m.Device("cpu")
    pool, grad = m.PoolingMax(dev, 2, 2, 2, 2), m.PoolingMaxGradient(dev, 2, 2, 2, 2)
    pool.offset = m.Offset(1, 1, 0)
    passes = _CountPasses(monkeypatch)
    with torch.inference_mode():
        x = _source((1, 2, 4, 4), torch.float32, 11)
        g = _gradient((1, 2, 2, 2), torch.float32, 12)
        cb = dev.new_command_queue().command_buffer()
        dx = _encode(pool, grad, m.Image.from_tensor(x), g, cb)
        run(cb)
        assert cb.error is None
        want = max_pool_backward_portable(g, x, _geometry(4, 4))
    assert passes.calls == 1
    assert torch.equal(bits(dx.tensor), bits(want))


def test_a_source_the_graph_frees_after_the_forward_is_not_kept() -> None:
    """Batch normalization before the pooling: the graph frees its result after the pooling's
    forward and recomputes it before the gradient. The hand-over does not keep it alive (the
    gradient then finds the argmax again in the recomputed tensor: the same bits)."""
    import gc
    import weakref

    from mpsnn.cnn import pooling as pooling_module
    from tests.graph._helpers import DEV, ce_loss, conv_ds, encode, gen, sgd1, training

    g = gen(21)
    x = m.ImageNode("x")
    conv = m.ConvolutionNode(x, conv_ds(g, 3, 3, 1, 4, sgd1(), dtype=torch.float32))
    bn = m.BatchNormalizationNode(
        conv.result_image, m.TensorBatchNormalizationDataSource(4, optimizer=sgd1())
    )
    pool = m.PoolingMaxNode(bn.result_image, 2)
    fc = m.FullyConnectedNode(
        pool.result_image, conv_ds(g, 3, 3, 4, 3, sgd1(), dtype=torch.float32)
    )
    graph, _ = training(
        ce_loss(fc.result_image, 2), needed=False, fmt=m.FeatureChannelFormat.FLOAT32
    )
    assert graph.plan.recompute.before  # the normalization's result is recomputed
    seen: list[weakref.ref] = []
    real_put = pooling_module._Argmax.put

    def put(self, t, tap):
        seen.append(weakref.ref(t))
        real_put(self, t, tap)

    alive_at_gradient = []
    real_take = pooling_module._Argmax.take

    def take(self, t):
        gc.collect()
        alive_at_gradient.append(seen[-1]() is not None)
        return real_take(self, t)

    pooling_module._Argmax.put, pooling_module._Argmax.take = put, take
    try:
        images = torch.randn(2, 1, 6, 6, dtype=torch.float64, generator=g).float()
        encode(graph, [images], [m.LossLabels(DEV, torch.tensor([[[0]], [[2]]]))])
    finally:
        pooling_module._Argmax.put, pooling_module._Argmax.take = real_put, real_take
    assert seen and alive_at_gradient == [False]
