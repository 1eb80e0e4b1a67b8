"""`Loss.encode` on a multi-image `Image`: like every kernel it covers the images the clip rect
selects (source images ``offset.z + i``, destination images ``clip_rect.origin.z + i``,
``i < min(clip_rect.size.depth, ...)``), one loss and one gradient per image, and its single
`LossLabels` holds one labels image per covered image, in order. Checked in float64 against a
loop of single-image encodes and against PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.helpers import assert_close, run

LT, RT = m.LossType, m.ReductionType


def _data(n, c, h, w, seed):
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(n, c, h, w, generator=gen, dtype=torch.float64)
    t = torch.rand(n, c, h, w, generator=gen, dtype=torch.float64)
    wt = torch.rand(n, c, h, w, generator=gen, dtype=torch.float64)
    idx = torch.randint(0, c, (n, h, w), generator=gen)
    return y, t, wt, idx


def _single(dev, desc, y1, labels_args):
    """The single-image path: one encode of a one-image `Image`."""
    labels = m.LossLabels(dev, *labels_args)
    cb = dev.new_command_queue().command_buffer()
    g = m.Loss(dev, desc).encode(cb, m.Image.from_tensor(y1), labels)
    run(cb)
    return g.tensor, labels.loss_image().tensor


@pytest.mark.parametrize("reduction", list(RT), ids=lambda r: r.name)
@pytest.mark.parametrize(
    "kind", [LT.MEAN_SQUARED_ERROR, LT.SOFTMAX_CROSS_ENTROPY, LT.HUBER], ids=lambda k: k.name
)
def test_every_image_of_a_multi_image_source(kind, reduction) -> None:
    dev = m.Device("cpu")
    y, t, wt, _ = _data(4, 3, 2, 3, seed=int(kind) * 4 + int(reduction))
    desc = m.LossDescriptor(kind, reduction, weight=0.75)
    labels = m.LossLabels(dev, t, wt)
    cb = dev.new_command_queue().command_buffer()
    grad = m.Loss(dev, desc).encode(cb, m.Image.from_tensor(y), labels)
    run(cb)
    assert grad.number_of_images == 4 and labels.loss_image().number_of_images == 4
    for i in range(4):
        g1, l1 = _single(dev, desc, y[i : i + 1], (t[i], wt[i]))
        assert_close(grad.tensor[i : i + 1], g1, f"image {i} gradient", tol=1e-15)
        assert_close(labels.loss_image().tensor[i : i + 1], l1, f"image {i} loss", tol=1e-15)


def test_offset_z_and_clip_depth_select_the_images() -> None:
    """offset.z = 1 and depth 2: source images 1 and 2 with labels images 0 and 1, written into
    destination images clip_rect.origin.z = 2 and 3; the other destination images are left as
    they were. Softmax cross entropy with class indices, against PyTorch."""
    dev = m.Device("cpu")
    y, _, _, idx = _data(4, 5, 2, 2, seed=3)
    loss = m.Loss(dev, m.LossDescriptor(LT.SOFTMAX_CROSS_ENTROPY, RT.MEAN))
    loss.offset = m.Offset(0, 0, 1)
    loss.clip_rect = m.Region.make(0, 0, 1 << 20, 1 << 20, z=2, depth=2)
    labels = m.LossLabels(dev, idx[1:3])
    before = torch.full((5, 5, 2, 2), 7.0, dtype=torch.float64)
    dst = m.Image.from_tensor(before.clone())
    cb = dev.new_command_queue().command_buffer()
    out = loss.encode(cb, m.Image.from_tensor(y), labels, dst)
    run(cb)
    assert out is dst
    yr = y[1:3].clone().requires_grad_()
    per_image = torch.stack(
        [F.cross_entropy(yr[i : i + 1], idx[1 + i : 2 + i], reduction="mean") for i in range(2)]
    )
    per_image.sum().backward()
    assert_close(labels.loss_image().tensor.view(2), per_image.detach(), "loss", tol=1e-14)
    assert_close(dst.tensor[2:4], yr.grad, "gradient", tol=1e-14)
    assert torch.equal(dst.tensor[[0, 1, 4]], before[[0, 1, 4]])


def test_allocated_gradient_follows_the_kernels_image_rule() -> None:
    """A returned destination holds the source's images from offset.z on (as every kernel);
    the clip rect's z range picks the ones written, the others are zeros."""
    dev = m.Device("cpu")
    y, t, _, _ = _data(5, 2, 1, 2, seed=4)
    loss = m.Loss(dev, m.LossDescriptor(LT.MEAN_SQUARED_ERROR, RT.SUM))
    loss.offset = m.Offset(0, 0, 2)
    labels = m.LossLabels(dev, t[2:])
    cb = dev.new_command_queue().command_buffer()
    g = loss.encode(cb, m.Image.from_tensor(y), labels)
    run(cb)
    assert g.number_of_images == 3
    assert_close(g.tensor, 2 * (y[2:] - t[2:]), "gradient", tol=1e-15)
    assert_close(labels.loss_image().tensor.view(3), ((y[2:] - t[2:]) ** 2).sum((1, 2, 3)), "loss")
    loss.clip_rect = m.Region.make(0, 0, 1 << 20, 1 << 20, z=1, depth=1)
    labels = m.LossLabels(dev, t[2:3])
    cb = dev.new_command_queue().command_buffer()
    g = loss.encode(cb, m.Image.from_tensor(y), labels)
    run(cb)
    assert g.number_of_images == 3
    assert g.tensor[[0, 2]].abs().max() == 0
    assert_close(g.tensor[1], 2 * (y[2] - t[2]), "gradient of the one covered image", tol=1e-15)


def test_labels_must_hold_one_image_per_covered_image() -> None:
    dev = m.Device("cpu")
    y, t, _, idx = _data(3, 2, 2, 2, seed=5)
    mse = m.Loss(dev, m.LossDescriptor(LT.MEAN_SQUARED_ERROR, RT.SUM))
    cb = dev.new_command_queue().command_buffer()
    src = m.Image.from_tensor(y)
    with pytest.raises(
        ValueError,
        match=r"\[Loss\] the labels must hold one image per source image the encode covers "
        r"\(3: images 0\.\.2 of the 3-image source\), got 1",
    ):
        mse.encode(cb, src, m.LossLabels(dev, t[0]))
    mse.offset = m.Offset(0, 0, 1)
    with pytest.raises(
        ValueError,
        match=r"\[Loss\] the labels must hold one image per source image the encode covers "
        r"\(2: images 1\.\.2 of the 3-image source\), got 3",
    ):
        mse.encode(cb, src, m.LossLabels(dev, t))
    mse.offset = m.Offset(0, 0, 3)
    with pytest.raises(ValueError, match=r"\[Loss\] offset\.z \(3\) and the clip rect's z range"):
        mse.encode(cb, src, m.LossLabels(dev, t[0]))
    mse.offset = m.Offset(0, 0, 0)
    mse.clip_rect = m.Region.make(0, 0, 1, 2, depth=3)  # not the whole width
    with pytest.raises(m.UnsupportedError, match=r"\[Loss\] a loss reads whole images"):
        mse.encode(cb, src, m.LossLabels(dev, t))
    ce = m.Loss(dev, m.LossDescriptor(LT.SOFTMAX_CROSS_ENTROPY, RT.SUM))
    ce.clip_rect = m.Region.make(0, 0, 2, 2, depth=2)  # exactly the image: allowed
    dst = m.Image.from_tensor(torch.zeros(1, 2, 2, 2, dtype=torch.float64))
    with pytest.raises(
        ValueError,
        match=r"\[Loss\] the labels must hold one image per source image the encode covers "
        r"\(1: images 0\.\.0 of the 3-image source\), got 2",
    ):
        ce.encode(cb, src, m.LossLabels(dev, idx[:2]), dst)  # a one-image destination
    assert len(cb) == 0
    ce.encode(cb, src, m.LossLabels(dev, idx[:2]))
    run(cb)
