"""mpsnn.save / mpsnn.load: round trips of every supported object (values bit for bit, types,
properties, shared objects), training that continues exactly after a reload, the dropout mask
sequence continuing, plain checkpoint dicts, every rejection of a bad file with its message,
atomic writes (a failed or killed save leaves the previous file), and the codec table."""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from safetensors import safe_open

import mpsnn as m
from mpsnn.io import register_codec, registered_types
from tests.helpers import run

CPU = m.Device("cpu")
ROOT = Path(__file__).resolve().parent.parent


def _roundtrip(obj, tmp_path: Path, device="cpu"):
    path = tmp_path / "obj.safetensors"
    m.save(obj, path)
    return m.load(path, device)


def _equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bit for bit: same dtype, shape and values (None equals None)."""
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _forward(kernel, x: torch.Tensor) -> torch.Tensor:
    cb = CPU.new_command_queue().command_buffer()
    y = kernel.encode_batch(cb, m.ImageBatch.from_tensor(x))
    run(cb)
    return y.tensor


def _parts(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The structure and the tensors of a saved file."""
    with safe_open(path, "pt") as f:
        structure = json.loads(f.metadata()["mpsnn"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
    return structure, tensors


def _write(path: Path, structure: dict, tensors: dict[str, torch.Tensor]) -> None:
    safetensors.torch.save_file(tensors, path, metadata={"mpsnn": json.dumps(structure)})


def _object(structure: dict, type_name: str) -> dict:
    return next(o for o in structure["objects"] if o["type"] == type_name)


# ---------------------------------------------------------------------------------------------
# descriptors and optimizers


def test_public_api() -> None:
    assert m.save is m.io.save and m.load is m.io.load
    assert issubclass(m.CheckpointError, ValueError)
    assert issubclass(m.CheckpointError, m.MpsnnError)
    names = set(registered_types())
    for cls in (
        m.TensorConvolutionDataSource, m.TensorBatchNormalizationDataSource,
        m.TensorInstanceNormalizationDataSource, m.TensorGroupNormalizationDataSource,
        m.SGD, m.RMSProp, m.Adam, m.Convolution, m.FullyConnected, m.ConvolutionTranspose,
        m.BatchNormalization, m.InstanceNormalization, m.GroupNormalization, m.PoolingMax,
        m.PoolingAverage, m.PoolingL2Norm, m.DilatedPoolingMax, m.Neuron, m.Dropout, m.SoftMax,
        m.LogSoftMax, m.Loss, m.ConvolutionDescriptor, m.NeuronDescriptor, m.LossDescriptor,
        m.OptimizerDescriptor,
    ):  # fmt: skip
        assert cls.__name__ in names


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


# ---------------------------------------------------------------------------------------------
# data sources continue training exactly


def _conv_step(ds, conv, grad, gen, path: str) -> None:
    """One training step of a 3x3 convolution: forward, gradient, the data source's update
    (``cpu``: after completion; ``gpu``: encoded), the kernel's reload."""
    desc = ds.descriptor()
    dtype = ds.weights().dtype
    x = torch.randn(2, desc.input_feature_channels, 5, 5, generator=gen, dtype=torch.float64)
    g = torch.randn(2, desc.output_feature_channels, 5, 5, generator=gen, dtype=torch.float64)
    xb, gb = m.ImageBatch.from_tensor(x.to(dtype)), m.ImageBatch.from_tensor(g.to(dtype))
    cb = CPU.new_command_queue().command_buffer()
    st = conv.result_state_batch(xb)
    conv.encode_batch(cb, xb, destination_states=st)
    grad.encode_batch(cb, gb, xb, st)
    if path == "gpu":
        conv.reload_weights_and_biases(cb, ds.update(cb, st[0], None))
        run(cb)
    else:
        run(cb)
        assert ds.update_on_cpu(st[0], None)
        conv.reload_weights_and_biases_from_data_source()


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
    ds = m.TensorConvolutionDataSource(desc, w, b, optimizer=opt, label="conv1")
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
    assert ds2._state._oihw.is_contiguous()
    if kind == "sgd":
        assert ds2.optimizer_state == {} and ds.optimizer_state == {}
    else:
        assert set(ds2.optimizer_state) == set(ds.optimizer_state) != set()
    for name, vectors in ds.optimizer_state.items():
        for a, b2 in zip(vectors, ds2.optimizer_state[name], strict=True):
            assert _equal(a, b2), name
    for a, b2 in zip(ds._optimizer_state, ds2._optimizer_state, strict=True):
        assert all(x.is_contiguous() and _equal(x, y) for x, y in zip(a, b2, strict=True))
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


# ---------------------------------------------------------------------------------------------
# kernels


def test_convolution_keeps_its_own_weights_and_properties(tmp_path) -> None:
    gen = torch.Generator().manual_seed(7)
    desc = m.ConvolutionDescriptor(3, 3, 2, 3)
    ds = m.TensorConvolutionDataSource(
        desc, torch.randn(desc.weights_shape, generator=gen), torch.randn(3, generator=gen),
        optimizer=m.SGD(CPU, descriptor=m.OptimizerDescriptor(0.5)),
    )  # fmt: skip
    conv, grad = m.Convolution(CPU, ds), m.ConvolutionGradient(CPU, ds)
    xb = m.ImageBatch.from_tensor(torch.randn(1, 2, 5, 5, generator=gen))
    cb = CPU.new_command_queue().command_buffer()
    st = conv.result_state_batch(xb)
    conv.encode_batch(cb, xb, destination_states=st)
    grad.encode_batch(cb, m.ImageBatch.from_tensor(torch.randn(1, 3, 5, 5, generator=gen)), xb, st)
    run(cb)
    assert ds.update_on_cpu(st[0], None)  # the data source moved on; the kernel did not reload
    assert not torch.equal(conv.weights, ds.weights())
    conv2 = _roundtrip(conv, tmp_path)
    assert _equal(conv2.weights, conv.weights) and _equal(conv2.biases, conv.biases)
    assert _equal(conv2.data_source.weights(), ds.weights())
    x = torch.randn(2, 2, 6, 4, generator=gen)
    assert _equal(_forward(conv2, x), _forward(conv, x))


def _configure(k, edge=m.EdgeMode.CLAMP) -> None:
    k.offset = m.Offset(1, -1, 0)
    k.clip_rect = m.Region.make(1, 0, 3, 2, 0, 1)
    k.edge_mode = edge
    k.source_feature_channel_offset = 1
    k.source_feature_channel_max_count = 2
    k.destination_feature_channel_offset = 2
    k.padding = m.DefaultPadding(
        m.PaddingMethod.ALIGN_TOP_LEFT | m.PaddingMethod.SIZE_FULL, label="mine"
    )
    k.label = "layer"
    k.options = m.KernelOptions.ALLOW_REDUCED_PRECISION


_PROPERTIES = (
    "offset", "clip_rect", "edge_mode", "source_feature_channel_offset",
    "source_feature_channel_max_count", "destination_feature_channel_offset", "label", "options",
)  # fmt: skip


def _same_properties(a, b) -> None:
    assert type(a) is type(b)
    for name in _PROPERTIES:
        assert getattr(a, name) == getattr(b, name), name
    assert type(b.padding) is m.DefaultPadding
    assert (a.padding.padding_method, a.padding.label, a.padding._sets_clamp) == (
        b.padding.padding_method, b.padding.label, b.padding._sets_clamp,
    )  # fmt: skip


@pytest.mark.parametrize("kind", [m.Convolution, m.FullyConnected, m.ConvolutionTranspose])
def test_convolution_kernels_round_trip_their_properties(tmp_path, kind) -> None:
    gen = torch.Generator().manual_seed(8)
    desc = m.ConvolutionDescriptor(3, 2, 2, 4)
    if kind is m.Convolution:
        desc = m.ConvolutionDescriptor(3, 3, 4, 6, 2, 1, 1, 2, groups=2)
    ds = m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape, generator=gen))
    k = kind(CPU, ds)
    _configure(k)
    k.accumulator_precision_option = m.ConvolutionAccumulatorPrecisionOption.HALF
    if kind is m.ConvolutionTranspose:
        k.kernel_offset_x, k.kernel_offset_y = 1, -2
    k2 = _roundtrip(k, tmp_path)
    _same_properties(k, k2)
    assert k2.accumulator_precision_option is m.ConvolutionAccumulatorPrecisionOption.HALF
    assert k2.descriptor == k.descriptor and k2.groups == k.groups
    assert _equal(k2.weights, k.weights) and k2.biases is None
    if kind is m.ConvolutionTranspose:
        assert (k2.kernel_offset_x, k2.kernel_offset_y) == (1, -2)
    plain = kind(CPU, ds)  # default properties: the forward must agree
    plain2 = _roundtrip(plain, tmp_path)
    x = torch.randn(2, desc.input_feature_channels, 4, 3, generator=gen)
    assert _equal(_forward(plain2, x), _forward(plain, x))


def test_convolution_biases_the_kernel_and_the_data_source_disagree_on(tmp_path) -> None:
    desc = m.ConvolutionDescriptor(1, 1, 2, 2)
    w = torch.randn(desc.weights_shape)
    gained = m.Convolution(CPU, m.TensorConvolutionDataSource(desc, w))  # no biases yet
    cb = CPU.new_command_queue().command_buffer()
    gained.reload_weights_and_biases(cb, m.ConvolutionWeightsAndBiasesState(w, torch.ones(2)))
    run(cb)
    ds = m.TensorConvolutionDataSource(desc, w)
    lost = m.Convolution(CPU, ds)
    ds.set_weights_and_biases(w, torch.ones(2))  # the data source gains biases, not the kernel
    out = _roundtrip({"gained": gained, "lost": lost}, tmp_path)
    assert out["gained"].data_source.bias_terms() is None
    assert _equal(out["gained"].biases, torch.ones(2))
    assert _equal(out["lost"].data_source.bias_terms(), torch.ones(2))
    assert out["lost"].biases is None


def test_batch_normalization_kernel_keeps_its_own_values(tmp_path) -> None:
    gen = torch.Generator().manual_seed(9)
    ds = m.TensorBatchNormalizationDataSource(
        3, torch.rand(3, generator=gen) + 0.5, torch.randn(3, generator=gen),
        torch.randn(3, generator=gen), torch.rand(3, generator=gen) + 0.5,
    )  # fmt: skip
    bn = m.BatchNormalization(CPU, ds, m.NeuronDescriptor(m.NeuronType.SIGMOID))
    bn.epsilon = 1e-2
    _configure(bn, m.EdgeMode.ZERO)
    ds.gamma().mul_(2)  # the data source changes; the kernel keeps its values until a reload
    ds.mean().add_(1)
    bn2 = _roundtrip(bn, tmp_path)
    _same_properties(bn, bn2)
    assert bn2.epsilon == 1e-2 and bn2.fused_neuron_descriptor == bn.fused_neuron_descriptor
    for name in ("gamma", "beta", "mean", "variance"):
        assert _equal(getattr(bn2, name), getattr(bn, name)), name
        assert _equal(getattr(bn2.data_source, name)(), getattr(ds, name)()), name
    assert not torch.equal(bn2.gamma, bn2.data_source.gamma())
    plain = m.BatchNormalization(CPU, ds)
    plain2 = _roundtrip(plain, tmp_path)
    x = torch.randn(2, 3, 4, 4, generator=gen)
    assert _equal(_forward(plain2, x), _forward(plain, x))  # inference mode


@pytest.mark.parametrize(
    "make",
    [
        lambda: m.PoolingMax(CPU, 3, 3, 2, 2),
        lambda: m.PoolingL2Norm(CPU, 2, 3, 1, 2),
        lambda: m.DilatedPoolingMax(CPU, 2, 2, 2, 3, 1, 2),
        lambda: m.PoolingAverage(CPU, 3, 3, 2, 2),
    ],
    ids=["max", "l2", "dilated", "average"],
)
def test_pooling_kernels_round_trip(tmp_path, make) -> None:
    k = make()
    k.edge_mode = m.EdgeMode.CLAMP
    if isinstance(k, m.PoolingAverage):
        k.zero_pad_size_x, k.zero_pad_size_y = 1, 2
        k.padding = m.DefaultPadding.tensorflow_average_pooling()
    k.label = "pool"
    k2 = _roundtrip(k, tmp_path)
    _same_properties(k, k2)
    for name in (
        "kernel_width", "kernel_height", "stride_in_pixels_x", "stride_in_pixels_y",
        "dilation_rate_x", "dilation_rate_y",
    ):  # fmt: skip
        assert getattr(k2, name) == getattr(k, name), name
    if isinstance(k, m.PoolingAverage):
        assert (k2.zero_pad_size_x, k2.zero_pad_size_y) == (1, 2) and k2.padding._sets_clamp
    x = torch.randn(2, 3, 7, 6, generator=torch.Generator().manual_seed(10))
    assert _equal(_forward(k2, x), _forward(k, x))


def test_neuron_softmax_and_loss_kernels_round_trip(tmp_path) -> None:
    gen = torch.Generator().manual_seed(11)
    prelu = m.Neuron(CPU, m.NeuronDescriptor(m.NeuronType.PRELU, data=[0.1, 0.5, -0.25]))
    elu = m.Neuron(CPU, m.NeuronDescriptor(m.NeuronType.ELU, a=0.7))
    soft, logsoft = m.SoftMax(CPU), m.LogSoftMax(CPU)
    soft.label = "probabilities"
    loss_desc = m.LossDescriptor(
        m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM, weight=0.5, label_smoothing=0.1
    )
    loss = m.Loss(CPU, loss_desc)
    out = _roundtrip([prelu, elu, soft, logsoft, loss], tmp_path)
    for a, b in zip([prelu, elu, soft, logsoft, loss], out, strict=True):
        _same_properties(a, b)
    assert out[0].neuron_descriptor == prelu.neuron_descriptor and out[0].data.device.type == "cpu"
    assert (out[1].neuron_type, out[1].a) == (m.NeuronType.ELU, 0.7)
    assert (out[4].loss_type, out[4].reduction_type, out[4].weight, out[4].label_smoothing) == (
        m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM, 0.5, 0.1,
    )  # fmt: skip
    x = torch.randn(2, 3, 4, 5, generator=gen)
    for a, b in zip([prelu, elu, soft, logsoft], out[:4], strict=True):
        assert _equal(_forward(b, x), _forward(a, x)), type(a).__name__
    labels = torch.softmax(torch.randn(2, 3, 4, 5, generator=gen), 1)
    grads = []
    for k in (loss, out[4]):
        cb = CPU.new_command_queue().command_buffer()
        grads.append(k.encode_batch(cb, m.ImageBatch.from_tensor(x), m.LossLabels(CPU, labels)))
        run(cb)
    assert _equal(grads[0].tensor, grads[1].tensor)


def test_dropout_mask_sequence_continues_after_a_reload(tmp_path) -> None:
    x = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(12))
    k = m.Dropout(CPU, 0.6, seed=17, mask_stride_in_pixels=m.Size(1, 0, 1))
    k.label = "drop"
    earlier = [_forward(k, x) for _ in range(2)]
    k2 = _roundtrip(k, tmp_path)
    _same_properties(k, k2)
    assert (k2.keep_probability, k2.seed, k2.mask_stride_in_pixels) == (0.6, 17, m.Size(1, 0, 1))
    assert _equal(k2._counter, k._counter) and int(k2._counter) == 2
    for _ in range(2):
        y, y2 = _forward(k, x), _forward(k2, x)
        assert _equal(y2, y)
        assert all(not torch.equal(y, e) for e in earlier)  # new masks, not a replay
    fresh = m.Dropout(CPU, 0.6, seed=17, mask_stride_in_pixels=m.Size(1, 0, 1))
    assert _equal(_forward(fresh, x), earlier[0])  # the sequence is the seed's


# ---------------------------------------------------------------------------------------------
# checkpoints: plain values around the objects


def test_a_training_checkpoint_dict(tmp_path) -> None:
    gen = torch.Generator().manual_seed(13)
    adam = m.Adam(CPU, time_step=4)
    desc = m.ConvolutionDescriptor(3, 3, 1, 2)
    ds = m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape), optimizer=adam)
    bnds = m.TensorBatchNormalizationDataSource(2, optimizer=adam)  # one optimizer, shared
    layers = [m.Convolution(CPU, ds), m.BatchNormalization(CPU, bnds), m.SoftMax(CPU)]
    shared = torch.arange(6.0)
    view = torch.randn(4, 3, generator=gen).t()  # not contiguous
    ckpt = {
        "layers": layers,
        "optimizer": adam,
        "epoch": 3,
        "rng": torch.get_rng_state(),
        "lr": 0.1,
        "name": "run é 1",
        "flags": (True, None, 1, 1.0),
        "floats": [math.inf, -math.inf, -0.0, 1e-308],
        "big": 1 << 70,
        "nested": {"empty": {}, "list": [], "tuple": (), "$obj": "a key like a tag"},
        "shared": [shared, shared],
        "view": view,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3, dtype=torch.int32),
        "half": torch.randn(3, generator=gen).to(torch.bfloat16),
        "mask": torch.tensor([True, False]),
    }
    out = _roundtrip(ckpt, tmp_path)
    assert list(out) == list(ckpt)
    conv, bn, soft = out["layers"]
    assert type(conv) is m.Convolution and type(bn) is m.BatchNormalization
    assert type(soft) is m.SoftMax
    assert conv.data_source.optimizer is out["optimizer"] is bn.data_source.optimizer
    assert out["optimizer"].time_step == 4
    assert out["epoch"] == 3 and type(out["epoch"]) is int
    assert out["lr"] == 0.1 and out["name"] == "run é 1"
    assert out["flags"] == (True, None, 1, 1.0) and type(out["flags"]) is tuple
    assert [type(v) for v in out["flags"]] == [bool, type(None), int, float]
    assert out["floats"][:2] == [math.inf, -math.inf]
    assert math.copysign(1, out["floats"][2]) == -1 and out["floats"][3] == 1e-308
    assert out["big"] == 1 << 70
    assert out["nested"] == {"empty": {}, "list": [], "tuple": (), "$obj": "a key like a tag"}
    assert out["shared"][0] is out["shared"][1] and _equal(out["shared"][0], shared)
    for name in ("rng", "view", "scalar", "empty", "half", "mask"):
        assert _equal(out[name], ckpt[name]), name
    nan = _roundtrip({"nan": math.nan}, tmp_path)["nan"]
    assert math.isnan(nan)


@pytest.mark.parametrize("device", ["cpu", m.Device("cpu"), torch.device("cpu")], ids=str)
def test_load_puts_every_tensor_on_the_device(tmp_path, device) -> None:
    desc = m.ConvolutionDescriptor(1, 1, 2, 2)
    opt = m.Adam(CPU)
    w, b = torch.ones(desc.weights_shape), torch.zeros(2)
    ds = m.TensorConvolutionDataSource(desc, w, b, optimizer=opt)
    out = _roundtrip({"conv": m.Convolution(CPU, ds), "t": torch.ones(2)}, tmp_path, device)
    conv = out["conv"]
    assert conv.device == CPU and conv.data_source.optimizer.device == CPU
    tensors = [
        out["t"], conv.weights, conv.biases, conv.data_source.weights(),
        conv.data_source.bias_terms(), conv.data_source.optimizer._hyper,
        conv.data_source.optimizer._step,
    ]  # fmt: skip
    assert all(t.device.type == "cpu" for t in tensors)
    # every tensor owns its memory (none is a view of the file's bytes)
    assert all(t.untyped_storage().resizable() for t in tensors)


def test_loading_never_unpickles(tmp_path, monkeypatch) -> None:
    ds = m.TensorBatchNormalizationDataSource(2, optimizer=m.Adam(CPU))
    path = tmp_path / "ckpt.safetensors"
    m.save({"bn": m.BatchNormalization(CPU, ds), "t": torch.ones(2)}, path)

    def refuse(*args, **kwargs):
        raise AssertionError("load must not unpickle")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    out = m.load(path)
    assert type(out["bn"]) is m.BatchNormalization and _equal(out["t"], torch.ones(2))


# ---------------------------------------------------------------------------------------------
# what save refuses (and then writes nothing)


class _MySource(m.TensorConvolutionDataSource):
    """A subclass: it has no codec of its own, so it cannot be saved as its base."""


class _Policy:
    padding_method = m.PaddingMethod.SIZE_SAME


def test_save_refuses_what_it_cannot_restore(tmp_path) -> None:
    path = tmp_path / "x.safetensors"
    loop: list = []
    loop.append(loop)
    desc = m.ConvolutionDescriptor(1, 1, 1, 1)
    conv = m.Convolution(CPU, m.TensorConvolutionDataSource(desc, torch.ones(1, 1, 1, 1)))
    conv.padding = _Policy()
    cases = [
        ({"a": np.zeros(2)}, TypeError, r"\[save\] values must be None, bool, int, float, str, list, tuple, dict, tensors or objects of a registered type \(.*\), got ndarray at root\.a"),
        ({1: 2}, TypeError, r"\[save\] dict keys must be str, got int 1 at root"),
        ([m.LossType.HINGE], TypeError, r"got LossType at root\.0"),
        ({"x": loop}, ValueError, r"\[save\] values must not contain themselves, got a list inside itself at root\.x\.0"),
        (conv, TypeError, r"\[save\] Convolution\.padding must be a DefaultPadding to be saved \(a custom policy is code\), got _Policy"),
        ({"ds": _MySource(desc, torch.ones(1, 1, 1, 1))}, TypeError, r"\[save\] objects must be of a registered type \(see mpsnn\.io\.register_codec\), got _MySource at root\.ds"),
        (torch.zeros(2, dtype=torch.complex64), TypeError, r"\[save\] tensors must have one of the dtypes float64, float32, .*, got complex64"),
    ]  # fmt: skip
    for value, error, message in cases:
        with pytest.raises(error, match=message):
            m.save(value, path)
    assert list(tmp_path.iterdir()) == []  # nothing written, no temporary file left


# ---------------------------------------------------------------------------------------------
# what load rejects


@pytest.fixture
def saved(tmp_path) -> Path:
    """A small checkpoint: a data source with biases and Adam, a dropout, a number."""
    desc = m.ConvolutionDescriptor(1, 1, 2, 2)
    opt = m.Adam(CPU)
    w = torch.randn(desc.weights_shape)
    ds = m.TensorConvolutionDataSource(desc, w, torch.zeros(2), optimizer=opt)
    path = tmp_path / "ckpt.safetensors"
    m.save({"ds": ds, "drop": m.Dropout(CPU, 0.5, seed=3), "epoch": 3}, path)
    return path


def _header_size(path: Path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def test_truncated_files_are_rejected(saved) -> None:
    data = saved.read_bytes()
    n, size = _header_size(saved), len(data)
    assert m.load(saved)["epoch"] == 3
    cases = [
        (0, r"the file must be a safetensors file \(at least 8 bytes\), got 0 bytes"),
        (5, r"the file must be a safetensors file \(at least 8 bytes\), got 5 bytes"),
        (8, rf"the safetensors header must fit in the file \({n} bytes announced after the first 8\), got a file of 8 bytes \(truncated, or not safetensors\)"),
        (8 + n // 2, r"the safetensors header must fit in the file .* \(truncated, or not safetensors\)"),
        (8 + n, rf"the file must hold exactly the {size - 8 - n} bytes of tensor data its header announces, got 0 \(truncated\)"),
        ((8 + n + size) // 2, r"the file must hold exactly the \d+ bytes of tensor data its header announces, got \d+ \(truncated\)"),
        (size - 1, rf"the file must hold exactly the {size - 8 - n} bytes of tensor data its header announces, got {size - 9 - n} \(truncated\)"),
    ]  # fmt: skip
    for cut, message in cases:
        saved.write_bytes(data[:cut])
        with pytest.raises(m.CheckpointError, match=r"\[load\] " + message):
            m.load(saved)
    saved.write_bytes(data + b"\0\0")
    with pytest.raises(
        m.CheckpointError,
        match=rf"\[load\] the file must hold exactly the {size - 8 - n} bytes of tensor data its header announces, got {size - 6 - n}$",
    ):
        m.load(saved)


def test_files_with_a_wrong_header_are_rejected(tmp_path) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"this is a text file, not a checkpoint at all")
    with pytest.raises(
        m.CheckpointError, match=r"\[load\] the safetensors header must fit in the file"
    ):
        m.load(path)
    path.write_bytes(struct.pack("<Q", 8) + b"not json")
    with pytest.raises(
        m.CheckpointError, match=r"\[load\] the safetensors header must be UTF-8 JSON, got"
    ):
        m.load(path)
    path.write_bytes(struct.pack("<Q", 2) + b"[]")
    with pytest.raises(
        m.CheckpointError, match=r"\[load\] the safetensors header must be a JSON object, got \[\]"
    ):
        m.load(path)
    safetensors.torch.save_file({"a": torch.zeros(2)}, path)  # safetensors, but not ours
    with pytest.raises(
        m.CheckpointError,
        match=r"\[load\] the safetensors header's __metadata__ must hold the key 'mpsnn' \(a string\), got null",
    ):
        m.load(path)
    safetensors.torch.save_file({}, path, metadata={"mpsnn": "{not json"})
    with pytest.raises(m.CheckpointError, match=r"\[load\] the 'mpsnn' metadata must be JSON, got"):
        m.load(path)
    safetensors.torch.save_file(
        {},
        path,
        metadata={"mpsnn": '{"format": "mpsnn", "version": 1, "root": NaN, "objects": []}'},
    )
    with pytest.raises(
        m.CheckpointError, match=r"\[load\] the 'mpsnn' metadata must be JSON, got NaN is not JSON"
    ):
        m.load(path)
    safetensors.torch.save_file({}, path, metadata={"mpsnn": "[1, 2]"})
    with pytest.raises(
        m.CheckpointError,
        match=r"\[load\] the 'mpsnn' metadata must be a JSON object, got \[1, 2\]",
    ):
        m.load(path)


def _rewrite(path: Path, edit) -> None:
    structure, tensors = _parts(path)
    edit(structure, tensors)
    _write(path, structure, tensors)


def _weights_name(structure: dict) -> str:
    return _object(structure, "TensorConvolutionDataSource")["fields"]["weights"]["$tensor"]


def _set(obj: dict, key: str, value) -> None:
    obj[key] = value


_STRUCTURE_CASES = {
    "format": (
        lambda s, t: _set(s, "format", "pickle"),
        r"the format must be 'mpsnn', got 'pickle'",
    ),
    "version": (
        lambda s, t: _set(s, "version", 2),
        r"the format version must be 1 \(this mpsnn reads version 1 only\), got 2",
    ),
    "no version": (
        lambda s, t: s.pop("version"),
        r"the structure must state its version, got none",
    ),
    "missing key": (
        lambda s, t: s.pop("objects"),
        r"the structure must have exactly the keys \['format', 'objects', 'root', 'version'\], got \['format', 'root', 'version'\]",
    ),
    "unknown type": (
        lambda s, t: _set(s["objects"][0], "type", "builtins.eval"),
        r"object 0's type must be a registered type \(Adam, .*\), got 'builtins.eval'",
    ),
    "extra tensor": (
        lambda s, t: _set(t, "extra", torch.zeros(3)),
        r"the file must hold only the tensors its structure references, got unreferenced tensors \['extra'\]",
    ),
    "missing tensor": (
        lambda s, t: t.pop(_weights_name(s)),
        r"tensor '0\.TensorConvolutionDataSource\.weights' \(referenced by object \d+ \(TensorConvolutionDataSource\)\.weights\) must be in the file, got none",
    ),
    "dtype in the file": (
        lambda s, t: _set(t, _weights_name(s), t[_weights_name(s)].double()),
        r"tensor '0\.TensorConvolutionDataSource\.weights' must be float32 of shape \[2, 1, 1, 2\] as the structure states, got float64 of shape \[2, 1, 1, 2\]",
    ),
    "shape in the file": (
        lambda s, t: _set(t, _weights_name(s), t[_weights_name(s)].reshape(2, 2)),
        r"tensor '0\.TensorConvolutionDataSource\.weights' must be float32 of shape \[2, 1, 1, 2\] as the structure states, got float32 of shape \[2, 2\]",
    ),
    "forward reference": (
        lambda s, t: _set(_object(s, "TensorConvolutionDataSource")["fields"], "optimizer", {"$obj": 99}),
        r"object \d+ \(TensorConvolutionDataSource\)\.optimizer must reference an object before it \(index < \d+\), got \{\"\$obj\": 99\}",
    ),
    "unreferenced object": (
        lambda s, t: s["objects"].append(json.loads(json.dumps(s["objects"][0]))),
        r"every object must be referenced, got unreferenced objects \[\d+\]",
    ),
    "bad tag": (
        lambda s, t: _set(s["root"]["$dict"], "epoch", {"$eval": "1 + 1"}),
        r"root\.epoch must be null, a boolean, a number, a string, a list or a tagged object \(\$obj, \$tensor, \$dict, \$tuple, \$float\), got \{\"\$eval\": \"1 \+ 1\"\}",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_STRUCTURE_CASES))
def test_files_with_a_wrong_structure_are_rejected(saved, case) -> None:
    edit, message = _STRUCTURE_CASES[case]
    _rewrite(saved, edit)
    with pytest.raises(m.CheckpointError, match=r"\[load\] " + message):
        m.load(saved)


def _fields(structure: dict, type_name: str) -> dict:
    return _object(structure, type_name)["fields"]


def _retype(s: dict, t: dict, dtype: torch.dtype) -> None:
    ref = _fields(s, "TensorConvolutionDataSource")["weights"]
    t[ref["$tensor"]] = t[ref["$tensor"]].to(dtype)
    ref["dtype"] = str(dtype).removeprefix("torch.")


def _reshape_counter(s: dict, t: dict) -> None:
    ref = _fields(s, "Dropout")["counter"]
    t[ref["$tensor"]] = torch.zeros(2, dtype=torch.int64)
    ref["shape"] = [2]


def _swap_optimizer(s: dict, t: dict) -> None:
    """The data source's optimizer becomes the Adam's descriptor (Adam stays referenced)."""
    fields = _fields(s, "TensorConvolutionDataSource")
    s["root"]["$dict"]["adam"] = fields["optimizer"]
    fields["optimizer"] = _fields(s, "Adam")["descriptor"]


_FIELD_CASES = {
    "missing field": (
        lambda s, t: _fields(s, "Dropout").pop("seed"),
        r"object \d+ \(Dropout\) must have the field 'seed', got the fields \[.*\]",
    ),
    "extra field": (
        lambda s, t: _set(_fields(s, "Dropout"), "evil", 1),
        r"object \d+ \(Dropout\) must have only the fields its type reads, got also \['evil'\]",
    ),
    "wrong field type": (
        lambda s, t: _set(_fields(s, "Dropout"), "seed", "x"),
        r"object \d+ \(Dropout\) field 'seed' must be an int >= 0, got 'x'",
    ),
    "wrong enum name": (
        lambda s, t: _set(_fields(s, "Dropout"), "edge_mode", "WRAP"),
        r"object \d+ \(Dropout\) field 'edge_mode' must be one of the EdgeMode names \(ZERO, CLAMP, .*\), got 'WRAP'",
    ),
    "wrong object type": (
        _swap_optimizer,
        r"object \d+ \(TensorConvolutionDataSource\) field 'optimizer' must be an instance of Optimizer, got OptimizerDescriptor",
    ),
    "invalid value": (
        lambda s, t: _set(_fields(s, "Dropout"), "keep_probability", 1.5),
        r"object \d+ \(Dropout\) must be rebuildable from its fields, got ValueError: \[Dropout\] keep_probability must be in \(0, 1\), got 1\.5",
    ),
    "wrong dtype": (
        lambda s, t: _retype(s, t, torch.float16),
        r"object \d+ \(TensorConvolutionDataSource\) field 'weights' must have the dtype float32 or float64, got float16",
    ),
    "wrong shape": (
        _reshape_counter,
        r"object \d+ \(Dropout\) field 'counter' must have the shape \[1\], got \[2\]",
    ),
    "optimizer state names": (
        lambda s, t: _set(_fields(s, "TensorConvolutionDataSource"), "optimizer_state", {"momentum": []}),
        r"object \d+ \(TensorConvolutionDataSource\) field 'optimizer_state' must map the optimizer's state vectors \['momentum', 'velocity'\] to lists, got",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(_FIELD_CASES))
def test_files_with_wrong_fields_are_rejected(saved, case) -> None:
    edit, message = _FIELD_CASES[case]
    _rewrite(saved, edit)
    with pytest.raises(m.CheckpointError, match=r"\[load\] " + message):
        m.load(saved)


def test_optimizer_state_of_the_wrong_dtype_is_rejected(tmp_path) -> None:
    desc = m.ConvolutionDescriptor(1, 1, 2, 2)
    w = torch.randn(desc.weights_shape)
    ds = m.TensorConvolutionDataSource(desc, w, torch.zeros(2), optimizer=m.SGD(CPU, 0.9))
    conv, grad = m.Convolution(CPU, ds), m.ConvolutionGradient(CPU, ds)
    _conv_step(ds, conv, grad, torch.Generator().manual_seed(0), "cpu")
    path = tmp_path / "ckpt.safetensors"
    m.save(ds, path)

    def edit(s, t):
        ref = _fields(s, "TensorConvolutionDataSource")["optimizer_state"]["momentum"][1]
        t[ref["$tensor"]] = t[ref["$tensor"]].double()
        ref["dtype"] = "float64"

    _rewrite(path, edit)
    with pytest.raises(
        m.CheckpointError,
        match=r"\[load\] object \d+ \(TensorConvolutionDataSource\) field 'optimizer_state\.momentum\.1' must have the dtype float32, got float64",
    ):
        m.load(path)


# ---------------------------------------------------------------------------------------------
# atomic writes


def _only_the_file(path: Path) -> None:
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_a_failed_rename_leaves_the_previous_file(saved, monkeypatch) -> None:
    before = saved.read_bytes()

    def fail(*args, **kwargs):
        raise OSError("rename failed")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="rename failed"):
        m.save({"epoch": 4}, saved)
    monkeypatch.undo()
    assert saved.read_bytes() == before and m.load(saved)["epoch"] == 3
    _only_the_file(saved)


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_write_interrupted_midway_leaves_the_previous_file(saved, monkeypatch, error) -> None:
    before = saved.read_bytes()
    real_write = os.write
    calls = []

    def write_half_then_fail(fd, data):
        calls.append(len(data))
        real_write(fd, bytes(data[: len(data) // 2]))
        raise error

    monkeypatch.setattr(os, "write", write_half_then_fail)
    big = {"epoch": 4, "t": torch.randn(1000)}
    with pytest.raises(type(error)):
        m.save(big, saved)
    monkeypatch.undo()
    assert calls, "the save must have started writing"
    assert saved.read_bytes() == before and m.load(saved)["epoch"] == 3
    _only_the_file(saved)
    m.save(big, saved)  # and a later save succeeds
    assert m.load(saved)["epoch"] == 4
    _only_the_file(saved)


def test_a_process_killed_mid_save_leaves_the_previous_file(saved) -> None:
    before = saved.read_bytes()
    script = (
        "import os, signal, torch, mpsnn\n"
        "os.replace = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"mpsnn.save({{'epoch': 5, 't': torch.ones(100)}}, {str(saved)!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    assert saved.read_bytes() == before and m.load(saved)["epoch"] == 3
    stray = [p.name for p in saved.parent.iterdir() if p != saved]
    assert len(stray) == 1 and stray[0].startswith(f".{saved.name}.")
    assert stray[0].endswith(".tmp")
    assert m.load(saved.parent / stray[0])["epoch"] == 5  # complete, just never renamed


def test_saving_replaces_and_creates_files(tmp_path) -> None:
    path = tmp_path / "new.safetensors"
    m.save(1, path)
    m.save("two", str(path))
    assert m.load(str(path)) == "two"
    _only_the_file(path)


# ---------------------------------------------------------------------------------------------
# the codec table


class _Point:
    def __init__(self, x: float, values: torch.Tensor, parent: _Point | None = None) -> None:
        self.x, self.values, self.parent = x, values, parent


def _encode_point(p: _Point, enc) -> dict:
    return {"x": p.x, "values": enc.tensor(p.values, "values"), "parent": enc.object(p.parent)}


def _decode_point(f) -> _Point:
    return _Point(
        f.get_float("x"),
        f.get_tensor("values", dtypes=(torch.float32,)),
        f.get_object("parent", _Point, optional=True),
    )


register_codec(_Point, _encode_point, _decode_point, name="tests.Point")


def test_registered_codecs_round_trip(tmp_path) -> None:
    assert registered_types()["tests.Point"] is _Point
    root = _Point(1.5, torch.ones(2))
    child = _Point(math.inf, torch.arange(3.0), root)
    out = _roundtrip({"child": child, "root": root}, tmp_path)
    assert type(out["child"]) is _Point and out["child"].parent is out["root"]
    assert out["child"].x == math.inf and _equal(out["child"].values, torch.arange(3.0))


def test_register_codec_errors() -> None:
    with pytest.raises(
        ValueError, match=r"\[register_codec\] a class must be registered once, got _Point again"
    ):
        register_codec(_Point, _encode_point, _decode_point, name="other")
    other = type("Other", (), {})
    with pytest.raises(
        ValueError,
        match=r"\[register_codec\] a name must be registered once, got 'tests.Point' again \(registered for _Point\)",
    ):
        register_codec(other, _encode_point, _decode_point, name="tests.Point")
    with pytest.raises(TypeError, match=r"\[register_codec\] cls must be a class, got str"):
        register_codec("Point", _encode_point, _decode_point)
    with pytest.raises(
        TypeError,
        match=r"\[register_codec\] encode and decode must be callable, got NoneType and function",
    ):
        register_codec(other, None, _decode_point)
    assert "Other" not in registered_types()
