"""PyTorch equivalents of mpsnn kernels, for ``mpsnn check``.

Each function takes the `Geometry` a forward encode resolved and the float64 inputs (which may
require grad) and returns ``(output, text)``: the block of the destination the kernel wrote
(images from ``offset.z``, channels from ``destination_feature_channel_offset``), computed with
PyTorch's own functions, and the PyTorch expression that computes it. A configuration PyTorch
cannot express raises `NoEquivalent` with the reason; nothing here re-implements a kernel.

Window kernels (convolution, pooling, the 1x1-window kernels) read, along each axis, the source
range ``[offset - E // 2, offset - E // 2 + (n - 1) * stride + E)`` for ``n`` destination pixels
and the effective window ``E = dilation * (kernel - 1) + 1`` (docs/semantics.md). Reads outside
the source are PyTorch padding: zeros for ``EdgeMode.ZERO``, ``mode="replicate"`` for
``EdgeMode.CLAMP``. Symmetric padding becomes the function's own ``padding=`` argument where
PyTorch allows it, anything else an explicit ``F.pad`` (and a crop when the offset skips pixels).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from mpsnn.cli.references_geometry import (
    Geometry,
    NoEquivalent,
    Tensors,
    _padded,
    _pair,
    _source,
    _symmetric,
)
from mpsnn.cli.references_loss import forward_loss
from mpsnn.cli.references_yolo import yolo_loss
from mpsnn.core.geometry import EdgeMode

__all__ = ["REFERENCES"]


# -- window kernels ------------------------------------------------------------------------------


def convolution(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    x, text = _source(t["x"], g)
    w = t["weights"].permute(0, 3, 1, 2)  # OHWI -> OIHW
    kw = dict(stride=_pair(g.stride), dilation=_pair(g.dilation), groups=g.params["groups"])
    args = ", ".join(f"{k}={v}" for k, v in kw.items())
    sym = _symmetric(g, limit=1 << 30) if g.edge is EdgeMode.ZERO else None
    if sym is not None:
        y = F.conv2d(x, w, t["bias"], padding=sym, **kw)  # type: ignore[arg-type]
        return y, f"F.conv2d({text}, w, b, padding={sym}, {args})"
    x, text = _padded(x, text, g)
    return F.conv2d(x, w, t["bias"], **kw), f"F.conv2d({text}, w, b, {args})"  # type: ignore[arg-type]


def fully_connected(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    x, text = _source(t["x"], g)
    kw, kh = g.kernel
    n, o = x.shape[0], t["weights"].shape[0]
    rows = x[:, :, :kh, :kw].permute(0, 2, 3, 1).reshape(n, -1)  # each image in HWC order
    y = F.linear(rows, t["weights"].reshape(o, -1), t["bias"]).view(n, o, 1, 1)
    return y, (
        f"F.linear({text}[:, :, :{kh}, :{kw}].permute(0, 2, 3, 1).reshape(N, -1), "
        "w.reshape(O, -1), b)  (w in OHWI order)"
    )


def convolution_transpose(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    """MPS correlates the zero-inserted source with the weights as given; PyTorch's transpose
    convolution flips them and swaps the channel roles. Output ``u`` of MPS is output
    ``u + p`` of the unpadded ``F.conv_transpose2d``, ``p = total - E // 2 + E - 1`` with
    ``total = offset * stride + kernel_offset``."""
    if g.edge is not EdgeMode.ZERO:
        raise NoEquivalent(
            "CLAMP edges replicate the zero-inserted source's edge samples: no PyTorch equivalent"
        )
    x, text = _source(t["x"], g)
    groups = g.params["groups"]
    o, kh, kw, ig = t["weights"].shape
    wt = (
        t["weights"].flip(1, 2).reshape(groups, o // groups, kh, kw, ig)
        .permute(0, 4, 1, 2, 3).reshape(groups * ig, o // groups, kh, kw)
    )  # fmt: skip
    shift, out_pad, full = [], [], []
    for j, n_src, n_dst in ((1, x.shape[2], g.destination[2]), (0, x.shape[3], g.destination[3])):
        e = g.dilation[j] * ((kh, kw)[1 - j] - 1) + 1
        total = g.offset[j] * g.stride[j] + g.params["kernel_offset"][j]
        p = total - e // 2 + e - 1
        length = (n_src - 1) * g.stride[j] + e  # the unpadded output's size
        shift.append(p)
        full.append(length)
        out_pad.append(n_dst - (length - 2 * p))
    kw_ = dict(stride=_pair(g.stride), dilation=_pair(g.dilation), groups=groups)
    args = ", ".join(f"{k}={v}" for k, v in kw_.items())
    limit = [max(g.stride[1], g.dilation[1]), max(g.stride[0], g.dilation[0])]
    w_text = (
        "w' = w.flip(1, 2).reshape(G, O // G, kH, kW, I // G).permute(0, 4, 1, 2, 3)"
        ".reshape(I, O // G, kH, kW)"
    )
    if all(p >= 0 for p in shift) and all(
        0 <= q < lim for q, lim in zip(out_pad, limit, strict=True)
    ):
        y = F.conv_transpose2d(
            x, wt, t["bias"], padding=tuple(shift), output_padding=tuple(out_pad), **kw_
        )
        return y, (
            f"F.conv_transpose2d({text}, w', b, padding={tuple(shift)}, "
            f"output_padding={tuple(out_pad)}, {args}) with {w_text}"
        )
    z = F.conv_transpose2d(x, wt, None, **kw_)
    n_y, n_x = g.destination[2], g.destination[3]
    pads = (-shift[1], n_x + shift[1] - full[1], -shift[0], n_y + shift[0] - full[0])
    y = F.pad(z, pads) + t["bias"].view(1, -1, 1, 1)  # negative pads crop
    return y, f"F.pad(F.conv_transpose2d({text}, w', {args}), {pads}) + b with {w_text}"


def pooling_max(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    x, text = _source(t["x"], g)
    k, s, d = _pair(g.kernel), _pair(g.stride), _pair(g.dilation)
    args = f"{k}, {s}, dilation={d}"
    sym = _symmetric(g)
    # PyTorch pads max pooling with -inf: MPS CLAMP when every window is contiguous.
    if g.edge is EdgeMode.CLAMP and sym is not None and d == (1, 1):
        return F.max_pool2d(x, k, s, sym, d), f"F.max_pool2d({text}, {args}, padding={sym})"
    x, text = _padded(x, text, g)
    return F.max_pool2d(x, k, s, 0, d), f"F.max_pool2d({text}, {args})"


def pooling_average(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    """ZERO edges divide by the window area; CLAMP by the pixels inside the source."""
    if g.params.get("exclude_edges"):
        raise NoEquivalent("EXCLUDE_EDGES (Caffe's divisor) has no PyTorch equivalent")
    x, text = _source(t["x"], g)
    k, s = _pair(g.kernel), _pair(g.stride)
    sym = _symmetric(g, limit=min(k) // 2)
    include = g.edge is EdgeMode.ZERO
    if sym is not None:
        y = F.avg_pool2d(x, k, s, sym, count_include_pad=include)
        return y, f"F.avg_pool2d({text}, {k}, {s}, padding={sym}, count_include_pad={include})"
    if include:
        x, text = _padded(x, text, g)
        return F.avg_pool2d(x, k, s), f"F.avg_pool2d({text}, {k}, {s})"
    zero = replace(g, edge=EdgeMode.ZERO)
    xp, xt = _padded(x, text, zero)
    ones, ot = _padded(torch.ones_like(x), "torch.ones_like(x)", zero)
    count = F.avg_pool2d(ones, k, s)
    if bool((count == 0).any()):
        raise NoEquivalent("a window holds no source pixel: no PyTorch equivalent")
    y = F.avg_pool2d(xp, k, s) / count
    return y, f"F.avg_pool2d({xt}, {k}, {s}) / F.avg_pool2d({ot}, {k}, {s})"


def pooling_l2(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    x, text = _padded(*_source(t["x"], g), g)
    k, s = _pair(g.kernel), _pair(g.stride)
    return F.lp_pool2d(x, 2, k, s), f"F.lp_pool2d({text}, 2, {k}, {s})"


# -- 1x1-window kernels ----------------------------------------------------------------------------


def _pointwise(fn: Callable[..., torch.Tensor], name: str, *more: str) -> Callable[..., Any]:
    def reference(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
        x, text = _padded(*_source(t["x"], g), g)
        args = [t[m] for m in more]
        return fn(x, *args), name.format(text)

    return reference


def _log(base: float) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
    if base == -1:
        return torch.log, "torch.log({})"
    return (lambda z: torch.log(z) / math.log(base)), f"torch.log({{}}) / math.log({base})"


def neuron(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    kind, a, b, c = g.params["neuron"], g.params["a"], g.params["b"], g.params["c"]
    x, text = _padded(*_source(t["x"], g), g)
    if kind == "EXPONENTIAL":
        base = "math.e" if c == -1 else c
        y = torch.pow(math.e if c == -1 else c, a * x + b)
        return y, f"torch.pow({base}, {a} * {text} + {b})"
    if kind == "LOGARITHM":
        fn, form = _log(c)
        return fn(a * x + b), form.format(f"{a} * {text} + {b}")
    if kind == "PRELU":
        return F.prelu(x, t["slopes"]), f"F.prelu({text}, slopes)"
    table: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], str]] = {
        "NONE": (lambda z: z, "{}"),
        "RELU": (lambda z: F.leaky_relu(z, a), f"F.leaky_relu({{}}, {a})"),
        "LINEAR": (lambda z: a * z + b, f"{a} * {{}} + {b}"),
        "SIGMOID": (torch.sigmoid, "torch.sigmoid({})"),
        "HARD_SIGMOID": (
            lambda z: torch.clamp(a * z + b, 0, 1),
            f"torch.clamp({a} * {{}} + {b}, 0, 1)",
        ),
        "TANH": (lambda z: a * torch.tanh(b * z), f"{a} * torch.tanh({b} * {{}})"),
        "ABSOLUTE": (torch.abs, "torch.abs({})"),
        "SOFT_PLUS": (
            lambda z: a * torch.log1p(torch.exp(b * z)),
            f"{a} * torch.log1p(torch.exp({b} * {{}}))",
        ),
        "SOFT_SIGN": (F.softsign, "F.softsign({})"),
        "ELU": (lambda z: F.elu(z, alpha=a), f"F.elu({{}}, alpha={a})"),
        "RELU_N": (
            lambda z: torch.clamp(F.leaky_relu(z, a), max=b),
            f"torch.clamp(F.leaky_relu({{}}, {a}), max={b})",
        ),
        "POWER": (lambda z: torch.pow(a * z + b, c), f"torch.pow({a} * {{}} + {b}, {c})"),
        "GELU": (F.gelu, "F.gelu({})"),
    }
    fn, form = table[kind]
    return fn(x), form.format(text)


def group_norm(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    x, text = _padded(*_source(t["x"], g), g)
    eps, groups = g.params["epsilon"], g.params["groups"]
    gamma, beta = t["gamma"], t["beta"]
    if g.params.get("instance"):
        y = F.instance_norm(x, weight=gamma, bias=beta, eps=eps)
        return y, f"F.instance_norm({text}, weight=gamma, bias=beta, eps={eps})"
    y = F.group_norm(x, groups, gamma, beta, eps=eps)
    return y, f"F.group_norm({text}, {groups}, gamma, beta, eps={eps})"


def batch_norm(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    x, text = _source(t["x"], g)
    eps = g.params["epsilon"]
    y = F.batch_norm(x, None, None, t["gamma"], t["beta"], training=True, eps=eps)
    return y, f"F.batch_norm({text}, None, None, gamma, beta, training=True, eps={eps})"


# -- enlarging and shape kernels -----------------------------------------------------------------


def upsampling(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    x, text = _source(t["x"], g)
    sx, sy = g.params["scale"]
    bilinear, align = g.params["bilinear"], g.params["align_corners"]
    if g.offset[:2] != (0, 0) or g.destination[2:] != (x.shape[2] * sy, x.shape[3] * sx):
        raise NoEquivalent(
            "an offset or another destination size: no PyTorch equivalent for this geometry"
        )
    if bilinear and g.edge is not EdgeMode.CLAMP:
        raise NoEquivalent(
            "bilinear ZERO edges read zeros at the border: no PyTorch equivalent for this geometry"
        )
    size = (x.shape[2] * sy, x.shape[3] * sx)
    if bilinear:
        y = F.interpolate(x, size=size, mode="bilinear", align_corners=align)
        return y, f'F.interpolate({text}, size={size}, mode="bilinear", align_corners={align})'
    y = F.interpolate(x, size=size, mode="nearest")
    return y, f'F.interpolate({text}, size={size}, mode="nearest")'


_PAD_MODES = {
    EdgeMode.ZERO: ("constant", ""),
    EdgeMode.CONSTANT: ("constant", ", value={fill}"),
    EdgeMode.CLAMP: ("replicate", ', mode="replicate"'),
    EdgeMode.MIRROR: ("reflect", ', mode="reflect"'),
}


def pad(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    x, text = _source(t["x"], g)
    (bx, by, bc), (ax, ay, ac), fill = g.params["before"], g.params["after"], g.params["fill"]
    if g.offset[:2] != (-bx, -by) or g.destination[2:] != (
        x.shape[2] + by + ay,
        x.shape[3] + bx + ax,
    ):
        raise NoEquivalent(
            "an offset or another destination size: no PyTorch equivalent for this geometry"
        )
    if g.edge not in _PAD_MODES:
        raise NoEquivalent(f"{g.edge.name}: F.pad has no such mode, no PyTorch equivalent")
    mode, extra = _PAD_MODES[g.edge]
    if mode == "reflect" and (max(bx, ax) >= x.shape[3] or max(by, ay) >= x.shape[2]):
        raise NoEquivalent(
            'F.pad(mode="reflect") needs pads smaller than the source: no PyTorch equivalent'
        )
    pads = (bx, ax, by, ay)
    value = fill if g.edge is EdgeMode.CONSTANT else 0.0
    y = F.pad(x, pads, mode=mode, value=value) if mode == "constant" else F.pad(x, pads, mode=mode)
    text = f"F.pad({text}, {pads}{extra.format(fill=fill)})"
    if bc or ac:
        y = F.pad(y, (0, 0, 0, 0, bc, ac), value=fill)
        text = f"F.pad({text}, (0, 0, 0, 0, {bc}, {ac}), value={fill})"
    return y, text


def arithmetic(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    _binary_geometry(g, t)
    op = g.params["op"]
    fn = {"+": torch.add, "-": torch.sub, "*": torch.mul, "/": torch.div}[op]
    return fn(t["x"], t["y"]), f"x {op} y  (broadcasting)"


def dropout(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    raise NoEquivalent("PyTorch draws its own dropout mask: no PyTorch equivalent")


# -- the Gram matrix, comparisons, reductions, correlation, resizes ------------------------------


def gram(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    """Channel ``i`` at x-coordinate ``j`` of the 1-high result holds ``alpha <x_i, x_j>``."""
    x, text = _source(t["x"], g)
    a = g.params["alpha"]
    y = a * torch.einsum("nihw,njhw->nij", x, x).unsqueeze(2)
    return y, f'{a} * torch.einsum("nihw,njhw->nij", {text}, {text}).unsqueeze(2)'


def _binary_geometry(g: Geometry, t: Tensors) -> None:
    if g.clipped or g.params["offsets"] != ((0, 0, 0), (0, 0, 0)):
        raise NoEquivalent("offsets or a clip rect: no PyTorch equivalent for this geometry")
    if g.destination[2:] != g.params["natural_size"]:
        raise NoEquivalent("another destination size: no PyTorch equivalent for this geometry")
    if any(b not in (1, a) for a, b in zip(t["x"].shape, t["y"].shape, strict=True)):
        raise NoEquivalent("the sources do not broadcast: no PyTorch equivalent for this geometry")


_COMPARE = {
    "EQUAL": (lambda x, y, e: e, "{e}"),
    "NOT_EQUAL": (lambda x, y, e: ~e, "~{e}"),
    "LESS": (lambda x, y, e: (x < y) & ~e, "(x < y) & ~{e}"),
    "LESS_OR_EQUAL": (lambda x, y, e: (x <= y) | e, "(x <= y) | {e}"),
    "GREATER": (lambda x, y, e: (x > y) & ~e, "(x > y) & ~{e}"),
    "GREATER_OR_EQUAL": (lambda x, y, e: (x >= y) | e, "(x >= y) | {e}"),
}


def compare(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    """Equality is ``x == y`` or ``|x - y| <= threshold`` (``torch.isclose``), and the ordered
    comparisons exclude or include it."""
    _binary_geometry(g, t)
    x, y = t["x"], t["y"]
    th = g.params["threshold"]
    fn, form = _COMPARE[g.params["comparison"]]
    eq = torch.isclose(x, y, rtol=0.0, atol=th)
    text = form.format(e=f"torch.isclose(x, y, rtol=0, atol={th})")
    return fn(x, y, eq).to(torch.float64), f"({text}).double()  (broadcasting)"


def _region(x: torch.Tensor, clip: tuple[int, int, int, int] | None) -> tuple[torch.Tensor, str]:
    """``x`` in a source clip rect (intersected with it)."""
    if clip is None:
        return x, ""
    x0, y0, w, h = clip
    ys, xs = slice(max(y0, 0), max(y0 + h, 0)), slice(max(x0, 0), max(x0 + w, 0))
    return x[..., ys, xs], f"[..., {ys.start}:{ys.stop}, {xs.start}:{xs.stop}]"


_REDUCE_DIMS = {"row": 3, "column": 2, "feature-channels": 1}
_REDUCE_FNS = {
    "min": "amin", "max": "amax", "mean": "mean", "sum": "sum", "argument-min": "argmin",
    "argument-max": "argmax",
}  # fmt: skip


def reduce(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    op = g.params["op"]
    if op.startswith("feature-channels-and-weights"):
        return _weighted_channels(g, t)
    x, text = _source(t["x"], g)
    x, crop = _region(x, g.params["source_clip"])
    axis, fn_name = next(
        (a, op.removeprefix(a + "-")) for a in _REDUCE_DIMS if op.startswith(a + "-")
    )
    fn, dim = _REDUCE_FNS[fn_name], _REDUCE_DIMS[axis]
    y, text = getattr(x, fn)(dim, keepdim=True).double(), f"{text}{crop}.{fn}({dim}, keepdim=True)"
    if op == "feature-channels-sum":
        w = g.params["weight"]
        y, text = w * y, f"{w} * {text}"
    return y, text


def _weighted_channels(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    c0, n = g.sco, g.channels_read
    x, xt = _region(t["x"][:, c0 : c0 + n], g.params["source_clip"])
    w = t["y"][:, c0 : c0 + n]
    w, wt = (w, "") if w.shape[2:] == (1, 1) else _region(w, g.params["source_clip"])
    text = f"(x[:, {c0}:{c0 + n}]{xt} * w[:, {c0}:{c0 + n}]{wt}).sum(1, keepdim=True)"
    y = (x * w).sum(1, keepdim=True)
    op = g.params["op"]
    if op.endswith("mean"):
        return y / n, f"{text} / {n}"
    if op.endswith("non-zero-weights"):
        count = (w != 0).sum(1, keepdim=True).expand_as(y)
        y = torch.where(count > 0, y / count.clamp(min=1), torch.zeros_like(y))
        return y, f"torch.where(count > 0, {text} / count, 0), count the non-zero weights"
    return y, text


def local_correlation(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    """Each output channel ``n (2 wx + 1) + m`` is the channel sum of ``x`` times ``y`` shifted
    by ``((n - wy) sy, (m - wx) sx)``: an unfold of the zero-padded ``y`` with the strides as
    dilations."""
    c0, n = g.sco, g.channels_read
    x, _ = _region(t["x"][:, c0 : c0 + n], g.params["source_clip"])
    y, _ = _region(t["y"][:, c0 : c0 + n], g.params["source_clip"])
    (wx, wy), (sx, sy) = g.params["window"], g.params["stride"]
    b, _, h, w = x.shape
    # y's region, placed at x's origin; taps outside it read 0 (negative pads crop)
    pads = (wx * sx, w + wx * sx - y.shape[3], wy * sy, h + wy * sy - y.shape[2])
    k = (2 * wy + 1, 2 * wx + 1)
    cols = F.unfold(F.pad(y, pads), k, dilation=(sy, sx)).view(b, n, k[0] * k[1], h, w)
    out = (x.unsqueeze(2) * cols).sum(1)
    return out, (
        f"(x.unsqueeze(2) * F.unfold(F.pad(y, {pads}), {k}, dilation={(sy, sx)})"
        f".view(N, C, {k[0] * k[1]}, H, W)).sum(1)  (x, y: the regions and channels read)"
    )


def _whole_destination(g: Geometry, x: torch.Tensor, size: tuple[int, int]) -> None:
    if g.offset[:2] != (0, 0) or g.destination[2:] != size:
        raise NoEquivalent(
            "an offset or another destination size: no PyTorch equivalent for this geometry"
        )


def resize_bilinear(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    x, text = _source(t["x"], g)
    w, h = g.params["resize"]
    _whole_destination(g, x, (h, w))
    if g.edge is not EdgeMode.CLAMP:
        raise NoEquivalent(
            "bilinear ZERO edges read zeros at the border: no PyTorch equivalent for this geometry"
        )
    align = g.params["align_corners"]
    y = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=align)
    return y, f'F.interpolate({text}, size={(h, w)}, mode="bilinear", align_corners={align})'


_SNAP = 1e-9  # a crop position this close to an edge is on it (mpsnn.ops.resize)


def _crop_axis(start: float, extent: float, count: int, size: int) -> tuple[Any, Any]:
    """TensorFlow's ``crop_and_resize`` positions along one axis (pixel centres 0 .. size - 1),
    as ``grid_sample`` coordinates, and which of them lie inside the source."""
    k = torch.arange(count, dtype=torch.float64)
    last = size - 1
    if count > 1:
        p = start * last + k * (extent * last / (count - 1))
    else:
        p = torch.full((1,), (start + extent / 2) * last, dtype=torch.float64)
    p = torch.where((p > -_SNAP) & (p < 0), torch.zeros_like(p), p)
    p = torch.where((p > last) & (p < last + _SNAP), torch.full_like(p, last), p)
    inside = (p >= 0) & (p <= last)
    return (2 * p / last - 1 if last else torch.zeros_like(p)), inside


def crop_and_resize(g: Geometry, t: Tensors) -> tuple[torch.Tensor, str]:
    x, text = _source(t["x"], g)
    w, h = g.params["resize"]
    _whole_destination(g, x, (h, w))
    crops = []
    for rx, ry, rw, rh in g.params["regions"]:
        gy, in_y = _crop_axis(ry, rh, h, x.shape[2])
        gx, in_x = _crop_axis(rx, rw, w, x.shape[3])
        grid = torch.stack(torch.broadcast_tensors(gx[None, :], gy[:, None]), -1)
        grid = grid.expand(x.shape[0], h, w, 2)
        y = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=True)
        crops.append(y * (in_y[:, None] & in_x[None, :]))
    return torch.cat(crops, 1), (
        f"torch.cat([F.grid_sample({text}, grid_r, align_corners=True) * inside_r for each "
        "region r], 1)  (grid_r: TensorFlow crop_and_resize's sample positions; inside_r: "
        "those inside the source, the others 0)"
    )


REFERENCES: dict[str, Callable[[Geometry, Tensors], tuple[torch.Tensor, str]]] = {
    "convolution": convolution,
    "fully-connected": fully_connected,
    "convolution-transpose": convolution_transpose,
    "pooling-max": pooling_max,
    "dilated-pooling-max": pooling_max,
    "pooling-average": pooling_average,
    "pooling-l2": pooling_l2,
    "neuron": neuron,
    "softmax": _pointwise(lambda z: torch.softmax(z, 1), "torch.softmax({}, dim=1)"),
    "log-softmax": _pointwise(lambda z: torch.log_softmax(z, 1), "torch.log_softmax({}, dim=1)"),
    "upsampling-nearest": upsampling,
    "upsampling-bilinear": upsampling,
    "batch-normalization": batch_norm,
    "instance-normalization": group_norm,
    "group-normalization": group_norm,
    "dropout": dropout,
    "slice": _pointwise(lambda z: z, "{}"),
    "pad": pad,
    "add": arithmetic,
    "subtract": arithmetic,
    "multiply": arithmetic,
    "divide": arithmetic,
    "compare": compare,
    "gram": gram,
    "reduce": reduce,
    "local-correlation": local_correlation,
    "resize-bilinear": resize_bilinear,
    "crop-and-resize-bilinear": crop_and_resize,
    "forward-loss": forward_loss,
    "loss-gradient": forward_loss,
    "yolo-loss": yolo_loss,
}
