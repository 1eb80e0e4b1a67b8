"""Weight updates inside a graph step: SGD (with momentum) and Adam against the same math done
with PyTorch over three steps, layers sharing one optimizer, CPU-style updates after
completion, and `Graph.compile` (eager on the CPU) giving the eager steps' weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.graph._helpers import (
    DEV,
    TorchConv,
    assert_close,
    ce_loss,
    ce_reference,
    conv_ds,
    encode,
    gen,
    rand,
    training,
)

STEPS = 3


def _net(seed: int, optimizers, *, cpu_style: bool = False, batch_norm: bool = False):
    """conv -> [batch norm] -> ReLU -> max pool -> fully connected -> cross entropy; one
    optimizer per layer from ``optimizers()`` (the same object when they share one)."""
    g = gen(seed)
    d1 = conv_ds(g, 3, 3, 2, 3, optimizers(), bias=not batch_norm)
    d2 = conv_ds(g, 3, 3, 3, 4, optimizers())
    sources = [d1, d2]
    x = m.ImageNode("x")
    img = m.ConvolutionNode(x, d1).result_image
    if batch_norm:
        bn_ds = m.TensorBatchNormalizationDataSource(
            3, gamma=1 + rand(g, 3, scale=0.2), beta=rand(g, 3, scale=0.2), optimizer=optimizers()
        )
        sources.append(bn_ds)
        img = m.BatchNormalizationNode(img, bn_ds).result_image
    if cpu_style:
        for ds in sources:
            ds.training_style = m.TrainingStyle.UPDATE_ON_CPU
    pool = m.PoolingMaxNode(m.NeuronReLUNode(img).result_image, 2)
    fc = m.FullyConnectedNode(pool.result_image, d2)
    graph, _ = training(ce_loss(fc.result_image, 4), needed=False)
    return graph, sources


def _batches(seed: int):
    g = gen(seed)
    return [
        (rand(g, 4, 2, 6, 6), torch.randint(0, 4, (4, 1, 1), generator=g)) for _ in range(STEPS)
    ]


def _train(graph, batches) -> None:
    for xt, labels in batches:
        assert encode(graph, [xt], [m.LossLabels(DEV, labels)]) is None


def _values(sources) -> list[torch.Tensor]:
    out = []
    for ds in sources:
        if isinstance(ds, m.TensorConvolutionDataSource):
            out += [ds.weights(), *([] if ds.bias_terms() is None else [ds.bias_terms()])]
        else:
            out += [ds.gamma(), ds.beta(), ds.mean(), ds.variance()]
    return out


def _reference_grads(sources, batches, update) -> list[torch.Tensor]:
    """The same network and steps in PyTorch; ``update(params, grads, t)`` changes the
    params in place. Returns the params (OIHW weights, biases)."""
    t1, t2 = TorchConv(sources[0]), TorchConv(sources[1])
    params = t1.params() + t2.params()
    for t, (xt, labels) in enumerate(batches, start=1):
        loss = ce_reference(t2.fc(F.max_pool2d(F.relu(t1(xt)), 2)), labels)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            update(params, grads, t)
    return params


def _graph_params(sources) -> list[torch.Tensor]:
    out = []
    for ds in sources:
        out.append(ds.weights().permute(0, 3, 1, 2))
        if ds.bias_terms() is not None:
            out.append(ds.bias_terms())
    return out


def test_sgd_with_momentum_in_the_step_matches_torch_optim_sgd() -> None:
    lr, mu = 0.1, 0.5
    desc = m.OptimizerDescriptor(learning_rate=lr)
    graph, sources = _net(50, lambda: m.SGD(DEV, momentum_scale=mu, descriptor=desc))
    batches = _batches(51)
    t1, t2 = TorchConv(sources[0]), TorchConv(sources[1])
    params = t1.params() + t2.params()
    start = params[0].detach().clone()
    opt = torch.optim.SGD(params, lr=lr, momentum=mu)
    _train(graph, batches)
    for xt, labels in batches:
        opt.zero_grad()
        ce_reference(t2.fc(F.max_pool2d(F.relu(t1(xt)), 2)), labels).backward()
        opt.step()
    for a, e in zip(_graph_params(sources), params, strict=True):
        assert_close(a, e, "SGD with momentum, 3 steps", 1e-12)
    assert not torch.allclose(params[0], start)  # it moved


def _adam_reference(lr, b1, b2, eps):
    state: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(params, grads, t):
        lr_t = lr * (1 - b2**t) ** 0.5 / (1 - b1**t)
        for i, (p, g) in enumerate(zip(params, grads, strict=True)):
            mom, vel = state.get(i, (torch.zeros_like(p), torch.zeros_like(p)))
            mom = b1 * mom + (1 - b1) * g
            vel = b2 * vel + (1 - b2) * g * g
            state[i] = (mom, vel)
            p -= lr_t * mom / (vel.sqrt() + eps)  # MPS: epsilon outside the bias correction

    return update


@pytest.mark.parametrize("shared", [True, False], ids=["one_adam", "adam_per_layer"])
def test_adam_in_the_step_matches_the_documented_math(shared: bool) -> None:
    lr, b1, b2, eps = 0.05, 0.8, 0.9, 1e-3  # a large epsilon: where it goes matters
    desc = m.OptimizerDescriptor(learning_rate=lr)
    one = m.Adam(DEV, b1, b2, eps, descriptor=desc)
    made: list[m.Adam] = []

    def optimizers():
        made.append(one if shared else m.Adam(DEV, b1, b2, eps, descriptor=desc))
        return made[-1]

    graph, sources = _net(52, optimizers)
    batches = _batches(53)
    ref = _reference_grads(sources, batches, _adam_reference(lr, b1, b2, eps))
    _train(graph, batches)
    for a, e in zip(_graph_params(sources), ref, strict=True):
        assert_close(a, e, "Adam, 3 steps", 1e-12)
    # one time step per encode, shared or not
    assert all(opt.time_step == STEPS for opt in made)


def test_cpu_style_updates_give_the_gpu_style_weights() -> None:
    def optimizers():
        return m.Adam(DEV, descriptor=m.OptimizerDescriptor(learning_rate=0.05))

    batches = _batches(54)
    gpu_graph, gpu = _net(55, optimizers, batch_norm=True)
    cpu_graph, cpu = _net(55, optimizers, batch_norm=True, cpu_style=True)
    start = [t.clone() for t in _values(cpu)]
    xt, labels = batches[0]
    cb = DEV.new_command_queue().command_buffer()
    cpu_graph.encode_batch(cb, [m.ImageBatch.from_tensor(xt)], [m.LossLabels(DEV, labels)])
    assert all(torch.equal(a, b) for a, b in zip(_values(cpu), start, strict=True))
    cb.commit()
    cb.wait_until_completed()  # the completed handler ran the updates
    assert not any(torch.equal(a, b) for a, b in zip(_values(cpu), start, strict=True))
    _train(cpu_graph, batches[1:])
    _train(gpu_graph, batches)
    for a, b in zip(_values(cpu), _values(gpu), strict=True):
        assert_close(a, b, "CPU-style against GPU-style updates", 1e-13)


def test_cpu_style_layers_sharing_one_adam_take_one_time_step_per_encode() -> None:
    def run(cpu_style: bool):
        shared = m.Adam(DEV, descriptor=m.OptimizerDescriptor(learning_rate=0.05))
        graph, sources = _net(56, lambda: shared, cpu_style=cpu_style)
        _train(graph, _batches(57))
        return shared.time_step, _values(sources)

    gpu_steps, gpu = run(False)
    cpu_steps, cpu = run(True)
    assert gpu_steps == STEPS
    assert cpu_steps == STEPS
    for a, b in zip(cpu, gpu, strict=True):
        assert_close(a, b, "shared Adam, CPU style", 1e-13)


# -- compile --------------------------------------------------------------------------------------


def test_compiled_steps_give_the_eager_weights_bit_for_bit() -> None:
    def optimizers():
        return m.Adam(DEV, descriptor=m.OptimizerDescriptor(learning_rate=0.01))

    batches = _batches(58)
    eager_graph, eager = _net(59, optimizers, batch_norm=True)
    graph, compiled_sources = _net(59, optimizers, batch_norm=True)
    comp = graph.compile()
    assert isinstance(comp, m.CompiledGraph) and comp.graph is graph
    _train(eager_graph, batches)
    losses = []
    for xt, labels in batches:
        lab = m.LossLabels(DEV, labels)
        assert comp([m.ImageBatch.from_tensor(xt)], [lab]) is None
        comp.wait_until_completed()
        losses.append(comp.source_states[0][0].loss_image().tensor.sum().item())
    assert comp.steps == STEPS and not comp.is_captured and comp.replays == 0
    assert len(set(losses)) == STEPS
    for a, b in zip(_values(compiled_sources), _values(eager), strict=True):
        assert torch.equal(a, b)
    before = [t.clone() for t in _values(compiled_sources)]
    xt, labels = batches[0]
    with pytest.raises(ValueError, match=r"must hold one image per source image \(4\), got 3"):
        comp([m.ImageBatch.from_tensor(xt)], [m.LossLabels(DEV, labels[:3])])
    assert all(torch.equal(a, b) for a, b in zip(_values(compiled_sources), before, strict=True))
