"""Dropout: the forward/gradient relation with one mask, statistics, determinism, one mask per
image, broadcast strides, the Triton path against the portable one, and errors."""

from __future__ import annotations

import math

import pytest
import torch

import mpsnn as m
from mpsnn.ops.dropout import dropout_apply_portable, dropout_geometry, stream_key
from tests.helpers import DEVICES, TRITON_DEVICES, assert_adjoint, run


def _forward_backward(dev, kernel, grad, x, g, batch=False):
    cb = dev.new_command_queue().command_buffer()
    if batch:
        xb = m.ImageBatch.from_tensor(x)
        states = kernel.result_state_batch(xb)
        y = kernel.encode_batch(cb, xb, destination_states=states)
        dx = grad.encode_batch(cb, m.ImageBatch.from_tensor(g), xb, states)
    else:
        src = m.Image.from_tensor(x)
        states = [kernel.result_state(src)]
        y = kernel.encode(cb, src, destination_state=states[0])
        dx = grad.encode(cb, m.Image.from_tensor(g), src, states[0])
    run(cb)
    return y.tensor, dx.tensor, states


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str
)
@pytest.mark.parametrize("keep", [0.2, 0.5, 0.9])
def test_forward_and_gradient_share_one_mask(keep, dtype, device) -> None:
    gen = torch.Generator().manual_seed(101)
    dev = m.Device(device)
    x = (torch.rand(4, 8, 16, 16, generator=gen) + 0.5).to(dtype).to(device)  # no zeros
    g = (torch.rand(4, 8, 16, 16, generator=gen) + 0.5).to(dtype).to(device)
    kernel, grad = m.Dropout(dev, keep, seed=7), m.DropoutGradient(dev, keep, seed=7)
    y, dx, states = _forward_backward(dev, kernel, grad, x, g, batch=True)
    mask = torch.cat([s.mask_data for s in states]).cpu()
    assert mask.shape == x.shape
    scale = torch.tensor(1 / keep, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    want_y = (x.cpu().to(scale.dtype) * mask * scale).to(dtype)
    want_dx = (g.cpu().to(scale.dtype) * mask * scale).to(dtype)
    assert torch.equal(y.cpu(), want_y) and torch.equal(dx.cpu(), want_dx)
    kept = mask.double().mean().item()
    sigma = math.sqrt(keep * (1 - keep) / mask.numel())
    assert abs(kept - keep) < 5 * sigma, f"kept {kept} of {keep}"
    assert states[0].resource_size() == 16 and x.numel() // 16 >= 8  # vs a byte per element


def test_dropout_is_an_adjoint_pair_and_deterministic() -> None:
    gen = torch.Generator().manual_seed(102)
    dev = m.Device("cpu")
    x = torch.randn(2, 3, 5, 7, generator=gen, dtype=torch.float64)
    v = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    g = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    a, b = m.Dropout(dev, 0.6, seed=11), m.Dropout(dev, 0.6, seed=11)
    grad = m.DropoutGradient(dev, 0.6, seed=11)
    ya, dxa, _ = _forward_backward(dev, a, grad, x, g)
    yb, _, _ = _forward_backward(dev, b, grad, x, g)
    assert torch.equal(ya, yb)  # same seed, same encode number: same masks
    y2, _, _ = _forward_backward(dev, a, grad, x, g)
    assert not torch.equal(ya, y2)  # the next encode draws new masks
    other, _, _ = _forward_backward(
        dev, m.Dropout(dev, 0.6, seed=12), m.DropoutGradient(dev, 0.6, seed=12), x, g
    )
    assert not torch.equal(ya, other)
    # linear in x: J v is the forward of v with the same mask
    kernel = m.Dropout(dev, 0.6, seed=11)
    jv, dx, _ = _forward_backward(dev, kernel, grad, v, g)
    assert_adjoint(jv, g, v, dx, "dropout adjoint", tol=1e-12)
    assert torch.equal(dx, dxa)


def test_one_mask_per_image_and_per_image_states() -> None:
    dev = m.Device("cpu")
    x = torch.ones(4, 2, 8, 8)
    kernel, grad = m.Dropout(dev, 0.5, seed=3), m.DropoutGradient(dev, 0.5, seed=3)
    y, _, states = _forward_backward(dev, kernel, grad, x, x.clone(), batch=True)
    masks = [y[i] != 0 for i in range(4)]
    assert all(not torch.equal(masks[0], mk) for mk in masks[1:])
    assert len({id(s) for s in states}) == 4 and not kernel.is_result_state_reused_across_batch
    # a gradient encoded for one image with that image's state uses that image's mask
    cb = dev.new_command_queue().command_buffer()
    g = torch.rand(1, 2, 8, 8, generator=torch.Generator().manual_seed(4)) + 0.5  # no zeros
    one = grad.encode(cb, m.Image.from_tensor(g), m.Image.from_tensor(x[2:3]), states[2])
    run(cb)
    assert torch.equal(one.tensor[0], torch.where(masks[2], g[0] * 2, 0.0))  # 1 / keep = 2


@pytest.mark.parametrize(
    "stride", [m.Size(0, 1, 1), m.Size(1, 0, 1), m.Size(1, 1, 0), m.Size(0, 0, 0)], ids=str
)
def test_mask_stride_broadcasts(stride) -> None:
    dev = m.Device("cpu")
    kernel = m.Dropout(dev, 0.5, seed=5, mask_stride_in_pixels=stride)
    cb = dev.new_command_queue().command_buffer()
    y = kernel.encode(cb, m.Image.from_tensor(torch.ones(2, 6, 5, 7)))
    run(cb)
    mask = y.tensor != 0
    for dim, s in ((3, stride.width), (2, stride.height), (1, stride.depth)):
        const = (mask == mask.narrow(dim, 0, 1)).all().item()
        assert const == (s == 0), f"mask {'is' if const else 'is not'} constant along dim {dim}"


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("strides", [(1, 1, 1), (0, 1, 1), (1, 0, 0), (0, 0, 0)], ids=str)
def test_triton_dropout_equals_portable(strides, dtype, device) -> None:
    from mpsnn.ops.triton import dropout as triton_dropout  # the dev setup installs Triton

    gen = torch.Generator().manual_seed(103)
    t = torch.randn(3, 5, 7, 9, generator=gen).to(dtype).to(device)
    for keep in (0.3, 0.9):
        geom = dropout_geometry(keep, strides)
        key = torch.tensor([stream_key(2**40 + 17, 3)], device=device)
        got = triton_dropout.dropout_apply_triton(t, key, 2, geom)
        want = dropout_apply_portable(t, key, 2, geom)
        assert torch.equal(got != 0, want != 0)  # the same mask bits
        if dtype == torch.bfloat16 and not t.is_cuda:
            # Triton's interpreter truncates float32 -> bfloat16 (compiled code rounds to
            # nearest even like PyTorch): allow one bfloat16 ulp here only.
            assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7).all()
        else:
            assert torch.equal(got, want)


def test_dropout_errors() -> None:
    dev = m.Device("cpu")
    for keep in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(
            ValueError, match=r"\[Dropout\] keep_probability must be in \(0, 1\), got"
        ):
            m.Dropout(dev, keep)
    with pytest.raises(TypeError, match=r"\[Dropout\] keep_probability must be a number, got str"):
        m.Dropout(dev, "0.5")
    with pytest.raises(
        ValueError,
        match=r"\[DropoutGradient\] mask_stride_in_pixels.width must be 0 \(broadcast\) or 1, got 2",
    ):
        m.DropoutGradient(dev, 0.5, 0, m.Size(2, 1, 1))
    with pytest.raises(ValueError, match=r"\[Dropout\] seed must be >= 0, got -1"):
        m.Dropout(dev, 0.5, seed=-1)
    kernel = m.Dropout(dev, 0.5, seed=1)
    x = m.Image.from_tensor(torch.ones(1, 1, 2, 2))
    cb = dev.new_command_queue().command_buffer()
    st = kernel.result_state(x)
    y = kernel.encode(cb, x, destination_state=st)
    with pytest.raises(
        ValueError, match=r"\[DropoutGradient\] seed must equal the forward dropout's \(1\), got 2"
    ):
        m.DropoutGradient(dev, 0.5, seed=2).encode(cb, y, x, st)
    with pytest.raises(
        ValueError,
        match=r"\[DropoutGradient\] keep_probability must equal the forward dropout's \(0.5\), got 0.4",
    ):
        m.DropoutGradient(dev, 0.4, seed=1).encode(cb, y, x, st)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("strides", [(1, 1, 1), (0, 1, 1)], ids=str)
def test_triton_dropout_computes_the_key_from_the_counter(strides, device) -> None:
    """The forward's one-launch form: the key comes from the encode counter inside the kernel
    (and is stored for the gradient), equal to the tensor form's key and mask."""
    from mpsnn.ops.dropout import _seed_part, stream_key_tensor
    from mpsnn.ops.triton import dropout as triton_dropout

    gen = torch.Generator().manual_seed(104)
    t = torch.randn(3, 5, 7, 9, generator=gen).to(device)
    geom = dropout_geometry(0.7, strides)
    seed = 2**40 + 17
    ticket = torch.zeros(1, dtype=torch.int32, device=device)
    for count in (0, 5, 2**32 + 3):  # the counter is taken mod 2^32, as the tensor form does
        counter = torch.tensor([count], device=device)
        want_key = stream_key_tensor(seed, counter)
        key_out = torch.zeros(1, dtype=torch.int64, device=device)
        got = triton_dropout.dropout_apply_triton(
            t, counter, 2, geom, seed_part=_seed_part(seed), key_out=key_out, ticket=ticket
        )
        assert torch.equal(key_out, want_key)
        assert torch.equal(got, dropout_apply_portable(t, want_key, 2, geom))
        # the last of its programs advanced the counter once, and left the ticket at 0
        assert counter.item() == count + 1 and ticket.item() == 0
    with pytest.raises(ValueError, match=r"\[dropout_apply_triton\] key_out and ticket must"):
        triton_dropout.dropout_apply_triton(t, counter, 0, geom, seed_part=1, key_out=key_out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams")
def test_runs_on_two_streams_follow_each_other() -> None:
    """One kernel encoded on queues of two streams: each run waits for the last one (they share
    the device counter and its ticket), so the encodes draw the keys of counts 0, 1, 2, 3."""
    dev = m.Device("cuda")
    drop = m.Dropout(dev, 0.5, seed=9)
    x = torch.randn(64, 32, 16, 16, device="cuda")
    src = m.Image.from_tensor(x)
    queues = [dev.new_command_queue(stream=torch.cuda.Stream()) for _ in range(2)]
    states = []
    for i in range(4):
        cb = queues[i % 2].command_buffer()
        st = drop.result_state(src)
        drop.encode(cb, src, destination_state=st)
        cb.commit()
        states.append(st)
    torch.cuda.synchronize()
    assert int(drop._counter) == 4 and int(drop._ticket) == 0
    keys = [int(st._forward.params.key) for st in states]
    assert keys == [stream_key(9, k) for k in range(4)]
