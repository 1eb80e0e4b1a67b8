"""Replays run two deep: a `CompiledGraph` call launches step ``n + 1`` while step ``n`` runs
on the device (it waits for step ``n - 1`` only), as Metal command buffers committed back to
back do. The steps still equal eager ones bit for bit, and a bad class index (a trusted
``max_index`` that lies) in any step, replayed or eager, is reported once, by a later call or
the wait, never lost to the step after it."""

from __future__ import annotations

import time

import pytest
import torch

import mpsnn as m

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture(autouse=True)
def _deterministic_cudnn():
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


def _net(dev: m.Device) -> tuple[m.Graph, list[m.TensorConvolutionDataSource]]:
    """conv 3x3 2->6 + ReLU, fully connected 8x8x6->5, softmax cross entropy (batch 8), SGD."""
    gen = torch.Generator().manual_seed(5)
    t = dev.torch_device
    sgd = m.SGD(dev, momentum_scale=0.9, descriptor=m.OptimizerDescriptor(learning_rate=0.05))
    d1, d2 = m.ConvolutionDescriptor(3, 3, 2, 6), m.ConvolutionDescriptor(8, 8, 6, 5)
    c1 = m.TensorConvolutionDataSource(
        d1, (torch.randn(d1.weights_shape, generator=gen) * 0.3).to(t), torch.zeros(6, device=t),
        sgd,
    )  # fmt: skip
    fc = m.TensorConvolutionDataSource(
        d2, (torch.randn(d2.weights_shape, generator=gen) * 0.05).to(t),
        torch.zeros(5, device=t), sgd,
    )  # fmt: skip
    x = m.ImageNode("x")
    h = m.NeuronReLUNode(m.ConvolutionNode(x, c1).result_image).result_image
    loss = m.LossNode(
        m.FullyConnectedNode(h, fc).result_image,
        m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM, weight=1 / 8),
    )
    (exit_node,) = loss.training_graph()
    return m.Graph(dev, exit_node.result_image, False), [c1, fc]


def _batches(count: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(9)
    return [
        (
            torch.randn(8, 2, 8, 8, generator=gen).to(device),
            torch.randint(0, 5, (8, 1, 1), generator=gen).to(device),
        )
        for _ in range(count)
    ]


def _step(dev: m.Device, compiled, x: torch.Tensor, y: torch.Tensor, max_index=None):  # type: ignore[no-untyped-def]
    labels = m.LossLabels(dev, y, max_index=max_index)
    return compiled([m.ImageBatch.from_tensor(x.clone())], [labels])


def _encode(graph: m.Graph, dev: m.Device, cb: m.CommandBuffer, x: torch.Tensor,
            y: torch.Tensor) -> m.LossLabels:  # fmt: skip
    """One eager training step encoded on ``cb`` (labels trusted to be < 5); its labels."""
    labels = m.LossLabels(dev, y, max_index=4)
    graph.encode_batch(cb, [m.ImageBatch.from_tensor(x.clone())], [labels])
    return labels


@needs_cuda
def test_a_call_returns_while_the_step_before_runs() -> None:
    """With the queue's stream busy (a long sleep kernel queued first), two calls return at
    once: the second does not wait for the first one's replay. The third waits for it."""
    dev = m.Device("cuda")
    graph, _ = _net(dev)
    queue = dev.new_command_queue()
    compiled = graph.compile(queue)
    data = _batches(3, "cuda")
    for x, y in data[:3]:  # eager, recorded, replayed
        _step(dev, compiled, x, y, max_index=4)
    compiled.wait_until_completed()
    assert compiled.is_captured
    torch.cuda._sleep(1_500_000_000)  # about a second on the queue's (current) stream
    start = time.perf_counter()
    _step(dev, compiled, *data[0], max_index=4)
    _step(dev, compiled, *data[1], max_index=4)
    both = time.perf_counter() - start
    assert both < 0.25, f"the calls waited {both:.3f} s for the step before"
    assert compiled._captured.status is m.CommandBufferStatus.COMMITTED
    _step(dev, compiled, *data[2], max_index=4)  # waits for the first of the two
    compiled.wait_until_completed()
    assert compiled._captured.status is m.CommandBufferStatus.COMPLETED


@needs_cuda
@pytest.mark.parametrize("storage", ["FLOAT32", "BFLOAT16"])
def test_back_to_back_replays_equal_eager_steps_bit_for_bit(storage: str) -> None:
    """Eight steps called back to back (no wait; each batch a fresh tensor dropped after its
    call) give the weights and the last loss of eight eager steps."""
    dev = m.Device("cuda")
    data = _batches(8, "cuda")
    eager, eager_sources = _net(dev)
    eager.format = m.FeatureChannelFormat[storage]
    queue = dev.new_command_queue()
    for x, y in data:
        cb = queue.command_buffer()
        eager_labels = _encode(eager, dev, cb, x, y)
        cb.commit()
    cb.wait_until_completed()
    replayed, replay_sources = _net(dev)
    replayed.format = m.FeatureChannelFormat[storage]
    compiled = replayed.compile(queue)
    for x, y in data:
        _step(dev, compiled, x, y, max_index=4)
    compiled.wait_until_completed()
    assert compiled.replays == len(data) - 1  # the second call records and replays
    loss = compiled.source_states[0][0].loss_image().tensor
    assert torch.equal(loss, eager_labels.loss_image().tensor)
    for a, b in zip(eager_sources, replay_sources, strict=True):
        assert torch.equal(a.weights(), b.weights())
        assert torch.equal(a.bias_terms(), b.bias_terms())


@needs_cuda
def test_a_bad_index_in_back_to_back_replays_is_raised_once() -> None:
    """One step of eight has an index of 7 for 5 classes (its labels say max_index=4): exactly
    one call (or the final wait) raises, naming the range; the other steps run."""
    dev = m.Device("cuda")
    graph, _ = _net(dev)
    compiled = graph.compile()
    data = _batches(8, "cuda")
    bad_y = data[4][1].clone()
    bad_y[3] = 7
    raised = []
    for k, (x, y) in enumerate(data):
        try:
            _step(dev, compiled, x, bad_y if k == 4 else y, max_index=4)
        except m.CommandBufferError as exc:
            raised.append((k, str(exc)))
    try:
        compiled.wait_until_completed()
    except m.CommandBufferError as exc:
        raised.append(("wait", str(exc)))
    assert len(raised) == 1, raised
    where, text = raised[0]
    assert where in (5, 6), raised  # the next call or the one after
    assert "class indices must lie in [0, 5)" in text and "to 7" in text
    _step(dev, compiled, *data[0], max_index=4)
    compiled.wait_until_completed()  # reported once: the range was reset


@needs_cuda
def test_overlapping_eager_steps_each_see_their_bad_index() -> None:
    """Eager steps of one step program share the loss command: a bad step followed by a good
    one, both completed before the bad one is waited for, still fails (the good step's range
    does not overwrite the bad one's); the good one then completes."""
    dev = m.Device("cuda")
    graph, _ = _net(dev)
    queue = dev.new_command_queue()
    data = _batches(3, "cuda")
    bad_y = data[1][1].clone()
    bad_y[0] = 9
    buffers = []
    for k, (x, y) in enumerate(data):
        cb = queue.command_buffer()
        _encode(graph, dev, cb, x, bad_y if k == 1 else y)
        cb.commit()
        buffers.append(cb)
    assert len(graph._programs) == 1  # the later steps ran the program
    torch.cuda.synchronize()
    buffers[0].wait_until_completed()
    with pytest.raises(m.CommandBufferError, match=r"\[0, 5\).*got 0 to 9"):
        buffers[1].wait_until_completed()
    buffers[2].wait_until_completed()
    assert buffers[2].status is m.CommandBufferStatus.COMPLETED


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=needs_cuda)], ids=["cpu", "cuda"]
)
def test_a_program_step_with_a_bad_index_fails_alone(device: str) -> None:
    """A step program's bad step fails its buffer; the steps around it complete."""
    dev = m.Device(device)
    graph, _ = _net(dev)
    queue = dev.new_command_queue()
    data = _batches(4, device)
    bad_y = data[2][1].clone()
    bad_y[5] = -1
    for k, (x, y) in enumerate(data):
        cb = queue.command_buffer()
        _encode(graph, dev, cb, x, bad_y if k == 2 else y)
        cb.commit()
        if k == 2:
            with pytest.raises(m.CommandBufferError, match=r"got -1 to \d"):
                cb.wait_until_completed()
        else:
            cb.wait_until_completed()
            assert cb.status is m.CommandBufferStatus.COMPLETED
    assert len(graph._programs) == 1


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=needs_cuda)], ids=["cpu", "cuda"]
)
def test_two_program_steps_in_one_buffer_fold_their_ranges(device: str) -> None:
    """Two steps of one step program encoded on one buffer (the loss command runs twice in it):
    a bad first step and a good second one still fail the buffer."""
    dev = m.Device(device)
    graph, _ = _net(dev)
    queue = dev.new_command_queue()
    data = _batches(4, device)
    for x, y in data[:2]:  # lower the program, then run it once
        cb = queue.command_buffer()
        _encode(graph, dev, cb, x, y)
        cb.commit()
        cb.wait_until_completed()
    bad = data[2][1].clone()
    bad[0] = 9
    cb = queue.command_buffer()
    for x, y in ((data[2][0], bad), (data[3][0], data[3][1])):
        _encode(graph, dev, cb, x, y)
    assert graph._programs[0].uses == 3  # both steps ran the program's commands
    cb.commit()
    with pytest.raises(m.CommandBufferError, match=r"\[0, 5\).*to 9"):
        cb.wait_until_completed()


@needs_cuda
def test_sources_made_on_another_stream_are_kept_for_the_queues_copies(monkeypatch) -> None:
    """With a queue on a private stream, the copies of a new batch wait on that stream behind
    the running replay: the caller's source tensors are recorded on it (`record_stream`), so
    the caching allocator does not hand their memory to the caller's next allocations first."""
    dev = m.Device("cuda")
    graph, _ = _net(dev)
    queue = dev.new_command_queue(stream=torch.cuda.Stream())
    compiled = graph.compile(queue)
    data = _batches(4, "cuda")
    for x, y in data[:2]:  # eager, recorded
        _step(dev, compiled, x, y, max_index=4)
    recorded = []
    real = torch.Tensor.record_stream

    def spy(self, stream):  # type: ignore[no-untyped-def]
        recorded.append((self.data_ptr(), stream))
        return real(self, stream)

    monkeypatch.setattr(torch.Tensor, "record_stream", spy)
    x, y = data[2]
    batch = m.ImageBatch.from_tensor(x.clone())
    labels = m.LossLabels(dev, y.clone(), max_index=4)
    compiled([batch], [labels])
    compiled.wait_until_completed()
    kept = {ptr for ptr, stream in recorded if stream == queue.stream}
    assert batch.tensor.data_ptr() in kept and labels._labels.data_ptr() in kept, recorded
