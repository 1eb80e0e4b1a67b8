"""Padding policies: output size and offset for every size rule, alignment and remainder, odd
and even effective kernels, strides 1-3; TensorFlow SAME equivalence; custom policies."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.helpers import assert_close, run

P = m.PaddingMethod
ALIGN = {
    "centered": P.ALIGN_CENTERED,
    "top_left": P.ALIGN_TOP_LEFT,
    "bottom_right": P.ALIGN_BOTTOM_RIGHT,
}
REMAINDER = {
    "tl": P.ADD_REMAINDER_TO_TOP_LEFT,
    "tr": P.ADD_REMAINDER_TO_TOP_RIGHT,
    "bl": P.ADD_REMAINDER_TO_BOTTOM_LEFT,
    "br": P.ADD_REMAINDER_TO_BOTTOM_RIGHT,
}
SIZE = {"valid": (P.SIZE_VALID_ONLY, -1), "same": (P.SIZE_SAME, 0), "full": (P.SIZE_FULL, 1)}


def _conv(k: tuple[int, int], s: tuple[int, int], d: tuple[int, int]) -> m.Convolution:
    desc = m.ConvolutionDescriptor(k[0], k[1], 1, 1, s[0], s[1], d[0], d[1])
    return m.Convolution(
        m.Device("cpu"), m.TensorConvolutionDataSource(desc, torch.ones(desc.weights_shape))
    )


def _before(method_bits: int, pad: int, remainder_first: bool) -> int:
    """Padding placed before the image, by the rule's words (not its formula)."""
    if method_bits == ALIGN["top_left"]:
        return 0  # all padding bottom/right
    if method_bits == ALIGN["bottom_right"]:
        return pad  # all padding top/left
    half, odd = divmod(pad, 2)  # centred: the odd pixel goes where the remainder flag says
    return half + (odd if remainder_first else 0)


@pytest.mark.parametrize("size", SIZE, ids=str)
@pytest.mark.parametrize("align", ALIGN, ids=str)
@pytest.mark.parametrize("rem", REMAINDER, ids=str)
def test_size_and_offset_for_every_policy(size: str, align: str, rem: str) -> None:
    bits, style = SIZE[size]
    method = bits | ALIGN[align] | REMAINDER[rem]
    x_first = rem in ("tl", "bl")  # remainder to the left
    y_first = rem in ("tl", "tr")  # remainder to the top
    checked = 0
    for kx, ky, dx, dy, sx, sy in itertools.product(
        (1, 2, 3, 4), (1, 2, 3), (1, 2), (1, 2), (1, 2, 3), (1, 3)
    ):
        conv = _conv((kx, ky), (sx, sy), (dx, dy))
        conv.padding = m.DefaultPadding(method)
        for w, h in ((7, 5), (8, 9), (4, 6)):
            ex, ey = dx * (kx - 1) + 1, dy * (ky - 1) + 1
            want_w = -(-(w + style * (ex - 1)) // sx)
            want_h = -(-(h + style * (ey - 1)) // sy)
            src = m.Image.from_tensor(torch.zeros(1, 1, h, w))
            if want_w < 1 or want_h < 1:
                with pytest.raises(
                    ValueError, match=r"\[Convolution\] the padding policy gives an empty"
                ):
                    conv.destination_image_descriptor([src])
                continue
            desc = conv.destination_image_descriptor([src])
            assert (desc.width, desc.height, desc.feature_channels) == (want_w, want_h, 1)
            for n_out, size_in, e, s, off, first in (
                (want_w, w, ex, sx, conv.offset.x, x_first),
                (want_h, h, ey, sy, conv.offset.y, y_first),
            ):
                pad = (n_out - 1) * s + e - size_in  # total padding the windows need
                before = _before(int(ALIGN[align]), pad, first)
                # the first window starts `before` pixels before the image ...
                assert off - e // 2 == -before, (kx, ky, dx, dy, sx, sy, w, h)
                # ... and the last one ends `pad - before` pixels after it
                assert off - e // 2 + (n_out - 1) * s + e - size_in == pad - before
            checked += 1
    assert checked > 400


def test_same_policy_matches_tensorflow_same_padding() -> None:
    """TF SAME = centred, remainder bottom-right: pad_top = P // 2, the extra pixel at the end."""
    gen = torch.Generator().manual_seed(31)
    dev = m.Device("cpu")
    for k, s, n in ((3, 2, 8), (4, 1, 7), (2, 2, 9), (5, 3, 10), (4, 3, 11)):
        desc = m.ConvolutionDescriptor(k, k, 2, 3, s, s)
        w = torch.randn(desc.weights_shape, generator=gen, dtype=torch.float64)
        conv = m.Convolution(dev, m.TensorConvolutionDataSource(desc, w))
        conv.padding = m.DefaultPadding(
            P.ALIGN_CENTERED | P.ADD_REMAINDER_TO_BOTTOM_RIGHT | P.SIZE_SAME
        )
        x = torch.randn(1, 2, n, n, generator=gen, dtype=torch.float64)
        cb = m.Device("cpu").new_command_queue().command_buffer()
        y = conv.encode(cb, m.Image.from_tensor(x))
        run(cb)
        out = -(-n // s)
        pad = max((out - 1) * s + k - n, 0)
        top = pad // 2
        want = F.conv2d(F.pad(x, (top, pad - top, top, pad - top)), w.permute(0, 3, 1, 2), stride=s)
        assert_close(y.tensor, want, f"TF SAME k{k} s{s} n{n}", tol=1e-13)


def test_valid_policy_aligned_top_left_matches_unpadded_torch() -> None:
    """Torch's unpadded convolution starts at pixel 0 and drops the leftover at the end: that
    is VALID with ALIGN_TOP_LEFT (ALIGN_CENTERED would centre the windows over the image)."""
    gen = torch.Generator().manual_seed(32)
    dev = m.Device("cpu")
    for k, s, n in ((3, 2, 8), (3, 2, 9), (2, 3, 10), (5, 1, 7)):
        desc = m.ConvolutionDescriptor(k, k, 1, 2, s, s)
        w = torch.randn(desc.weights_shape, generator=gen, dtype=torch.float64)
        conv = m.Convolution(dev, m.TensorConvolutionDataSource(desc, w))
        conv.padding = m.DefaultPadding(P.SIZE_VALID_ONLY | P.ALIGN_TOP_LEFT)
        x = torch.randn(1, 1, n, n, generator=gen, dtype=torch.float64)
        cb = dev.new_command_queue().command_buffer()
        y = conv.encode(cb, m.Image.from_tensor(x))
        run(cb)
        assert_close(
            y.tensor,
            F.conv2d(x, w.permute(0, 3, 1, 2), stride=s),
            f"VALID k{k} s{s} n{n}",
            tol=1e-13,
        )


def test_fully_connected_defaults_to_valid_and_one_pixel() -> None:
    fc = m.FullyConnected(
        m.Device("cpu"),
        m.TensorConvolutionDataSource(m.ConvolutionDescriptor(4, 3, 2, 5), torch.ones(5, 3, 4, 2)),
    )
    assert fc.padding.padding_method.size_style == -1
    desc = fc.destination_image_descriptor([m.Image.from_tensor(torch.zeros(2, 2, 3, 4))])
    assert (desc.width, desc.height, desc.feature_channels, desc.number_of_images) == (1, 1, 5, 2)


def test_tensorflow_average_pooling_policy_switches_to_clamp() -> None:
    conv = _conv((3, 3), (1, 1), (1, 1))
    conv.padding = m.DefaultPadding.tensorflow_average_pooling()
    assert conv.padding.padding_method & P.CUSTOM
    assert conv.edge_mode is m.EdgeMode.ZERO
    conv.destination_image_descriptor([m.Image.from_tensor(torch.zeros(1, 1, 5, 5))])
    assert conv.edge_mode is m.EdgeMode.CLAMP
    valid = m.DefaultPadding.tensorflow_average_pooling_valid_only()
    assert valid.padding_method.size_style == -1


class _FixedSize:
    """A custom policy: always a 3x2 result whose first window is centred at (1, 1)."""

    padding_method = P.CUSTOM | P.SIZE_SAME

    def destination_image_descriptor(
        self, source_images, source_states, kernel, suggested_descriptor
    ):
        kernel.offset = m.Offset(1, 1, 0)
        desc = suggested_descriptor.copy()
        desc.width, desc.height = 3, 2
        return desc


def test_custom_padding_object_decides_size_and_offset() -> None:
    gen = torch.Generator().manual_seed(33)
    dev = m.Device("cpu")
    desc = m.ConvolutionDescriptor(3, 3, 1, 1)
    w = torch.randn(desc.weights_shape, generator=gen, dtype=torch.float64)
    conv = m.Convolution(dev, m.TensorConvolutionDataSource(desc, w))
    conv.padding = _FixedSize()
    x = torch.randn(1, 1, 6, 6, generator=gen, dtype=torch.float64)
    cb = dev.new_command_queue().command_buffer()
    y = conv.encode(cb, m.Image.from_tensor(x))
    run(cb)
    assert y.shape == (1, 1, 2, 3) and conv.offset == m.Offset(1, 1, 0)
    want = F.conv2d(x, w.permute(0, 3, 1, 2))[:, :, :2, :3]  # centre (1, 1) = no padding
    assert_close(y.tensor, want, "custom policy", tol=1e-13)


def test_padding_validation_messages() -> None:
    with pytest.raises(
        ValueError, match=r"\[DefaultPadding\] the alignment must not be ALIGN_RESERVED"
    ):
        m.DefaultPadding(P.ALIGN_RESERVED)
    with pytest.raises(ValueError, match=r"\[PaddingMethod\] the size field must be"):
        m.DefaultPadding(P.SIZE_RESERVED)
    with pytest.raises(TypeError, match=r"\[Convolution\] padding must have a padding_method"):
        _conv((1, 1), (1, 1), (1, 1)).padding = "same"


@pytest.mark.parametrize(
    "make",
    [lambda d: m.Neuron(d, m.NeuronDescriptor(m.NeuronType.RELU)), m.Add],
    ids=["unary", "binary"],
)
def test_destination_properties_are_validated_alike(make) -> None:
    """Unary and binary kernels share the destination-side properties and their checks."""
    kernel = make(m.Device("cpu"))
    name = type(kernel).__name__
    with pytest.raises(TypeError, match=rf"\[{name}\] clip_rect must be a Region, got tuple"):
        kernel.clip_rect = (0, 0, 1, 1)
    with pytest.raises(ValueError, match=rf"\[{name}\] destination_feature_channel_offset must"):
        kernel.destination_feature_channel_offset = -4
    with pytest.raises(TypeError, match=rf"\[{name}\] padding must have a padding_method"):
        kernel.padding = "same"
    with pytest.raises(TypeError, match=rf"\[{name}\] destination_image_allocator must have an"):
        kernel.destination_image_allocator = object()
    kernel.clip_rect = m.Region.make(1, 2, 3, 4)
    kernel.destination_feature_channel_offset = 8
    assert kernel.clip_rect == m.Region.make(1, 2, 3, 4)
    assert kernel.destination_feature_channel_offset == 8


def test_geometry_value_types_validate_their_fields() -> None:
    with pytest.raises(TypeError, match=r"\[Offset\] y must be an int, got float"):
        m.Offset(0, 1.5)
    with pytest.raises(ValueError, match=r"\[Size\] height must be >= 0, got -1"):
        m.Size(2, -1)
    with pytest.raises(ValueError, match=r"\[ImageCoordinate\] channel must be >= 0, got -3"):
        m.ImageCoordinate(1, 1, -3)
    with pytest.raises(TypeError, match=r"\[Region\] size must be a Size, got tuple"):
        m.Region(m.Origin(), (1, 1, 1))
    assert m.Offset(-2, 3) == m.Offset(-2, 3, 0) and m.Offset(-2, 3).x == -2  # signed is fine
    assert m.ImageCoordinate(1, 2, 3).channel == 3
