"""No kernel's destination shares storage with its inputs, for every family.

Each case encodes a forward kernel and its gradient kernel(s), runs them, then overwrites every
input in place: the results must not change. The cases are keyed by the forward → gradient
registry, so a family added without a case here fails `test_every_registered_pair_has_a_case`.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import mpsnn as m
from mpsnn.core.registry import registered_pairs
from tests.helpers import run

DEV = m.Device("cpu")
GEN = torch.Generator().manual_seed(77)


def _img(*shape: int) -> m.ImageBatch:
    return m.ImageBatch.from_tensor(torch.randn(*shape, generator=GEN, dtype=torch.float64))


def _conv_source(kind: type, desc: m.ConvolutionDescriptor) -> m.TensorConvolutionDataSource:
    w = torch.randn(desc.weights_shape, generator=GEN, dtype=torch.float64)
    return m.TensorConvolutionDataSource(desc, w, torch.randn(desc.output_feature_channels))


def _unary(fwd: m.CNNKernel, grad: m.GradientKernel, shape: tuple[int, ...], result=False):
    def case(cb: m.CommandBuffer) -> tuple[list[m.ImageBatch], list[m.ImageBatch]]:
        x = _img(*shape)
        st = fwd.result_state_batch(x)
        y = fwd.encode_batch(cb, x, destination_states=st)
        g = _img(*y.shape)
        dx = grad.encode_batch(cb, g, y if result else x, st)
        return [x, g], [y, dx]

    return case


def _binary(fwd: type, grad: type, primary_other: bool):
    def case(cb: m.CommandBuffer) -> tuple[list[m.ImageBatch], list[m.ImageBatch]]:
        x, y = _img(2, 3, 4, 4), _img(2, 3, 4, 4).tensor.abs().add(1.0)
        y = m.ImageBatch.from_tensor(y)
        k = fwd(DEV)
        st = k.result_state_batch(x, y)
        z = k.encode_batch(cb, x, y, destination_states=st)
        g = _img(*z.shape)
        dp = grad(DEV, False).encode_batch(cb, g, y if primary_other else x, st)
        ds = grad(DEV, True).encode_batch(cb, g, x if primary_other else y, st)
        return [x, y, g], [z, dp, ds]

    return case


def _batch_norm(cb: m.CommandBuffer) -> tuple[list[m.ImageBatch], list[m.ImageBatch]]:
    x = _img(2, 3, 4, 4)
    ds = m.TensorBatchNormalizationDataSource(3)
    bn = m.BatchNormalization(DEV, ds, m.NeuronDescriptor(m.NeuronType.NONE))
    state = bn.result_state(x[0])
    m.BatchNormalizationStatistics(DEV).encode_batch(cb, x, state)
    y = bn.encode_batch(cb, x, state)
    g = _img(*y.shape)
    m.BatchNormalizationStatisticsGradient(DEV).encode_batch(cb, g, x, state)
    dx = m.BatchNormalizationGradient(DEV).encode_batch(cb, g, x, state)
    return [x, g], [y, dx]


def _conv_case(kind: type, gkind: type, desc: m.ConvolutionDescriptor, shape) -> Callable:
    ds = _conv_source(kind, desc)
    return _unary(kind(DEV, ds), gkind(DEV, ds), shape)


RELU = m.NeuronDescriptor(m.NeuronType.RELU)
CASES: dict[type, Callable] = {
    m.Convolution: _conv_case(
        m.Convolution, m.ConvolutionGradient, m.ConvolutionDescriptor(3, 3, 2, 3), (2, 2, 5, 5)
    ),
    m.FullyConnected: _conv_case(
        m.FullyConnected,
        m.FullyConnectedGradient,
        m.ConvolutionDescriptor(4, 4, 2, 3),
        (2, 2, 4, 4),
    ),
    m.ConvolutionTranspose: _conv_case(
        m.ConvolutionTranspose,
        m.ConvolutionTransposeGradient,
        m.ConvolutionDescriptor(3, 3, 2, 3, stride_in_pixels_x=2, stride_in_pixels_y=2),
        (2, 2, 4, 4),
    ),
    m.PoolingMax: _unary(
        m.PoolingMax(DEV, 2, 2, 2, 2), m.PoolingMaxGradient(DEV, 2, 2, 2, 2), (2, 3, 4, 4)
    ),
    m.PoolingAverage: _unary(
        m.PoolingAverage(DEV, 3, 3), m.PoolingAverageGradient(DEV, 3, 3), (2, 3, 5, 5)
    ),
    m.PoolingL2Norm: _unary(
        m.PoolingL2Norm(DEV, 2, 2, 1, 1), m.PoolingL2NormGradient(DEV, 2, 2, 1, 1), (2, 3, 5, 5)
    ),
    m.DilatedPoolingMax: _unary(
        m.DilatedPoolingMax(DEV, 2, 2, 2, 2),
        m.DilatedPoolingMaxGradient(DEV, 2, 2, 2, 2),
        (2, 3, 6, 6),
    ),
    # NONE is the identity: the case a view could slip through
    m.Neuron: _unary(
        m.Neuron(DEV, m.NeuronDescriptor(m.NeuronType.NONE)),
        m.NeuronGradient(DEV, m.NeuronDescriptor(m.NeuronType.NONE)),
        (2, 3, 4, 4),
    ),
    m.SoftMax: _unary(m.SoftMax(DEV), m.SoftMaxGradient(DEV), (2, 4, 3, 3), result=True),
    m.LogSoftMax: _unary(m.LogSoftMax(DEV), m.LogSoftMaxGradient(DEV), (2, 4, 3, 3), result=True),
    m.Dropout: _unary(
        m.Dropout(DEV, 0.6, seed=4), m.DropoutGradient(DEV, 0.6, seed=4), (2, 3, 4, 4)
    ),
    m.UpsamplingNearest: _unary(
        m.UpsamplingNearest(DEV, 1, 1), m.UpsamplingNearestGradient(DEV, 1, 1), (2, 3, 4, 4)
    ),
    m.UpsamplingBilinear: _unary(
        m.UpsamplingBilinear(DEV, 2, 2), m.UpsamplingBilinearGradient(DEV, 2, 2), (2, 3, 4, 4)
    ),
    # the source's size and the whole region: the identity, where a view could slip through
    m.ResizeBilinear: _unary(
        m.ResizeBilinear(DEV, 4, 4), m.ResizeBilinearGradient(DEV, 4, 4), (2, 3, 4, 4)
    ),
    m.ReduceSpatialMean: _unary(
        m.ReduceSpatialMean(DEV), m.ReduceSpatialMeanGradient(DEV), (2, 3, 4, 4)
    ),
    m.GramMatrixCalculation: _unary(
        m.GramMatrixCalculation(DEV, 0.5), m.GramMatrixCalculationGradient(DEV, 0.5), (2, 3, 4, 4)
    ),
    m.CropAndResizeBilinear: _unary(
        m.CropAndResizeBilinear(DEV, 4, 4, 1, [(0, 0, 1, 1)]),
        m.CropAndResizeBilinearGradient(DEV, 4, 4, 1, [(0, 0, 1, 1)]),
        (2, 3, 4, 4),
    ),
    m.Add: _binary(m.Add, m.AddGradient, False),
    m.Subtract: _binary(m.Subtract, m.SubtractGradient, False),
    m.Multiply: _binary(m.Multiply, m.MultiplyGradient, True),
    m.Divide: _binary(m.Divide, m.DivideGradient, True),
    m.Slice: _unary(m.Slice(DEV), m.SliceGradient(DEV), (2, 3, 4, 4)),
    # the same shape: a reshape that is the identity, where views used to be returned
    m.Reshape: _unary(m.Reshape(DEV, 4, 4, 3), m.ReshapeGradient(DEV), (2, 3, 4, 4)),
    m.Pad: _unary(m.Pad(DEV), m.PadGradient(DEV), (2, 3, 4, 4)),
    m.BatchNormalization: _batch_norm,
    m.InstanceNormalization: _unary(
        m.InstanceNormalization(DEV, m.TensorInstanceNormalizationDataSource(3)),
        m.InstanceNormalizationGradient(DEV),
        (2, 3, 4, 4),
    ),
    m.GroupNormalization: _unary(
        m.GroupNormalization(DEV, m.TensorGroupNormalizationDataSource(4, 2)),
        m.GroupNormalizationGradient(DEV),
        (2, 4, 3, 3),
    ),
    m.CrossChannelNormalization: _unary(
        m.CrossChannelNormalization(DEV, 3),
        m.CrossChannelNormalizationGradient(DEV, 3),
        (2, 4, 3, 3),
    ),
    m.SpatialNormalization: _unary(
        m.SpatialNormalization(DEV, 3, 2), m.SpatialNormalizationGradient(DEV, 3, 2), (2, 3, 4, 4)
    ),
    m.LocalContrastNormalization: _unary(
        m.LocalContrastNormalization(DEV, 3, 3),
        m.LocalContrastNormalizationGradient(DEV, 3, 3),
        (2, 3, 4, 4),
    ),
}


def test_every_registered_pair_has_a_case() -> None:
    # mpsnn's own families (a test module may register a family of its own)
    ours = [f for f, _ in registered_pairs() if f.__module__.startswith("mpsnn.")]
    missing = {f.__name__ for f in ours if f not in CASES}
    assert not missing, f"no aliasing case for {sorted(missing)}"


@pytest.mark.parametrize("forward", list(CASES), ids=lambda c: c.__name__)
def test_results_do_not_share_storage_with_inputs(forward: type) -> None:
    cb = DEV.new_command_queue().command_buffer()
    inputs, outputs = CASES[forward](cb)
    run(cb)
    saved = [o.tensor.clone() for o in outputs]
    for i in inputs:
        i.tensor.fill_(123.0)  # overwrite every input in place
    for o, s in zip(outputs, saved, strict=True):
        assert torch.equal(o.tensor, s), f"a result of {forward.__name__} changed with its input"
        for i in inputs:
            assert o.tensor.untyped_storage().data_ptr() != i.tensor.untyped_storage().data_ptr()
