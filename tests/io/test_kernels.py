"""Round trips of kernels: their own values (a convolution's master weights, the
normalizations' copies), their configuration, the forward they compute, and the dropout mask
sequence continuing."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from tests.helpers import run
from tests.io._helpers import CPU, _equal, _forward, _roundtrip


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
