"""Loop-level references of the MPS window model, written from the MPS window model (docs/semantics.md).

Plain NumPy float64, one destination pixel and one tap at a time: slow and obviously right.
They share no code with mpsnn.
"""

from __future__ import annotations

import numpy as np

ZERO, CLAMP = 0, 1


def taps(centre: int, kernel: int, dilation: int) -> list[int]:
    """Source coordinates a window centred at ``centre`` reads (even windows lean top-left)."""
    extent = dilation * (kernel - 1) + 1
    return [centre - extent // 2 + dilation * j for j in range(kernel)]


def read(x: np.ndarray, ty: int, tx: int, edge: int) -> np.ndarray:
    """``x[..., ty, tx]`` with the edge rule (x: (..., H, W))."""
    h, w = x.shape[-2:]
    if 0 <= ty < h and 0 <= tx < w:
        return x[..., ty, tx]
    if edge == ZERO:
        return np.zeros(x.shape[:-2])
    return x[..., min(max(ty, 0), h - 1), min(max(tx, 0), w - 1)]


def clip_span(origin: int, size: int, extent: int) -> range:
    return range(max(origin, 0), min(origin + size, extent))


def convolution(
    x: np.ndarray,
    w_ohwi: np.ndarray,
    b: np.ndarray | None,
    dst: np.ndarray,
    *,
    offset: tuple[int, int, int],
    clip: tuple[int, int, int, int, int, int],
    sco: int,
    smax: int,
    dco: int,
    edge: int,
    stride: tuple[int, int],
    dilation: tuple[int, int],
    groups: int,
) -> np.ndarray:
    """MPS convolution into a copy of ``dst``.

    x: (N, C, H, W); w_ohwi: (O, kH, kW, I/G); dst: (Nd, Cd, Hd, Wd) initial contents;
    offset (x, y, z); clip (x, y, z, width, height, depth); stride/dilation (x, y).
    """
    out = dst.copy()
    n, c = x.shape[:2]
    nd, _, hd, wdd = out.shape
    o, kh, kw, ig = w_ohwi.shape
    ox, oy, oz = offset
    cx0, cy0, cz0, cw, ch, cdp = clip
    count = min(cdp, n - oz, nd - cz0)
    n_read = min(smax, c - sco)
    assert n_read == ig * groups
    og = o // groups
    src = x[oz : oz + count, sco : sco + n_read]
    for y in clip_span(cy0, ch, hd):
        cy = oy + stride[1] * (y - cy0)
        for xx in clip_span(cx0, cw, wdd):
            cx = ox + stride[0] * (xx - cx0)
            patch = np.zeros((count, n_read, kh, kw))
            for q, ty in enumerate(taps(cy, kh, dilation[1])):
                for p, tx in enumerate(taps(cx, kw, dilation[0])):
                    patch[:, :, q, p] = read(src, ty, tx, edge)
            for g in range(groups):
                val = np.einsum(
                    "ncqp,oqpc->no", patch[:, g * ig : (g + 1) * ig], w_ohwi[g * og : (g + 1) * og]
                )
                if b is not None:
                    val = val + b[g * og : (g + 1) * og]
                out[cz0 : cz0 + count, dco + g * og : dco + (g + 1) * og, y, xx] = val
    return out


def convolution_transpose(
    x: np.ndarray,
    w_ohwi: np.ndarray,
    b: np.ndarray | None,
    dst_hw: tuple[int, int],
    *,
    total: tuple[int, int],
    edge: int,
    stride: tuple[int, int],
    dilation: tuple[int, int],
    groups: int,
) -> np.ndarray:
    """MPS convolution transpose, whole destination, no channel offsets.

    Output pixel ``u`` reads the zero-inserted source at ``total + u - E // 2 + d * j``; a
    position ``e`` of that frame holds ``x[e / s]`` when ``s`` divides it. Outside the frame
    ``[0, (src - 1) s]``: 0 (ZERO) or the nearest edge sample of the frame (CLAMP).
    """
    n, c, h, w = x.shape
    o, kh, kw, ig = w_ohwi.shape
    og = o // groups
    hd, wd = dst_hw
    sx, sy = stride
    he, we = (h - 1) * sy + 1, (w - 1) * sx + 1

    def sample(ey: int, ex: int) -> np.ndarray:
        if not (0 <= ey < he and 0 <= ex < we):
            if edge == ZERO:
                return np.zeros((n, c))
            ey, ex = min(max(ey, 0), he - 1), min(max(ex, 0), we - 1)
        if ey % sy or ex % sx:
            return np.zeros((n, c))
        return x[:, :, ey // sy, ex // sx]

    out = np.zeros((n, o, hd, wd))
    for u in range(hd):
        for v in range(wd):
            patch = np.zeros((n, c, kh, kw))
            for q, ey in enumerate(taps(total[1] + u, kh, dilation[1])):
                for p, ex in enumerate(taps(total[0] + v, kw, dilation[0])):
                    patch[:, :, q, p] = sample(ey, ex)
            for g in range(groups):
                val = np.einsum(
                    "ncqp,oqpc->no", patch[:, g * ig : (g + 1) * ig], w_ohwi[g * og : (g + 1) * og]
                )
                if b is not None:
                    val = val + b[g * og : (g + 1) * og]
                out[:, g * og : (g + 1) * og, u, v] = val
    return out
