"""Convolution transpose: the MPS definition (zero insertion + unrotated correlation) against a
loop-level reference, the exact adjoint relation with a paired convolution,
PyTorch's conv_transpose2d, and the float64 adjoint test of its gradient."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests import reference
from tests.helpers import DEVICES, assert_adjoint, assert_close, run


def _hits(c: dict, axis: int) -> bool:
    """Some output's window reads a real (non-inserted) sample along ``axis`` (0: x, 1: y)."""
    s, k, d = c["s"][axis], c["k"][axis], c["d"][axis]
    size = c["w"] if axis == 0 else c["h"]
    total = c["off"][axis] * s + c["koff"][axis]
    extent = (size - 1) * s + 1
    for u in range(c["dst"][1 - axis]):
        for e in reference.taps(total + u, k, d):
            if 0 <= e < extent and e % s == 0:
                return True
    return False


def _case(seed: int) -> dict:
    r = random.Random(seed)
    while True:
        c = _draw(r)
        if _hits(c, 0) and _hits(c, 1):
            return c


def _draw(r: random.Random) -> dict:
    g = r.choice([1, 1, 2])
    return dict(
        n=r.randint(1, 2),
        cin=g * r.randint(1, 3),
        cout=g * r.randint(1, 3),
        groups=g,
        k=(r.randint(1, 4), r.randint(1, 4)),
        s=(r.randint(1, 3), r.randint(1, 3)),
        d=(r.randint(1, 2), r.randint(1, 2)),
        h=r.randint(2, 6),
        w=r.randint(2, 6),
        edge=r.randint(0, 1),
        off=(r.randint(-1, 2), r.randint(-1, 2)),
        koff=(r.randint(-3, 3), r.randint(-3, 3)),
        dst=(r.randint(2, 12), r.randint(2, 12)),
    )


CASES = [_case(s) for s in range(20)]


def _ids(c: dict) -> str:
    return (
        f"k{c['k']} s{c['s']} d{c['d']} g{c['groups']} {c['cin']}->{c['cout']} off{c['off']} "
        f"koff{c['koff']} {'clamp' if c['edge'] else 'zero'}"
    )


def _transpose(dev, c, w, b):
    desc = m.ConvolutionDescriptor(
        c["k"][0],
        c["k"][1],
        c["cin"],
        c["cout"],
        c["s"][0],
        c["s"][1],
        c["d"][0],
        c["d"][1],
        c["groups"],
    )
    t = m.ConvolutionTranspose(dev, m.TensorConvolutionDataSource(desc, w, b))
    t.edge_mode = m.EdgeMode(c["edge"])
    t.offset = m.Offset(c["off"][0], c["off"][1], 0)
    t.kernel_offset_x, t.kernel_offset_y = c["koff"]
    return t


def _encode(dev, c, x, w, b, state=None) -> torch.Tensor:
    t = _transpose(dev, c, w, b)
    dst = m.Image(
        dev,
        m.ImageDescriptor(
            m.FeatureChannelFormat.FLOAT64, c["dst"][1], c["dst"][0], c["cout"], c["n"]
        ),
    )
    cb = dev.new_command_queue().command_buffer()
    t.encode(cb, m.Image.from_tensor(x), dst, state)
    run(cb)
    return dst.tensor


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("c", CASES, ids=_ids)
def test_transpose_matches_loop_reference(c, device) -> None:
    gen = torch.Generator().manual_seed(21)
    dev = m.Device(device)
    x = torch.randn(c["n"], c["cin"], c["h"], c["w"], generator=gen, dtype=torch.float64)
    w = torch.randn(
        c["cout"], c["k"][1], c["k"][0], c["cin"] // c["groups"], generator=gen, dtype=torch.float64
    )
    b = torch.randn(c["cout"], generator=gen, dtype=torch.float64)
    got = _encode(dev, c, x.to(device), w, b)
    total = (c["off"][0] * c["s"][0] + c["koff"][0], c["off"][1] * c["s"][1] + c["koff"][1])
    want = reference.convolution_transpose(
        x.numpy(),
        w.numpy(),
        b.numpy(),
        c["dst"],
        total=total,
        edge=c["edge"],
        stride=c["s"],
        dilation=c["d"],
        groups=c["groups"],
    )
    assert_close(got, want, "transpose forward", tol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("c", CASES[:14], ids=_ids)
def test_transpose_gradients_are_adjoint(c, device) -> None:
    gen = torch.Generator().manual_seed(22)
    dev = m.Device(device)
    shape_x = (c["n"], c["cin"], c["h"], c["w"])
    x = torch.randn(shape_x, generator=gen, dtype=torch.float64).to(device)
    v = torch.randn(shape_x, generator=gen, dtype=torch.float64).to(device)
    w = torch.randn(
        c["cout"], c["k"][1], c["k"][0], c["cin"] // c["groups"], generator=gen, dtype=torch.float64
    )
    vw = torch.randn(w.shape, generator=gen, dtype=torch.float64)
    b = torch.randn(c["cout"], generator=gen, dtype=torch.float64)
    vb = torch.randn(b.shape, generator=gen, dtype=torch.float64)
    cot = torch.randn(c["n"], c["cout"], *c["dst"], generator=gen, dtype=torch.float64).to(device)
    jv_x = (_encode(dev, c, x + v, w, b) - _encode(dev, c, x - v, w, b)) / 2
    jv_w = (_encode(dev, c, x, w + vw, b) - _encode(dev, c, x, w - vw, b)) / 2
    jv_b = (_encode(dev, c, x, w, b + vb) - _encode(dev, c, x, w, b - vb)) / 2

    t = _transpose(dev, c, w, b)
    grad = m.ConvolutionTransposeGradient(dev, t.data_source)
    state = t.result_state(m.Image.from_tensor(x))
    assert isinstance(state, m.ConvolutionTransposeGradientState)
    dst = m.Image(
        dev,
        m.ImageDescriptor(
            m.FeatureChannelFormat.FLOAT64, c["dst"][1], c["dst"][0], c["cout"], c["n"]
        ),
    )
    cb = dev.new_command_queue().command_buffer()
    t.encode(cb, m.Image.from_tensor(x), dst, state)
    dx = grad.encode(cb, m.Image.from_tensor(cot), m.Image.from_tensor(x), state)
    run(cb)
    assert_adjoint(jv_x, cot, v, dx.tensor, "transpose data gradient")
    assert_adjoint(jv_w, cot, vw, state.gradient_for_weights, "transpose weight gradient")
    assert_adjoint(jv_b, cot, vb, state.gradient_for_biases, "transpose bias gradient")


PAIRS = [
    # (C, H, W, O, k, stride, dilation, groups)
    (3, 8, 7, 5, 3, 1, 1, 1),
    (4, 9, 10, 6, 3, 2, 1, 2),
    (2, 8, 8, 4, 4, 2, 1, 1),
    (3, 11, 9, 3, 3, 3, 2, 3),
    (2, 7, 6, 2, 2, 1, 2, 1),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("p", PAIRS, ids=str)
def test_paired_transpose_is_the_exact_adjoint_of_the_convolution(p, device) -> None:
    """<conv(x), y> == <x, transpose(y)> with W_t[i][q][p][o] = W[o][kH-1-q][kW-1-p][i], and
    the same result as torch's conv_transpose2d where one exists."""
    c, h, w, o, k, s, d, g = p
    gen = torch.Generator().manual_seed(23)
    dev = m.Device(device)
    conv_w = torch.randn(o, k, k, c // g, generator=gen, dtype=torch.float64)
    conv = m.Convolution(
        dev,
        m.TensorConvolutionDataSource(m.ConvolutionDescriptor(k, k, c, o, s, s, d, d, g), conv_w),
    )
    # The adjoint's weights: rotate 180 degrees, swap the channel roles within each group.
    wt = (
        conv_w.flip(1, 2)
        .reshape(g, o // g, k, k, c // g)
        .permute(0, 4, 2, 3, 1)
        .reshape(c, k, k, o // g)
    )
    tr = m.ConvolutionTranspose(
        dev, m.TensorConvolutionDataSource(m.ConvolutionDescriptor(k, k, o, c, s, s, d, d, g), wt)
    )
    x = torch.randn(2, c, h, w, generator=gen, dtype=torch.float64).to(device)
    cb = dev.new_command_queue().command_buffer()
    state = conv.result_state(m.Image.from_tensor(x))
    y = conv.encode(cb, m.Image.from_tensor(x), destination_state=state)
    ycot = m.Image.from_tensor(torch.randn(y.shape, generator=gen, dtype=torch.float64).to(device))
    back = tr.encode(cb, ycot, convolution_gradient_state=state)
    run(cb)
    assert back.shape == x.shape
    assert_adjoint(y.tensor, ycot.tensor, x, back.tensor, "conv vs paired transpose", tol=1e-12)
    e, pad = d * (k - 1) + 1, d * (k - 1) // 2

    def symmetric(n: int) -> bool:  # the SAME policy's padding is torch's padding=pad here
        dst = -(-n // s)
        return ((dst - 1) * s + e - n + 1) // 2 == pad and (n + 2 * pad - e) // s + 1 == dst

    if symmetric(h) and symmetric(w):
        out_pad = (h + 2 * pad - d * (k - 1) - 1) % s, (w + 2 * pad - d * (k - 1) - 1) % s
        want = F.conv_transpose2d(
            ycot.tensor.cpu(), conv_w.permute(0, 3, 1, 2), None, s, pad, out_pad, g, d
        )
        assert_close(back.tensor, want, "paired transpose vs torch conv_transpose2d", tol=1e-12)


@pytest.mark.parametrize(
    "style,method",
    [
        (-1, m.PaddingMethod.SIZE_VALID_ONLY),
        (0, m.PaddingMethod.SIZE_SAME),
        (1, m.PaddingMethod.SIZE_FULL),
    ],
)
@pytest.mark.parametrize("k,s", [(3, 2), (4, 2), (3, 1), (5, 3)])
def test_unpaired_transpose_uses_the_reverse_size_rule(style, method, k, s) -> None:
    dev = m.Device("cpu")
    t = m.ConvolutionTranspose(
        dev,
        m.TensorConvolutionDataSource(
            m.ConvolutionDescriptor(k, k, 1, 1, s, s), torch.ones(1, k, k, 1)
        ),
    )
    t.padding = m.DefaultPadding(method)
    assert t.is_backwards
    for n in (3, 4, 7):
        desc = t.destination_image_descriptor([m.Image.from_tensor(torch.ones(1, 1, n, n))])
        assert desc.width == (n - 1) * s + 1 + style * (k - 1)
        assert t.offset.x == 0


def test_valid_forward_and_full_transpose_round_trip_sizes() -> None:
    """A reverse filter undoing a VALID forward uses FULL padding."""
    dev = m.Device("cpu")
    for k, s, n in ((3, 2, 9), (5, 1, 8), (2, 2, 10)):
        ds = m.TensorConvolutionDataSource(
            m.ConvolutionDescriptor(k, k, 1, 1, s, s), torch.ones(1, k, k, 1)
        )
        conv, tr = m.Convolution(dev, ds), m.ConvolutionTranspose(dev, ds)
        conv.padding = m.DefaultPadding(m.PaddingMethod.SIZE_VALID_ONLY)
        tr.padding = m.DefaultPadding(m.PaddingMethod.SIZE_FULL)
        fwd = conv.destination_image_descriptor([m.Image.from_tensor(torch.ones(1, 1, n, n))])
        back = tr.destination_image_descriptor(
            [m.Image.from_tensor(torch.ones(1, 1, fwd.height, fwd.width))]
        )
        assert back.width == n - (n - k) % s  # exact when the windows tile the source
