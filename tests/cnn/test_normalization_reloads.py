"""`reload_normalization_states`: several normalization kernels' gamma/beta and running
statistics reloaded as one command (what a training graph records after its updates), against
each kernel's own reloads; every pair checked before anything changes."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from mpsnn.cnn.normalization.batch_norm_forward import reload_normalization_states
from tests.helpers import DEVICES, run


def _kernels(dev, gen):
    bns = [
        m.BatchNormalization(dev, m.TensorBatchNormalizationDataSource(
            c, torch.randn(c, generator=gen), torch.randn(c, generator=gen)))
        for c in (3, 5)
    ]  # fmt: skip
    inst = m.InstanceNormalization(dev, m.TensorInstanceNormalizationDataSource(
        4, torch.randn(4, generator=gen), torch.randn(4, generator=gen)))  # fmt: skip
    return [*bns, inst]


def _vectors(c, gen):
    return torch.randn(c, generator=gen), torch.rand(c, generator=gen) + 0.5


@pytest.mark.parametrize("device", DEVICES)
def test_one_command_equals_each_kernels_own_reloads(device: str) -> None:
    dev = m.Device(device)
    gen = torch.Generator().manual_seed(7)
    one = _kernels(dev, torch.Generator().manual_seed(1))
    each = _kernels(dev, torch.Generator().manual_seed(1))
    q = dev.new_command_queue()
    cb, cb2 = q.command_buffer(), q.command_buffer()
    pairs, own = [], []
    for a, b in zip(one, each, strict=True):
        c = a.number_of_feature_channels
        g, bt = _vectors(c, gen)
        gb = m.NormalizationGammaAndBetaState(g.to(dev.torch_device), bt.to(dev.torch_device))
        pairs.append((a, gb))
        own.append((b.reload_gamma_and_beta, gb))
        if isinstance(a, m.BatchNormalization):
            mu, var = _vectors(c, gen)
            mv = m.NormalizationMeanAndVarianceState(mu.to(dev.torch_device),
                                                     var.to(dev.torch_device))  # fmt: skip
            pairs.append((a, mv))
            own.append((b.reload_mean_and_variance, mv))
    n = len(cb)
    reload_normalization_states(cb, pairs)
    assert len(cb) == n + 1  # one command for all five reloads
    for reload, state in own:
        reload(cb2, state)
    assert len(cb2) == 5
    # nothing changes until the command runs (work encoded before reads the old values)
    before = [k.gamma.clone() for k in one]
    assert all(torch.equal(k.gamma, b) for k, b in zip(one, before, strict=True))
    run(cb)
    run(cb2)
    for a, b in zip(one, each, strict=True):
        assert torch.equal(a.gamma, b.gamma) and torch.equal(a.beta, b.beta)
        assert not torch.equal(a.gamma, before[one.index(a)])
        if isinstance(a, m.BatchNormalization):
            assert torch.equal(a.mean, b.mean) and torch.equal(a.variance, b.variance)


def test_every_pair_is_checked_before_anything_is_recorded() -> None:
    dev = m.Device("cpu")
    bn, _, inst = _kernels(dev, torch.Generator().manual_seed(2))
    cb = dev.new_command_queue().command_buffer()
    good = m.NormalizationGammaAndBetaState(torch.ones(3), torch.zeros(3), command_buffer=cb)
    wrong = m.NormalizationGammaAndBetaState(torch.ones(3), torch.zeros(3), command_buffer=cb)
    gamma = bn.gamma.clone()
    with pytest.raises(
        ValueError,
        match=r"\[InstanceNormalization\] gamma_and_beta_state must hold 4 channels, got 3",
    ):
        reload_normalization_states(cb, [(bn, good), (inst, wrong)])
    assert len(cb) == 0 and good.read_count == wrong.read_count == 1
    assert torch.equal(bn.gamma, gamma)
    with pytest.raises(TypeError, match=r"\[InstanceNormalization\] gamma_and_beta_state must be"):
        reload_normalization_states(cb, [(inst, object())])
    reload_normalization_states(cb, [])  # nothing to do
    assert len(cb) == 0
    reload_normalization_states(cb, [(bn, good)])  # a temporary state's read is consumed
    assert good.read_count == 0 and len(cb) == 1


def test_a_state_listed_more_often_than_its_read_count_raises_before_anything() -> None:
    dev = m.Device("cpu")
    a, b, _ = _kernels(dev, torch.Generator().manual_seed(3))
    cb = dev.new_command_queue().command_buffer()
    once = m.NormalizationGammaAndBetaState(torch.ones(3), torch.zeros(3), command_buffer=cb)
    with pytest.raises(
        m.StaleResourceError,
        match=r"\[BatchNormalization\] NormalizationGammaAndBetaState must have a read_count of "
        r"at least its 2 reads in one grouped reload, got 1",
    ):
        reload_normalization_states(cb, [(a, once), (a, once)])
    assert len(cb) == 0 and once.read_count == 1
    twice = m.NormalizationGammaAndBetaState(torch.ones(3), torch.zeros(3), command_buffer=cb)
    twice.read_count = 2
    reload_normalization_states(cb, iter([(a, twice), (a, twice)]))  # any iterable
    assert twice.read_count == 0 and len(cb) == 1
    assert b.gamma.shape == (5,)


def test_copies_that_depend_on_each_other_happen_in_list_order() -> None:
    """A source that is another pair's destination (b reloaded from a's masters in the call
    that reloads a) and a destination listed twice: the result of the reloads one by one."""
    dev = m.Device("cpu")
    gen = torch.Generator().manual_seed(4)
    one = _kernels(dev, torch.Generator().manual_seed(1))[0]
    same = _kernels(dev, torch.Generator().manual_seed(1))[0]
    other = [_kernels(dev, torch.Generator().manual_seed(2))[0] for _ in range(2)]
    new = m.NormalizationGammaAndBetaState(*_vectors(3, gen))
    later = m.NormalizationGammaAndBetaState(*_vectors(3, gen))
    q = dev.new_command_queue()
    cb, cb2 = q.command_buffer(), q.command_buffer()
    reload_normalization_states(cb, [
        (one, new), (other[0], m.NormalizationGammaAndBetaState(one.gamma, one.beta)),
        (one, later)])  # fmt: skip
    same.reload_gamma_and_beta(cb2, new)
    other[1].reload_gamma_and_beta(cb2, m.NormalizationGammaAndBetaState(same.gamma, same.beta))
    same.reload_gamma_and_beta(cb2, later)
    run(cb)
    run(cb2)
    assert torch.equal(other[0].gamma, new.gamma) and torch.equal(other[1].gamma, new.gamma)
    assert torch.equal(one.gamma, later.gamma) and torch.equal(one.beta, same.beta)


def test_wrong_kernels_and_kinds_are_refused() -> None:
    dev = m.Device("cpu")
    _, _, inst = _kernels(dev, torch.Generator().manual_seed(5))
    cb = dev.new_command_queue().command_buffer()
    mv = m.NormalizationMeanAndVarianceState(torch.zeros(4), torch.ones(4))
    with pytest.raises(
        TypeError,
        match=r"\[reload_normalization_states\] a mean_and_variance_state must be reloaded into "
        r"a BatchNormalization, got a InstanceNormalization",
    ):
        reload_normalization_states(cb, [(inst, mv)])
    conv = m.Convolution(dev, m.TensorConvolutionDataSource(m.ConvolutionDescriptor(1, 1, 4, 4),
                                                            torch.ones(4, 1, 1, 4)))  # fmt: skip
    gb = m.NormalizationGammaAndBetaState(torch.ones(4), torch.zeros(4))
    with pytest.raises(
        TypeError,
        match=r"\[reload_normalization_states\] each kernel must be a normalization kernel "
        r"\(with gamma and beta\), got a Convolution",
    ):
        reload_normalization_states(cb, [(conv, gb)])
    assert len(cb) == 0


def test_float64_and_float32_masters_in_one_call() -> None:
    dev = m.Device("cpu")
    wide = m.BatchNormalization(dev, m.TensorBatchNormalizationDataSource(
        2, torch.ones(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)))  # fmt: skip
    narrow = _kernels(dev, torch.Generator().manual_seed(6))[0]
    assert wide.gamma.dtype == torch.float64 and narrow.gamma.dtype == torch.float32
    g64 = torch.tensor([0.1, 0.2], dtype=torch.float64)
    cb = dev.new_command_queue().command_buffer()
    reload_normalization_states(cb, [
        (wide, m.NormalizationGammaAndBetaState(g64, g64 * 3)),
        (narrow, m.NormalizationGammaAndBetaState(torch.full((3,), 0.3), torch.zeros(3)))])  # fmt: skip
    run(cb)
    assert torch.equal(wide.gamma, g64) and torch.equal(wide.beta, g64 * 3)
    assert torch.equal(narrow.gamma, torch.full((3,), 0.3))
