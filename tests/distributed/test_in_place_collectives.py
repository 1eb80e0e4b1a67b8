"""The collectives of a synchronized batch normalization run in place on the buffer its
kernels wrote a layer's vectors into (`_adjacent`), and copy the vectors otherwise. The
exchanges run through `_StepCollectives` with a stand-in for the process group, on the fast
paths (CUDA, or Triton's interpreter on the CPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import mpsnn as m
from mpsnn.distributed.collectives import _adjacent, _StepCollectives
from mpsnn.distributed.data_parallel import DataParallel
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.batch_norm import bn_statistics_portable
from tests.helpers import assert_close, run


def test_pieces_of_one_buffer_in_order_give_one_view_of_it() -> None:
    out = torch.arange(7.0)
    count, mean, m2 = out[:1], out[1:4], out[4:7]
    whole = _adjacent([count, mean, m2])
    assert whole is not None and torch.equal(whole, out)
    whole.mul_(2)  # a collective's in-place result lands in the pieces
    assert torch.equal(mean, torch.tensor([2.0, 4.0, 6.0]))
    # the gradient sums' rows, listed in reverse: in any order only when asked
    sums = torch.arange(6.0).view(2, 3)
    assert _adjacent([sums[1], sums[0]]) is None
    flat = _adjacent([sums[1], sums[0]], ordered=False)
    assert flat is not None and flat.data_ptr() == sums.data_ptr() and flat.numel() == 6


def test_anything_else_is_refused() -> None:
    out = torch.arange(8.0)
    assert _adjacent([out[:2], out[3:5]]) is None  # a gap
    assert _adjacent([out[:2], out[1:3]]) is None  # an overlap
    assert _adjacent([torch.zeros(2), torch.zeros(3)]) is None  # two storages
    assert _adjacent([out[:2], out.view(2, 4)[:, 2]]) is None  # not contiguous
    mixed = torch.zeros(4, dtype=torch.float32)
    assert _adjacent([mixed[:2], mixed[2:].view(torch.int32)]) is None  # two dtypes


@pytest.fixture
def fast_device(monkeypatch) -> m.Device:
    """A device whose batch-normalization statistics take the Triton kernels: CUDA, or the CPU
    with the kernels run by Triton's interpreter (the tests' setting without a GPU)."""
    if torch.cuda.is_available():
        return m.Device("cuda")
    monkeypatch.setattr(fast_paths, "_runs", lambda *tensors: fast_paths.enabled())
    return m.Device("cpu")


def _layer(dev: m.Device, c: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(6, c, 4, 5, generator=gen) * 2 + 0.5).to(dev.torch_device)
    g = torch.randn(6, c, 4, 5, generator=gen).to(dev.torch_device)
    ds = m.TensorBatchNormalizationDataSource(c, torch.rand(c, generator=gen) + 0.5,
                                              torch.randn(c, generator=gen))  # fmt: skip
    return x, g, m.BatchNormalizationStatistics(dev), m.BatchNormalization(dev, ds)


def test_the_statistics_all_gather_reads_the_kernels_buffer(fast_device) -> None:
    x, _, stats, bn = _layer(fast_device)
    x0, x1 = x[:4], x[4:]
    count, mean, m2 = bn_statistics_portable(x1)  # the other rank's part
    other = torch.cat([count, mean, m2])
    seen = []

    def all_gather(what: str, packed: torch.Tensor) -> torch.Tensor:
        seen.append(packed)
        return torch.stack([packed, other])

    dp = SimpleNamespace(world_size=2, sync_batch_norm=True, _all_gather=all_gather)
    src = m.ImageBatch.from_tensor(x0)
    state = bn.result_state(src[0])
    cb = fast_device.new_command_queue().command_buffer()
    hooks = _StepCollectives(dp, SimpleNamespace(cb=cb))
    stats.encode_batch(cb, src, state)
    hooks.batch_norm_statistics(None, state)
    run(cb)
    (packed,) = seen
    sums = state._slots[0]
    assert packed.data_ptr() == sums[0].data_ptr() and packed.numel() == 7  # no packing copy
    assert_close(sums[1], x.mean((0, 2, 3)), "merged mean", tol=1e-5)
    assert_close(state.variance, x.var((0, 2, 3), unbiased=False), "merged variance", tol=1e-5)
    assert float(sums[0].reshape(-1)[0]) == 6 * 4 * 5


def test_the_gradient_sums_are_all_reduced_in_their_own_buffer(fast_device) -> None:
    x, g, stats, bn = _layer(fast_device, seed=1)
    src, gb = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(g)
    reduced = []

    def sum_now(what: str, flat: torch.Tensor) -> None:
        reduced.append(flat)
        flat.mul_(2.0)  # another rank with the same sums

    dp = SimpleNamespace(world_size=2, sync_batch_norm=True, _sum_now=sum_now,
                         _collective=lambda what, fn: fn())  # fmt: skip
    q = fast_device.new_command_queue()
    sums = []
    for hooked in (False, True):
        state = bn.result_state(src[0])
        cb = q.command_buffer()
        stats.encode_batch(cb, src, state)
        bn.encode_batch(cb, src, state)
        m.BatchNormalizationStatisticsGradient(fast_device).encode_batch(cb, gb, src, state)
        if hooked:
            _StepCollectives(dp, SimpleNamespace(cb=cb)).batch_norm_gradient_sums(None, state)
        run(cb)
        sums.append([t.clone() for t in state._slots[1]])
    (flat,) = reduced
    assert flat.data_ptr() in {t.data_ptr() for t in state._slots[1]} and flat.numel() == 6
    for a, b in zip(sums[0], sums[1], strict=True):
        assert torch.equal(2.0 * a, b)


def test_buckets_coalesce_with_nccl_or_on_the_cpu_only() -> None:
    """A bucket is all-reduced in place as one coalesced collective with NCCL, or with Gloo on
    CPU tensors (Gloo's coalesced all-reduce takes CPU tensors only); otherwise, and for a
    non-contiguous sum, it is flattened and copied back."""
    dp = DataParallel.__new__(DataParallel)  # only the backend matters here
    sums = [torch.zeros(3, 2), torch.zeros(4)]
    device = [torch.zeros(3, 2, device="meta")]
    strided = [torch.zeros(4, 4)[:, ::2]]
    dp.backend = "gloo"
    assert dp._coalesces(sums)
    assert not dp._coalesces(device) and not dp._coalesces(strided)
    dp.backend = "nccl"
    assert dp._coalesces(sums) and dp._coalesces(device)
    assert not dp._coalesces(strided)


def test_a_channels_last_sum_is_reduced_through_a_contiguous_view_of_it() -> None:
    """A CPU float32 convolution's weight-gradient sum is channels-last: the bucket passes the
    NHWC view of its memory (contiguous), so it is reduced in place like the others."""
    from mpsnn.distributed.collectives import _dense_view

    cl = torch.randn(4, 3, 2, 2).contiguous(memory_format=torch.channels_last)
    view = _dense_view(cl)
    assert view.is_contiguous() and view.data_ptr() == cl.data_ptr()
    view.add_(1.0)  # what an in-place sum does: written through
    assert torch.equal(cl, view.permute(0, 3, 1, 2))
    plain = torch.randn(3, 2)
    assert _dense_view(plain) is plain
    dp = DataParallel.__new__(DataParallel)
    dp.backend = "gloo"
    assert dp._coalesces([view]) and not dp._coalesces([cl])
