"""Loss math (`mpsnn.ops.loss`): every loss type × reduction, weighted or not, smoothed or not,
wide and class-index labels, against a float64 reference written from the formulas
(`tests.ops._loss_helpers`), its autograd gradient, a directional finite difference of the
function's own summed loss, and PyTorch's losses where PyTorch has them (with the per-image
reduction mapping made explicit). The edges, the input checks and the one-hot shortcut's bits
are in `test_loss_ops_edges`.

Reduction mapping to PyTorch used below, per image ``n`` (the loss never reduces across
images): NONE ↔ ``reduction="none"``; SUM ↔ ``reduction="sum"`` on image ``n`` alone;
MEAN ↔ ``reduction="mean"`` on image ``n`` alone (for cross entropy, the mean over pixels:
the class axis is summed).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from mpsnn.ops import loss as L
from mpsnn.ops.loss import LossParams, loss_forward_backward
from tests.helpers import DEVICES, assert_close
from tests.ops._loss_helpers import (
    CROSS_ENTROPIES,
    DELTA,
    NAMES,
    PER_PIXEL,
    REDUCTIONS,
    _cases,
    _on,
    _params,
    make_case,
    reference,
)

# -- every type × reduction × weighting × smoothing × label form ----------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("kind", "form", "wform", "ls", "red", "weight"), list(_cases()))
def test_against_reference(kind, form, wform, ls, red, weight, device):
    seed = 1000 * kind + 100 * red + 10 * len(form) + (0 if wform is None else len(wform))
    y, labels, weights = make_case(kind, form, wform, seed)
    # Smoothing with K != C on wide and index labels (the class count need not be C).
    k = 5 if (ls and form != "float") else None
    p = _params(kind, red, weight, ls, k)
    yd, ld, wd = _on(device, y, labels, weights)
    loss, grad = loss_forward_backward(yd, ld, wd, p)
    assert loss.device == yd.device and grad.device == yd.device

    yr = y.clone().requires_grad_()
    ref = reference(yr, labels, weights, p)
    n, c, h, w = y.shape
    if red == L.NONE:
        assert ref.shape == ((n, 1, h, w) if kind in PER_PIXEL else (n, c, h, w))
    else:
        assert ref.shape == (n, 1, 1, 1)
    assert loss.dtype == torch.float64 and grad.dtype == torch.float64
    assert_close(loss, ref.detach(), "loss")
    (g_ref,) = torch.autograd.grad(ref.sum(), yr)
    assert_close(grad, g_ref, "gradient vs autograd of the reference")

    # The gradient is the derivative of the function's own summed loss: a central difference
    # along a random direction (no data sits within the step of a kink).
    v = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=y.dtype)
    step = 1e-6
    vd = v.to(device)
    plus = loss_forward_backward(yd + step * vd, ld, wd, p)[0].sum()
    minus = loss_forward_backward(yd - step * vd, ld, wd, p)[0].sum()
    fd = ((plus - minus) / (2 * step)).item()
    an = (grad * vd).sum().item()
    assert abs(fd - an) <= 1e-6 * max(1.0, abs(an)), f"directional derivative {fd} != {an}"


def test_reference_cases_exercise_zero_weight_pixels():
    """The weight generator zeroes whole pixels, so the 'a pixel counts when any class weight is
    non-zero' rule and the cosine mean rule change the SUM_BY_NON_ZERO_WEIGHTS divisor."""
    for kind in PER_PIXEL:
        y, labels, weights = make_case(kind, "float", "elem", 7)
        nzw, _ = loss_forward_backward(y, labels, weights, _params(kind, L.SUM_BY_NON_ZERO_WEIGHTS))
        total, _ = loss_forward_backward(y, labels, weights, _params(kind, L.SUM))
        h, w = y.shape[2:]
        wbar = weights.mean(1) if kind == L.COSINE_DISTANCE else weights.abs().amax(1)
        counts = (wbar != 0).sum((1, 2)).double()
        assert counts[0] < h * w  # image 0's first pixel has all weights zero
        assert_close(nzw.flatten(), total.flatten() / counts, f"{NAMES[kind]} divisor")


def test_all_one_weights_make_nzw_equal_mean():
    for kind in NAMES:
        y, labels, _ = make_case(kind, "float", None, 11)
        ones = torch.ones_like(labels)
        nzw, g_nzw = loss_forward_backward(
            y, labels, ones, _params(kind, L.SUM_BY_NON_ZERO_WEIGHTS)
        )
        mean, g_mean = loss_forward_backward(y, labels, None, _params(kind, L.MEAN))
        assert_close(nzw, mean, f"{NAMES[kind]} loss")
        assert_close(g_nzw, g_mean, f"{NAMES[kind]} gradient")


# -- PyTorch's losses -----------------------------------------------------------------------


def _torch_image(per_image, y: torch.Tensor, red: int) -> torch.Tensor:
    """A loss image from a PyTorch loss applied image by image (reduction mapping above)."""
    if red == L.NONE:
        return per_image(y, "none")
    mode = {L.SUM: "sum", L.MEAN: "mean"}[red]
    return torch.stack(per_image(y, mode)).view(-1, 1, 1, 1)


def _check_against_torch(per_image, y, labels, weights, p: LossParams, what: str):
    loss, grad = loss_forward_backward(y, labels, weights, p)
    yr = y.clone().requires_grad_()
    expected = _torch_image(per_image, yr, p.reduction)
    assert_close(loss, expected.detach(), f"{what} loss")
    (g,) = torch.autograd.grad(expected.sum(), yr)
    assert_close(grad, g, f"{what} gradient")


def _split(fn):
    """``fn(y_n, i, reduction)`` per image for SUM/MEAN, whole batch for NONE."""

    def per_image(y, mode):
        if mode == "none":
            return fn(y, slice(None), "none")
        return [fn(y[i : i + 1], slice(i, i + 1), mode) for i in range(y.shape[0])]

    return per_image


@pytest.mark.parametrize("red", [L.NONE, L.SUM, L.MEAN], ids=REDUCTIONS.get)
@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_softmax_ce_is_torch_cross_entropy_index_labels(red, ls):
    """PyTorch's label smoothing is t' = (1 - ls) t + ls / C: the same as ours with K = C."""
    y, idx, _ = make_case(L.SOFTMAX_CROSS_ENTROPY, "index", None, 21)

    def fn(yy, s, mode):
        out = F.cross_entropy(yy, idx[s], label_smoothing=ls, reduction=mode)
        return out[:, None] if mode == "none" else out

    p = _params(L.SOFTMAX_CROSS_ENTROPY, red, ls=ls)
    _check_against_torch(_split(fn), y, idx, None, p, "cross_entropy")


@pytest.mark.parametrize("red", [L.NONE, L.SUM, L.MEAN], ids=REDUCTIONS.get)
@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_softmax_ce_is_torch_cross_entropy_probability_labels(red, ls):
    y, t, _ = make_case(L.SOFTMAX_CROSS_ENTROPY, "float", None, 22)
    t = t / t.sum(1, keepdim=True)  # PyTorch's probability targets

    def fn(yy, s, mode):
        out = F.cross_entropy(yy, t[s], label_smoothing=ls, reduction=mode)
        return out[:, None] if mode == "none" else out

    p = _params(L.SOFTMAX_CROSS_ENTROPY, red, ls=ls)
    _check_against_torch(_split(fn), y, t, None, p, "cross_entropy")


@pytest.mark.parametrize("ls", [0.0, 0.1])
def test_softmax_ce_class_weights_are_torch_weight(ls):
    """Per-channel weights equal to a class-weight vector give PyTorch's ``weight=`` per pixel
    (smoothing term included). PyTorch's ``mean`` then divides by the sum of the targets' class
    weights; our MEAN divides by H·W: the two differ by that ratio."""
    y, idx, _ = make_case(L.SOFTMAX_CROSS_ENTROPY, "index", None, 23)
    n, c, h, w = y.shape
    cw = torch.tensor([0.5, 2.0, 1.25, 0.75], dtype=torch.float64)
    weights = cw.view(1, c, 1, 1).expand(n, c, h, w).contiguous()

    def fn(yy, s, mode):
        out = F.cross_entropy(yy, idx[s], weight=cw, label_smoothing=ls, reduction=mode)
        return out[:, None] if mode == "none" else out

    for red in (L.NONE, L.SUM):
        p = _params(L.SOFTMAX_CROSS_ENTROPY, red, ls=ls)
        _check_against_torch(_split(fn), y, idx, weights, p, f"weighted {REDUCTIONS[red]}")
    mean, _ = loss_forward_backward(
        y, idx, weights, _params(L.SOFTMAX_CROSS_ENTROPY, L.MEAN, ls=ls)
    )
    for i in range(n):
        theirs = F.cross_entropy(y[i : i + 1], idx[i : i + 1], weight=cw, label_smoothing=ls)
        ratio = h * w / cw[idx[i]].sum()
        assert_close(mean[i].flatten(), (theirs / ratio).view(1), "weighted mean ratio")


def test_weight_one_over_batch_is_the_batch_mean():
    """A classifier head (N, C, 1, 1) with SUM and weight 1/B: image n's loss is CE_n / B, the
    losses add up to PyTorch's batch-mean cross entropy, and so do the gradients."""
    b, c = 5, 7
    gen = torch.Generator().manual_seed(31)
    y = torch.randn(b, c, 1, 1, generator=gen, dtype=torch.float64)
    idx = torch.randint(0, c, (b, 1, 1), generator=gen)
    loss, grad = loss_forward_backward(y, idx, None, _params(L.SOFTMAX_CROSS_ENTROPY, L.SUM, 1 / b))
    per = F.cross_entropy(y.view(b, c), idx.view(b), reduction="none")
    assert_close(loss.flatten(), per / b, "per-image CE / B")
    yr = y.clone().requires_grad_()
    batch_mean = F.cross_entropy(yr.view(b, c), idx.view(b))
    assert_close(loss.sum(), batch_mean.detach(), "sum of the loss image")
    (g,) = torch.autograd.grad(batch_mean, yr)
    assert_close(grad, g, "gradient of the batch mean")


@pytest.mark.parametrize("red", [L.NONE, L.SUM, L.MEAN], ids=REDUCTIONS.get)
@pytest.mark.parametrize(
    ("kind", "torch_fn"),
    [
        (L.MEAN_SQUARED_ERROR, F.mse_loss),
        (L.MEAN_ABSOLUTE_ERROR, F.l1_loss),
        (L.HUBER, lambda a, b, reduction: F.huber_loss(a, b, reduction=reduction, delta=DELTA)),
    ],
    ids=["mse_loss", "l1_loss", "huber_loss"],
)
def test_regression_losses_are_torch(kind, torch_fn, red):
    y, t, _ = make_case(kind, "float", None, 41)
    _check_against_torch(
        _split(lambda yy, s, mode: torch_fn(yy, t[s], reduction=mode)),
        y,
        t,
        None,
        _params(kind, red),
        NAMES[kind],
    )


@pytest.mark.parametrize("red", [L.NONE, L.SUM], ids=REDUCTIONS.get)
def test_kl_is_torch_kl_div(red):
    """F.kl_div(input=log-probabilities, target=probabilities), with some zero targets."""
    y, t, _ = make_case(L.KULLBACK_LEIBLER_DIVERGENCE, "float", None, 51)
    t = t.clone()
    t[0, 1] = 0
    t[1, :, 0, 0] = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    fn = _split(lambda yy, s, mode: F.kl_div(yy, t[s], reduction=mode))
    _check_against_torch(fn, y, t, None, _params(L.KULLBACK_LEIBLER_DIVERGENCE, red), "kl_div")


@pytest.mark.parametrize("red", [L.NONE, L.SUM, L.MEAN], ids=REDUCTIONS.get)
@pytest.mark.parametrize("weighted", [False, True])
def test_sigmoid_ce_is_torch_bce_with_logits(red, weighted):
    y, t, w = make_case(L.SIGMOID_CROSS_ENTROPY, "float", "elem" if weighted else None, 61)

    def fn(yy, s, mode):
        return F.binary_cross_entropy_with_logits(
            yy, t[s], weight=None if w is None else w[s], reduction=mode
        )

    p = _params(L.SIGMOID_CROSS_ENTROPY, red)
    _check_against_torch(_split(fn), y, t, w, p, "bce_with_logits")


def test_sigmoid_ce_smoothing_is_torch_with_smoothed_target():
    """PyTorch has no label smoothing for BCE: ours equals it with target (1 - ls) t + ls / 2."""
    ls = 0.2
    y, t, _ = make_case(L.SIGMOID_CROSS_ENTROPY, "float", None, 62)
    ts = (1 - ls) * t + ls / 2
    fn = _split(lambda yy, s, mode: F.binary_cross_entropy_with_logits(yy, ts[s], reduction=mode))
    _check_against_torch(fn, y, t, None, _params(L.SIGMOID_CROSS_ENTROPY, L.SUM, ls=ls), "bce")


@pytest.mark.parametrize("red", [L.NONE, L.SUM, L.MEAN], ids=REDUCTIONS.get)
def test_log_with_zero_eps_is_torch_binary_cross_entropy(red):
    """With eps = 0 and y away from 0 and 1 (PyTorch clamps its logs at -100 instead)."""
    y, t, w = make_case(L.LOG, "float", "elem", 71)

    def fn(yy, s, mode):
        return F.binary_cross_entropy(yy, t[s], weight=w[s], reduction=mode)

    _check_against_torch(_split(fn), y, t, w, _params(L.LOG, red, eps=0.0), "binary_cross_entropy")


@pytest.mark.parametrize("red", [L.NONE, L.SUM, L.MEAN], ids=REDUCTIONS.get)
def test_categorical_ce_is_torch_nll_of_log(red):
    y, idx, _ = make_case(L.CATEGORICAL_CROSS_ENTROPY, "index", None, 81)

    def fn(yy, s, mode):
        out = F.nll_loss(torch.log(yy), idx[s], reduction=mode)
        return out[:, None] if mode == "none" else out

    p = _params(L.CATEGORICAL_CROSS_ENTROPY, red)
    _check_against_torch(_split(fn), y, idx, None, p, "nll_loss(log y)")


def test_index_labels_equal_one_hot_labels():
    for kind, ls, k in itertools.product(CROSS_ENTROPIES, [0.0, 0.1], [None, 6]):
        y, idx, wp = make_case(kind, "index", "pixel", 91)
        c = y.shape[1]
        one_hot = F.one_hot(idx, c).permute(0, 3, 1, 2).double()
        we = wp[:, None].expand_as(one_hot).contiguous()
        p = _params(kind, L.SUM_BY_NON_ZERO_WEIGHTS, 0.5, ls, k)
        a = loss_forward_backward(y, idx, wp, p)
        b = loss_forward_backward(y, one_hot, we, p)
        assert_close(a[0], b[0], "loss")
        assert_close(a[1], b[1], "gradient")
