"""A FLOAT64 training graph over float32 data sources: its gradient sums are float64, and the
optimizer reads them in the values' precision (an update of float32 values refuses float64
gradient tensors it is given explicitly; sums the graph made are narrowed instead). The
update equals the same optimizer step applied to the float64 gradient rounded to float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from mpsnn.ops import optim as ops_optim
from mpsnn.ops import optim_hyper

DEV = m.Device("cpu")


def _optimizer(name: str) -> m.SGD | m.Adam:
    desc = m.OptimizerDescriptor(learning_rate=0.01)
    return m.SGD(DEV, descriptor=desc) if name == "sgd" else m.Adam(DEV, descriptor=desc)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_float64_graph_updates_float32_weights(name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    desc = m.ConvolutionDescriptor(3, 3, 2, 4)
    w0 = torch.randn(desc.weights_shape, generator=gen)  # OHWI, float32
    b0 = torch.randn(4, generator=gen)
    ds = m.TensorConvolutionDataSource(desc, w0.clone(), b0.clone(), optimizer=_optimizer(name))
    x = torch.randn(2, 2, 5, 5, generator=gen, dtype=torch.float64)
    target = torch.randn(2, 4, 5, 5, generator=gen, dtype=torch.float64)
    y = m.ConvolutionNode(m.ImageNode("x"), ds).result_image
    loss = m.LossNode(y, m.LossDescriptor(m.LossType.MEAN_SQUARED_ERROR, m.ReductionType.SUM))
    (exit_node,) = loss.training_graph()
    graph = m.Graph(DEV, exit_node.result_image, False)
    graph.format = m.FeatureChannelFormat.FLOAT64
    cb = DEV.new_command_queue().command_buffer()
    graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)], [m.LossLabels(DEV, target)])
    cb.commit()
    cb.wait_until_completed()
    assert cb.error is None

    # the reference: the float64 gradient (autograd), rounded to float32, one step of the rule
    w = w0.permute(0, 3, 1, 2).double().requires_grad_()
    b = b0.double().requires_grad_()
    ((F.conv2d(x, w, b, padding=1) - target) ** 2).sum().backward()
    grads = [w.grad.float().contiguous(), b.grad.float()]
    values = [w0.permute(0, 3, 1, 2).contiguous(), b0.clone()]
    hyper = optim_hyper.make_hyper("cpu", learning_rate=0.01)
    if name == "sgd":
        ops_optim.sgd_update(values, grads, values, None, hyper)
    else:
        moments = [[torch.zeros_like(v) for v in values] for _ in range(2)]
        ops_optim.adam_update(
            values, grads, values, *moments, None, hyper, optim_hyper.make_step("cpu")
        )
    torch.testing.assert_close(ds.weights(), values[0].permute(0, 2, 3, 1))
    torch.testing.assert_close(ds.bias_terms(), values[1])
    assert not torch.equal(ds.weights(), w0)  # the step moved the weights


def test_an_explicit_float64_gradient_for_float32_values_is_still_refused() -> None:
    w = [torch.randn(4)]
    hyper = optim_hyper.make_hyper("cpu", learning_rate=0.1)
    with pytest.raises(TypeError, match=r"grads\[0\] is torch.float64 with torch.float32 values"):
        ops_optim.sgd_update(w, [torch.randn(4).double()], w, None, hyper)
