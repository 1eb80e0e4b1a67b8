"""The Triton softmax cross entropy (class indices, one-hot class terms) equals the portable
path: the kernel against the portable per-pixel loss and gradient, and `loss_forward_backward`
with Triton on against Triton off for every reduction; shapes with few and many classes, C = 1,
channels-last and strided logits, every storage format, scalar weights 1 and 1/40; special
values (±inf, NaN, 1e30 logits) with NaN and infinity positions equal to the portable path's;
and the dispatch, which takes only that case.

log-softmax's sum of exponentials may be ordered differently from ATen's and, on the CPU, the
interpreter's ``exp``/``log`` are NumPy's, not ATen's: values are compared within an ulp or so
(the loss in float32, the gradient in its storage dtype), special values exactly. Without a GPU
the kernel runs in Triton's interpreter on CPU tensors; `_interpreted` lets the dispatch take
them there (it takes CUDA tensors only)."""

from __future__ import annotations

import math

import pytest
import torch

from mpsnn.ops import loss as L
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.loss import LossParams, loss_forward_backward
from mpsnn.ops.triton import loss as triton_loss
from tests.helpers import TRITON_DEVICES

# the interpreter evaluates padding lanes and special values with NumPy, which warns about
# the NaNs and infinities it makes (-inf - -inf, 0 * -inf, log 0): those lanes are masked
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
REDUCTIONS = [L.NONE, L.SUM, L.MEAN, L.SUM_BY_NON_ZERO_WEIGHTS]
# (shape, layout): NCHW, channels-last, or a strided view of a wider tensor
CASES = [
    ((256, 10, 1, 1), "nchw"),  # classification: classes adjacent in memory
    ((3, 7, 2, 5), "nchw"),  # pixels innermost
    ((2, 1, 3, 4), "nchw"),  # one class: loss -0.0 and gradient 0 (w - w)
    ((2, 6, 3, 5), "nhwc"),
    ((2, 5, 3, 4), "strided"),
    ((3, 300, 1, 2), "nchw"),  # a row of 512 padded classes
]
# |got - want| <= atol * scale + rtol |want|, scale = weight / divisor (the gradient's size)
GRAD_TOL = {
    torch.float32: (1e-5, 1e-6),
    torch.float16: (2e-3, 1e-5),
    # the interpreter truncates float32 -> bfloat16 (a GPU rounds to nearest): one ulp, 2^-7
    torch.bfloat16: (1.6e-2, 1e-4),
}


@pytest.fixture
def _interpreted(monkeypatch, device):
    """The dispatch's device test, widened to the interpreter's CPU tensors (CUDA: as is)."""
    if device == "cpu":
        monkeypatch.setattr(
            fast_paths, "_runs", lambda *ts: fast_paths.enabled() and fast_paths.available()
        )


@pytest.fixture
def _portable_after():
    yield
    fast_paths.set_enabled(True)


def _inputs(shape, layout: str, dtype, device, seed: int = 7):
    n, c, h, w = shape
    gen = torch.Generator().manual_seed(seed)
    y = torch.randn(n, c, h, w, generator=gen) * 3
    labels = torch.randint(0, c, (n, h, w), generator=gen)
    y = y.to(device=device, dtype=dtype)
    labels = labels.to(device)
    if layout == "nhwc":
        y = y.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":  # every other column of a wider tensor, labels transposed
        wide = torch.zeros(n, c, h, 2 * w, device=device, dtype=dtype)
        wide[..., ::2] = y
        y = wide[..., ::2]
        labels = labels.transpose(1, 2).contiguous().transpose(1, 2)
        assert not y.is_contiguous() and not labels.is_contiguous()
    return y, labels


def _portable(y, labels, weight: float, reduction: int, **kw):
    fast_paths.set_enabled(False)
    try:
        return loss_forward_backward(
            y, labels, None, LossParams(L.SOFTMAX_CROSS_ENTROPY, reduction, weight, **kw)
        )
    finally:
        fast_paths.set_enabled(True)


def _same_specials(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isposinf(), want.isposinf())
    assert torch.equal(got.isneginf(), want.isneginf())


def _close_loss(got: torch.Tensor, want: torch.Tensor, weight: float) -> None:
    _same_specials(got, want)
    assert got.dtype == torch.float32
    # log(sum of exponentials) may differ by an ulp of the sum: an absolute error
    torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-6 * weight, equal_nan=True)


def _close_grad(got: torch.Tensor, want: torch.Tensor, scale: float) -> None:
    _same_specials(got, want)
    rtol, atol = GRAD_TOL[want.dtype]
    torch.testing.assert_close(
        got.double(), want.double(), rtol=rtol, atol=atol * scale, equal_nan=True
    )


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("weight", [1.0, 1 / 40], ids=["w1", "w1_40"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "layout"), CASES, ids=str)
def test_kernel_equals_the_portable_per_pixel_loss(shape, layout, dtype, weight, device) -> None:
    y, labels = _inputs(shape, layout, dtype, device)
    # the portable path upcasts y to float32 first: its float32 gradient, before the cast
    want_loss, want_grad = _portable(y.float(), labels, weight, L.NONE)
    for divisor in (1, 6):
        loss, grad = triton_loss.softmax_cross_entropy_triton(y, labels, weight, divisor)
        assert loss.shape == (shape[0], 1, *shape[2:]) and loss.is_contiguous()
        assert grad.dtype == dtype and grad.shape == y.shape
        if layout != "strided":  # dense logits: the gradient has their layout
            assert grad.stride() == y.stride()
        _close_loss(loss, want_loss, weight)
        _close_grad(grad, (want_grad / divisor).to(dtype), weight / divisor)
        assert (grad.float() != 0).any() or shape[1] == 1


@pytest.mark.usefixtures("_interpreted")
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("weight", [1.0, 1 / 40], ids=["w1", "w1_40"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("shape", "layout"), CASES, ids=str)
def test_loss_forward_backward_fused_equals_portable(
    shape, layout, dtype, weight, device, monkeypatch
) -> None:
    calls = []
    kernel = triton_loss.softmax_cross_entropy_triton
    monkeypatch.setattr(
        triton_loss, "softmax_cross_entropy_triton", lambda *a: calls.append(1) or kernel(*a)
    )
    y, labels = _inputs(shape, layout, dtype, device)
    for reduction in REDUCTIONS:
        params = LossParams(L.SOFTMAX_CROSS_ENTROPY, reduction, weight)
        loss, grad = loss_forward_backward(y, labels, None, params)
        want_loss, want_grad = _portable(y, labels, weight, reduction)
        divisor = 1 if reduction in (L.NONE, L.SUM) else shape[2] * shape[3]
        assert loss.shape == want_loss.shape
        _close_loss(loss, want_loss, weight * shape[2] * shape[3] / divisor)
        _close_grad(grad, want_grad, weight / divisor)
    assert len(calls) == len(REDUCTIONS)  # the fused path ran every time


def _special_rows(dtype, device):
    """(1, 5, 3, 3) logits, one special case per pixel, and labels 2 (pixel 1: 0)."""
    y = torch.tensor([0.5, -1.0, 2.0, 0.25, 1.5]).repeat(9, 1)  # (pixel, class)
    labels = torch.full((9,), 2)
    inf, nan = float("inf"), float("nan")
    y[0, 4] = -inf  # at another class: 0 * -inf = NaN loss, gradient finite
    y[1, 0], labels[1] = -inf, 0  # at the label: +inf loss, gradient -w at the label
    y[2, 1] = inf  # a NaN row
    y[3, 3] = nan  # a NaN row
    y[4, 0] = 1e30  # probability 1 elsewhere: loss 1e30 w (float16: +inf, a NaN row)
    y[5, 2] = 1e30  # at the label: loss 0
    y[6] = -inf  # every class -inf: a NaN row
    y[7, :] = 1e4  # equal logits: log 5
    y = y.T.reshape(1, 5, 3, 3).to(device=device, dtype=dtype)
    return y, labels.reshape(1, 3, 3).to(device)


@pytest.mark.usefixtures("_interpreted")
@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_special_values_propagate_as_in_the_portable_path(dtype, device) -> None:
    y, labels = _special_rows(dtype, device)
    for weight in (1.0, 1 / 40):
        loss, grad = triton_loss.softmax_cross_entropy_triton(y, labels, weight)
        want_loss, want_grad = _portable(y, labels, weight, L.NONE)
        _close_loss(loss, want_loss, weight)
        _close_grad(grad, want_grad, weight)
        flat = loss.view(-1)
        assert flat[[0, 2, 3, 6]].isnan().all() and flat[1] == float("inf")
        # 1e30 is +inf in float16: NaN rows there
        assert flat[[4, 5]].isnan().all() if dtype == torch.float16 else flat[4] > 1e28 * weight
        assert float(flat[7]) == pytest.approx(math.log(5) * weight)
        # the -inf label's gradient: -w (bfloat16: truncated by the interpreter)
        assert grad[0, 0, 0, 1].item() == pytest.approx(-weight, rel=2**-7)
        for reduction in REDUCTIONS[1:]:  # a NaN pixel makes the image's sum NaN
            params = LossParams(L.SOFTMAX_CROSS_ENTROPY, reduction, weight)
            got = loss_forward_backward(y, labels, None, params)
            want = _portable(y, labels, weight, reduction)
            _same_specials(got[0], want[0])
            _close_grad(got[1], want[1], weight / (1 if reduction == L.SUM else 9))
            assert got[0].isnan().all()


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_out_of_range_class_indices_give_nan_pixels(device) -> None:
    """Indices outside [0, C) (trusted through ``max_index``) are never used as addresses:
    those pixels get NaN, the others their loss."""
    y, labels = _inputs((2, 4, 2, 3), "nchw", torch.float32, device)
    labels[0, 0, 1], labels[1, 1, 2] = 4, -1
    loss, grad = triton_loss.softmax_cross_entropy_triton(y, labels, 1.0)
    bad = torch.zeros(2, 1, 2, 3, dtype=torch.bool, device=device)
    bad[0, 0, 0, 1] = bad[1, 0, 1, 2] = True
    assert torch.equal(loss.isnan(), bad)
    assert torch.equal(grad.isnan(), bad.expand_as(grad))
    fixed = labels.clamp(0, 3)
    want_loss, _ = _portable(y, fixed, 1.0, L.NONE)
    _close_loss(loss[~bad], want_loss[~bad], 1.0)


def test_dispatch_takes_cuda_tensors_only() -> None:
    y = torch.randn(2, 3, 2, 2)
    labels = torch.randint(0, 3, (2, 2, 2))
    assert fast_paths.softmax_cross_entropy(y, labels, None, 1.0, 0.0) is None  # CPU tensors
    if torch.cuda.is_available():
        assert fast_paths.softmax_cross_entropy(y.cuda(), labels.cuda(), None, 1.0, 0.0)
        assert fast_paths.softmax_cross_entropy(y.cuda(), labels, None, 1.0, 0.0) is None


@pytest.mark.usefixtures("_interpreted", "_portable_after")
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_dispatch_takes_the_one_hot_case_only(device) -> None:
    y, labels = _inputs((2, 3, 2, 2), "nchw", torch.float32, device)
    ce = fast_paths.softmax_cross_entropy
    got = ce(y, labels, None, 0.5, 0.0, 4)
    assert got is not None
    want = _portable(y, labels, 0.5, L.MEAN)
    _close_grad(got[1], want[1], 0.5 / 4)
    for dtype in (torch.float16, torch.bfloat16):
        assert ce(y.to(dtype), labels, None, 1.0, 0.0) is not None
    p = LossParams(L.SOFTMAX_CROSS_ENTROPY, L.NONE)
    f32_max = torch.finfo(torch.float32).max
    # the dispatch's case is `_one_hot_sum`'s (with float32 accumulation)
    for weight in (1.0, 1 / 40, f32_max, 0.0, -1.0, float("nan"), 1e39, float("inf")):
        eligible = L._one_hot_sum(labels, None, p._replace(weight=weight), y) is not None
        assert (ce(y, labels, None, weight, 0.0) is not None) == eligible
        assert eligible == (0 < weight <= f32_max)
    assert ce(y.double(), labels, None, 1.0, 0.0) is None  # float64: portable
    assert ce(y, labels, torch.ones_like(labels, dtype=y.dtype), 1.0, 0.0) is None  # weights
    assert ce(y, labels, None, 1.0, 0.1) is None  # label smoothing
    assert ce(y, labels.to(y.dtype), None, 1.0, 0.0) is None  # float labels
    assert ce(y, labels.int(), None, 1.0, 0.0) is None  # not int64
    assert ce(y, labels[:, :1], None, 1.0, 0.0) is None  # not (N, H, W)
    assert ce(y[:0], labels[:0], None, 1.0, 0.0) is None  # empty
    wide = torch.zeros(1, triton_loss.MAX_CLASSES + 1, 1, 1, device=device)
    assert ce(wide, torch.zeros(1, 1, 1, dtype=torch.int64, device=device), None, 1.0, 0.0) is None
    fast_paths.set_enabled(False)
    assert ce(y, labels, None, 1.0, 0.0) is None
    fast_paths.set_enabled(True)
    assert ce(y, labels, None, 1.0, 0.0) is not None


@pytest.mark.usefixtures("_interpreted")
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_loss_forward_backward_keeps_the_portable_path_outside_the_case(
    device, monkeypatch
) -> None:
    """Weights, label smoothing, weight <= 0 and CATEGORICAL_CROSS_ENTROPY do not launch."""

    def fail(*a):
        raise AssertionError("the fused kernel ran outside its case")

    monkeypatch.setattr(triton_loss, "softmax_cross_entropy_triton", fail)
    y, labels = _inputs((2, 3, 2, 2), "nchw", torch.float32, device)
    pix = torch.ones(2, 2, 2, device=device)
    sce = L.SOFTMAX_CROSS_ENTROPY
    for wt, params in (
        (pix, LossParams(sce, L.MEAN)),
        (None, LossParams(sce, L.MEAN, label_smoothing=0.1)),
        (None, LossParams(sce, L.MEAN, weight=-1.0)),
        (None, LossParams(L.CATEGORICAL_CROSS_ENTROPY, L.MEAN)),
    ):
        loss, grad = loss_forward_backward(y, labels, wt, params)
        assert torch.isfinite(loss).all() and grad.dtype == y.dtype


@pytest.mark.usefixtures("_interpreted")
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_class_offsets_past_two_to_the_31_are_computed_in_int64(device) -> None:
    """A class stride of 2**30 + 1 elements (NCHW logits with that many pixels per image): the
    third class's offset passes 2**31. A view of a buffer of which only three elements are
    written (4 GiB of float16, mostly never touched on the CPU)."""
    s = 2**30 + 1
    base = torch.zeros(2 * s + 1, dtype=torch.float16, device=device)
    for i, v in enumerate((1.0, -2.0, 3.0)):
        base[i * s] = v
    y = base.as_strided((1, 3, 1, 1), (1, s, 1, 1))
    labels = torch.tensor([[[2]]], device=device)
    p = LossParams(L.SOFTMAX_CROSS_ENTROPY, L.NONE, 1.0)
    fast_paths.set_enabled(False)
    try:
        want_loss, want_grad = loss_forward_backward(y, labels, None, p)
    finally:
        fast_paths.set_enabled(True)
    got_loss, got_grad = loss_forward_backward(y, labels, None, p)
    assert torch.allclose(got_loss, want_loss, rtol=1e-6)
    assert torch.allclose(got_grad.float(), want_grad.float(), atol=2e-3)
