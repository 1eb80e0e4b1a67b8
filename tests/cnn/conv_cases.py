"""Random convolution geometries for the forward, adjoint and device tests.

Each case draws every MPS geometry knob: odd and even kernels, strides 1-3, dilations 1-2,
groups (incl. depthwise), offsets (negative too), clip rects partly outside the destination,
source and destination channel offsets, a source channel max count, both edge modes, old-style
multi-image z offsets and explicit destinations with existing contents.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

import mpsnn as m


@dataclass(frozen=True)
class ConvCase:
    n: int
    cin: int
    cout: int
    groups: int
    k: tuple[int, int]  # (kw, kh)
    stride: tuple[int, int]
    dilation: tuple[int, int]
    src: tuple[int, int, int, int]  # N, C, H, W
    dst: tuple[int, int, int, int]
    offset: tuple[int, int, int]
    clip: tuple[int, int, int, int, int, int]  # x, y, z, w, h, depth
    sco: int
    smax: int
    dco: int
    edge: int
    bias: bool

    def __str__(self) -> str:
        e = "clamp" if self.edge else "zero"
        return (
            f"conv k{self.k[0]}x{self.k[1]} s{self.stride[0]},{self.stride[1]} "
            f"d{self.dilation[0]},{self.dilation[1]} g{self.groups} {self.cin}->{self.cout} "
            f"off{self.offset} clip{self.clip} sco{self.sco} dco{self.dco} {e} "
            f"src{self.src} dst{self.dst}"
        )

    def descriptor(self) -> m.ConvolutionDescriptor:
        return m.ConvolutionDescriptor(
            self.k[0],
            self.k[1],
            self.cin,
            self.cout,
            self.stride[0],
            self.stride[1],
            self.dilation[0],
            self.dilation[1],
            self.groups,
        )

    def weights(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = torch.randn(
            self.cout,
            self.k[1],
            self.k[0],
            self.cin // self.groups,
            generator=gen,
            dtype=torch.float64,
        )
        b = torch.randn(self.cout, generator=gen, dtype=torch.float64) if self.bias else None
        return w, b

    def configure(self, kernel: m.CNNKernel) -> None:
        kernel.offset = m.Offset(*self.offset)
        x, y, z, w, h, d = self.clip
        kernel.clip_rect = m.Region(m.Origin(x, y, z), m.Size(w, h, d))
        kernel.source_feature_channel_offset = self.sco
        kernel.source_feature_channel_max_count = self.smax
        kernel.destination_feature_channel_offset = self.dco
        kernel.edge_mode = m.EdgeMode(self.edge)

    def reference_kwargs(self) -> dict:
        return dict(
            offset=self.offset,
            clip=self.clip,
            sco=self.sco,
            smax=self.smax,
            dco=self.dco,
            edge=self.edge,
            stride=self.stride,
            dilation=self.dilation,
            groups=self.groups,
        )


def random_case(seed: int) -> ConvCase:
    r = random.Random(seed)
    kind = r.choice(["plain", "plain", "grouped", "depthwise"])
    if kind == "plain":
        groups, cin, cout = 1, r.randint(1, 5), r.randint(1, 5)
    elif kind == "grouped":
        groups = r.choice([2, 3])
        cin, cout = groups * r.randint(1, 2), groups * r.randint(1, 2)
    else:
        cin = r.randint(2, 5)
        groups, cout = cin, cin * r.choice([1, 2])
    k = (r.randint(1, 4), r.randint(1, 4))
    stride = (r.randint(1, 3), r.randint(1, 3))
    dilation = (r.randint(1, 2), r.randint(1, 2))
    old_style = r.random() < 0.3
    n_src = r.randint(2, 3) if old_style else r.randint(1, 2)
    sco = r.randint(0, 2)
    extra = r.randint(0, 2)
    smax = cin if (extra or r.random() < 0.5) else (1 << 40)
    src = (n_src, sco + cin + extra, r.randint(3, 9), r.randint(3, 9))
    oz = r.randint(0, n_src - 1) if old_style else 0
    count = n_src - oz
    hd, wd = r.randint(2, 7), r.randint(2, 7)
    dco = r.randint(0, 2)
    cz = r.randint(0, 1) if old_style else 0
    nd = cz + count + (r.randint(0, 1) if old_style else 0)
    dst = (nd, dco + cout + r.randint(0, 2), hd, wd)
    cx, cy = r.randint(-2, wd - 1), r.randint(-2, hd - 1)
    cw = r.randint(max(1, 1 - cx), wd + 3)
    ch = r.randint(max(1, 1 - cy), hd + 3)
    depth = count if r.random() < 0.5 else (1 << 40)
    clip = (cx, cy, cz, cw, ch, depth)

    def reads_image(
        o: int, c0: int, k: int, d: int, s: int, size: int, extent: int, span: int
    ) -> bool:
        # some written pixel has a tap inside the source (else the case only tests the bias)
        first = max(c0, 0)
        for px in range(first, min(c0 + span, extent)):
            centre = o + s * (px - c0)
            e = d * (k - 1) + 1
            if any(0 <= centre - e // 2 + d * j < size for j in range(k)):
                return True
        return False

    while True:
        offset = (r.randint(-2, 4), r.randint(-2, 4), oz)
        if reads_image(offset[0], cx, k[0], dilation[0], stride[0], src[3], wd, cw) and reads_image(
            offset[1], cy, k[1], dilation[1], stride[1], src[2], hd, ch
        ):
            break
    return ConvCase(
        n_src,
        cin,
        cout,
        groups,
        k,
        stride,
        dilation,
        src,
        dst,
        offset,
        clip,
        sco,
        smax,
        dco,
        r.randint(0, 1),
        r.random() < 0.8,
    )


CASES = [random_case(s) for s in range(36)]


def numpy_of(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().double().numpy()
