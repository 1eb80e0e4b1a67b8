"""Softmax cross entropy with class-index labels in one Triton launch: the per-pixel loss and
the gradient of a training step's commonest loss.

The case: predictions ``y`` (N, C, H, W) in float16, bfloat16 or float32, int64 class indices
``k`` (N, H, W), no per-element weights, no label smoothing and a scalar weight
``0 < w <= float32 max``, where the class terms are one-hot, ``a_c = w`` at ``c = k`` and +0.0
elsewhere (`mpsnn.ops.loss._one_hot_sum`). Per pixel, over its row of C logits ``x``, in
float32 (loaded and upcast; the portable path computes in float32 too):

* ``m = max_c x_c``, ``s = sum_c exp(x_c - m)``, ``logp_c = (x_c - m) - log(s)`` (ATen's
  log-softmax formula; the sum's order may differ from ATen's, so ``logp`` may differ from
  ``torch.log_softmax`` by an ulp or so);
* loss ``l = -sum_c a_c logp_c``, every term computed, as the portable path does, so that
  special values propagate alike: ``0 * -inf`` (a -inf logit at another class than the label)
  is NaN, a -inf logit at the label gives +inf, a +inf or NaN logit gives a NaN row. The zero
  terms are signed zeros and the one non-zero term is exact in any order, so ``l``'s bits are
  the portable path's wherever ``logp``'s are;
* gradient ``g_c = (exp(logp_c) w - a_c) * (1 / d)``, ``d`` the reduction's divisor (1, or
  ``H W`` for MEAN and SUM_BY_NON_ZERO_WEIGHTS without weights), with ``1 / d`` rounded to
  float32 first: ATen's CUDA division by a Python number multiplies by the float32 reciprocal
  (exact for ``d = 1``). It is stored in ``y``'s dtype, so the caller's division and cast are
  not needed.

On the GPU, ``exp`` and ``log`` are libdevice's ``expf``/``logf``, the functions ATen's CUDA
kernels call (Triton's own ``tl.exp`` is the faster ``ex2.approx``); Triton's interpreter has no
libdevice and takes NumPy's.

A class index outside ``[0, C)`` (possible when `mpsnn.cnn.loss.LossLabels` trusted a
``max_index``, or its labels changed in place) matches no class: that pixel's loss and gradient
are NaN. The index is never used as an address, so no memory outside the tensors is read. With
``bounds``, every program also folds its pixels' indices into ``bounds = (max ~k, max k)`` by
two atomic maxima (``~k = -1 - k``, so that the lowest index is a maximum too and no value
overflows): running maxima, so ``bounds`` (made by `mpsnn.ops.loss.new_index_bounds`) can
gather the range of many launches; `mpsnn.ops.loss.read_index_bounds` decodes it after the
work completed.

Layouts: any strides of ``y`` and of the labels (passed to the kernel, with the gradient's,
which has ``y``'s layout where ``y`` is dense); the loss is a new contiguous (N, 1, H, W) float32
tensor. Each program takes ``BLOCK_P`` pixels times ``BLOCK_C = next_power_of_2(C)`` classes,
with the class axis innermost when classes are adjacent in memory (channels-last, or (N, C, 1, 1)
classification outputs) and the pixel axis innermost otherwise (NCHW), so neighbouring threads
read neighbouring addresses in both cases. Above `MAX_CLASSES` classes the portable path runs.

Why: the portable path is about 11 PyTorch operations (zeros, a scatter, the log-softmax, a
product and its sum, a negation, an exponential, a product, a difference, the reduction's
division, a cast), each 15-20 µs of host time on a slow host; this is one launch and two
allocations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from mpsnn.ops.triton.launch import cdiv, fast_kernel, next_power_of_2

__all__ = ["MAX_CLASSES", "softmax_cross_entropy_triton"]

_I64_MIN = -(2**63)
_LOW = tl.constexpr(_I64_MIN)  # read inside the kernel

MAX_CLASSES = 4096  # one row per program at most BLOCK_C = 4096 wide; wider rows: portable
_TILE = 2048  # elements (pixels x padded classes) per program when rows are narrower
# Triton's interpreter runs kernels on the host, without libdevice
_INTERPRETED = bool(triton.knobs.runtime.interpret)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        r = libdevice.exp(x)
    else:
        r = tl.exp(x)
    return r


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        r = libdevice.log(x)
    else:
        r = tl.log(x)
    return r


@fast_kernel
@triton.jit
def _softmax_cross_entropy(
    y_ptr, lab_ptr, loss_ptr, g_ptr, bounds_ptr,
    npix, C, HW, W,
    ysn, ysc, ysh, ysw,
    lsn, lsh, lsw,
    gsn, gsc, gsh, gsw,
    weight, divisor,
    BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, CLS_AXIS: tl.constexpr,
    LIBDEVICE: tl.constexpr, BOUNDS: tl.constexpr,
):  # fmt: skip
    pix = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    pmask = pix < npix
    n = pix // HW
    hw = pix - n * HW
    h = hw // W
    w = hw - h * W
    lab = tl.load(lab_ptr + (n * lsn + h * lsh + w * lsw), mask=pmask, other=0)
    if BOUNDS:  # the block's (max ~k, max k), folded into the launch's by atomic maxima
        low = tl.full((BLOCK_P,), _LOW, tl.int64)
        tl.atomic_max(bounds_ptr, tl.max(tl.where(pmask, ~lab, low), axis=0))
        tl.atomic_max(bounds_ptr + 1, tl.max(tl.where(pmask, lab, low), axis=0))
    # the tile: classes along CLS_AXIS, pixels along the other axis
    # int64 class offsets: (C - 1) * stride may pass 2**31 (NCHW logits of large images)
    if CLS_AXIS == 1:
        cls = tl.arange(0, BLOCK_C).to(tl.int64)[None, :]
    else:
        cls = tl.arange(0, BLOCK_C).to(tl.int64)[:, None]
    m2 = tl.expand_dims(pmask, CLS_AXIS) & (cls < C)
    y_off = tl.expand_dims(n * ysn + h * ysh + w * ysw, CLS_AXIS) + cls * ysc
    x = tl.load(y_ptr + y_off, mask=m2, other=-float("inf")).to(tl.float32)

    mx = tl.max(x, axis=CLS_AXIS)
    z = x - tl.expand_dims(mx, CLS_AXIS)
    # padding lanes (-inf - m, NaN in a row whose maximum is -inf) add nothing
    s = tl.sum(tl.where(m2, _exp(z, LIBDEVICE), 0.0), axis=CLS_AXIS)
    logp = z - tl.expand_dims(_log(s, LIBDEVICE), CLS_AXIS)

    a = tl.where(cls == tl.expand_dims(lab, CLS_AXIS), weight, 0.0)
    # every class's product, as the portable path forms it (0 * -inf = NaN); padding lanes add
    # -0.0, the sum's identity, so they change no bit
    loss = -tl.sum(tl.where(m2, a * logp, -0.0), axis=CLS_AXIS)
    inv = tl.math.div_rn(tl.full((), 1.0, tl.float32), divisor)
    g = (_exp(logp, LIBDEVICE) * weight - a) * inv

    valid = (lab >= 0) & (lab < C)  # an index outside [0, C): a NaN pixel
    loss = tl.where(valid, loss, float("nan"))
    g = tl.where(tl.expand_dims(valid, CLS_AXIS), g, float("nan"))
    tl.store(loss_ptr + pix, loss, mask=pmask)
    g_off = tl.expand_dims(n * gsn + h * gsh + w * gsw, CLS_AXIS) + cls * gsc
    tl.store(g_ptr + g_off, g.to(g_ptr.dtype.element_ty), mask=m2)


def softmax_cross_entropy_triton(
    y: torch.Tensor,
    labels: torch.Tensor,
    weight: float,
    divisor: int = 1,
    bounds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss (N, 1, H, W) float32, gradient in ``y``'s dtype and layout divided by ``divisor``)
    of the softmax cross entropy of logits ``y`` (N, C, H, W) with class indices ``labels``
    (N, H, W) and one-hot class terms ``weight`` (see the module). The caller (`mpsnn.ops.triton.
    softmax_cross_entropy`) checked the case: CUDA (or the interpreter), float16/bfloat16/
    float32, int64 labels of that shape on ``y``'s device, ``0 < weight <= float32 max``,
    ``1 <= C <= MAX_CLASSES``, at least one pixel. ``bounds``: None, or an int64 tensor of 2
    elements on ``y``'s device into which the labels' ``(max ~k, max k)`` are folded."""
    n, c, h, w = y.shape
    npix = n * h * w
    loss = torch.empty((n, 1, h, w), dtype=torch.float32, device=y.device)
    grad = torch.empty_like(y)  # y's strides where y is dense, else contiguous
    block_c = next_power_of_2(c)
    block_p = max(1, min(_TILE // block_c, next_power_of_2(npix)))
    # classes innermost when they are adjacent in memory, else pixels (NCHW planes)
    cls_axis = 1 if y.stride(1) == 1 else 0
    _softmax_cross_entropy[(cdiv(npix, block_p),)](
        y, labels, loss, grad, loss if bounds is None else bounds,
        npix, c, h * w, w, *y.stride(), *labels.stride(), *grad.stride(),
        float(weight), float(divisor),
        BLOCK_P=block_p, BLOCK_C=block_c, CLS_AXIS=cls_axis,
        LIBDEVICE=y.is_cuda and not _INTERPRETED, BOUNDS=bounds is not None,
        num_warps=8 if block_p * block_c >= 2048 else 4,
    )  # fmt: skip
    return loss, grad
