"""Instance and group normalization kernels: against PyTorch autograd in float64 (gradients
of x, and of gamma and beta summed over the batch's per-image states), the adjoint identity,
the 1x1-window geometry, a data source with an optimizer, and the errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.helpers import DEVICES, assert_adjoint, assert_close, run


def _data(n=3, c=4, h=3, w=5, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, c, h, w, generator=gen, dtype=torch.float64) * 3 + 2).to(device)
    g = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64).to(device)
    gamma = torch.rand(c, generator=gen, dtype=torch.float64) + 0.5
    beta = torch.randn(c, generator=gen, dtype=torch.float64)
    return x, g, gamma, beta


def _run(dev, kind, x, g, gamma, beta, groups):
    if kind == "instance":
        ds = m.TensorInstanceNormalizationDataSource(x.shape[1], gamma, beta, epsilon=1e-5)
        fwd, grad = m.InstanceNormalization(dev, ds), m.InstanceNormalizationGradient(dev)
    else:
        ds = m.TensorGroupNormalizationDataSource(x.shape[1], groups, gamma, beta, 1e-5)
        fwd, grad = m.GroupNormalization(dev, ds), m.GroupNormalizationGradient(dev)
    xb, gb = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(g)
    cb = dev.new_command_queue().command_buffer()
    st = fwd.result_state_batch(xb)
    y = fwd.encode_batch(cb, xb, destination_states=st)
    dx = grad.encode_batch(cb, gb, xb, st)
    run(cb)
    return y.tensor, dx.tensor, st


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,groups", [("instance", 4), ("group", 2), ("group", 1)])
def test_against_pytorch(device, kind, groups) -> None:
    dev = m.Device(device)
    x, g, gamma, beta = _data(device=device)
    y, dx, states = _run(dev, kind, x, g, gamma, beta, groups)
    dgamma, dbeta = type(states[0]).summed_gradients(states)
    xr = x.cpu().requires_grad_()
    ga, be = gamma.clone().requires_grad_(), beta.clone().requires_grad_()
    ref = F.group_norm(xr, groups, ga, be, eps=1e-5)
    rdx, rdg, rdb = torch.autograd.grad(ref, (xr, ga, be), g.cpu())
    assert_close(y, ref.detach(), f"{kind} forward")
    assert_close(dx, rdx, f"{kind} dL/dx")
    assert_close(dgamma, rdg, f"{kind} dL/dgamma summed over the batch")
    assert_close(dbeta, rdb, f"{kind} dL/dbeta")
    if kind == "instance":
        assert_close(y, F.instance_norm(x.cpu(), weight=gamma, bias=beta, eps=1e-5), "instance")


def test_adjoint_with_gamma_varying_inside_groups() -> None:
    dev = m.Device("cpu")
    x, w, gamma, beta = _data(seed=1)
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    _, jv = torch.autograd.functional.jvp(lambda t: F.group_norm(t, 2, gamma, beta, eps=1e-5), x, v)
    _, dx, _ = _run(dev, "group", x, w, gamma, beta, 2)
    assert_adjoint(jv, w, v, dx, "group normalization, 2 groups")


def test_geometry_offset_and_clip_rect() -> None:
    """The 1x1-window model: the statistics are of the block read, written at the clip rect."""
    dev = m.Device("cpu")
    x, _, gamma, beta = _data(n=1, c=2, h=4, w=4, seed=3)
    ds = m.TensorInstanceNormalizationDataSource(2, gamma[:2], beta[:2], epsilon=1e-5)
    k = m.InstanceNormalization(dev, ds)
    k.offset = m.Offset(1, 1, 0)
    k.clip_rect = m.Region.make(0, 0, 3, 3)
    dst = m.Image.from_tensor(torch.full((1, 2, 3, 3), 7.0, dtype=torch.float64))
    cb = dev.new_command_queue().command_buffer()
    k.encode(cb, m.Image.from_tensor(x), dst)
    run(cb)
    block = x[:, :, 1:4, 1:4]
    assert_close(
        dst.tensor, F.instance_norm(block, weight=gamma[:2], bias=beta[:2], eps=1e-5), "block"
    )


def test_data_source_optimizer_updates_gamma_and_beta() -> None:
    dev = m.Device("cpu")
    x, g, gamma, beta = _data(seed=4)
    opt = m.SGD(dev, descriptor=m.OptimizerDescriptor(learning_rate=0.5))
    ds = m.TensorGroupNormalizationDataSource(4, 2, gamma, beta, optimizer=opt)
    fwd, grad = m.GroupNormalization(dev, ds), m.GroupNormalizationGradient(dev)
    xb, gb = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(g)
    cb = dev.new_command_queue().command_buffer()
    st = fwd.result_state_batch(xb)
    fwd.encode_batch(cb, xb, destination_states=st)
    grad.encode_batch(cb, gb, xb, st)
    new = ds.update_gamma_and_beta(cb, st)  # the batch of per-image states
    fwd.reload_gamma_and_beta(cb, new)
    run(cb)
    dgamma, dbeta = m.GroupNormalizationGradientState.summed_gradients(st)
    assert_close(ds.gamma(), gamma - 0.5 * dgamma, "gamma after SGD")
    assert_close(fwd.gamma, ds.gamma(), "reloaded")
    assert_close(fwd.beta, beta - 0.5 * dbeta, "beta after SGD")


def test_group_normalization_errors() -> None:
    dev = m.Device("cpu")
    with pytest.raises(
        ValueError,
        match=r"\[TensorGroupNormalizationDataSource\] number_of_groups must divide number_of_feature_channels \(6\), got 4",
    ):
        m.TensorGroupNormalizationDataSource(6, 4)
    with pytest.raises(
        TypeError,
        match=r"\[GroupNormalization\] data_source must be a GroupNormalizationDataSource, got TensorInstanceNormalizationDataSource",
    ):
        m.GroupNormalization(dev, m.TensorInstanceNormalizationDataSource(4))
    k = m.InstanceNormalization(dev, m.TensorInstanceNormalizationDataSource(4))
    cb = dev.new_command_queue().command_buffer()
    with pytest.raises(
        ValueError,
        match=r"\[InstanceNormalization\] the source must provide number_of_feature_channels=4 channels",
    ):
        k.encode(cb, m.Image.from_tensor(torch.zeros(1, 3, 2, 2)))
    state = k.result_state(m.Image.from_tensor(torch.zeros(1, 4, 2, 2)))
    with pytest.raises(
        ValueError,
        match=r"\[InstanceNormalizationGradient\] the gradient state must have been written by a forward encode",
    ):
        m.InstanceNormalizationGradient(dev).encode(
            cb,
            m.Image.from_tensor(torch.zeros(1, 4, 2, 2)),
            m.Image.from_tensor(torch.zeros(1, 4, 2, 2)),
            state,
        )
    ds = m.TensorInstanceNormalizationDataSource(4, optimizer=m.SGD(dev))
    with pytest.raises(
        ValueError,
        match=r"\[TensorInstanceNormalizationDataSource\] the state must hold gamma/beta gradients",
    ):
        ds.update_gamma_and_beta(cb, state)
    assert len(cb) == 0
