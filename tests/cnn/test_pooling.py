"""Pooling: forward against PyTorch and a window-model reference (offsets, clip rects, CLAMP,
even windows, dilation, zero pads), gradients against autograd through that reference and by
the adjoint test, tie and padding rules of the max gradient, L2 numerics, and errors."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.helpers import DEVICES, assert_adjoint, assert_close, run

KINDS = {
    "max": (m.PoolingMax, m.PoolingMaxGradient),
    "dilated": (m.DilatedPoolingMax, m.DilatedPoolingMaxGradient),
    "average": (m.PoolingAverage, m.PoolingAverageGradient),
    "l2": (m.PoolingL2Norm, m.PoolingL2NormGradient),
}


def _taps(c: int, k: int, d: int) -> list[int]:
    e = d * (k - 1) + 1
    return [c - e // 2 + d * j for j in range(k)]


def reference(x: torch.Tensor, kind: str, p: dict) -> torch.Tensor:
    """The MPS window model, differentiable (autograd gives the reference gradient): gathers
    every tap with the edge rule and reduces. Destination covers the clip rect only."""
    n, c, h, w = x.shape
    ox, oy = p["offset"]
    (cx, cy, cw, ch), (dh, dw) = p["clip"], p["dst"]
    xs = range(max(cx, 0), min(cx + cw, dw))
    ys = range(max(cy, 0), min(cy + ch, dh))
    kx, ky, sx, sy, dx, dy = p["kx"], p["ky"], p["sx"], p["sy"], p["dx"], p["dy"]
    clamp = p["edge"] == 1
    zp = p.get("zp", (0, 0))
    rows = []
    for u in ys:
        row = []
        for v in xs:
            ty = _taps(oy + sy * (u - cy), ky, dy)
            tx = _taps(ox + sx * (v - cx), kx, dx)
            vals, count = [], 0
            for a in ty:
                for b in tx:
                    inside = 0 <= a < h and 0 <= b < w
                    if kind == "average":
                        if clamp:  # shrink to the image grown by the zero pad
                            count += (-zp[1] <= a < h + zp[1]) and (-zp[0] <= b < w + zp[0])
                        else:
                            count += 1
                        vals.append(x[:, :, a, b] if inside else torch.zeros(n, c, dtype=x.dtype))
                    elif inside:
                        vals.append(x[:, :, a, b])
                    elif clamp:
                        vals.append(x[:, :, min(max(a, 0), h - 1), min(max(b, 0), w - 1)])
                    else:
                        vals.append(torch.zeros(n, c, dtype=x.dtype))  # a constant: no gradient
            t = torch.stack(vals, -1)
            if kind in ("max", "dilated"):
                row.append(t.max(-1).values)
            elif kind == "average":
                row.append(t.sum(-1) / count if count else t.sum(-1) * 0)
            else:
                row.append(torch.sqrt((t * t).sum(-1)))
        rows.append(torch.stack(row, -1))
    return torch.stack(rows, -2)


def _case(seed: int, kind: str) -> dict:
    r = random.Random(seed)
    dil = kind == "dilated"
    dh, dw = r.randint(2, 5), r.randint(2, 5)
    cx, cy = r.randint(-1, dw - 1), r.randint(-1, dh - 1)
    return dict(
        kx=r.randint(1, 4), ky=r.randint(1, 4), sx=r.randint(1, 3), sy=r.randint(1, 3),
        dx=r.randint(1, 3) if dil else 1, dy=r.randint(1, 3) if dil else 1,
        offset=(r.randint(-1, 3), r.randint(-1, 3)), clip=(cx, cy, r.randint(1 - min(cx, 0), 6), r.randint(1 - min(cy, 0), 6)),
        dst=(dh, dw), edge=r.randint(0, 1), src=(r.randint(1, 2), r.randint(1, 3), r.randint(3, 8), r.randint(3, 8)),
        zp=(r.randint(0, 2), r.randint(0, 2)) if kind == "average" else (0, 0),
    )  # fmt: skip


def _make(dev, kind: str, p: dict):
    fwd_cls, grad_cls = KINDS[kind]
    if kind == "dilated":
        fwd = fwd_cls(dev, p["kx"], p["ky"], p["dx"], p["dy"], p["sx"], p["sy"])
        grad = grad_cls(dev, p["kx"], p["ky"], p["dx"], p["dy"], p["sx"], p["sy"])
    else:
        fwd = fwd_cls(dev, p["kx"], p["ky"], p["sx"], p["sy"])
        grad = grad_cls(dev, p["kx"], p["ky"], p["sx"], p["sy"])
    fwd.offset = m.Offset(*p["offset"], 0)
    cx, cy, cw, ch = p["clip"]
    fwd.clip_rect = m.Region.make(cx, cy, cw, ch, depth=1 << 20)  # every image
    fwd.edge_mode = m.EdgeMode(p["edge"])
    if kind == "average":
        fwd.zero_pad_size_x, fwd.zero_pad_size_y = p["zp"]
        grad.zero_pad_size_x, grad.zero_pad_size_y = p["zp"]
    return fwd, grad


def _run(dev, kind, p, x, g=None):
    fwd, grad = _make(dev, kind, p)
    n, c = x.shape[:2]
    dst = m.Image.from_tensor(torch.zeros(n, c, *p["dst"], dtype=x.dtype, device=x.device))
    cb = dev.new_command_queue().command_buffer()
    st = fwd.result_state(m.Image.from_tensor(x))
    fwd.encode(cb, m.Image.from_tensor(x), dst, st)
    dx = None if g is None else grad.encode(cb, m.Image.from_tensor(g), m.Image.from_tensor(x), st)
    run(cb)
    return dst.tensor, (None if dx is None else dx.tensor)


def _written(p: dict) -> tuple[slice, slice]:
    (cx, cy, cw, ch), (dh, dw) = p["clip"], p["dst"]
    return slice(max(cy, 0), min(cy + ch, dh)), slice(max(cx, 0), min(cx + cw, dw))


CASES = [(kind, s) for kind in KINDS for s in range(14)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,seed", CASES, ids=lambda v: str(v))
def test_pooling_matches_the_window_model_and_autograd(kind, seed, device) -> None:
    p = _case(seed, kind)
    gen = torch.Generator().manual_seed(seed)
    dev = m.Device(device)
    if kind in ("max", "dilated"):  # small integers: many ties, which must go to the first max
        x = torch.randint(-3, 4, p["src"], generator=gen).double()
    else:
        x = torch.randn(p["src"], generator=gen, dtype=torch.float64)
    n, c = p["src"][:2]
    g = torch.randn(n, c, *p["dst"], generator=gen, dtype=torch.float64)
    ys, xs = _written(p)
    g_outside = g.clone()
    g_outside[:, :, ys, xs] = 0
    out, dx = _run(dev, kind, p, x.to(device), g.to(device))
    xr = x.clone().requires_grad_()
    want = reference(xr, kind, p)
    assert_close(out[:, :, ys, xs], want.detach(), f"{kind} forward {p}", tol=1e-13)
    assert not out.cpu()[g_outside != 0].any()  # only the clip rect is written
    if want.requires_grad:  # else every window read only ZERO padding
        want.backward(g[:, :, ys, xs])
    grad_ref = xr.grad if xr.grad is not None else torch.zeros_like(x)
    assert_close(dx, grad_ref, f"{kind} gradient vs autograd {p}", tol=1e-12)


@pytest.mark.parametrize("kind", ["average", "l2", "max"])
def test_pooling_gradients_are_adjoint(kind) -> None:
    dev = m.Device("cpu")
    for seed in range(8):
        p = _case(100 + seed, kind)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(p["src"], generator=gen, dtype=torch.float64)  # distinct values: no ties
        v = torch.randn(p["src"], generator=gen, dtype=torch.float64)
        g = torch.randn(*p["src"][:2], *p["dst"], generator=gen, dtype=torch.float64)
        eps = 1e-7
        jv = (_run(dev, kind, p, x + eps * v)[0] - _run(dev, kind, p, x - eps * v)[0]) / (2 * eps)
        _, dx = _run(dev, kind, p, x, g)
        if jv.abs().max() == 0:  # every window read only ZERO padding
            assert dx.abs().max() == 0
            continue
        assert_adjoint(jv, g, v, dx, f"{kind} adjoint {p}", tol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_standard_pooling_equals_torch(dtype, device) -> None:
    gen = torch.Generator().manual_seed(71)
    dev = m.Device(device)
    x = torch.randn(2, 3, 9, 8, generator=gen).to(dtype)
    x64 = x.double()
    for kernel, ref in (
        (m.PoolingMax(dev, 3, 3, 2, 2), lambda t: F.max_pool2d(t, 3, 2, 1)),
        (
            m.PoolingAverage(dev, 3, 3, 2, 2),
            lambda t: F.avg_pool2d(t, 3, 2, 1, count_include_pad=True),
        ),
        (m.PoolingL2Norm(dev, 2, 2, 2, 2), lambda t: F.lp_pool2d(t, 2, 2, 2)),
    ):
        if isinstance(kernel, m.PoolingMax):  # torch pads max pooling with -inf: MPS CLAMP
            kernel.edge_mode = m.EdgeMode.CLAMP
        if isinstance(kernel, m.PoolingL2Norm):
            kernel.padding = m.DefaultPadding(
                m.PaddingMethod.SIZE_VALID_ONLY | m.PaddingMethod.ALIGN_TOP_LEFT
            )
        cb = dev.new_command_queue().command_buffer()
        y = kernel.encode(cb, m.Image.from_tensor(x.to(device)))
        run(cb)
        assert_close(y.tensor, ref(x64), f"{type(kernel).__name__} vs torch", dtype=dtype)


def test_clamp_average_shrinks_to_the_image_and_tensorflow_policy() -> None:
    """TF SAME average pooling = centred, remainder bottom-right, CLAMP (valid-pixel count),
    which is torch's count_include_pad=False when the padding is symmetric."""
    gen = torch.Generator().manual_seed(72)
    dev = m.Device("cpu")
    x = torch.randn(1, 2, 7, 7, generator=gen, dtype=torch.float64)
    pool = m.PoolingAverage(dev, 3, 3, 2, 2)
    pool.padding = m.DefaultPadding.tensorflow_average_pooling()
    cb = dev.new_command_queue().command_buffer()
    y = pool.encode(cb, m.Image.from_tensor(x))
    run(cb)
    assert pool.edge_mode is m.EdgeMode.CLAMP
    assert_close(
        y.tensor, F.avg_pool2d(x, 3, 2, 1, count_include_pad=False), "TF SAME average", tol=1e-13
    )


def test_exclude_edges_counts_the_policy_padding_only() -> None:
    """ZERO edges + EXCLUDE_EDGES (Caffe): on 4 px with a 3-wide window and stride 2, SAME pads
    1 pixel before and none after, so taps in [-1, 4) count. Windows centred at -1, 1, 3 read
    [-2, 1), [0, 3), [2, 5)."""
    dev = m.Device("cpu")
    x = m.Image.from_tensor(torch.ones(1, 1, 1, 4, dtype=torch.float64))
    results = {}
    for name, method in (
        ("exclude", m.PaddingMethod.SIZE_SAME | m.PaddingMethod.EXCLUDE_EDGES),
        ("zero", m.PaddingMethod.SIZE_SAME),
    ):
        pool = m.PoolingAverage(dev, 3, 1, 2, 1)
        pool.padding = m.DefaultPadding(method)
        pool.offset = m.Offset(-1, 0, 0)
        dst = m.Image.from_tensor(torch.zeros(1, 1, 1, 3, dtype=torch.float64))
        cb = dev.new_command_queue().command_buffer()
        pool.encode(cb, x, dst)
        run(cb)
        results[name] = dst.tensor.flatten().tolist()
    assert results["exclude"] == pytest.approx([1 / 2, 1.0, 1.0])  # divisors 2, 3, 2
    assert results["zero"] == pytest.approx([1 / 3, 1.0, 2 / 3])  # divisors 3, 3, 3


def test_max_gradient_routes_to_the_first_maximum_and_not_to_padding() -> None:
    dev = m.Device("cpu")
    pool, grad = m.PoolingMax(dev, 2, 2, 2, 2), m.PoolingMaxGradient(dev, 2, 2, 2, 2)
    x = torch.tensor([[[[1.0, 5.0, -3.0, -2.0], [5.0, 5.0, -1.0, -4.0]]]], dtype=torch.float64)
    pool.offset = m.Offset(1, 1, 0)  # windows [0,2)x[0,2) and [2,4)x[0,2): no padding
    src = m.Image.from_tensor(x)
    cb = dev.new_command_queue().command_buffer()
    st = pool.result_state(src)
    y = pool.encode(cb, src, m.Image.from_tensor(torch.zeros(1, 1, 1, 2, dtype=torch.float64)), st)
    dx = grad.encode(
        cb, m.Image.from_tensor(torch.tensor([[[[7.0, 9.0]]]], dtype=torch.float64)), src, st
    )
    run(cb)
    assert y.tensor.flatten().tolist() == [5.0, -1.0]
    assert dx.tensor.flatten().tolist() == [0, 7, 0, 0, 0, 0, 9, 0]  # first 5 in raster order
    # shifted by one row: the windows reach a ZERO row above the image, and 0 beats negatives
    pool.offset = m.Offset(1, 0, 0)
    cb = dev.new_command_queue().command_buffer()
    st = pool.result_state(src)
    y = pool.encode(cb, src, m.Image.from_tensor(torch.zeros(1, 1, 1, 2, dtype=torch.float64)), st)
    dx = grad.encode(
        cb, m.Image.from_tensor(torch.tensor([[[[7.0, 9.0]]]], dtype=torch.float64)), src, st
    )
    run(cb)
    assert y.tensor.flatten().tolist() == [5.0, 0.0]  # the second window is won by padding
    assert dx.tensor.flatten().tolist() == [0, 7, 0, 0, 0, 0, 0, 0]  # which passes no gradient


def test_l2_pooling_of_zeros_has_zero_gradient() -> None:
    dev = m.Device("cpu")
    pool, grad = m.PoolingL2Norm(dev, 2, 2, 2, 2), m.PoolingL2NormGradient(dev, 2, 2, 2, 2)
    x = torch.zeros(1, 1, 4, 4, dtype=torch.float32)
    x[0, 0, 2:, 2:] = torch.tensor([[3.0, 0.0], [0.0, 4.0]])
    src = m.Image.from_tensor(x)
    cb = dev.new_command_queue().command_buffer()
    st = pool.result_state(src)
    y = pool.encode(cb, src, destination_state=st)
    g = torch.tensor([[[[1.5, -2.0], [0.5, 2.5]]]])
    dx = grad.encode(cb, m.Image.from_tensor(g), src, st)
    run(cb)
    assert y.tensor.flatten().tolist() == [0.0, 0.0, 0.0, 5.0]
    assert torch.isfinite(dx.tensor).all()
    assert dx.tensor[0, 0, :2].abs().max() == 0  # the all-zero windows pass nothing, not NaN
    assert dx.tensor[0, 0, 2, 2] == pytest.approx(2.5 * 3 / 5)  # g x / y
    assert dx.tensor[0, 0, 3, 3] == pytest.approx(2.5 * 4 / 5)


def test_source_size_limits_the_contributing_gradient() -> None:
    dev = m.Device("cpu")
    pool, grad = m.PoolingAverage(dev, 2, 2, 2, 2), m.PoolingAverageGradient(dev, 2, 2, 2, 2)
    src = m.Image.from_tensor(torch.randn(1, 1, 4, 4, dtype=torch.float64))
    g = m.Image.from_tensor(torch.tensor([[[[0.5, -1.0], [2.0, 3.0]]]], dtype=torch.float64))
    grad.source_size = m.Size(1, 2, 1)
    cb = dev.new_command_queue().command_buffer()
    st = pool.result_state(src)
    pool.encode(cb, src, destination_state=st)
    dx = grad.encode(cb, g, src, st)
    run(cb)
    assert dx.tensor[0, 0, :2, :2].eq(0.5 / 4).all() and dx.tensor[0, 0, 2:, :2].eq(2.0 / 4).all()
    assert dx.tensor[0, 0, :, 2:].abs().max() == 0  # output column 1 lies outside source_size


def test_pooling_errors() -> None:
    dev = m.Device("cpu")
    with pytest.raises(ValueError, match=r"\[PoolingMax\] kernel_width must be positive, got 0"):
        m.PoolingMax(dev, 0, 2)
    with pytest.raises(
        ValueError, match=r"\[PoolingAverage\] stride_in_pixels_y must be positive, got -1"
    ):
        m.PoolingAverage(dev, 2, 2, 1, -1)
    with pytest.raises(
        ValueError, match=r"\[DilatedPoolingMax\] dilation_rate_x must be positive, got 0"
    ):
        m.DilatedPoolingMax(dev, 2, 2, 0)
    with pytest.raises(
        ValueError, match=r"\[PoolingMaxGradient\] kernel_height must be positive, got 0"
    ):
        m.PoolingMaxGradient(dev, 2, 0)
    with pytest.raises(
        ValueError, match=r"\[PoolingAverage\] zero_pad_size_x must be >= 0, got -1"
    ):
        m.PoolingAverage(dev, 2, 2).zero_pad_size_x = -1
    pool = m.PoolingMax(dev, 2, 2, 2, 2)
    src = m.Image.from_tensor(torch.randn(1, 1, 4, 4))
    cb = dev.new_command_queue().command_buffer()
    st = pool.result_state(src)
    y = pool.encode(cb, src, destination_state=st)
    with pytest.raises(
        ValueError,
        match=r"\[PoolingMaxGradient\] stride_in_pixels_x must equal the forward pooling's \(2\), got 1",
    ):
        m.PoolingMaxGradient(dev, 2, 2, 1, 2).encode(cb, y, src, st)
    with pytest.raises(
        ValueError,
        match=r"\[PoolingAverageGradient\] gradient_state must come from a PoolingAverage encode, got one from PoolingMax",
    ):
        m.PoolingAverageGradient(dev, 2, 2, 2, 2).encode(cb, y, src, st)
    avg = m.PoolingAverage(dev, 2, 2, 2, 2)
    avg.zero_pad_size_x = 1
    st2 = avg.result_state(src)
    y2 = avg.encode(cb, src, destination_state=st2)
    with pytest.raises(
        ValueError,
        match=r"\[PoolingAverageGradient\] zero_pad_size_x must equal the forward pooling's \(1\), got 0",
    ):
        m.PoolingAverageGradient(dev, 2, 2, 2, 2).encode(cb, y2, src, st2)
