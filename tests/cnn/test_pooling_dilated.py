"""Dilated average and L2-norm pooling: the window model of `DilatedPoolingMax` (taps
``c - E // 2 + d j``, ``E = d (k - 1) + 1``) with the average's divisor rules (ZERO: the ``k_x
k_y`` taps; CLAMP: the taps inside the image grown by the zero pad; EXCLUDE_EDGES: the image
plus the policy's padding). Forward against the loop-level reference of test_pooling (float64),
gradient against autograd through it and by the adjoint identity with random cotangents."""

from __future__ import annotations

import random

import pytest
import torch

import mpsnn as m
from tests.cnn.test_pooling import _make, _written, reference
from tests.helpers import DEVICES, assert_adjoint, assert_close, run


def _dilated_case(seed: int, kind: str) -> dict:
    r = random.Random(1000 + seed)
    dh, dw = r.randint(2, 5), r.randint(2, 5)
    cx, cy = r.randint(-1, dw - 1), r.randint(-1, dh - 1)
    dx, dy = r.randint(1, 3), r.randint(1, 3)
    if dx == dy == 1:  # at least one dilated axis
        dx = 2
    return dict(
        kx=r.randint(1, 4), ky=r.randint(1, 4), sx=r.randint(1, 3), sy=r.randint(1, 3),
        dx=dx, dy=dy,
        offset=(r.randint(-1, 3), r.randint(-1, 3)),
        clip=(cx, cy, r.randint(1 - min(cx, 0), 6), r.randint(1 - min(cy, 0), 6)),
        dst=(dh, dw), edge=r.randint(0, 1),
        src=(r.randint(1, 2), r.randint(1, 3), r.randint(3, 9), r.randint(3, 9)),
        zp=(r.randint(0, 2), r.randint(0, 2)) if kind == "average" else (0, 0),
    )  # fmt: skip


def _dilated(dev, kind: str, p: dict):
    """`_make` with the dilation rates set (average and L2 take them as keywords)."""
    fwd, grad = _make(dev, kind, p)
    cls_f, cls_g = type(fwd), type(grad)
    kw = dict(dilation_rate_x=p["dx"], dilation_rate_y=p["dy"])
    f2 = cls_f(dev, p["kx"], p["ky"], p["sx"], p["sy"], **kw)
    g2 = cls_g(dev, p["kx"], p["ky"], p["sx"], p["sy"], **kw)
    f2.offset, f2.clip_rect, f2.edge_mode = fwd.offset, fwd.clip_rect, fwd.edge_mode
    if kind == "average":
        f2.zero_pad_size_x, f2.zero_pad_size_y = p["zp"]
        g2.zero_pad_size_x, g2.zero_pad_size_y = p["zp"]
    return f2, g2


def _run_dilated(dev, kind, p, x, g=None):
    fwd, grad = _dilated(dev, kind, p)
    n, c = x.shape[:2]
    dst = m.Image.from_tensor(torch.zeros(n, c, *p["dst"], dtype=x.dtype, device=x.device))
    cb = dev.new_command_queue().command_buffer()
    src = m.Image.from_tensor(x)
    st = fwd.result_state(src)
    fwd.encode(cb, src, dst, st)
    dx = None if g is None else grad.encode(cb, m.Image.from_tensor(g), src, st)
    run(cb)
    return dst.tensor, (None if dx is None else dx.tensor)


CASES = [(kind, s) for kind in ("average", "l2") for s in range(16)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,seed", CASES, ids=str)
def test_dilated_pooling_matches_the_window_model_and_autograd(kind, seed, device) -> None:
    p = _dilated_case(seed, kind)
    gen = torch.Generator().manual_seed(seed)
    dev = m.Device(device)
    x = torch.randn(p["src"], generator=gen, dtype=torch.float64)
    n, c = p["src"][:2]
    g = torch.randn(n, c, *p["dst"], generator=gen, dtype=torch.float64)
    ys, xs = _written(p)
    out, dx = _run_dilated(dev, kind, p, x.to(device), g.to(device))
    xr = x.clone().requires_grad_()
    want = reference(xr, kind, p)
    assert_close(out[:, :, ys, xs], want.detach(), f"{kind} forward {p}", tol=1e-13)
    outside = torch.ones_like(out, dtype=torch.bool)
    outside[:, :, ys, xs] = False
    assert not out[outside].any()  # only the clip rect is written
    if want.requires_grad:
        want.backward(g[:, :, ys, xs])
    grad_ref = xr.grad if xr.grad is not None else torch.zeros_like(x)
    assert_close(dx, grad_ref, f"{kind} gradient vs autograd {p}", tol=1e-12)


@pytest.mark.parametrize("kind", ["average", "l2"])
def test_dilated_pooling_gradients_are_adjoint(kind) -> None:
    dev = m.Device("cpu")
    checked = 0
    for seed in range(10):
        p = _dilated_case(50 + seed, kind)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(p["src"], generator=gen, dtype=torch.float64)
        v = torch.randn(p["src"], generator=gen, dtype=torch.float64)
        g = torch.randn(*p["src"][:2], *p["dst"], generator=gen, dtype=torch.float64)
        eps = 1e-7
        plus = _run_dilated(dev, kind, p, x + eps * v)[0]
        minus = _run_dilated(dev, kind, p, x - eps * v)[0]
        jv = (plus - minus) / (2 * eps)
        _, dx = _run_dilated(dev, kind, p, x, g)
        if jv.abs().max() == 0:  # every window read only ZERO padding
            assert dx.abs().max() == 0
            continue
        assert_adjoint(jv, g, v, dx, f"{kind} adjoint {p}", tol=1e-6)
        checked += 1
    assert checked >= 5


def test_dilated_average_divisors_by_hand() -> None:
    """One row of 5 ones, kernel 2, dilation 3 (E = 4): the window centred at c reads c - 2
    and c + 1. ZERO divides by the 2 taps; CLAMP counts the taps inside the image (zero pad 0)
    or inside the image grown by 1 (zero pad 1)."""
    dev = m.Device("cpu")
    x = m.Image.from_tensor(torch.ones(1, 1, 1, 5, dtype=torch.float64))
    got = {}
    for name, edge, zp in (("zero", 0, 0), ("clamp", 1, 0), ("clamp_zp1", 1, 1)):
        pool = m.PoolingAverage(dev, 2, 1, 1, 1, dilation_rate_x=3)
        pool.edge_mode = m.EdgeMode(edge)
        pool.zero_pad_size_x = zp
        pool.offset = m.Offset(0, 0, 0)
        dst = m.Image.from_tensor(torch.zeros(1, 1, 1, 5, dtype=torch.float64))
        cb = dev.new_command_queue().command_buffer()
        pool.encode(cb, x, dst)
        run(cb)
        got[name] = dst.tensor.flatten().tolist()
    # centres 0..4 read (-2, 1), (-1, 2), (0, 3), (1, 4), (2, 5)
    assert got["zero"] == pytest.approx([0.5, 0.5, 1.0, 1.0, 0.5])
    assert got["clamp"] == pytest.approx([1.0, 1.0, 1.0, 1.0, 1.0])  # 1/1, 1/1, 2/2, 2/2, 1/1
    assert got["clamp_zp1"] == pytest.approx([1.0, 0.5, 1.0, 1.0, 0.5])  # -1 and 5 count


def test_dilated_l2_by_hand() -> None:
    dev = m.Device("cpu")
    x = torch.tensor([[[[3.0, 9.0, 4.0, 7.0]]]], dtype=torch.float64)
    pool = m.PoolingL2Norm(dev, 2, 1, 2, 1, dilation_rate_x=2)
    grad = m.PoolingL2NormGradient(dev, 2, 1, 2, 1, dilation_rate_x=2)
    pool.offset = m.Offset(2, 0, 0)  # E = 3: the window centred at 2 reads 1 and 3
    src = m.Image.from_tensor(x)
    dst = m.Image.from_tensor(torch.zeros(1, 1, 1, 1, dtype=torch.float64))
    cb = dev.new_command_queue().command_buffer()
    st = pool.result_state(src)
    pool.encode(cb, src, dst, st)
    dx = grad.encode(
        cb, m.Image.from_tensor(torch.full((1, 1, 1, 1), 2.0, dtype=torch.float64)), src, st
    )
    run(cb)
    y = (81.0 + 49.0) ** 0.5
    assert dst.tensor.item() == pytest.approx(y)
    assert dx.tensor.flatten().tolist() == pytest.approx([0.0, 2 * 9 / y, 0.0, 2 * 7 / y])


def test_dilated_exclude_edges_counts_the_policy_padding() -> None:
    """ZERO + EXCLUDE_EDGES, kernel 2, dilation 2 (E = 3), stride 2, 4 px, SIZE_SAME: the
    policy pads 1 before and 0 after; windows centred at -1+... count taps in [-1, 4)."""
    dev = m.Device("cpu")
    x = m.Image.from_tensor(torch.ones(1, 1, 1, 4, dtype=torch.float64))
    pool = m.PoolingAverage(dev, 2, 1, 2, 1, dilation_rate_x=2)
    pool.padding = m.DefaultPadding(m.PaddingMethod.SIZE_SAME | m.PaddingMethod.EXCLUDE_EDGES)
    cb = dev.new_command_queue().command_buffer()
    y = pool.encode(cb, x)
    run(cb)
    # SAME: 2 outputs; centred offset E // 2 - floor(((2 - 1) 2 + 3 - 4 + 1) / 2) = 0:
    # centres 0 and 2 read (-1, 1) and (1, 3); -1 lies in the policy padding [-1, 4)
    assert pool.offset.x == 0
    assert y.tensor.flatten().tolist() == pytest.approx([0.5, 1.0])
