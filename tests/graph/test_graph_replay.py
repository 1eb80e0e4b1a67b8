"""`Graph.compile` on CUDA: a training step recorded once and replayed gives the eager steps'
results bit for bit (weights, losses, dropout masks), with new batches every step."""

from __future__ import annotations

import warnings

import pytest
import torch

import mpsnn as m

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture(autouse=True)
def _deterministic_cudnn():
    """Bit-for-bit comparisons between two runs need cuDNN's deterministic algorithms (its
    default weight-gradient algorithms may sum in a different order from run to run)."""
    saved = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    yield
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved


def _model(dev: m.Device, storage: m.FeatureChannelFormat) -> tuple[m.Graph, list]:
    """conv + ReLU (fused) + max pool + batch norm + dropout + FC + loss, Adam in the layers."""
    g = torch.Generator().manual_seed(7)
    adam = m.Adam(dev, descriptor=m.OptimizerDescriptor(learning_rate=1e-2))
    t = dev.torch_device

    def conv(kw: int, cin: int, cout: int) -> m.TensorConvolutionDataSource:
        desc = m.ConvolutionDescriptor(kw, kw, cin, cout)
        w = torch.randn(desc.weights_shape, generator=g) * (kw * kw * cin) ** -0.5
        return m.TensorConvolutionDataSource(
            desc, w.to(t), (0.1 * torch.randn(cout, generator=g)).to(t), adam
        )

    c1, fc = conv(3, 2, 8), conv(4, 8, 5)
    bn = m.TensorBatchNormalizationDataSource(8, optimizer=adam)
    x = m.ImageNode("x")
    h = m.NeuronReLUNode(m.ConvolutionNode(x, c1).result_image).result_image
    h = m.PoolingMaxNode(h, 2).result_image
    h = m.BatchNormalizationNode(h, bn).result_image
    h = m.DropoutNode(h, 0.75, seed=3).result_image
    logits = m.FullyConnectedNode(h, fc).result_image
    loss = m.LossNode(
        logits,
        m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM, weight=1 / 16),
    )
    (exit_node,) = loss.training_graph()
    graph = m.Graph(dev, exit_node.result_image, result_image_is_needed=True)
    graph.format = storage
    return graph, [c1, fc, bn]


def _values(sources: list) -> list[torch.Tensor]:
    out = []
    for ds in sources:
        if isinstance(ds, m.TensorConvolutionDataSource):
            out += [ds.weights(), ds.bias_terms()]
        else:
            out += [ds.gamma(), ds.beta(), ds.mean(), ds.variance()]
    return out


@needs_cuda
@pytest.mark.parametrize("storage", ["FLOAT32", "BFLOAT16"])
def test_replayed_steps_equal_eager_steps_bit_for_bit(storage: str) -> None:
    dev = m.Device("cuda")
    fmt = m.FeatureChannelFormat[storage]
    eager_graph, eager_sources = _model(dev, fmt)
    replay_graph, replay_sources = _model(dev, fmt)
    gen = torch.Generator().manual_seed(11)
    batches = [
        (torch.randn(16, 2, 8, 8, generator=gen), torch.randint(0, 5, (16, 1, 1), generator=gen))
        for _ in range(6)
    ]
    queue = dev.new_command_queue()
    compiled = replay_graph.compile(queue)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no silent slow fallback inside the capture
        for k, (x, y) in enumerate(batches):
            xs = [m.ImageBatch.from_tensor(x.cuda())]
            cb = queue.command_buffer()
            eager_labels = m.LossLabels(dev, y.cuda())
            eager_dx = eager_graph.encode_batch(cb, xs, [eager_labels])
            cb.commit()
            replay_dx = compiled(
                [m.ImageBatch.from_tensor(x.cuda())], [m.LossLabels(dev, y.cuda())]
            )
            compiled.wait_until_completed()
            assert torch.equal(eager_dx.tensor, replay_dx.tensor), f"step {k}: dL/dx differ"
            eager_loss = eager_labels.loss_image().tensor
            replay_loss = compiled.source_states[0][0].loss_image().tensor
            assert torch.equal(eager_loss, replay_loss), f"step {k}: losses differ"
            for i, (a, b) in enumerate(
                zip(_values(eager_sources), _values(replay_sources), strict=True)
            ):
                assert torch.equal(a, b), f"step {k}: value {i} differs"
    assert compiled.is_captured and compiled.replays == len(batches) - 1


@needs_cuda
def test_replay_refuses_another_batch_shape_and_keeps_working() -> None:
    dev = m.Device("cuda")
    graph, _ = _model(dev, m.FeatureChannelFormat.FLOAT32)
    compiled = graph.compile()
    x = torch.randn(16, 2, 8, 8, device="cuda")
    y = torch.randint(0, 5, (16, 1, 1), device="cuda")
    for _ in range(3):
        compiled([m.ImageBatch.from_tensor(x)], [m.LossLabels(dev, y)])
    with pytest.raises(ValueError, match=r"\[CompiledGraph\] source_images\[0\] must match"):
        compiled([m.ImageBatch.from_tensor(x[:8])], [m.LossLabels(dev, y[:8])])
    with pytest.raises(ValueError, match=r"class indices must be < the 5 channels"):
        compiled([m.ImageBatch.from_tensor(x)], [m.LossLabels(dev, y + 5)])
    out = compiled([m.ImageBatch.from_tensor(x)], [m.LossLabels(dev, y)])
    compiled.wait_until_completed()
    assert torch.isfinite(out.tensor).all()


class _AdamDataSource(m.ConvolutionDataSource):
    """A data source of its own, as Apple's sample writes it: the GPU update path encodes Adam
    from the gradient state and the weights the kernel used (an exported, temporary state made
    at encode time) into the data source's own state, out of place."""

    def __init__(self, dev: m.Device, desc: m.ConvolutionDescriptor, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        w = torch.randn(desc.weights_shape, generator=g) * 0.2
        self._desc = desc
        self._state = m.ConvolutionWeightsAndBiasesState(
            w.to(dev.torch_device),
            torch.full((desc.output_feature_channels,), 0.1, device=dev.torch_device),
        )
        self.adam = m.Adam(dev, descriptor=m.OptimizerDescriptor(learning_rate=1e-2))
        params = (self._state.weights, self._state.biases)
        self._m = [torch.zeros_like(p) for p in params]
        self._v = [torch.zeros_like(p) for p in params]

    def descriptor(self) -> m.ConvolutionDescriptor:
        return self._desc

    def weights(self) -> torch.Tensor:
        return self._state.weights

    def bias_terms(self) -> torch.Tensor:
        return self._state.biases

    def update(self, command_buffer, gradient_state, source_state):  # type: ignore[no-untyped-def]
        self.adam.encode(
            command_buffer,
            convolution_gradient_state=gradient_state,
            convolution_source_state=source_state,
            input_momentum_vectors=self._m,
            input_velocity_vectors=self._v,
            result_state=self._state,
        )
        return self._state


@needs_cuda
def test_replay_with_a_custom_data_source_update_equals_eager() -> None:
    """A layer updated through its data source's own ``update`` (Adam's encode from the
    convolution gradient state, as in Apple's sample) is recorded and replayed, and gives the
    eager weights bit for bit at every step. (The optimizer's encode once read the gradient
    state's property, which made zero sums at encode time: the recorded gradient then added
    into them at every replay, from the second replay on twice the gradient.)"""
    dev = m.Device("cuda")

    def model() -> tuple[m.Graph, list]:
        sources = [
            _AdamDataSource(dev, m.ConvolutionDescriptor(3, 3, 2, 6), 1),
            _AdamDataSource(dev, m.ConvolutionDescriptor(8, 8, 6, 5), 2),
        ]
        x = m.ImageNode("x")
        h = m.NeuronReLUNode(m.ConvolutionNode(x, sources[0]).result_image).result_image
        loss = m.LossNode(
            m.FullyConnectedNode(h, sources[1]).result_image,
            m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM, weight=1 / 8),
        )
        (exit_node,) = loss.training_graph()
        return m.Graph(dev, exit_node.result_image, False), sources

    eager_graph, eager_sources = model()
    replay_graph, replay_sources = model()
    queue = dev.new_command_queue()
    compiled = replay_graph.compile(queue)
    gen = torch.Generator().manual_seed(5)
    for k in range(6):
        x = torch.randn(8, 2, 8, 8, generator=gen).cuda()
        y = torch.randint(0, 5, (8, 1, 1), generator=gen).cuda()
        cb = queue.command_buffer()
        eager_graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)], [m.LossLabels(dev, y)])
        cb.commit()
        compiled([m.ImageBatch.from_tensor(x.clone())], [m.LossLabels(dev, y.clone())])
        junk = [torch.full((1 << 16,), float("nan"), device="cuda") for _ in range(8)]  # reuse
        compiled.wait_until_completed()
        del junk
        for a, b in zip(eager_sources, replay_sources, strict=True):
            assert torch.equal(a.weights(), b.weights()), f"step {k}: weights differ"
            assert torch.equal(a.bias_terms(), b.bias_terms()), f"step {k}: biases differ"
    assert compiled.is_captured and compiled.replays == 5 and compiled.eager_reason is None


def test_a_data_source_that_is_not_capturable_keeps_a_compiled_graph_eager() -> None:
    """A data source whose update needs host work at every step opts out of recording
    (``capturable = False``): the compiled graph says so and runs its steps eagerly."""
    dev = m.Device("cpu")

    class HostCounting(_AdamDataSource):
        capturable = False

    x = m.ImageNode("x")
    fc = m.FullyConnectedNode(x, HostCounting(dev, m.ConvolutionDescriptor(4, 4, 2, 3), 1))
    fc.label = "counted"
    loss = m.LossNode(
        fc.result_image, m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM)
    )
    (exit_node,) = loss.training_graph()
    compiled = m.Graph(dev, exit_node.result_image, False).compile()
    assert compiled.eager_reason == (
        "data sources that need host work at every update (capturable = False): counted"
    )
    plain = m.FullyConnectedNode(
        m.ImageNode("y"), _AdamDataSource(dev, m.ConvolutionDescriptor(4, 4, 2, 3), 2)
    )
    (exit_node,) = m.LossNode(
        plain.result_image, m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM)
    ).training_graph()
    assert m.Graph(dev, exit_node.result_image, False).compile().eager_reason is None
