"""Data sources and weights: load/purge, export, reload on the CPU and on the command buffer,
and the CPU update path driven by a completed handler."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from mpsnn.core.layout import channels_last_only
from tests.helpers import DEVICES, assert_close, run


class CountingSource(m.ConvolutionDataSource):
    """A user-written data source (OHWI numpy weights), counting load/purge calls."""

    def __init__(self, desc: m.ConvolutionDescriptor, w, b) -> None:
        self.desc, self.w, self.b = desc, w, b
        self.loads = self.purges = 0
        self.ok = True

    def descriptor(self):
        return self.desc

    def weights(self):
        return self.w

    def bias_terms(self):
        return self.b

    def load(self) -> bool:
        self.loads += 1
        return self.ok

    def purge(self) -> None:
        self.purges += 1


def test_user_data_source_is_loaded_and_purged_in_balance() -> None:
    desc = m.ConvolutionDescriptor(3, 3, 2, 3)
    src = CountingSource(desc, torch.randn(desc.weights_shape).numpy(), None)
    conv = m.Convolution(m.Device("cpu"), src)
    m.ConvolutionGradient(m.Device("cpu"), src)
    conv.reload_weights_and_biases_from_data_source()
    assert src.loads == src.purges == 3
    assert conv.biases is None and conv.weights.shape == desc.weights_shape
    src.ok = False
    with pytest.raises(
        ValueError, match=r"\[Convolution\] the data source's load\(\) must succeed, got False"
    ):
        conv.reload_weights_and_biases_from_data_source()
    assert (src.loads, src.purges) == (4, 3)  # a failed load is not purged


@pytest.mark.parametrize("device", DEVICES)
def test_export_round_trips_the_weights(device: str) -> None:
    dev = m.Device(device)
    desc = m.ConvolutionDescriptor(2, 3, 4, 6, groups=2)
    w, b = torch.randn(desc.weights_shape), torch.randn(6)
    conv = m.Convolution(dev, m.TensorConvolutionDataSource(desc, w, b))
    cb = dev.new_command_queue().command_buffer()
    state = conv.export_weights_and_biases(cb)
    tmp = conv.export_weights_and_biases(cb, result_state_can_be_temporary=True)
    assert (
        isinstance(state, m.ConvolutionWeightsAndBiasesState)
        and not state.is_temporary
        and tmp.is_temporary
    )
    run(cb)
    assert torch.equal(state.weights.cpu(), w) and torch.equal(state.biases.cpu(), b)


@pytest.mark.parametrize("device", DEVICES)
def test_reload_on_the_command_buffer_affects_later_encodes_only(device: str) -> None:
    dev = m.Device(device)
    desc = m.ConvolutionDescriptor(1, 1, 1, 1)
    conv = m.Convolution(
        dev, m.TensorConvolutionDataSource(desc, torch.full((1, 1, 1, 1), 2.0), torch.zeros(1))
    )
    x = m.Image.from_tensor(torch.ones(1, 1, 2, 2, device=device))
    cb = dev.new_command_queue().command_buffer()
    before = conv.encode(cb, x)
    new = m.ConvolutionWeightsAndBiasesState.temporary(cb, desc)
    new.weights.fill_(5.0)
    new.biases.fill_(1.0)
    conv.reload_weights_and_biases(cb, new)
    assert new.read_count == 0  # the reload read it
    after = conv.encode(cb, x)
    run(cb)
    assert before.tensor.flatten().tolist() == [2.0] * 4
    assert after.tensor.flatten().tolist() == [6.0] * 4
    with pytest.raises(
        ValueError,
        match=r"\[Convolution\] state.weights must have the OHWI shape \(1, 1, 1, 1\), got \(1, 3, 3, 1\)",
    ):
        conv.reload_weights_and_biases(
            dev.new_command_queue().command_buffer(),
            m.ConvolutionWeightsAndBiasesState(torch.zeros(1, 3, 3, 1, device=device)),
        )


def test_reload_from_the_data_source_updates_the_master_weights_in_place() -> None:
    """The CPU path copies into the kernel's master tensors now: committed work keeps the
    weights it ran with, work that runs afterwards reads the new ones, and tensors obtained
    before the reload (an optimizer's, a captured graph's) see the new values."""
    dev = m.Device("cpu")
    desc = m.ConvolutionDescriptor(1, 1, 1, 1)
    ds = m.TensorConvolutionDataSource(desc, torch.full((1, 1, 1, 1), 2.0))
    conv = m.Convolution(dev, ds)
    held = conv.weights
    x = m.Image.from_tensor(torch.ones(1, 1, 1, 1))
    cb = dev.new_command_queue().command_buffer()
    old = conv.encode(cb, x)
    run(cb)
    ds.set_weights_and_biases(torch.full((1, 1, 1, 1), 7.0))
    conv.reload_weights_and_biases_from_data_source()
    cb = dev.new_command_queue().command_buffer()
    new = conv.encode(cb, x)
    run(cb)
    assert (old.tensor.item(), new.tensor.item()) == (2.0, 7.0)
    assert held.item() == 7.0 and held.data_ptr() == conv.weights.data_ptr()
    with pytest.raises(
        ValueError, match=r"\[Convolution\] the data source's descriptor must not change"
    ):
        ds._descriptor = m.ConvolutionDescriptor(3, 3, 1, 1)
        ds._state = m.ConvolutionWeightsAndBiasesState(torch.zeros(1, 3, 3, 1))
        conv.reload_weights_and_biases_from_data_source()


def test_cpu_update_path_trains_a_linear_fit() -> None:
    """MPS update path 1: after completion, read the gradient state, update the data source,
    reload. Fits y = 3x - 1 with a 1x1 convolution and plain gradient descent."""
    dev = m.Device("cpu")
    desc = m.ConvolutionDescriptor(1, 1, 1, 1)
    ds = m.TensorConvolutionDataSource(desc, torch.zeros(1, 1, 1, 1), torch.zeros(1))
    conv, grad = m.Convolution(dev, ds), m.ConvolutionGradient(dev, ds)
    gen = torch.Generator().manual_seed(41)
    q = dev.new_command_queue()
    lr = 1.0

    def update(state: m.ConvolutionGradientState):
        def handler(_cb):
            ds.set_weights_and_biases(
                ds.weights() - lr * state.gradient_for_weights,
                ds.bias_terms() - lr * state.gradient_for_biases,
            )
            conv.reload_weights_and_biases_from_data_source()
            grad.reload_weights_and_biases_from_data_source()

        return handler

    for _ in range(150):
        xs = torch.rand(16, 1, 1, 1, generator=gen)
        x = m.ImageBatch.from_tensor(xs)
        cb = q.command_buffer()
        states = conv.result_state_batch(x)
        y = conv.encode_batch(cb, x, destination_states=states)
        cb.commit()
        cb.wait_until_completed()
        g = (y.tensor - (3 * xs - 1)) / 16  # d/dy of mean squared error / 2
        cb = q.command_buffer()
        grad.gradient_option = m.ConvolutionGradientOption.GRADIENT_WITH_WEIGHTS_AND_BIAS
        assert grad.encode_batch(cb, m.ImageBatch.from_tensor(g), x, states) is None
        cb.add_completed_handler(update(states[0]))
        cb.commit()
        cb.wait_until_completed()
    assert_close(ds.weights().flatten(), torch.tensor([3.0]), "learned slope", tol=1e-3)
    assert_close(ds.bias_terms(), torch.tensor([-1.0]), "learned bias", tol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_reloads_of_several_kernels_as_one_command(device: str) -> None:
    """`reload_weights_and_biases` (the module function a training graph uses) gives each
    kernel the weights its own reload gives, as one command, and drops each pair's read count
    once (a state reloaded into two kernels drops twice). A layer without bias gains one."""
    from mpsnn.cnn.convolution.kernels import reload_weights_and_biases

    dev = m.Device(device)
    gen = torch.Generator().manual_seed(3)
    descs = [m.ConvolutionDescriptor(3, 3, 2, 4), m.ConvolutionDescriptor(2, 2, 4, 3)]
    fc_desc = m.ConvolutionDescriptor(2, 2, 3, 5)

    def kernels():
        convs = [
            m.Convolution(dev, m.TensorConvolutionDataSource(d, torch.randn(d.weights_shape)))
            for d in descs
        ]
        fc = m.FullyConnected(
            dev, m.TensorConvolutionDataSource(fc_desc, torch.randn(fc_desc.weights_shape))
        )
        return [*convs, fc]

    def states(cb):
        out = []
        for d in (*descs, fc_desc):
            st = m.ConvolutionWeightsAndBiasesState.temporary(cb, d)
            st.weights.copy_(torch.randn(d.weights_shape, generator=gen))
            st.biases.copy_(torch.randn(d.output_feature_channels, generator=gen))
            out.append(st)
        return out

    q = dev.new_command_queue()
    one, each = kernels(), kernels()
    cb = q.command_buffer()
    news = states(cb)
    copies = [m.ConvolutionWeightsAndBiasesState(st.weights, st.biases) for st in news]
    shared = news[0]
    shared.read_count = 2  # reloaded into two kernels below
    extra = m.Convolution(dev, m.TensorConvolutionDataSource(descs[0], torch.zeros(4, 3, 3, 2)))
    n = len(cb)
    reload_weights_and_biases(cb, [*zip(one, news, strict=True), (extra, shared)])
    assert len(cb) == n + 1  # one command for all
    assert [s.read_count for s in news] == [0, 0, 0]
    cb2 = q.command_buffer()
    for k, st in zip(each, copies, strict=True):
        k.reload_weights_and_biases(cb2, st)
    run(cb2)
    run(cb)
    for a, b in zip([*one, extra], [*each, each[0]], strict=True):
        assert torch.equal(a.weights, b.weights) and torch.equal(a.biases, b.biases)


def test_batched_reload_checks_every_pair_first() -> None:
    """A wrong pair raises the per-kernel message, and nothing was recorded or changed: no
    command, no read count dropped, no bias gained by the kernels before it."""
    from mpsnn.cnn.convolution.kernels import reload_weights_and_biases

    dev = m.Device("cpu")
    desc = m.ConvolutionDescriptor(1, 1, 1, 1)
    fc_desc = m.ConvolutionDescriptor(2, 2, 3, 5)
    conv = m.Convolution(dev, m.TensorConvolutionDataSource(desc, torch.ones(1, 1, 1, 1)))
    fc = m.FullyConnected(
        dev, m.TensorConvolutionDataSource(fc_desc, torch.ones(fc_desc.weights_shape))
    )
    cb = dev.new_command_queue().command_buffer()
    good = m.ConvolutionWeightsAndBiasesState.temporary(cb, desc)  # with biases: conv gains one
    bad = m.ConvolutionWeightsAndBiasesState(torch.zeros(5, 3, 2, 2), command_buffer=cb)
    with pytest.raises(
        ValueError,
        match=r"\[FullyConnected\] state.weights must have the OHWI shape \(5, 2, 2, 3\), "
        r"got \(5, 3, 2, 2\)",
    ):
        reload_weights_and_biases(cb, [(conv, good), (fc, bad)])
    assert len(cb) == 0 and good.read_count == bad.read_count == 1 and conv.biases is None
    other = dev.new_command_queue().command_buffer()
    with pytest.raises(ValueError, match=r"\[Convolution\] state is a temporary state of another"):
        reload_weights_and_biases(other, [(conv, good)])
    with pytest.raises(TypeError, match=r"\[Convolution\] state must be a ConvolutionWeights"):
        reload_weights_and_biases(cb, [(conv, object())])
    reload_weights_and_biases(cb, [])  # nothing to do
    assert len(cb) == 0


@pytest.mark.parametrize("ohwi_memory", [False, True])
def test_fully_connected_matrix_view_follows_the_weights(ohwi_memory: bool) -> None:
    """The (O, K) matrix a fully connected layer keeps is a view of the weights it was made
    for, its columns in their memory order ((c, h, w) for OIHW storage; (h, w, c) where the
    data source keeps OHWI memory and the CPU's float32 masters are made channels-last):
    in-place updates (reloads, optimizers) show through it, another tensor (a cast, new
    weights) gets its own, and the forward sums in that order."""
    desc = m.ConvolutionDescriptor(2, 2, 3, 5)
    oihw = torch.randn(5, 3, 2, 2)
    ohwi = oihw.permute(0, 2, 3, 1)  # a view of OIHW memory
    fc = m.FullyConnected(
        m.Device("cpu"),
        m.TensorConvolutionDataSource(desc, ohwi.contiguous() if ohwi_memory else ohwi),
    )
    ws = fc._weights
    assert channels_last_only(ws.weight) is ohwi_memory

    def columns(w: torch.Tensor) -> torch.Tensor:
        return (w.permute(0, 2, 3, 1) if ohwi_memory else w).reshape(5, -1)

    mat = ws.matrix(ws.weight)
    assert mat.shape == (5, 12) and mat.data_ptr() == ws.weight.data_ptr()
    assert ws.matrix(ws.weight) is mat
    ws.weight.mul_(2)
    assert torch.equal(mat, columns(ws.weight))
    wide, _ = ws.cast(torch.float64)  # other formats' casts: OIHW-contiguous, (c, h, w)
    assert ws.matrix(wide) is not mat and torch.equal(ws.matrix(wide), wide.reshape(5, -1))
    x = m.ImageBatch.from_tensor(torch.randn(4, 3, 2, 2))
    cb = m.Device("cpu").new_command_queue().command_buffer()
    y = fc.encode_batch(cb, x)
    run(cb)
    xs = (x.tensor.permute(0, 2, 3, 1) if ohwi_memory else x.tensor).reshape(4, -1)
    want = xs @ columns(ws.weight).t()  # no bias: mm
    assert torch.equal(y.tensor.reshape(4, 5), want)


def test_batched_reload_refuses_a_state_read_more_often_than_its_read_count() -> None:
    """As the second of two separate reloads would find it released: nothing is recorded."""
    from mpsnn.cnn.convolution.kernels import reload_weights_and_biases

    dev = m.Device("cpu")
    desc = m.ConvolutionDescriptor(1, 1, 1, 1)
    convs = [m.Convolution(dev, m.TensorConvolutionDataSource(desc, torch.ones(1, 1, 1, 1)))
             for _ in range(2)]  # fmt: skip
    cb = dev.new_command_queue().command_buffer()
    st = m.ConvolutionWeightsAndBiasesState.temporary(cb, desc)
    with pytest.raises(m.StaleResourceError, match=r"\[Convolution\] .* at least its 2 reads"):
        reload_weights_and_biases(cb, [(convs[0], st), (convs[1], st)])
    assert len(cb) == 0 and st.read_count == 1
