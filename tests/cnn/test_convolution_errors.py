"""Bad convolution input gets a clear error before anything is recorded."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m

CPU = m.Device("cpu")


def _ds(k=3, cin=4, cout=6, **kw) -> m.TensorConvolutionDataSource:
    desc = m.ConvolutionDescriptor(k, k, cin, cout, **kw)
    return m.TensorConvolutionDataSource(desc, torch.randn(desc.weights_shape), torch.randn(cout))


def _img(*shape) -> m.Image:
    return m.Image.from_tensor(torch.randn(*shape))


def _cb() -> m.CommandBuffer:
    return CPU.new_command_queue().command_buffer()


def test_descriptor_sizes_must_be_positive_and_groups_must_divide() -> None:
    with pytest.raises(
        ValueError, match=r"\[ConvolutionDescriptor\] kernel_width must be positive, got 0"
    ):
        m.ConvolutionDescriptor(0, 3, 1, 1)
    with pytest.raises(
        ValueError, match=r"\[ConvolutionDescriptor\] stride_in_pixels_y must be positive, got -1"
    ):
        m.ConvolutionDescriptor(3, 3, 1, 1, stride_in_pixels_y=-1)
    with pytest.raises(
        ValueError, match=r"\[ConvolutionDescriptor\] dilation_rate_x must be positive, got 0"
    ):
        m.ConvolutionDescriptor(3, 3, 1, 1, dilation_rate_x=0)
    with pytest.raises(
        TypeError, match=r"\[ConvolutionDescriptor\] kernel_height must be an int, got float 3.0"
    ):
        m.ConvolutionDescriptor(3, 3.0, 1, 1)
    with pytest.raises(
        ValueError,
        match=r"\[ConvolutionDescriptor\] groups must divide input_feature_channels and output_feature_channels, got groups=3 with 4 input and 6 output channels",
    ):
        m.ConvolutionDescriptor(3, 3, 4, 6, groups=3)
    desc = m.ConvolutionDescriptor(3, 3, 4, 6, groups=2)
    desc.groups = 4  # a later change is caught when a kernel reads the data source
    with pytest.raises(ValueError, match=r"\[TensorConvolutionDataSource\] groups must divide"):
        m.TensorConvolutionDataSource(desc, torch.zeros(6, 3, 3, 1))


def test_weights_and_biases_of_the_wrong_shape() -> None:
    desc = m.ConvolutionDescriptor(3, 3, 4, 6, groups=2)
    with pytest.raises(
        ValueError,
        match=r"\[TensorConvolutionDataSource\] weights must have the OHWI shape \(6, 3, 3, 2\) \(output channels, kernel height, kernel width, input channels / groups\), got \(6, 4, 3, 3\)",
    ):
        m.TensorConvolutionDataSource(desc, torch.zeros(6, 4, 3, 3))
    with pytest.raises(
        ValueError,
        match=r"\[TensorConvolutionDataSource\] biases must have shape \(6,\), got \(4,\)",
    ):
        m.TensorConvolutionDataSource(desc, torch.zeros(6, 3, 3, 2), torch.zeros(4))
    with pytest.raises(
        TypeError,
        match=r"\[TensorConvolutionDataSource\] weights must hold floating-point values, got torch.int64",
    ):
        m.TensorConvolutionDataSource(desc, torch.zeros(6, 3, 3, 2, dtype=torch.int64))

    class Bad(m.ConvolutionDataSource):
        def descriptor(self):
            return desc

        def weights(self):
            return torch.zeros(6, 3, 3, 4)

        def bias_terms(self):
            return None

    with pytest.raises(
        ValueError, match=r"\[Convolution\] weights must have the OHWI shape \(6, 3, 3, 2\)"
    ):
        m.Convolution(CPU, Bad())
    with pytest.raises(
        TypeError,
        match=r"\[Convolution\] weights must be a ConvolutionDataSource \(with descriptor\(\), weights\(\) and bias_terms\(\)\), got Tensor",
    ):
        m.Convolution(CPU, torch.zeros(6, 3, 3, 2))


def test_channel_count_mismatch() -> None:
    conv = m.Convolution(CPU, _ds(cin=4))
    cb = _cb()
    with pytest.raises(
        ValueError,
        match=r"\[Convolution\] the source must provide input_feature_channels=4 channels \(after source_feature_channel_offset=0 and source_feature_channel_max_count\), got 5",
    ):
        conv.encode(cb, _img(1, 5, 6, 6))
    conv.source_feature_channel_offset = 2
    with pytest.raises(ValueError, match=r"got 2"):
        conv.encode(cb, _img(1, 4, 6, 6))
    conv.source_feature_channel_offset = 7
    with pytest.raises(
        ValueError,
        match=r"\[Convolution\] source_feature_channel_offset must be < the source's 4 channels, got 7",
    ):
        conv.encode(cb, _img(1, 4, 6, 6), _img(1, 6, 6, 6))
    assert len(cb) == 0


def test_destination_too_small_for_its_channel_offset() -> None:
    conv = m.Convolution(CPU, _ds())
    conv.destination_feature_channel_offset = 3
    cb = _cb()
    with pytest.raises(
        ValueError,
        match=r"\[Convolution\] the destination needs destination_feature_channel_offset \+ 6 channels = 9, got a destination with 8",
    ):
        conv.encode(cb, _img(1, 4, 6, 6), _img(1, 8, 6, 6))
    assert len(cb) == 0


def test_clip_rect_and_image_ranges() -> None:
    conv = m.Convolution(CPU, _ds())
    cb = _cb()
    conv.clip_rect = m.Region.make(6, 0, 2, 2)
    with pytest.raises(
        ValueError,
        match=r"\[Convolution\] the clip rect must overlap the 6-pixel destination along x, got origin 6 and size 2",
    ):
        conv.encode(cb, _img(1, 4, 6, 6), _img(1, 6, 6, 6))
    conv.clip_rect = m.RECT_NO_CLIP
    conv.offset = m.Offset(0, 0, 2)
    with pytest.raises(
        ValueError,
        match=r"\[Convolution\] offset.z \(2\) and the clip rect's z range .* must select at least one image of the 2-image source",
    ):
        conv.encode(cb, _img(2, 4, 6, 6), _img(2, 6, 6, 6))
    conv.offset = m.Offset(0, 0, -1)
    with pytest.raises(
        ValueError,
        match=r"\[Convolution\] offset.z and clip_rect.origin.z must be >= 0, got -1 and 0",
    ):
        conv.encode(cb, _img(2, 4, 6, 6), _img(2, 6, 6, 6))
    with pytest.raises(TypeError, match=r"\[Offset\] x must be an int, got float 1.5"):
        m.Offset(1.5, 0, 0)
    with pytest.raises(TypeError, match=r"\[Convolution\] offset must be a Offset, got tuple"):
        conv.offset = (1, 1, 0)
    assert len(cb) == 0


def test_properties_reject_bad_values() -> None:
    conv = m.Convolution(CPU, _ds())
    with pytest.raises(
        ValueError, match=r"\[Convolution\] destination_feature_channel_offset must be >= 0, got -1"
    ):
        conv.destination_feature_channel_offset = -1
    with pytest.raises(
        ValueError, match=r"\[Convolution\] source_feature_channel_max_count must be >= 1, got 0"
    ):
        conv.source_feature_channel_max_count = 0
    with pytest.raises(
        ValueError, match=r"\[Convolution\] edge_mode must be one of ZERO, CLAMP, got MIRROR"
    ):
        conv.edge_mode = m.EdgeMode.MIRROR
    with pytest.raises(AttributeError):
        conv.stride_in_pixels_x = 2  # read-only, as in MPS


def test_destination_must_not_alias_the_source() -> None:
    conv = m.Convolution(CPU, _ds(cin=6))
    x = _img(1, 6, 5, 5)
    with pytest.raises(
        ValueError,
        match=r"\[Convolution\] destination_image must not alias an input \(MPS forbids in-place encodes\), got the same image",
    ):
        conv.encode(_cb(), x, x)


def test_mismatched_gradient_and_forward() -> None:
    ds = _ds()
    conv = m.Convolution(CPU, ds)
    x = _img(1, 4, 6, 6)
    cb = _cb()
    state = conv.result_state(x)
    y = conv.encode(cb, x, destination_state=state)
    other = m.ConvolutionGradient(CPU, _ds(k=5))
    with pytest.raises(
        ValueError,
        match=r"\[ConvolutionGradient\] the gradient's data source must describe the forward kernel \(ConvolutionDescriptor\(3x3, 4->6",
    ):
        other.encode(cb, y, x, state)
    fc_ds = m.TensorConvolutionDataSource(
        m.ConvolutionDescriptor(6, 6, 4, 6), torch.zeros(6, 6, 6, 4)
    )
    fc_state = m.FullyConnected(CPU, fc_ds).result_state(x)
    m.FullyConnected(CPU, fc_ds).encode(cb, x, destination_state=fc_state)
    with pytest.raises(
        ValueError,
        match=r"\[ConvolutionGradient\] gradient_state must come from a Convolution encode, got one from FullyConnected",
    ):
        m.ConvolutionGradient(CPU, fc_ds).encode(cb, y, x, fc_state)
    grad = m.ConvolutionGradient(CPU, ds)
    with pytest.raises(
        ValueError,
        match=r"\[ConvolutionGradient\] source_gradient must have the forward destination's shape 6x6x6 \(width x height x channels\) and at least 1 images, got 5x6x6 with 1 images",
    ):
        grad.encode(cb, _img(1, 6, 6, 5), x, state)
    with pytest.raises(
        ValueError,
        match=r"\[ConvolutionGradient\] source_image must have the forward source's shape 6x6x4",
    ):
        grad.encode(cb, y, _img(1, 3, 6, 6), state)
    with pytest.raises(
        ValueError,
        match=r"\[ConvolutionGradient\] destination_gradient must be 6x6 \(the forward source\)",
    ):
        grad.encode(cb, y, x, state, _img(1, 4, 5, 5))
    grad.kernel_offset_x = 3
    with pytest.raises(
        m.UnsupportedError,
        match=r"\[ConvolutionGradient\] kernel_offset_x must match the forward encode recorded in the gradient state \(0\), got 3",
    ):
        grad.encode(cb, y, x, state)
    grad.kernel_offset_x = 0  # agreeing with the state is fine
    assert grad.encode(cb, y, x, state).shape == x.shape
    assert len(cb) == 3


def test_fused_neuron_must_be_a_shared_parameter_neuron_and_optimizers_must_be_optimizers() -> None:
    def conv(neuron):
        desc = m.ConvolutionDescriptor(1, 1, 1, 1, fused_neuron_descriptor=neuron)
        return m.Convolution(CPU, m.TensorConvolutionDataSource(desc, torch.zeros(1, 1, 1, 1)))

    with pytest.raises(
        TypeError,
        match=r"\[Convolution\] fused_neuron_descriptor must be a NeuronDescriptor or None, got str",
    ):
        conv("relu")
    with pytest.raises(
        ValueError,
        match=r"\[Convolution\] a fused neuron must have parameters shared by all channels, got PRELU",
    ):
        conv(m.NeuronDescriptor(m.NeuronType.PRELU, data=[0.1]))
    assert (
        conv(m.NeuronDescriptor(m.NeuronType.NONE)).fused_neuron_descriptor.neuron_type
        is m.NeuronType.NONE
    )
    with pytest.raises(
        TypeError,
        match=r"\[TensorConvolutionDataSource\] optimizer must be an mpsnn optimizer \(SGD, RMSProp or Adam\) or None, got object",
    ):
        m.TensorConvolutionDataSource(
            m.ConvolutionDescriptor(1, 1, 1, 1), torch.zeros(1, 1, 1, 1), optimizer=object()
        )


def test_fully_connected_constraints() -> None:
    with pytest.raises(
        ValueError,
        match=r"\[FullyConnected\] strides, dilations and groups must be 1, got stride=\(2, 1\)",
    ):
        m.FullyConnected(CPU, _ds(stride_in_pixels_x=2))
    fc = m.FullyConnected(CPU, _ds(k=4))
    with pytest.raises(
        ValueError,
        match=r"\[FullyConnected\] the source must be at least the kernel size 4x4, got 3x3",
    ):
        fc.encode(_cb(), _img(1, 4, 3, 3))
