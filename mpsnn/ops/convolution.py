"""Convolution math on tensors: forward, gradient (data), gradient (weights and bias).

Layouts: images (N, C, H, W); weights OIHW ``(O, I / groups, kH, kW)`` (the MPS OHWI layout is
converted once, at the data-source boundary).

Forward (correlation, no flip), per output pixel ``(i, j)`` and output channel ``k`` of group
``g(k)``::

    y(k, i, j) = b[k] + sum_{q, p, c} W[k, c, q, p] * x(g(k) * I/G + c, ys + sy*i + dy*q,
                                                        xs + sx*j + dx*p)

with ``ys, xs`` the window starts of `AxisWindow` and out-of-image reads given by the edge mode.

Gradients (the exact adjoint of the forward, derived as in ``jax/_src/lax/convolution.py``):

    dx = extract_adjoint(conv_transpose(E, W))          (data)
    dW[k, c, q, p] = sum_{n, i, j} E(k, i, j) * x_ext(c, sy*i + dy*q, sx*j + dx*p)  (weights)
    db[k] = sum_{n, i, j} E(k, i, j)                      (bias)

computed with ``aten.convolution_backward`` over the same extracted source the forward read.
Weight and bias gradients are returned in float32 (accumulations run in at least float32).

Every cuDNN/cuBLAS call here goes through `mpsnn.core.precision` (`float32_conv_call`,
`float32_call`): float32 on CUDA is float32 arithmetic (no TF32) unless
`mpsnn.set_float32_matmul_precision` allows TF32.

The convolution transpose is defined as MPS defines it: insert ``stride - 1``
zeros between source pixels, then correlate with the weights *as given*.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from mpsnn.core.capture import recording
from mpsnn.core.geometry import AxisWindow, EdgeMode
from mpsnn.core.layout import channels_last_only, channels_last_preferred
from mpsnn.core.precision import float32_call, float32_conv_call
from mpsnn.ops import triton as fast_paths
from mpsnn.ops._dtypes import acc_dtype
from mpsnn.ops._functorch import under_transform
from mpsnn.ops.window import (
    ExtractPlan,
    apply_extract,
    apply_extract_adjoint,
    insert_zeros,
    pad_axis,
    plan_extract,
)

__all__ = [
    "ConvGeometry",
    "conv_geometry",
    "conv_backward",
    "conv_forward",
    "conv_transpose_backward",
    "conv_transpose_forward",
    "fc_backward",
    "fc_forward",
]

_conv_backward = torch.ops.aten.convolution_backward.default


class ConvGeometry(NamedTuple):
    """The resolved windows of one convolution encode, its edge mode and group count, and how
    the source is prepared for them (made once per configuration by `conv_geometry`)."""

    y: AxisWindow
    x: AxisWindow
    edge: EdgeMode
    groups: int
    plan: ExtractPlan
    crop: bool  # the operator makes more outputs than the window has
    conv_args: tuple[Any, ...]  # F.conv2d's arguments after the bias (`_conv2d_args`)


def conv_geometry(y: AxisWindow, x: AxisWindow, edge: EdgeMode, groups: int) -> ConvGeometry:
    plan = plan_extract(y, x, edge, whole_tail=True)  # extra outputs are cut off (`crop`)
    crop = (
        _out_len(plan.y.length, plan.y.pad, y) != y.count
        or _out_len(plan.x.length, plan.x.pad, x) != x.count
    )
    args = _conv2d_args((y.stride, x.stride), plan.pads, (y.dilation, x.dilation), groups)
    return ConvGeometry(y, x, edge, groups, plan, crop, args)


def _conv2d_args(stride: tuple[int, int], pads: tuple[int, int], dilation: tuple[int, int],
                 groups: int) -> tuple[Any, ...]:  # fmt: skip
    """F.conv2d's ``(stride, padding, dilation, groups)``, made once per configuration, in the
    form it parses fastest: a pair equal on both axes as one int, trailing defaults left out
    (each tuple it parses costs about 0.1 us, as much as the rest of a tiny forward's Python)."""
    args: list[Any] = [a if a[0] != a[1] else a[0] for a in (stride, pads, dilation)]
    args.append(groups)
    defaults = (1, 0, 1, 1)
    while args and args[-1] == defaults[len(args) - 1]:
        args.pop()
    return tuple(args)


def _out_len(length: int, pad: int, a: AxisWindow) -> int:
    return (length + 2 * pad - a.extent) // a.stride + 1


def _cpu_half(x: torch.Tensor) -> bool:
    """PyTorch's CPU float16 convolutions take a slow scalar path (several times slower than
    float32): compute those in float32 and round the results to float16 — float16 storage with
    float32 accumulation, the semantics the GPU kernels have too."""
    return x.dtype is torch.float16 and x.device.type == "cpu"  # dtypes are singletons


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the layout the convolution runs in (`mpsnn.core.layout`: channels-last for
    float16/bfloat16 on CUDA, else as is); values and shape are the same either way."""
    if not channels_last_preferred(t.dtype, t.device):
        return t
    if t.shape[1] == 1 and t.is_cpu and t.is_contiguous():
        # one channel: NCHW memory is channels-last memory, but PyTorch reads the strides to
        # choose the result's layout (on the CPU, where the masters' strides of a one-channel
        # kernel do not tell either); these strides make it channels-last like the others
        h, w = t.shape[2:]
        return t.as_strided(t.shape, (h * w, 1, w, 1), t.storage_offset())
    return fast_paths.to_channels_last(t)  # a graph's images: channels-last already, kept


def _channel_sums(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``g.sum((0, 2, 3))`` in ``dtype``: Triton for a channels-last CUDA ``g`` (PyTorch's
    reduction over its three strided dimensions runs at a fraction of the bandwidth)."""
    if dtype is torch.float32:
        fast = fast_paths.channel_sums(g)
        if fast is not None:
            return fast
    return g.sum((0, 2, 3), dtype=dtype)


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _few_channels(t: torch.Tensor, weight: torch.Tensor, groups: int) -> bool:
    """Whether the convolution of ``t`` (the input as the convolution reads it) by OIHW
    ``weight`` runs on the Triton few-channel kernels (`mpsnn.ops.triton.conv_few_channels`):
    a float16/bfloat16 CUDA input of 2 or 3 channels, one group, at least 16 filters of at most
    3x3 (an image network's stem).

    Why, and why only there: cuDNN (9.x, through PyTorch) runs such a layer's forward and
    weight gradient far from the bytes they move (its tensor-core kernels want 8 input
    channels). In a replayed ResNet-18 step on an H200 (512x3x32x32 bfloat16, 64 3x3
    filters) the stem's forward takes 25.2 µs in Triton against cuDNN's 78.3 µs on operands
    padded to 8 channels, its weight gradient 47 µs against about 123; every 2- or 3-channel
    case of the table in `benchmarks/RESULTS.md` (float16, 16 to 64 filters, 1x1, stride 2 at
    224x224) is faster in Triton; four channels run slower there, and one channel and larger
    filters are not in it. The sums run in the tensor cores' order, not cuDNN's: the last place
    of a result may differ from cuDNN's."""
    # the channel count first: most convolutions have more, and it is the cheapest read
    o, c, kh, kw = weight.shape
    return (
        2 <= c <= 3
        and groups == 1
        and o >= 16
        and kh <= 3
        and kw <= 3
        and (t.dtype is torch.bfloat16 or t.dtype is torch.float16)
        and channels_last_preferred(t.dtype, t.device)
    )


def _stem_geometry(geom: ConvGeometry) -> tuple[tuple[int, int], ...]:
    """(strides, zero pads, dilations) of the convolution that runs on the prepared source."""
    return (
        (geom.y.stride, geom.x.stride),
        geom.plan.pads,
        (geom.y.dilation, geom.x.dilation),
    )


def _stem_forward(
    t: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, geom: ConvGeometry
) -> torch.Tensor:
    """The forward of a stem (`_few_channels`): Triton's few-channel convolution, else (Triton
    off) cuDNN's."""
    out = fast_paths.few_channel_conv(t, weight, bias, *_stem_geometry(geom))
    if out is None:
        out = float32_conv_call(F.conv2d, t, t, weight, bias, *geom.conv_args)
    return out


def conv_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, geom: ConvGeometry
) -> torch.Tensor:
    """``(N, I, H, W) -> (N, O, y.count, x.count)``; see the module docstring."""
    if _cpu_half(x):
        return conv_forward(x.float(), weight.float(), _f32(bias), geom).to(x.dtype)
    plan = geom.plan
    # The identity test is apply_extract's first, made here: no call for the common case.
    t = x if plan.identity else apply_extract(x, plan)
    t = _channels_last(t)
    if _few_channels(t, weight, geom.groups):
        out = _stem_forward(t, weight, bias, geom)
    else:
        out = float32_conv_call(F.conv2d, t, t, weight, bias, *geom.conv_args)
    if geom.crop:
        out = out[:, :, : geom.y.count, : geom.x.count]
    return out


def _like_masters(dw: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the weight gradient ``dw`` already has the layout and the accumulation dtype
    of the weights it was computed for: channels-last float32 masters on the CPU
    (`mpsnn.core.layout.master_layout`), whose gradient oneDNN returns channels-last."""
    return (
        dw.dtype is weight.dtype
        and dw.dtype is acc_dtype(dw.dtype)
        and (dw.stride() == weight.stride())
    )


def conv_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    geom: ConvGeometry,
    need_data: bool = True,
    need_weights: bool = True,
    need_bias: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of `conv_forward` for the incoming gradient ``grad`` (N, O, ny, nx).

    Returns:
        ``(dx, dW, db)``: dx shaped like ``x`` (or None), dW like ``weight``: contiguous OIHW,
        or channels-last when it has the layout and accumulation dtype of ``weight`` (the
        CPU's float32 masters: `_like_masters`), in the storage dtype (accumulated in float32 by
        the backend; in at least float32 when converted from channels-last; or None), db
        ``(O,)`` in at least float32 (None when ``need_bias`` is False, a layer without biases,
        or ``need_weights`` is False). A stem's dW from the Triton few-channel kernels
        (`_few_channels`) is contiguous OIHW float32 whatever its filter size.
    """
    if _cpu_half(x) or _cpu_half(grad):
        dx, dw, db = conv_backward(grad.float(), x.float(), weight.float(), geom, need_data,
                                   need_weights, need_bias)  # fmt: skip
        return (None if dx is None else dx.to(x.dtype),
                None if dw is None else dw.to(weight.dtype), db)  # fmt: skip
    need_bias = need_bias and need_weights  # MPS: the weights' and bias gradients go together
    plan = geom.plan
    t = _channels_last(apply_extract(x, plan))
    g = grad
    if geom.crop:  # the operator made extra outputs: their gradient is 0
        oy = _out_len(plan.y.length, plan.y.pad, geom.y)
        ox = _out_len(plan.x.length, plan.x.pad, geom.x)
        g = F.pad(g, (0, ox - g.shape[3], 0, oy - g.shape[2]))
    g = _channels_last(g)
    acc = acc_dtype(grad.dtype)
    stem_dw = None
    if need_weights and _few_channels(t, weight, geom.groups):
        # a stem's weight gradient in Triton (`_few_channels`): float32 OIHW, as the
        # conversion of cuDNN's below gives it; the backend computes the data gradient alone
        stem_dw = fast_paths.few_channel_conv_weight_grad(g, t, weight.shape,
                                                          *_stem_geometry(geom))  # fmt: skip
        if stem_dw is not None:
            stem_db = _channel_sums(g, acc) if need_bias else None
            if not need_data:
                return None, stem_dw, stem_db
            need_weights = need_bias = False
    # On CUDA, the bias gradient of a float32/float64 NCHW ``g`` comes with the operator (a
    # sum of ``g`` over (0, 2, 3) in C++): one call from Python less per layer and step.
    # Narrower dtypes sum in float32 below, a channels-last ``g`` through the Triton channel
    # sums; the CPU keeps the explicit sum (oneDNN's operator sums in an order of its own).
    with_bias = need_bias and g.is_cuda and g.dtype is acc and g.is_contiguous()
    dt, dw, db = float32_conv_call(
        _conv_backward,
        g,
        g,
        t,
        weight,
        [g.shape[1]] if with_bias else None,
        [geom.y.stride, geom.x.stride],
        list(plan.pads),
        [geom.y.dilation, geom.x.dilation],
        False,
        [0, 0],
        geom.groups,
        [need_data, need_weights, with_bias],
    )
    dx = apply_extract_adjoint(dt, plan) if need_data else None
    # g: grad, zero-padded where it was cropped
    if need_bias and not with_bias:  # (without the mask bit, the operator returned None)
        db = _channel_sums(g, acc)
    if need_weights and not dw.is_contiguous() and not _like_masters(dw, weight):
        # cuDNN's channels-last weight gradient: gradient states and optimizers hold the
        # weights' own layout, and sum in float32 (float64 stays): one pass does both. In work
        # recorded into a CUDA graph, a Triton transpose for half precision: a replay runs the
        # recorded kernels with no host time (PyTorch's strided copy of a 64x64x3x3 gradient
        # takes 9.7 µs on an H200, the transpose 1.2); an eager step is bound by its host
        # time, to which a Python-launched kernel per layer adds more than PyTorch's one call
        wide = fast_paths.nchw_float32(dw) if recording(dw) else None
        if wide is None:
            wide = dw.to(acc_dtype(dw.dtype), memory_format=torch.contiguous_format)
        dw = wide
    if stem_dw is not None:
        return dx, stem_dw, stem_db
    return dx, (dw if need_weights else None), db


# -- fully connected -------------------------------------------------------------------------


def fc_matrix(weight: torch.Tensor) -> torch.Tensor:
    """The ``(O, K)`` matrix of OIHW ``weight``, its columns in the weights' memory order:
    ``(c, h, w)`` for contiguous weights, ``(h, w, c)`` for channels-last ones (OHWI memory,
    MPS's order). A view either way (a caller may keep it: in-place changes of the weights
    show through it); a layer computes in that order (`fc_forward`, `fc_backward`)."""
    o = weight.shape[0]
    if channels_last_only(weight):
        return weight.permute(0, 2, 3, 1).reshape(o, -1)
    return weight.reshape(o, -1)


def _pixels(x: torch.Tensor, kh: int, kw: int, hwc: bool = False) -> torch.Tensor:
    """The top-left ``kH x kW`` pixels of ``x`` as ``(N, K)``, each image's values in
    ``(c, h, w)`` order, or ``(h, w, c)`` with ``hwc`` (a view of channels-last ``x``; no slice
    when that is all of ``x``: one view op less per layer and step)."""
    if x.shape[2] != kh or x.shape[3] != kw:
        x = x[:, :, :kh, :kw]
    if hwc:
        x = x.permute(0, 2, 3, 1)
    return x.reshape(x.shape[0], -1)


def fc_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    matrix: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y[n, o] = b[o] + sum_{c, h, w} W[o, c, h, w] x[n, c, h, w]`` over the top-left
    ``kH x kW`` pixels of ``x``; returns ``(N, O, 1, 1)``. ``matrix``: `fc_matrix` of
    ``weight``, when the caller keeps it.

    The sum runs in the weights' memory order (`fc_matrix`): over ``(c, h, w)`` for contiguous
    weights, ``(h, w, c)`` for channels-last ones (a kernel whose data source keeps OHWI
    memory, float32 on the CPU: `mpsnn.cnn.convolution.weights`), where channels-last ``x``
    is read through a view and the OHWI weights need no reordered copy. The two orders round
    apart in the last place."""
    n = x.shape[0]
    o, _, kh, kw = weight.shape
    w2 = fc_matrix(weight) if matrix is None else matrix
    xs = _pixels(x, kh, kw, channels_last_only(weight))
    # F.linear is one addmm (mm without a bias) of the (N, O) product; resized in place to
    # (N, O, 1, 1) rather than viewed, it stays a new tensor (no base) that an image adopts
    # as its storage. One call from Python for what took four (out=, t, view, addmm).
    return float32_call(F.linear, x, xs, w2, bias).resize_(n, o, 1, 1)


def fc_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    need_data: bool = True,
    need_weights: bool = True,
    matrix: torch.Tensor | None = None,
    need_bias: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of `fc_forward`: ``dx = E W``, ``dW = E^T x`` (float32), ``db = sum E``
    (None unless ``need_bias``); ``matrix``: `fc_matrix` of ``weight``, when the caller keeps
    it.

    In the weights' memory order, as the forward: for channels-last weights (OHWI memory) dx
    is channels-last and dW lies in OHWI memory, the order the optimizer writes the data
    source's weights in, so the update reads it without a reordering copy (12.8 MB per step
    for Apple's sample's 3136→1024 layer). Each element of dW is the same sum over the batch
    in either order, each of dx the same sum over the outputs; the BLAS may round a few
    elements of some shapes one unit in the last place apart."""
    n, c, h, w = x.shape
    o, _, kh, kw = weight.shape
    hwc = channels_last_only(weight)
    g2 = grad.reshape(n, o)
    dx = dw = None
    if need_data:
        w2 = fc_matrix(weight) if matrix is None else matrix
        if hwc and under_transform():  # (out= has no batching rule): a view is fine there
            dx = float32_call(torch.mm, g2, g2, w2).view(n, kh, kw, c).permute(0, 3, 1, 2)
        elif hwc:  # a new channels-last tensor, its (h, w, c) memory written by the product
            dx = torch.empty((n, c, kh, kw), dtype=g2.dtype, device=g2.device,
                             memory_format=torch.channels_last)  # fmt: skip
            flat = dx.permute(0, 2, 3, 1).view(n, -1)
            float32_call(functools.partial(torch.mm, out=flat), g2, g2, w2)
        else:  # a new tensor, not a view (fc_forward)
            dx = float32_call(torch.mm, g2, g2, w2).resize_(n, c, kh, kw)
        if (kh, kw) != (h, w):
            dx = F.pad(dx, (0, w - kw, 0, h - kh))
    if need_weights:
        dw = float32_call(torch.mm, g2, g2.t(), _pixels(x, kh, kw, hwc))
        dw = dw.view(o, kh, kw, c).permute(0, 3, 1, 2) if hwc else dw.view(o, c, kh, kw)
    return dx, dw, g2.sum(0, dtype=acc_dtype(grad.dtype)) if need_bias else None


# -- convolution transpose -------------------------------------------------------------------


def _regroup(weight: torch.Tensor, groups: int) -> torch.Tensor:
    """OIHW transpose weights -> the ``(I, O/G, kH, kW)`` rotated layout of conv_transpose2d."""
    o, ig, kh, kw = weight.shape
    w = (
        weight.reshape(groups, o // groups, ig, kh, kw)
        .transpose(1, 2)
        .reshape(groups * ig, o // groups, kh, kw)
    )
    return w.flip(-1, -2)


def _ungroup(w: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of `_regroup` (used for the weight gradient)."""
    i, og, kh, kw = w.shape
    w = w.flip(-1, -2)
    return (
        w.reshape(groups, i // groups, og, kh, kw)
        .transpose(1, 2)
        .reshape(groups * og, i // groups, kh, kw)
    )


def _transpose_axis_plan(a: AxisWindow, size: int, stride: int) -> tuple[int, int, int, int]:
    """(padding, output_padding, crop_before, crop_after) for one axis of conv_transpose2d.

    ``a`` is the window over the zero-inserted source (stride 1). The full transpose output
    (padding 0) has ``Lf = (size - 1) * stride + E`` samples and output ``o`` of the window is
    sample ``o + P`` with ``P = a.start + E - 1``.
    """
    e = a.extent
    lf = (size - 1) * stride + e
    p = a.start + e - 1
    op = a.count - (lf - 2 * p)
    if p >= 0 and 0 <= op < max(stride, a.dilation):
        return p, op, 0, 0
    return 0, 0, -p, p + a.count - lf


def conv_transpose_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    geom: ConvGeometry,
    stride: tuple[int, int],
) -> torch.Tensor:
    """MPS convolution transpose: zero-insert ``x`` by ``stride``, then correlate with
    ``weight`` (OIHW, not rotated) over the windows ``geom`` (stride-1 windows over the
    zero-inserted frame). Returns ``(N, O, y.count, x.count)``."""
    if _cpu_half(x):
        return conv_transpose_forward(x.float(), weight.float(), _f32(bias), geom, stride).to(
            x.dtype
        )
    sy, sx = stride
    if geom.edge is EdgeMode.CLAMP:
        y = conv_forward(insert_zeros(x, sy, sx), weight, None, geom)
    else:
        py, opy, cy0, cy1 = _transpose_axis_plan(geom.y, x.shape[2], sy)
        px, opx, cx0, cx1 = _transpose_axis_plan(geom.x, x.shape[3], sx)
        y = float32_conv_call(
            F.conv_transpose2d,
            x,
            x,
            _regroup(weight, geom.groups),
            None,
            (sy, sx),
            (py, px),
            (opy, opx),
            geom.groups,
            (geom.y.dilation, geom.x.dilation),
        )
        y = pad_axis(pad_axis(y, -2, cy0, cy1), -1, cx0, cx1)
    if bias is not None:
        y = y + bias.view(1, -1, 1, 1)
    return y


def conv_transpose_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    geom: ConvGeometry,
    stride: tuple[int, int],
    need_data: bool = True,
    need_weights: bool = True,
    need_bias: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of `conv_transpose_forward` (dx like ``x``; dW OIHW float32; db float32,
    None unless ``need_bias``)."""
    if _cpu_half(x) or _cpu_half(grad):
        dx, dw, db = conv_transpose_backward(
            grad.float(), x.float(), weight.float(), geom, stride, need_data, need_weights,
            need_bias,
        )  # fmt: skip
        return (None if dx is None else dx.to(x.dtype),
                None if dw is None else dw.to(weight.dtype), db)  # fmt: skip
    sy, sx = stride
    db = grad.sum((0, 2, 3), dtype=acc_dtype(grad.dtype)) if need_bias else None
    if geom.edge is EdgeMode.CLAMP:
        dxe, dw, _ = conv_backward(
            grad, insert_zeros(x, sy, sx), weight, geom, need_data, need_weights, False
        )
        dx = dxe[:, :, ::sy, ::sx] if dxe is not None else None
        return dx, dw, db
    py, opy, cy0, cy1 = _transpose_axis_plan(geom.y, x.shape[2], sy)
    px, opx, cx0, cx1 = _transpose_axis_plan(geom.x, x.shape[3], sx)
    g = pad_axis(pad_axis(grad, -2, -cy0, -cy1), -1, -cx0, -cx1)  # adjoint of the crop
    dx, dwr, _ = float32_conv_call(
        _conv_backward,
        g,
        g,
        x,
        _regroup(weight, geom.groups),
        None,
        [sy, sx],
        [py, px],
        [geom.y.dilation, geom.x.dilation],
        True,
        [opy, opx],
        geom.groups,
        [need_data, need_weights, False],
    )
    # contiguous OIHW, as `conv_backward` returns it (a channels-last source makes cuDNN's
    # weight gradient channels-last; optimizers and gradient states read dense OIHW)
    dw = _ungroup(dwr, geom.groups).contiguous() if need_weights else None
    return (dx if need_data else None), dw, db
