"""The Loss kernel: gradient image out, loss into the labels, MPS's label forms (wider labels,
class indices, one LossLabels per image), and every documented error. The loss math itself is
checked against float64 references and PyTorch in tests/ops/test_loss_ops.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from mpsnn.ops.loss import LossParams, loss_forward_backward
from tests.helpers import DEVICES, assert_close, run

LT, RT = m.LossType, m.ReductionType


def _logits(n, c, h=1, w=1, seed=0, dtype=torch.float64, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, h, w, generator=gen, dtype=dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_apple_sample_loss_facts(device) -> None:
    """12-channel one-hot labels for 10 classes, one LossLabels per image, SUM with weight
    1/B: the per-image loss is CE/B, the gradient is softmax - onehot over B."""
    dev = m.Device(device)
    b = 5
    y = _logits(b, 10, seed=1, device=device)
    classes = torch.tensor([3, 0, 9, 9, 1])
    onehot12 = F.one_hot(classes, 12).double().view(b, 12, 1, 1)
    labels = m.StateBatch(m.LossLabels(dev, onehot12[i]) for i in range(b))
    loss = m.Loss(dev, m.LossDescriptor(LT.SOFTMAX_CROSS_ENTROPY, RT.SUM, weight=1 / b))
    cb = dev.new_command_queue().command_buffer()
    grad = loss.encode_batch(cb, m.ImageBatch.from_tensor(y), labels)
    run(cb)
    ce = F.cross_entropy(y.view(b, 10).cpu(), classes, reduction="none")
    per_image = torch.stack([lab.loss_image().tensor.view(()) for lab in labels]).cpu()
    assert_close(per_image, ce / b, "per-image loss = CE / B")
    want = (torch.softmax(y.view(b, 10).cpu(), 1) - F.one_hot(classes, 10)) / b
    assert_close(grad.tensor.view(b, 10), want, "gradient")
    assert grad.shape == (b, 10, 1, 1)


def test_index_labels_equal_one_hot_labels() -> None:
    dev = m.Device("cpu")
    y = _logits(3, 4, 2, 3, seed=2)
    idx = torch.randint(0, 4, (3, 2, 3), generator=torch.Generator().manual_seed(3))
    onehot = F.one_hot(idx, 4).permute(0, 3, 1, 2).double()
    loss = m.Loss(dev, m.LossDescriptor(LT.SOFTMAX_CROSS_ENTROPY, RT.MEAN, label_smoothing=0.1))
    outs = []
    for labels in (m.LossLabels(dev, idx), m.LossLabels(dev, onehot)):
        cb = dev.new_command_queue().command_buffer()
        g = loss.encode_batch(cb, m.ImageBatch.from_tensor(y), labels)
        run(cb)
        outs.append((g.tensor, labels.loss_image().tensor))
    assert_close(outs[0][0], outs[1][0], "gradient, index vs one-hot")
    assert_close(outs[0][1], outs[1][1], "loss, index vs one-hot")


@pytest.mark.parametrize("reduction", list(RT), ids=lambda r: r.name)
@pytest.mark.parametrize("kind", list(LT), ids=lambda k: k.name)
def test_kernel_equals_the_loss_math(kind, reduction) -> None:
    """Every type and reduction, per-element weights, single-image encode: the kernel gives
    what the (separately tested) math gives, with the loss image shaped by the reduction."""
    dev = m.Device("cpu")
    gen = torch.Generator().manual_seed(int(kind) * 7 + int(reduction))
    y = torch.rand(1, 3, 2, 2, generator=gen, dtype=torch.float64) * 0.8 + 0.1
    if kind is LT.KULLBACK_LEIBLER_DIVERGENCE:
        y = torch.log(y)
    t = torch.rand(1, 3, 2, 2, generator=gen, dtype=torch.float64)
    w = torch.rand(1, 3, 2, 2, generator=gen, dtype=torch.float64)
    desc = m.LossDescriptor(kind, reduction, weight=0.5)
    labels = m.LossLabels(dev, t[0], w[0])
    cb = dev.new_command_queue().command_buffer()
    grad = m.Loss(dev, desc).encode(cb, m.Image.from_tensor(y), labels)
    run(cb)
    want_loss, want_grad = loss_forward_backward(y, t, w, desc._params())
    assert_close(grad.tensor, want_grad, f"{kind.name} {reduction.name} gradient")
    assert_close(labels.loss_image().tensor, want_loss, f"{kind.name} {reduction.name} loss")
    per_pixel = kind in (LT.SOFTMAX_CROSS_ENTROPY, LT.CATEGORICAL_CROSS_ENTROPY, LT.COSINE_DISTANCE)
    if reduction is RT.NONE:
        assert labels.loss_image().shape == (1, 1 if per_pixel else 3, 2, 2)
    else:
        assert labels.loss_image().shape == (1, 1, 1, 1)


def test_loss_of_one_labels_object_holding_the_batch() -> None:
    dev = m.Device("cpu")
    y = _logits(4, 3, 2, 2, seed=5)
    t = torch.rand(4, 3, 2, 2, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    labels = m.LossLabels(dev, t)
    desc = m.LossDescriptor(LT.MEAN_SQUARED_ERROR, RT.SUM)
    cb = dev.new_command_queue().command_buffer()
    grad = m.Loss(dev, desc).encode_batch(cb, m.ImageBatch.from_tensor(y), labels)
    run(cb)
    assert_close(labels.loss_image().tensor.view(4), ((y - t) ** 2).sum((1, 2, 3)), "per image")
    assert_close(grad.tensor, 2 * (y - t), "gradient")


def test_softmax_cross_entropy_stays_finite_for_huge_logits() -> None:
    dev = m.Device("cpu")
    y = torch.tensor([[1e4, -1e4, 0.0]], dtype=torch.float32).view(1, 3, 1, 1)
    labels = m.LossLabels(dev, torch.tensor([[0.0], [1.0], [0.0]]).view(3, 1, 1))
    cb = dev.new_command_queue().command_buffer()
    g = m.Loss(dev, m.LossDescriptor(LT.SOFTMAX_CROSS_ENTROPY, RT.SUM)).encode(
        cb, m.Image.from_tensor(y), labels
    )
    run(cb)
    assert torch.isfinite(g.tensor).all() and torch.isfinite(labels.loss_image().tensor).all()
    assert labels.loss_image().tensor.item() == pytest.approx(2e4)


def test_loss_errors() -> None:
    dev = m.Device("cpu")
    cb = dev.new_command_queue().command_buffer()
    with pytest.raises(
        ValueError, match=r"\[LossDescriptor\] label_smoothing must be >= 0.0, got -0.1"
    ):
        m.LossDescriptor(LT.SOFTMAX_CROSS_ENTROPY, RT.SUM, label_smoothing=-0.1)
    with pytest.raises(ValueError, match=r"\[LossDescriptor\] weight must be finite, got inf"):
        m.LossDescriptor(LT.HINGE, RT.SUM, weight=float("inf"))
    with pytest.raises(TypeError, match=r"\[LossDescriptor\] loss_type must be a LossType"):
        m.LossDescriptor(2, RT.SUM)
    with pytest.raises(ValueError, match=r"\[LossDescriptor\] epsilon must be > 0, got 0"):
        m.LossDescriptor(LT.LOG, RT.SUM, epsilon=0)
    with pytest.raises(
        ValueError,
        match=r"\[LossLabels\] labels must have shape \(C, H, W\) or \(N, C, H, W\), got \(5,\)",
    ):
        m.LossLabels(dev, torch.zeros(5))
    with pytest.raises(ValueError, match=r"\[LossLabels\] class indices must be >= 0, got -1"):
        m.LossLabels(dev, torch.tensor([[-1, 0]]))
    with pytest.raises(
        ValueError,
        match=r"\[LossLabels\] weights must have the labels' shape \(3, 1, 1\), got \(2, 1, 1\)",
    ):
        m.LossLabels(dev, torch.zeros(3, 1, 1), torch.ones(2, 1, 1))
    y = m.Image.from_tensor(torch.zeros(1, 3, 2, 2))
    ce = m.Loss(dev, m.LossDescriptor(LT.SOFTMAX_CROSS_ENTROPY, RT.SUM))
    with pytest.raises(
        ValueError,
        match=r"\[Loss\] labels must be 2x2 with at least the predictions' 3 channels, got 2x2x2",
    ):
        ce.encode(cb, y, m.LossLabels(dev, torch.zeros(2, 2, 2)))
    with pytest.raises(
        ValueError,
        match=r"\[Loss\] class indices must be < the 3 channels of the predictions, got 3",
    ):
        ce.encode(cb, y, m.LossLabels(dev, torch.tensor([[0, 3], [1, 2]])))
    mse = m.Loss(dev, m.LossDescriptor(LT.MEAN_SQUARED_ERROR, RT.SUM))
    with pytest.raises(
        ValueError,
        match=r"\[Loss\] class-index labels need a cross entropy loss, got MEAN_SQUARED_ERROR",
    ):
        mse.encode(cb, y, m.LossLabels(dev, torch.tensor([[0, 1], [1, 2]])))
    yb = m.ImageBatch.from_tensor(torch.zeros(2, 3, 2, 2))
    with pytest.raises(
        ValueError, match=r"\[Loss\] the labels must hold one image per source image \(2\), got 1"
    ):
        mse.encode_batch(cb, yb, [m.LossLabels(dev, torch.zeros(3, 2, 2))])
    with pytest.raises(
        ValueError,
        match=r"\[Loss\] loss_image_size must be Size\(width=1, height=1, depth=1\) for SUM",
    ):
        mse.encode(cb, y, m.LossLabels(dev, torch.zeros(3, 2, 2), loss_image_size=m.Size(2, 2, 3)))
    mse.offset = m.Offset(1, 0, 0)
    with pytest.raises(m.UnsupportedError, match=r"\[Loss\] a loss reads whole images"):
        mse.encode(cb, y, m.LossLabels(dev, torch.zeros(3, 2, 2)))
    with pytest.raises(
        ValueError,
        match=r"\[LossLabels\] loss_image needs a Loss encode that used these labels, got none",
    ):
        m.LossLabels(dev, torch.zeros(3, 2, 2)).loss_image()
    assert len(cb) == 0


def test_params_of_the_descriptor() -> None:
    d = m.LossDescriptor(LT.HUBER, RT.MEAN, weight=2.0, delta=0.5)
    assert d._params() == LossParams(int(LT.HUBER), int(RT.MEAN), 2.0, 0.0, None, 1e-7, 0.5)
    loss = m.Loss(m.Device("cpu"), d)
    assert (loss.loss_type, loss.reduction_type, loss.delta) == (LT.HUBER, RT.MEAN, 0.5)


def test_max_index_replaces_the_scan_of_index_labels() -> None:
    """A known bound skips the min/max scan (which waits for the device on GPUs); the encode
    checks the bound against the predictions' channels, not the values."""
    dev = m.Device("cpu")
    y = torch.tensor([[[1]], [[3]]])
    assert m.LossLabels(dev, y)._max_index == 3  # scanned
    assert m.LossLabels(dev, y, max_index=4)._max_index == 4  # trusted
    loss = m.Loss(dev, m.LossDescriptor(m.LossType.SOFTMAX_CROSS_ENTROPY, m.ReductionType.SUM))
    x = m.ImageBatch.from_tensor(torch.randn(2, 5, 1, 1))
    cb = dev.new_command_queue().command_buffer()
    loss.encode_batch(cb, x, m.LossLabels(dev, y, max_index=4))  # a bound below 5 channels
    with pytest.raises(ValueError, match=r"class indices must be < the 5 channels .*got 5"):
        loss.encode_batch(cb, x, m.LossLabels(dev, y, max_index=5))
    with pytest.raises(ValueError, match=r"\[LossLabels\] max_index must be >= 0, got -1"):
        m.LossLabels(dev, y, max_index=-1)
