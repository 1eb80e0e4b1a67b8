"""Batch normalization hands its per-channel arguments to the math as frozen records
(`BatchNormParams`, `BatchNormSums`), built from the forward's record and the state's storage;
the public kernels keep their signatures."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import mpsnn as m
from mpsnn.cnn.normalization import batch_norm_forward, batch_norm_gradient
from mpsnn.cnn.normalization.batch_norm_forward import BatchNormalizationRecord
from mpsnn.cnn.normalization.data_sources import _AffineArguments
from mpsnn.cnn.normalization.group_norm import GroupNormalizationRecord
from mpsnn.ops.batch_norm import bn_backward, bn_forward, bn_gradient_sums
from mpsnn.ops.batch_norm_params import BatchNormParams, BatchNormSums
from tests.helpers import run

DEV = m.Device("cpu")
RECORDS = [BatchNormParams, BatchNormSums, BatchNormalizationRecord, GroupNormalizationRecord,
           _AffineArguments]  # fmt: skip


@pytest.mark.parametrize("cls", RECORDS, ids=lambda c: c.__name__)
def test_the_records_are_frozen_and_slotted(cls) -> None:
    assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen
    assert "__slots__" in vars(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    record = cls(*[None] * len(fields))
    assert not hasattr(record, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(record, fields[-1], 1.0)


def test_the_kernels_pass_one_record_holding_the_state_storage(monkeypatch) -> None:
    """The forward, the statistics gradient and the gradient each hand the math one
    `BatchNormParams` whose mean and variance are the state's storage (what the statistics
    wrote), gamma/beta the kernel's masters, epsilon and the fused neuron's parameters; the
    gradient adds one `BatchNormSums` of the state's gradient sums and count."""
    c = 3
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, c, 4, 4, generator=gen, dtype=torch.float64)
    g = torch.randn(2, c, 4, 4, generator=gen, dtype=torch.float64)
    gamma, beta = torch.rand(c, dtype=torch.float64) + 0.5, torch.randn(c, dtype=torch.float64)
    relu = m.NeuronDescriptor(m.NeuronType.RELU, a=0.2)
    ds = m.TensorBatchNormalizationDataSource(c, gamma, beta, epsilon=0.01)
    bn = m.BatchNormalization(DEV, ds, relu)
    seen: list[tuple] = []

    def spy(name, fn):
        def call(*args):
            seen.append((name, args))
            return fn(*args)

        return call

    monkeypatch.setattr(batch_norm_forward, "bn_forward", spy("forward", bn_forward))
    monkeypatch.setattr(batch_norm_gradient, "bn_gradient_sums", spy("sums", bn_gradient_sums))
    monkeypatch.setattr(batch_norm_gradient, "bn_backward", spy("backward", bn_backward))
    src, gb = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(g)
    state = bn.result_state(src[0])
    cb = DEV.new_command_queue().command_buffer()
    m.BatchNormalizationStatistics(DEV).encode_batch(cb, src, state)
    bn.encode_batch(cb, src, state)
    m.BatchNormalizationStatisticsGradient(DEV, relu).encode_batch(cb, gb, src, state)
    m.BatchNormalizationGradient(DEV, relu).encode_batch(cb, gb, src, state)
    run(cb)
    assert [name for name, _ in seen] == ["forward", "sums", "backward"]
    for name, args in seen:
        p = args[-2] if name == "backward" else args[-1]
        assert isinstance(p, BatchNormParams), name
        assert p.mean is state.mean and p.var is state.variance, name
        assert p.gamma is bn.gamma and p.beta is bn.beta and p.eps == 0.01, name
        assert p.neuron == relu.params, name
    sums = seen[-1][1][-1]
    assert isinstance(sums, BatchNormSums)
    assert sums.sum_gy is state.gradient_for_beta and sums.sum_gy_xhat is state.gradient_for_gamma
    assert torch.equal(torch.as_tensor(sums.count), torch.tensor([x[:, 0].numel()], dtype=x.dtype))


def test_the_public_kernels_keep_their_signatures() -> None:
    def names(fn) -> list[str]:
        return list(inspect.signature(fn).parameters)

    assert names(m.BatchNormalization) == ["device", "data_source", "fused_neuron_descriptor"]
    assert names(m.BatchNormalization.encode_batch) == [
        "self", "command_buffer", "source_images", "batch_normalization_state",
        "destination_images",
    ]  # fmt: skip
    assert names(m.BatchNormalizationStatistics.encode_batch) == [
        "self", "command_buffer", "source_images", "batch_normalization_state",
    ]  # fmt: skip
    assert names(m.BatchNormalizationGradient.encode_batch) == [
        "self", "command_buffer", "source_gradients", "source_images",
        "batch_normalization_state", "destination_gradients",
    ]  # fmt: skip
    assert names(m.TensorBatchNormalizationDataSource) == [
        "number_of_feature_channels", "gamma", "beta", "mean", "variance", "epsilon",
        "momentum", "optimizer", "label",
    ]  # fmt: skip
    assert names(m.BatchNormalization.reload_mean_and_variance) == [
        "self", "command_buffer", "mean_and_variance_state",
    ]  # fmt: skip
