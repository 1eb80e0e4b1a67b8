"""MPS contracts of a training graph that clients rely on: read counts a data source adds
are its own, ``training_style`` on gradient nodes, Adam's ``time_step`` counted per step at
encode (also by a run step), ``encode_batch`` of plain lists of images, and result states
(``output_state_is_temporary``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from mpsnn.errors import StaleResourceError
from tests.graph._helpers import (
    DEV,
    F64,
    TorchConv,
    assert_close,
    conv_ds,
    gen,
    mse_loss,
    mse_reference,
    new_cb,
    rand,
    sgd1,
    training,
)


class _Holding(m.TensorConvolutionDataSource):
    """A client's data source that keeps the gradient state to read it after completion (it
    raises the read count inside ``update``, as MPS clients do)."""

    batch_form = False
    kept: m.ConvolutionGradientState | None = None

    def update(self, command_buffer, gradient_state, source_state):
        if self.batch_form:  # a shared state appearing three times counts once
            assert m.StateBatch([gradient_state] * 3).increment_read_count(1) == 1
        else:
            gradient_state.read_count += 1
        self.kept = gradient_state
        return super().update(command_buffer, gradient_state, source_state)


def _conv_net(ds) -> tuple[m.Graph, m.ConvolutionNode]:
    x = m.ImageNode("x")
    conv = m.ConvolutionNode(x, ds)
    graph, _ = training(mse_loss(conv.result_image), needed=False)
    return graph, conv


@pytest.mark.parametrize("batch_form", [False, True], ids=["read_count", "state_batch"])
def test_a_read_count_a_data_source_adds_keeps_the_state_for_it(batch_form: bool) -> None:
    g = gen(10)
    base = conv_ds(g, 3, 3, 2, 3, sgd1())
    ds = _Holding(base.descriptor(), base.weights().clone(), base.bias_terms().clone(), sgd1())
    ds.batch_form = batch_form
    ref = TorchConv(ds)
    graph, _ = _conv_net(ds)
    xt, target = rand(g, 2, 2, 5, 5), rand(g, 2, 3, 5, 5)
    labels = m.LossLabels(DEV, target)
    cb = new_cb()
    graph.encode_batch(cb, [m.ImageBatch.from_tensor(xt)], [labels])
    cb.commit()
    cb.wait_until_completed()
    mse_reference(ref(xt), target).backward()
    kept = ds.kept
    assert kept is not None and kept.read_count == 1  # the graph dropped only its own reads
    assert_close(kept.gradient_for_weights.permute(0, 3, 1, 2), ref.w.grad, "dL/dW", 1e-10)
    assert_close(kept.gradient_for_biases, ref.b.grad, "dL/db", 1e-10)
    kept.read_count -= 1  # the client is done: released, and its storage freed now
    assert all(t is None for t in kept._slots.values()) or not kept._slots
    assert not cb._pending_releases
    with pytest.raises(StaleResourceError, match="read_count reached 0"):
        _ = kept.gradient_for_weights


def test_a_gpu_style_update_that_returns_none_falls_back_to_update_on_cpu() -> None:
    """A data source whose ``update`` returns None gets ``update_on_cpu`` after completion,
    reading the gradient state the graph kept for it (then released)."""

    class CpuOnly(m.TensorConvolutionDataSource):
        seen = None
        state = None

        def update(self, command_buffer, gradient_state, source_state):
            return None

        def update_on_cpu(self, gradient_state, source_state):
            self.state = gradient_state
            self.seen = gradient_state.gradient_for_weights.clone()
            return super().update_on_cpu(gradient_state, source_state)

    g = gen(12)
    base = conv_ds(g, 3, 3, 2, 3, sgd1())
    ds = CpuOnly(base.descriptor(), base.weights().clone(), base.bias_terms().clone(), sgd1())
    ref = TorchConv(ds)
    graph, _ = _conv_net(ds)
    xt, target = rand(g, 2, 2, 5, 5), rand(g, 2, 3, 5, 5)
    cb = new_cb()
    graph.encode_batch(cb, [m.ImageBatch.from_tensor(xt)], [m.LossLabels(DEV, target)])
    cb.commit()
    cb.wait_until_completed()
    mse_reference(ref(xt), target).backward()
    assert ds.seen is not None
    assert_close(ds.seen.permute(0, 3, 1, 2), ref.w.grad, "dL/dW read by update_on_cpu", 1e-10)
    with torch.no_grad():
        updated = ref.w - ref.w.grad  # SGD, learning rate 1
    assert_close(ds.weights().permute(0, 3, 1, 2), updated, "weights after the CPU update", 1e-10)
    with pytest.raises(StaleResourceError):  # the graph released it after the update
        _ = ds.state.gradient_for_weights


def test_without_a_client_read_the_graph_releases_the_update_states() -> None:
    class Peeking(m.TensorConvolutionDataSource):
        kept = None

        def update(self, command_buffer, gradient_state, source_state):
            self.kept = gradient_state
            return super().update(command_buffer, gradient_state, source_state)

    g = gen(11)
    base = conv_ds(g, 3, 3, 2, 3, sgd1())
    ds = Peeking(base.descriptor(), base.weights().clone(), base.bias_terms().clone(), sgd1())
    graph, _ = _conv_net(ds)
    cb = new_cb()
    labels = m.LossLabels(DEV, rand(g, 2, 3, 5, 5))
    graph.encode_batch(cb, [m.ImageBatch.from_tensor(rand(g, 2, 2, 5, 5))], [labels])
    cb.commit()
    with pytest.raises(StaleResourceError):
        _ = ds.kept.gradient_for_weights


# -- training_style on gradient nodes -----------------------------------------------------------


class _Recording(m.TensorConvolutionDataSource):
    """Records which update a graph calls."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def update(self, command_buffer, gradient_state, source_state):
        self.calls.append("update")
        return super().update(command_buffer, gradient_state, source_state)

    def update_on_cpu(self, gradient_state, source_state):
        self.calls.append("update_on_cpu")
        return super().update_on_cpu(gradient_state, source_state)


def _styled(ds_style, node_style):
    g = gen(12)
    base = conv_ds(g, 3, 3, 2, 3, sgd1())
    ds = _Recording(base.descriptor(), base.weights().clone(), base.bias_terms().clone(), sgd1())
    ds.training_style = ds_style
    ref = TorchConv(ds)
    x = m.ImageNode("x")
    conv = m.ConvolutionNode(x, ds)
    made = []

    def handler(gnode, inference, *_):
        made.append(gnode)
        if inference is conv and node_style is not None:
            gnode.training_style = node_style

    graph, _ = training(mse_loss(conv.result_image), needed=False, handler=handler)
    (gnode,) = [n for n in made if n.inference_node is conv]
    xt, target = rand(g, 2, 2, 5, 5), rand(g, 2, 3, 5, 5)
    cb = new_cb()
    graph.encode_batch(cb, [m.ImageBatch.from_tensor(xt)], [m.LossLabels(DEV, target)])
    before_commit = list(ds.calls)
    cb.commit()
    cb.wait_until_completed()
    mse_reference(ref(xt), target).backward()
    ref.check_step(f"{ds_style.name} / {node_style}")  # the update ran either way
    return gnode, before_commit, ds.calls


def test_a_gradient_nodes_cpu_style_makes_the_graph_call_update_on_cpu() -> None:
    gpu, cpu = m.TrainingStyle.UPDATE_ON_GPU, m.TrainingStyle.UPDATE_ON_CPU
    gnode, before, calls = _styled(gpu, cpu)
    assert gnode.training_style is cpu
    assert before == [] and calls == ["update_on_cpu"]  # after completion, not encoded
    # unset: the data source's style (MPS copies the forward node's onto the gradient node)
    gnode, before, calls = _styled(cpu, None)
    assert gnode.training_style is cpu and calls == ["update_on_cpu"]
    gnode, before, calls = _styled(gpu, None)
    assert gnode.training_style is gpu and before == calls == ["update"]
    # set on the node, it wins over the data source's
    gnode, before, calls = _styled(cpu, gpu)
    assert gnode.training_style is gpu and before == calls == ["update"]
    with pytest.raises(TypeError, match=r"training_style must be a TrainingStyle .*got str"):
        gnode.training_style = "cpu"
    gnode.training_style = None  # back to the data source's
    assert gnode.training_style is cpu


def test_training_style_of_a_gradient_node_is_saved(tmp_path) -> None:
    g = gen(13)
    ds = conv_ds(g, 3, 3, 2, 3, sgd1())
    x = m.ImageNode("x")
    conv = m.ConvolutionNode(x, ds)
    made = []
    terminals = mse_loss(conv.result_image).training_graph(
        None, lambda gn, inf, *_: made.append(gn) if inf is conv else None
    )
    made[0].training_style = m.TrainingStyle.UPDATE_ON_CPU
    graph = m.Graph(DEV, terminals[0].result_image, False)
    graph.output_state_is_temporary = True
    path = tmp_path / "graph.mpsnn"
    m.save(graph, path)
    loaded = m.load(path, DEV)
    styles = [
        n.training_style
        for n in loaded._plan.order
        if isinstance(n, m.GradientFilterNode) and isinstance(n.inference_node, m.ConvolutionNode)
    ]
    assert styles == [m.TrainingStyle.UPDATE_ON_CPU]
    assert loaded.output_state_is_temporary is True
    assert loaded._plan.modes.cpu_updates  # the loaded graph plans the CPU update


# -- Adam's time_step through a graph ---------------------------------------------------------


@pytest.mark.parametrize("reuse", [True, False])
def test_adam_time_step_counts_each_step_at_encode_also_a_re_armed_one(reuse: bool) -> None:
    def run(reuse_step: bool):
        g = gen(14)
        adam = m.Adam(DEV, learning_rate=0.05)
        d1, d2 = conv_ds(g, 3, 3, 2, 3, adam), conv_ds(g, 3, 3, 3, 2, adam)
        x = m.ImageNode("x")
        c1 = m.ConvolutionNode(x, d1)
        c2 = m.ConvolutionNode(m.NeuronReLUNode(c1.result_image).result_image, d2)
        graph, _ = training(mse_loss(c2.result_image), needed=False)
        graph.reuse_step = reuse_step
        counts = []
        for step in range(5):
            xt, target = rand(g, 2, 2, 5, 5), rand(g, 2, 2, 5, 5)
            cb = new_cb()
            graph.encode_batch(cb, [m.ImageBatch.from_tensor(xt)], [m.LossLabels(DEV, target)])
            counts.append(adam.time_step)  # before the work ran
            if step != 2:  # step 2's buffer is abandoned: its encode still counts
                cb.commit()
                cb.wait_until_completed()
        assert int(adam._step[0]) == 5  # the device copy: the last committed step's count
        return counts, [d1.weights(), d1.bias_terms(), d2.weights(), d2.bias_terms()], graph

    counts, weights, graph = run(reuse)
    assert counts == [1, 2, 3, 4, 5]  # one per step, two layers sharing the Adam
    if reuse:
        assert sum(t.uses for t in graph._programs) >= 1  # run steps were counted
    _, plain, _ = run(False)
    for a, b in zip(weights, plain, strict=True):
        assert torch.equal(a, b)


# -- encode_batch of lists of images ----------------------------------------------------------


def test_graph_and_kernels_take_lists_of_images() -> None:
    g = gen(15)
    ds = conv_ds(g, 3, 3, 2, 3)
    x = m.ImageNode("x")
    graph = m.Graph(DEV, m.ConvolutionNode(x, ds).result_image)
    graph.format = F64
    xt = rand(g, 3, 2, 5, 5)
    batch = m.ImageBatch.from_tensor(xt)
    separate = [m.Image.from_tensor(xt[i : i + 1].clone()) for i in range(3)]
    outs = []
    for source in (batch, list(batch), separate):
        cb = new_cb()
        out = graph.encode_batch(cb, [source])
        cb.commit()
        outs.append(out.tensor)
    expected = F.conv2d(xt, TorchConv(ds).w, TorchConv(ds).b, padding=1)
    for out in outs:
        assert_close(out, expected, "graph of a list", 1e-10)
    conv = m.Convolution(DEV, ds)
    cb = new_cb()
    views = conv.encode_batch(cb, list(batch))
    assert len(cb) == 1  # views of one batch: wrapped, no copy
    stacked = conv.encode_batch(cb, separate)
    assert len(cb) == 3  # separate images: one recorded copy, then the convolution
    dst = m.ImageBatch.from_tensor(torch.zeros(3, 3, 5, 5, dtype=torch.float64))
    written = conv.encode_batch(cb, separate, list(dst))
    cb.commit()
    for out in (views.tensor, stacked.tensor, dst.tensor):
        assert_close(out, expected, "kernel of a list", 1e-10)
    assert written.tensor.data_ptr() == dst.tensor.data_ptr()  # written where it is
    grad = m.ConvolutionGradient(DEV, ds)
    states = conv.result_state_batch(batch)
    gy = rand(g, 3, 3, 5, 5)
    cb = new_cb()
    conv.encode_batch(cb, batch, destination_states=states)
    dx_list = grad.encode_batch(
        cb, [m.Image.from_tensor(gy[i : i + 1]) for i in range(3)], separate, states
    )
    cb.commit()
    xr = xt.clone().requires_grad_(True)
    F.conv2d(xr, TorchConv(ds).w, TorchConv(ds).b, padding=1).backward(gy)
    assert_close(dx_list.tensor, xr.grad, "gradient of lists", 1e-10)


def test_lists_of_images_are_refused_with_a_message() -> None:
    g = gen(16)
    ds = conv_ds(g, 3, 3, 2, 3)
    conv = m.Convolution(DEV, ds)
    a = m.Image.from_tensor(rand(g, 1, 2, 5, 5))
    b = m.Image.from_tensor(rand(g, 1, 2, 4, 5))
    cb = new_cb()
    with pytest.raises(
        ValueError, match=r"\[Convolution\] source_images must hold images of one shape"
    ):
        conv.encode_batch(cb, [a, b])
    with pytest.raises(
        TypeError, match=r"\[Convolution\] source_images\[1\] must be an Image, got int"
    ):
        conv.encode_batch(cb, [a, 3])
    with pytest.raises(
        ValueError, match=r"\[Convolution\] source_images must hold at least one image"
    ):
        conv.encode_batch(cb, [])
    c = m.Image.from_tensor(rand(g, 1, 3, 5, 5))
    with pytest.raises(
        ValueError, match=r"\[Convolution\] destination_images must be an ImageBatch"
    ):
        conv.encode_batch(cb, [a, a], [c, m.Image.from_tensor(rand(g, 1, 3, 5, 5))])
    # a failed encode leaves the buffer as it was (no stray copy)
    with pytest.raises(ValueError, match=r"\[Convolution\] destination_states"):
        conv.encode_batch(cb, [a, a], None, conv.result_state_batch(m.ImageBatch(a)))
    assert len(cb) == 0
    graph = m.Graph(DEV, m.ConvolutionNode(m.ImageNode("x"), ds).result_image)
    with pytest.raises(ValueError, match=r"\[Graph\] source_images\[0\] must hold images of one"):
        graph.encode_batch(cb, [[a, b]])
    with pytest.raises(ValueError, match=r"\[Graph\] encode_batch needs one ImageBatch per"):
        graph.encode_batch(cb, [[a, a], [a]])
    assert len(cb) == 0


# -- result states: output_state_is_temporary -------------------------------------------------


def test_result_states_are_permanent_unless_output_state_is_temporary() -> None:
    g = gen(17)
    ds = conv_ds(g, 3, 3, 2, 3)
    x = m.ImageNode("x")
    node = m.ConvolutionNode(x, ds)
    node.result_state.handle = "conv state"
    node.result_state.export_from_graph = True
    graph = m.Graph(DEV, m.NeuronReLUNode(node.result_image).result_image)
    graph.format = F64
    assert graph.output_state_is_temporary is False
    assert graph.result_state_handles == ["conv state"]
    xt, gy = rand(g, 2, 2, 5, 5), rand(g, 2, 3, 5, 5)
    grad = m.ConvolutionGradient(DEV, ds)
    for temporary in (False, True):
        graph.output_state_is_temporary = temporary
        cb = new_cb()
        graph.encode_batch(cb, [m.ImageBatch.from_tensor(xt)])
        (states,) = graph.result_states
        (st,) = states.unique()
        assert st.is_temporary is temporary
        assert st.read_count == (1 if temporary else 0)  # temporary: one read, the client's
        dx = grad.encode_batch(
            cb, m.ImageBatch.from_tensor(gy), m.ImageBatch.from_tensor(xt), states
        )
        cb.commit()
        xr = xt.clone().requires_grad_(True)
        F.conv2d(xr, TorchConv(ds).w, TorchConv(ds).b, padding=1).backward(gy)
        assert_close(dx.tensor, xr.grad, "gradient from the graph's result state", 1e-10)
        if temporary:
            with pytest.raises(StaleResourceError):
                _ = st.gradient_for_weights  # its one read was the gradient's
        else:
            assert st.gradient_for_weights.shape == (3, 3, 3, 2)
    with pytest.raises(TypeError, match=r"\[Graph\] output_state_is_temporary must be a bool"):
        graph.output_state_is_temporary = 1


# -- CUDA: captured work advances the device count at every replay ----------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@needs_cuda
def test_compiled_steps_count_adam_time_steps_and_match_eager_ones() -> None:
    dev = m.Device("cuda")

    def net():
        g = gen(18)
        adam = m.Adam(dev, learning_rate=0.05)
        d1 = conv_ds(g, 3, 3, 2, 3, adam, dtype=torch.float32)
        d2 = conv_ds(g, 3, 3, 3, 2, adam, dtype=torch.float32)
        for ds in (d1, d2):
            ds._to(torch.device("cuda"))
        x = m.ImageNode("x")
        c1 = m.ConvolutionNode(x, d1)
        c2 = m.ConvolutionNode(m.NeuronReLUNode(c1.result_image).result_image, d2)
        loss = mse_loss(c2.result_image)
        (exit_node,) = loss.training_graph()
        graph = m.Graph(dev, exit_node.result_image, False)
        return graph, adam, [d1, d2]

    eager, eager_adam, eager_ds = net()
    replayed, adam, ds = net()
    compiled = replayed.compile()
    g = gen(19)
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        for k in range(5):
            x, t = rand(g, 2, 2, 5, 5).float().cuda(), rand(g, 2, 2, 5, 5).float().cuda()
            cb = dev.new_command_queue().command_buffer()
            eager.encode_batch(cb, [m.ImageBatch.from_tensor(x)], [m.LossLabels(dev, t)])
            cb.commit()
            compiled([m.ImageBatch.from_tensor(x)], [m.LossLabels(dev, t)])
            assert adam.time_step == eager_adam.time_step == k + 1
            compiled.wait_until_completed()
            cb.wait_until_completed()
            assert int(adam._step[0]) == int(eager_adam._step[0]) == k + 1
            for a, b in zip(eager_ds, ds, strict=True):
                assert torch.equal(a.weights(), b.weights()), f"step {k}"
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved
    assert compiled.replays == 4


@needs_cuda
def test_a_captured_adam_update_advances_the_device_count_at_each_replay() -> None:
    dev = m.Device("cuda")
    adam = m.Adam(dev, learning_rate=0.1)
    w = torch.randn(64, device="cuda")
    gr = torch.randn(64, device="cuda")
    mo, v = torch.zeros_like(w), torch.zeros_like(w)
    q = dev.new_command_queue()

    def encode(cb):
        adam.encode(
            cb, input_gradient_vector=gr, input_values_vector=w, input_momentum_vector=mo,
            input_velocity_vector=v, result_values_vector=w,
        )  # fmt: skip

    cb = q.command_buffer()
    encode(cb)  # warm-up (compiles the kernel)
    cb.commit()
    cb.wait_until_completed()
    cb = q.command_buffer()
    encode(cb)
    assert adam.time_step == 2
    captured = cb.capture()
    for k in range(3):
        captured.replay()
        captured.wait_until_completed()
        assert int(adam._step[0]) == 2 + k  # relative: each replay adds one


def test_a_capture_starts_adams_device_count_at_its_recorded_encode() -> None:
    """An abandoned encode leaves Adam's device step count behind ``time_step``; captured work
    only adds one per update, so `CompiledGraph` sets the count the recorded encode took
    before capturing (checked here on the CPU, where the function runs the same way)."""
    from mpsnn.graph.compiled import _start_device_counts
    from mpsnn.optim.base import journal

    opt = m.Adam(DEV)
    w = torch.zeros(4, dtype=torch.float64)
    mom, vel = torch.zeros_like(w), torch.zeros_like(w)
    queue = DEV.new_command_queue()

    def encode() -> m.CommandBuffer:
        cb = queue.command_buffer()
        opt.encode(cb, input_gradient_vector=torch.ones_like(w), input_values_vector=w,
                   result_values_vector=w, input_momentum_vector=mom,
                   input_velocity_vector=vel)  # fmt: skip
        return cb

    encode().commit()  # t = 1 ran
    encode()  # t = 2, abandoned
    with journal() as encodes:
        encode()  # t = 3: the step a capture would record
    assert opt.time_step == 3 and int(opt._step[0]) == 1
    _start_device_counts(queue, encodes)
    assert int(opt._step[0]) == 2  # the recorded update (adds one) runs with t = 3
