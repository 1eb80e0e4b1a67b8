"""Shared pieces of the model tests: run a model's graphs once in float64 and compare every
value with its PyTorch twin (`Model.torch_module`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import mpsnn as m
from mpsnn.models import Model
from tests.helpers import assert_close

DEV = m.Device("cpu")
F64 = m.FeatureChannelFormat.FLOAT64
TOL = 1e-10  # float64 against float64 (relative norm)
LR = 0.5  # exact in float32, as the optimizer's device-side hyperparameters are


def sgd() -> m.SGD:
    return m.SGD(DEV, descriptor=m.OptimizerDescriptor(learning_rate=LR))


def run(graph: m.Graph, x: torch.Tensor, labels: torch.Tensor | None = None):
    """One ``encode_batch`` on a fresh command buffer, committed and waited for."""
    cb = DEV.new_command_queue().command_buffer()
    states = None if labels is None else [m.LossLabels(DEV, labels.view(-1, 1, 1))]
    out = graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)], states)
    cb.commit()
    cb.wait_until_completed()
    return out


def logits(model: Model, x: torch.Tensor) -> torch.Tensor:
    """The inference graph's logits as ``(N, classes)``."""
    graph = model.inference_graph(storage=F64)
    return run(graph, x).tensor.reshape(x.shape[0], -1)


def check_twin_holds_data_sources(model: Model, twin: nn.Module) -> None:
    """``twin`` (from `torch_module`) holds every data source's current values, exactly."""
    modules = dict(twin.named_modules())
    names = {id(mod): name for name, mod in model.twin.named_modules()}
    for module, ds in model.layers:
        mine = modules[names[id(module)]]
        if isinstance(ds, m.TensorConvolutionDataSource):
            w = ds.weights().permute(0, 3, 1, 2).reshape(mine.weight.shape)
            assert torch.equal(mine.weight.detach(), w), names[id(module)]
            if mine.bias is not None:
                assert torch.equal(mine.bias.detach(), ds.bias_terms())
        else:
            for a, b in [(mine.weight, ds.gamma()), (mine.bias, ds.beta()),
                         (mine.running_mean, ds.mean()), (mine.running_var, ds.variance())]:  # fmt: skip
                assert torch.equal(a.detach(), b), names[id(module)]


def check_one_sgd_step(model: Model, x: torch.Tensor, labels: torch.Tensor) -> None:
    """One training-graph step against the twin trained one step with ``torch.optim.SGD`` on
    ``F.cross_entropy`` (batch mean): every weight, bias, gamma, beta and running statistic
    (read back through `torch_module`), then the inference graph on the trained values."""
    twin = model.torch_module().train()
    check_twin_holds_data_sources(model, twin)
    before = {k: v.clone() for k, v in twin.state_dict().items()}
    opt = torch.optim.SGD(twin.parameters(), lr=LR)
    opt.zero_grad()
    F.cross_entropy(twin(x), labels).backward()
    opt.step()

    train = model.training_graph(x.shape[0], storage=F64)
    infer = model.inference_graph(storage=F64)  # built before the step: reads after a reload
    assert run(train, x, labels) is None
    after = model.torch_module()
    check_twin_holds_data_sources(model, after)
    got, want = after.state_dict(), twin.state_dict()
    for name, value in want.items():
        if name.endswith("num_batches_tracked"):
            continue
        assert_close(got[name], value, f"{name} after one step", TOL)
        assert not torch.equal(got[name], before[name]), f"{name} did not move"

    infer.reload_from_data_sources()
    with torch.no_grad():
        expected = twin.eval()(x)
    assert_close(run(infer, x).tensor.reshape(x.shape[0], -1), expected, "trained logits", TOL)
