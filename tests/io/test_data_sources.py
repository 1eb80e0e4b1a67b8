"""Round trips of descriptors, optimizers and data sources: values bit for bit, types, the
optimizers' device tensors, and training that continues exactly after a reload."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mpsnn as m
from tests.helpers import run
from tests.io._helpers import CPU, _conv_step, _equal, _roundtrip


def test_descriptors_round_trip(tmp_path) -> None:
    prelu = m.NeuronDescriptor(m.NeuronType.PRELU, data=torch.tensor([0.1, -0.2, 0.3]))
    relu_n = m.NeuronDescriptor(m.NeuronType.RELU_N, a=0.125, b=3.0)
    conv = m.ConvolutionDescriptor(3, 5, 4, 6, 2, 1, 1, 2, groups=2, fused_neuron_descriptor=relu_n)
    loss = m.LossDescriptor(
        m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM_BY_NON_ZERO_WEIGHTS, weight=0.25,
        label_smoothing=0.1, number_of_classes=5, epsilon=1e-6, delta=2.0,
    )  # fmt: skip
    opt = m.OptimizerDescriptor(0.3, 0.5, True, 0.75, -0.25, m.RegularizationType.L1, 1e-4)
    values = {"prelu": prelu, "relu_n": relu_n, "conv": conv, "loss": loss, "opt": opt}
    out = _roundtrip(values, tmp_path)
    assert out["prelu"] == prelu and _equal(out["prelu"].data, prelu.data)
    assert out["relu_n"] == relu_n
    assert type(out["conv"]) is m.ConvolutionDescriptor and out["conv"] == conv
    assert out["conv"].fused_neuron_descriptor == relu_n
    assert out["conv"].fused_neuron_descriptor is out["relu_n"]  # one object, saved once
    assert repr(out["loss"]) == repr(loss)
    assert repr(out["opt"]) == repr(opt)


def _optimizers():
    desc = m.OptimizerDescriptor(0.1, 0.5, True, 2.0, -3.0, m.RegularizationType.L2, 0.01)
    sgd = m.SGD(CPU, 0.9, True, desc)
    sgd.learning_rate = 0.0123  # changed after construction: the current one is saved
    sgd.apply_gradient_clipping = False
    rms = m.RMSProp(CPU, 0.8, 1e-6, m.OptimizerDescriptor(learning_rate=-0.5))
    adam = m.Adam(CPU, 0.8, 0.99, 1e-7, time_step=7, descriptor=desc, amsgrad=True)
    adam.learning_rate = 1 / 3
    adam.label = "adam"
    adam.options = m.KernelOptions.VERBOSE
    return [sgd, rms, adam, m.SGD(CPU), m.Adam(CPU)]


@pytest.mark.parametrize("index", range(5))
def test_optimizers_round_trip_with_their_device_tensors(tmp_path, index) -> None:
    opt = _optimizers()[index]
    out = _roundtrip(opt, tmp_path)
    assert type(out) is type(opt) and repr(out) == repr(opt)
    for name in (
        "learning_rate", "gradient_rescale", "apply_gradient_clipping", "gradient_clip_max",
        "gradient_clip_min", "regularization_type", "regularization_scale", "label", "options",
    ):  # fmt: skip
        assert getattr(out, name) == getattr(opt, name), name
    assert _equal(out._hyper, opt._hyper)  # the device copy of the hyperparameters, exactly
    assert out._state_names() == opt._state_names()
    if isinstance(opt, m.Adam):
        assert _equal(out._step, opt._step) and out.time_step == opt.time_step
        assert (out.beta1, out.beta2, out.epsilon) == (opt.beta1, opt.beta2, opt.epsilon)
    if index == 0:
        assert out.learning_rate == 0.0123 and out._hyper[0].item() == 0.0123
        assert out.momentum_scale == 0.9 and out.use_nesterov_momentum


def _make_optimizer(kind: str):
    desc = m.OptimizerDescriptor(learning_rate=0.05)
    return {
        "sgd": lambda: m.SGD(CPU, descriptor=desc),
        "momentum": lambda: m.SGD(CPU, 0.9, descriptor=desc),
        "nesterov": lambda: m.SGD(CPU, 0.8, True, descriptor=desc),
        "rmsprop": lambda: m.RMSProp(CPU, 0.9, 1e-6, descriptor=desc),
        "adam": lambda: m.Adam(CPU, descriptor=desc),
        "amsgrad": lambda: m.Adam(CPU, descriptor=desc, amsgrad=True),
    }[kind]()


@pytest.mark.parametrize(
    "kind,dtype,path,bias",
    [
        ("adam", torch.float32, "cpu", True),
        ("adam", torch.float64, "gpu", True),
        ("amsgrad", torch.float32, "gpu", False),
        ("sgd", torch.float32, "cpu", True),
        ("momentum", torch.float32, "gpu", True),
        ("nesterov", torch.float64, "cpu", True),
        ("rmsprop", torch.float32, "cpu", True),
    ],
)
def test_convolution_data_source_continues_training_exactly(tmp_path, kind, dtype, path, bias):
    gen = torch.Generator().manual_seed(1)
    desc = m.ConvolutionDescriptor(3, 3, 2, 3)
    w = torch.randn(desc.weights_shape, generator=gen, dtype=torch.float64).to(dtype)
    b = torch.randn(3, generator=gen, dtype=torch.float64).to(dtype) if bias else None
    opt = _make_optimizer(kind)
    opt.learning_rate = 0.02  # changed during training: the current rate is saved
    ds = m.TensorConvolutionDataSource(desc, w.clone(), b, optimizer=opt, label="conv1")
    conv, grad = m.Convolution(CPU, ds), m.ConvolutionGradient(CPU, ds)
    for _ in range(3):
        _conv_step(ds, conv, grad, gen, path)
    assert not torch.equal(ds.weights(), w)
    loaded = _roundtrip({"ds": ds, "conv": conv}, tmp_path)
    ds2, conv2 = loaded["ds"], loaded["conv"]
    assert type(ds2) is m.TensorConvolutionDataSource and conv2.data_source is ds2
    assert ds2.label == "conv1" and ds2.descriptor() == desc
    assert type(ds2.optimizer) is type(opt) and ds2.optimizer.learning_rate == 0.02
    assert _equal(ds2.weights(), ds.weights()) and _equal(ds2.bias_terms(), ds.bias_terms())
    # the memory order of the held weights comes back (OHWI given here: channels-last OIHW)
    assert ds2._state._oihw.stride() == ds._state._oihw.stride()
    if kind == "sgd":
        assert ds2.optimizer_state == {} and ds.optimizer_state == {}
    else:
        assert set(ds2.optimizer_state) == set(ds.optimizer_state) != set()
    for name, vectors in ds.optimizer_state.items():
        for a, b2 in zip(vectors, ds2.optimizer_state[name], strict=True):
            assert _equal(a, b2), name
    values = [ds._state._oihw, ds._state._biases][: len(ds._optimizer_state[0])] if (
        ds._optimizer_state) else []  # fmt: skip
    for a, b2 in zip(ds._optimizer_state, ds2._optimizer_state, strict=True):
        assert all(_equal(x, y) for x, y in zip(a, b2, strict=True))
        # each state vector in its weights' memory order (OHWI given: channels-last OIHW),
        # the loaded ones too
        assert all(x.stride() == v.stride() for x, v in zip(a, values, strict=True))
        assert all(x.stride() == y.stride() for x, y in zip(a, b2, strict=True))
    grad2 = m.ConvolutionGradient(CPU, ds2)
    gens = [torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)]
    before = ds.weights().clone()
    for _ in range(2):
        _conv_step(ds, conv, grad, gens[0], path)
        _conv_step(ds2, conv2, grad2, gens[1], path)
    assert not torch.equal(ds.weights(), before)  # the steps did train
    assert _equal(ds2.weights(), ds.weights()) and _equal(ds2.bias_terms(), ds.bias_terms())
    assert _equal(conv2.weights, conv.weights) and _equal(conv2.biases, conv.biases)
    for name, vectors in ds.optimizer_state.items():
        for a, b2 in zip(vectors, ds2.optimizer_state[name], strict=True):
            assert _equal(a, b2), name
    if isinstance(opt, m.Adam):
        assert ds2.optimizer.time_step == opt.time_step == 5


def test_data_source_before_its_first_update(tmp_path) -> None:
    desc = m.ConvolutionDescriptor(1, 1, 2, 2)
    ds = m.TensorConvolutionDataSource(desc, np.ones((2, 1, 1, 2), np.float32))
    ds.training_style = m.TrainingStyle.UPDATE_ON_CPU
    out = _roundtrip(ds, tmp_path)
    assert out.optimizer is None and out.optimizer_state is None and out.bias_terms() is None
    assert out.training_style is m.TrainingStyle.UPDATE_ON_CPU and out.label is None
    assert _equal(out.weights(), ds.weights())


def _bn_step(ds, bn, gen) -> None:
    """Batch statistics, forward and gamma/beta gradients, then the data source's updates
    (gamma/beta by its optimizer, running statistics) and the kernel's reloads."""
    c = ds.number_of_feature_channels
    x = torch.randn(4, c, 3, 3, generator=gen, dtype=torch.float64) * 2 + 1
    g = torch.randn(4, c, 3, 3, generator=gen, dtype=torch.float64)
    dtype = ds.gamma().dtype
    xb, gb = m.ImageBatch.from_tensor(x.to(dtype)), m.ImageBatch.from_tensor(g.to(dtype))
    q = CPU.new_command_queue()
    state = bn.result_state_batch(xb)[0]
    cb = q.command_buffer()
    m.BatchNormalizationStatistics(CPU).encode_batch(cb, xb, state)
    run(cb)
    cb = q.command_buffer()
    bn.encode_batch(cb, xb, state)
    m.BatchNormalizationStatisticsGradient(CPU, bn.fused_neuron_descriptor).encode_batch(
        cb, gb, xb, state
    )
    run(cb)
    assert ds.update_gamma_and_beta_on_cpu(state)
    assert ds.update_mean_and_variance_on_cpu(state)
    bn.reload_gamma_and_beta_from_data_source()
    bn.reload_mean_and_variance_from_data_source()


@pytest.mark.parametrize("kind", ["adam", "momentum", "rmsprop"])
def test_batch_normalization_data_source_continues_training_exactly(tmp_path, kind) -> None:
    gen = torch.Generator().manual_seed(3)
    opt = _make_optimizer(kind)
    ds = m.TensorBatchNormalizationDataSource(
        3, torch.rand(3, generator=gen) + 0.5, torch.randn(3, generator=gen), epsilon=1e-3,
        momentum=0.25, optimizer=opt, label="bn",
    )  # fmt: skip
    relu = m.NeuronDescriptor(m.NeuronType.RELU)
    bn = m.BatchNormalization(CPU, ds, relu)
    for _ in range(3):
        _bn_step(ds, bn, gen)
    loaded = _roundtrip([bn, ds], tmp_path)
    bn2, ds2 = loaded
    assert bn2.data_source is ds2 and type(ds2) is m.TensorBatchNormalizationDataSource
    assert (ds2.epsilon, ds2.momentum, ds2.label) == (1e-3, 0.25, "bn")
    assert bn2.fused_neuron_descriptor == relu and bn2.epsilon == bn.epsilon
    for name in ("gamma", "beta", "mean", "variance"):
        assert _equal(getattr(ds2, name)(), getattr(ds, name)()), name
        assert _equal(getattr(bn2, name), getattr(bn, name)), name
    gens = [torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)]
    before = ds.gamma().clone()
    for _ in range(2):
        _bn_step(ds, bn, gens[0])
        _bn_step(ds2, bn2, gens[1])
    assert not torch.equal(ds.gamma(), before)
    for name in ("gamma", "beta", "mean", "variance"):
        assert _equal(getattr(ds2, name)(), getattr(ds, name)()), name
        assert _equal(getattr(bn2, name), getattr(bn, name)), name
    for a, b in zip(ds.optimizer_state, ds2.optimizer_state, strict=True):
        assert all(_equal(x, y) for x, y in zip(a, b, strict=True))


def _norm_step(ds, kernel, gen) -> None:
    c = ds.number_of_feature_channels
    x = torch.randn(2, c, 3, 4, generator=gen, dtype=torch.float64) * 3 + 2
    g = torch.randn(2, c, 3, 4, generator=gen, dtype=torch.float64)
    xb, gb = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(g)
    grad_kind = (
        m.GroupNormalizationGradient
        if isinstance(kernel, m.GroupNormalization)
        else m.InstanceNormalizationGradient
    )
    cb = CPU.new_command_queue().command_buffer()
    st = kernel.result_state_batch(xb)
    kernel.encode_batch(cb, xb, destination_states=st)
    grad_kind(CPU).encode_batch(cb, gb, xb, st)
    run(cb)
    assert ds.update_gamma_and_beta_on_cpu(st[0])
    kernel.reload_gamma_and_beta_from_data_source()


@pytest.mark.parametrize("kind", ["instance", "group"])
def test_instance_and_group_data_sources_continue_training_exactly(tmp_path, kind) -> None:
    gen = torch.Generator().manual_seed(5)
    gamma = torch.rand(4, generator=gen, dtype=torch.float64) + 0.5
    beta = torch.randn(4, generator=gen, dtype=torch.float64)
    opt = m.Adam(CPU, descriptor=m.OptimizerDescriptor(learning_rate=0.1))
    if kind == "instance":
        ds = m.TensorInstanceNormalizationDataSource(4, gamma, beta, 1e-4, opt, "in")
        kernel = m.InstanceNormalization(CPU, ds)
    else:
        ds = m.TensorGroupNormalizationDataSource(4, 2, gamma, beta, 1e-4, opt, "gn")
        kernel = m.GroupNormalization(CPU, ds)
    kernel.epsilon = 2e-4
    for _ in range(3):
        _norm_step(ds, kernel, gen)
    kernel2 = _roundtrip(kernel, tmp_path)
    ds2 = kernel2.data_source
    assert type(kernel2) is type(kernel) and type(ds2) is type(ds)
    assert (ds2.epsilon, ds2.label, kernel2.epsilon) == (1e-4, ds.label, 2e-4)
    if kind == "group":
        assert ds2.number_of_groups == 2
    gens = [torch.Generator().manual_seed(6), torch.Generator().manual_seed(6)]
    for _ in range(2):
        _norm_step(ds, kernel, gens[0])
        _norm_step(ds2, kernel2, gens[1])
    assert _equal(ds2.gamma(), ds.gamma()) and _equal(ds2.beta(), ds.beta())
    assert _equal(kernel2.gamma, kernel.gamma) and _equal(kernel2.beta, kernel.beta)
    assert ds2.optimizer.time_step == 5
