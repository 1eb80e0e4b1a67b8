"""Reductions: every unary kernel against ``torch.amin/amax/mean/sum/argmin/argmax`` in float64
over the source clip rect, the destination clip rect and channel offsets, image selection,
argument ties, the feature-channel sum's weight, every storage format, the weighted binary
reductions against a loop-level formula, and the errors."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from tests.helpers import DEVICES, assert_close, run

# kernel -> (dim reduced, reference on the region block)
UNARY = {
    m.ReduceRowMin: (3, lambda t: t.amin(3, keepdim=True)),
    m.ReduceRowMax: (3, lambda t: t.amax(3, keepdim=True)),
    m.ReduceRowMean: (3, lambda t: t.mean(3, keepdim=True)),
    m.ReduceRowSum: (3, lambda t: t.sum(3, keepdim=True)),
    m.ReduceColumnMin: (2, lambda t: t.amin(2, keepdim=True)),
    m.ReduceColumnMax: (2, lambda t: t.amax(2, keepdim=True)),
    m.ReduceColumnMean: (2, lambda t: t.mean(2, keepdim=True)),
    m.ReduceColumnSum: (2, lambda t: t.sum(2, keepdim=True)),
    m.ReduceFeatureChannelsMin: (1, lambda t: t.amin(1, keepdim=True)),
    m.ReduceFeatureChannelsMax: (1, lambda t: t.amax(1, keepdim=True)),
    m.ReduceFeatureChannelsMean: (1, lambda t: t.mean(1, keepdim=True)),
    m.ReduceFeatureChannelsSum: (1, lambda t: t.sum(1, keepdim=True)),
    m.ReduceFeatureChannelsArgumentMin: (1, lambda t: t.argmin(1, keepdim=True).double()),
    m.ReduceFeatureChannelsArgumentMax: (1, lambda t: t.argmax(1, keepdim=True).double()),
}
IDS = [k.__name__ for k in UNARY]


def _encode(dev, kernel, x, dst=None, batch=False):
    cb = dev.new_command_queue().command_buffer()
    if batch:
        out = kernel.encode_batch(
            cb, m.ImageBatch.from_tensor(x), None if dst is None else m.ImageBatch.from_tensor(dst)
        ).image
    else:
        out = kernel.encode(
            cb, m.Image.from_tensor(x), None if dst is None else m.Image.from_tensor(dst)
        )
    run(cb)
    return out.tensor


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("cls", list(UNARY), ids=IDS)
def test_unary_whole_image_matches_torch(cls, batch, device) -> None:
    gen = torch.Generator().manual_seed(20)
    x = torch.randn(3, 5, 4, 6, generator=gen, dtype=torch.float64)
    y = _encode(m.Device(device), cls(m.Device(device)), x.to(device), batch=batch)
    _, ref = UNARY[cls]
    want = ref(x)
    assert y.shape == want.shape
    assert_close(y, want, cls.__name__, tol=1e-14)


@pytest.mark.parametrize("cls", list(UNARY), ids=IDS)
def test_unary_source_clip_rect_destination_clip_and_channels(cls) -> None:
    gen = torch.Generator().manual_seed(21)
    dev = m.Device("cpu")
    x = torch.randn(3, 6, 7, 8, generator=gen, dtype=torch.float64)
    k = cls(dev)
    # region: images 1..2, rows 2..5 (4 rows, the clip rect runs past the image), columns 1..5
    k.clip_rect_source = m.Region.make(1, 2, 5, 9, z=1, depth=5)
    k.source_feature_channel_offset = 1
    k.source_feature_channel_max_count = 4
    k.offset = m.Offset(3, -2, 0)  # ignored: the source clip rect replaces it
    # returned: the region's size with the reduced axis 1
    y = _encode(dev, k, x)
    dim, ref = UNARY[cls]
    block = x[1:3, 1:5, 2:7, 1:6]
    assert_close(y, ref(block), f"{cls.__name__} region", tol=1e-14)
    # into a given destination: clip rect and channel offset; the rest untouched
    k.destination_feature_channel_offset = 2
    k.clip_rect = m.Region.make(1, 1, 3, 2, z=1, depth=1)
    dst = torch.randn(3, 7, 6, 9, generator=gen, dtype=torch.float64)
    out = _encode(dev, k, x, dst.clone())
    want = dst.clone()
    r = ref(block[:1])  # one image: the clip rect's depth
    nc = r.shape[1]
    rows = 1 if dim == 2 else 2
    cols = 1 if dim == 3 else 3
    want[1:2, 2 : 2 + nc, 1 : 1 + rows, 1 : 1 + cols] = r[:, :, :rows, :cols]
    assert_close(out, want, f"{cls.__name__} into a destination", tol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("cls", list(UNARY), ids=IDS)
def test_unary_storage_formats(cls, dtype) -> None:
    gen = torch.Generator().manual_seed(22)
    x = torch.randn(2, 5, 4, 6, generator=gen).to(dtype)
    y = _encode(m.Device("cpu"), cls(m.Device("cpu")), x)
    assert y.dtype == dtype
    _, ref = UNARY[cls]
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    assert_close(y, ref(x.double()), cls.__name__, tol=tol)


def test_argument_ties_give_the_first_index_counted_from_the_first_channel_read() -> None:
    dev = m.Device("cpu")
    x = torch.zeros(1, 6, 1, 3, dtype=torch.float64)
    x[0, :, 0, 0] = torch.tensor([9.0, 1.0, 5.0, 1.0, 5.0, 0.0])
    x[0, :, 0, 1] = 2.0  # all tied
    x[0, :, 0, 2] = torch.tensor([0.0, 3.0, 3.0, -1.0, -1.0, 9.0])
    for cls, want in (
        (m.ReduceFeatureChannelsArgumentMax, [1.0, 0.0, 0.0]),
        (m.ReduceFeatureChannelsArgumentMin, [0.0, 0.0, 2.0]),
    ):
        k = cls(dev)
        k.source_feature_channel_offset = 1
        k.source_feature_channel_max_count = 4  # channels 1..4
        assert _encode(dev, k, x).flatten().tolist() == want, cls.__name__


def test_feature_channels_sum_weight() -> None:
    gen = torch.Generator().manual_seed(23)
    dev = m.Device("cpu")
    x = torch.randn(2, 4, 3, 3, generator=gen, dtype=torch.float64)
    k = m.ReduceFeatureChannelsSum(dev)
    assert k.weight == 1.0
    k.weight = -0.5
    assert_close(_encode(dev, k, x), -0.5 * x.sum(1, keepdim=True), "weighted sum", tol=1e-14)
    with pytest.raises(
        TypeError, match=r"\[ReduceFeatureChannelsSum\] weight must be a number, got str"
    ):
        k.weight = "1"


def test_unary_errors() -> None:
    dev = m.Device("cpu")
    src = m.Image.from_tensor(torch.zeros(2, 3, 4, 5))
    cb = dev.new_command_queue().command_buffer()
    k = m.ReduceRowSum(dev)
    with pytest.raises(TypeError, match=r"\[ReduceRowSum\] clip_rect_source must be a Region"):
        k.clip_rect_source = (0, 0, 1, 1)
    k.clip_rect_source = m.Region.make(5, 0, 2, 2)
    with pytest.raises(
        ValueError,
        match=r"\[ReduceRowSum\] clip_rect_source must overlap the 2x5x4 \(images x width x "
        r"height\) source along x, got origin 5 and size 2",
    ):
        k.encode(cb, src)
    k.clip_rect_source = m.RECT_NO_CLIP
    k.clip_rect = m.Region.make(-1, 0, 3, 4)
    with pytest.raises(
        ValueError,
        match=r"\[ReduceRowSum\] the clip rect's x origin must be inside the destination .*got -1",
    ):
        k.encode(cb, src, m.Image.from_tensor(torch.zeros(2, 3, 4, 2)))
    k.clip_rect = m.Region.make(0, 7, 1, 4)
    with pytest.raises(
        ValueError, match=r"\[ReduceRowSum\] the clip rect must overlap the 6-pixel destination"
    ):
        k.encode(cb, src, m.Image.from_tensor(torch.zeros(2, 3, 6, 1)))
    k.clip_rect = m.Region.make(0, -5, 1, 9)
    with pytest.raises(
        ValueError,
        match=r"\[ReduceRowSum\] the clip rect must start inside the 4-pixel source region "
        r"along y, got 5 pixels past it",
    ):
        k.encode(cb, src, m.Image.from_tensor(torch.zeros(2, 3, 6, 1)))
    k.clip_rect = m.RECT_NO_CLIP
    with pytest.raises(
        ValueError, match=r"\[ReduceRowSum\] this kernel has no gradient state; destination_state"
    ):
        k.encode(cb, src, None, m.GradientState(dev))
    assert k.result_state(src) is None
    f = m.ReduceFeatureChannelsMax(dev)
    f.destination_feature_channel_offset = 1
    with pytest.raises(
        ValueError,
        match=r"destination_feature_channel_offset \+ 1 channels = 2, got a destination with 1",
    ):
        f.encode(cb, src, m.Image.from_tensor(torch.zeros(2, 1, 4, 5)))
    f.destination_feature_channel_offset = 0
    f.source_feature_channel_offset = 3
    with pytest.raises(
        ValueError,
        match=r"\[ReduceFeatureChannelsMax\] source_feature_channel_offset must be < the "
        r"source's 3 channels, got 3",
    ):
        f.encode(cb, src)
    run(cb)


# -- binary: feature channels and weights -----------------------------------------------------------


def _weighted_reference(x, w, mode):
    """Loop-level: per image and pixel, sum_c x w, then the mode's division."""
    n, c, h, wd = x.shape
    out = torch.zeros(n, 1, h, wd, dtype=torch.float64)
    for b in range(n):
        wb = w[b if w.shape[0] > 1 else 0]
        for i in range(h):
            for j in range(wd):
                ww = wb[:, i if wb.shape[1] > 1 else 0, j if wb.shape[2] > 1 else 0]
                s = sum(float(x[b, ch, i, j]) * float(ww[ch]) for ch in range(c))
                if mode == "mean":
                    s /= c
                elif mode == "non_zero":
                    nz = int((ww != 0).sum())
                    s = s / nz if nz else 0.0
                out[b, 0, i, j] = s
    return out


def _weights_kernel(dev, mode):
    if mode == "mean":
        return m.ReduceFeatureChannelsAndWeightsMean(dev)
    return m.ReduceFeatureChannelsAndWeightsSum(dev, mode == "non_zero")


def encode_binary(dev, k, x, w, dst=None, batch=False):
    """The result of one binary encode (``encode``, or ``encode_batch`` with ``batch``)."""
    cb = dev.new_command_queue().command_buffer()
    if batch:
        out = k.encode_batch(
            cb,
            m.ImageBatch.from_tensor(x),
            m.ImageBatch.from_tensor(w),
            None if dst is None else m.ImageBatch.from_tensor(dst),
        ).image
    else:
        out = k.encode(
            cb,
            m.Image.from_tensor(x),
            m.Image.from_tensor(w),
            None if dst is None else m.Image.from_tensor(dst),
        )
    run(cb)
    return out.tensor


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean", "non_zero"])
@pytest.mark.parametrize("weights", ["per_channel", "per_pixel", "shared"])
@pytest.mark.parametrize("batch", [False, True])
def test_weighted_channels_against_loops(batch, weights, mode, device) -> None:
    gen = torch.Generator().manual_seed(24)
    dev = m.Device(device)
    x = torch.randn(2, 4, 3, 5, generator=gen, dtype=torch.float64)
    shape = {"per_channel": (2, 4, 1, 1), "per_pixel": (2, 4, 3, 5), "shared": (1, 4, 1, 1)}
    w = torch.randn(shape[weights], generator=gen, dtype=torch.float64)
    w[w.abs() < 0.5] = 0.0  # some zero weights
    w[0, :, 0, 0] = 0.0  # a pixel (or every pixel) with no non-zero weight
    k = _weights_kernel(dev, mode)
    y = encode_binary(dev, k, x.to(device), w.to(device), batch=batch)
    assert_close(y, _weighted_reference(x, w, mode), f"{mode} {weights}", tol=1e-14)


def test_weighted_channels_regions_channels_and_destination() -> None:
    gen = torch.Generator().manual_seed(25)
    dev = m.Device("cpu")
    x = torch.randn(2, 6, 5, 7, generator=gen, dtype=torch.float64)
    w = torch.randn(1, 5, 3, 3, generator=gen, dtype=torch.float64)
    k = m.ReduceFeatureChannelsAndWeightsSum(dev)
    assert not k.do_weighted_sum_by_non_zero_weights
    k.primary_source_clip_rect = m.Region.make(2, 1, 4, 3, z=0, depth=2)
    k.secondary_source_clip_rect = m.Region.make(1, 2, 1, 1)  # one weight per channel
    k.primary_source_feature_channel_offset = 2
    k.secondary_source_feature_channel_offset = 1
    k.secondary_source_feature_channel_max_count = 4
    k.primary_offset = m.Offset(5, 5, 0)  # ignored: the clip rects replace the offsets
    y = encode_binary(dev, k, x, w)
    want = _weighted_reference(x[:, 2:6, 1:4, 2:6], w[:, 1:5, 2:3, 1:2], "sum")
    assert_close(y, want, "regions and channels", tol=1e-14)
    k.clip_rect = m.Region.make(1, -1, 9, 3, z=1, depth=1)
    k.destination_feature_channel_offset = 1
    dst = torch.randn(2, 2, 4, 6, generator=gen, dtype=torch.float64)
    out = encode_binary(dev, k, x, w, dst.clone())
    expect = dst.clone()
    expect[1:2, 1:2, 0:2, 1:5] = want[:1, :, 1:3, 0:4]  # rows from 1 past the clip origin
    assert_close(out, expect, "into a destination", tol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_weighted_channels_storage_formats(dtype) -> None:
    gen = torch.Generator().manual_seed(26)
    x = torch.randn(2, 8, 3, 4, generator=gen).to(dtype)
    w = torch.randn(2, 8, 1, 1, generator=gen).to(dtype)
    y = encode_binary(m.Device("cpu"), m.ReduceFeatureChannelsAndWeightsMean(m.Device("cpu")), x, w)
    assert y.dtype == dtype
    tol = {torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    want = (x.double() * w.double()).sum(1, keepdim=True) / 8
    assert_close(y, want, "weighted mean", tol=tol)


def test_binary_errors() -> None:
    dev = m.Device("cpu")
    x = m.Image.from_tensor(torch.zeros(2, 3, 4, 5))
    cb = dev.new_command_queue().command_buffer()
    k = m.ReduceFeatureChannelsAndWeightsMean(dev)
    with pytest.raises(
        TypeError,
        match=r"\[ReduceFeatureChannelsAndWeightsSum\] do_weighted_sum_by_non_zero_weights "
        r"must be a bool, got int",
    ):
        m.ReduceFeatureChannelsAndWeightsSum(dev, 1)
    with pytest.raises(
        TypeError,
        match=r"\[ReduceFeatureChannelsAndWeightsMean\] secondary_source_clip_rect must be a Region",
    ):
        k.secondary_source_clip_rect = None
    with pytest.raises(
        ValueError,
        match=r"the weights region must be 1x1 or the primary region's 5x4, got 5x1",
    ):
        k.encode(cb, x, m.Image.from_tensor(torch.zeros(2, 3, 1, 5)))
    with pytest.raises(
        ValueError,
        match=r"the secondary source must give as many channels as the primary \(3\), got 2",
    ):
        k.encode(cb, x, m.Image.from_tensor(torch.zeros(2, 2, 1, 1)))
    with pytest.raises(
        ValueError,
        match=r"the secondary source must give as many images as the primary \(3\) or one, got 2",
    ):
        k.encode_batch(
            cb,
            m.ImageBatch.from_tensor(torch.zeros(3, 3, 4, 5)),
            m.ImageBatch.from_tensor(torch.zeros(2, 3, 1, 1)),
        )
    with pytest.raises(
        ValueError,
        match=r"\[ReduceFeatureChannelsAndWeightsMean\] this kernel has no gradient \(MPS "
        r"defines none\), so no destination state: it must be None, got a state",
    ):
        k.encode(cb, x, m.Image.from_tensor(torch.zeros(1, 3, 1, 1)), None, m.GradientState(dev))
    k.primary_source_clip_rect = m.Region.make(0, 0, 2, 2, z=2, depth=1)
    with pytest.raises(
        ValueError, match=r"primary_source_clip_rect must overlap the 2x5x4 .* along z \(images\)"
    ):
        k.encode(cb, x, m.Image.from_tensor(torch.zeros(1, 3, 1, 1)))
    k.primary_source_clip_rect = m.RECT_NO_CLIP
    k.primary_source_feature_channel_offset = 3
    with pytest.raises(
        ValueError,
        match=r"primary_source_feature_channel_offset must be < the primary source's 3 "
        r"channels, got 3",
    ):
        k.encode(cb, x, m.Image.from_tensor(torch.zeros(1, 3, 1, 1)))
    k.primary_source_feature_channel_offset = 0
    with pytest.raises(ValueError, match=r"the destination batch must hold 2 images, got 1"):
        k.encode_batch(
            cb,
            m.ImageBatch(x),
            m.ImageBatch.from_tensor(torch.zeros(1, 3, 1, 1)),
            m.ImageBatch.from_tensor(torch.zeros(1, 1, 4, 5)),
        )
    k.clip_rect = m.Region.make(0, 0, 5, 4, z=3, depth=1)
    with pytest.raises(
        ValueError,
        match=r"the clip rect's z range \(origin 3, depth 1\) must select at least one of the "
        r"destination's 2 images, got none",
    ):
        k.encode(
            cb,
            x,
            m.Image.from_tensor(torch.zeros(1, 3, 1, 1)),
            m.Image.from_tensor(torch.zeros(2, 1, 4, 5)),
        )
    run(cb)
