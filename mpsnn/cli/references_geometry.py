"""What the PyTorch references of ``mpsnn check`` share: the `Geometry` a forward encode
resolved, `NoEquivalent`, and the source range a window kernel reads along each axis,
``[offset - E // 2, offset - E // 2 + (n - 1) * stride + E)`` for ``n`` destination pixels and
the effective window ``E = dilation * (kernel - 1) + 1``, as PyTorch padding (zeros for
``EdgeMode.ZERO``, ``mode="replicate"`` for ``EdgeMode.CLAMP``) and a crop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from mpsnn.core.geometry import EdgeMode

__all__ = ["Geometry", "NoEquivalent", "Tensors"]

Tensors = dict[str, torch.Tensor]


class NoEquivalent(Exception):
    """This configuration has no PyTorch equivalent (the message says why)."""


@dataclass(frozen=True)
class Geometry:
    """What a forward encode resolved (shapes N, C, H, W; pairs x, y)."""

    source: tuple[int, int, int, int]
    destination: tuple[int, int, int, int]
    offset: tuple[int, int, int]
    edge: EdgeMode
    clipped: bool  # a clip rect was given
    sco: int
    dco: int
    channels_read: int
    channels_written: int
    kernel: tuple[int, int] = (1, 1)
    stride: tuple[int, int] = (1, 1)
    dilation: tuple[int, int] = (1, 1)
    params: dict[str, Any] = field(default_factory=dict)  # the family's own settings


@dataclass(frozen=True)
class _Axis:
    start: int  # first source position read
    count: int  # destination pixels
    stride: int
    extent: int
    size: int  # source pixels

    @property
    def before(self) -> int:
        return -self.start

    @property
    def after(self) -> int:
        return self.start + (self.count - 1) * self.stride + self.extent - self.size

    def symmetric(self, limit: int) -> int | None:
        """PyTorch's ``padding=p`` when it reads exactly this range (and p <= limit)."""
        p = self.before
        fits = p >= 0 and (self.size + 2 * p - self.extent) // self.stride + 1 == self.count
        return p if fits and self.after <= p <= limit else None


def _axes(g: Geometry) -> tuple[_Axis, _Axis]:
    out = []
    for i, (n, size) in enumerate(
        ((g.destination[2], g.source[2]), (g.destination[3], g.source[3]))
    ):
        j = 1 - i  # kernel, stride, dilation and offset are (x, y)
        e = g.dilation[j] * (g.kernel[j] - 1) + 1
        out.append(_Axis(g.offset[j] - e // 2, n, g.stride[j], e, size))
    return out[0], out[1]


def _source(x: torch.Tensor, g: Geometry) -> tuple[torch.Tensor, str]:
    """The images and channels the kernel reads; refuses clip rects."""
    if g.clipped:
        raise NoEquivalent(
            "a clip rect writes part of the destination: no PyTorch equivalent for this geometry"
        )
    z, c0, n = g.offset[2], g.sco, g.channels_read
    if z == 0 and c0 == 0 and n == x.shape[1]:
        return x, "x"
    return x[z:, c0 : c0 + n], f"x[{z or ''}:, {c0 or ''}:{c0 + n}]"


def _padded(x: torch.Tensor, text: str, g: Geometry) -> tuple[torch.Tensor, str]:
    """The source range the windows read, with the edge rule as PyTorch padding."""
    ay, ax = _axes(g)
    if g.edge not in (EdgeMode.ZERO, EdgeMode.CLAMP):
        raise NoEquivalent(f"edge mode {g.edge.name}: no PyTorch equivalent for this kernel")
    if any(a.start >= a.size or a.size + a.after <= 0 for a in (ay, ax)):  # [start, end)
        raise NoEquivalent("the windows read nothing of the source: no PyTorch equivalent")
    crop = [max(0, -a.before) for a in (ay, ax)] + [max(0, -a.after) for a in (ay, ax)]
    if any(crop):
        x = x[..., crop[0] : x.shape[2] - crop[2], crop[1] : x.shape[3] - crop[3]]
        text = f"{text}[..., {crop[0] or ''}:{-crop[2] or ''}, {crop[1] or ''}:{-crop[3] or ''}]"
    pads = (max(0, ax.before), max(0, ax.after), max(0, ay.before), max(0, ay.after))
    if not any(pads):
        return x, text
    if g.edge is EdgeMode.ZERO:
        return F.pad(x, pads), f"F.pad({text}, {pads})"
    return F.pad(x, pads, mode="replicate"), f'F.pad({text}, {pads}, mode="replicate")'


def _symmetric(g: Geometry, limit: int | None = None) -> tuple[int, int] | None:
    ay, ax = _axes(g)
    lim_y = ay.extent // 2 if limit is None else limit
    lim_x = ax.extent // 2 if limit is None else limit
    py, px = ay.symmetric(lim_y), ax.symmetric(lim_x)
    return None if py is None or px is None else (py, px)


def _pair(v: tuple[int, int]) -> tuple[int, int]:
    return (v[1], v[0])  # (x, y) -> PyTorch's (h, w) order
