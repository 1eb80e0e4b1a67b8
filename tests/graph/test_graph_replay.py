"""`Graph.compile` on CUDA: a training step recorded once and replayed gives the eager steps'
results bit for bit (weights, losses, dropout masks), with new batches every step."""

from __future__ import annotations

import warnings

import pytest
import torch

import mpsnn as m

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


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
