"""Batch-normalization math: statistics, normalization (+ neuron), and the gradient.

Layout: ``x`` is (N, C, H, W); every statistic is per feature channel ``c`` over the
``m = N H W`` elements of the channel (one batch, possibly seen as several sub-batches).
Per-channel tensors (``mean``, ``var``, ``gamma``, ``beta``, sums) are (C,) in the accumulation
dtype: float32, float64 for float64 data (`mpsnn.ops._dtypes.acc_dtype`).

**Statistics.** A sub-batch is summarized by a Chan-mergeable triple: ``count`` (its number of
elements per channel, a (1,) or (C,) float tensor), ``mean[c]`` and ``m2[c] = Σ (x - mean)²``.
The triple of one sub-batch is computed precisely: each channel is shifted by one of its own
samples (``x[0, c, 0, 0]``, so that ``x - shift`` is exact for float16/bfloat16 data and small
for data far from 0), then a two-pass mean and sum of squared deviations is taken in the
accumulation dtype. A channel of mean 1e4 and standard deviation 1 keeps its variance to
float32 rounding, where the one-pass ``Σx² - (Σx)²/m`` would lose it entirely. Triples merge
with Chan et al.'s update (`bn_merge`)::

    n = na + nb,  d = mb - ma,  mean = ma + d nb / n,  m2 = m2a + m2b + d² na nb / n

which is exact when ``na = 0`` (the first merge stores the second triple). Normalization uses
the biased variance ``var = m2 / n``; running statistics use the unbiased ``m2 / (n - 1)``
(`bn_variance`).

**Forward.** With ``s = 1 / sqrt(var + eps)`` (0 where ``var + eps <= 0``: a constant channel
with ``eps = 0`` maps to ``f(beta)`` instead of NaN) and ``a = gamma s``::

    xhat = (x - mean) s,   z = (x - mean) a + beta  (= gamma xhat + beta),   y = f(z)

``x - mean`` is formed first: folding the mean into an offset (``z = x a + (beta - mean a)``)
cancels catastrophically when ``|mean| >> std``.

**Gradient.** With ``g = dL/dy`` and ``gy = dL/dz = g f'(z)`` (``g`` itself with no neuron),
``z = gamma xhat + beta`` gives ``dL/dbeta = Σ gy`` and ``dL/dgamma = Σ gy xhat``
(`bn_gradient_sums`; summed over the whole batch, and over sub-batches by plain addition), and
``dL/dxhat = gamma gy``. The whole batch's statistics depend on every ``x_j`` of the channel:
``dmean/dx_j = 1/m`` and, since ``Σ (x_i - mean) = 0``, ``dvar/dx_j = 2 (x_j - mean) / m``, so
``ds/dx_j = -s³ (x_j - mean) / m`` and::

    dxhat_i/dx_j = s (δ_ij - 1/m) + (x_i - mean) ds/dx_j = s (δ_ij - 1/m - xhat_i xhat_j / m)

Summing ``gamma gy_i dxhat_i/dx_j`` over ``i`` (`bn_backward`)::

    dx_j = gamma s (gy_j - Σ gy / m - xhat_j Σ gy xhat / m)

which holds for a sub-batch's ``x_j`` too, given the whole batch's sums and ``m``.

Data in float16/bfloat16 are computed in float32 and rounded once at the end. Each public
function runs the Triton fast path where `mpsnn.ops.triton.batch_norm_eligible` says so
(CUDA, float16/bfloat16/float32, no neuron or ReLU), else the portable ``*_portable`` code;
``bn_forward`` and ``bn_backward`` give the same bits on both paths (same operations in the same
order, each rounded once), the reductions the same values up to summation order. The
normalization's per-channel arguments (``mean``, ``var``, ``gamma``, ``beta``, ``eps``, the
neuron) come as one `mpsnn.ops.batch_norm_params.BatchNormParams`, the input gradient's sums
and count as one `mpsnn.ops.batch_norm_params.BatchNormSums`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpsnn.ops import triton as fast_paths
from mpsnn.ops._dtypes import acc_dtype
from mpsnn.ops._functorch import under_transform
from mpsnn.ops.batch_norm_params import BatchNormParams, BatchNormSums, RunningUpdate
from mpsnn.ops.neuron import NeuronParams, activation, activation_backward, plain_relu

__all__ = [
    "bn_backward",
    "bn_backward_portable",
    "bn_forward",
    "bn_forward_portable",
    "bn_gradient_sums",
    "bn_gradient_sums_portable",
    "bn_merge",
    "bn_merge_all",
    "bn_merge_rows",
    "bn_running_update",
    "bn_running_update_portable",
    "bn_running_updates",
    "bn_statistics",
    "bn_statistics_and_variance",
    "bn_statistics_portable",
    "bn_variance",
]

_NONE, _RELU = 0, 1  # neuron type codes (`mpsnn.ops.neuron`) with their own fast formulas
_DIMS = (0, 2, 3)  # the reduced axes of (N, C, H, W)


# -- checks and small helpers ---------------------------------------------------------------


def _check_source(what: str, x: torch.Tensor, g: torch.Tensor | None = None) -> None:
    if x.dim() != 4:
        raise ValueError(f"[{what}] x must be (N, C, H, W), got shape {tuple(x.shape)}")
    if g is not None and g.shape != x.shape:
        raise ValueError(f"[{what}] g must have x's shape {tuple(x.shape)}, got {tuple(g.shape)}")


def _check_params(what: str, x: torch.Tensor, p: BatchNormParams, **more: torch.Tensor) -> None:
    """Every per-channel tensor of ``p`` (and ``more``) is (C,) for ``x``'s C channels."""
    c = (x.shape[1],)
    if (  # the common case in one test (every command of a normalization layer asks)
        p.mean.shape == c and p.var.shape == c and p.gamma.shape == c and p.beta.shape == c
        and all(t.shape == c for t in more.values())
    ):  # fmt: skip
        return
    tensors = {"mean": p.mean, "var": p.var, "gamma": p.gamma, "beta": p.beta, **more}
    for name, t in tensors.items():
        if t.shape != c:
            raise ValueError(f"[{what}] {name} must be ({c[0]},), got shape {tuple(t.shape)}")


def _col(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A (C,) tensor shaped (1, C, 1, 1) in ``dtype``, to broadcast over (N, C, H, W)."""
    return t.to(dtype).view(1, -1, 1, 1)


def _minus(x: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """``x.to(col.dtype) - col`` as one new tensor (a half-precision ``x`` is widened inside the
    subtraction: exactly, the bits of the conversion followed by it).

    The portable passes make the temporaries they need and update them in place, each
    operation the one the formulas name, in their order and in the layout a new tensor would
    have (so the same bits, the sums' order included): on the CPU a fresh tensor of a layer's
    size costs about as much as a pass over it (the allocator maps and zero-fills new pages for
    it), so fewer of them is most of the speed."""
    return torch.sub(x, col)


def _reuse(xc: torch.Tensor, inv: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``xc``'s memory for ``z`` once ``xhat = xc inv`` is made (xc is not read again), or a
    copy where autograd saved ``xc`` for that product's gradient (reverse mode through the
    gradient passes: a gradient penalty) and must find it unchanged; ``xc`` itself where
    ``z`` is not made in place (``in_place`` False: nothing writes it)."""
    if in_place and torch.is_grad_enabled() and (xc.requires_grad or inv.requires_grad):
        return xc.clone()
    return xc


def _mul(a: torch.Tensor, b: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``a * b``, in ``a``'s memory when ``in_place`` (``a`` is a temporary of the pass)."""
    return a.mul_(b) if in_place else a * b


def _add(a: torch.Tensor, b: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``a + b``, in ``a``'s memory when ``in_place``."""
    return a.add_(b) if in_place else a + b


def _sub(a: torch.Tensor, b: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``a - b``, in ``a``'s memory when ``in_place``."""
    return a.sub_(b) if in_place else a - b


def _sqrt_rn(v: torch.Tensor) -> torch.Tensor:
    """``sqrt(v)`` correctly rounded. CUDA's float32 square root is; PyTorch's vectorized CPU
    one can be one unit in the last place off, so on the CPU a float32 ``v`` is rooted in
    float64 and rounded once to float32: correctly rounded, since float64 carries more than
    twice float32's 24 bits plus two (the square root's double rounding is then innocuous;
    checked over every float32 bit pattern). ``sqrt(inf)`` is inf and ``sqrt(-0.0)`` is -0.0,
    as on CUDA."""
    if v.dtype != torch.float32 or v.device.type != "cpu":
        return torch.sqrt(v)
    return torch.sqrt(v.double()).to(torch.float32)


def _inv_std(var: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(var + eps)`` (correctly rounded square root, then division), 0 where
    ``var + eps <= 0`` (and, through the division, where it is +inf). The Triton kernels
    compute the same operations in the same order."""
    v = var + eps
    pos = v > 0
    return torch.where(pos, 1.0 / _sqrt_rn(torch.where(pos, v, 1.0)), 0.0)


def _neuron_gradient(neuron: NeuronParams | None, g: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``g f'(z)``. ReLU selects ``g`` or ``g a`` (exact, as the Triton kernels do); other
    neurons multiply by their slope (`mpsnn.ops.neuron.activation_backward`)."""
    if neuron is None or neuron.kind == _NONE:
        return g
    if neuron.kind == _RELU and not plain_relu(neuron, z):
        return torch.where(z >= 0, g, g * neuron.a)
    # the plain ReLU: ``(z >= 0) g`` through a 1.0/0.0 mask, the bits of the select above
    # (``0.0 g = g 0.0``) in vectorized passes (PyTorch's three-tensor ``where`` is not)
    return activation_backward(neuron, g, z)


# -- statistics -----------------------------------------------------------------------------


def bn_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(count, mean, m2)`` of the sub-batch ``x`` (N, C, H, W), per channel.

    ``count``: (1,), the ``N H W`` elements of each channel; ``mean``, ``m2 = Σ (x - mean)²``:
    (C,). All in the accumulation dtype (float32; float64 for float64 data), on ``x``'s device.
    Shifted two-pass scheme (see the module docstring); an empty ``x`` gives count 0 and zeros.
    """
    _check_source("bn_statistics", x)
    fast = fast_paths.batch_norm_statistics(x)
    if fast is None:
        return bn_statistics_portable(x)
    count, mean, m2 = fast
    return count, mean, m2


def bn_statistics_and_variance(
    x: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`bn_statistics` of ``x`` and the biased variance of the result (`bn_variance`), made by
    one piece of work: on the Triton path the kernel that combines the statistics also writes
    the variance (the same bits as `bn_variance` of them)."""
    _check_source("bn_statistics", x)
    fast = fast_paths.batch_norm_statistics(x, variance=True)
    if fast is not None:
        count, mean, m2, var = fast
        return count, mean, m2, var
    count, mean, m2 = bn_statistics_portable(x)
    return count, mean, m2, bn_variance(count, m2)


def bn_statistics_portable(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`bn_statistics` in PyTorch operations (any device)."""
    _check_source("bn_statistics", x)
    ct = acc_dtype(x.dtype)
    c = x.shape[1]
    m = x.numel() // c if c else 0
    count = torch.full((1,), float(m), dtype=ct, device=x.device)
    if m == 0:
        zeros = torch.zeros(c, dtype=ct, device=x.device)
        return count, zeros, zeros.clone()
    # Shift by a sample of each channel: exact for half types widened to float32, and it keeps
    # the sums small for data far from 0. Then the two-pass mean and squared deviations.
    shift = x[:1, :, :1, :1].to(ct)
    d = _minus(x, shift)
    dm = d.mean(dim=_DIMS, keepdim=True)
    own = not under_transform()  # temporaries updated in place (`mpsnn.ops._functorch`)
    d = _sub(d, dm, own)
    # squared in place outside a transform (the bits of d * d; mul_(d) would differentiate
    # wrongly in forward mode)
    m2 = (d.square_() if own else d.square()).sum(dim=_DIMS)
    return count, (shift + dm).view(c), m2


def bn_merge(acc: list[torch.Tensor], new: Sequence[torch.Tensor]) -> None:
    """Merge the triple ``new = (count, mean, m2)`` into ``acc = [count, mean, m2]``.

    Chan et al.'s pairwise update (module docstring), per channel, with counts of shape (1,) or
    (C,). Where ``acc``'s count is 0 the result is ``new`` exactly (whatever ``acc``'s mean and
    m2 hold, NaN included); where ``new``'s count is 0, ``acc`` is kept. The merge is
    commutative up to rounding, so the order of sub-batches does not matter beyond it.
    ``acc``'s tensors are written in place; an entry is replaced instead where the result's
    shape differs (a (1,) count merged with a (C,) count) or ``acc`` holds it in another dtype.
    Runs on the device with no host synchronization.
    """
    if len(acc) != 3 or len(new) != 3:
        raise ValueError(
            f"[bn_merge] acc and new must be (count, mean, m2), got {len(acc)} and {len(new)}"
        )
    na, ma, qa = acc
    nb, mb, qb = (t.to(device=ma.device, dtype=ma.dtype) for t in new)
    na = na.to(ma.dtype)
    n = na + nb
    w = nb / torch.where(n > 0, n, 1.0)  # weight of the new part
    d = mb - ma
    mean = torch.where(na > 0, torch.where(nb > 0, ma + d * w, ma), mb)
    m2 = torch.where(na > 0, torch.where(nb > 0, qa + qb + d * d * na * w, qa), qb)
    for i, value in enumerate((n, mean, m2)):
        if acc[i].shape == value.shape and acc[i].dtype == value.dtype:
            acc[i].copy_(value)
        else:
            acc[i] = value


def bn_merge_all(
    count: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge ``W`` triples at once: rows ``r`` of ``count`` (W, C) or (W, 1), ``mean`` and
    ``m2`` (W, C) summarize disjoint parts of one batch (e.g. the ranks of a data-parallel
    step); returns the whole batch's ``(count, mean, m2)``, each (C,).

    The closed form of W pairwise merges (`bn_merge` in row order gives the same up to
    rounding)::

        n = Σ n_r,   mean = Σ n_r mean_r / n,   m2 = Σ m2_r + Σ n_r (mean_r - mean)²

    In a few kernels whatever W is, where the pairwise form takes W - 1 merges of a dozen
    kernels each (on the critical path of a synchronized batch normalization). Rows with
    ``n_r = 0`` contribute nothing (their mean and m2 are ignored, NaN included); a channel
    with ``n = 0`` gets mean and m2 0.
    """
    if mean.dim() != 2 or m2.shape != mean.shape or count.dim() != 2:
        raise ValueError(
            "[bn_merge_all] mean and m2 must be (W, C) and count (W, C) or (W, 1), got "
            f"{tuple(count.shape)}, {tuple(mean.shape)}, {tuple(m2.shape)}"
        )
    if count.shape[0] != mean.shape[0] or count.shape[1] not in (1, mean.shape[1]):
        raise ValueError(
            f"[bn_merge_all] count must be (W, C) or (W, 1) for mean {tuple(mean.shape)}, "
            f"got {tuple(count.shape)}"
        )
    nr = count.to(mean.dtype).expand_as(mean)
    present = nr > 0
    n = nr.sum(0)
    safe = torch.where(n > 0, n, 1.0)
    mean_all = torch.where(present, nr * mean, 0.0).sum(0) / safe
    d = mean - mean_all
    m2_all = torch.where(present, m2 + nr * d * d, 0.0).sum(0)
    return n, mean_all, m2_all


def bn_merge_rows(
    rows: torch.Tensor, into: Sequence[torch.Tensor], var: torch.Tensor | None = None
) -> torch.Tensor:
    """Merge the statistics of ``W`` disjoint parts of one batch, packed one per row of
    ``rows`` (W, k + 2C) as ``[count (k = 1 or C), mean (C), m2 (C)]`` (what a data-parallel
    all-gather of each process's sums returns), into ``into = (count, mean, m2)`` in place
    (`bn_merge_all`'s closed form); returns the biased variance of the result (`bn_variance`'s
    bits of the written ``count`` and ``m2``), written into ``var`` when given.

    On CUDA one Triton launch, merging in float64; elsewhere `bn_merge_all` in the sums' dtype,
    then copies and the division."""
    if len(into) != 3:
        raise ValueError(f"[bn_merge_rows] into must be (count, mean, m2), got {len(into)} tensors")
    count, mean, m2 = into
    c = mean.numel()
    if mean.dim() != 1 or m2.shape != mean.shape or count.numel() not in (1, c):
        raise ValueError(
            f"[bn_merge_rows] into must be (count (1 or C), mean (C,), m2 (C,)), got shapes "
            f"{[tuple(t.shape) for t in into]}"
        )
    if rows.dim() != 2 or rows.shape[1] != count.numel() + 2 * c:
        raise ValueError(
            f"[bn_merge_rows] rows must be (W, k + 2C) for into = (count (k,), mean (C,), m2 "
            f"(C,)), got {tuple(rows.shape)} for {[tuple(t.shape) for t in into]}"
        )
    fast = fast_paths.batch_norm_merge_rows(rows, (count, mean, m2), var)
    if fast is not None:
        return fast
    k, c = count.numel(), mean.numel()
    n, mean_all, m2_all = bn_merge_all(rows[:, :k], rows[:, k : k + c], rows[:, k + c :])
    for dst, src in zip(into, (n[:k], mean_all, m2_all), strict=True):
        dst.copy_(src.reshape(dst.shape))
    result = bn_variance(count, m2)
    return result if var is None else var.copy_(result)


def bn_variance(count: torch.Tensor, m2: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """``m2 / count`` (biased, what normalization uses) or ``m2 / (count - 1)`` (unbiased, for
    running statistics). A divisor below 1 counts as 1: a single sample (``m2 = 0``) or an
    empty batch gives variance 0, not inf or NaN. Shape: ``m2``'s (C,)."""
    n = count - 1 if unbiased else count
    return m2 / n.to(m2.dtype).clamp(min=1.0)


def bn_running_update(
    running: tuple[torch.Tensor, torch.Tensor],
    count: torch.Tensor,
    mean: torch.Tensor,
    m2: torch.Tensor,
    momentum: float,
) -> None:
    """Blend a batch's statistics into running ones, in place::

        running_mean = (1 - momentum) running_mean + momentum mean
        running_var = (1 - momentum) running_var + momentum m2 / max(count - 1, 1)

    (the unbiased variance, `bn_variance`). ``running``: the (C,) mean and variance; ``count``
    (1,) or (C,). One launch on the Triton path, with the portable path's bits."""
    bn_running_updates((RunningUpdate(running, count, mean, m2, momentum),))


def bn_running_updates(updates: Sequence[RunningUpdate]) -> None:
    """`bn_running_update` of each of ``updates``, as if one after the other in list order (an
    update of running tensors an earlier one wrote reads its result). On the Triton path one
    launch updates up to 32 layers; a layer listed twice runs in a later launch. Each layer
    gets the bits of its own `bn_running_update_portable`."""
    if not updates or fast_paths.batch_norm_running_updates(updates):
        return
    for u in updates:
        bn_running_update_portable(u.running, u.count, u.mean, u.m2, u.momentum)


def bn_running_update_portable(
    running: tuple[torch.Tensor, torch.Tensor],
    count: torch.Tensor,
    mean: torch.Tensor,
    m2: torch.Tensor,
    momentum: float,
) -> None:
    """`bn_running_update` in PyTorch operations (any device and dtype)."""
    mu, var = running
    unbiased = bn_variance(count, m2, unbiased=True)
    # both vectors in one launch each on a GPU
    torch._foreach_mul_([mu, var], 1 - momentum)
    torch._foreach_add_([mu, var], [mean.to(mu.dtype), unbiased.to(var.dtype)], alpha=momentum)


# -- forward --------------------------------------------------------------------------------


def bn_forward(x: torch.Tensor, p: BatchNormParams) -> torch.Tensor:
    """``y = f((x - mean) gamma / sqrt(var + eps) + beta)`` in ``x``'s dtype, (N, C, H, W).

    ``p``: the (C,) ``mean``, ``var`` (biased), ``gamma``, ``beta`` on ``x``'s device, ``eps``
    and the neuron ``f`` (`mpsnn.ops.neuron.activation`), or none. Computed in float32 for half
    types.
    """
    _check_source("bn_forward", x)
    _check_params("bn_forward", x, p)
    fast = fast_paths.batch_norm_forward(x, p)
    return fast if fast is not None else bn_forward_portable(x, p)


def bn_forward_portable(x: torch.Tensor, p: BatchNormParams) -> torch.Tensor:
    """`bn_forward` in PyTorch operations (any device, any neuron)."""
    ct = acc_dtype(x.dtype)
    inv = _inv_std(p.var.to(ct), p.eps)
    a = p.gamma.to(ct) * inv
    own = not under_transform()  # temporaries updated in place (`mpsnn.ops._functorch`)
    z = _add(_mul(_minus(x, _col(p.mean, ct)), _col(a, ct), own), _col(p.beta, ct), own)
    if p.neuron is not None:
        z = activation(p.neuron, z)
    return z.to(x.dtype)


# -- gradient -------------------------------------------------------------------------------


def bn_gradient_sums(
    g: torch.Tensor, x: torch.Tensor, p: BatchNormParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ gy, Σ gy xhat)`` per channel over this sub-batch: ``dL/dbeta`` and ``dL/dgamma``.

    ``g = dL/dy`` and ``x``: (N, C, H, W); ``gy = g f'(z)`` with ``z`` and ``xhat`` recomputed
    from ``x`` and ``p`` (the whole batch's ``mean`` and biased ``var``). The sums of several
    sub-batches add up to the whole batch's. Returns two (C,) tensors in the accumulation dtype.
    """
    _check_source("bn_gradient_sums", x, g)
    _check_params("bn_gradient_sums", x, p)
    fast = fast_paths.batch_norm_gradient_sums(g, x, p)
    return fast if fast is not None else bn_gradient_sums_portable(g, x, p)


def bn_gradient_sums_portable(
    g: torch.Tensor, x: torch.Tensor, p: BatchNormParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """`bn_gradient_sums` in PyTorch operations (any device, any neuron)."""
    ct = acc_dtype(x.dtype)
    inv = _inv_std(p.var.to(ct), p.eps)
    own = not under_transform()  # temporaries updated in place (`mpsnn.ops._functorch`)
    xc = _minus(x, _col(p.mean, ct))
    xhat = xc * _col(inv, ct)
    if p.neuron is not None:
        a = _col(p.gamma.to(ct) * inv, ct)
        z = _add(_mul(_reuse(xc, inv, own), a, own), _col(p.beta, ct), own)
        gy = _neuron_gradient(p.neuron, g.to(ct), z)
    else:
        gy = g.to(ct)  # (``g`` itself when it is in ``ct``: never written)
    # in xhat's memory only where it has gy's layout: the product's layout orders the sum
    gy_xhat = xhat.mul_(gy) if own and xhat.stride() == gy.stride() else gy * xhat
    return gy.sum(dim=_DIMS), gy_xhat.sum(dim=_DIMS)


def bn_backward(
    g: torch.Tensor, x: torch.Tensor, p: BatchNormParams, sums: BatchNormSums
) -> torch.Tensor:
    """``dL/dx = gamma s (gy - Σ gy / m - xhat Σ gy xhat / m)`` in ``x``'s dtype, (N, C, H, W).

    ``g``, ``x``: this sub-batch; ``p`` (``mean``, biased ``var``) and ``sums`` (``Σ gy``,
    ``Σ gy xhat`` and ``count = m``): the whole batch's. Derivation in the module docstring.
    Per element, in this order::

        xc = x - mean, xhat = xc s, gy = g f'(xc a + beta),
        dx = ((gy - Σgy/m) - xhat (Σgy xhat/m)) a
    """
    _check_source("bn_backward", x, g)
    _check_params("bn_backward", x, p, sum_gy=sums.sum_gy, sum_gy_xhat=sums.sum_gy_xhat)
    fast = fast_paths.batch_norm_backward(g, x, p, sums)
    return fast if fast is not None else bn_backward_portable(g, x, p, sums)


def bn_backward_portable(
    g: torch.Tensor, x: torch.Tensor, p: BatchNormParams, sums: BatchNormSums
) -> torch.Tensor:
    """`bn_backward` in PyTorch operations (any device, any neuron)."""
    ct = acc_dtype(x.dtype)
    m = torch.as_tensor(sums.count, dtype=ct, device=x.device)
    inv = _inv_std(p.var.to(ct), p.eps)
    a = p.gamma.to(ct) * inv
    mean_gy = sums.sum_gy.to(ct) / m
    mean_gy_xhat = sums.sum_gy_xhat.to(ct) / m
    own = not under_transform()  # temporaries updated in place (`mpsnn.ops._functorch`)
    xc = _minus(x, _col(p.mean, ct))
    xhat = xc * _col(inv, ct)
    if p.neuron is not None:
        z = _add(_mul(_reuse(xc, inv, own), _col(a, ct), own), _col(p.beta, ct), own)
        gy = _neuron_gradient(p.neuron, g.to(ct), z)
    else:
        gy = g.to(ct)  # (``g`` itself when it is in ``ct``: never written)
    # gy is a new tensor of ours (a widened g, or the neuron's product) unless it is g itself:
    # decided from the dtypes and the neuron (under torch.func a widened view can be a new
    # object sharing g's memory), then it becomes t in place
    fresh = g.dtype != ct or (p.neuron is not None and p.neuron.kind != _NONE)
    t = _sub(gy, _col(mean_gy, ct), own and fresh)
    t = _sub(t, _mul(xhat, _col(mean_gy_xhat, ct), own), own)
    return _mul(t, _col(a, ct), own).to(x.dtype)
