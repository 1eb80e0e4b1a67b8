"""``encode_batch`` of every kernel family takes a sequence of `Image` s as well as an
`ImageBatch` (MPS's ``MPSImageBatch`` is an array of images), including the kernels that
override ``encode_batch`` (arithmetic, batch normalization, loss, reductions); a failed encode
records nothing."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m

DEV = m.Device("cpu")
F64 = torch.float64


def _rand(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=F64)


def _separate(t: torch.Tensor) -> list[m.Image]:
    """Each image of ``t`` in its own permanent image (a copy: not views of one batch)."""
    return [m.Image.from_tensor(t[i : i + 1].clone()) for i in range(t.shape[0])]


def _run(encode) -> torch.Tensor:
    cb = DEV.new_command_queue().command_buffer()
    out = encode(cb)
    cb.commit()
    cb.wait_until_completed()
    return out


def test_arithmetic_takes_lists() -> None:
    g = torch.Generator().manual_seed(1)
    a, b = _rand(g, 3, 2, 4, 5), _rand(g, 3, 2, 4, 5)
    add = m.Add(DEV)
    ref = _run(lambda cb: add.encode_batch(cb, m.ImageBatch.from_tensor(a),
                                           m.ImageBatch.from_tensor(b))).tensor  # fmt: skip
    got = _run(lambda cb: add.encode_batch(cb, _separate(a), list(m.ImageBatch.from_tensor(b))))
    assert torch.equal(got.tensor, ref)
    assert torch.allclose(ref, a + b)


def test_batch_normalization_statistics_and_forward_take_lists() -> None:
    g = torch.Generator().manual_seed(2)
    x = _rand(g, 4, 3, 5, 5) * 2 + 1
    ds = m.TensorBatchNormalizationDataSource(3, gamma=_rand(g, 3), beta=_rand(g, 3))
    bn, stats = m.BatchNormalization(DEV, ds), m.BatchNormalizationStatistics(DEV)

    def step(source) -> torch.Tensor:
        state = bn.result_state_batch(m.ImageBatch.from_tensor(x))
        state = state[0] if isinstance(state, list | m.StateBatch) else state

        def encode(cb):
            stats.encode_batch(cb, source, state)
            return bn.encode_batch(cb, source, state)

        return _run(encode).tensor

    ref = step(m.ImageBatch.from_tensor(x))
    got = step(_separate(x))
    assert torch.equal(got, ref)
    mean, var = x.mean((0, 2, 3), keepdim=True), x.var((0, 2, 3), unbiased=False, keepdim=True)
    gamma, beta = ds.gamma().view(1, 3, 1, 1), ds.beta().view(1, 3, 1, 1)
    expected = (x - mean) / torch.sqrt(var + ds.epsilon) * gamma.to(F64) + beta.to(F64)
    assert torch.allclose(ref, expected, atol=1e-5)


def test_loss_takes_lists() -> None:
    g = torch.Generator().manual_seed(3)
    y = _rand(g, 3, 4, 1, 1)
    labels = torch.randint(0, 4, (3, 1, 1), generator=g)
    desc = m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM)
    loss = m.Loss(DEV, desc)

    def step(source) -> torch.Tensor:
        lab = [m.LossLabels(DEV, labels[i : i + 1]) for i in range(3)]
        return _run(lambda cb: loss.encode_batch(cb, source, lab)).tensor

    ref = step(m.ImageBatch.from_tensor(y))
    assert torch.equal(step(_separate(y)), ref)


def test_a_failed_encode_of_a_list_records_nothing() -> None:
    g = torch.Generator().manual_seed(4)
    a = _separate(_rand(g, 2, 2, 4, 5))
    wrong = _separate(_rand(g, 2, 3, 4, 5))  # other channel count: the addition refuses
    add = m.Add(DEV)
    cb = DEV.new_command_queue().command_buffer()
    with pytest.raises(ValueError, match=r"\[Add\]"):
        add.encode_batch(cb, a, wrong)
    assert len(cb) == 0
    stats = m.BatchNormalizationStatistics(DEV)
    ds = m.TensorBatchNormalizationDataSource(3)
    state = m.BatchNormalization(DEV, ds).result_state_batch(m.ImageBatch(a[0]))
    state = state[0] if isinstance(state, list | m.StateBatch) else state
    with pytest.raises(ValueError, match=r"\[BatchNormalizationStatistics\]"):
        stats.encode_batch(cb, a, state)  # 2 channels read, the state has 3
    assert len(cb) == 0
