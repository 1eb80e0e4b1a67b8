"""Loss math of MPS's ``MPSCNNLoss``: the loss image and the gradient of its sum, in one call.

Notation: ``y`` predictions (N, C, H, W); ``t`` labels, of which only the first C channels take
part (a label image may be wider: channels ``>= C`` are never read into the math); ``w``
optional per-element weights (same rule for channels); ``weight`` the descriptor's scalar
weight; ``ls`` label smoothing; ``K`` the number of classes (None: C); ``eps``; ``delta``.

Per-element types (one loss value per element of ``y``), with ``l`` the loss and ``dl/dy``:

* MEAN_ABSOLUTE_ERROR: ``l = |y - t|``; ``dl/dy = sign(y - t)`` (0 at ``y = t``).
* MEAN_SQUARED_ERROR: ``l = (y - t)^2``; ``dl/dy = 2 (y - t)``.
* SIGMOID_CROSS_ENTROPY (``y`` logits): with ``t' = (1 - ls) t + ls / 2``,
  ``l = max(y, 0) - y t' + log(1 + e^-|y|)``, the overflow-free form of
  ``-t' log s - (1 - t') log(1 - s)``, ``s = sigmoid(y)``. For ``y >= 0`` the derivative is
  ``1 - t' - e^-y / (1 + e^-y) = 1 - t' - (1 - s) = s - t'``; for ``y < 0`` it is
  ``-t' + e^y / (1 + e^y) = s - t'``: ``dl/dy = sigmoid(y) - t'``.
* HINGE: labels 0/1 become ``t~ = 2 t - 1``; ``m = 1 - t~ y``, ``l = max(m, 0)``;
  ``dl/dy = -t~`` where ``m > 0``, 0 elsewhere (the kink ``m = 0`` takes 0).
* HUBER: ``r = y - t``; ``l = r^2 / 2`` where ``|r| <= delta``, else
  ``delta (|r| - delta / 2)``; ``dl/dy = r`` inside, ``delta sign(r)`` outside (the two
  pieces meet with equal value and slope at ``|r| = delta``). MPS's documentation writes the
  inside piece as ``y^2 / 2``, which ignores the label: the residual is used here.
* LOG (``y`` probabilities): ``l = -t log(y + eps) - (1 - t) log(1 - y + eps)``;
  ``dl/dy = -t / (y + eps) + (1 - t) / (1 - y + eps)``, finite at ``y = 0`` and ``y = 1``
  for ``eps > 0``. Predictions outside ``[-eps, 1 + eps]`` take the log of a negative number
  (NaN, as ``torch.log``): they are outside the loss's domain.
* KULLBACK_LEIBLER_DIVERGENCE (``y`` log-probabilities): ``l = t (log t - y)`` with
  ``0 log 0 = 0``; ``dl/dy = -t``. MPS's documentation gives ``-t / y``, the derivative for
  probability predictions ``t (log t - log y)``; with log-probability predictions the loss is
  linear in ``y``, so ``-t`` is the true derivative and is what is computed.

Per-pixel types (channels are classes or vector components; one loss value per pixel):

* SOFTMAX_CROSS_ENTROPY (``y`` logits): ``t'_c = (1 - ls) t_c + ls / K`` and, with
  per-channel weights, ``a_c = weight w_c t'_c``; ``l = -sum_c a_c log_softmax(y)_c``.
  Since ``d log_softmax(y)_c / dy_j = [c = j] - softmax(y)_j``,
  ``dl/dy_j = -a_j + softmax(y)_j sum_c a_c``. For unweighted labels summing to 1 this is
  ``softmax(y) - t'``; MPS's documentation writes ``y - t``, which is wrong (it is neither the
  derivative with respect to the logits nor with respect to the probabilities). The form used
  is exact for labels that do not sum to 1 too. ``log_softmax`` keeps logits of magnitude 1e4
  finite.
* CATEGORICAL_CROSS_ENTROPY (``y`` probabilities): ``a_c`` as above;
  ``l = -sum_c a_c log(max(y_c, eps))``; ``dl/dy_c = -a_c / y_c`` where ``y_c > eps`` and 0
  where the clamp holds (``y_c <= eps``): finite at ``y = 0`` and ``y = 1``.
* COSINE_DISTANCE: ``l = weight w_bar (1 - sum_c y_c t_c)`` (no normalization), where
  **w_bar is the mean of the pixel's C per-element weights** (1 without weights): one weight
  per pixel, so that a pixel whose weights are all equal to ``v`` is weighted by ``v``.
  ``dl/dy_c = -weight w_bar t_c``. Label smoothing does not apply.

Label smoothing applies to the two cross entropies and to SIGMOID_CROSS_ENTROPY only.

**Weights.** Per-element types: ``l_w = weight w l`` and ``d l_w / dy = weight w dl/dy``. The
cross entropies weight each class's term (``a_c`` above; a per-pixel weight, e.g. the (N, H, W)
weights allowed with class-index labels, is the same weight for every class). Cosine
distance: ``w_bar`` as above.

**Class-index labels** (int64 (N, H, W), cross entropies only): ``t`` is one-hot, built by a
scatter into the (N, C, H, W) class-term tensor ``a`` (no int64 one-hot). Indices must lie in
``[0, C)`` (there is no "ignore" index); a check on the host would wait for the device, so
they are checked on the device instead: an index is never used as an address outside the
tensors (the scatter takes it clamped into ``[0, C)``; the Triton pass only compares it), and
with ``index_bounds`` the call folds the indices' range into a small int64 tensor (made by
`new_index_bounds`; a running minimum and maximum, so one tensor can gather the range of many
calls), which `read_index_bounds` decodes once the work has completed (`mpsnn.cnn.loss.Loss`
turns a bad range into an error of its command buffer). A pixel with a bad index gets
meaningless values (those of the clamped index on the portable path, NaN on the Triton pass).

**CUDA fast path.** SOFTMAX_CROSS_ENTROPY with class indices, no weights, no label smoothing
and ``0 < weight <= float32 max`` on float16/bfloat16/float32 CUDA predictions runs as one
Triton kernel (`mpsnn.ops.triton.loss`): the same formulas, ``log_softmax`` within an ulp or so
of ATen's.

**Reductions**, per image ``n`` (a reduction never crosses images), ``S_n`` the sum of ``l_w``
over the image:

* NONE: the loss image is ``l_w``: (N, C, H, W) for per-element types, (N, 1, H, W) for
  per-pixel types.
* SUM: (N, 1, 1, 1) ``S_n``.
* MEAN: ``S_n / (C H W)`` for per-element types, ``S_n / (H W)`` for per-pixel types.
* SUM_BY_NON_ZERO_WEIGHTS: ``S_n / Z_n``, ``Z_n`` the number of weighting units with a non-zero
  per-element weight ``w`` (the scalar weight is not counted): elements for per-element types;
  pixels for the per-pixel types, a cross-entropy pixel counting when any of its C class
  weights is non-zero and a cosine-distance pixel when ``w_bar != 0``. Without ``w``, ``Z_n``
  is the number of units (C H W or H W), so all-one weights give MEAN. ``Z_n = 0`` gives loss 0
  and gradient 0: every ``l_w`` is then ``0 * l = 0`` and the divisor is taken as 1.

The gradient returned is ``d (sum_n loss_image[n]) / dy`` (for NONE, the derivative of the sum
of the loss image): ``d l_w / dy`` divided by the image's divisor (1, the unit count, or
``Z_n``), so it includes ``weight``, ``w``, and the reduction.

NaN and infinite inputs propagate to the loss and the gradient (a NaN prediction gives a NaN
gradient at that element, including for KULLBACK_LEIBLER_DIVERGENCE and COSINE_DISTANCE whose
gradient does not depend on ``y``); finite inputs inside a loss's domain give finite results.
Computation is in the accumulation dtype (float32 for float16/bfloat16 and float32, float64
for float64); the loss image comes back in that dtype, the gradient in ``y``'s dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from mpsnn.ops import triton as fast_paths
from mpsnn.ops._dtypes import acc_dtype

__all__ = [
    "LossParams",
    "loss_forward_backward",
    "new_index_bounds",
    "read_index_bounds",
    "MEAN_ABSOLUTE_ERROR",
    "MEAN_SQUARED_ERROR",
    "SOFTMAX_CROSS_ENTROPY",
    "SIGMOID_CROSS_ENTROPY",
    "CATEGORICAL_CROSS_ENTROPY",
    "HINGE",
    "HUBER",
    "COSINE_DISTANCE",
    "LOG",
    "KULLBACK_LEIBLER_DIVERGENCE",
    "NONE",
    "SUM",
    "MEAN",
    "SUM_BY_NON_ZERO_WEIGHTS",
]

# Loss type codes (MPS MPSCNNLossType values).
MEAN_ABSOLUTE_ERROR, MEAN_SQUARED_ERROR, SOFTMAX_CROSS_ENTROPY, SIGMOID_CROSS_ENTROPY = range(4)
CATEGORICAL_CROSS_ENTROPY, HINGE, HUBER, COSINE_DISTANCE, LOG = range(4, 9)
KULLBACK_LEIBLER_DIVERGENCE = 9
# Reduction codes (MPS MPSCNNReductionType values).
NONE, SUM, MEAN, SUM_BY_NON_ZERO_WEIGHTS = range(4)

_CROSS_ENTROPIES = frozenset({SOFTMAX_CROSS_ENTROPY, CATEGORICAL_CROSS_ENTROPY})
_PER_PIXEL = _CROSS_ENTROPIES | {COSINE_DISTANCE}


class LossParams(NamedTuple):
    """The descriptor's numbers. ``kind``/``reduction``: the codes above; ``weight``: the
    scalar weight; ``number_of_classes``: K in the label smoothing ``ls / K`` (None: C)."""

    kind: int
    reduction: int
    weight: float = 1.0
    label_smoothing: float = 0.0
    number_of_classes: int | None = None
    epsilon: float = 1e-7
    delta: float = 1.0


def loss_forward_backward(
    y: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    params: LossParams,
    *,
    index_bounds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss image, gradient) for predictions ``y`` (N, C, H, W): see the module docstring.

    ``labels``: float (N, Cl, H, W) with Cl >= C, or for the two cross entropies int64 class
    indices (N, H, W). ``weights``: None, or float with the labels' shape; with index labels
    (N, H, W) (one weight per pixel) or (N, Cw, H, W) with Cw >= C (one per class). Returns the
    loss image in the accumulation dtype and ``d sum(loss image) / dy`` in ``y``'s dtype.
    ``index_bounds``: with class-index labels, a `new_index_bounds` tensor on the labels'
    device into which their range is folded (decoded by `read_index_bounds` after the work
    ran: the range of every call that folded into it since it was made or reset).
    """
    kind, reduction = int(params.kind), int(params.reduction)
    _check(y, labels, weights, kind, reduction)
    if index_bounds is not None:
        _check_bounds(index_bounds, labels)
    if kind == SOFTMAX_CROSS_ENTROPY and weights is None:
        fused = _fused_softmax_cross_entropy(y, labels, params, reduction, index_bounds)
        if fused is not None:
            return fused
    if index_bounds is not None:
        _index_range(labels, index_bounds)
    _, c, h, w = y.shape
    acc = acc_dtype(y.dtype)
    yw = y.to(acc)
    # Per-element weights, channels >= C dropped; (N, H, W) pixel weights get a channel axis.
    wt = None
    if weights is not None:
        wt = (weights.unsqueeze(1) if weights.dim() == 3 else weights[:, :c]).to(acc)

    if kind in _PER_PIXEL:
        if kind == COSINE_DISTANCE:
            loss, grad, units, count = _cosine(yw, labels[:, :c].to(acc), wt, params.weight)
        else:
            a = _class_terms(labels, wt, params, c, yw)
            loss, grad = _cross_entropy(
                kind, yw, a, params.epsilon, _one_hot_sum(labels, wt, params, yw)
            )
            units, count = h * w, None
            if wt is not None:  # a pixel counts when any class weight is non-zero
                count = (wt != 0).any(1).sum((1, 2))
    else:
        loss, grad = _elementwise(kind, yw, labels[:, :c].to(acc), params)
        if wt is not None:
            scale = wt * params.weight if params.weight != 1 else wt
            loss, grad = loss * scale, grad * scale
        elif params.weight != 1:
            loss, grad = loss * params.weight, grad * params.weight
        units = c * h * w
        count = None if wt is None else (wt != 0).sum((1, 2, 3))

    if reduction != NONE:
        loss = loss.sum((1, 2, 3), keepdim=True)
        divisor = _divisor(reduction, units, count, acc)
        if not (isinstance(divisor, int) and divisor == 1):
            loss, grad = loss / divisor, grad / divisor
    return loss, grad.to(y.dtype)


_I64_MIN = -(2**63)


def _index_range(labels: torch.Tensor, out: torch.Tensor) -> None:
    """Fold ``(~min, max)`` of the class indices into ``out`` (running maxima, on the device,
    no wait); the first is stored complemented so that both are maxima, as the Triton pass
    computes them (``~k = -1 - k`` never overflows)."""
    if labels.numel() == 0:
        return  # an empty range changes nothing
    pair = torch.stack(torch.aminmax(labels))
    pair[0].bitwise_not_()
    torch.maximum(out, pair, out=out)


def new_index_bounds(device: torch.device | str) -> torch.Tensor:
    """An ``index_bounds`` tensor holding the empty range (both entries the int64 minimum, the
    identity of the running maxima), on ``device``. Refill it with that value to reset it."""
    return torch.full((2,), _I64_MIN, dtype=torch.int64, device=device)


def read_index_bounds(bounds: torch.Tensor) -> tuple[int, int]:
    """``(lowest, highest)`` class index from an ``index_bounds`` tensor that a
    `loss_forward_backward` call filled. Call it once that work completed: a CUDA tensor is
    read on a side stream of its own, which waits for nothing queued after the work (a read on
    the work's stream would wait for every later commit too)."""
    if bounds.is_cuda:
        with torch.cuda.stream(_side_stream(bounds.device)):
            lo_complement, hi = bounds.tolist()
    else:
        lo_complement, hi = bounds.tolist()
    return ~lo_complement, hi


@functools.cache
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _check_bounds(bounds: torch.Tensor, labels: torch.Tensor) -> None:
    if labels.is_floating_point():
        raise ValueError("[loss] index_bounds needs class-index labels, got float labels")
    if bounds.dtype != torch.int64 or bounds.shape != (2,) or bounds.device != labels.device:
        raise ValueError(
            f"[loss] index_bounds must be an int64 tensor of 2 elements on {labels.device}, "
            f"got {bounds.dtype} {tuple(bounds.shape)} on {bounds.device}"
        )


def _divisor(
    reduction: int, units: int, count: torch.Tensor | None, acc: torch.dtype
) -> int | torch.Tensor:
    """What an image's loss sum is divided by: 1 (NONE, SUM), ``units`` (MEAN, and
    SUM_BY_NON_ZERO_WEIGHTS without weights), or the image's ``count`` of pixels or elements
    with a non-zero weight (at least 1), as an (N, 1, 1, 1) tensor."""
    if reduction == MEAN or (reduction == SUM_BY_NON_ZERO_WEIGHTS and count is None):
        return units
    if reduction == SUM_BY_NON_ZERO_WEIGHTS and count is not None:
        return count.clamp(min=1).to(acc).view(-1, 1, 1, 1)
    return 1


# -- per-element types ----------------------------------------------------------------------


def _nan_where(probe: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``g`` with NaN wherever ``probe`` is NaN (for gradients that do not read ``probe``)."""
    return torch.where(torch.isnan(probe), probe, g)


def _elementwise(
    kind: int, y: torch.Tensor, t: torch.Tensor, p: LossParams
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unweighted per-element loss and its derivative (module docstring)."""
    if kind == MEAN_ABSOLUTE_ERROR:
        r = y - t
        return r.abs(), _nan_where(r, torch.sign(r))  # torch.sign(NaN) is 0
    if kind == MEAN_SQUARED_ERROR:
        r = y - t
        return r * r, r * 2
    if kind == SIGMOID_CROSS_ENTROPY:
        ls = p.label_smoothing
        ts = t * (1 - ls) + ls / 2 if ls else t
        loss = y.clamp(min=0) - y * ts + torch.log1p(torch.exp(-y.abs()))
        return loss, torch.sigmoid(y) - ts
    if kind == HINGE:
        tt = t * 2 - 1
        m = 1 - tt * y
        grad = torch.where(m > 0, -tt, torch.where(torch.isnan(m), m, 0.0))
        return m.clamp(min=0), grad
    if kind == HUBER:
        d = p.delta
        r = y - t
        ar = r.abs()
        inside = ar <= d
        loss = torch.where(inside, r * r * 0.5, (ar - d / 2) * d)
        return loss, _nan_where(r, torch.where(inside, r, torch.sign(r) * d))
    if kind == LOG:
        eps = p.epsilon
        q, pm = y + eps, 1 - y + eps
        loss = -t * torch.log(q) - (1 - t) * torch.log(pm)
        return loss, (1 - t) / pm - t / q
    if kind == KULLBACK_LEIBLER_DIVERGENCE:
        return torch.xlogy(t, t) - t * y, _nan_where(y, -t)
    raise ValueError(f"[loss] loss type must be 0..9, got {kind}")  # pragma: no cover


# -- per-pixel types ------------------------------------------------------------------------


def _class_terms(
    labels: torch.Tensor, wt: torch.Tensor | None, p: LossParams, c: int, y: torch.Tensor
) -> torch.Tensor:
    """``a_c = weight w_c t'_c`` (N, C, H, W) in ``y``'s dtype, ``t'`` the smoothed labels."""
    ls = p.label_smoothing
    k = c if p.number_of_classes is None else p.number_of_classes
    if labels.is_floating_point():
        a = labels[:, :c].to(y.dtype)
        if ls:
            a = a * (1 - ls) + ls / k
    else:  # one-hot (1 - ls) at the class index, plus ls / K everywhere
        # clamped: an index outside [0, C) must not address memory (`loss_forward_backward`
        # reports it through ``index_bounds``); a no-op for good indices
        index = labels.clamp(0, c - 1).unsqueeze(1)
        if _one_hot_sum(labels, wt, p, y) is not None:
            # ``weight`` scattered directly: the bits of ``1.0 * weight`` at the class and of
            # ``0.0 * weight`` (+0.0, weight > 0) elsewhere, without the product's pass
            return torch.zeros_like(y).scatter_(1, index, p.weight)
        a = torch.zeros_like(y).scatter_(1, index, 1 - ls)
        if ls:
            a += ls / k
    if wt is not None:
        a = a * (wt * p.weight if p.weight != 1 else wt)
    elif p.weight != 1:
        a = a * p.weight
    return a


def _one_hot_sum(
    labels: torch.Tensor, wt: torch.Tensor | None, p: LossParams, y: torch.Tensor
) -> float | None:
    """``sum_c a_c`` of every pixel when the class terms are a one-hot ``weight`` (class
    indices, no label smoothing, no per-element weights, ``weight > 0``), else None. Then every
    pixel's sum is exactly ``weight`` (one non-zero term; the others +0.0), so the gradient
    needs no reduction over the classes. (With ``weight <= 0`` the zeros' signs could differ
    from those of ``0.0 * weight``: that case keeps the general form; so does a weight beyond
    ``y``'s dtype's range, whose general products overflow to inf/NaN.)"""
    if labels.is_floating_point() or wt is not None or p.label_smoothing or not p.weight > 0:
        return None
    if not p.weight <= torch.finfo(y.dtype).max:
        return None
    return p.weight


def _fused_softmax_cross_entropy(
    y: torch.Tensor,
    labels: torch.Tensor,
    p: LossParams,
    reduction: int,
    index_bounds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """SOFTMAX_CROSS_ENTROPY with one-hot class terms (`_one_hot_sum`) on CUDA: one Triton
    launch for `_class_terms` and `_cross_entropy`, its gradient already divided by the
    reduction's divisor and in ``y``'s dtype (`mpsnn.ops.triton.loss`), then the loss's
    reduction as in `loss_forward_backward`; None where that launch does not apply."""
    # no per-element weights: SUM_BY_NON_ZERO_WEIGHTS counts every pixel, as MEAN
    units = y.shape[2] * y.shape[3]
    divisor: int = _divisor(reduction, units, None, torch.float32)  # type: ignore[assignment]  # no counts: an int
    fused = fast_paths.softmax_cross_entropy(
        y, labels, None, p.weight, p.label_smoothing, divisor, index_bounds=index_bounds
    )
    if fused is None:
        return None
    loss, grad = fused
    if reduction != NONE:
        loss = loss.sum((1, 2, 3), keepdim=True)
        if divisor != 1:
            loss = loss / divisor
    return loss, grad


def _cross_entropy(
    kind: int, y: torch.Tensor, a: torch.Tensor, eps: float, a_sum: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pixel loss ``-sum_c a_c log p_c`` (N, 1, H, W) and its derivative (N, C, H, W);
    ``a_sum``: ``sum_c a_c``, when it is one number for every pixel (`_one_hot_sum`)."""
    if kind == SOFTMAX_CROSS_ENTROPY:
        logp = torch.log_softmax(y, dim=1)
        loss = -(a * logp).sum(1, keepdim=True)
        if a_sum is None:
            return loss, a.sum(1, keepdim=True) * torch.exp(logp) - a
        # the same products as ``a_sum * exp(logp)`` with the sums' tensor (``x * 1.0`` is x)
        p = torch.exp(logp)
        return loss, (p if a_sum == 1 else p.mul_(a_sum)) - a
    p = y.clamp(min=eps)
    loss = -(a * torch.log(p)).sum(1, keepdim=True)
    # a / p is finite where the clamp holds (p = eps); the mask zeroes it there. A NaN y gives
    # p = NaN and keeps the NaN through the product.
    return loss, -(a / p) * (y > eps)


def _cosine(
    y: torch.Tensor, t: torch.Tensor, wt: torch.Tensor | None, weight: float
) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """Loss, gradient, unit count and non-zero-weight count of COSINE_DISTANCE."""
    _, _, h, w = y.shape
    dot = (y * t).sum(1, keepdim=True)
    count = None
    if wt is None:
        scale: float | torch.Tensor = weight
    else:
        wbar = wt.mean(1, keepdim=True)
        count = (wbar != 0).sum((1, 2, 3))
        scale = wbar * weight if weight != 1 else wbar
    loss = (1 - dot) * scale
    return loss, _nan_where(y, -t * scale), h * w, count


# -- shape checks ---------------------------------------------------------------------------


def _check(
    y: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    kind: int,
    reduction: int,
) -> None:
    if not 0 <= kind <= 9:
        raise ValueError(f"[loss] loss type must be 0..9, got {kind}")
    if not 0 <= reduction <= 3:
        raise ValueError(f"[loss] reduction type must be 0..3, got {reduction}")
    if y.dim() != 4 or not y.is_floating_point():
        raise ValueError(
            f"[loss] predictions must be a float (N, C, H, W) tensor, "
            f"got {y.dtype} of shape {tuple(y.shape)}"
        )
    n, c, h, w = y.shape
    if labels.is_floating_point():
        if labels.dim() != 4 or labels.shape[0] != n or labels.shape[2:] != (h, w):
            raise ValueError(
                f"[loss] labels must be (N, Cl, H, W) = ({n}, >={c}, {h}, {w}), "
                f"got {tuple(labels.shape)}"
            )
        if labels.shape[1] < c:
            raise ValueError(
                f"[loss] labels must have at least the predictions' {c} channels, "
                f"got {labels.shape[1]}"
            )
        if weights is not None and weights.shape != labels.shape:
            raise ValueError(
                f"[loss] weights must have the labels' shape {tuple(labels.shape)}, "
                f"got {tuple(weights.shape)}"
            )
    else:
        if labels.dtype != torch.int64:
            raise ValueError(
                f"[loss] labels must be float or int64 class indices, got {labels.dtype}"
            )
        if kind not in _CROSS_ENTROPIES:
            raise ValueError(
                f"[loss] class-index labels need a cross-entropy loss type (2 or 4), got {kind}"
            )
        if tuple(labels.shape) != (n, h, w):
            raise ValueError(
                f"[loss] class-index labels must be (N, H, W) = ({n}, {h}, {w}), "
                f"got {tuple(labels.shape)}"
            )
        if weights is not None and not (
            tuple(weights.shape) == (n, h, w)
            or (
                weights.dim() == 4
                and weights.shape[0] == n
                and weights.shape[1] >= c
                and weights.shape[2:] == (h, w)
            )
        ):
            raise ValueError(
                f"[loss] weights with class-index labels must be (N, H, W) = ({n}, {h}, {w}) "
                f"or (N, Cw >= {c}, H, W), got {tuple(weights.shape)}"
            )
    if weights is not None and not weights.is_floating_point():
        raise ValueError(f"[loss] weights must be float, got {weights.dtype}")
