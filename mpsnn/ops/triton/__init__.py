"""CUDA fast paths written in Triton, and the one place that decides when they run.

A fast path computes the same function as the portable PyTorch path it replaces and is tested
against it (on the GPU machine, and on the CPU through Triton's interpreter at small sizes).
It runs for CUDA tensors when Triton is importable and the configuration is one it handles;
`set_enabled(False)` forces the portable paths (for comparisons and debugging).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from mpsnn.core.layout import channels_last_only
from mpsnn.ops._functorch import under_transform
from mpsnn.ops.batch_norm_params import BatchNormParams, BatchNormSums, RunningUpdate

__all__ = [
    "add_relu",
    "available",
    "batch_norm_add_relu",
    "batch_norm_backward",
    "batch_norm_eligible",
    "batch_norm_forward",
    "batch_norm_gradient_sums",
    "batch_norm_merge_rows",
    "batch_norm_running_updates",
    "batch_norm_statistics",
    "cast_into_channels_last",
    "channel_sums",
    "dropout_apply",
    "enabled",
    "few_channel_conv",
    "few_channel_conv_weight_grad",
    "max_pool_backward",
    "narrow_into",
    "nchw_float32",
    "optimizer_tables",
    "pool_tiles",
    "relu_times",
    "set_enabled",
    "softmax_cross_entropy",
    "to_channels_last",
]

_enabled = True


@functools.cache
def available() -> bool:
    """True when Triton can be imported."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def set_enabled(flag: bool) -> None:
    """Turn the Triton fast paths on or off for the whole process."""
    global _enabled
    _enabled = bool(flag)


def enabled() -> bool:
    return _enabled


def _runs(*tensors: torch.Tensor) -> bool:
    """Whether the fast paths may take these tensors: on, CUDA tensors, Triton importable,
    and no ``torch.func`` transform or forward-mode AD level active (whose batched or dual
    tensors the kernels cannot read; the portable paths handle them)."""
    if not _enabled:
        return False
    for t in tensors:  # (a loop: a generator costs more than the tests, at every command)
        if not t.is_cuda:
            return False
    return available() and not under_transform()


def max_pool_backward(g: torch.Tensor, x: torch.Tensor, geom: Any) -> torch.Tensor | None:
    """The Triton max-pool gradient when it applies (non-overlapping windows, stride ==
    kernel, no dilation, inside the image; CUDA; float16/bfloat16/float32), else None."""
    if not (_runs(g, x) and pool_tiles(geom)):
        return None
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    from mpsnn.ops.triton.pooling import max_pool_backward_triton

    return max_pool_backward_triton(g, x, geom)


def pool_tiles(geom: Any) -> bool:
    """Windows of ``geom`` are disjoint and inside the image (the Triton kernel's case)."""
    for a, p in ((geom.y, geom.plan.y), (geom.x, geom.plan.x)):
        if a.stride != a.kernel or a.dilation != 1 or not p.is_view:
            return False
    return True


def dropout_apply(
    t: torch.Tensor,
    key: torch.Tensor,
    first_image: int,
    geom: Any,
    *,
    seed_part: int | None = None,
    key_out: torch.Tensor | None = None,
    ticket: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The Triton dropout for CUDA tensors in float16, bfloat16 or float32, else None (float64
    runs on the portable path); ``seed_part``/``key_out``/``ticket``: ``key`` is the encode
    counter, advanced by the kernel (see `mpsnn.ops.triton.dropout.dropout_apply_triton`)."""
    if not (_runs(t) and t.dtype in (torch.float16, torch.bfloat16, torch.float32)):
        return None
    from mpsnn.ops.triton.dropout import dropout_apply_triton

    return dropout_apply_triton(
        t, key, first_image, geom, seed_part=seed_part, key_out=key_out, ticket=ticket
    )


def _one_pass(x: torch.Tensor, y: torch.Tensor) -> bool:
    """``x`` and ``y`` can be read elementwise in memory order by one pass: CUDA, float16,
    bfloat16 or float32, one shape, dtype and dense layout (NCHW or channels-last)."""
    return (
        _runs(x, y)
        and x.dtype in _PASS_DTYPES
        and y.dtype is x.dtype
        and x.shape == y.shape
        and x.stride() == y.stride()
        and x.numel() > 0
        and (x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last))
    )


_PASS_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def add_relu(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
    """``relu(x + y)`` in one pass for CUDA tensors in float16, bfloat16 or float32 of one
    shape, dtype and dense layout (a residual block's addition and ReLU), else None."""
    if not _one_pass(x, y):
        return None
    from mpsnn.ops.triton.elementwise import add_relu_triton

    return add_relu_triton(x, y)


def relu_times(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor | None:
    """``(x >= 0) t`` (the plain ReLU with ``t = x``, its gradient with ``t`` the incoming
    gradient) in one pass, under `add_relu`'s conditions, else None."""
    if not _one_pass(x, t):
        return None
    from mpsnn.ops.triton.elementwise import relu_times_triton

    return relu_times_triton(x, t)


def sum_relu_gradient(a: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor | None:
    """``threshold_backward(a + b, r, 0)`` (the plain ReLU's gradient, from its result ``r``,
    of a sum of two gradients) in one pass, under `add_relu`'s conditions for the three
    tensors, else None."""
    if not (_one_pass(a, b) and _one_pass(a, r)):
        return None
    from mpsnn.ops.triton.elementwise import sum_relu_gradient_triton

    return sum_relu_gradient_triton(a, b, r)


_F32_MAX = torch.finfo(torch.float32).max


def softmax_cross_entropy(
    y: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    weight: float,
    label_smoothing: float,
    divisor: int = 1,
    *,
    index_bounds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Triton softmax cross entropy's ``(per-pixel loss (N, 1, H, W) float32, gradient in
    ``y``'s dtype divided by ``divisor``)`` when its class terms are a one-hot ``weight``
    (`mpsnn.ops.loss._one_hot_sum`: int64 class indices (N, H, W), no ``weights``, no label
    smoothing, ``0 < weight <= float32 max``) for non-empty CUDA (N, C, H, W) logits in
    float16, bfloat16 or float32 with at most `mpsnn.ops.triton.loss.MAX_CLASSES` classes,
    else None (float64 and the other cases run on the portable path). ``index_bounds``: the
    labels' range, as `mpsnn.ops.loss.loss_forward_backward` documents it."""
    if weights is not None or label_smoothing or labels.dtype != torch.int64:
        return None
    if not 0 < weight <= _F32_MAX:  # NaN fails too
        return None
    if not _runs(y, labels) or y.dtype not in _PASS_DTYPES or y.dim() != 4 or y.numel() == 0:
        return None
    n, c, h, w = y.shape
    if labels.shape != (n, h, w) or labels.device != y.device:
        return None
    from mpsnn.ops.triton.loss import MAX_CLASSES, softmax_cross_entropy_triton

    if c > MAX_CLASSES:
        return None
    return softmax_cross_entropy_triton(y, labels, weight, divisor, index_bounds)


_MAX_PIXELS = 1 << 30  # a channel's pixels: chunk bounds up to twice that stay int32


def batch_norm_eligible(x: torch.Tensor, neuron: Any = None, *more: torch.Tensor) -> bool:
    """The batch-normalization kernels' case: non-empty CUDA (N, C, H, W) tensors in float16,
    bfloat16 or float32 (``more``, an incoming gradient, of the same shape and dtype) with
    fewer than 2^30 pixels per channel (the channels-last passes count a channel's pixels in
    32-bit integers), and no neuron, NONE or RELU (type codes 0 and 1, any slope). float64,
    other neurons and larger tensors run on the portable path."""
    if not _runs(x, *more) or not _bn_case(x, neuron):
        return False
    return all(g.dtype == x.dtype and g.shape == x.shape for g in more)


def _bn_case(x: torch.Tensor, neuron: Any, g: torch.Tensor | None = None) -> bool:
    """`batch_norm_eligible` once `_runs` holds."""
    if x.dim() != 4 or x.dtype not in _PASS_DTYPES:
        return False
    n = x.numel()
    if n == 0 or n // x.shape[1] >= _MAX_PIXELS:
        return False
    if neuron is not None and neuron.kind not in (0, 1):
        return False
    return g is None or (g.dtype == x.dtype and g.shape == x.shape)


# The passes of each layout, by kind: statistics, normalization, gradient sums, input
# gradient, normalization inside the residual addition (NCHW: none). Looked up by name in
# their modules at each call (tests replace them there); the modules are imported at the
# first normalization (Triton's import is slow; a machine without it never pays it).
_STATS, _FORWARD, _SUMS, _BACKWARD, _ADD = range(5)
_BN_NAMES = (
    ("bn_statistics_triton", "bn_forward_triton", "bn_gradient_sums_triton",
     "bn_backward_triton", None),
    ("nhwc_statistics", "nhwc_forward", "nhwc_gradient_sums", "nhwc_backward",
     "nhwc_forward_add_relu"),
)  # fmt: skip
_bn_modules: tuple[Any, Any] | None = None


def _bn_pass(kind: int, x: torch.Tensor, neuron: Any, g: torch.Tensor | None = None) -> Any:
    """The Triton pass ``kind`` for ``x``'s layout (channels-last storage: the NHWC passes,
    else the NCHW ones) where `batch_norm_eligible` holds, else None. One call per command:
    a normalization layer makes four or five per training step."""
    global _bn_modules
    if not (_runs(x) if g is None else _runs(x, g)) or not _bn_case(x, neuron, g):
        return None
    if _bn_modules is None:
        from mpsnn.ops.triton import batch_norm as nchw
        from mpsnn.ops.triton import batch_norm_nhwc as nhwc

        _bn_modules = (nchw, nhwc)
    # channels-last storage (half-precision convolution outputs) takes the NHWC passes
    layout = 1 if channels_last_only(x) else 0
    name = _BN_NAMES[layout][kind]
    return None if name is None else getattr(_bn_modules[layout], name)


def batch_norm_statistics(
    x: torch.Tensor, variance: bool = False
) -> tuple[torch.Tensor, ...] | None:
    """The Triton ``(count, mean, m2)`` of ``x`` (and the biased ``var`` with ``variance``)
    when `batch_norm_eligible`, else None."""
    run = _bn_pass(_STATS, x, None)
    return None if run is None else run(x, variance=variance)


def batch_norm_running_updates(updates: Sequence[RunningUpdate]) -> bool:
    """Run the Triton running-statistics updates (`mpsnn.ops.batch_norm.bn_running_updates`)
    when every tensor of every update is a contiguous float32 CUDA vector of the current device
    (``count``: 1 or C elements); False, with nothing run, where one does not apply."""
    for u in updates:
        ts = (*u.running, u.count, u.mean, u.m2)
        if not (_runs(*ts) and _on_current_device(*ts)):  # (one device, then)
            return False
        c = u.mean.numel()
        for t in ts:
            if t.dtype is not torch.float32 or not t.is_contiguous():
                return False
            if t.numel() != c and t is not u.count:
                return False
        if u.count.numel() not in (1, c):
            return False
    from mpsnn.ops.triton.batch_norm_vectors import bn_running_updates_triton

    bn_running_updates_triton(updates)
    return True


def batch_norm_forward(x: torch.Tensor, p: BatchNormParams) -> torch.Tensor | None:
    """The Triton normalization (+ neuron) of ``x`` by ``p`` when `batch_norm_eligible`, else
    None."""
    run = _bn_pass(_FORWARD, x, p.neuron)
    return None if run is None else run(x, p)


def batch_norm_add_relu(
    x: torch.Tensor, p: BatchNormParams, r: torch.Tensor, first: bool = True
) -> torch.Tensor | None:
    """``relu(bn(x) + r)`` in one Triton pass (`batch_norm_nhwc.nhwc_forward_add_relu`) for
    channels-last CUDA ``x`` and ``r`` of one shape, strides and dtype and no neuron in ``p``,
    else None."""
    if p.neuron is not None:
        return None
    run = _bn_pass(_ADD, x, None, r)
    if run is None or r.stride() != x.stride():
        return None
    return run(x, p, r, first=first)


def batch_norm_gradient_sums(
    g: torch.Tensor, x: torch.Tensor, p: BatchNormParams
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The Triton ``(Σ gy, Σ gy xhat)`` when `batch_norm_eligible`, else None."""
    run = _bn_pass(_SUMS, x, p.neuron, g)
    return None if run is None else run(g, x, p)


def batch_norm_backward(
    g: torch.Tensor, x: torch.Tensor, p: BatchNormParams, sums: BatchNormSums
) -> torch.Tensor | None:
    """The Triton ``dL/dx`` when `batch_norm_eligible`, else None."""
    run = _bn_pass(_BACKWARD, x, p.neuron, g)
    return None if run is None else run(g, x, p, sums)


def batch_norm_merge_rows(
    rows: torch.Tensor,
    into: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    var: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The Triton merge of gathered statistics ``rows`` into ``into`` (see
    `mpsnn.ops.batch_norm.bn_merge_rows`), returning the biased variance (written into ``var``
    when given), when every tensor is contiguous float32 on one CUDA device; else None
    (nothing written)."""
    outs = (*into, var) if var is not None else into
    if not _runs(rows, *outs) or rows.dim() != 2:
        return None
    for t in (rows, *outs):
        if t.dtype is not torch.float32 or not t.is_contiguous() or t.device != rows.device:
            return None
    if var is not None and var.shape != into[1].shape:
        return None
    from mpsnn.ops.triton.batch_norm_vectors import bn_merge_rows_triton

    return bn_merge_rows_triton(rows, into, var)


def channel_sums(g: torch.Tensor) -> torch.Tensor | None:
    """The Triton float32 ``g.sum((0, 2, 3))`` of a channels-last float16/bfloat16/float32
    CUDA tensor (a convolution's bias gradient), else None."""
    if not _runs(g) or g.numel() == 0:
        return None
    if g.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return None
    from mpsnn.ops.triton import batch_norm_nhwc as nhwc

    return nhwc.nhwc_channel_sums(g) if channels_last_only(g) else None


def to_channels_last(t: torch.Tensor) -> torch.Tensor:
    """``t.contiguous(memory_format=torch.channels_last)``, ``t`` itself when it is
    channels-last already; an NCHW float16, bfloat16 or float32 CUDA tensor through the Triton
    transpose (`mpsnn.ops.triton.layout`: PyTorch's strided copy runs at about a third of the
    bandwidth), others through PyTorch's copy. Unlike the other fast paths it always returns
    the tensor."""
    if not (_runs(t) and t.dtype in _PASS_DTYPES):
        return t.contiguous(memory_format=torch.channels_last)
    from mpsnn.ops.triton.layout import channels_last_copy

    return channels_last_copy(t)


def cast_into_channels_last(t: torch.Tensor, out: torch.Tensor) -> bool:
    """``out.copy_(t)`` for an NCHW-contiguous float32 CUDA ``t`` and a channels-last
    float16/bfloat16 ``out`` of its shape through one Triton pass (`mpsnn.ops.triton.layout`;
    NaN payloads may differ from PyTorch's); False, writing nothing, where it does not apply."""
    if not (_runs(t, out) and out.dtype in _HALF and _on_current_device(t, out)):
        return False
    from mpsnn.ops.triton.layout import nchw_to_nhwc_into

    return nchw_to_nhwc_into(t, out)


def narrow_into(
    dst: list[torch.Tensor], src: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``dst[i].copy_(src[i])`` for the pairs of contiguous float32 CUDA ``src`` and contiguous
    float16/bfloat16 ``dst`` of the same shapes on the current device, through one Triton
    launch per 32 pairs (`mpsnn.ops.triton.layout.narrow_flat_into`; NaN payloads may differ
    from PyTorch's). Returns the pairs it did not write (all of them where Triton does not
    run), for the caller's own copy."""
    if not (dst and _runs(*dst, *src) and _on_current_device(*dst, *src)):
        return dst, src
    from mpsnn.ops.triton.layout import flat_narrowable, narrow_flat_into

    device = src[0].device
    take = [flat_narrowable(d, s, device) for d, s in zip(dst, src, strict=True)]
    if any(take):
        narrow_flat_into([d for d, t in zip(dst, take, strict=True) if t],
                         [s for s, t in zip(src, take, strict=True) if t])  # fmt: skip
    rest = [i for i, t in enumerate(take) if not t]
    return [dst[i] for i in rest], [src[i] for i in rest]


def nchw_float32(t: torch.Tensor) -> torch.Tensor | None:
    """``t.to(torch.float32, memory_format=torch.contiguous_format)`` of a channels-last (not
    NCHW) float16/bfloat16 CUDA tensor through one Triton pass (`mpsnn.ops.triton.layout`),
    else None."""
    if not (_runs(t) and t.dtype in _HALF and _on_current_device(t)):
        return None
    from mpsnn.ops.triton.layout import nchw_float32_triton

    return nchw_float32_triton(t)


def few_channel_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    stride: tuple[int, int], pads: tuple[int, int], dilation: tuple[int, int],
) -> torch.Tensor | None:  # fmt: skip
    """The Triton convolution of an image with few channels (one group, ``C kH kW`` at most
    64, float16/bfloat16 CUDA operands of one dtype) as a new channels-last tensor
    (`mpsnn.ops.triton.conv_few_channels`), else None."""
    if not (_runs(x, weight) and x.dtype in _HALF and weight.dtype is x.dtype):
        return None
    from mpsnn.ops.triton import conv_few_channels as few

    if not (
        _on_current_device(x, weight)
        and (bias is None or bias.device == x.device)
        and few.fits(x, weight.shape, stride, pads, dilation)
    ):
        return None
    return few.few_channel_conv_forward(x, weight, bias, stride, pads, dilation)


def few_channel_conv_weight_grad(
    g: torch.Tensor, x: torch.Tensor, weight_shape: Sequence[int],
    stride: tuple[int, int], pads: tuple[int, int], dilation: tuple[int, int],
) -> torch.Tensor | None:  # fmt: skip
    """The weights' gradient of `few_channel_conv` for the output gradient ``g`` (a contiguous
    float32 OIHW tensor), where that convolution runs, else None."""
    if not (_runs(g, x) and x.dtype in _HALF and g.dtype is x.dtype):
        return None
    from mpsnn.ops.triton import conv_few_channels as few

    if not (_on_current_device(g, x) and few.fits(x, weight_shape, stride, pads, dilation, g)):
        return None
    return few.few_channel_conv_weight_grad(g, x, weight_shape, stride, pads, dilation)


_HALF = (torch.float16, torch.bfloat16)


def _on_current_device(*tensors: torch.Tensor) -> bool:
    """Whether every CUDA tensor is on the current device: Triton launches on the current
    device's stream (a tensor elsewhere takes PyTorch's path, which switches devices)."""
    current = torch.cuda.current_device()
    return all(t.device.index == current for t in tensors)


def optimizer_tables(
    lists: Sequence[Sequence[torch.Tensor]], capturing: bool | None = None
) -> Any | None:
    """The Triton multi-tensor optimizer update for ``lists`` (values, gradients, results, then
    the state lists; checked by `mpsnn.ops.optim`) when it applies, else None: CUDA, float32
    values, results and state, float16/bfloat16/float32 gradients, every tensor contiguous.
    The object returned keeps the lists' device tables; its ``launch`` runs an update.
    ``capturing``: whether a CUDA graph is being captured (None: detect it); the tables are
    then staged for that capture (`mpsnn.ops.triton.optim.build_tables`)."""
    if not (lists and lists[0] and _runs(lists[0][0])):
        return None
    values, grads, *rest = lists
    for lst in (values, *rest):
        for t in lst:
            if not (t.is_cuda and t.dtype == torch.float32 and t.is_contiguous()):
                return None
    for t in grads:
        if not (t.is_cuda and t.dtype in _OPTIM_GRAD_DTYPES and t.is_contiguous()):
            return None
    from mpsnn.ops.triton.optim import build_tables

    return build_tables(lists, capturing)


_OPTIM_GRAD_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
