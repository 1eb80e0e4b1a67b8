"""The plain ReLU's elementwise passes in Triton: a residual block's ``relu(x + y)``, the
masked product ``(x >= 0) t`` (the ReLU itself with ``t = x``, its gradient with ``t`` the
incoming gradient), and the ReLU's gradient from its result of a sum of two gradients, each in
one pass.

``x`` and ``y`` have one shape and one memory layout (NCHW or channels-last, dense), so the sum
is elementwise over their storage in memory order. The sum is rounded to the storage dtype
first and the ReLU applied to that value as MPS's ReLU does, ``(z >= 0) z`` (a negative sum
gives -0.0, NaN stays NaN): the bits equal ``torch.add`` followed by the portable ReLU. Bytes
moved: both inputs once and the output once, against twice the output more for an addition
and a separate ReLU.

``(x >= 0) t`` computes the product with the mask 1.0/0.0 in float32 and rounds it to the
storage dtype: multiplying by 1.0 or 0.0 is exact, so the bits equal the portable form's (a
1.0/0.0 mask in ``x``'s dtype, then a product): ``x`` for ``x >= 0``, -0.0 for ``x < 0``, NaN
for NaN and -inf. It reads ``x`` and ``t`` once and writes once (the portable form writes the
mask, then reads it again), and it is one launch instead of two.

The gradient of a sum, ``(a + b)`` where ``r > 0`` else +0.0 (``r`` the ReLU's result), is
where a residual network's two gradients of a block's input meet the ReLU that made that
input: the sum rounded to the storage dtype, then PyTorch's ``threshold_backward(sum, r, 0)``
(``r <= 0`` gives +0.0; a NaN ``r`` passes the sum). Its bits equal ``torch.add`` followed by
that call; it reads the three inputs once and writes once, where the two passes read four
tensors and write two.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from mpsnn.ops.triton.launch import cdiv, fast_kernel

__all__ = ["add_relu_triton", "relu_times_triton", "sum_relu_gradient_triton"]

_BLOCK = 4096


@fast_kernel
@triton.jit
def _add_relu(x_ptr, y_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=m, other=0.0).to(tl.float32)
    # the sum rounded to the storage dtype (exact again in float32), then (z >= 0) z: a
    # product with 1.0 or 0.0 is exact, so rounding it back changes nothing
    z = (x + y).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne").to(tl.float32)
    out = tl.where(z >= 0, 1.0, 0.0) * z
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=m)


def add_relu_triton(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``relu(x + y)`` for dense CUDA tensors of one shape, strides and dtype (the caller
    checks); a new tensor with ``x``'s layout."""
    return _launch(_add_relu, x, y)


@fast_kernel
@triton.jit
def _relu_times(x_ptr, t_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    # compared in float32: exact on the GPU; Triton's interpreter would compare bfloat16 as
    # raw bits (it also mishandles bfloat16 subnormals, which its tests therefore avoid)
    x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
    t = tl.load(t_ptr + offs, mask=m, other=0.0).to(tl.float32)
    out = tl.where(x >= 0, 1.0, 0.0) * t  # exact: a product with 1.0 or 0.0
    tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=m)


def relu_times_triton(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``(x >= 0) t`` for dense CUDA tensors of one shape, strides and dtype (the caller
    checks); a new tensor with ``x``'s layout."""
    return _launch(_relu_times, x, t)


@fast_kernel
@triton.jit
def _sum_relu_gradient(a_ptr, b_ptr, r_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < numel
    a = tl.load(a_ptr + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=m, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + offs, mask=m, other=0.0).to(tl.float32)
    s = (a + b).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
    out = tl.where(r <= 0, tl.zeros_like(s), s)  # threshold_backward: r <= 0 gives +0.0
    tl.store(out_ptr + offs, out, mask=m)


def sum_relu_gradient_triton(a: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``a + b`` where ``r > 0`` (or NaN), else +0.0, for dense CUDA tensors of one shape,
    strides and dtype (the caller checks); a new tensor with ``a``'s layout."""
    return _launch(_sum_relu_gradient, a, b, r)


def _launch(kernel: Any, a: torch.Tensor, *more: torch.Tensor) -> torch.Tensor:
    """Run a pass over the inputs' storage in memory order into a new tensor with ``a``'s
    layout (the caller checked one shape, strides and dtype)."""
    out = torch.empty_like(a)
    n = a.numel()
    kernel[(cdiv(n, _BLOCK),)](a, *more, out, n, BLOCK=_BLOCK, num_warps=8)
    return out
