"""Optimizers through their MPS encode forms, and the three MPS weight-update paths.

The update math is checked against the formulas step by step in tests/ops/test_optim_ops.py;
here: the encode forms (vectors, a convolution state, a normalization state), the options
(learning rate set between steps, time step), the three update paths giving identical weights,
a layer trained end to end with each path, and the errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import mpsnn as m
from tests.helpers import DEVICES, assert_close, run

CPU = m.Device("cpu")


def _adam_reference(w, grads, lr, b1=0.9, b2=0.999, eps=1e-8):
    """MPS Adam, written out (float64)."""
    w, mo, v = w.clone(), torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        lr_t = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        mo = b1 * mo + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w = w - lr_t * mo / (v.sqrt() + eps)
    return w


@pytest.mark.parametrize("device", DEVICES)
def test_vector_form_follows_the_formula_with_a_changing_learning_rate(device) -> None:
    dev = m.Device(device)
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(7, generator=gen, dtype=torch.float64)
    grads = [torch.randn(7, generator=gen, dtype=torch.float64) for _ in range(5)]
    opt = m.SGD(dev, momentum_scale=0.9, descriptor=m.OptimizerDescriptor(learning_rate=0.1))
    w, mom = w0.clone().to(device), torch.zeros(7, dtype=torch.float64, device=device)
    ref_w, ref_m = w0.clone(), torch.zeros(7, dtype=torch.float64)
    q = dev.new_command_queue()
    for k, g in enumerate(grads):
        lr = 0.1 / (k + 1)
        opt.learning_rate = lr
        cb = q.command_buffer()
        opt.encode(
            cb, input_gradient_vector=g.to(device), input_values_vector=w,
            input_momentum_vector=mom, result_values_vector=w,
        )  # fmt: skip
        run(cb)
        ref_m = 0.9 * ref_m + lr * g  # MPS: the momentum holds lr·g
        ref_w = ref_w - ref_m
    assert_close(w, ref_w, "SGD with momentum and a changing rate", tol=1e-12)
    assert opt.learning_rate == pytest.approx(0.02)


def _encoded_gradient(seed: int) -> tuple[Any, ...]:
    """A 3x3 convolution (float64) and its gradient encoded, not committed: (data source,
    queue, command buffer, gradient states, exported weights state)."""
    desc = m.ConvolutionDescriptor(3, 3, 2, 2)
    gen = torch.Generator().manual_seed(seed)
    ds = m.TensorConvolutionDataSource(
        desc, torch.randn(desc.weights_shape, generator=gen, dtype=torch.float64),
        torch.randn(2, generator=gen, dtype=torch.float64),
    )  # fmt: skip
    conv, grad = m.Convolution(CPU, ds), m.ConvolutionGradient(CPU, ds)
    q = CPU.new_command_queue()
    x = m.ImageBatch.from_tensor(torch.randn(2, 2, 5, 5, generator=gen, dtype=torch.float64))
    g = m.ImageBatch.from_tensor(torch.randn(2, 2, 5, 5, generator=gen, dtype=torch.float64))
    st = conv.result_state_batch(x)
    cb = q.command_buffer()
    conv.encode_batch(cb, x, destination_states=st)
    grad.encode_batch(cb, g, x, st)
    return ds, q, cb, st, conv.export_weights_and_biases(cb)


def test_adam_time_step_counts_encodes_and_a_convolution_state_counts_once() -> None:
    ds, q, cb, st, source = _encoded_gradient(seed=1)
    adam = m.Adam(CPU, time_step=3)
    result = m.ConvolutionWeightsAndBiasesState(
        torch.zeros_like(source.weights), torch.zeros(2, dtype=torch.float64)
    )
    moms = [torch.zeros_like(source.weights), torch.zeros(2, dtype=torch.float64)]
    vels = [torch.zeros_like(source.weights), torch.zeros(2, dtype=torch.float64)]
    adam.encode(
        cb, convolution_gradient_state=st[0], convolution_source_state=source,
        input_momentum_vectors=moms, input_velocity_vectors=vels, result_state=result,
    )  # fmt: skip
    run(cb)
    assert adam.time_step == 4  # weights and biases together: one update
    w_ref = _adam_reference(ds.weights(), [st[0].gradient_for_weights], 0.001)
    lr_t = 0.001 * math.sqrt(1 - 0.999**4) / (1 - 0.9**4)  # the step started at t = 3
    g_w = st[0].gradient_for_weights
    mo, v = 0.1 * g_w, 0.001 * g_w * g_w
    assert_close(result.weights, ds.weights() - lr_t * mo / (v.sqrt() + 1e-8), "Adam at t = 4")
    assert_close(moms[0], mo, "momentum vector, OHWI, updated in place")
    assert not torch.equal(w_ref, result.weights)  # t = 4 is not t = 1
    # a list of length 1 leaves the biases alone
    cb = q.command_buffer()
    before = result.biases.clone()
    adam.encode(
        cb, convolution_gradient_state=st[0], convolution_source_state=result,
        input_momentum_vectors=moms[:1], input_velocity_vectors=vels[:1], result_state=result,
    )  # fmt: skip
    run(cb)
    assert torch.equal(result.biases, before) and adam.time_step == 5


def test_encoding_an_update_leaves_the_gradient_state_untouched() -> None:
    """An optimizer's encode from a convolution gradient state reads the sums when the update
    runs, and makes nothing at encode time: the gradient encoded before it still *stores* its
    sums when it runs (no zero sums made early that it would add into: a recorded step would
    then keep adding at every replay)."""
    _, _, cb, st, source = _encoded_gradient(seed=4)
    for opt in (m.SGD(CPU), m.Adam(CPU)):
        vectors = {} if isinstance(opt, m.SGD) else {
            "input_momentum_vectors": [torch.zeros_like(source.weights), torch.zeros_like(source.biases)],
            "input_velocity_vectors": [torch.zeros_like(source.weights), torch.zeros_like(source.biases)],
        }  # fmt: skip
        opt.encode(cb, convolution_gradient_state=st[0], convolution_source_state=source,
                   result_state=source, **vectors)  # fmt: skip
        assert not st[0].has_accumulated, f"{type(opt).__name__}.encode made the sums early"


def _layer(path: str, seed: int = 2):
    """A 1x1 convolution whose data source applies Adam (paths: cpu, gpu, optimizer-direct)."""
    gen = torch.Generator().manual_seed(seed)
    desc = m.ConvolutionDescriptor(1, 1, 3, 1)
    opt = m.Adam(CPU, descriptor=m.OptimizerDescriptor(learning_rate=0.05))
    w = torch.randn(desc.weights_shape, generator=gen, dtype=torch.float64)
    ds = m.TensorConvolutionDataSource(desc, w, torch.zeros(1, dtype=torch.float64), optimizer=opt)
    return ds, m.Convolution(CPU, ds), m.ConvolutionGradient(CPU, ds), opt


def _train(path: str, steps: int = 80) -> tuple[torch.Tensor, list[float]]:
    """Fit y = x·(1, -2, 0.5) + 0.3 with MSE, updating through ``path``."""
    ds, conv, grad, opt = _layer(path)
    gen = torch.Generator().manual_seed(3)
    target_w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64).view(1, 3, 1, 1)
    mse = m.Loss(CPU, m.LossDescriptor(m.LossType.MEAN_SQUARED_ERROR, m.ReductionType.SUM, 1 / 8))
    q = CPU.new_command_queue()
    moms = vels = None
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 3, 1, 1, generator=gen, dtype=torch.float64)
        y = (x * target_w).sum(1, keepdim=True) + 0.3
        labels = m.LossLabels(CPU, y)
        xb = m.ImageBatch.from_tensor(x)
        cb = q.command_buffer()
        st = conv.result_state_batch(xb)
        pred = conv.encode_batch(cb, xb, destination_states=st)
        dy = mse.encode_batch(cb, pred, labels)
        grad.encode_batch(cb, dy, xb, st)
        if path == "gpu":  # MPS path 2/3: the data source's update on the command buffer
            state = ds.update(cb, st[0], None)
            conv.reload_weights_and_biases(cb, state)
            run(cb)
        elif path == "cpu":  # MPS path 1: after completion, update on the CPU, then reload
            run(cb)
            assert ds.update_on_cpu(st[0], None)
            conv.reload_weights_and_biases_from_data_source()
        else:  # an optimizer encoded by hand into the kernel's exported weights
            source = conv.export_weights_and_biases(cb)
            if moms is None:
                moms = [
                    torch.zeros(1, 1, 1, 3, dtype=torch.float64),
                    torch.zeros(1, dtype=torch.float64),
                ]
                vels = [
                    torch.zeros(1, 1, 1, 3, dtype=torch.float64),
                    torch.zeros(1, dtype=torch.float64),
                ]
            opt.encode(
                cb, convolution_gradient_state=st[0], convolution_source_state=source,
                input_momentum_vectors=moms, input_velocity_vectors=vels, result_state=source,
            )  # fmt: skip
            conv.reload_weights_and_biases(cb, source)
            run(cb)
        losses.append(labels.loss_image().tensor.sum().item())
    return torch.cat([conv.weights.reshape(-1), conv.biases]), losses


def test_the_three_update_paths_give_identical_weights_and_train() -> None:
    results = {path: _train(path) for path in ("cpu", "gpu", "direct")}
    w_cpu, losses = results["cpu"]
    for path in ("gpu", "direct"):
        assert torch.equal(results[path][0], w_cpu), f"{path} path differs from the CPU path"
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.05 * first, (first, last)  # the layer trains
    ds, *_ = _layer("cpu")
    assert ds.optimizer_state is None  # made by the first update


def test_data_source_weights_are_the_memory_the_optimizer_writes() -> None:
    ds, conv, grad, _opt = _layer("gpu")
    held = ds.weights()
    x = m.ImageBatch.from_tensor(torch.randn(2, 3, 1, 1, dtype=torch.float64))
    cb = CPU.new_command_queue().command_buffer()
    st = conv.result_state_batch(x)
    y = conv.encode_batch(cb, x, destination_states=st)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grad.encode_batch(cb, m.ImageBatch.from_tensor(g), x, st)
    state = ds.update(cb, st[0], None)
    run(cb)
    assert state is ds.state and held.data_ptr() == ds.weights().data_ptr()
    assert not torch.equal(held, conv.weights)  # updated, not yet reloaded into the kernel
    assert set(ds.optimizer_state) == {"momentum", "velocity"}
    assert ds.optimizer_state["momentum"][0].shape == (1, 1, 1, 3)  # OHWI like the weights


def test_rmsprop_and_sgd_without_momentum_vectors() -> None:
    gen = torch.Generator().manual_seed(4)
    w, g = (
        torch.randn(5, generator=gen, dtype=torch.float64),
        torch.randn(5, generator=gen, dtype=torch.float64),
    )
    s = torch.zeros(5, dtype=torch.float64)
    out = torch.empty_like(w)
    cb = CPU.new_command_queue().command_buffer()
    m.RMSProp(CPU, decay=0.8, epsilon=1e-6).encode(
        cb, input_gradient_vector=g, input_values_vector=w, input_sum_of_squares_vector=s,
        result_values_vector=out,
    )  # fmt: skip
    plain = torch.empty_like(w)
    desc = m.OptimizerDescriptor(0.5, apply_gradient_clipping=True, gradient_clip_max=0.25,
                                 gradient_clip_min=-0.25, regularization_type=m.RegularizationType.L2,
                                 regularization_scale=0.1)  # fmt: skip
    m.SGD(CPU, descriptor=desc).encode(
        cb, input_gradient_vector=g, input_values_vector=w, result_values_vector=plain
    )
    run(cb)
    assert_close(s, 0.2 * g * g, "sum of squares")
    assert_close(out, w - 1e-3 * g / ((0.2 * g * g).sqrt() + 1e-6), "RMSProp")
    assert_close(plain, w - 0.5 * (g.clamp(-0.25, 0.25) + 0.1 * w), "clip, then L2, then SGD")


def test_optimizer_errors() -> None:
    with pytest.raises(
        ValueError, match=r"\[OptimizerDescriptor\] learning_rate must be finite, got nan"
    ):
        m.OptimizerDescriptor(float("nan"))
    with pytest.raises(
        ValueError,
        match=r"\[OptimizerDescriptor\] gradient_clip_min must be <= gradient_clip_max, got 2.0 > 1.0",
    ):
        m.OptimizerDescriptor(gradient_clip_min=2.0, gradient_clip_max=1.0)
    opt = m.Adam(CPU)
    with pytest.raises(ValueError, match=r"\[Adam\] learning_rate must be finite, got inf"):
        opt.learning_rate = float("inf")
    with pytest.raises(ValueError, match=r"\[Adam\] time_step must be an int >= 0, got -1"):
        m.Adam(CPU, time_step=-1)
    cb = CPU.new_command_queue().command_buffer()
    w = torch.zeros(3)
    with pytest.raises(ValueError, match=r"\[Adam\] encode needs momentum and velocity vectors"):
        opt.encode(cb, input_gradient_vector=w, input_values_vector=w, result_values_vector=w)
    with pytest.raises(ValueError, match=r"\[SGD\] use_nesterov_momentum needs momentum vectors"):
        m.SGD(CPU, 0.9, True).encode(
            cb, input_gradient_vector=w, input_values_vector=w, result_values_vector=w
        )
    with pytest.raises(ValueError, match=r"\[SGD\] encode needs input_gradient_vector"):
        m.SGD(CPU).encode(cb, input_gradient_vector=w, result_values_vector=w)
    with pytest.raises(
        ValueError,
        match=r"\[SGD\] input_gradient_vector must have the values' shape \(3,\), got \(2,\)",
    ):
        m.SGD(CPU).encode(
            cb, input_gradient_vector=torch.zeros(2), input_values_vector=w, result_values_vector=w
        )
    assert len(cb) == 0
    with pytest.raises(
        TypeError,
        match=r"\[TensorBatchNormalizationDataSource\] optimizer must be an mpsnn optimizer",
    ):
        m.TensorBatchNormalizationDataSource(4, optimizer="adam")
