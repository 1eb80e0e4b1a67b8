"""The UNORM8 storage format: uint8 bytes ``k`` that read as ``k/255``.

Descriptor and format round trips, byte I/O (raw bytes in and out, float values rounded and
clamped, both layouts), kernels reading a UNORM8 source exactly as they read the float32 image
``k/255`` (bitwise on the CPU), FLOAT32 returned destinations, UNORM8 destinations, errors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mpsnn as m
from tests.helpers import run

U8 = m.FeatureChannelFormat.UNORM8
F32 = m.FeatureChannelFormat.FLOAT32
HWC = m.DataLayout.HEIGHT_WIDTH_FEATURE_CHANNELS
CHW = m.DataLayout.FEATURE_CHANNELS_HEIGHT_WIDTH
LT, RT = m.LossType, m.ReductionType


def _bytes(*shape: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)


def _pair(*shape: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A uint8 tensor and the float32 values it reads as."""
    k = _bytes(*shape, seed=seed)
    return k, k.float() / 255


def _cb(dev: m.Device) -> m.CommandBuffer:
    return dev.new_command_queue().command_buffer()


def _unorm8(v: torch.Tensor) -> torch.Tensor:
    return torch.round(torch.clamp(v.float(), 0, 1) * 255).to(torch.uint8)


# -- format, descriptor, construction --------------------------------------------------------


def test_format_and_descriptor_round_trips() -> None:
    assert int(U8) == 1 and U8.dtype == torch.uint8
    assert m.FeatureChannelFormat.from_dtype(torch.uint8) is U8
    for fmt in m.FeatureChannelFormat:
        assert m.FeatureChannelFormat.from_dtype(fmt.dtype) is fmt
    d = m.ImageDescriptor(U8, 5, 4, 3, 2)
    assert d.channel_format is U8 and d.copy() == d and d != m.ImageDescriptor(F32, 5, 4, 3, 2)
    assert (
        repr(d)
        == "ImageDescriptor(UNORM8, width=5, height=4, feature_channels=3, number_of_images=2)"
    )
    im = m.Image(m.Device("cpu"), d)
    assert im.feature_channel_format is U8 and im.dtype == torch.uint8
    assert im.descriptor == d
    assert im.tensor.dtype == torch.uint8 and im.tensor.shape == (2, 3, 4, 5)
    assert not im.tensor.any()


def test_from_tensor_of_uint8_makes_a_unorm8_image() -> None:
    k, v = _pair(2, 3, 4, 5)
    im = m.Image.from_tensor(k)
    assert im.tensor is k and im.feature_channel_format is U8
    assert m.Image.from_tensor(k[0]).shape == (1, 3, 4, 5)
    out = im.numpy()
    assert out.dtype == np.float32 and np.array_equal(out, v.numpy())
    batch = m.ImageBatch.from_tensor(k)
    assert batch.feature_channel_format is U8 and batch[1].feature_channel_format is U8
    assert np.array_equal(batch.numpy(), v.numpy())
    assert np.array_equal(batch[1].numpy(), v[1:2].numpy())
    assert np.array_equal(batch[1].read_bytes(CHW), k[1].numpy())


# -- byte I/O ----------------------------------------------------------------------------------


def test_write_bytes_of_uint8_writes_the_raw_bytes_and_read_bytes_returns_them() -> None:
    im = m.Image(m.Device("cpu"), m.ImageDescriptor(U8, 4, 3, 2, 2))
    k = _bytes(3, 4, 2, seed=1).numpy()  # HWC
    im.write_bytes(k, image_index=1)
    out = im.read_bytes(image_index=1)
    assert out.dtype == np.uint8 and np.array_equal(out, k)
    assert np.array_equal(im.tensor[1].permute(1, 2, 0).numpy(), k)
    assert np.array_equal(im.read_bytes(CHW, image_index=1), k.transpose(2, 0, 1))
    assert np.array_equal(im.numpy()[1], k.transpose(2, 0, 1).astype(np.float32) / 255)
    assert not im.tensor[0].any()
    chw = _bytes(1, 2, 2, seed=2).numpy()
    region = m.Region(m.Origin(1, 1, 0), m.Size(2, 2, 1))
    im.write_bytes(chw, CHW, 0, region, m.ImageReadWriteParams(1, 1))
    assert np.array_equal(im.tensor[0, 1, 1:3, 1:3].numpy(), chw[0])
    assert np.array_equal(im.read_bytes(CHW, 0, region, m.ImageReadWriteParams(1, 1)), chw)


@pytest.mark.parametrize("layout", [HWC, CHW], ids=["hwc", "chw"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_write_bytes_of_floats_rounds_and_clamps(layout, dtype) -> None:
    values = np.array([-1.0, -0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0 / 255, 254.4 / 255, 1e-3])
    want = np.array([0, 0, 0, 64, 128, 191, 255, 255, 2, 254, 0], dtype=np.uint8)
    shape = (1, 1, 11) if layout is HWC else (11, 1, 1)
    im = m.Image(m.Device("cpu"), m.ImageDescriptor(U8, 1, 1, 11, 1))
    im.write_bytes(values.astype(dtype).reshape(shape), layout)
    assert np.array_equal(im.read_bytes(layout).reshape(-1), want)
    assert np.array_equal(im.numpy().reshape(-1), want.astype(np.float32) / 255)


def test_write_bytes_rounds_half_to_even() -> None:
    # float32 values whose product with 255 is exactly k + 0.5
    v = (torch.arange(255, dtype=torch.float64) + 0.5).div(255).float()
    ties = v[(v * 255) == (v * 255).floor() + 0.5]
    assert ties.numel() > 1  # at least 0.5 and one tie with an even k below it
    im = m.Image(m.Device("cpu"), m.ImageDescriptor(U8, ties.numel(), 1, 1, 1))
    im.write_bytes(ties.view(1, -1, 1).numpy())
    got = torch.from_numpy(im.read_bytes().reshape(-1)).long()
    assert torch.equal(got, torch.round(ties * 255).long())
    assert (got % 2 == 0).all()


def test_byte_io_errors() -> None:
    im = m.Image(m.Device("cpu"), m.ImageDescriptor(U8, 2, 2, 1, 1))
    with pytest.raises(
        TypeError,
        match=r"\[Image\] write_bytes into a UNORM8 image needs uint8 \(raw bytes\) or "
        r"floating-point \(values in \[0, 1\]\) data, got torch.int64",
    ):
        im.write_bytes(np.zeros((2, 2, 1), dtype=np.int64))
    with pytest.raises(
        TypeError,
        match=r"\[FeatureChannelFormat\] the dtype must be float32, float16, bfloat16 or float64, "
        r"got torch.int16; uint8 \(UNORM8\) is accepted too",
    ):
        m.Image.from_tensor(torch.zeros(1, 1, 1, 1, dtype=torch.int16))


# -- kernels reading a UNORM8 source ------------------------------------------------------------


def _conv_pair(dev: m.Device, cin: int, cout: int, seed: int):
    """Two convolutions (and gradients) with equal weights, own data sources."""
    gen = torch.Generator().manual_seed(seed)
    desc = m.ConvolutionDescriptor(3, 3, cin, cout)
    wt, b = torch.randn(desc.weights_shape, generator=gen), torch.randn(cout, generator=gen)
    out = []
    for _ in range(2):
        ds = m.TensorConvolutionDataSource(desc, wt.clone(), b.clone())
        out.append((m.Convolution(dev, ds), m.ConvolutionGradient(dev, ds)))
    return out


def test_convolution_and_its_gradient_read_unorm8_as_k_over_255() -> None:
    dev = m.Device("cpu")
    k, v = _pair(2, 3, 6, 7, seed=3)
    g = torch.randn(2, 4, 6, 7, generator=torch.Generator().manual_seed(4))
    results = []
    for (conv, grad), x in zip(_conv_pair(dev, 3, 4, seed=5), (k, v), strict=True):
        cb = _cb(dev)
        src = m.Image.from_tensor(x)
        state = conv.result_state(src)
        y = conv.encode(cb, src, destination_state=state)
        dx = grad.encode(cb, m.Image.from_tensor(g), src, state)
        run(cb)
        assert y.feature_channel_format is F32 and dx.feature_channel_format is F32
        results.append((y.tensor, dx.tensor, state.gradient_for_weights, state.gradient_for_biases))
    for a, b, what in zip(*results, ("forward", "dx", "dW", "db"), strict=True):
        assert torch.equal(a, b), what


def test_pooling_neuron_softmax_read_unorm8_as_k_over_255() -> None:
    dev = m.Device("cpu")
    k, v = _pair(2, 3, 6, 6, seed=6)
    g = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(7))
    sig = m.NeuronDescriptor(m.NeuronType.SIGMOID)
    pairs = [
        (m.PoolingMax(dev, 2, 2, 2, 2), m.PoolingMaxGradient(dev, 2, 2, 2, 2)),
        (m.Neuron(dev, sig), m.NeuronGradient(dev, sig)),
        (m.SoftMax(dev), None),
    ]
    for forward, gradient in pairs:
        name = type(forward).__name__
        out = []
        for x in (k, v):
            cb = _cb(dev)
            src = m.Image.from_tensor(x)
            state = None if gradient is None else forward.result_state(src)
            y = forward.encode(cb, src, destination_state=state)
            dx = None
            if gradient is not None:
                gy = m.Image.from_tensor(g[:, :, : y.height, : y.width].contiguous())
                dx = gradient.encode(cb, gy, src, state)
            run(cb)
            assert y.feature_channel_format is F32, name
            out.append((y.tensor, None if dx is None else dx.tensor))
        assert torch.equal(out[0][0], out[1][0]), f"{name} forward"
        if gradient is not None:
            assert out[0][1].dtype == torch.float32
            assert torch.equal(out[0][1], out[1][1]), f"{name} gradient"


def test_arithmetic_reads_a_unorm8_primary_or_secondary() -> None:
    dev = m.Device("cpu")
    k, v = _pair(2, 3, 4, 5, seed=8)
    other = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(9))
    g = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(10))
    z = {}
    for name, x in (("u8", k), ("f32", v)):
        cb = _cb(dev)
        xi, oi = m.Image.from_tensor(x), m.Image.from_tensor(other)
        add = m.Add(dev).encode(cb, xi, oi)
        mul = m.Multiply(dev)
        st = mul.result_state(oi, xi)
        prod = mul.encode(cb, oi, xi, destination_state=st)  # UNORM8 secondary
        d_other = m.MultiplyGradient(dev, False).encode(cb, m.Image.from_tensor(g), xi, st)
        run(cb)
        assert add.feature_channel_format is F32 and d_other.feature_channel_format is F32
        z[name] = (add.tensor, prod.tensor, d_other.tensor)
    for a, b, what in zip(z["u8"], z["f32"], ("add", "multiply", "d/d primary"), strict=True):
        assert torch.equal(a, b), what
    cb = _cb(dev)
    out = m.Add(dev).encode(cb, m.Image.from_tensor(other), m.Image.from_tensor(k))
    run(cb)
    assert out.feature_channel_format is F32 and torch.equal(out.tensor, other + v)


def test_loss_reads_unorm8_predictions() -> None:
    dev = m.Device("cpu")
    k, v = _pair(2, 3, 2, 2, seed=11)
    t = torch.rand(2, 3, 2, 2, generator=torch.Generator().manual_seed(12))
    desc = m.LossDescriptor(LT.MEAN_SQUARED_ERROR, RT.SUM)
    out = []
    for x in (k, v):
        labels = m.LossLabels(dev, t)
        cb = _cb(dev)
        grad = m.Loss(dev, desc).encode_batch(cb, m.ImageBatch.from_tensor(x), labels)
        run(cb)
        assert grad.feature_channel_format is F32
        out.append((grad.tensor, labels.loss_image().tensor))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


def test_batch_normalization_statistics_read_unorm8() -> None:
    dev = m.Device("cpu")
    k, v = _pair(4, 3, 3, 5, seed=13)
    out = []
    for x in (k, v):
        bn = m.BatchNormalization(dev, m.TensorBatchNormalizationDataSource(3))
        xb = m.ImageBatch.from_tensor(x)
        state = bn.result_state(xb[0])
        cb = _cb(dev)
        m.BatchNormalizationStatistics(dev).encode_batch(cb, xb, state)
        y = bn.encode_batch(cb, xb, state)
        run(cb)
        assert y.feature_channel_format is F32
        out.append((state.mean, state.variance, y.tensor))
    for a, b, what in zip(*out, ("mean", "variance", "forward"), strict=True):
        assert torch.equal(a, b), what
    torch.testing.assert_close(out[0][0], v.mean((0, 2, 3)))


def test_unorm8_gradient_image_reads_as_k_over_255() -> None:
    dev = m.Device("cpu")
    x = torch.randn(1, 2, 3, 3, generator=torch.Generator().manual_seed(14))
    k, v = _pair(1, 2, 3, 3, seed=15)
    sig = m.NeuronDescriptor(m.NeuronType.SIGMOID)
    neuron, grad = m.Neuron(dev, sig), m.NeuronGradient(dev, sig)
    out = []
    for g in (k, v):
        cb = _cb(dev)
        src = m.Image.from_tensor(x)
        state = neuron.result_state(src)
        neuron.encode(cb, src, destination_state=state)
        dx = grad.encode(cb, m.Image.from_tensor(g), src, state)
        run(cb)
        assert dx.feature_channel_format is F32
        out.append(dx.tensor)
    assert torch.equal(out[0], out[1])


# -- returned formats and UNORM8 destinations ---------------------------------------------------


def test_returned_destinations_of_unorm8_sources_are_float32() -> None:
    dev = m.Device("cpu")
    src = m.Image.from_tensor(_bytes(1, 4, 2, 2, seed=16))
    kernels = [
        m.UpsamplingNearest(dev, 2, 2),
        m.Reshape(dev, 4, 2, 2),
        m.Pad(dev, m.ImageCoordinate(1, 1, 0), m.ImageCoordinate(0, 0, 0)),
        m.FullyConnected(
            dev,
            m.TensorConvolutionDataSource(
                m.ConvolutionDescriptor(2, 2, 4, 3), torch.ones(3, 2, 2, 4)
            ),
        ),
    ]
    for kernel in kernels:
        assert kernel.destination_image_descriptor([src]).channel_format is F32
        cb = _cb(dev)
        out = kernel.encode(cb, src)
        run(cb)
        assert out.feature_channel_format is F32 and out.tensor.dtype == torch.float32


def test_a_unorm8_destination_stores_rounded_clamped_values() -> None:
    dev = m.Device("cpu")
    x = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(17)) * 0.7 + 0.5
    linear = m.NeuronDescriptor(m.NeuronType.LINEAR, a=1.5, b=-0.2)
    cb = _cb(dev)
    src = m.Image.from_tensor(x)
    want = m.Neuron(dev, linear).encode(cb, src)
    dst = m.Image(dev, m.ImageDescriptor(U8, 5, 4, 3, 2))
    got = m.Neuron(dev, linear).encode(cb, src, dst)
    k = m.Image.from_tensor(_bytes(2, 3, 4, 5, seed=18))
    add_dst = m.Image(dev, m.ImageDescriptor(U8, 5, 4, 3, 2))  # arithmetic: UNORM8 in and out
    m.Add(dev).encode(cb, k, m.Image.from_tensor(x), add_dst)
    run(cb)
    assert got is dst and dst.tensor.dtype == torch.uint8
    assert (want.tensor < 0).any() and (want.tensor > 1).any()  # clamping is exercised
    assert torch.equal(dst.tensor, _unorm8(want.tensor))
    assert torch.equal(add_dst.tensor, _unorm8(k.tensor.float() / 255 + x))
    # a partial write (a clip rect) into an allocated UNORM8 image converts as well
    part = m.Image.from_tensor(torch.full((1, 3, 4, 5), 7, dtype=torch.uint8))
    neuron = m.Neuron(dev, linear)
    neuron.clip_rect = m.Region(m.Origin(1, 1, 0), m.Size(2, 2, 1))
    cb = _cb(dev)
    neuron.encode(cb, m.Image.from_tensor(x[:1]), part)
    run(cb)
    expect = torch.full((1, 3, 4, 5), 7, dtype=torch.uint8)
    expect[:, :, 1:3, 1:3] = _unorm8(want.tensor[:1, :, 0:2, 0:2])  # the clip origin reads (0, 0)
    assert torch.equal(part.tensor, expect)
