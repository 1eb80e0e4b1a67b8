"""Inverted dropout with masks regenerated from a key (no mask is stored).

``y = x * keep / p`` with ``keep`` true with probability ``p``. The mask bit of element ``e`` of
image ``n`` is a counter-based hash::

    u = mix(mix(e) ^ mix(stream_key ^ mix(n + 1)))      (32-bit values)
    keep = u < floor(p * 2^32)

where ``mix`` is the "lowbias32" integer finalizer (xor-shift-multiply, full avalanche),
``stream_key`` is derived from the kernel's seed and the number of encodes it made, and ``e``
indexes the mask: ``(c * Hm + y) * Wm + x`` over the *mask* shape, where an axis whose
``mask_stride_in_pixels`` is 0 has extent 1 (the mask is broadcast along it). The same bits come
from the portable path (int64 tensor arithmetic, written so that no product overflows) and from
the Triton kernel, on any device: a gradient regenerates exactly its forward's mask.

The key is device data: a one-element int64 tensor computed on the device from the seed and a
device counter (`stream_key_tensor`), so that work captured into a CUDA graph draws new masks
at every replay.
"""

from __future__ import annotations

import functools

import torch

from mpsnn.ops import triton as fast_paths
from mpsnn.ops._dtypes import acc_dtype
from mpsnn.ops.plans import DropoutGeometry

__all__ = [
    "dropout_apply",
    "dropout_apply_counted",
    "dropout_apply_portable",
    "dropout_geometry",
    "keep_mask",
    "mix32",
    "stream_key",
    "stream_key_tensor",
]

M32 = 0xFFFFFFFF
_K1, _K2 = 0x7FEB352D, 0x846CA68B


def dropout_geometry(keep_probability: float, strides: tuple[int, int, int]) -> DropoutGeometry:
    threshold = min(int(keep_probability * 2**32), M32)
    return DropoutGeometry(threshold, 1.0 / keep_probability, strides)


def mix32(h: int) -> int:
    """The finalizer on a Python int (host side)."""
    h &= M32
    h ^= h >> 16
    h = (h * _K1) & M32
    h ^= h >> 15
    h = (h * _K2) & M32
    return h ^ (h >> 16)


def stream_key(seed: int, counter: int) -> int:
    """Key of one encode of a dropout kernel: its seed (64 bits) and encode number."""
    return mix32(_seed_part(seed) ^ mix32(counter + 0x632BE5AB))


@functools.lru_cache(maxsize=256)  # once per kernel's seed, not at every encode
def _seed_part(seed: int) -> int:
    """The 32-bit part of a key that depends on the seed (64 bits) alone."""
    return mix32((seed & M32) ^ 0x9E3779B9) ^ mix32(seed >> 32)


def stream_key_tensor(seed: int, counter: torch.Tensor) -> torch.Tensor:
    """`stream_key` computed on the counter's device: ``counter`` is a one-element int64 tensor
    (the number of encodes so far); returns a one-element int64 tensor in [0, 2^32)."""
    return _mix(_mix((counter + 0x632BE5AB) & M32) ^ _seed_part(seed))


def _mul32(h: torch.Tensor, k: int) -> torch.Tensor:
    """``(h * k) mod 2^32`` for int64 ``h`` in [0, 2^32) without int64 overflow."""
    lo = h * (k & 0xFFFF)
    hi = ((h * (k >> 16)) & 0xFFFF) << 16
    return (lo + hi) & M32


def _mix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, _K1)
    h = h ^ (h >> 15)
    h = _mul32(h, _K2)
    return h ^ (h >> 16)


def keep_mask(
    key: int | torch.Tensor, first_image: int, shape: tuple[int, int, int, int],
    geom: DropoutGeometry, device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """Boolean mask of shape ``(N, Cm, Hm, Wm)`` (broadcastable to ``shape``); ``key`` is an
    int or a one-element int64 tensor."""
    n, c, h, w = shape
    sc, sy, sx = geom.strides
    cm, hm, wm = (c if sc else 1), (h if sy else 1), (w if sx else 1)
    e = torch.arange(cm * hm * wm, dtype=torch.int64, device=device).view(1, cm, hm, wm)
    images = torch.arange(first_image, first_image + n, dtype=torch.int64, device=device)
    if isinstance(key, torch.Tensor):
        key = key.reshape(1).to(device)
    image_keys = _mix(key ^ _mix(images + 1)).view(n, 1, 1, 1)
    return _mix(_mix(e) ^ image_keys) < geom.threshold


def dropout_apply_portable(
    t: torch.Tensor, key: int | torch.Tensor, first_image: int, geom: DropoutGeometry
) -> torch.Tensor:
    """``t * keep * scale`` (forward, or the gradient with ``t = g``), on any device."""
    keep = keep_mask(key, first_image, tuple(t.shape), geom, t.device)  # type: ignore[arg-type]  # NCHW
    wide = acc_dtype(t.dtype)
    factor = keep.to(wide) * geom.scale
    return (t.to(wide) * factor).to(t.dtype)


def dropout_apply_counted(
    t: torch.Tensor,
    counter: torch.Tensor,
    seed: int,
    first_image: int,
    geom: DropoutGeometry,
    key_out: torch.Tensor,
    ticket: torch.Tensor,
) -> torch.Tensor:
    """A forward dropout of the encode numbered ``counter`` (a one-element int64 tensor on t's
    device), which it advances by 1: the key `stream_key_tensor` ``(seed, counter)`` is written
    to ``key_out`` (for the gradient) and the mask applied. ``ticket``: a one-element int32
    tensor on t's device holding 0, scratch of the Triton kernel (0 again after it).

    On CUDA the Triton kernel computes the key and advances the counter itself (one launch; the
    tensor form is about 30 small integer operations and the increment one more, which on a
    slow host cost more than the dropout of a large batch)."""
    fast = fast_paths.dropout_apply(
        t, counter, first_image, geom, seed_part=_seed_part(seed), key_out=key_out, ticket=ticket
    )
    if fast is not None:
        return fast
    key_out.copy_(stream_key_tensor(seed, counter))
    counter.add_(1)
    return dropout_apply_portable(t, key_out, first_image, geom)


def dropout_apply(
    t: torch.Tensor, key: torch.Tensor, first_image: int, geom: DropoutGeometry
) -> torch.Tensor:
    """``t * keep * scale`` with the mask of ``key`` (a one-element int64 tensor on t's
    device): the Triton kernel on CUDA, the portable path elsewhere (same bits)."""
    fast = fast_paths.dropout_apply(t, key, first_image, geom)
    return fast if fast is not None else dropout_apply_portable(t, key, first_image, geom)
