"""Bilinear resize and crop-and-resize: forwards against F.interpolate and loop-level float64
references (TensorFlow's crop_and_resize rule written out), gradients against float64 autograd
of a PyTorch restatement and the adjoint test, geometry (offset, clip rect, channel offsets,
batches, edge modes), storage formats, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.helpers import DEVICES, assert_adjoint, assert_close, run

CPU = m.Device("cpu")
SNAP = 1e-9  # a crop position this close to an edge is on it (the documented rule)


def _encode(fwd, grad, x, g=None, dst=None, configure=None):
    """Forward (with a state) and, given ``g``, the gradient; returns the tensors."""
    if configure:
        configure(fwd)
    src = m.Image.from_tensor(x)
    cb = CPU.new_command_queue().command_buffer() if x.device.type == "cpu" else None
    if cb is None:
        cb = m.Device(str(x.device)).new_command_queue().command_buffer()
    st = fwd.result_state(src)
    y = fwd.encode(cb, src, None if dst is None else m.Image.from_tensor(dst.clone()), st)
    dx = None if g is None else grad.encode(cb, m.Image.from_tensor(g), src, st)
    run(cb)
    return y.tensor, (None if dx is None else dx.tensor)


# -- ResizeBilinear -------------------------------------------------------------------------


RESIZE_CASES = [  # (width, height, align_corners) from a 7 x 5 source
    (11, 9, False),
    (3, 2, False),
    (7, 5, False),
    (11, 9, True),
    (4, 3, True),
    (1, 1, True),
    (1, 3, False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str
)
@pytest.mark.parametrize("rw,rh,align", RESIZE_CASES, ids=str)
def test_resize_matches_interpolate_and_autograd(rw, rh, align, dtype, device) -> None:
    gen = torch.Generator().manual_seed(201)
    x = torch.randn(2, 3, 5, 7, generator=gen).to(dtype)
    g = torch.randn(2, 3, rh, rw, generator=gen).to(dtype)
    dev = m.Device(device)
    fwd = m.ResizeBilinear(dev, rw, rh, align)
    grad = m.ResizeBilinearGradient(dev, rw, rh, align)
    y, dx = _encode(fwd, grad, x.to(device), g.to(device))
    xr = x.double().requires_grad_()
    ref = F.interpolate(xr, size=(rh, rw), mode="bilinear", align_corners=align)
    ref.backward(g.double())
    tol = 1e-12 if dtype == torch.float64 else None
    assert_close(y, ref.detach(), "resize forward", dtype=dtype, tol=tol)
    assert_close(dx, xr.grad, "resize gradient", dtype=dtype, tol=tol)
    assert fwd.resize_width == rw and fwd.resize_height == rh and fwd.align_corners is align


def _check_adjoint(kernels, x, dst, configure, gen, what) -> torch.Tensor:
    """<J v, w> = <v, J^T w> for random ``v`` and cotangent ``w`` (the forward is linear in
    ``x``: ``J v`` is the difference of two encodes); returns ``J^T w``. ``kernels()`` makes a
    fresh (forward, gradient) pair for each encode."""
    v = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    cot = torch.randn(dst.shape, generator=gen, dtype=torch.float64)
    jv = (
        _encode(*kernels(), x + v, dst=dst, configure=configure)[0]
        - _encode(*kernels(), x, dst=dst, configure=configure)[0]
    )
    _, dx = _encode(*kernels(), x, cot, dst=dst, configure=configure)
    assert_adjoint(jv, cot, v, dx, what, tol=1e-12)
    return dx


def _resize_position(u, offset, size, resize, align):
    if align:
        return offset + (u * (size - 1) / (resize - 1) if resize > 1 else 0.0)
    return offset + (u + 0.5) * size / resize - 0.5


@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("edge", [m.EdgeMode.ZERO, m.EdgeMode.CLAMP], ids=lambda e: e.name)
def test_resize_general_geometry_formula_and_adjoint(align, edge) -> None:
    gen = torch.Generator().manual_seed(202)
    h, w, rw, rh = 4, 6, 9, 7
    x = torch.randn(3, 3, h, w, generator=gen, dtype=torch.float64)
    dst = torch.randn(2, 4, 8, 10, generator=gen, dtype=torch.float64)

    def configure(k):
        k.edge_mode = edge
        k.offset = m.Offset(1, -1, 1)  # source image 1 onwards
        k.clip_rect = m.Region.make(-2, 1, 9, 6, 0, 2)
        k.source_feature_channel_offset = 1
        k.destination_feature_channel_offset = 2

    def kernels():
        return m.ResizeBilinear(CPU, rw, rh, align), m.ResizeBilinearGradient(CPU, rw, rh, align)

    y, _ = _encode(*kernels(), x, dst=dst, configure=configure)

    def read(n, i, j):
        if 0 <= i < h and 0 <= j < w:
            return x[n, 1:3, i, j]
        if edge is m.EdgeMode.CLAMP:
            return x[n, 1:3, min(max(i, 0), h - 1), min(max(j, 0), w - 1)]
        return torch.zeros(2, dtype=torch.float64)

    want = dst.clone()
    for n in range(2):
        for r in range(1, 7):  # clip rows [1, 7)
            for c in range(0, 7):  # clip columns [-2, 7) of a 10-wide destination
                u, v = r - 1, c + 2  # counted from the clip origin
                py = _resize_position(u, -1, h, rh, align)
                px = _resize_position(v, 1, w, rw, align)
                i0, j0 = math.floor(py), math.floor(px)
                fy, fx = py - i0, px - j0
                want[n, 2:4, r, c] = (
                    (1 - fy) * (1 - fx) * read(n + 1, i0, j0)
                    + (1 - fy) * fx * read(n + 1, i0, j0 + 1)
                    + fy * (1 - fx) * read(n + 1, i0 + 1, j0)
                    + fy * fx * read(n + 1, i0 + 1, j0 + 1)
                )
    assert_close(y, want, "resize general geometry", tol=1e-13)
    _check_adjoint(kernels, x, dst, configure, gen, "resize adjoint")


# -- CropAndResizeBilinear -------------------------------------------------------------------


def crop_reference(x, regions, rw, rh):
    """TensorFlow's crop_and_resize (bilinear, extrapolation value 0), written as loops."""
    n, c, h, w = x.shape
    out = torch.zeros(n, len(regions) * c, rh, rw, dtype=torch.float64)

    def position(a, s, k, size, count):
        if count > 1:
            p = a * (size - 1) + k * (s * (size - 1) / (count - 1))
        else:
            p = 0.5 * (a + a + s) * (size - 1)
        if -SNAP < p < 0:
            p = 0.0
        if size - 1 < p < size - 1 + SNAP:
            p = float(size - 1)
        return p

    for r, (rx, ry, rwid, rhei) in enumerate(regions):
        for v in range(rh):
            in_y = position(ry, rhei, v, h, rh)
            if in_y < 0 or in_y > h - 1:
                continue
            top, bottom = math.floor(in_y), math.ceil(in_y)
            ly = in_y - top
            for u in range(rw):
                in_x = position(rx, rwid, u, w, rw)
                if in_x < 0 or in_x > w - 1:
                    continue
                left, right = math.floor(in_x), math.ceil(in_x)
                lx = in_x - left
                tl, tr = x[:, :, top, left], x[:, :, top, right]
                bl, br = x[:, :, bottom, left], x[:, :, bottom, right]
                top_v = tl + (tr - tl) * lx
                bottom_v = bl + (br - bl) * lx
                out[:, r * c : (r + 1) * c, v, u] = top_v + (bottom_v - top_v) * ly
    return out


def crop_torch(x, regions, rw, rh):
    """The same function in differentiable PyTorch ops (gathers and masks), for autograd."""
    h, w = x.shape[2:]

    def axis(a, s, count, size):
        k = torch.arange(count, dtype=torch.float64)
        p = (
            a * (size - 1) + k * (s * (size - 1) / (count - 1))
            if count > 1
            else torch.full((1,), 0.5 * (2 * a + s) * (size - 1), dtype=torch.float64)
        )
        p = torch.where((p > -SNAP) & (p < 0), torch.zeros_like(p), p)
        p = torch.where((p > size - 1) & (p < size - 1 + SNAP), torch.full_like(p, size - 1), p)
        valid = (p >= 0) & (p <= size - 1)
        q = p.clamp(0, size - 1)
        lo, hi = q.floor().long(), q.ceil().long()
        return lo, hi, q - lo, valid

    crops = []
    for rx, ry, rwid, rhei in regions:
        t, b, ly, vy = axis(ry, rhei, rh, h)
        lft, rgt, lx, vx = axis(rx, rwid, rw, w)
        rows_t, rows_b = x[:, :, t], x[:, :, b]
        top = rows_t[..., lft] + (rows_t[..., rgt] - rows_t[..., lft]) * lx
        bot = rows_b[..., lft] + (rows_b[..., rgt] - rows_b[..., lft]) * lx
        val = top + (bot - top) * ly[:, None]
        crops.append(val * (vy[:, None] & vx[None, :]))
    return torch.cat(crops, 1)


CROP_CASES = [  # (width, height, regions)
    (4, 3, [(0.0, 0.0, 1.0, 1.0), (0.2, 0.1, 0.5, 0.7)]),
    (5, 6, [(-0.3, 0.25, 1.5, 0.5), (0.9, -0.2, -0.6, 1.6), (0.4, 0.4, 0.0, 0.0)]),
    (1, 1, [(0.1, 0.3, 0.6, 0.2)]),
    (3, 1, [(0.75, 0.5, -0.5, 0.25), (1.2, 0.0, 0.3, 1.0)]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("rw,rh,regions", CROP_CASES, ids=str)
def test_crop_and_resize_matches_the_reference_and_autograd(rw, rh, regions, dtype, device):
    gen = torch.Generator().manual_seed(203)
    x = torch.randn(2, 3, 6, 7, generator=gen).to(dtype)
    g = torch.randn(2, 3 * len(regions), rh, rw, generator=gen).to(dtype)
    dev = m.Device(device)
    n = len(regions)
    fwd = m.CropAndResizeBilinear(dev, rw, rh, n, regions)
    grad = m.CropAndResizeBilinearGradient(dev, rw, rh, n, regions)
    y, dx = _encode(fwd, grad, x.to(device), g.to(device))
    xd = x.double()
    want = crop_reference(xd, regions, rw, rh)
    xr = xd.clone().requires_grad_()
    restated = crop_torch(xr, regions, rw, rh)
    assert_close(restated.detach(), want, "the restatement is the reference", tol=1e-14)
    restated.backward(g.double())
    tol = 1e-12 if dtype == torch.float64 else None
    assert_close(y, want, "crop and resize forward", dtype=dtype, tol=tol)
    assert_close(dx, xr.grad, "crop and resize gradient", dtype=dtype, tol=tol)
    assert fwd.number_of_regions == n and fwd.regions == tuple(
        tuple(map(float, r)) for r in regions
    )


def test_whole_region_at_source_size_is_the_source_and_regions_stack_along_channels() -> None:
    gen = torch.Generator().manual_seed(204)
    x = torch.randn(2, 3, 5, 6, generator=gen, dtype=torch.float64)
    regions = [(0.0, 0.0, 1.0, 1.0), (1.0, 1.0, -1.0, -1.0)]  # the image, then rotated by 180
    y, _ = _encode(m.CropAndResizeBilinear(CPU, 6, 5, 2, regions), None, x)
    assert torch.equal(y[:, :3], x)
    assert torch.equal(y[:, 3:], x.flip(2, 3))


def test_crop_outside_the_source_is_the_extrapolation_value_zero() -> None:
    x = torch.randn(1, 2, 4, 4, dtype=torch.float64) + 5.0
    # Columns sample x = -1/3, 0, 1/3 .. of the width: the first is outside, so zero.
    regions = [(-1.0 / 9.0, 0.0, 1.0 / 3.0, 1.0)]
    y, _ = _encode(m.CropAndResizeBilinear(CPU, 3, 4, 1, regions), None, x)
    assert torch.equal(y[..., 0], torch.zeros_like(y[..., 0]))
    assert (y[..., 1:] != 0).all()
    assert_close(y, crop_reference(x, regions, 3, 4), "extrapolation", tol=1e-14)


def test_crop_geometry_clip_rect_channel_offsets_and_adjoint() -> None:
    gen = torch.Generator().manual_seed(205)
    x = torch.randn(3, 4, 6, 5, generator=gen, dtype=torch.float64)
    dst = torch.randn(3, 8, 5, 6, generator=gen, dtype=torch.float64)
    regions = [(0.1, 0.2, 0.8, 0.6), (-0.2, 0.5, 0.7, 0.7)]

    def configure(k):
        k.clip_rect = m.Region.make(-1, 2, 5, 9, 0, 3)  # columns 0..3, rows 2..4, 3 images
        k.source_feature_channel_offset = 1
        k.source_feature_channel_max_count = 2
        k.destination_feature_channel_offset = 3

    def kernels():
        return (
            m.CropAndResizeBilinear(CPU, 5, 4, 2, regions),
            m.CropAndResizeBilinearGradient(CPU, 5, 4, 2, regions),
        )

    y, _ = _encode(*kernels(), x, dst=dst, configure=configure)
    full = crop_reference(x[:, 1:3], regions, 5, 4)  # crops of channels 1, 2
    want = dst.clone()
    # destination pixel (r, c) is crop pixel (r - 2, c + 1), counted from the clip origin
    want[:, 3:7, 2:5, 0:4] = full[:, :, 0:3, 1:5]
    assert_close(y, want, "crop geometry", tol=1e-14)
    dx = _check_adjoint(kernels, x, dst, configure, gen, "crop adjoint")
    assert torch.equal(dx[:, [0, 3]], torch.zeros_like(dx[:, [0, 3]]))  # channels not read


def test_resize_and_crop_errors() -> None:
    with pytest.raises(
        ValueError, match=r"\[ResizeBilinear\] resize_width must be positive, got 0"
    ):
        m.ResizeBilinear(CPU, 0, 2)
    with pytest.raises(
        TypeError, match=r"\[ResizeBilinear\] resize_height must be an int, got float"
    ):
        m.ResizeBilinear(CPU, 2, 2.0)
    with pytest.raises(
        TypeError, match=r"\[ResizeBilinear\] align_corners must be a bool, got int"
    ):
        m.ResizeBilinear(CPU, 2, 2, 1)
    crop = m.CropAndResizeBilinear
    with pytest.raises(
        ValueError, match=r"\[CropAndResizeBilinear\] number_of_regions must be positive, got 0"
    ):
        crop(CPU, 2, 2, 0, [])
    with pytest.raises(
        ValueError,
        match=r"\[CropAndResizeBilinear\] regions must hold number_of_regions \(2\) regions, got 1",
    ):
        crop(CPU, 2, 2, 2, [(0, 0, 1, 1)])
    with pytest.raises(
        TypeError,
        match=r"\[CropAndResizeBilinear\] regions must be a sequence of \(x, y, width, height\) tuples, got int",
    ):
        crop(CPU, 2, 2, 1, 5)
    with pytest.raises(
        TypeError,
        match=r"\[CropAndResizeBilinear\] region 1 must be 4 real numbers \(x, y, width, height\), got \(0, 0, 1\)",
    ):
        crop(CPU, 2, 2, 2, [(0, 0, 1, 1), (0, 0, 1)])
    with pytest.raises(
        ValueError, match=r"\[CropAndResizeBilinear\] region 0 must be finite, got \(0, nan, 1, 1\)"
    ):
        crop(CPU, 2, 2, 1, [(0, math.nan, 1, 1)])
    k = crop(CPU, 2, 2, 1, [(0, 0, 1, 1)])
    with pytest.raises(
        ValueError, match=r"\[CropAndResizeBilinear\] edge_mode must be one of ZERO, got CLAMP"
    ):
        k.edge_mode = m.EdgeMode.CLAMP
    x = m.Image.from_tensor(torch.randn(1, 2, 3, 3))
    cb = CPU.new_command_queue().command_buffer()
    k.offset = m.Offset(1, 0, 0)
    with pytest.raises(
        ValueError,
        match=r"\[CropAndResizeBilinear\] offset.x and offset.y must be 0 \(the regions place the crops\), got \(1, 0\)",
    ):
        k.encode(cb, x, m.Image.from_tensor(torch.zeros(1, 2, 2, 2)))


def test_gradient_parameters_must_match_the_forward() -> None:
    x = m.Image.from_tensor(torch.randn(1, 1, 3, 3))
    cb = CPU.new_command_queue().command_buffer()
    fwd = m.ResizeBilinear(CPU, 4, 5, True)
    st = fwd.result_state(x)
    y = fwd.encode(cb, x, destination_state=st)
    with pytest.raises(
        ValueError,
        match=r"\[ResizeBilinearGradient\] \(resize_width, resize_height\) and align_corners must equal the forward's \(\(4, 5\), True\), got \(\(4, 5\), False\)",
    ):
        m.ResizeBilinearGradient(CPU, 4, 5).encode(cb, y, x, st)
    regions = [(0.0, 0.0, 0.5, 0.5)]
    crop = m.CropAndResizeBilinear(CPU, 2, 2, 1, regions)
    cst = crop.result_state(x)
    cy = crop.encode(cb, x, destination_state=cst)
    with pytest.raises(
        ValueError,
        match=r"\[CropAndResizeBilinearGradient\] regions must equal the forward's \(\(0.0, 0.0, 0.5, 0.5\),\), got \(\(0.0, 0.0, 0.5, 0.25\),\)",
    ):
        m.CropAndResizeBilinearGradient(CPU, 2, 2, 1, [(0, 0, 0.5, 0.25)]).encode(cb, cy, x, cst)
    with pytest.raises(
        ValueError,
        match=r"\[CropAndResizeBilinearGradient\] \(resize_width, resize_height\) must equal the forward's \(2, 2\), got \(3, 2\)",
    ):
        m.CropAndResizeBilinearGradient(CPU, 3, 2, 1, regions).encode(cb, cy, x, cst)
    with pytest.raises(
        ValueError,
        match=r"\[ResizeBilinearGradient\] gradient_state must come from a ResizeBilinear encode, got one from CropAndResizeBilinear",
    ):
        m.ResizeBilinearGradient(CPU, 2, 2).encode(cb, cy, x, cst)
