"""Arithmetic: the four operations with scales, bias and clamp, broadcasting by 0 strides,
offsets and edge modes, gradients per input (autograd through broadcasting, the adjoint test,
the clamp mask), batches, and errors."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from tests.helpers import DEVICES, assert_adjoint, assert_close, run

OPS = {
    "add": (m.Add, m.AddGradient, lambda a, b: a + b),
    "sub": (m.Subtract, m.SubtractGradient, lambda a, b: a - b),
    "mul": (m.Multiply, m.MultiplyGradient, lambda a, b: a * b),
    "div": (m.Divide, m.DivideGradient, lambda a, b: a / b),
}


def _kernel(dev, op, ps=1.5, ss=-0.75, bias=0.25, clamp=None, strides=((1, 1, 1), (1, 1, 1))):
    k = OPS[op][0](dev)
    k.primary_scale, k.secondary_scale, k.bias = ps, ss, bias
    if clamp:
        k.minimum_value, k.maximum_value = clamp
    (pc, py, px), (sc, sy, sx) = strides
    k.primary_stride_in_feature_channels, k.secondary_stride_in_feature_channels = pc, sc
    k.primary_stride_in_pixels_x, k.primary_stride_in_pixels_y = px, py
    k.secondary_stride_in_pixels_x, k.secondary_stride_in_pixels_y = sx, sy
    return k


def _run(dev, kernel, x, y, g=None, op="add", batch=False):
    cb = dev.new_command_queue().command_buffer()
    if batch:
        xb, yb = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(y)
        st = kernel.result_state_batch(xb, yb)
        z = kernel.encode_batch(cb, xb, yb, destination_states=st).image
    else:
        xi, yi = m.Image.from_tensor(x), m.Image.from_tensor(y)
        st = kernel.result_state(xi, yi)
        z = kernel.encode(cb, xi, yi, destination_state=st)
    grads = []
    if g is not None:
        needs_other = op in ("mul", "div")
        for secondary in (False, True):
            gk = OPS[op][1](dev, secondary)
            other = (x if secondary else y) if needs_other else (y if secondary else x)
            if batch:
                d = gk.encode_batch(
                    cb, m.ImageBatch.from_tensor(g), m.ImageBatch.from_tensor(other), st
                )
                grads.append(d.image)
            else:
                grads.append(gk.encode(cb, m.Image.from_tensor(g), m.Image.from_tensor(other), st))
    run(cb)
    return z.tensor, [d.tensor for d in grads]


BROADCASTS = {
    "full": ((1, 1, 1), (1, 1, 1)),
    "channel": ((1, 1, 1), (0, 1, 1)),
    "row": ((1, 1, 1), (1, 0, 1)),
    "scalar": ((1, 1, 1), (0, 0, 0)),
    "primary-column": ((1, 1, 0), (1, 1, 1)),
}


def _shape(strides, full=(2, 3, 4, 5)):
    n, c, h, w = full
    sc, sy, sx = strides
    return (n, c if sc else 1, h if sy else 1, w if sx else 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("bc", list(BROADCASTS))
@pytest.mark.parametrize("clamp", [None, (-0.8, 1.1)], ids=["noclamp", "clamp"])
def test_forward_and_gradients_match_autograd(op, bc, clamp, device) -> None:
    gen = torch.Generator().manual_seed(121)
    dev = m.Device(device)
    strides = BROADCASTS[bc]
    x = torch.randn(_shape(strides[0]), generator=gen, dtype=torch.float64)
    y = torch.randn(_shape(strides[1]), generator=gen, dtype=torch.float64)
    if op == "div":
        y = y.sign() * (y.abs() + 0.5)  # keep away from 0
    g = torch.randn(2, 3, 4, 5, generator=gen, dtype=torch.float64)
    kernel = _kernel(dev, op, clamp=clamp, strides=strides)
    z, (dx, dy) = _run(dev, kernel, x.to(device), y.to(device), g.to(device), op)
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    ref = OPS[op][2](1.5 * xr, -0.75 * yr) + 0.25
    if clamp:
        ref = ref.clamp(*clamp)
    ref = ref.expand(2, 3, 4, 5)
    ref.backward(g)
    assert_close(z, ref.detach(), f"{op} {bc} forward", tol=1e-13)
    assert_close(dx, xr.grad, f"{op} {bc} primary gradient", tol=1e-12)
    assert_close(dy, yr.grad, f"{op} {bc} secondary gradient", tol=1e-12)


@pytest.mark.parametrize("op", list(OPS))
def test_gradients_are_adjoint_with_offsets_and_clamp_edges(op) -> None:
    gen = torch.Generator().manual_seed(122)
    dev = m.Device("cpu")
    x = torch.randn(1, 3, 4, 5, generator=gen, dtype=torch.float64)
    y = torch.randn(1, 3, 4, 5, generator=gen, dtype=torch.float64) + (3 if op == "div" else 0)
    vx, vy = (torch.randn(x.shape, generator=gen, dtype=torch.float64) for _ in range(2))
    g = torch.randn(1, 3, 4, 5, generator=gen, dtype=torch.float64)

    def kernel():
        k = _kernel(dev, op)
        k.primary_offset = m.Offset(1, -1, 0)
        k.primary_edge_mode = m.EdgeMode.CLAMP
        k.secondary_offset = m.Offset(-2, 0, 0)  # ZERO edges: reads of zeros pass nothing back
        if op == "div":
            k.secondary_edge_mode = m.EdgeMode.CLAMP  # a ZERO divisor would be infinite
        return k

    eps = 1e-6
    jx = (_run(dev, kernel(), x + eps * vx, y)[0] - _run(dev, kernel(), x - eps * vx, y)[0]) / (
        2 * eps
    )
    jy = (_run(dev, kernel(), x, y + eps * vy)[0] - _run(dev, kernel(), x, y - eps * vy)[0]) / (
        2 * eps
    )
    _, (dx, dy) = _run(dev, kernel(), x, y, g, op)
    assert_adjoint(jx, g, vx, dx, f"{op} primary adjoint", tol=1e-7)
    assert_adjoint(jy, g, vy, dy, f"{op} secondary adjoint", tol=1e-7)


def test_clamp_masks_the_gradient_and_batches_share_one_state() -> None:
    dev = m.Device("cpu")
    x = torch.tensor([[[[-2.0, 0.0, 0.5, 3.0]]]]).repeat(3, 1, 1, 1)
    y = torch.zeros_like(x)
    kernel = _kernel(dev, "add", ps=1.0, ss=1.0, bias=0.0, clamp=(-1.0, 1.0))
    g = torch.tensor([0.5, -1.5, 2.0, 3.0]).view(1, 1, 1, 4) * torch.arange(1.0, 4.0).view(
        3, 1, 1, 1
    )
    z, (dx, _) = _run(dev, kernel, x, y, g, "add", batch=True)
    assert z[0].flatten().tolist() == [-1.0, 0.0, 0.5, 1.0]
    assert dx[2].flatten().tolist() == [0.0, -4.5, 6.0, 0.0]  # clamped elements pass nothing
    assert dx[0].flatten().tolist() == [0.0, -1.5, 2.0, 0.0]  # each image its own gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_low_precision(dtype) -> None:
    gen = torch.Generator().manual_seed(123)
    x, y = torch.randn(2, 3, 4, 5, generator=gen), torch.randn(2, 1, 4, 5, generator=gen)
    z, (_, dy) = _run(
        m.Device("cpu"),
        _kernel(m.Device("cpu"), "mul", strides=BROADCASTS["channel"]),
        x.to(dtype),
        y.to(dtype),
        torch.ones(2, 3, 4, 5).to(dtype),
        "mul",
    )
    assert z.dtype == dtype
    want = (1.5 * x.to(dtype).double()) * (-0.75 * y.to(dtype).double()) + 0.25
    assert_close(z, want, "low-precision multiply", dtype=dtype)
    assert_close(
        dy, (1.5 * -0.75 * x.to(dtype).double()).sum(1, keepdim=True), "broadcast sum", dtype=dtype
    )


def test_arithmetic_errors() -> None:
    dev = m.Device("cpu")
    cb = dev.new_command_queue().command_buffer()
    a, b = (
        m.Image.from_tensor(torch.randn(1, 3, 4, 5)),
        m.Image.from_tensor(torch.randn(1, 3, 3, 5)),
    )
    add = m.Add(dev)
    with pytest.raises(
        ValueError,
        match=r"\[Add\] the sources' heights cannot broadcast: 4 and 3 \(both read with stride 1\)",
    ):
        add.encode(cb, a, b)
    with pytest.raises(
        ValueError, match=r"\[Add\] the sources' feature channel counts cannot broadcast: 3 and 2"
    ):
        add.encode(cb, a, m.Image.from_tensor(torch.randn(1, 2, 4, 5)))
    add.secondary_stride_in_pixels_x = 2
    with pytest.raises(
        ValueError,
        match=r"\[Add\] secondary_stride_in_pixels_x must be 0 \(broadcast\) or 1, got 2",
    ):
        add.encode(cb, a, a)
    with pytest.raises(TypeError, match=r"\[Multiply\] primary_scale must be a number, got str"):
        m.Multiply(dev).primary_scale = "2"
    with pytest.raises(
        TypeError, match=r"\[AddGradient\] is_secondary_source_filter must be a bool, got int"
    ):
        m.AddGradient(dev, 1)
    mul = m.Multiply(dev)
    st = mul.result_state(a, a)
    z = mul.encode(cb, a, a, destination_state=st)
    with pytest.raises(
        ValueError,
        match=r"\[AddGradient\] gradient_state must come from a Add encode, got one from Multiply",
    ):
        m.AddGradient(dev, False).encode(cb, z, a, st)
    with pytest.raises(
        ValueError,
        match=r"\[MultiplyGradient\] source_image must have the forward secondary source's shape",
    ):
        m.MultiplyGradient(dev, False).encode(cb, z, b, st)
    assert len(cb) == 1


def test_batch_states_must_repeat_one_state() -> None:
    """Arithmetic keeps one state for a batch: a batch of distinct states is refused, before
    anything is recorded, by the forward and by both gradients."""
    dev = m.Device("cpu")
    gen = torch.Generator().manual_seed(5)
    xb = m.ImageBatch.from_tensor(torch.randn(3, 2, 4, 4, generator=gen, dtype=torch.float64))
    yb = m.ImageBatch.from_tensor(torch.randn(3, 2, 4, 4, generator=gen, dtype=torch.float64))
    cb = dev.new_command_queue().command_buffer()
    add = m.Add(dev)
    distinct = m.StateBatch(add.result_state(xb[0], yb[0]) for _ in range(3))
    with pytest.raises(
        ValueError,
        match=r"\[Add\] destination_states must repeat one state \(see result_state_batch\), "
        r"got 3 distinct states",
    ):
        add.encode_batch(cb, xb, yb, destination_states=distinct)
    assert add.is_result_state_reused_across_batch and not add.append_batch_barrier
    shared = add.result_state_batch(xb, yb)
    assert len({id(s) for s in shared}) == 1
    z = add.encode_batch(cb, xb, yb, destination_states=shared)
    mixed = m.StateBatch([shared[0], shared[0], distinct[0]])
    with pytest.raises(
        ValueError,
        match=r"\[AddGradient\] gradient_states must repeat one state \(see result_state_batch\), "
        r"got 2 distinct states",
    ):
        m.AddGradient(dev, True).encode_batch(cb, z, yb, mixed)
    assert len(cb) == 1  # only the valid forward was recorded


class _AtenOps(__import__("torch").utils._python_dispatch.TorchDispatchMode):
    """The aten operators that run inside the mode (name per call)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_plain_addition_and_its_gradients_are_one_pass_each() -> None:
    """Scale 1 and bias 0 cost nothing: the addition is one ``add`` whose result becomes the
    destination's storage (no zero fill, no copy); each input gradient is one copy of the
    incoming gradient (the destination never aliases it), subtraction's second one a ``neg``."""
    dev = m.Device("cpu")
    gen = torch.Generator().manual_seed(77)
    a, b, g = (torch.randn(2, 3, 4, 5, generator=gen) for _ in range(3))
    a[0, 0, 0, 0] = b[0, 0, 0, 0] = -0.0
    for kernel_class, grad_class, op in (
        (m.Add, m.AddGradient, torch.add),
        (m.Subtract, m.SubtractGradient, torch.sub),
    ):
        kernel = kernel_class(dev)
        grads = [grad_class(dev, False), grad_class(dev, True)]
        cb = dev.new_command_queue().command_buffer()
        sa, sb, sg = m.Image.from_tensor(a), m.Image.from_tensor(b), m.Image.from_tensor(g)
        state = kernel.result_state(sa, sb)
        y = kernel.encode(cb, sa, sb, destination_state=state)
        dxs = [k.encode(cb, sg, s, state) for k, s in zip(grads, (sa, sb), strict=True)]
        ops = _AtenOps()
        with ops:
            cb.commit()
        cb.wait_until_completed()
        assert torch.equal(y.tensor, op(a, b))
        if kernel_class is m.Add:
            assert torch.signbit(y.tensor[0, 0, 0, 0])  # -0 + -0 is -0 (as torch.add)
        assert torch.equal(dxs[0].tensor, g)
        assert torch.equal(dxs[1].tensor, g if kernel_class is m.Add else -g)
        assert dxs[0].tensor.data_ptr() != g.data_ptr()
        passes = ("add", "sub", "mul", "neg", "copy_", "_to_copy", "fill_", "zero_", "zeros")
        heavy = [n for n in ops.names if n in passes]
        want = ["add" if kernel_class is m.Add else "sub", "_to_copy"]
        want += ["_to_copy"] if kernel_class is m.Add else ["neg"]
        assert heavy == want, ops.names
