"""The update math of `mpsnn.ops.optim` with PyTorch operations: the portable path
(``torch._foreach_*`` over the lists, any device, float32 and float64) and, on the CPU, Adam
through PyTorch's fused kernel. `mpsnn.ops.optim.apply_update` chooses; its module docstring has
the math, the order of the gradient's preparation and the dtypes."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence

import torch

from mpsnn.core.layout import channels_last_only, nhwc_view
from mpsnn.ops.optim_hyper import Hyper, RegularizationType, UpdateRule

__all__ = ["cpu_fused_adam", "portable_update"]

# ---------------------------------------------------------------------------------------------
# the portable path: torch._foreach_* over the lists
#
# Hyperparameters are "scalars": 0-dim device tensors off the CPU (read by the device when the
# work runs: nothing waits, a captured graph follows them), Python floats on the CPU (read for
# free, and they let the CPU use torch's fused foreach ops). Either way they hold the values'
# dtype (float32 for float32 values: MPS computes in float32, and so does the Triton kernel).

_TensorList = list[torch.Tensor]
_Scalar = float | torch.Tensor


def _axpy_(y: _TensorList, x: Sequence[torch.Tensor], a: _Scalar) -> None:
    """``y += a x``."""
    if isinstance(a, torch.Tensor):
        torch._foreach_add_(y, torch._foreach_mul(x, a))  # type: ignore[call-overload]  # lists or tuples, as torch's stubs want
    else:
        torch._foreach_add_(y, x, alpha=a)  # type: ignore[call-overload]  # lists or tuples, as torch's stubs want


def _add_(y: _TensorList, a: _Scalar) -> None:
    """``y += a``."""
    if isinstance(a, torch.Tensor):
        # the 0-dim tensor overload of _foreach_add_ breaks CUDA-graph capture (PyTorch 2.11;
        # that of _foreach_mul_ does not); a list of 0-dim tensors runs tensor by tensor
        torch._foreach_add_(y, [a] * len(y))
    else:
        torch._foreach_add_(y, a)


def _addcmul_(y: _TensorList, x1: _TensorList, x2: _TensorList, a: _Scalar) -> None:
    """``y += a (x1 x2)``."""
    if isinstance(a, torch.Tensor):
        t = torch._foreach_mul(x1, x2)
        torch._foreach_mul_(t, a)
        torch._foreach_add_(y, t)
    else:
        torch._foreach_addcmul_(y, x1, x2, a)


def _addcdiv_(y: _TensorList, x1: _TensorList, x2: _TensorList, a: _Scalar) -> None:
    """``y += a (x1 / x2)``."""
    if isinstance(a, torch.Tensor):
        t = torch._foreach_div(x1, x2)
        torch._foreach_mul_(t, a)
        torch._foreach_add_(y, t)
    else:
        torch._foreach_addcdiv_(y, x1, x2, a)


def _clamped(g: _TensorList, lo: _Scalar, hi: _Scalar) -> _TensorList:
    """``clamp(g, lo, hi)`` as new tensors (NaN stays NaN)."""
    if isinstance(lo, torch.Tensor):
        # no foreach clamp takes tensor bounds; maximum/minimum take a list of 0-dim tensors
        # (one launch per tensor on CUDA, where this path runs only when Triton does not)
        out = torch._foreach_maximum(g, [lo] * len(g))
        torch._foreach_minimum_(out, [hi] * len(g))  # type: ignore[list-item]  # a tensor, as lo
    else:
        out = torch._foreach_maximum(g, lo)
        torch._foreach_minimum_(out, hi)  # type: ignore[arg-type]  # a float, as lo
    return list(out)


def _gradients(
    values: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    h: Sequence[_Scalar],
    clip: bool,
    regularization: RegularizationType,
) -> _TensorList:
    """Clipped, rescaled, regularized gradients, to be read only: new tensors, or on the CPU
    the callers' own when nothing changes them (saves a copy; the callers' are never written)."""
    dt = values[0].dtype
    g = [x if x.dtype == dt else x.to(dt) for x in grads]
    rescale = h[Hyper.GRADIENT_RESCALE]
    if not (clip or regularization or isinstance(rescale, torch.Tensor)) and rescale == 1.0:
        return g
    if clip:
        g = _clamped(g, h[Hyper.GRADIENT_CLIP_MIN], h[Hyper.GRADIENT_CLIP_MAX])
        torch._foreach_mul_(g, h[Hyper.GRADIENT_RESCALE])
    else:
        g = list(torch._foreach_mul(g, h[Hyper.GRADIENT_RESCALE]))
    if regularization == RegularizationType.L1:
        sign = torch._foreach_sign(values)  # type: ignore[arg-type]  # lists or tuples, as torch's stubs want
        _axpy_(g, sign, h[Hyper.REGULARIZATION_SCALE])
    elif regularization == RegularizationType.L2:
        _axpy_(g, values, h[Hyper.REGULARIZATION_SCALE])
    return g


# Each rule: (g, states, h, hyper, step) -> (x, den, c) with w_new = w - c x / den (den None:
# w - c x; c None: w - x), updating the state in place; g is only read.
_Step = tuple[_TensorList, _TensorList | None, _Scalar | None]


def _sgd(g: _TensorList, states, h, hyper, step) -> _Step:
    return g, None, h[Hyper.LEARNING_RATE]


def _sgd_momentum(g: _TensorList, states, h, hyper, step) -> _Step:
    (m,) = states
    torch._foreach_mul_(m, h[Hyper.MOMENTUM_SCALE])
    _axpy_(m, g, h[Hyper.LEARNING_RATE])
    return m, None, None


def _sgd_nesterov(g: _TensorList, states, h, hyper, step) -> _Step:
    (m,) = states
    mu = h[Hyper.MOMENTUM_SCALE]
    torch._foreach_mul_(m, mu)
    torch._foreach_add_(m, g)
    x = list(torch._foreach_mul(m, mu))
    torch._foreach_add_(x, g)
    return x, None, h[Hyper.LEARNING_RATE]


def _rmsprop(g: _TensorList, states, h, hyper, step) -> _Step:
    (s,) = states
    decay = h[Hyper.DECAY]
    torch._foreach_mul_(s, decay)
    _addcmul_(s, g, g, 1 - decay)
    den = list(torch._foreach_sqrt(s))
    _add_(den, h[Hyper.EPSILON])
    return g, den, h[Hyper.LEARNING_RATE]


def _adam(g: _TensorList, states, h, hyper, step) -> _Step:
    m, v = states[0], states[1]
    # t += 1 and lr_t, on the device in float64 (tensor ops: nothing read back to the host)
    step[:1].add_(1)
    corr = 1 - torch.pow(hyper[Hyper.BETA1 : Hyper.BETA2 + 1], step[0])
    lr_t = (hyper[Hyper.LEARNING_RATE] * corr[1].sqrt() / corr[0]).to(g[0].dtype)
    if not isinstance(h[0], torch.Tensor):
        lr_t = lr_t.item()  # the CPU
    b1, b2 = h[Hyper.BETA1], h[Hyper.BETA2]
    torch._foreach_mul_(m, b1)
    _axpy_(m, g, 1 - b1)
    torch._foreach_mul_(v, b2)
    _addcmul_(v, g, g, 1 - b2)
    if len(states) == 3:
        torch._foreach_maximum_(states[2], v)
        den = list(torch._foreach_sqrt(states[2]))
    else:
        den = list(torch._foreach_sqrt(v))
    _add_(den, h[Hyper.EPSILON])
    return m, den, lr_t


def _results(results: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> _TensorList:
    """``results`` holding the values, to be updated in place: copied there unless every result
    is its value (also right where only some are)."""
    target = list(results)
    if not all(r is w for r, w in zip(results, values, strict=True)):
        torch._foreach_copy_(target, list(values))
    return target


def _float32(x: float) -> float:
    """``x`` rounded to float32 (to nearest even; beyond its range, an infinity), as a Python
    float."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


# PyTorch's fused Adam (``torch.optim.Adam(fused=True)``'s kernel), where this PyTorch has it
_FUSED_ADAM: Callable[..., None] | None = getattr(torch, "_fused_adam_", None)


def _nhwc_views(grad: torch.Tensor, written: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """`nhwc_view` of a parameter's gradient and of the tensors the update writes, when the
    written ones are all `channels_last_only` (an element-wise update may then read and write
    them in that order), else None. A gradient in another layout is copied channels-last first:
    it is only read, so one copy of it replaces a copy and a copy back of each written tensor
    (a gradient made in OIHW order against a data source's OHWI weights and Adam state)."""
    if not all(channels_last_only(t) for t in written):
        return None
    # the gradient has their shape (checked by `apply_update`), one whose two layouts differ
    grad = grad.contiguous(memory_format=torch.channels_last)  # (itself when it is already)
    return [nhwc_view(t) for t in (grad, *written)]


def cpu_fused_adam(
    values: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    results: Sequence[torch.Tensor],
    states: Sequence[Sequence[torch.Tensor]],
    hyper: torch.Tensor,
    step: torch.Tensor,
    clip: bool,
    regularization: RegularizationType,
) -> bool:
    """Adam (AMSGrad with a third state list) on CPU float32 lists as PyTorch's fused kernel:
    one pass over each parameter's tensors, where the portable path makes seven (each a pass
    over memory, the CPU's cost). False, with nothing done, where it does not apply (another
    device or dtype, bias corrections of 0, no fused kernel in this PyTorch).

    The portable path's update in other roundings. The kernel reads the betas as the portable
    path's float32 values (``m`` and ``v`` are the same sums, ``m`` updated as a lerp, up to
    their roundings) and divides by ``sqrt(v) /
    sqrt(c2) + eps'`` with a step of ``lr' / c1``, where ``c1``, ``c2`` are its own bias
    corrections of those betas; with ``lr' = lr_t c1 / sqrt(c2)`` (``lr_t`` as `_adam` computes
    it) and ``eps' = eps / sqrt(c2)`` that is ``lr_t m / (sqrt(v) + eps)``. The weights differ
    from the portable path's by the roundings of that division (a few float32 ulps of the
    step). A non-finite gradient leaves other non-finite state than the portable path (``m`` is
    updated as a lerp: NaN where that path keeps an infinity; AMSGrad's maximum drops NaN in the
    kernel's scalar tail only); the weights are NaN on both. A parameter whose written tensors
    (its result and state) are all channels-last (the CPU's float32 convolutions; OHWI weights
    a data source holds) is updated through contiguous NHWC views of them, in place, its
    gradient copied channels-last first where it is not: a copy and back of each written
    tensor would cost more than the update. The kernel's scalar tail (its last elements in
    memory order) may round one unit in the last place apart from its vector body, so such a
    parameter's bits can differ there from a contiguous one's. Other layouts go through
    contiguous copies."""
    # `apply_update` checked the lists: results and states share the values' dtype, and the
    # gradients are read in it (`_gradients`)
    if _FUSED_ADAM is None or hyper.device.type != "cpu" or values[0].dtype is not torch.float32:
        return False
    h64 = hyper.tolist()  # float64: lr_t as `_adam` computes it
    h32 = hyper.to(torch.float32).tolist()  # the portable path's arithmetic
    t = int(step[0]) + 1  # this update's (the CPU: no wait)
    t32 = _float32(t)  # the kernel reads the step as float32
    b1, b2 = h32[Hyper.BETA1], h32[Hyper.BETA2]
    c1, c2 = 1.0 - b1**t32, 1.0 - b2**t32  # the kernel's bias corrections (in double)
    lr_t = h64[Hyper.LEARNING_RATE] * (1.0 - h64[Hyper.BETA2] ** t) ** 0.5
    lr_t /= 1.0 - h64[Hyper.BETA1] ** t
    if not (c2 > 0.0 and c1 != 0.0 and abs(lr_t) < float("inf")):
        return False  # beta1 or beta2 of 1 (in float32 or float64): the portable arithmetic
    lr_t = _float32(lr_t)  # rounded as `_adam`'s
    grads_now = _gradients(values, grads, h32, clip, regularization)
    # what the kernel updates in place: contiguous tensors as they are; a parameter whose
    # written tensors are all channels-last (the CPU's float32 convolution masters and their
    # state) through contiguous NHWC views of them, written in place; others through copies
    written = [_results(results, values), *(list(s) for s in states)]
    views = [_nhwc_views(g, [xs[i] for xs in written]) for i, g in enumerate(grads_now)]
    g = [v[0] if v is not None else x.contiguous() for v, x in zip(views, grads_now, strict=True)]
    dense = [
        [v[1 + k] if v is not None else (x if x.is_contiguous() else x.contiguous())
         for v, x in zip(views, xs, strict=True)]
        for k, xs in enumerate(written)
    ]  # fmt: skip
    amsgrad = len(states) == 3
    _FUSED_ADAM(
        dense[0], g, dense[1], dense[2], dense[3] if amsgrad else [],
        [torch.tensor(t32)] * len(g),
        lr=lr_t * c1 / c2**0.5, beta1=b1, beta2=b2, weight_decay=0.0,
        eps=h32[Hyper.EPSILON] / c2**0.5, amsgrad=amsgrad, maximize=False,
    )  # fmt: skip
    step[:1].add_(1)  # once the update ran
    for xs, ds in zip(written, dense, strict=True):
        for x, d, v in zip(xs, ds, views, strict=True):
            if d is not x and v is None:  # a copy (a view wrote in place)
                x.copy_(d)
    return True


_PORTABLE_RULES: dict[UpdateRule, Callable[..., _Step]] = {
    UpdateRule.SGD: _sgd,
    UpdateRule.SGD_MOMENTUM: _sgd_momentum,
    UpdateRule.SGD_NESTEROV: _sgd_nesterov,
    UpdateRule.RMSPROP: _rmsprop,
    UpdateRule.ADAM: _adam,
    UpdateRule.ADAM_AMSGRAD: _adam,
}


def portable_update(
    rule: UpdateRule,
    values: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    results: Sequence[torch.Tensor],
    states: Sequence[Sequence[torch.Tensor]],
    hyper: torch.Tensor,
    step: torch.Tensor | None,
    clip: bool,
    regularization: RegularizationType,
) -> None:
    """The update with ``torch._foreach_*`` ops: a few launches per step whatever the count of
    tensors (on CUDA; the CPU loops over the tensors inside each op)."""
    h_dt = hyper.to(values[0].dtype)  # hyperparameters rounded once to the values' dtype
    h: list[_Scalar] = list(h_dt.unbind()) if h_dt.device.type != "cpu" else h_dt.tolist()
    g = _gradients(values, grads, h, clip, regularization)
    x, den, c = _PORTABLE_RULES[rule](g, [list(s) for s in states], h, hyper, step)
    target = _results(results, values)
    if c is None:
        torch._foreach_sub_(target, x)
    elif den is None:
        _axpy_(target, x, -c)
    else:
        _addcdiv_(target, x, den, -c)
