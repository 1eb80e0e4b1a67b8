"""Loss math (`mpsnn.ops.loss`) at its edges: extreme logits, the ends of the probability
losses' domains, zero weights, NaN, padding channels, kinks, the cosine pixel weight; the
input checks and their messages; and the bit identity of the one-hot cross-entropy shortcut
with the general form. The reference and the data are those of `test_loss_ops`
(`tests.ops._loss_helpers`)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from mpsnn.ops import loss as L
from mpsnn.ops.loss import LossParams, loss_forward_backward
from tests.helpers import DEVICES, TOL, assert_close
from tests.ops._loss_helpers import (
    CROSS_ENTROPIES,
    DELTA,
    NAMES,
    REDUCTIONS,
    SMOOTHED,
    _on,
    _params,
    make_case,
    reference,
)

# -- edges: extremes, domain ends, zero weights, NaN, padding -------------------------------

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_ce_finite_for_huge_logits(dtype, device):
    row = torch.tensor([1e4, -1e4, 0.0, 5e3], dtype=torch.float64)
    y = torch.stack([row, -row, row.flip(0)]).view(3, 4, 1, 1).repeat(1, 1, 2, 1)
    idx = torch.tensor([[[1], [0]], [[1], [2]], [[3], [3]]])
    t = F.one_hot(idx, 4).permute(0, 3, 1, 2).double() * 0.7 + 0.1
    for labels, ls in ((idx, 0.1), (t, 0.0)):
        p = _params(L.SOFTMAX_CROSS_ENTROPY, L.SUM, ls=ls)
        yd = y.to(dtype)
        loss, grad = loss_forward_backward(yd.to(device), labels.to(device), None, p)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
        yr = yd.double().requires_grad_()
        ref = reference(yr, labels, None, p)
        (g_ref,) = torch.autograd.grad(ref.sum(), yr)
        assert_close(loss, ref.detach(), "loss", tol=1e-6)
        assert_close(grad, g_ref, "gradient", tol=max(TOL[dtype], 1e-6))


def test_sigmoid_ce_finite_for_huge_logits():
    y = torch.tensor([1e4, -1e4, 3e4, -3e4], dtype=torch.float32).view(1, 4, 1, 1)
    t = torch.tensor([0.0, 1.0, 0.3, 0.6], dtype=torch.float32).view(1, 4, 1, 1)
    loss, grad = loss_forward_backward(y, t, None, _params(L.SIGMOID_CROSS_ENTROPY, L.NONE))
    expected = torch.tensor([1e4, 1e4, 0.7 * 3e4, 0.6 * 3e4]).view(1, 4, 1, 1)
    assert_close(loss, expected, "loss", tol=1e-7)
    assert_close(grad, torch.tensor([1.0, -1.0, 0.7, -0.6]).view(1, 4, 1, 1), "gradient", tol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("kind", [L.LOG, L.CATEGORICAL_CROSS_ENTROPY], ids=NAMES.get)
def test_probability_losses_finite_at_zero_and_one(kind, dtype, device):
    y = torch.tensor([[0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.5, 0.0]], dtype=torch.float64)
    t = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.5, 0.0]], dtype=torch.float64)
    y, t = y.view(2, 4, 1, 1), t.view(2, 4, 1, 1)
    for red in REDUCTIONS:
        p = _params(kind, red, ls=0.1 if kind in SMOOTHED else 0.0)
        loss, grad = loss_forward_backward(*_on(device, y.to(dtype), t.to(dtype)), None, p)
        assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
        yr = y.clone().requires_grad_()
        ref = reference(yr, t, None, p)
        (g_ref,) = torch.autograd.grad(ref.sum(), yr)
        tol = 1e-10 if dtype == torch.float64 else 1e-5
        assert_close(loss, ref.detach(), "loss", tol=tol)
        assert_close(grad, g_ref, "gradient", tol=tol)
    # LOG at y = 0 with t = 1 costs -log(eps); its derivative is -1 / eps.
    if kind == L.LOG:
        loss, grad = loss_forward_backward(y, t, None, _params(kind, L.NONE))
        assert loss[0, 0, 0, 0].item() == pytest.approx(-torch.log(torch.tensor(1e-7)).item())
        assert grad[0, 0, 0, 0].item() == pytest.approx(-1e7)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(NAMES), ids=NAMES.get)
def test_nzw_all_zero_weights_give_zero(kind, device):
    for form in ["float", "index"] if kind in CROSS_ENTROPIES else ["float"]:
        y, labels, w = make_case(kind, form, "elem" if form == "float" else "pixel", 101)
        zero = torch.zeros_like(w)
        p = _params(kind, L.SUM_BY_NON_ZERO_WEIGHTS, ls=0.1 if kind in SMOOTHED else 0.0)
        loss, grad = loss_forward_backward(*_on(device, y, labels, zero), p)
        assert torch.equal(loss, torch.zeros_like(loss)), loss
        assert torch.equal(grad, torch.zeros_like(grad))
        # One image without weights does not disturb the other.
        w[0] = 0
        loss, grad = loss_forward_backward(*_on(device, y, labels, w), p)
        yr = y.clone().requires_grad_()
        ref = reference(yr, labels, w, p)
        (g_ref,) = torch.autograd.grad(ref.sum(), yr)
        assert loss[0].item() == 0 and torch.equal(grad[0], torch.zeros_like(grad[0]))
        assert loss[1].abs().item() > 0 and grad[1].abs().sum().item() > 0
        assert_close(loss, ref.detach(), "loss")
        assert_close(grad, g_ref, "gradient")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("red", list(REDUCTIONS), ids=REDUCTIONS.get)
@pytest.mark.parametrize("kind", list(NAMES), ids=NAMES.get)
def test_low_precision_predictions(kind, red, dtype, device):
    """Inputs rounded to the dtype; the reference in float64 on the rounded values. The loss is
    computed (and returned) in float32, the gradient rounded to the predictions' dtype."""
    y, t, w = make_case(kind, "wide", "elem", 200 + kind)
    y, t, w = y.to(dtype), t.to(dtype), w.to(dtype)
    p = _params(kind, red, 0.75, 0.1 if kind in SMOOTHED else 0.0)
    loss, grad = loss_forward_backward(*_on(device, y, t, w), p)
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    yr = y.double().requires_grad_()
    ref = reference(yr, t.double(), w.double(), p)
    (g_ref,) = torch.autograd.grad(ref.sum(), yr)
    assert_close(loss, ref.detach(), "loss", tol=2e-6)
    assert_close(grad, g_ref, "gradient", tol=max(TOL[dtype], 2e-6))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", list(NAMES), ids=NAMES.get)
def test_nan_propagates(kind, device):
    y, t, _ = make_case(kind, "float", None, 301)
    y = y.clone()
    y[0, 1, 0, 0] = float("nan")
    loss, grad = loss_forward_backward(*_on(device, y, t), None, _params(kind, L.SUM))
    assert torch.isnan(loss[0]).all() and torch.isfinite(loss[1]).all()
    assert torch.isnan(grad[0, 1, 0, 0]) and torch.isfinite(grad[1]).all()
    # Elsewhere in image 0 the gradient is the finite one (per-element types) or NaN only in
    # the NaN's pixel (per-pixel types: the pixel's classes are coupled).
    assert torch.isfinite(grad[0, :, 1:]).all()


def test_padding_channels_take_no_part():
    """Wide labels and weights whose channels >= C are NaN give exactly the narrow result."""
    for kind, red in itertools.product(NAMES, REDUCTIONS):
        y, wide, w_wide = make_case(kind, "wide", "elem", 401)
        c = y.shape[1]
        p = _params(kind, red, ls=0.1 if kind in SMOOTHED else 0.0)
        a = loss_forward_backward(y, wide, w_wide, p)
        b = loss_forward_backward(y, wide[:, :c].contiguous(), w_wide[:, :c].contiguous(), p)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), NAMES[kind]
        assert torch.isfinite(a[0]).all() and torch.isfinite(a[1]).all()


def _column(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).view(1, -1, 1, 1)


def test_kinks_take_the_documented_side():
    """MAE at y = t and HINGE at 1 - t~ y = 0 have derivative 0; HUBER at |y - t| = delta has
    the common value and slope of both pieces."""
    none = L.NONE
    loss, grad = loss_forward_backward(
        _column(0.25, 1.0), _column(0.25, 0.0), None, _params(0, none)
    )
    assert_close(loss, _column(0.0, 1.0), "mae loss")
    assert_close(grad, _column(0.0, 1.0), "mae gradient")
    y, t = _column(1.0, -1.0, 0.5, 0.5), _column(1.0, 0.0, 1.0, 0.0)
    loss, grad = loss_forward_backward(y, t, None, _params(L.HINGE, none))
    assert_close(loss, _column(0.0, 0.0, 0.5, 1.5), "hinge loss")
    assert_close(grad, _column(0.0, 0.0, -1.0, 1.0), "hinge gradient")
    y, t = _column(DELTA, -DELTA, 2.0), _column(0.0, 0.0, 0.0)
    loss, grad = loss_forward_backward(y, t, None, _params(L.HUBER, none))
    assert_close(loss, _column(DELTA**2 / 2, DELTA**2 / 2, DELTA * (2.0 - DELTA / 2)), "huber")
    assert_close(grad, _column(DELTA, -DELTA, DELTA), "huber gradient")


def test_cosine_pixel_weight_is_the_channel_mean():
    """COSINE_DISTANCE weights each pixel by the mean of its C per-element weights."""
    y, t, _ = make_case(L.COSINE_DISTANCE, "float", None, 501)
    gen = torch.Generator().manual_seed(502)
    w = torch.rand(t.shape, generator=gen, dtype=torch.float64)
    loss, grad = loss_forward_backward(y, t, w, _params(L.COSINE_DISTANCE, L.NONE, 2.0))
    wbar = w.mean(1, keepdim=True)
    assert_close(loss, 2.0 * wbar * (1 - (y * t).sum(1, keepdim=True)), "loss")
    assert_close(grad, -2.0 * wbar * t, "gradient")


# -- shape checks ---------------------------------------------------------------------------


def test_inconsistent_shapes_raise():
    y = torch.zeros(2, 3, 4, 5)
    good = torch.zeros(2, 3, 4, 5)
    mse = _params(L.MEAN_SQUARED_ERROR, L.SUM)
    ce = _params(L.SOFTMAX_CROSS_ENTROPY, L.SUM)
    bad = [
        (torch.zeros(3, 4, 5), good, None, mse, r"predictions must be a float \(N, C, H, W\)"),
        (y, torch.zeros(2, 2, 4, 5), None, mse, r"at least the predictions' 3 channels, got 2"),
        (y, torch.zeros(2, 3, 4, 6), None, mse, r"labels must be \(N, Cl, H, W\)"),
        (y, good, torch.zeros(2, 1, 4, 5), mse, r"weights must have the labels' shape"),
        (y, torch.zeros(2, 4, 5, dtype=torch.int64), None, mse, r"class-index labels need"),
        (y, torch.zeros(2, 4, 6, dtype=torch.int64), None, ce, r"must be \(N, H, W\)"),
        (y, torch.zeros(2, 4, 5, dtype=torch.int32), None, ce, r"float or int64"),
        (y, torch.zeros(2, 4, 5, dtype=torch.int64), torch.zeros(2, 2, 4, 5), ce, r"Cw >= 3"),
        (y, good, None, _params(10, L.SUM), r"loss type must be 0..9, got 10"),
        (y, good, None, _params(L.HINGE, 4), r"reduction type must be 0..3, got 4"),
    ]
    for yy, labels, weights, p, msg in bad:
        with pytest.raises(ValueError, match=r"^\[loss\] .*" + msg):
            loss_forward_backward(yy, labels, weights, p)


_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_VIEW[t.element_size()])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16], ids=str)
@pytest.mark.parametrize("weight", [1.0, 0.25, 3.0, 0.0, -2.0, 1e5, 1e39, float("inf")])
@pytest.mark.parametrize("reduction", [L.NONE, L.SUM, L.MEAN])
def test_one_hot_cross_entropy_shortcut_keeps_the_bits(
    reduction, weight, dtype, device, monkeypatch
):
    """Softmax cross entropy with class indices (no smoothing, no per-element weights) scatters
    the scalar weight and uses it for the per-pixel class-term sum: the same bits as the general
    form (scatter 1, multiply, reduce over the classes), also for ±inf and NaN logits, logits
    whose softmax is exactly one-hot, and pixels (H, W > 1). A weight beyond the dtype's range
    (1e5 in float16, 1e39 in float32, inf) keeps the general form (its overflow to inf/NaN)."""
    gen = torch.Generator().manual_seed(11)
    y = torch.randn(4, 5, 2, 3, generator=gen, dtype=torch.float64) * 3
    y[0, :, 0, 0] = torch.tensor([float("inf"), 0.0, 1.0, 2.0, 3.0])
    y[0, :, 0, 1] = torch.tensor([-float("inf"), 0.0, 1.0, 2.0, 3.0])
    y[1, :, 1, 2] = torch.tensor([float("nan"), 0.0, 1.0, 2.0, 3.0])
    y[2, :, 0, 0] = torch.tensor([200.0, -200.0, -300.0, 0.0, -250.0])  # softmax one-hot
    y = y.to(device=device, dtype=dtype)
    labels = torch.randint(0, 5, (4, 2, 3), generator=gen).to(device)
    labels[2, 0, 0] = 0
    params = LossParams(L.SOFTMAX_CROSS_ENTROPY, reduction, weight)
    shortcut = 0 < weight <= torch.finfo(dtype).max
    assert (L._one_hot_sum(labels, None, params, y) is not None) == shortcut
    fast = loss_forward_backward(y, labels, None, params)
    monkeypatch.setattr(L, "_one_hot_sum", lambda *args: None)
    general = loss_forward_backward(y, labels, None, params)
    for a, b in zip(fast, general, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b))
