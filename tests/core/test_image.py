"""Images, temporary images and read counts, image batches, byte I/O."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mpsnn as m
from tests.helpers import run

F32 = m.FeatureChannelFormat.FLOAT32


def _conv(dev: m.Device, cin: int = 1, cout: int = 1) -> m.Convolution:
    desc = m.ConvolutionDescriptor(1, 1, cin, cout)
    return m.Convolution(
        dev, m.TensorConvolutionDataSource(desc, torch.full(desc.weights_shape, 2.0))
    )


def test_from_tensor_wraps_without_copying() -> None:
    t = torch.randn(2, 3, 4, 5)
    im = m.Image.from_tensor(t, label="x")
    assert im.tensor is t and im.shape == (2, 3, 4, 5) and im.label == "x"
    assert (im.width, im.height, im.feature_channels, im.number_of_images) == (5, 4, 3, 2)
    assert m.Image.from_tensor(torch.zeros(3, 4, 5)).shape == (1, 3, 4, 5)
    assert (
        m.Image.from_tensor(t.to(torch.bfloat16)).feature_channel_format
        is m.FeatureChannelFormat.BFLOAT16
    )
    with pytest.raises(
        TypeError,
        match=r"\[FeatureChannelFormat\] the dtype must be float32, float16, bfloat16 or float64, got torch.int64",
    ):
        m.Image.from_tensor(torch.zeros(1, 1, 1, 1, dtype=torch.int64))
    with pytest.raises(
        ValueError,
        match=r"\[Image\] the tensor must have shape \(C, H, W\) or \(N, C, H, W\), got shape \(3, 4\)",
    ):
        m.Image.from_tensor(torch.zeros(3, 4))


def test_descriptor_validation() -> None:
    d = m.ImageDescriptor(F32, 4, 3, 2, 5)
    assert d.shape == (5, 2, 3, 4) and d.copy() == d
    with pytest.raises(ValueError, match=r"\[ImageDescriptor\] width must be >= 1, got 0"):
        m.ImageDescriptor(F32, 0, 3, 2)
    with pytest.raises(
        TypeError, match=r"\[ImageDescriptor\] feature_channels must be an int, got float"
    ):
        m.ImageDescriptor(F32, 1, 1, 2.0)
    with pytest.raises(
        TypeError, match=r"\[ImageDescriptor\] channel_format must be a FeatureChannelFormat"
    ):
        m.ImageDescriptor("float32", 1, 1, 1)


def test_allocated_image_storage_is_lazy_and_adopts_a_full_write() -> None:
    dev = m.Device("cpu")
    cb = dev.new_command_queue().command_buffer()
    y = _conv(dev).encode(cb, m.Image.from_tensor(torch.ones(1, 1, 3, 3)))
    assert y._storage is None  # nothing allocated at encode time
    run(cb)
    assert torch.equal(y.tensor, torch.full((1, 1, 3, 3), 2.0))
    fresh = m.Image(dev, m.ImageDescriptor(F32, 2, 2, 1))
    assert torch.equal(fresh.tensor, torch.zeros(1, 1, 2, 2))  # first touch allocates zeros


def test_temporary_image_read_count_and_release() -> None:
    dev = m.Device("cpu")
    conv = _conv(dev)
    cb = dev.new_command_queue().command_buffer()
    tmp = m.TemporaryImage.from_descriptor(cb, m.ImageDescriptor(F32, 3, 3, 1), label="conv1 out")
    assert tmp.is_temporary and tmp.read_count == 1
    conv.encode(cb, m.Image.from_tensor(torch.full((1, 1, 3, 3), 1.5)), tmp)  # writes: no change
    assert tmp.read_count == 1
    out = conv.encode(cb, tmp)  # the last read
    assert tmp.read_count == 0
    with pytest.raises(
        m.StaleResourceError,
        match=r"\[Convolution\] TemporaryImage 'conv1 out' 1x1x3x3 must be live, but its read_count reached 0 \(released after its last read by Convolution\)",
    ):
        conv.encode(cb, tmp)
    with pytest.raises(m.StaleResourceError, match=r"\[read_count\] TemporaryImage 'conv1 out'"):
        tmp.read_count = 2
    with pytest.raises(m.StaleResourceError):
        conv.encode(cb, m.Image.from_tensor(torch.ones(1, 1, 3, 3)), tmp)  # writing is an error too
    assert len(cb) == 2  # the failed encodes recorded nothing
    run(cb)
    assert tmp._storage is None  # freed right after its last reader ran
    assert torch.equal(out.tensor, torch.full((1, 1, 3, 3), 6.0))  # 2 * (2 * 1.5)


def test_raising_read_count_keeps_a_temporary_for_more_readers() -> None:
    dev = m.Device("cpu")
    conv = _conv(dev)
    cb = dev.new_command_queue().command_buffer()
    tmp = m.TemporaryImage(cb, m.ImageDescriptor(F32, 2, 2, 1))
    conv.encode(cb, m.Image.from_tensor(torch.ones(1, 1, 2, 2)), tmp)
    tmp.read_count = 3
    outs = [conv.encode(cb, tmp) for _ in range(3)]
    assert tmp.read_count == 0
    run(cb)
    assert all(torch.equal(o.tensor, torch.full((1, 1, 2, 2), 4.0)) for o in outs)
    with pytest.raises(m.StaleResourceError):
        _ = tmp.tensor


def test_temporary_images_belong_to_one_command_buffer_and_die_with_it() -> None:
    dev = m.Device("cpu")
    conv = _conv(dev)
    q = dev.new_command_queue()
    cb, other = q.command_buffer(), q.command_buffer()
    tmp = m.TemporaryImage(cb, m.ImageDescriptor(F32, 2, 2, 1), label="t")
    with pytest.raises(
        ValueError,
        match=r"\[Convolution\] source_image is a TemporaryImage of another command buffer",
    ):
        conv.encode(other, tmp)
    tmp.read_count = 5
    conv.encode(cb, tmp)
    run(cb)
    with pytest.raises(m.StaleResourceError, match=r"its command buffer completed"):
        tmp.read_bytes()
    with pytest.raises(
        ValueError, match=r"\[TemporaryImage\] the command buffer must not be committed yet"
    ):
        m.TemporaryImage(cb, m.ImageDescriptor(F32, 1, 1, 1))


def test_a_failed_encode_leaves_read_counts_and_offsets_unchanged() -> None:
    dev = m.Device("cpu")
    conv = _conv(dev, cin=2)
    cb = dev.new_command_queue().command_buffer()
    tmp = m.TemporaryImage(cb, m.ImageDescriptor(F32, 2, 2, 3))
    conv.offset = m.Offset(5, 5, 0)
    with pytest.raises(ValueError, match=r"input_feature_channels=2"):
        conv.encode(cb, tmp)  # 3 channels for a 2-channel convolution
    assert tmp.read_count == 1 and len(cb) == 0 and conv.offset == m.Offset(5, 5, 0)


def test_temporary_allocator_makes_temporary_results() -> None:
    dev = m.Device("cpu")
    conv = _conv(dev)
    conv.destination_image_allocator = m.TemporaryImage.default_allocator()
    cb = dev.new_command_queue().command_buffer()
    y = conv.encode(cb, m.Image.from_tensor(torch.ones(1, 1, 2, 2)))
    assert isinstance(y, m.TemporaryImage) and y.command_buffer is cb
    conv.destination_image_allocator = m.Image.default_allocator()
    z = conv.encode(cb, y)
    assert not isinstance(z, m.TemporaryImage)
    run(cb)
    assert torch.equal(z.tensor, torch.full((1, 1, 2, 2), 4.0))
    with pytest.raises(
        TypeError,
        match=r"destination_image_allocator must have an image\(command_buffer, descriptor, kernel\) method",
    ):
        conv.destination_image_allocator = object()


def test_image_batch() -> None:
    t = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).view(2, 3, 2, 2)
    b = m.ImageBatch.from_tensor(t)
    assert len(b) == 2 and b.tensor is t and b[1].shape == (1, 3, 2, 2)
    assert torch.equal(b[-1].tensor, t[1:2]) and [im.shape for im in b] == [(1, 3, 2, 2)] * 2
    assert len(b[0:2]) == 2
    b[0].write_bytes(np.full((2, 2, 3), 7.0, dtype=np.float32))  # a view: writes into the batch
    assert torch.equal(t[0], torch.full((3, 2, 2), 7.0))
    stacked = m.ImageBatch.from_images([m.Image.from_tensor(t[i]) for i in range(2)])
    assert torch.equal(stacked.tensor, t) and stacked.tensor is not t
    with pytest.raises(IndexError, match=r"\[ImageBatch\] index must be in \[-2, 2\), got 2"):
        b[2]
    with pytest.raises(ValueError, match=r"\[ImageBatch\] from_images needs images of one shape"):
        m.ImageBatch.from_images(
            [m.Image.from_tensor(torch.zeros(1, 2, 2)), m.Image.from_tensor(torch.zeros(2, 2, 2))]
        )
    with pytest.raises(
        ValueError, match=r"\[ImageBatch\] from_images needs at least one image, got 0"
    ):
        m.ImageBatch.from_images([])
    conv = _conv(m.Device("cpu"), 3, 1)
    with pytest.raises(
        TypeError,
        match=r"\[Convolution\] source_images must be an ImageBatch \(see ImageBatch.from_images\), got int",
    ):  # a list of images is a batch too (tests/graph/test_graph_contracts.py)
        conv.encode_batch(m.Device("cpu").new_command_queue().command_buffer(), 3)


def test_read_and_write_bytes_layouts_regions_and_channels() -> None:
    t = torch.arange(1 * 5 * 3 * 4, dtype=torch.float32).view(1, 5, 3, 4)
    im = m.Image.from_tensor(t.clone())
    hwc = im.read_bytes(m.DataLayout.HEIGHT_WIDTH_FEATURE_CHANNELS)
    chw = im.read_bytes(m.DataLayout.FEATURE_CHANNELS_HEIGHT_WIDTH)
    assert hwc.shape == (3, 4, 5) and np.array_equal(hwc, t[0].permute(1, 2, 0).numpy())
    assert np.array_equal(chw, t[0].numpy())
    region = m.Region.make(1, 1, 2, 2)
    info = m.ImageReadWriteParams(
        feature_channel_offset=1, number_of_feature_channels_to_read_write=3
    )
    part = im.read_bytes(m.DataLayout.HEIGHT_WIDTH_FEATURE_CHANNELS, 0, region, info)
    assert np.array_equal(part, t[0, 1:4, 1:3, 1:3].permute(1, 2, 0).numpy())
    im.write_bytes(
        np.zeros((3, 2, 2), dtype=np.float32),
        m.DataLayout.FEATURE_CHANNELS_HEIGHT_WIDTH,
        0,
        region,
        info,
    )
    want = t.clone()
    want[0, 1:4, 1:3, 1:3] = 0
    assert torch.equal(im.tensor, want)
    bf = m.Image.from_tensor(torch.tensor([[[[1.5, -2.25]]]], dtype=torch.bfloat16))
    got = bf.read_bytes()
    assert got.dtype == np.float32 and got.ravel().tolist() == [1.5, -2.25]
    with pytest.raises(
        ValueError,
        match=r"\[Image\] read_bytes region must lie inside the 4x3 image, got x=3 y=0 width=2 height=1",
    ):
        im.read_bytes(region=m.Region.make(3, 0, 2, 1))
    with pytest.raises(
        ValueError, match=r"\[Image\] read_bytes channels \[4, 6\) must lie in \[0, 5\)"
    ):
        im.read_bytes(feature_channel_info=m.ImageReadWriteParams(4, 2))
    with pytest.raises(
        ValueError,
        match=r"\[Image\] write_bytes needs an array of shape \(3, 4, 5\) for this region and layout, got \(5, 3, 4\)",
    ):
        im.write_bytes(np.zeros((5, 3, 4)))
    with pytest.raises(
        ValueError, match=r"\[Image\] read_bytes image_index must be in \[0, 1\), got 1"
    ):
        im.read_bytes(image_index=1)
    assert np.array_equal(im.numpy(), want.numpy())
