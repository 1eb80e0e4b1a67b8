"""Group and instance normalization math: forward and exact gradient.

Layouts: ``x`` is (N, C, H, W); its C channels form ``G`` groups of ``C / G`` consecutive
channels (instance normalization is ``G = C``). Per image ``n`` and group ``g`` the statistics
run over the group's ``m = (C / G) · H · W`` values::

    mean = (1/m) Σ x                      var = (1/m) Σ (x - mean)^2      (biased)
    r    = (var + eps)^(-1/2)             xhat = (x - mean) · r
    y[c] = gamma[c] · xhat[c] + beta[c]   (gamma, beta per channel; beta None means 0)

Statistics are computed in the accumulation dtype (`acc_dtype`: float32 for float16/bfloat16
and float32 storage, float64 for float64) in two passes (the mean, then the mean of squared
deviations), so a group of mean 1e4 and standard deviation 1 keeps full precision. The mean of
the first pass is only a pivot: ``x - pivot`` is exact in floating point when the values lie
near the pivot, and the mean of those differences (the pivot's own rounding error, up to half
an ulp of 1e4 in float32, which would otherwise bias every ``xhat`` by ~5e-4) is removed
before the deviations are squared. The gradient recentres the same way around the mean it is
given.

A group whose ``var + eps`` is 0 (constant values with ``eps = 0``) has no derivative; it is
given ``r = 0`` (``xhat = 0``, ``y = beta``, zero gradient to ``x``) instead of NaN. With
``eps > 0`` a constant group is regular: ``xhat = 0`` and the formulas below apply as they are.
"""

from __future__ import annotations

import torch

from mpsnn.ops._dtypes import acc_dtype

__all__ = ["group_norm_backward", "group_norm_forward"]


def _check(x: torch.Tensor, groups: int) -> None:
    if x.dim() != 4:
        raise ValueError(f"[group_norm] x must be (N, C, H, W), got shape {tuple(x.shape)}")
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"[group_norm] groups must be a positive int, got {groups!r}")
    if x.shape[1] % groups:
        raise ValueError(f"[group_norm] groups ({groups}) must divide channels ({x.shape[1]})")


def _per_channel(
    v: torch.Tensor | None, c: int, dtype: torch.dtype, device: torch.device, what: str
) -> torch.Tensor | None:
    """``v`` (C,) as a (1, C, 1) tensor in the accumulation dtype, broadcastable over (N, C, HW)."""
    if v is None:
        return None
    if tuple(v.shape) != (c,):
        raise ValueError(f"[group_norm] {what} must have shape ({c},), got {tuple(v.shape)}")
    return v.to(device=device, dtype=dtype).view(1, c, 1)


def _centred(xg: torch.Tensor, pivot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x - mean, mean - pivot)`` for groups ``xg`` (N, G, m) around ``pivot`` (N, G).

    ``xg - pivot`` loses nothing when the pivot is close to the values; the residual mean of
    those differences is what the pivot misses of the true mean, and subtracting it leaves
    deviations accurate to the dtype's precision relative to the spread, not to the mean.
    """
    d = xg - pivot.unsqueeze(-1)
    resid = d.mean(-1, keepdim=True)
    return d - resid, resid.squeeze(-1)


def _rstd(var: torch.Tensor, eps: float) -> torch.Tensor:
    """``(var + eps)^(-1/2)``, and 0 where ``var + eps = 0`` (no derivative there: see above)."""
    ve = var + eps
    return torch.where(ve > 0, torch.rsqrt(ve), 0.0)


def group_norm_forward(
    x: torch.Tensor,
    groups: int,
    gamma: torch.Tensor | None,
    beta: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group normalization of ``x`` (N, C, H, W) with ``groups`` groups (module docstring).

    Args:
        gamma: (C,) float32/float64 scale per channel (None: 1).
        beta: (C,) float32/float64 shift per channel (None: 0).

    Returns:
        ``(y, mean, var)``: ``y`` (N, C, H, W) in ``x``'s dtype; ``mean`` and the biased ``var``
        (N, G) in the accumulation dtype of ``x`` (float32, or float64 for float64).
    """
    _check(x, groups)
    n, c, h, w = x.shape
    acc = acc_dtype(x.dtype)
    xg = x.to(acc).reshape(n, groups, (c // groups) * h * w)
    pivot = xg.mean(-1)
    dev, resid = _centred(xg, pivot)
    mean = pivot + resid
    var = (dev * dev).mean(-1)
    y = (dev * _rstd(var, eps).unsqueeze(-1)).reshape(n, c, h * w)
    gam = _per_channel(gamma, c, acc, x.device, "gamma")
    bet = _per_channel(beta, c, acc, x.device, "beta")
    if gam is not None:
        y = y * gam
    if bet is not None:
        y = y + bet
    return y.reshape(x.shape).to(x.dtype), mean, var


def group_norm_backward(
    g: torch.Tensor,
    x: torch.Tensor,
    groups: int,
    mean: torch.Tensor,
    var: torch.Tensor,
    gamma: torch.Tensor | None,
    eps: float,
    per_image: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact vector-Jacobian product of `group_norm_forward` for the cotangent ``g``.

    Args:
        g: (N, C, H, W) gradient of the loss with respect to ``y``.
        x: (N, C, H, W) the forward's input.
        mean, var: (N, G) the forward's statistics of ``x`` (``mean`` is used as the pivot of
            the recentring described in the module docstring; ``var`` is used as it is).
        gamma: (C,) the forward's scale (None: 1).
        per_image: keep ``dgamma`` and ``dbeta`` per image, (N, C), instead of summed.

    Returns:
        ``(dx, dgamma, dbeta)``: ``dx`` (N, C, H, W) in ``g``'s dtype; ``dgamma`` and ``dbeta``
        (C,) summed over the batch and the pixels (``per_image``: (N, C), summed over the
        pixels of each image), in the accumulation dtype of ``x``.

    Derivation, for one group of ``m`` values ``x_i`` (channel ``c(i)``), ``mu = mean``,
    ``r = (var + eps)^(-1/2)``, ``xhat_i = (x_i - mu) r``, ``y_i = gamma_c(i) xhat_i + beta_c(i)``:

    * ``d mu / d x_j = 1/m``; ``d var / d x_j = (2/m)(x_j - mu)`` (the term through ``mu``
      vanishes because ``Σ_i (x_i - mu) = 0``); so ``d r / d x_j = -r^3 (x_j - mu) / m``.
    * ``d xhat_i / d x_j = r (δ_ij - 1/m) - (x_i - mu) r^3 (x_j - mu) / m
      = r (δ_ij - 1/m - xhat_i xhat_j / m)``.
    * With ``dxhat_i = g_i gamma_c(i)`` (``d y_i / d xhat_i``; the statistics do not involve
      gamma), ``dx_j = Σ_i dxhat_i d xhat_i / d x_j
      = r (dxhat_j - mean_i(dxhat_i) - xhat_j mean_i(dxhat_i xhat_i))``, means over the group.
    * ``dgamma_c = Σ_{n, pixels} g xhat``, ``dbeta_c = Σ_{n, pixels} g``.

    gamma must enter through ``dxhat`` inside the group means: the shorthand
    ``gamma_c · r (g - mean(g) - xhat mean(g xhat))`` is the same only when gamma is constant
    within the group (always true for instance normalization, not for groups of several
    channels with different scales).
    """
    _check(x, groups)
    n, c, h, w = x.shape
    if tuple(g.shape) != tuple(x.shape):
        raise ValueError(f"[group_norm] g shape {tuple(g.shape)} != x shape {tuple(x.shape)}")
    acc = acc_dtype(x.dtype)
    m = (c // groups) * h * w
    dev, _ = _centred(x.to(acc).reshape(n, groups, m), mean.to(acc))
    r = _rstd(var.to(acc), eps).unsqueeze(-1)
    xhat = dev * r  # (N, G, m)
    gc = g.to(acc).reshape(n, c, h * w)
    dims = 2 if per_image else (0, 2)
    dbeta = gc.sum(dims)
    dgamma = (gc * xhat.reshape(n, c, h * w)).sum(dims)
    gam = _per_channel(gamma, c, acc, x.device, "gamma")
    dxhat = (gc if gam is None else gc * gam).reshape(n, groups, m)
    inner = dxhat - dxhat.mean(-1, keepdim=True) - xhat * (dxhat * xhat).mean(-1, keepdim=True)
    dx = r * inner
    return dx.reshape(x.shape).to(g.dtype), dgamma, dbeta
