"""Image scale kernels (the kernels of the scale nodes): Lanczos (a = 3) against a float64
matrix reference written from the documented rule and against Pillow's LANCZOS where the two
definitions coincide (outputs whose taps all lie inside the image), bilinear against
F.interpolate, transforms and clip rects, edge modes, storage formats, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from mpsnn.cnn.scale import ImageBilinearScale, ImageLanczosScale, ImageScale
from tests.helpers import DEVICES, assert_close, run

CPU = m.Device("cpu")


def lanczos(x: float) -> float:
    if abs(x) >= 3:
        return 0.0
    if x == 0:
        return 1.0
    return math.sin(math.pi * x) / (math.pi * x) * math.sin(math.pi * x / 3) / (math.pi * x / 3)


def axis_matrix(count, size, scale, translate, first=0, lanczos_kernel=True, clamp=True):
    """``count x size`` weights of one axis (float64): rows are outputs ``first ..``."""
    a = torch.zeros(count, size, dtype=torch.float64)
    for k in range(count):
        u = first + k
        p = (u + 0.5 - translate) / scale - 0.5
        if lanczos_kernel:
            stretch = max(1.0, 1.0 / scale)
            taps = [
                (i, lanczos((i - p) / stretch))
                for i in range(math.floor(p - 3 * stretch) - 1, math.ceil(p + 3 * stretch) + 2)
            ]
            total = sum(w for _, w in taps)
            taps = [(i, w / total) for i, w in taps]
        else:
            i0 = math.floor(p)
            taps = [(i0, 1 - (p - i0)), (i0 + 1, p - i0)]
        for i, w in taps:
            if not 0 <= i < size:
                if not clamp:
                    continue
                i = min(max(i, 0), size - 1)
            a[k, i] += w
    return a


def reference(x, ay, ax):
    return torch.einsum("vi,ncij,uj->ncvu", ay, x.double(), ax)


def _scale(kernel, x, dst):
    src = m.Image.from_tensor(x)
    out = m.Image.from_tensor(dst.clone())
    cb = m.Device(str(x.device)).new_command_queue().command_buffer()
    kernel.encode(cb, src, out)
    run(cb)
    return out.tensor


SIZES = [(11, 9), (23, 17), (5, 4), (3, 8), (9, 6)]  # destination (width, height) of a 9 x 6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("width,height", SIZES, ids=str)
@pytest.mark.parametrize("edge", [m.EdgeMode.CLAMP, m.EdgeMode.ZERO], ids=lambda e: e.name)
def test_lanczos_fits_the_source_to_the_destination(width, height, edge, dtype, device) -> None:
    gen = torch.Generator().manual_seed(301)
    x = torch.randn(2, 3, 6, 9, generator=gen).to(dtype)
    k = ImageLanczosScale(m.Device(device))
    k.edge_mode = edge
    y = _scale(k, x.to(device), torch.zeros(2, 3, height, width, dtype=dtype, device=device))
    clamp = edge is m.EdgeMode.CLAMP
    ay = axis_matrix(height, 6, height / 6, 0.0, clamp=clamp)
    ax = axis_matrix(width, 9, width / 9, 0.0, clamp=clamp)
    tol = 1e-13 if dtype == torch.float64 else None
    assert_close(y, reference(x, ay, ax), "Lanczos scale", dtype=dtype, tol=tol)


def test_lanczos_keeps_a_constant_image_and_has_six_taps_when_enlarging() -> None:
    from mpsnn.ops.resize import ScaleAxis, _scale_taps

    x = torch.full((1, 2, 5, 7), 3.25, dtype=torch.float64)
    for width, height in [(7, 5), (19, 13), (3, 2)]:
        y = _scale(ImageLanczosScale(CPU), x, torch.zeros(1, 2, height, width, dtype=torch.float64))
        assert_close(y, torch.full_like(y, 3.25), "constant", tol=1e-15)
    taps = _scale_taps(ScaleAxis(0, 40, 20, 2.0, 0.0, True, False))
    assert max(len(t) for t in taps) == 6  # a = 3: six taps per axis at scale >= 1
    taps = _scale_taps(ScaleAxis(0, 15, 60, 0.25, 0.0, True, False))
    assert max(len(t) for t in taps) == 24  # reduced 4 times: the kernel 4 times as wide


def _inside(size, count):
    """The outputs whose Lanczos taps all lie inside the source (no edge rule involved)."""
    scale = count / size
    stretch = max(1.0, 1.0 / scale)
    ok = []
    for u in range(count):
        p = (u + 0.5) / scale - 0.5
        ok.append(math.floor(p - 3 * stretch) + 1 >= 0 and math.ceil(p + 3 * stretch) - 1 < size)
    return torch.tensor(ok)


@pytest.mark.parametrize("width,height", [(53, 41), (61, 17), (9, 8), (20, 33)], ids=str)
def test_lanczos_equals_pillow_where_the_definitions_coincide(width, height) -> None:
    from PIL import Image as PILImage

    gen = torch.Generator().manual_seed(302)
    x = torch.randn(1, 1, 30, 24, generator=gen, dtype=torch.float64)
    y = _scale(ImageLanczosScale(CPU), x, torch.zeros(1, 1, height, width, dtype=torch.float64))
    image = PILImage.fromarray(x[0, 0].numpy().astype(np.float32), mode="F")
    ref = np.array(image.resize((width, height), PILImage.Resampling.LANCZOS), dtype=np.float64)
    inside = _inside(30, height)[:, None] & _inside(24, width)[None, :]
    assert inside.sum() >= 6
    got = y[0, 0][inside]
    want = torch.from_numpy(ref)[inside]
    # Pillow stores its horizontal pass in float32: agreement to float32 rounding.
    assert_close(got, want, "Lanczos against Pillow (inner outputs)", tol=1e-6)
    # Near the edges Pillow drops the outside taps and renormalizes; mpsnn clamps them.
    edge = ~inside
    assert (y[0, 0][edge] - torch.from_numpy(ref)[edge]).abs().max() > 1e-3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width,height", SIZES, ids=str)
def test_bilinear_fits_like_interpolate(width, height, device) -> None:
    gen = torch.Generator().manual_seed(303)
    x = torch.randn(2, 3, 6, 9, generator=gen, dtype=torch.float64).to(device)
    y = _scale(
        ImageBilinearScale(m.Device(device)),
        x,
        torch.zeros(2, 3, height, width, dtype=torch.float64, device=device),
    )
    ref = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False)
    assert_close(y, ref, "bilinear scale", tol=1e-13)


def test_bilinear_scale_transform_like_interpolate_scale_factor() -> None:
    gen = torch.Generator().manual_seed(304)
    x = torch.randn(1, 2, 7, 8, generator=gen, dtype=torch.float64)
    sx, sy = 1.7, 0.55
    ref = F.interpolate(
        x, scale_factor=(sy, sx), mode="bilinear", align_corners=False, recompute_scale_factor=False
    )
    k = ImageBilinearScale(CPU)
    k.scale_transform = m.ScaleTransform(sx, sy, 0.0, 0.0)
    y = _scale(k, x, torch.zeros(ref.shape, dtype=torch.float64))
    assert_close(y, ref, "bilinear scale with a transform", tol=1e-13)


@pytest.mark.parametrize("lanczos_kernel", [True, False])
def test_transform_and_clip_rect(lanczos_kernel) -> None:
    """The transform's origin is the clip rect's top-left corner; pixels outside the clip rect
    keep their values."""
    gen = torch.Generator().manual_seed(305)
    x = torch.randn(2, 2, 8, 10, generator=gen, dtype=torch.float64)
    dst = torch.randn(2, 2, 9, 12, generator=gen, dtype=torch.float64)
    t = m.ScaleTransform(1.6, 0.7, -3.2, 1.5)
    k = ImageLanczosScale(CPU) if lanczos_kernel else ImageBilinearScale(CPU)
    k.scale_transform = t
    k.clip_rect = m.Region.make(-2, 3, 9, 20, 0, 2)  # columns 0..6, rows 3..8
    y = _scale(k, x, dst)
    ay = axis_matrix(6, 8, 0.7, 1.5, first=0, lanczos_kernel=lanczos_kernel)
    ax = axis_matrix(7, 10, 1.6, -3.2, first=2, lanczos_kernel=lanczos_kernel)
    want = dst.clone()
    want[:, :, 3:9, 0:7] = reference(x, ay, ax)
    assert_close(y, want, "scale with a transform and a clip rect", tol=1e-13)
    # Without a transform the source fits the whole destination; the clip rect selects.
    k.scale_transform = None
    y = _scale(k, x, dst)
    ay = axis_matrix(6, 8, 9 / 8, 0.0, first=3, lanczos_kernel=lanczos_kernel)
    ax = axis_matrix(7, 10, 12 / 10, 0.0, first=0, lanczos_kernel=lanczos_kernel)
    want[:, :, 3:9, 0:7] = reference(x, ay, ax)
    assert_close(y, want, "scale without a transform, clipped", tol=1e-13)


def test_returning_encode_sizes_from_the_transform_and_channels_offsets() -> None:
    gen = torch.Generator().manual_seed(306)
    x = torch.randn(1, 4, 6, 5, generator=gen, dtype=torch.float64)
    k = ImageLanczosScale(CPU)
    k.scale_transform = m.ScaleTransform(2.0, 0.5)
    k.source_feature_channel_offset = 1
    k.source_feature_channel_max_count = 2
    cb = CPU.new_command_queue().command_buffer()
    y = k.encode(cb, m.Image.from_tensor(x))
    run(cb)
    assert y.tensor.shape == (1, 2, 3, 10)
    ref = reference(x[:, 1:3], axis_matrix(3, 6, 0.5, 0.0), axis_matrix(10, 5, 2.0, 0.0))
    assert_close(y.tensor, ref, "returning encode", tol=1e-13)
    assert k.result_state(m.Image.from_tensor(x)) is None  # forward only: no gradient state


def test_scale_errors() -> None:
    with pytest.raises(
        TypeError,
        match=r"\[ImageScale\] ImageScale is abstract: make an ImageBilinearScale or an ImageLanczosScale, got ImageScale",
    ):
        ImageScale(CPU)
    with pytest.raises(
        ValueError, match=r"\[ScaleTransform\] scale_x must be finite and > 0, got 0.0"
    ):
        m.ScaleTransform(0.0, 1.0)
    with pytest.raises(ValueError, match=r"\[ScaleTransform\] translate_y must be finite, got inf"):
        m.ScaleTransform(1.0, 1.0, 0.0, math.inf)
    with pytest.raises(
        TypeError, match=r"\[ScaleTransform\] scale_y must be a real number, got str '2'"
    ):
        m.ScaleTransform(1.0, "2")
    k = ImageBilinearScale(CPU)
    with pytest.raises(
        TypeError,
        match=r"\[ImageBilinearScale\] scale_transform must be a ScaleTransform or None, got tuple",
    ):
        k.scale_transform = (1.0, 1.0, 0.0, 0.0)
    x = m.Image.from_tensor(torch.randn(1, 1, 4, 4))
    cb = CPU.new_command_queue().command_buffer()
    with pytest.raises(
        ValueError,
        match=r"\[ImageBilinearScale\] a returning encode sizes its destination from scale_transform \(source size times its scale\): set one or give a destination_image, got scale_transform None",
    ):
        k.encode(cb, x)
    k.offset = m.Offset(0, 2, 0)
    with pytest.raises(
        ValueError,
        match=r"\[ImageBilinearScale\] offset.x and offset.y must be 0 \(scale_transform places the source\), got \(0, 2\)",
    ):
        k.encode(cb, x, m.Image.from_tensor(torch.zeros(1, 1, 2, 2)))
