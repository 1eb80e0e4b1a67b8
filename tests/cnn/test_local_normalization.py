"""Local normalization kernels (cross-channel, spatial, local contrast) and their gradients on
the MPS window model: forwards against PyTorch's local_response_norm (cross channel) and
loop-level references written here from the formulas (one pixel and one tap at a time), on
random geometry (offsets, clip rects, channel ranges, destination channel offsets, ZERO and
CLAMP, odd and even windows, kw != kh, single multi-image images and batches); gradients against
autograd of those references and by the adjoint identity with Jacobian-vector products of the
kernels' own encodes; storage formats; parameters captured at encode; errors."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

import mpsnn as m
from tests.helpers import DEVICES, assert_adjoint, assert_close, run

F64 = torch.float64
KINDS = {
    "cross": (m.CrossChannelNormalization, m.CrossChannelNormalizationGradient),
    "spatial": (m.SpatialNormalization, m.SpatialNormalizationGradient),
    "contrast": (m.LocalContrastNormalization, m.LocalContrastNormalizationGradient),
}


# -- references: the window model and the formulas, written out ---------------------------------


def _taps(centre: int, k: int) -> list[int]:
    return [centre - k // 2 + j for j in range(k)]


def _read(x: torch.Tensor, a: int, b: int, clamp: bool) -> torch.Tensor:
    """``x[:, :, a, b]`` with the edge rule (a constant 0 outside the image under ZERO)."""
    h, w = x.shape[-2:]
    if 0 <= a < h and 0 <= b < w:
        return x[:, :, a, b]
    if clamp:
        return x[:, :, min(max(a, 0), h - 1), min(max(b, 0), w - 1)]
    return torch.zeros(x.shape[:2], dtype=x.dtype)


def _written(p: dict) -> tuple[range, range]:
    (cx, cy, cw, ch), (dh, dw) = p["clip"], p["dst"]
    return range(max(cy, 0), min(cy + ch, dh)), range(max(cx, 0), min(cx + cw, dw))


def _images_and_channels(p: dict) -> tuple[int, int, int]:
    """(first source image, first source channel, channels read)."""
    c = p["src"][1]
    return p["z"], p["sco"], min(p["smax"], c - p["sco"])


def reference(x: torch.Tensor, kind: str, p: dict) -> torch.Tensor:
    """The written block ``(images, channels read, rows, cols)`` of the destination."""
    z, sco, nc = _images_and_channels(p)
    src = x[z:, sco : sco + nc]
    ox, oy = p["offset"]
    cx, cy = p["clip"][:2]
    clamp = p["edge"] == 1
    q = p["params"]
    ys, xs = _written(p)
    rows = []
    for u in ys:
        row = []
        for v in xs:
            ci, cj = oy + (u - cy), ox + (v - cx)  # the centre: stride 1
            if kind == "cross":
                row.append(_read(src, ci, cj, clamp))  # normalized over channels below
                continue
            kw, kh = p["kernel"]
            k = kw * kh
            s1 = torch.zeros(src.shape[:2], dtype=x.dtype)
            s2 = torch.zeros(src.shape[:2], dtype=x.dtype)
            for a in _taps(ci, kh):
                for b in _taps(cj, kw):
                    t = _read(src, a, b, clamp)
                    s1 = s1 + t
                    s2 = s2 + t * t
            centre = _read(src, ci, cj, clamp)
            if kind == "spatial":
                base = q["delta"] + q["alpha"] / k * s2
                row.append(centre * base ** (-q["beta"]))
            else:
                mean = s1 / k
                var = torch.clamp(s2 / k - mean * mean, min=0.0)
                base = q["delta"] + q["alpha"] * var
                row.append(q["pm"] + q["ps"] * (centre - q["p0"] * mean) * base ** (-q["beta"]))
        rows.append(torch.stack(row, -1))
    block = torch.stack(rows, -2)
    if kind == "cross":
        size = p["kernel"]
        return F.local_response_norm(block, size, q["alpha"], q["beta"], q["delta"])
    return block


# -- random configurations ----------------------------------------------------------------------


def _params(r: random.Random, kind: str) -> dict:
    if kind == "contrast":
        return dict(
            alpha=r.uniform(0.3, 2.0), beta=r.uniform(0.3, 1.0), delta=r.uniform(0.1, 1.0),
            p0=r.uniform(0.3, 1.2), pm=r.uniform(-0.5, 0.5), ps=r.uniform(0.5, 2.0),
        )  # fmt: skip
    return dict(alpha=r.uniform(0.3, 2.0), beta=r.uniform(0.3, 1.5), delta=r.uniform(0.5, 1.5))


def _case(seed: int, kind: str, batch: bool) -> dict:
    r = random.Random(seed * 7 + len(kind))
    n, c, h, w = r.randint(1, 3), r.randint(1, 6), r.randint(3, 7), r.randint(3, 7)
    dh, dw = r.randint(2, 6), r.randint(2, 6)
    cx, cy = r.randint(-1, dw - 1), r.randint(-1, dh - 1)
    sco = r.randint(0, c - 1)
    smax = r.randint(1, c + 1)
    dco = r.randint(0, 2)
    z = 0 if batch else r.randint(0, n - 1)
    kernel = r.randint(1, 6) if kind == "cross" else (r.randint(1, 5), r.randint(1, 5))
    return dict(
        src=(n, c, h, w), dst=(dh, dw), z=z, sco=sco, smax=smax, dco=dco,
        dst_channels=dco + min(smax, c - sco) + r.randint(0, 1),
        offset=(r.randint(-2, 3), r.randint(-2, 3)),
        clip=(cx, cy, r.randint(1 - min(cx, 0), 6), r.randint(1 - min(cy, 0), 6)),
        edge=r.randint(0, 1), kernel=kernel, params=_params(r, kind), batch=batch,
    )  # fmt: skip


def _make(dev: m.Device, kind: str, p: dict) -> tuple[m.CNNKernel, m.GradientKernel]:
    fwd_cls, grad_cls = KINDS[kind]
    size = (p["kernel"],) if kind == "cross" else p["kernel"]
    fwd, grad = fwd_cls(dev, *size), grad_cls(dev, *size)
    for name, value in p["params"].items():
        setattr(fwd, name, value)
        setattr(grad, name, value)
    fwd.offset = m.Offset(*p["offset"], p["z"])
    cx, cy, cw, ch = p["clip"]
    fwd.clip_rect = m.Region.make(cx, cy, cw, ch, depth=1 << 20)  # every image
    fwd.edge_mode = m.EdgeMode(p["edge"])
    fwd.source_feature_channel_offset = p["sco"]
    fwd.source_feature_channel_max_count = p["smax"]
    fwd.destination_feature_channel_offset = p["dco"]
    return fwd, grad


def _dst_shape(p: dict) -> tuple[int, int, int, int]:
    return (p["src"][0] - p["z"], p["dst_channels"], *p["dst"])


def _encode(dev, kind, p, x, dst0, g=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Forward into a copy of ``dst0`` (and the gradient of ``g`` when given): the tensors."""
    fwd, grad = _make(dev, kind, p)
    cb = dev.new_command_queue().command_buffer()
    if p["batch"]:
        src, dst = m.ImageBatch.from_tensor(x), m.ImageBatch.from_tensor(dst0.clone())
        states = fwd.result_state_batch(src)
        fwd.encode_batch(cb, src, dst, states)
        dx = None
        if g is not None:
            dx = grad.encode_batch(cb, m.ImageBatch.from_tensor(g), src, states)
    else:
        src, dst = m.Image.from_tensor(x), m.Image.from_tensor(dst0.clone())
        state = fwd.result_state(src)
        fwd.encode(cb, src, dst, state)
        dx = None if g is None else grad.encode(cb, m.Image.from_tensor(g), src, state)
    run(cb)
    return dst.tensor, (None if dx is None else dx.tensor)


def _region(p: dict) -> tuple[slice, slice, slice]:
    ys, xs = _written(p)
    nc = _images_and_channels(p)[2]
    return (
        slice(p["dco"], p["dco"] + nc),
        slice(ys.start, ys.stop),
        slice(xs.start, xs.stop),
    )


def _inputs(p: dict, seed: int, dtype=F64) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(p["src"], generator=gen, dtype=F64) * 1.3 + 0.2
    dst0 = torch.randn(_dst_shape(p), generator=gen, dtype=F64)
    g = torch.randn(_dst_shape(p), generator=gen, dtype=F64)
    return x.to(dtype), dst0.to(dtype), g.to(dtype)


def _reference_gradient(x: torch.Tensor, kind: str, p: dict, g: torch.Tensor):
    """(forward block, dL/dx) of the reference for the incoming gradient ``g`` (whole dst)."""
    xr = x.detach().double().clone().requires_grad_()
    want = reference(xr, kind, p)
    chans, ys, xs = _region(p)
    if want.requires_grad:  # else every read was ZERO padding: a constant
        want.backward(g.double()[:, chans, ys, xs])
    grad = xr.grad if xr.grad is not None else torch.zeros_like(xr)
    return want.detach(), grad


CASES = [(kind, s, s % 2 == 1) for kind in KINDS for s in range(16)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,seed,batch", CASES, ids=str)
def test_matches_the_reference_and_autograd(kind, seed, batch, device) -> None:
    p = _case(seed, kind, batch)
    dev = m.Device(device)
    x, dst0, g = _inputs(p, seed)
    out, dx = _encode(dev, kind, p, x.to(device), dst0.to(device), g.to(device))
    want, grad_ref = _reference_gradient(x, kind, p, g)
    chans, ys, xs = _region(p)
    assert_close(out[:, chans, ys, xs], want, f"{kind} forward {p}", tol=1e-12)
    untouched = torch.ones(dst0.shape, dtype=torch.bool)
    untouched[:, chans, ys, xs] = False
    assert torch.equal(out.cpu()[untouched], dst0[untouched]), "wrote outside the clip/channels"
    assert_close(dx, grad_ref, f"{kind} gradient vs autograd {p}", tol=1e-11)
    z, sco, nc = _images_and_channels(p)
    # the gradient is the forward source's shape; channels and images not read get 0
    assert dx.shape == x.shape
    if z:
        assert dx[:z].abs().sum().item() == 0
    others = [i for i in range(x.shape[1]) if not sco <= i < sco + nc]
    assert dx[:, others].abs().sum().item() == 0


@pytest.mark.parametrize("kind,seed,batch", CASES[::2], ids=str)
def test_gradient_is_the_adjoint_of_the_encoded_forward(kind, seed, batch) -> None:
    """``<J(x) v, w> = <v, gradient(w)>``: ``J(x) v`` by differentiating the forward encode
    itself (`torch.autograd.functional.jvp`), ``v`` and ``w`` random (``w`` over the whole
    destination: what lies outside the written region must not count)."""
    p = _case(100 + seed, kind, batch)
    dev = m.Device("cpu")
    x, dst0, w = _inputs(p, 100 + seed)
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)

    def forward(t: torch.Tensor) -> torch.Tensor:
        return _encode(dev, kind, p, t, dst0)[0]

    _, jv = torch.autograd.functional.jvp(forward, x, v)
    _, dx = _encode(dev, kind, p, x, dst0, w)
    if jv.abs().max() == 0:  # every read was ZERO padding: nothing depends on x
        assert dx.abs().max() == 0
        return
    assert_adjoint(jv, w, v, dx, f"{kind} adjoint {p}", tol=1e-10)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", list(KINDS))
def test_storage_formats(kind, dtype, device) -> None:
    """Inputs rounded to the format, the reference in float64 on the rounded inputs."""
    dev = m.Device(device)
    for seed in (3, 4, 9):
        p = _case(seed, kind, seed % 2 == 0)
        x, dst0, g = _inputs(p, 200 + seed, dtype)
        out, dx = _encode(dev, kind, p, x.to(device), dst0.to(device), g.to(device))
        assert out.dtype == dtype and dx.dtype == dtype
        want, grad_ref = _reference_gradient(x, kind, p, g)
        chans, ys, xs = _region(p)
        assert_close(out[:, chans, ys, xs], want, f"{kind} {dtype} forward {p}", dtype=dtype)
        assert_close(dx, grad_ref, f"{kind} {dtype} gradient {p}", dtype=dtype)


def test_cross_channel_equals_torch_with_the_mps_defaults() -> None:
    """A returning encode: same-size destination, offset 0; kernel_size 5, alpha 1, beta 5,
    delta 1 by default."""
    dev = m.Device("cpu")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 7, 3, 4, generator=gen, dtype=F64)
    g = torch.randn(2, 7, 3, 4, generator=gen, dtype=F64)
    lrn = m.CrossChannelNormalization(dev)
    assert (lrn.kernel_size, lrn.alpha, lrn.beta, lrn.delta) == (5, 1.0, 5.0, 1.0)
    assert (lrn.kernel_width, lrn.kernel_height) == (1, 1)  # spatially a 1x1 window
    src = m.Image.from_tensor(x)
    cb = dev.new_command_queue().command_buffer()
    st = lrn.result_state(src)
    y = lrn.encode(cb, src, destination_state=st)
    dx = m.CrossChannelNormalizationGradient(dev, 5).encode(cb, m.Image.from_tensor(g), src, st)
    run(cb)
    xr = x.clone().requires_grad_()
    want = F.local_response_norm(xr, 5, 1.0, 5.0, 1.0)
    want.backward(g)
    assert lrn.offset == m.Offset(0, 0, 0)
    assert_close(y.tensor, want.detach(), "lrn defaults", tol=1e-13)
    assert_close(dx.tensor, xr.grad, "lrn defaults gradient", tol=1e-12)


@pytest.mark.parametrize("kind", ["spatial", "contrast"])
@pytest.mark.parametrize("edge", [0, 1])
def test_windowed_defaults_and_same_size_policy(kind, edge) -> None:
    """The MPS defaults (spatial alpha 1, beta 5, delta 1; local contrast alpha 0, beta 0.5,
    delta 1/1024, p0 1, pm 0, ps 1, here with alpha 1 so the variance matters) and a returning
    encode: destination the size of the source, offset 0, windows centred (kw != kh)."""
    dev = m.Device("cpu")
    fwd_cls, grad_cls = KINDS[kind]
    fwd = fwd_cls(dev, 3, 4)
    if kind == "spatial":
        defaults = dict(alpha=1.0, beta=5.0, delta=1.0)
    else:
        defaults = dict(alpha=0.0, beta=0.5, delta=1.0 / 1024, p0=1.0, pm=0.0, ps=1.0)
    assert {k: getattr(fwd, k) for k in defaults} == defaults
    assert (fwd.kernel_width, fwd.kernel_height) == (3, 4)
    params = dict(defaults, alpha=1.0)
    fwd.alpha = 1.0
    fwd.edge_mode = m.EdgeMode(edge)
    gen = torch.Generator().manual_seed(6 + edge)
    x = torch.randn(2, 2, 5, 6, generator=gen, dtype=F64) * 0.5
    g = torch.randn(2, 2, 5, 6, generator=gen, dtype=F64)
    src = m.Image.from_tensor(x)
    cb = dev.new_command_queue().command_buffer()
    st = fwd.result_state(src)
    y = fwd.encode(cb, src, destination_state=st)
    grad = grad_cls(dev, 3, 4)
    grad.alpha = 1.0
    dx = grad.encode(cb, m.Image.from_tensor(g), src, st)
    run(cb)
    assert fwd.offset == m.Offset(0, 0, 0) and y.tensor.shape == x.shape
    p = dict(
        src=x.shape, dst=(5, 6), z=0, sco=0, smax=2, dco=0, offset=(0, 0),
        clip=(0, 0, 6, 5), edge=edge, kernel=(3, 4), params=params,
    )  # fmt: skip
    xr = x.clone().requires_grad_()
    want = reference(xr, kind, p)
    want.backward(g)
    assert_close(y.tensor, want.detach(), f"{kind} defaults", tol=1e-12)
    assert_close(dx.tensor, xr.grad, f"{kind} defaults gradient", tol=1e-11)


def test_clamped_taps_send_their_gradient_to_the_edge_pixel() -> None:
    """A 1-pixel-wide source read with CLAMP by a 3-wide window: every tap is the one column,
    so the adjoint sums all three taps onto it (vs ZERO, where two taps are constants)."""
    dev = m.Device("cpu")
    x = torch.tensor([[[[0.5], [-1.0], [2.0]]]], dtype=F64)  # 1 x 1 x 3 x 1
    g = torch.tensor([[[[1.5], [-0.5], [0.25]]]], dtype=F64)
    results = {}
    for edge in (m.EdgeMode.ZERO, m.EdgeMode.CLAMP):
        fwd, grad = m.SpatialNormalization(dev, 3, 1), m.SpatialNormalizationGradient(dev, 3, 1)
        fwd.beta = grad.beta = 0.75
        fwd.edge_mode = edge
        src = m.Image.from_tensor(x)
        cb = dev.new_command_queue().command_buffer()
        st = fwd.result_state(src)
        y = fwd.encode(cb, src, destination_state=st)
        dx = grad.encode(cb, m.Image.from_tensor(g), src, st)
        run(cb)
        results[edge] = (y.tensor, dx.tensor)
    y_clamp, dx_clamp = results[m.EdgeMode.CLAMP]
    y_zero, _ = results[m.EdgeMode.ZERO]
    # CLAMP: T = 1 + (3 x^2) / 3; ZERO: T = 1 + x^2 / 3
    assert_close(y_clamp, x * (1 + x * x) ** -0.75, "clamp forward", tol=1e-14)
    assert_close(y_zero, x * (1 + x * x / 3) ** -0.75, "zero forward", tol=1e-14)
    xr = x.clone().requires_grad_()
    (xr * (1 + xr * xr) ** -0.75).backward(g)
    assert_close(dx_clamp, xr.grad, "clamp gradient on the edge pixel", tol=1e-13)


def test_parameters_are_taken_at_encode() -> None:
    """Changing a parameter between encode and commit changes neither the recorded forward nor
    what its gradient must match."""
    dev = m.Device("cpu")
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(1, 3, 4, 4, generator=gen, dtype=F64)
    g = torch.randn(1, 3, 4, 4, generator=gen, dtype=F64)
    fwd = m.LocalContrastNormalization(dev, 3, 3)
    fwd.alpha, fwd.p0 = 0.7, 0.4
    grad = m.LocalContrastNormalizationGradient(dev, 3, 3)
    grad.alpha, grad.p0 = 0.7, 0.4
    src = m.Image.from_tensor(x)
    cb = dev.new_command_queue().command_buffer()
    st = fwd.result_state(src)
    y = fwd.encode(cb, src, destination_state=st)
    fwd.alpha, fwd.p0 = 3.0, 2.0  # after the encode: must not matter
    dx = grad.encode(cb, m.Image.from_tensor(g), src, st)
    run(cb)
    params = dict(alpha=0.7, beta=0.5, delta=1.0 / 1024, p0=0.4, pm=0.0, ps=1.0)
    p = dict(
        src=x.shape, dst=(4, 4), z=0, sco=0, smax=3, dco=0, offset=(0, 0),
        clip=(0, 0, 4, 4), edge=0, kernel=(3, 3), params=params,
    )  # fmt: skip
    xr = x.clone().requires_grad_()
    want = reference(xr, "contrast", p)
    want.backward(g)
    assert_close(y.tensor, want.detach(), "encode-time parameters", tol=1e-12)
    assert_close(dx.tensor, xr.grad, "encode-time parameters gradient", tol=1e-11)


def test_zero_delta_on_an_all_zero_window_stays_finite() -> None:
    dev = m.Device("cpu")
    x = torch.zeros(1, 2, 5, 5, dtype=torch.float32)
    x[0, 0, 0, 0] = 2.0
    g = torch.randn(1, 2, 5, 5, generator=torch.Generator().manual_seed(9))
    for fwd, grad in (
        (m.SpatialNormalization(dev, 3, 3), m.SpatialNormalizationGradient(dev, 3, 3)),
        (m.CrossChannelNormalization(dev, 1), m.CrossChannelNormalizationGradient(dev, 1)),
    ):
        fwd.delta = grad.delta = 0.0
        src = m.Image.from_tensor(x)
        cb = dev.new_command_queue().command_buffer()
        st = fwd.result_state(src)
        y = fwd.encode(cb, src, destination_state=st)
        dx = grad.encode(cb, m.Image.from_tensor(g), src, st)
        run(cb)
        assert torch.isfinite(y.tensor).all() and torch.isfinite(dx.tensor).all()
        assert y.tensor[0, 1].abs().max() == 0 and dx.tensor[0, 1].abs().max() == 0
        assert y.tensor[0, 0, 0, 0] != 0


# -- errors -------------------------------------------------------------------------------------


def test_construction_and_assignment_errors() -> None:
    dev = m.Device("cpu")
    with pytest.raises(
        ValueError, match=r"\[CrossChannelNormalization\] kernel_size must be positive, got 0"
    ):
        m.CrossChannelNormalization(dev, 0)
    with pytest.raises(
        TypeError,
        match=r"\[CrossChannelNormalizationGradient\] kernel_size must be an int, got bool True",
    ):
        m.CrossChannelNormalizationGradient(dev, True)
    with pytest.raises(
        TypeError, match=r"\[SpatialNormalization\] kernel_width must be an int, got float 2.0"
    ):
        m.SpatialNormalization(dev, 2.0, 3)
    with pytest.raises(
        ValueError,
        match=r"\[LocalContrastNormalizationGradient\] kernel_height must be positive, got -1",
    ):
        m.LocalContrastNormalizationGradient(dev, 3, -1)
    with pytest.raises(
        ValueError,
        match=r"\[SpatialNormalizationGradient\] kernel_width must be positive, got 0",
    ):
        m.SpatialNormalizationGradient(dev, 0, 3)
    with pytest.raises(ValueError, match=r"\[SpatialNormalization\] alpha must be >= 0, got -1.0"):
        m.SpatialNormalization(dev, 3, 3).alpha = -1
    with pytest.raises(
        ValueError, match=r"\[CrossChannelNormalizationGradient\] alpha must be >= 0, got -0.5"
    ):
        m.CrossChannelNormalizationGradient(dev, 3).alpha = -0.5
    with pytest.raises(
        ValueError, match=r"\[CrossChannelNormalization\] beta must be finite, got nan"
    ):
        m.CrossChannelNormalization(dev).beta = math.nan
    with pytest.raises(
        ValueError, match=r"\[LocalContrastNormalization\] ps must be finite, got inf"
    ):
        m.LocalContrastNormalization(dev, 3, 3).ps = math.inf
    with pytest.raises(
        TypeError,
        match=r"\[LocalContrastNormalizationGradient\] delta must be a real number, got str",
    ):
        m.LocalContrastNormalizationGradient(dev, 3, 3).delta = "1"
    with pytest.raises(
        TypeError, match=r"\[SpatialNormalization\] beta must be a real number, got bool"
    ):
        m.SpatialNormalization(dev, 3, 3).beta = True
    with pytest.raises(
        ValueError,
        match=r"\[SpatialNormalization\] edge_mode must be one of ZERO, CLAMP, got MIRROR",
    ):
        m.SpatialNormalization(dev, 3, 3).edge_mode = m.EdgeMode.MIRROR
    with pytest.raises(AttributeError):
        m.CrossChannelNormalization(dev).kernel_size = 3
    lrn = m.CrossChannelNormalization(dev, 3)
    lrn.alpha = 2  # any finite real number, kept as a float
    assert lrn.alpha == 2.0 and isinstance(lrn.alpha, float)


def _forward_state(dev, fwd, x):
    src = m.Image.from_tensor(x)
    cb = dev.new_command_queue().command_buffer()
    st = fwd.result_state(src)
    y = fwd.encode(cb, src, destination_state=st)
    return cb, src, y, st


MISMATCHES = [
    (
        lambda d: m.SpatialNormalization(d, 3, 3),
        lambda d: m.SpatialNormalizationGradient(d, 3, 3),
        "alpha", 2.0, 1.0,
        r"\[SpatialNormalizationGradient\] alpha must equal the forward's \(2.0\), got 1.0",
    ),
    (
        lambda d: m.SpatialNormalization(d, 3, 2),
        lambda d: m.SpatialNormalizationGradient(d, 2, 2),
        None, None, None,
        r"\[SpatialNormalizationGradient\] kernel_width must equal the forward's \(3\), got 2",
    ),
    (
        lambda d: m.LocalContrastNormalization(d, 2, 3),
        lambda d: m.LocalContrastNormalizationGradient(d, 2, 4),
        None, None, None,
        r"\[LocalContrastNormalizationGradient\] kernel_height must equal the forward's \(3\), "
        r"got 4",
    ),
    (
        lambda d: m.LocalContrastNormalization(d, 3, 3),
        lambda d: m.LocalContrastNormalizationGradient(d, 3, 3),
        "p0", 0.25, 1.0,
        r"\[LocalContrastNormalizationGradient\] p0 must equal the forward's \(0.25\), got 1.0",
    ),
    (
        lambda d: m.LocalContrastNormalization(d, 3, 3),
        lambda d: m.LocalContrastNormalizationGradient(d, 3, 3),
        "pm", -0.5, 0.0,
        r"\[LocalContrastNormalizationGradient\] pm must equal the forward's \(-0.5\), got 0.0",
    ),
    (
        lambda d: m.CrossChannelNormalization(d, 5),
        lambda d: m.CrossChannelNormalizationGradient(d, 3),
        None, None, None,
        r"\[CrossChannelNormalizationGradient\] kernel_size must equal the forward's \(5\), got 3",
    ),
    (
        lambda d: m.CrossChannelNormalization(d, 3),
        lambda d: m.CrossChannelNormalizationGradient(d, 3),
        "beta", 0.75, 5.0,
        r"\[CrossChannelNormalizationGradient\] beta must equal the forward's \(0.75\), got 5.0",
    ),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(MISMATCHES)))
def test_gradient_parameters_must_match_the_forward(case) -> None:
    make_fwd, make_grad, name, fwd_value, grad_value, message = MISMATCHES[case]
    dev = m.Device("cpu")
    fwd, grad = make_fwd(dev), make_grad(dev)
    if name is not None:
        setattr(fwd, name, fwd_value)
        setattr(grad, name, grad_value)
    x = torch.randn(1, 4, 4, 4, generator=torch.Generator().manual_seed(case), dtype=F64)
    cb, src, y, st = _forward_state(dev, fwd, x)
    with pytest.raises(ValueError, match=message + "$"):
        grad.encode(cb, y, src, st)
    assert len(cb) == 1  # only the forward: the failed encode recorded nothing


@pytest.mark.parametrize(
    "forward,gradient,forward_name",
    [
        ("SoftMax", "CrossChannelNormalizationGradient", "CrossChannelNormalization"),
        ("LocalContrastNormalization", "SpatialNormalizationGradient", "SpatialNormalization"),
        (
            "SpatialNormalization",
            "LocalContrastNormalizationGradient",
            "LocalContrastNormalization",
        ),
        ("CrossChannelNormalization", "SpatialNormalizationGradient", "SpatialNormalization"),
    ],
)
def test_a_state_from_another_kernel_is_refused(forward, gradient, forward_name) -> None:
    dev = m.Device("cpu")
    fwd = m.SoftMax(dev) if forward == "SoftMax" else getattr(m, forward)(dev, *(
        (3,) if forward == "CrossChannelNormalization" else (3, 3)
    ))  # fmt: skip
    grad = getattr(m, gradient)(dev, *((3,) if "Cross" in gradient else (3, 3)))
    x = torch.randn(1, 3, 4, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    cb, src, y, st = _forward_state(dev, fwd, x)
    with pytest.raises(
        ValueError,
        match=rf"\[{gradient}\] gradient_state must come from a {forward_name} encode, "
        rf"got one from {forward}$",
    ):
        grad.encode(cb, y, src, st)
    assert len(cb) == 1


def test_the_secondary_image_must_be_the_forward_source() -> None:
    dev = m.Device("cpu")
    fwd = m.SpatialNormalization(dev, 3, 3)
    fwd.source_feature_channel_max_count = 2
    x = torch.randn(1, 3, 4, 4, generator=torch.Generator().manual_seed(2), dtype=F64)
    cb, _, y, st = _forward_state(dev, fwd, x)
    wrong = m.Image.from_tensor(torch.randn(1, 2, 4, 4, dtype=F64))  # the result's channels
    with pytest.raises(
        ValueError,
        match=r"\[SpatialNormalizationGradient\] source_image must have the forward source's "
        r"shape 4x4x3",
    ):
        m.SpatialNormalizationGradient(dev, 3, 3).encode(cb, y, wrong, st)
