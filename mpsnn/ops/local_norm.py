"""Local normalizations, per pixel: cross-channel (LRN), spatial, and local contrast.

All three take ``x`` (N, C, H, W) and return a tensor of the same shape. Float16/bfloat16 data
is computed in float32 (`widen`); results come back in the input's dtype (``y`` in ``x``'s,
``dx`` in ``g``'s). Gradients are the exact vector-Jacobian products of the forwards here,
derived in each docstring (MPS documents looser backward formulas; these are the true adjoints
of the forward maps).

**Cross-channel** (size ``N`` over channels, at every pixel)::

    Q(k) = [max(0, k - N//2), min(C-1, k + (N-1)//2)]
    L_k  = delta + (alpha / N) Σ_{q in Q(k)} x_q^2           y_k = x_k L_k^(-beta)

The divisor is ``N`` even where ``Q(k)`` is cut by the channel ends. This is exactly
``torch.nn.functional.local_response_norm(x, size=N, alpha=alpha, beta=beta, k=delta)``, for
odd and even ``N`` alike (PyTorch pads ``N//2`` channels before and ``(N-1)//2`` after, which is
this ``Q(k)``; an even window leans towards lower channels).

**Spatial windows** (spatial and local contrast): output ``(i, j)`` reads rows
``i - kh//2 + a`` (``a = 0 .. kh-1``) and columns ``j - kw//2 + b`` (``b = 0 .. kw-1``) of its
own channel: even windows lean top-left. A tap outside the image reads 0 (`EdgeMode.ZERO`) or
the nearest edge pixel (`EdgeMode.CLAMP`); either way every tap counts, the divisor is
``K = kw · kh``. The taps are read through the window module (`plan_extract` /
`apply_extract`), and the gradient goes back through the exact adjoint of the window sum and of
that extraction (`apply_extract_adjoint`: a clamped tap's gradient lands on the edge pixel it
read), so nothing is approximated and the sums are deterministic.

**Spatial**::

    T = delta + (alpha / K) Σ_window x^2                     y = x T^(-beta)

**Local contrast**::

    M   = (1/K) Σ_window x                VAR = max((1/K) Σ_window x^2 - M^2, 0)
    D   = delta + alpha VAR               y   = pm + ps (x - p0 M) D^(-beta)

Where a base (``L``, ``T``, ``D``) is exactly 0 and its exponent negative (only possible with
``delta = 0``: an all-zero window for LRN and spatial, a constant window for local contrast)
the power is taken as 0, so results and gradients stay finite; the true map has no derivative
there. With ``delta > 0`` (the usual case) nothing is guarded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpsnn.core.geometry import AxisWindow, EdgeMode
from mpsnn.ops._dtypes import widen
from mpsnn.ops.window import ExtractPlan, apply_extract, apply_extract_adjoint, plan_extract

__all__ = [
    "cross_channel_norm_backward",
    "cross_channel_norm_forward",
    "local_contrast_norm_backward",
    "local_contrast_norm_forward",
    "spatial_norm_backward",
    "spatial_norm_forward",
]

_avg_pool_backward = torch.ops.aten.avg_pool2d_backward.default


def _check_x(x: torch.Tensor, who: str) -> None:
    if x.dim() != 4:
        raise ValueError(f"[{who}] x must be (N, C, H, W), got shape {tuple(x.shape)}")


def _check_g(g: torch.Tensor, x: torch.Tensor, who: str) -> None:
    if tuple(g.shape) != tuple(x.shape):
        raise ValueError(f"[{who}] g shape {tuple(g.shape)} != x shape {tuple(x.shape)}")


def _check_size(name: str, v: int, who: str) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"[{who}] {name} must be a positive int, got {v!r}")


def _power(base: torch.Tensor, exponent: float) -> torch.Tensor:
    """``base ** exponent``, with 0 where ``base == 0`` and the exponent is negative (instead of
    inf, which would turn ``0 · inf`` into NaN downstream)."""
    p = base.pow(exponent)
    if exponent < 0:
        p = torch.where(base == 0, 0.0, p)
    return p


# -- cross-channel (LRN) --------------------------------------------------------------------


def _channel_window_sum(s: torch.Tensor, before: int, after: int, size: int) -> torch.Tensor:
    """``out_k = Σ_{q = k - before}^{k + after} s_q`` over channels (out-of-range q read 0);
    ``before + after + 1 == size``. A stride-1 box sum, deterministic on every device."""
    n, c, h, w = s.shape
    v = F.pad(s.reshape(n, 1, c, h * w), (0, 0, before, after))
    return F.avg_pool2d(v, (size, 1), 1, 0, False, True, 1).reshape(n, c, h, w)


def _lrn_base(xa: torch.Tensor, size: int, alpha: float, delta: float) -> torch.Tensor:
    """``L`` of the module docstring (Q(k) = k - N//2 .. k + (N-1)//2)."""
    return delta + (alpha / size) * _channel_window_sum(xa * xa, size // 2, (size - 1) // 2, size)


def cross_channel_norm_forward(
    x: torch.Tensor, size: int, alpha: float, beta: float, delta: float
) -> torch.Tensor:
    """``y_k = x_k L_k^(-beta)`` (module docstring); (N, C, H, W) in ``x``'s dtype."""
    _check_x(x, "cross_channel_norm")
    _check_size("size", size, "cross_channel_norm")
    xa = widen(x)
    return (xa * _power(_lrn_base(xa, size, alpha, delta), -beta)).to(x.dtype)


def cross_channel_norm_backward(
    g: torch.Tensor, x: torch.Tensor, size: int, alpha: float, beta: float, delta: float
) -> torch.Tensor:
    """Exact ``dx`` (N, C, H, W, in ``g``'s dtype) of `cross_channel_norm_forward` for ``g``.

    Derivation (one pixel): ``d L_k / d x_j = (2 alpha / N) x_j [j in Q(k)]``, so
    ``d y_k / d x_j = δ_kj L_k^(-beta) - beta x_k L_k^(-beta-1) (2 alpha / N) x_j [j in Q(k)]``
    and ``dx_j = g_j L_j^(-beta) - (2 alpha beta / N) x_j Σ_{k: j in Q(k)} g_k x_k
    L_k^(-beta-1)``. ``j in Q(k)`` is ``k in [j - (N-1)//2, j + N//2]``: the adjoint of the
    channel window sum is the box sum with the window mirrored.
    """
    _check_x(x, "cross_channel_norm")
    _check_g(g, x, "cross_channel_norm")
    _check_size("size", size, "cross_channel_norm")
    xa, ga = widen(x), widen(g)
    base = _lrn_base(xa, size, alpha, delta)
    u = ga * xa * _power(base, -beta - 1.0)
    back = _channel_window_sum(u, (size - 1) // 2, size // 2, size)
    dx = ga * _power(base, -beta) - (2.0 * alpha * beta / size) * xa * back
    return dx.to(g.dtype)


# -- spatial windows ------------------------------------------------------------------------


def _plan(x: torch.Tensor, kw: int, kh: int, edge: EdgeMode, who: str) -> ExtractPlan:
    """Extraction of the ``kh`` × ``kw`` windows centred on every pixel (output = image size),
    prepared as a padded copy so a plain stride-1 box sum reads every tap."""
    _check_x(x, who)
    _check_size("kw", kw, who)
    _check_size("kh", kh, who)
    h, w = x.shape[-2:]
    ay = AxisWindow(-(kh // 2), h, kh, 1, 1, h)
    ax = AxisWindow(-(kw // 2), w, kw, 1, 1, w)
    return plan_extract(ay, ax, edge, allow_pad=False)


def _window_sum(t: torch.Tensor, kw: int, kh: int) -> torch.Tensor:
    """Stride-1 ``kh`` × ``kw`` box sums of an extracted source (divisor_override=1: a sum)."""
    return F.avg_pool2d(t, (kh, kw), 1, 0, False, True, 1)


def _window_sum_extract_adjoint(
    u: torch.Tensor, kw: int, kh: int, plan: ExtractPlan
) -> torch.Tensor:
    """Adjoint of ``x -> _window_sum(apply_extract(x, plan))``: each output's ``u`` added to
    every tap of its window (PyTorch's gather-style, deterministic pooling backward), then the
    extraction's adjoint (padding dropped, clamped reads summed onto their edge pixels)."""
    shape = (u.shape[0], u.shape[1], plan.y.length, plan.x.length)
    t = u.new_empty(shape)  # the pooling backward reads only its input's shape
    dt = _avg_pool_backward(u.contiguous(), t, [kh, kw], [1, 1], [0, 0], False, True, 1)
    return apply_extract_adjoint(dt, plan)


def _spatial_base(
    xa: torch.Tensor, kw: int, kh: int, alpha: float, delta: float, plan: ExtractPlan
) -> torch.Tensor:
    t = apply_extract(xa, plan)
    return delta + (alpha / (kw * kh)) * _window_sum(t * t, kw, kh)


def spatial_norm_forward(
    x: torch.Tensor, kw: int, kh: int, alpha: float, beta: float, delta: float, edge: EdgeMode
) -> torch.Tensor:
    """``y = x T^(-beta)`` over ``kw`` × ``kh`` windows (module docstring), in ``x``'s dtype."""
    plan = _plan(x, kw, kh, edge, "spatial_norm")
    xa = widen(x)
    return (xa * _power(_spatial_base(xa, kw, kh, alpha, delta, plan), -beta)).to(x.dtype)


def spatial_norm_backward(
    g: torch.Tensor,
    x: torch.Tensor,
    kw: int,
    kh: int,
    alpha: float,
    beta: float,
    delta: float,
    edge: EdgeMode,
) -> torch.Tensor:
    """Exact ``dx`` (N, C, H, W, in ``g``'s dtype) of `spatial_norm_forward` for ``g``.

    Derivation: write ``E`` for the extraction (taps with the edge rule) and ``S`` for the box
    sum, so ``T = delta + (alpha / K) S(E(x)^2)`` and ``E(x)^2 = E(x^2)`` (extraction copies
    values or writes 0). Then ``dT = (2 alpha / K) S(E(x dx))`` and, from
    ``dy = dx T^(-beta) - beta x T^(-beta-1) dT``, the adjoint is
    ``dx = g T^(-beta) - (2 alpha beta / K) x E^T S^T(g x T^(-beta-1))``.
    """
    who = "spatial_norm"
    plan = _plan(x, kw, kh, edge, who)
    _check_g(g, x, who)
    xa, ga = widen(x), widen(g)
    base = _spatial_base(xa, kw, kh, alpha, delta, plan)
    back = _window_sum_extract_adjoint(ga * xa * _power(base, -beta - 1.0), kw, kh, plan)
    dx = ga * _power(base, -beta) - (2.0 * alpha * beta / (kw * kh)) * xa * back
    return dx.to(g.dtype)


def _contrast_terms(
    xa: torch.Tensor, kw: int, kh: int, plan: ExtractPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, raw)``: the window mean and the unclamped population variance ``E[x^2] - M^2``."""
    k = kw * kh
    t = apply_extract(xa, plan)
    mean = _window_sum(t, kw, kh) / k
    return mean, _window_sum(t * t, kw, kh) / k - mean * mean


def local_contrast_norm_forward(
    x: torch.Tensor,
    kw: int,
    kh: int,
    alpha: float,
    beta: float,
    delta: float,
    p0: float,
    pm: float,
    ps: float,
    edge: EdgeMode,
) -> torch.Tensor:
    """``y = pm + ps (x - p0 M) (delta + alpha VAR)^(-beta)`` (module docstring), in ``x``'s
    dtype."""
    plan = _plan(x, kw, kh, edge, "local_contrast_norm")
    xa = widen(x)
    mean, raw = _contrast_terms(xa, kw, kh, plan)
    base = delta + alpha * raw.clamp_min(0.0)  # rounding can make E[x^2] - M^2 slightly < 0
    return (pm + ps * (xa - p0 * mean) * _power(base, -beta)).to(x.dtype)


def local_contrast_norm_backward(
    g: torch.Tensor,
    x: torch.Tensor,
    kw: int,
    kh: int,
    alpha: float,
    beta: float,
    delta: float,
    p0: float,
    pm: float,
    ps: float,
    edge: EdgeMode,
) -> torch.Tensor:
    """Exact ``dx`` (N, C, H, W, in ``g``'s dtype) of `local_contrast_norm_forward` for ``g``.

    Derivation: with ``A = E^T S^T`` the adjoint of the window sum of the extracted source,
    ``r = x - p0 M``, ``D = delta + alpha VAR``, ``P = D^(-beta)``:

    * ``dM = (1/K) S(E(dx))``; ``dVAR = (2/K) S(E(x dx)) - 2 M dM`` where the unclamped
      variance is positive, 0 where the clamp holds it at 0;
    * ``dy = ps (dr P + r dP)`` with ``dr = dx - p0 dM`` and
      ``dP = -beta alpha D^(-beta-1) dVAR``.

    Collecting the coefficients ``a = ps g P`` (of ``dr``) and
    ``b = -ps alpha beta g r D^(-beta-1)`` (of ``dVAR``, 0 where clamped), the adjoint is
    ``dx = a + (1/K) A(-p0 a - 2 b M) + (2/K) x A(b)``.
    """
    who = "local_contrast_norm"
    plan = _plan(x, kw, kh, edge, who)
    _check_g(g, x, who)
    k = kw * kh
    xa, ga = widen(x), widen(g)
    mean, raw = _contrast_terms(xa, kw, kh, plan)
    base = delta + alpha * raw.clamp_min(0.0)
    a = ps * ga * _power(base, -beta)
    b = (-ps * alpha * beta) * ga * (xa - p0 * mean) * _power(base, -beta - 1.0)
    b = torch.where(raw > 0, b, 0.0)  # the clamp's derivative: 0 where it holds VAR at 0
    through_mean = _window_sum_extract_adjoint(-p0 * a - 2.0 * b * mean, kw, kh, plan)
    through_square = _window_sum_extract_adjoint(b, kw, kh, plan)
    dx = a + through_mean / k + (2.0 / k) * xa * through_square
    return dx.to(g.dtype)
