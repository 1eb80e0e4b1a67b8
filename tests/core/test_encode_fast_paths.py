"""The encode path's per-configuration caches and fast paths give what the general path gives:
F.conv2d's compact arguments, the compute dtype decided at encode, kernel attributes changed
without bumping the configuration, and the geometry a failed encode restores."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from mpsnn.cnn.neuron_descriptor import FusedNeuron
from mpsnn.ops.convolution import _conv2d_args
from tests.helpers import run

F32 = m.FeatureChannelFormat.FLOAT32


def _conv(cin: int = 2, cout: int = 3, k: int = 3, **kw) -> m.Convolution:
    desc = m.ConvolutionDescriptor(k, k, cin, cout, **kw)
    g = torch.Generator().manual_seed(0)
    ds = m.TensorConvolutionDataSource(
        desc, torch.randn(desc.weights_shape, generator=g), torch.randn(cout, generator=g)
    )
    return m.Convolution(m.Device("cpu"), ds)


def _encode(conv: m.Convolution, x: torch.Tensor) -> torch.Tensor:
    cb = m.Device("cpu").new_command_queue().command_buffer()
    out = conv.encode(cb, m.Image.from_tensor(x))
    run(cb)
    return out.tensor


@pytest.mark.parametrize(
    ("stride", "pads", "dilation", "groups"),
    [
        ((1, 1), (1, 1), (1, 1), 1),
        ((1, 1), (0, 0), (1, 1), 1),
        ((2, 1), (0, 2), (1, 1), 1),
        ((1, 1), (0, 0), (2, 2), 1),
        ((1, 1), (1, 1), (1, 2), 2),
        ((2, 2), (0, 0), (1, 1), 2),
    ],
)
def test_compact_conv2d_arguments_match_the_full_ones(stride, pads, dilation, groups) -> None:
    x = torch.randn(2, 4, 9, 8, dtype=torch.float64)
    w = torch.randn(6, 4 // groups, 3, 3, dtype=torch.float64)
    args = _conv2d_args(stride, pads, dilation, groups)
    assert len(args) <= 4
    full = F.conv2d(x, w, None, stride, pads, dilation, groups)
    assert torch.equal(F.conv2d(x, w, None, *args), full)


def test_a_neuron_set_directly_is_read_by_the_next_encode() -> None:
    """A graph sets ``_neuron`` without bumping ``_config``: the cached plan and op must not
    keep the old forward."""
    conv = _conv()
    x = torch.randn(1, 2, 6, 5)
    plain = _encode(conv, x)
    assert (plain < 0).any()
    relu = m.NeuronDescriptor(m.NeuronType.RELU)
    conv._neuron = FusedNeuron.of("Convolution", relu)
    assert torch.equal(_encode(conv, x), plain.clamp_min(0))
    conv._neuron = None
    assert torch.equal(_encode(conv, x), plain)


def _encode_into(conv: m.Convolution, x: torch.Tensor) -> torch.Tensor:
    cb = m.Device("cpu").new_command_queue().command_buffer()
    dst = m.Image(m.Device("cpu"), m.ImageDescriptor(F32, 5, 6, 3, 1))
    conv.encode(cb, m.Image.from_tensor(x), dst)
    run(cb)
    return dst.tensor


def test_an_offset_set_directly_is_read_by_the_next_encode() -> None:
    """The padding policy and ConvolutionTranspose set ``_offset`` without bumping
    ``_config``: an encode after that must use the new offset, as after a public set."""
    x = torch.randn(1, 2, 6, 5)
    conv, fresh = _conv(), _conv()
    first = _encode_into(conv, x)
    conv._offset = m.Offset(2, 1, 0)
    fresh.offset = m.Offset(2, 1, 0)
    shifted = _encode_into(conv, x)
    assert not torch.equal(shifted, first)
    assert torch.equal(shifted, _encode_into(fresh, x))


class _WiderAllocator:
    """Returns float32 images whatever the descriptor says (the compute dtype decided at encode
    from the descriptor must give way to the image's own format when the command runs)."""

    def image(self, command_buffer, descriptor, kernel):
        d = descriptor.copy()
        d.channel_format = F32
        return m.Image(command_buffer.device, d)


def _float32_conv(conv: m.Convolution, x: torch.Tensor) -> torch.Tensor:
    """PyTorch's float32 convolution of ``x``, on operands in the layout mpsnn runs CPU
    float32 convolutions in (channels-last: oneDNN's kernels for it round alike)."""
    cl = torch.channels_last
    w = conv.weights.permute(0, 3, 1, 2)  # OHWI memory: channels-last OIHW
    return F.conv2d(x.float().contiguous(memory_format=cl), w, conv.biases, padding=1)


def test_an_allocator_of_another_format_gets_the_wider_compute_dtype() -> None:
    conv = _conv()
    x = torch.randn(1, 2, 6, 5).half()
    conv.destination_image_allocator = _WiderAllocator()
    out = _encode(conv, x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _float32_conv(conv, x), rtol=0, atol=0)


def test_mixed_formats_of_a_given_destination_compute_in_the_wider_one() -> None:
    conv = _conv()
    x = torch.randn(1, 2, 6, 5).half()
    cb = m.Device("cpu").new_command_queue().command_buffer()
    dst = m.Image(m.Device("cpu"), m.ImageDescriptor(F32, 5, 6, 3, 1))
    conv.encode(cb, m.Image.from_tensor(x), dst)
    run(cb)
    torch.testing.assert_close(dst.tensor, _float32_conv(conv, x), rtol=0, atol=0)


def test_a_failed_transpose_encode_restores_every_saved_attribute() -> None:
    desc = m.ConvolutionDescriptor(3, 3, 2, 2, stride_in_pixels_x=2, stride_in_pixels_y=2)
    ds = m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape))
    t = m.ConvolutionTranspose(m.Device("cpu"), ds)
    assert len(t._save_geometry()[1]) == len(t._geometry_attrs) == 8
    t.kernel_offset_x, t.kernel_offset_y = 5, -3
    before = t._save_geometry()
    cb = m.Device("cpu").new_command_queue().command_buffer()
    bad = m.Image.from_tensor(torch.randn(1, 3, 4, 4))  # 3 channels: the transpose reads 2
    with pytest.raises(ValueError, match=r"input_feature_channels=2"):
        t.encode(cb, bad)
    assert t._save_geometry() == before and len(cb) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="completion events exist on CUDA")
def test_completion_events_are_reused_after_the_caller_saw_them_fire() -> None:
    dev = m.Device("cuda")
    q = dev.new_command_queue()
    x = m.Image.from_tensor(torch.randn(1, 2, 4, 4, device="cuda"))
    neuron = m.Neuron(dev, m.NeuronDescriptor(m.NeuronType.ABSOLUTE))
    cb = q.command_buffer()
    first = neuron.encode(cb, x)
    cb.commit()
    event = cb._event
    cb.wait_until_completed()
    assert q._spare_events == [event] and cb._event is None
    assert cb.status is m.CommandBufferStatus.COMPLETED  # no event needed any more
    cb2 = q.command_buffer()
    second = neuron.encode(cb2, x)
    cb2.commit()
    assert cb2._event is event and q._spare_events == []  # recorded again
    while cb2.status is not m.CommandBufferStatus.COMPLETED:  # polling also hands it back
        pass
    assert q._spare_events == [event]
    assert torch.equal(first.tensor, second.tensor)
    with_handler = q.command_buffer()
    neuron.encode(with_handler, x)
    with_handler.add_completed_handler(lambda _: None)
    with_handler.commit()
    with_handler.wait_until_completed()  # its completion thread keeps its own event
    assert with_handler._event is event and q._spare_events == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the layout policy is CUDA's")
def test_half_precision_weight_casts_take_the_layout_their_kernel_reads() -> None:
    """Convolutions get channels-last bfloat16 casts (cuDNN's layout); a fully connected layer
    keeps OIHW-contiguous ones (it reads them as a matrix view)."""
    dev = m.Device("cuda")
    desc = m.ConvolutionDescriptor(3, 3, 4, 6)
    ds = m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape), torch.randn(6))
    conv, fc = m.Convolution(dev, ds), m.FullyConnected(dev, ds)
    w_conv, _ = conv._weights.cast(torch.bfloat16)
    w_fc, _ = fc._weights.cast(torch.bfloat16)
    assert w_conv.is_contiguous(memory_format=torch.channels_last) and not w_conv.is_contiguous()
    assert w_fc.is_contiguous()
    assert torch.equal(w_conv, w_fc)  # the same values
