"""A training graph whose data-parallel hooks ask for ``weights_beside`` runs each
convolution's weight gradient on its queue's side stream (beside the collectives that follow
it): the same training, bit for bit, eager, as a step program and replayed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mpsnn as m

BATCH, CLASSES, STEPS = 8, 5, 4
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="side streams need a GPU"))]  # fmt: skip


class _Hooks:
    """Data-parallel hooks of one process: no collectives, the weight gradients beside."""

    capturable = True
    programmable = True

    def __init__(self, beside: bool) -> None:
        self.weights_beside = beside

    def program_settings(self) -> tuple[Any, ...]:
        return (self.weights_beside,)

    def program_step(self, command_buffer: Any) -> None:
        pass

    def begin_step(self, step: Any) -> _Hooks:
        return self

    def weight_gradient_ready(self, node: Any, kernel: Any, states: Any) -> None:
        pass

    def batch_norm_statistics(self, node: Any, state: Any) -> None:
        pass

    def batch_norm_gradient_sums(self, node: Any, state: Any) -> None:
        pass

    def before_updates(self) -> None:
        pass

    def after_updates(self) -> None:
        pass


def _build(device: m.Device) -> tuple[m.Graph, list[Any]]:
    g = torch.Generator().manual_seed(3)
    opt = m.SGD(device, momentum_scale=0.9, descriptor=m.OptimizerDescriptor(learning_rate=0.05))
    sources: list[Any] = []
    x = m.ImageNode("image")
    for cin, cout in ((3, 8), (8, 8)):
        desc = m.ConvolutionDescriptor(3, 3, cin, cout)
        w = torch.randn(*desc.weights_shape, generator=g) * (9 * cin) ** -0.5
        sources.append(m.TensorConvolutionDataSource(desc, w, None, optimizer=opt))
        x = m.ConvolutionNode(x, sources[-1]).result_image
        sources.append(m.TensorBatchNormalizationDataSource(
            cout, gamma=1 + 0.1 * torch.randn(cout, generator=g),
            beta=0.1 * torch.randn(cout, generator=g), mean=torch.zeros(cout),
            variance=torch.ones(cout), epsilon=1e-5, momentum=0.1, optimizer=opt,
        ))  # fmt: skip
        x = m.BatchNormalizationNode(x, sources[-1]).result_image
        x = m.NeuronReLUNode(x).result_image
    desc = m.ConvolutionDescriptor(6, 6, 8, CLASSES)
    fc = torch.randn(*desc.weights_shape, generator=g) * 0.05
    sources.append(m.TensorConvolutionDataSource(desc, fc, torch.zeros(CLASSES), optimizer=opt))
    logits = m.FullyConnectedNode(x, sources[-1]).result_image
    loss = m.LossNode(logits, m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY,
                                               m.ReductionType.MEAN))  # fmt: skip
    (exit_node,) = loss.training_graph()
    return m.Graph(device, exit_node.result_image, result_image_is_needed=False), sources


def _values(sources: list[Any]) -> list[torch.Tensor]:
    out = []
    for ds in sources:
        if isinstance(ds, m.TensorConvolutionDataSource):
            out.append(ds.weights().detach().cpu().clone())
        else:
            out += [t.detach().cpu().clone() for t in (ds.gamma(), ds.beta(), ds.mean(),
                                                       ds.variance())]  # fmt: skip
    return out


def _train(
    device: str, hooks: _Hooks | None, compiled: bool, steps: int = STEPS, seed: int = 11
) -> tuple[list[torch.Tensor], Any, Any, Any]:
    """``steps`` training steps; the trained values, the graph, its queue and compiled step."""
    dev = m.Device(device)
    graph, sources = _build(dev)
    graph.data_parallel = hooks
    queue = dev.new_command_queue()
    step = graph.compile(queue) if compiled else None
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(BATCH, 3, 6, 6, generator=gen).to(dev.torch_device)
        y = torch.randint(0, CLASSES, (BATCH,), generator=gen).to(dev.torch_device)
        images = [m.ImageBatch.from_tensor(x)]
        labels = [m.LossLabels(dev, y.view(-1, 1, 1))]
        if step is not None:
            step(images, labels)
        else:
            cb = queue.command_buffer()
            graph.encode_batch(cb, images, labels)
            cb.commit()
            cb.wait_until_completed()
    if step is not None:
        step.wait_until_completed()
    return _values(sources), graph, queue, step


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True])
def test_weight_gradients_beside_train_the_same_bits(device: str, compiled: bool) -> None:
    with torch.backends.cudnn.flags(enabled=True, benchmark=False, deterministic=True):
        plain, *_ = _train(device, None, compiled)
        beside, graph, *_ = _train(device, _Hooks(True), compiled)
    kernels = [k for k in graph._plan.kernels.values() if type(k) is m.ConvolutionGradient]
    assert len(kernels) == 2 and all(k._weights_beside for k in kernels)
    assert graph._programs, "the steps ran a step program"
    for a, b in zip(plain, beside, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("beside", [False, True])
def test_the_hooks_decide_whether_weight_gradients_run_beside(beside: bool) -> None:
    _, graph, *_ = _train("cpu", _Hooks(beside), compiled=False)
    kernels = [k for k in graph._plan.kernels.values() if type(k) is m.ConvolutionGradient]
    assert kernels and all(k._weights_beside is beside for k in kernels)
    # the fully connected layer's gradient keeps its weights on the queue's stream
    fc = [k for k in graph._plan.kernels.values() if type(k) is m.FullyConnectedGradient]
    assert fc and not any(k._weights_beside for k in fc)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="side streams need a GPU")
@pytest.mark.parametrize("compiled", [False, True])
def test_only_captured_steps_use_the_side_stream(compiled: bool, monkeypatch) -> None:
    """An eager step is bound by its host time: it keeps one stream (the switch would only add
    host work); the recording of a compiled step hands the weight gradient over (the second
    convolution's: the first computes no data gradient, and nothing follows it to overlap)."""
    handed: list[int] = []
    real = m.CommandBuffer._beside

    def spy(self, work, keep):
        handed.append(len(keep))
        return real(self, work, keep)

    monkeypatch.setattr(m.CommandBuffer, "_beside", spy)
    # eager, recorded, replayed when compiled
    _, _, queue, step = _train("cuda", _Hooks(True), compiled, steps=3, seed=1)
    if step is not None:
        assert step.is_captured
    assert (queue._side is not None) is compiled  # made by the first hand-over
    assert handed == ([3] if compiled else [])  # once, in the recording: (g, x, w) kept
