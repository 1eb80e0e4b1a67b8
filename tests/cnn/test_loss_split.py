"""The split loss: `ForwardLoss`, `LossGradient`, `InitialGradient`.

In float64: the forward loss equals the fused `Loss`'s loss image for every loss type and
reduction; the gradient of an incoming gradient of ones equals `Loss`'s gradient; with a random
incoming gradient, the prediction and label gradients equal autograd of a PyTorch restatement
(`tests/cnn/_loss_reference.py`), plus the adjoint test; the batch reduction; the gradient
state; the initial gradient's geometry; lower storage formats; every error message.
"""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from tests.cnn._loss_reference import LT, RT, inputs, loss_image
from tests.helpers import assert_adjoint, assert_close, run

DEV = m.Device("cpu")
B = m.ImageBatch.from_tensor
ALL = [(k, r) for k in LT for r in RT]


def _ids(case: tuple[m.LossType, m.ReductionType]) -> str:
    return f"{case[0].name}-{case[1].name}"


def _desc(kind: m.LossType, red: m.ReductionType, **kw: float) -> m.LossDescriptor:
    return m.LossDescriptor(kind, red, weight=kw.pop("weight", 0.7), delta=0.6, **kw)


def _split(desc, y, t, wt, g=None, *, across=False, labels_grad=False, state=True):
    """(loss image, gradient) of the split kernels on one command buffer; ``g`` None: the
    initial gradient (ones)."""
    cb = DEV.new_command_queue().command_buffer()
    fwd = m.ForwardLoss(DEV, desc, reduce_across_batch=across)
    wb = None if wt is None else B(wt)
    states = fwd.result_state_batch(B(y)) if state else None
    loss = fwd.encode_batch(cb, B(y), B(t), wb, states)
    g_in = m.InitialGradient(DEV).encode_batch(cb, loss) if g is None else B(g)
    lg = m.LossGradient(DEV, desc, reduce_across_batch=across, compute_label_gradients=labels_grad)
    grad = lg.encode_batch(cb, g_in, B(y), B(t), wb, states)
    run(cb)
    return loss.image.tensor, grad.image.tensor


def _fused(desc, y, t, wt):
    cb = DEV.new_command_queue().command_buffer()
    labels = m.LossLabels(DEV, t, wt)
    grad = m.Loss(DEV, desc).encode_batch(cb, B(y), labels)
    run(cb)
    return labels.loss_image().tensor, grad.image.tensor


def _autograd(desc, y, t, wt, g, across=False):
    yr, tr = y.clone().requires_grad_(), t.clone().requires_grad_()
    (loss_image(yr, tr, wt, desc, across) * g).sum().backward()
    return yr.grad, tr.grad


def _incoming(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5


# -- against the fused loss -------------------------------------------------------------------


@pytest.mark.parametrize("case", ALL, ids=_ids)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_forward_and_gradient_of_ones_equal_the_fused_loss(case, weighted) -> None:
    kind, red = case
    y, t, wt = inputs(kind, 3, 4, 2, 3, seed=int(kind) * 4 + int(red), extra=2)
    wt = wt if weighted else None
    desc = _desc(kind, red, label_smoothing=0.1 if kind in (2, 3, 4) else 0.0)
    loss, grad = _split(desc, y, t, wt)
    ref_loss, ref_grad = _fused(desc, y, t, wt)
    assert loss.dtype == torch.float64 and grad.dtype == torch.float64
    assert torch.equal(loss, ref_loss), f"loss differs by {(loss - ref_loss).abs().max()}"
    assert torch.equal(grad, ref_grad), f"gradient differs by {(grad - ref_grad).abs().max()}"
    assert_close(loss, loss_image(y, t, wt, desc), "loss vs the restatement")


# -- random incoming gradients against autograd -----------------------------------------------


@pytest.mark.parametrize("across", [False, True], ids=["per-image", "across-batch"])
@pytest.mark.parametrize("case", ALL, ids=_ids)
def test_prediction_and_label_gradients_match_autograd(case, across) -> None:
    kind, red = case
    y, t, wt = inputs(kind, 3, 4, 2, 3, seed=100 + int(kind) * 4 + int(red), extra=1)
    desc = _desc(kind, red, label_smoothing=0.2 if kind in (2, 3, 4) else 0.0)
    shape = loss_image(y, t, wt, desc).shape
    g = _incoming(shape, seed=int(kind))
    loss, dy = _split(desc, y, t, wt, g, across=across)
    ref_dy, ref_dt = _autograd(desc, y, t, wt, g, across)
    assert_close(loss, loss_image(y, t, wt, desc, across), "loss")
    assert_close(dy, ref_dy, "d/dy")
    if kind == LT.KULLBACK_LEIBLER_DIVERGENCE:
        return  # no label gradient (refused: test_kl_has_no_label_gradient)
    _, dt = _split(desc, y, t, wt, g, across=across, labels_grad=True)
    assert dt.shape == t.shape and torch.equal(dt[:, 4:], torch.zeros_like(dt[:, 4:]))
    assert_close(dt, ref_dt, "d/dt")


@pytest.mark.parametrize(
    "kind", [LT.SOFTMAX_CROSS_ENTROPY, LT.HUBER, LT.COSINE_DISTANCE, LT.LOG], ids=lambda k: k.name
)
@pytest.mark.parametrize("red", [RT.NONE, RT.MEAN], ids=lambda r: r.name)
def test_adjoint_of_the_prediction_gradient(kind, red) -> None:
    """<J v, w> = <v, J^T w>: J v by forward-mode differentiation of the restatement, J^T w
    by `LossGradient` with the incoming gradient w."""
    y, t, wt = inputs(kind, 2, 3, 2, 2, seed=7)
    desc = _desc(kind, red)
    v = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, jv = torch.func.jvp(lambda yy: loss_image(yy, t, wt, desc), (y,), (v,))
    w = _incoming(jv.shape, seed=2)
    _, jtw = _split(desc, y, t, wt, w)
    assert_adjoint(jv, w, v, jtw, f"{kind.name} {red.name}")


def test_across_batch_writes_the_batch_value_into_image_zero() -> None:
    """MEAN across the batch: the mean over every element of the batch, in image 0, zeros in
    the others; SUM: the sum of the fused per-image sums."""
    y, t, wt = inputs(LT.MEAN_SQUARED_ERROR, 4, 3, 2, 2, seed=3)
    mean = _desc(LT.MEAN_SQUARED_ERROR, RT.MEAN, weight=1.0)
    loss, _ = _split(mean, y, t, None, across=True)
    assert loss.shape == (4, 1, 1, 1)
    assert_close(loss[0, 0, 0, 0], ((y - t) ** 2).mean(), "batch mean", tol=1e-14)
    assert torch.equal(loss[1:], torch.zeros(3, 1, 1, 1, dtype=torch.float64))
    total, _ = _split(_desc(LT.MEAN_SQUARED_ERROR, RT.SUM), y, t, wt, across=True)
    per_image, _ = _fused(_desc(LT.MEAN_SQUARED_ERROR, RT.SUM), y, t, wt)
    assert_close(total[0, 0, 0, 0], per_image.sum(), "batch sum", tol=1e-14)
    # NONE: the flag changes nothing
    a, da = _split(_desc(LT.HUBER, RT.NONE), y, t, wt, across=True)
    b, db = _split(_desc(LT.HUBER, RT.NONE), y, t, wt)
    assert torch.equal(a, b) and torch.equal(da, db)


def test_sum_by_non_zero_weights_with_all_zero_weights_gives_zero() -> None:
    y, t, _ = inputs(LT.MEAN_SQUARED_ERROR, 2, 2, 2, 2, seed=4)
    zero = torch.zeros_like(t)
    for across in (False, True):
        desc = _desc(LT.MEAN_SQUARED_ERROR, RT.SUM_BY_NON_ZERO_WEIGHTS)
        loss, dy = _split(desc, y, t, zero, across=across)
        _, dt = _split(desc, y, t, zero, across=across, labels_grad=True)
        for v in (loss, dy, dt):
            assert torch.equal(v, torch.zeros_like(v))


# -- the gradient state -------------------------------------------------------------------------


def test_gradient_state_carries_the_forward_parameters() -> None:
    """A forward encoded with weight 2 and label smoothing 0.1: a gradient kernel with other
    values uses the forward's through the state, its own without one."""
    y, t, _ = inputs(LT.SIGMOID_CROSS_ENTROPY, 2, 3, 2, 2, seed=5)
    desc = _desc(LT.SIGMOID_CROSS_ENTROPY, RT.SUM, weight=1.0)
    cb = DEV.new_command_queue().command_buffer()
    fwd = m.ForwardLoss(DEV, desc)
    fwd.weight, fwd.label_smoothing = 2.0, 0.1
    state = fwd.temporary_result_state(cb, m.Image.from_tensor(y))
    state.read_count = 2
    loss = fwd.encode(cb, m.Image.from_tensor(y), m.Image.from_tensor(t), None, state)
    ones = m.InitialGradient(DEV).encode(cb, loss)
    lg = m.LossGradient(DEV, desc)
    args = (m.Image.from_tensor(y), m.Image.from_tensor(t))
    with_state = lg.encode(cb, ones, *args, None, state)
    without = lg.encode(cb, ones, *args)
    run(cb)
    assert state.forward.params.params.weight == 2.0 and state.is_temporary
    forward_desc = _desc(LT.SIGMOID_CROSS_ENTROPY, RT.SUM, weight=2.0, label_smoothing=0.1)
    assert torch.equal(with_state.tensor, _fused(forward_desc, y, t, None)[1])
    assert torch.equal(without.tensor, _fused(desc, y, t, None)[1])
    assert_close(loss.tensor, loss_image(y, t, None, forward_desc), "loss")


def test_a_gradient_state_must_match_the_forward() -> None:
    y, t, _ = inputs(LT.MEAN_SQUARED_ERROR, 2, 3, 2, 2, seed=6)
    yi, ti = m.Image.from_tensor(y), m.Image.from_tensor(t)
    cb = DEV.new_command_queue().command_buffer()
    fwd = m.ForwardLoss(DEV, _desc(LT.MEAN_SQUARED_ERROR, RT.SUM))
    state = fwd.result_state(yi)
    loss = fwd.encode(cb, yi, ti, None, state)
    ones = m.InitialGradient(DEV).encode(cb, loss)
    other = m.LossGradient(DEV, _desc(LT.MEAN_ABSOLUTE_ERROR, RT.SUM))
    with pytest.raises(ValueError, match=r"\[LossGradient\] loss type, reduction, .* must equal "
                       r"the forward's \(MEAN_SQUARED_ERROR, SUM, None, reduce_across_batch="
                       r"False\), got \(MEAN_ABSOLUTE_ERROR, SUM, None"):  # fmt: skip
        other.encode(cb, ones, yi, ti, None, state)
    across = m.LossGradient(DEV, _desc(LT.MEAN_SQUARED_ERROR, RT.SUM), reduce_across_batch=True)
    with pytest.raises(ValueError, match=r"reduce_across_batch=True\)"):
        across.encode(cb, ones, yi, ti, None, state)
    lg = m.LossGradient(DEV, _desc(LT.MEAN_SQUARED_ERROR, RT.SUM))
    with pytest.raises(ValueError, match=r"\[LossGradient\] the gradient state must have been "):
        lg.encode(cb, ones, yi, ti, None, m.GradientState(DEV))
    conv_state = m.GradientState(DEV)
    m.Neuron(DEV, m.NeuronDescriptor(m.NeuronType.RELU)).encode(cb, yi, None, conv_state)
    with pytest.raises(ValueError, match=r"must come from a ForwardLoss encode, got one written "
                       r"by Neuron"):  # fmt: skip
        lg.encode(cb, ones, yi, ti, None, conv_state)
    y2 = m.Image.from_tensor(torch.cat([y, y]))
    with pytest.raises(ValueError, match=r"source_image must have the forward's shape "
                       r"\(2, 3, 2, 2\), got \(4, 3, 2, 2\)"):  # fmt: skip
        lg.encode_batch(cb, B(torch.ones(4, 1, 1, 1, dtype=torch.float64)), m.ImageBatch(y2),
                        m.ImageBatch(m.Image.from_tensor(torch.cat([t, t]))),
                        source_states=[state] * 4)  # fmt: skip
    second = fwd.result_state(yi)
    fwd.encode(cb, yi, ti, None, second)
    with pytest.raises(ValueError, match=r"must all come from one ForwardLoss encode, got states "
                       r"of 2 encodes"):  # fmt: skip
        lg.encode_batch(cb, m.ImageBatch(ones), B(y), B(t), None, [state, second])
    run(cb)


# -- the initial gradient ----------------------------------------------------------------------


def test_initial_gradient_is_ones_in_the_source_format() -> None:
    x = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    x[0, 0, 0, 0] = float("nan")
    cb = DEV.new_command_queue().command_buffer()
    ones = m.InitialGradient(DEV).encode_batch(cb, B(x))
    half = m.InitialGradient(DEV).encode(cb, m.Image.from_tensor(x.half()))
    run(cb)
    assert torch.equal(ones.image.tensor, torch.ones_like(x))
    assert half.feature_channel_format is m.FeatureChannelFormat.FLOAT16
    assert torch.equal(half.tensor, torch.ones(2, 3, 4, 5, dtype=torch.float16))


def test_initial_gradient_follows_the_unary_geometry() -> None:
    """A clip rect and a destination channel offset: ones where the encode writes, the
    destination's earlier contents elsewhere."""
    cb = DEV.new_command_queue().command_buffer()
    k = m.InitialGradient(DEV)
    k.clip_rect = m.Region(m.Origin(1, 0, 0), m.Size(2, 2, 1))
    k.destination_feature_channel_offset = 1
    dst = m.Image.from_tensor(torch.full((1, 3, 3, 4), 7.0))
    k.encode(cb, m.Image.from_tensor(torch.zeros(1, 2, 3, 4)), dst)
    run(cb)
    want = torch.full((1, 3, 3, 4), 7.0)
    want[0, 1:3, 0:2, 1:3] = 1.0
    assert torch.equal(dst.tensor, want)


# -- storage formats ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=lambda d: str(d)[6:]
)
@pytest.mark.parametrize("kind", [LT.SOFTMAX_CROSS_ENTROPY, LT.MEAN_SQUARED_ERROR], ids=str)
def test_lower_storage_formats_match_float64(dtype, kind) -> None:
    y, t, wt = inputs(kind, 2, 4, 3, 3, seed=8)
    y, t, wt = y.to(dtype), t.to(dtype), wt.to(dtype)
    desc = _desc(kind, RT.MEAN)
    g = _incoming((2, 1, 1, 1), seed=9)
    loss, dy = _split(desc, y, t, wt, g.to(dtype))
    _, dt = _split(desc, y, t, wt, g.to(dtype), labels_grad=True)
    y64, t64, w64, g64 = (v.double() for v in (y, t, wt, g.to(dtype)))
    ref_dy, ref_dt = _autograd(desc, y64, t64, w64, g64)
    assert loss.dtype == torch.float32 and dy.dtype == dtype and dt.dtype == dtype
    assert_close(loss, loss_image(y64, t64, w64, desc), "loss", dtype=torch.float32)
    assert_close(dy, ref_dy, "d/dy", dtype=dtype)
    assert_close(dt, ref_dt, "d/dt", dtype=dtype)


def test_multi_image_encode_equals_the_batch_encode() -> None:
    y, t, wt = inputs(LT.HUBER, 3, 2, 2, 2, seed=10)
    desc = _desc(LT.HUBER, RT.SUM)
    g = _incoming((3, 1, 1, 1), seed=11)
    cb = DEV.new_command_queue().command_buffer()
    yi, ti, wi = (m.Image.from_tensor(v) for v in (y, t, wt))
    loss = m.ForwardLoss(DEV, desc).encode(cb, yi, ti, wi)
    dy = m.LossGradient(DEV, desc).encode(cb, m.Image.from_tensor(g), yi, ti, wi)
    run(cb)
    ref_loss, ref_dy = _split(desc, y, t, wt, g)
    assert torch.equal(loss.tensor, ref_loss) and torch.equal(dy.tensor, ref_dy)


def test_destinations_are_written() -> None:
    y, t, _ = inputs(LT.MEAN_SQUARED_ERROR, 2, 2, 2, 2, seed=12)
    desc = _desc(LT.MEAN_SQUARED_ERROR, RT.SUM)
    cb = DEV.new_command_queue().command_buffer()
    loss = B(torch.zeros(2, 1, 1, 1, dtype=torch.float64))
    out = m.ForwardLoss(DEV, desc).encode_batch(cb, B(y), B(t), destination_images=loss)
    dy = B(torch.zeros_like(y))
    lg = m.LossGradient(DEV, desc)
    lg.encode_batch(cb, loss, B(y), B(t), destination_gradients=dy)
    run(cb)
    ref_loss, _ = _split(desc, y, t, None)
    _, ref_dy = _split(desc, y, t, None, ref_loss)  # the loss image was the incoming gradient
    assert out.image is loss.image and torch.equal(loss.image.tensor, ref_loss)
    assert torch.equal(dy.image.tensor, ref_dy)


def test_properties() -> None:
    desc = m.LossDescriptor(LT.HUBER, RT.MEAN, weight=0.5, number_of_classes=3)
    for k in (m.ForwardLoss(DEV, desc), m.LossGradient(DEV, desc)):
        assert (k.loss_type, k.reduction_type, k.number_of_classes) == (LT.HUBER, RT.MEAN, 3)
        assert (k.weight, k.label_smoothing, k.epsilon, k.delta) == (0.5, 0.0, 1e-7, 1.0)
        assert k.reduce_across_batch is False
        k.weight, k.label_smoothing, k.epsilon, k.delta = 2, 0.5, 1e-3, 3.0
        assert (k.weight, k.label_smoothing, k.epsilon, k.delta) == (2.0, 0.5, 1e-3, 3.0)
        with pytest.raises(AttributeError):
            k.loss_type = LT.LOG
    assert desc.weight == 0.5  # the kernels copied the descriptor
    assert m.LossGradient(DEV, desc).compute_label_gradients is False
    d = m.ForwardLoss(DEV, desc).destination_image_descriptor([m.Image.from_tensor(
        torch.zeros(3, 2, 4, 5, dtype=torch.float16))])  # fmt: skip
    assert (d.number_of_images, d.feature_channels, d.height, d.width) == (3, 1, 1, 1)
    assert d.channel_format is m.FeatureChannelFormat.FLOAT32


# -- errors -------------------------------------------------------------------------------------


def test_kl_has_no_label_gradient() -> None:
    desc = _desc(LT.KULLBACK_LEIBLER_DIVERGENCE, RT.SUM)
    msg = (r"\[LossGradient\] compute_label_gradients needs a loss type with a label gradient "
           r"\(not KULLBACK_LEIBLER_DIVERGENCE: d\(t log t\)/dt is infinite at t = 0\), got "
           r"KULLBACK_LEIBLER_DIVERGENCE")  # fmt: skip
    with pytest.raises(ValueError, match=msg):
        m.LossGradient(DEV, desc, compute_label_gradients=True)
    k = m.LossGradient(DEV, desc)
    with pytest.raises(ValueError, match=msg):
        k.compute_label_gradients = True
    with pytest.raises(TypeError, match=r"\[LossGradient\] compute_label_gradients must be a "
                       r"bool, got int"):  # fmt: skip
        k.compute_label_gradients = 1


def test_construction_and_property_errors() -> None:
    desc = _desc(LT.HUBER, RT.SUM)
    with pytest.raises(TypeError, match=r"\[ForwardLoss\] loss_descriptor must be a "
                       r"LossDescriptor, got str"):  # fmt: skip
        m.ForwardLoss(DEV, "mse")
    with pytest.raises(TypeError, match=r"\[LossGradient\] reduce_across_batch must be a bool, "
                       r"got int"):  # fmt: skip
        m.LossGradient(DEV, desc, reduce_across_batch=1)
    k = m.ForwardLoss(DEV, desc)
    with pytest.raises(ValueError, match=r"\[ForwardLoss\] weight must be finite, got inf"):
        k.weight = float("inf")
    with pytest.raises(TypeError, match=r"\[ForwardLoss\] weight must be a number, got str"):
        k.weight = "1"
    with pytest.raises(ValueError, match=r"\[ForwardLoss\] label_smoothing must be >= 0.0, "
                       r"got -0.1"):  # fmt: skip
        k.label_smoothing = -0.1
    with pytest.raises(ValueError, match=r"\[LossGradient\] epsilon must be > 0, got 0"):
        m.LossGradient(DEV, desc).epsilon = 0
    with pytest.raises(ValueError, match=r"\[ForwardLoss\] delta must be > 0, got -1"):
        k.delta = -1


def test_encode_errors() -> None:
    y, t, wt = inputs(LT.MEAN_SQUARED_ERROR, 2, 3, 2, 2, seed=13)
    desc = _desc(LT.MEAN_SQUARED_ERROR, RT.SUM)
    cb = DEV.new_command_queue().command_buffer()
    fwd, lg = m.ForwardLoss(DEV, desc), m.LossGradient(DEV, desc)
    ones = B(torch.ones(2, 1, 1, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[ForwardLoss\] labels must be 2 image\(s\) of 2x2 "
                       r"with at least the predictions' 3 channels, got 2 of 2x2x2"):  # fmt: skip
        fwd.encode_batch(cb, B(y), B(t[:, :2]))
    with pytest.raises(ValueError, match=r"\[LossGradient\] labels must be 2 image\(s\) of 2x2 "
                       r"with at least the predictions' 3 channels, got 1 of 2x2x3"):  # fmt: skip
        lg.encode_batch(cb, ones, B(y), B(t[:1]))
    with pytest.raises(ValueError, match=r"\[ForwardLoss\] weights must have the labels' shape "
                       r"\(2, 3, 2, 2\), got \(2, 1, 2, 2\)"):  # fmt: skip
        fwd.encode_batch(cb, B(y), B(t), B(wt[:, :1]))
    with pytest.raises(ValueError, match=r"\[LossGradient\] the incoming gradient must have the "
                       r"loss image's shape \(2, 1, 1, 1\), got \(2, 3, 2, 2\)"):  # fmt: skip
        lg.encode_batch(cb, B(y), B(y), B(t))
    with pytest.raises(ValueError, match=r"\[ForwardLoss\] the destination must have the loss "
                       r"image's shape \(2, 1, 1, 1\), got \(2, 3, 2, 2\)"):  # fmt: skip
        fwd.encode_batch(cb, B(y), B(t), destination_images=B(torch.zeros_like(y)))
    with pytest.raises(ValueError, match=r"\[LossGradient\] the destination must have the "
                       r"predictions' shape \(2, 3, 2, 2\), got \(2, 1, 1, 1\)"):  # fmt: skip
        lg.encode_batch(cb, ones, B(y), B(t), destination_gradients=B(torch.zeros(2, 1, 1, 1)))
    lg.compute_label_gradients = True
    with pytest.raises(ValueError, match=r"\[LossGradient\] the destination must have the "
                       r"labels' shape \(2, 3, 2, 2\), got \(2, 1, 1, 1\)"):  # fmt: skip
        lg.encode_batch(cb, ones, B(y), B(t), destination_gradients=B(torch.zeros(2, 1, 1, 1)))
    with pytest.raises(TypeError, match=r"\[ForwardLoss\] labels must be an ImageBatch"):
        fwd.encode_batch(cb, B(y), t)
    with pytest.raises(TypeError, match=r"\[LossGradient\] labels must be an Image, got Tensor"):
        lg.encode(cb, ones.image, m.Image.from_tensor(y), t)
    fwd.offset = m.Offset(1, 0, 0)
    with pytest.raises(m.UnsupportedError, match=r"\[ForwardLoss\] the split loss reads whole "
                       r"images: offsets, clip rect and channel offsets must keep their "
                       r"defaults, got offsets \[Offset\(x=1"):  # fmt: skip
        fwd.encode_batch(cb, B(y), B(t))
    fwd.offset = m.Offset()
    fwd.source_feature_channel_max_count = 2
    with pytest.raises(m.UnsupportedError, match=r"\[ForwardLoss\] the split loss reads every "
                       r"channel: source_feature_channel_max_count must be at least the "
                       r"source's 3, got 2"):  # fmt: skip
        fwd.encode_batch(cb, B(y), B(t))
    lg.clip_rect = m.Region(m.Origin(0, 0, 0), m.Size(1, 1, 1))
    with pytest.raises(m.UnsupportedError, match=r"\[LossGradient\] the split loss reads whole"):
        lg.encode_batch(cb, ones, B(y), B(t))
    yi = m.Image.from_tensor(y)
    with pytest.raises(ValueError, match=r"\[ForwardLoss\] destination_image must not alias an "
                       r"input"):  # fmt: skip
        m.ForwardLoss(DEV, desc).encode(cb, yi, m.Image.from_tensor(t), None, None, yi)
    assert cb._commands == []  # nothing was recorded by the failed encodes
