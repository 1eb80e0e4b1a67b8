"""Class indices outside ``[0, C)`` that reach the loss command (a trusted ``max_index``, labels
changed in place after the scan, negative indices without a scan) are caught on the device: the
command never addresses memory with them (the portable path clamps them, the Triton pass only
compares them), writes the indices' range into a small device tensor, and the command buffer
turns that into a `CommandBufferError` naming the `Loss` once the work completed (no host
synchronization at encode). Good indices give the same bits as before."""

from __future__ import annotations

import time

import pytest
import torch

import mpsnn as m
from mpsnn.ops import loss as L
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.loss import LossParams, loss_forward_backward
from mpsnn.ops.triton import loss as triton_loss
from tests.helpers import TRITON_DEVICES

LT, RT = m.LossType, m.ReductionType

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


@pytest.fixture
def triton_pass(monkeypatch, device):
    """The fused kernel's path: on the CPU the dispatch's device test is widened to CPU tensors
    (Triton's interpreter runs them; CUDA: as is); and a count of the kernel's launches."""
    if device == "cpu":
        monkeypatch.setattr(
            fast_paths, "_runs", lambda *ts: fast_paths.enabled() and fast_paths.available()
        )
    calls = []
    real = triton_loss.softmax_cross_entropy_triton

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_loss, "softmax_cross_entropy_triton", counted)
    return calls


def _encode(kind, idx, max_index, dtype=torch.float32, batch=True, reduction=RT.MEAN, device="cpu"):
    dev = m.Device(device)
    n, h, w = idx.shape
    gen = torch.Generator().manual_seed(11)
    y = torch.randn(n, 5, h, w, generator=gen).to(dtype)
    if kind is LT.CATEGORICAL_CROSS_ENTROPY:
        y = torch.softmax(y.double(), 1).to(dtype)
    y, idx = y.to(device), idx.to(device)
    labels = m.LossLabels(dev, idx, max_index=max_index)
    loss = m.Loss(dev, m.LossDescriptor(kind, reduction))
    cb = dev.new_command_queue().command_buffer()
    if batch:
        g = loss.encode_batch(cb, m.ImageBatch.from_tensor(y), labels)
    else:
        g = loss.encode(cb, m.Image.from_tensor(y), labels)
    cb.commit()
    return cb, g, labels, y


def _bad_labels(low: int, high: int) -> torch.Tensor:
    idx = torch.randint(0, 5, (3, 2, 3), generator=torch.Generator().manual_seed(4))
    idx[0, 1, 2], idx[2, 0, 0] = low, high
    return idx


CASES = [
    (LT.SOFTMAX_CROSS_ENTROPY, 0, 7, "0 to 7"),
    (LT.SOFTMAX_CROSS_ENTROPY, -3, 4, "-3 to 4"),
    (LT.CATEGORICAL_CROSS_ENTROPY, -1, 5, "-1 to 5"),
    (LT.CATEGORICAL_CROSS_ENTROPY, 0, 2**40, f"0 to {2**40}"),
]


@pytest.mark.parametrize("batch", [True, False], ids=["batch", "image"])
@pytest.mark.parametrize(("kind", "low", "high", "got"), CASES, ids=str)
def test_bad_indices_fail_the_command_buffer_on_the_portable_path(
    kind, low, high, got, batch
) -> None:
    """A trusted max_index of 4 (the scan is skipped): the indices reach the command."""
    cb, g, labels, _ = _encode(kind, _bad_labels(low, high), 4, batch=batch)
    msg = rf"\[Loss\] class indices must lie in \[0, 5\) \(the predictions' channels\), got {got}"
    with pytest.raises(m.CommandBufferError, match=msg):
        cb.wait_until_completed()
    assert cb.status is m.CommandBufferStatus.ERROR
    assert cb.failed_command == "Loss"
    with pytest.raises(m.CommandBufferError, match=r"whose command 'Loss' failed.*\[Loss\]"):
        g.tensor  # noqa: B018
    with pytest.raises(m.CommandBufferError, match=r"'Loss' failed"):
        labels.loss_image().tensor  # noqa: B018


def test_labels_changed_in_place_after_the_scan_are_caught() -> None:
    dev = m.Device("cpu")
    idx = torch.zeros(2, 1, 1, dtype=torch.int64)
    labels = m.LossLabels(dev, idx)  # scanned: max 0
    labels._labels[1, 0, 0] = 9  # what a refill of a compiled step could bring
    loss = m.Loss(dev, m.LossDescriptor(LT.SOFTMAX_CROSS_ENTROPY, RT.SUM))
    cb = dev.new_command_queue().command_buffer()
    loss.encode_batch(cb, m.ImageBatch.from_tensor(torch.randn(2, 3, 1, 1)), labels)
    cb.commit()
    with pytest.raises(m.CommandBufferError, match=r"\[0, 3\).*got 0 to 9"):
        cb.wait_until_completed()


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize(("kind", "low", "high", "got"), CASES[:2], ids=str)
def test_bad_indices_fail_the_command_buffer_on_the_triton_pass(
    kind, low, high, got, triton_pass, device
) -> None:
    cb, _, _, _ = _encode(kind, _bad_labels(low, high), 4, device=device)
    with pytest.raises(m.CommandBufferError, match=rf"\[Loss\] class indices .*got {got}"):
        cb.wait_until_completed()
    assert triton_pass, "the fused kernel did not run"


@pytest.mark.parametrize("reduction", list(RT), ids=lambda r: r.name)
@pytest.mark.parametrize("kind", [LT.SOFTMAX_CROSS_ENTROPY, LT.CATEGORICAL_CROSS_ENTROPY])
def test_good_indices_keep_their_bits(kind, reduction) -> None:
    idx = torch.randint(0, 5, (3, 2, 3), generator=torch.Generator().manual_seed(8))
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        cb, g, labels, y = _encode(kind, idx, None, dtype, reduction=reduction)
        cb.wait_until_completed()
        assert cb.status is m.CommandBufferStatus.COMPLETED
        want_loss, want_grad = loss_forward_backward(
            y, idx, None, LossParams(int(kind), int(reduction))
        )
        assert torch.equal(g.tensor, want_grad)
        assert torch.equal(labels.loss_image().tensor, want_loss)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("reduction", list(RT), ids=lambda r: r.name)
def test_good_indices_keep_the_triton_bits(reduction, triton_pass, device) -> None:
    idx = torch.randint(0, 5, (3, 2, 3), generator=torch.Generator().manual_seed(8))
    cb, g, labels, y = _encode(
        LT.SOFTMAX_CROSS_ENTROPY, idx, None, reduction=reduction, device=device
    )
    cb.wait_until_completed()
    assert triton_pass
    divisor = 6 if reduction in (RT.MEAN, RT.SUM_BY_NON_ZERO_WEIGHTS) else 1
    loss, grad = triton_loss.softmax_cross_entropy_triton(y, idx.to(device), 1.0, divisor)
    assert torch.equal(g.tensor, grad)
    if reduction is RT.NONE:
        assert torch.equal(labels.loss_image().tensor, loss)


def test_ops_report_the_index_range_without_reading_out_of_bounds() -> None:
    """`loss_forward_backward` with ``index_bounds``: the range comes back (read after the work,
    `read_index_bounds`); bad pixels are computed from a clamped index, never addressed."""
    y = torch.randn(2, 4, 3, 3, dtype=torch.float64)
    idx = torch.randint(0, 4, (2, 3, 3), generator=torch.Generator().manual_seed(1))
    idx[1, 2, 2], idx[0, 0, 1] = 1000, -5
    for kind in (L.SOFTMAX_CROSS_ENTROPY, L.CATEGORICAL_CROSS_ENTROPY):
        bounds = L.new_index_bounds("cpu")
        p = LossParams(kind, L.NONE)
        loss, grad = loss_forward_backward(y.abs(), idx, None, p, index_bounds=bounds)
        assert L.read_index_bounds(bounds) == (-5, 1000)
        good = torch.ones(2, 3, 3, dtype=torch.bool)
        good[1, 2, 2] = good[0, 0, 1] = False
        want_loss, want_grad = loss_forward_backward(y.abs(), idx.clamp(0, 3), None, p)
        assert torch.equal(loss[:, 0][good], want_loss[:, 0][good])
        assert torch.equal(grad.permute(0, 2, 3, 1)[good], want_grad.permute(0, 2, 3, 1)[good])


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_pass_reports_the_index_range(triton_pass, device) -> None:
    y = torch.randn(2, 4, 3, 3, device=device)
    idx = torch.randint(0, 4, (2, 3, 3), generator=torch.Generator().manual_seed(1)).to(device)
    bounds = L.new_index_bounds(device)
    p = LossParams(L.SOFTMAX_CROSS_ENTROPY, L.SUM)
    loss_forward_backward(y, idx, None, p, index_bounds=bounds)
    assert L.read_index_bounds(bounds) == (int(idx.min()), int(idx.max()))
    idx[0, 2, 1] = -(2**62)
    loss_forward_backward(y, idx, None, p, index_bounds=bounds)
    assert L.read_index_bounds(bounds) == (-(2**62), int(idx.max()))
    assert len(triton_pass) == 2


@pytest.mark.parametrize("fused", [True, False], ids=["triton", "portable"])
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_index_bounds_fold_the_range_of_every_call(fused, device, triton_pass) -> None:
    """`new_index_bounds` starts empty; each call folds its labels' range in (running minimum
    and maximum), so one tensor holds the range of several calls until it is refilled."""
    fast_paths.set_enabled(fused)
    try:
        bounds = L.new_index_bounds(device)
        assert L.read_index_bounds(bounds) == (2**63 - 1, -(2**63))  # the empty range
        y = torch.randn(2, 4, 3, 3, device=device)
        p = LossParams(L.SOFTMAX_CROSS_ENTROPY, L.SUM)
        for low, high in ((1, 2), (0, 1), (2, 3), (1, 1)):
            idx = torch.full((2, 3, 3), low, dtype=torch.int64)
            idx[1, 2, 0] = high
            loss_forward_backward(y, idx.to(device), None, p, index_bounds=bounds)
        assert L.read_index_bounds(bounds) == (0, 3)
        assert len(triton_pass) == (4 if fused else 0)
        bounds.fill_(-(2**63))
        loss_forward_backward(y, torch.full((2, 3, 3), 2).to(device), None, p, index_bounds=bounds)
        assert L.read_index_bounds(bounds) == (2, 2)
    finally:
        fast_paths.set_enabled(True)


def test_completed_handlers_see_the_failed_check() -> None:
    """The check runs when the work completed, before the completed handlers: they see the
    error and status ERROR. Labels that are good on a later buffer pass."""
    dev = m.Device("cpu")
    loss = m.Loss(dev, m.LossDescriptor(LT.SOFTMAX_CROSS_ENTROPY, RT.SUM))
    y = m.ImageBatch.from_tensor(torch.randn(3, 5, 2, 3))
    seen = []
    cb = dev.new_command_queue().command_buffer()
    loss.encode_batch(cb, y, m.LossLabels(dev, _bad_labels(0, 5), max_index=4))
    cb.add_completed_handler(lambda b: seen.append((b.status, type(b.error))))
    cb.commit()
    assert seen == [(m.CommandBufferStatus.ERROR, m.CommandBufferError)]
    cb = dev.new_command_queue().command_buffer()
    loss.encode_batch(cb, y, m.LossLabels(dev, _bad_labels(0, 4), max_index=4))
    cb.commit()
    cb.wait_until_completed()
    assert cb.status is m.CommandBufferStatus.COMPLETED and cb.error is None


CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="CUDA streams and graphs need a GPU")


@needs_cuda
@pytest.mark.parametrize("fused", [True, False], ids=["triton", "portable"])
def test_cuda_bad_indices_leave_the_process_usable(fused) -> None:
    """On CUDA a bad index used to be a device-side assertion (the scatter), which poisons the
    process; now the buffer fails and the next work runs."""
    dev = m.Device("cuda")
    loss = m.Loss(dev, m.LossDescriptor(LT.SOFTMAX_CROSS_ENTROPY, RT.MEAN))
    fast_paths.set_enabled(fused)
    try:
        y = m.ImageBatch.from_tensor(torch.randn(3, 5, 2, 3, device="cuda"))
        labels = m.LossLabels(dev, _bad_labels(-2, 9).cuda(), max_index=4)
        cb = dev.new_command_queue().command_buffer()
        loss.encode_batch(cb, y, labels)
        cb.commit()
        with pytest.raises(m.CommandBufferError, match=r"\[0, 5\).*got -2 to 9"):
            cb.wait_until_completed()
        good = m.LossLabels(dev, _bad_labels(0, 4).cuda(), max_index=4)
        cb = dev.new_command_queue().command_buffer()
        g = loss.encode_batch(cb, y, good)
        cb.commit()
        cb.wait_until_completed()
        assert torch.isfinite(g.tensor).all()
    finally:
        fast_paths.set_enabled(True)


@needs_cuda
def test_cuda_read_of_the_range_waits_for_no_later_work() -> None:
    """The check reads the range on a side stream: work queued after the loss on the queue's
    stream (here a long sleep kernel) does not delay the loss buffer's completion."""
    dev = m.Device("cuda")
    q = dev.new_command_queue()
    loss = m.Loss(dev, m.LossDescriptor(LT.SOFTMAX_CROSS_ENTROPY, RT.SUM))
    y = m.ImageBatch.from_tensor(torch.randn(3, 5, 2, 3, device="cuda"))
    cb = q.command_buffer()
    loss.encode_batch(cb, y, m.LossLabels(dev, _bad_labels(0, 4).cuda(), max_index=4))
    cb.commit()
    torch.cuda.synchronize()
    cb2 = q.command_buffer()
    loss.encode_batch(cb2, y, m.LossLabels(dev, _bad_labels(0, 4).cuda(), max_index=4))
    cb2.commit()
    later = q.command_buffer()
    later.record("sleep", lambda: torch.cuda._sleep(2_000_000_000))  # about a second or more
    later.commit()
    start = time.perf_counter()
    cb2.wait_until_completed()
    assert time.perf_counter() - start < 0.2
    assert later.status is m.CommandBufferStatus.COMMITTED
    later.wait_until_completed()


@needs_cuda
def test_captured_loss_checks_every_replay() -> None:
    dev = m.Device("cuda")
    q = dev.new_command_queue()
    loss = m.Loss(dev, m.LossDescriptor(LT.SOFTMAX_CROSS_ENTROPY, RT.MEAN))
    y = m.ImageBatch.from_tensor(torch.randn(3, 5, 2, 3, device="cuda"))
    labels = m.LossLabels(dev, _bad_labels(0, 4).cuda(), max_index=4)
    cb = q.command_buffer()
    loss.encode_batch(cb, y, labels)  # eager once: Triton compiled, constants made
    cb.commit()
    cb.wait_until_completed()
    cb = q.command_buffer()
    g = loss.encode_batch(cb, y, labels)
    step = cb.capture()
    step.replay()
    step.wait_until_completed()
    want = g.tensor.clone()
    labels._labels.copy_(_bad_labels(0, 7).cuda())  # refilled in place with a bad index
    step.replay()
    with pytest.raises(m.CommandBufferError, match=r"\[0, 5\).*got 0 to 7"):
        step.wait_until_completed()
    labels._labels.copy_(_bad_labels(0, 4).cuda())
    step.replay()
    step.wait_until_completed()
    assert torch.equal(g.tensor, want)
