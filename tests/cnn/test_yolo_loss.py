"""The YOLO loss (`YOLOLoss`, `YOLOLossDescriptor`): loss and gradient against the autograd of an
independent float64 restatement (tests/cnn/_yolo_reference.py) for every option, finite
differences, the label helpers, storage formats, image and batch forms, and every error."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from mpsnn.ops.yolo import boxes_to_labels, predicted_boxes
from tests.cnn._yolo_reference import Config, loss_image, masks, random_labels
from tests.helpers import assert_close, run

LT, RT = m.LossType, m.ReductionType
DEV = m.Device("cpu")
ANCHORS = [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0)]
# Two near-identical shapes: a box matching both is an object of the second through the
# min_iou_for_object_presence rule.
CLOSE = [(1.0, 1.0), (1.1, 1.0), (3.0, 1.5)]


def _predictions(n, c, h, w, seed, scale=1.5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, h, w, generator=g, dtype=torch.float64) * scale


def _encode(cfg: Config, y, labels, weights=None, *, batch=True):
    kernel = m.YOLOLoss(DEV, cfg.descriptor())
    lab = m.LossLabels(DEV, labels, weights)
    cb = DEV.new_command_queue().command_buffer()
    if batch:
        grad = kernel.encode_batch(cb, m.ImageBatch.from_tensor(y), lab)
    else:
        grad = kernel.encode(cb, m.Image.from_tensor(y), lab)
    run(cb)
    return lab.loss_image().tensor, grad.tensor


def _reference(cfg: Config, y, labels, weights=None):
    yy = y.detach().clone().requires_grad_(True)
    image = loss_image(yy, labels, weights, cfg)
    image.sum().backward()
    return image.detach(), yy.grad


def _check(cfg: Config, y, labels, weights=None, what=""):
    loss, grad = _encode(cfg, y, labels, weights)
    want_loss, want_grad = _reference(cfg, y, labels, weights)
    assert_close(loss, want_loss, f"{what} loss")
    assert_close(grad, want_grad, f"{what} gradient")
    assert grad.abs().sum() > 0
    return loss, grad


# -- the loss and its gradient against the reference ------------------------------------------


@pytest.mark.parametrize("rescore", [True, False])
@pytest.mark.parametrize("reduction", list(RT))
def test_production_losses_against_autograd(rescore, reduction) -> None:
    """MSE / Huber / sigmoid cross entropy / softmax cross entropy (the Tiny-YOLOv2 client),
    3 anchors, 4 classes, 2 images, every reduction, rescore on and off."""
    cfg = Config(ANCHORS, reduction=reduction, rescore=rescore)
    n, k, h, w = 2, 4, 3, 4
    labels = random_labels(n, ANCHORS, k, h, w, seed=1)
    _, _, counts = masks(labels, cfg)
    # the data exercise every kind of slot
    assert counts["best"] and counts["noobj_in_box_cell"] and counts["ignored"] and counts["empty"]
    y = _predictions(n, 3 * (5 + k), h, w, seed=2)
    loss, _ = _check(cfg, y, labels, what=f"{reduction.name} rescore={rescore}")
    want = (n, 3 * (5 + k), h, w) if reduction is RT.NONE else (n, 1, 1, 1)
    assert loss.shape == want


def test_scales_thresholds_and_sub_descriptor_fields() -> None:
    """Other scales and thresholds, sub-descriptor weights, Huber delta, label smoothing of the
    confidence and class losses; anchors close in shape (the 'above min IoU' rule)."""
    cfg = Config(
        CLOSE, scales=(0.5, 2.0, 0.25, 3.0, 1.5), min_iou=0.6, max_iou=0.4,
        weights={"xy": 0.5, "wh": 2.0, "confidence": 1.5, "classes": 0.75}, delta=0.4,
        conf_smoothing=0.1, cls_smoothing=0.2,
    )  # fmt: skip
    labels = random_labels(2, CLOSE, 3, 4, 3, seed=3, fill=0.9)
    _, _, counts = masks(labels, cfg)
    assert counts["above"] > 0
    _check(cfg, _predictions(2, 3 * 8, 4, 3, seed=4), labels, what="scales")


def test_other_sub_loss_types() -> None:
    """XY as LOG (binary cross entropy of the sigmoid), WH as mean absolute error, confidence
    as MSE, classes as sigmoid cross entropy per class channel (one loss per class)."""
    cfg = Config(
        ANCHORS, xy=LT.LOG, wh=LT.MEAN_ABSOLUTE_ERROR, conf=LT.MEAN_SQUARED_ERROR,
        cls=LT.SIGMOID_CROSS_ENTROPY, reduction=RT.NONE, cls_smoothing=0.1,
    )  # fmt: skip
    labels = random_labels(2, ANCHORS, 2, 3, 3, seed=5)
    _check(cfg, _predictions(2, 21, 3, 3, seed=6), labels, what="other types")


def test_boxes_in_chosen_slots() -> None:
    """Labels that place each box in one slot of its cell (two boxes in some cells): a slot is
    responsible when its own anchor matches its box best among all anchors."""
    cfg = Config(ANCHORS, reduction=RT.SUM)
    labels = random_labels(3, ANCHORS, 2, 3, 3, seed=7, every_anchor=False, fill=0.8)
    _, _, counts = masks(labels, cfg)
    assert counts["best"] > 0 and counts["noobj_in_box_cell"] + counts["ignored"] > 0
    _check(cfg, _predictions(3, 21, 3, 3, seed=8), labels, what="chosen slots")


@pytest.mark.parametrize("reduction", [RT.SUM, RT.SUM_BY_NON_ZERO_WEIGHTS, RT.NONE])
def test_weights_and_wider_labels(reduction) -> None:
    """Per-element weights (some zero, one image all zero) multiply each term; labels with more
    channels than the predictions (the extra ones take no part)."""
    cfg = Config(ANCHORS, reduction=reduction)
    n, k, h, w = 3, 2, 2, 3
    c = 3 * (5 + k)
    labels = random_labels(n, ANCHORS, k, h, w, seed=9, fill=0.9)
    g = torch.Generator().manual_seed(10)
    weights = torch.rand(n, c, h, w, generator=g, dtype=torch.float64) * 2
    weights[weights < 0.5] = 0.0
    weights[2] = 0.0
    y = _predictions(n, c, h, w, seed=11)
    wide = torch.cat([labels, torch.full((n, 3, h, w), 7.0, dtype=torch.float64)], 1)
    wide_w = torch.cat([weights, torch.ones(n, 3, h, w, dtype=torch.float64)], 1)
    loss, grad = _encode(cfg, y, wide, wide_w)
    want_loss, want_grad = _reference(cfg, y, labels, weights)
    assert_close(loss, want_loss, "weighted loss")
    assert_close(grad, want_grad, "weighted gradient")
    assert grad[2].abs().max() == 0 and loss[2].abs().max() == 0


def test_finite_differences() -> None:
    """Central differences of the summed loss image (rescore off: with rescore the IoU target
    is a constant of the loss, not differentiated)."""
    cfg = Config(ANCHORS, reduction=RT.MEAN, rescore=False)
    n, k, h, w = 1, 2, 3, 3
    labels = random_labels(n, ANCHORS, k, h, w, seed=12)
    y = _predictions(n, 21, h, w, seed=13)
    _, grad = _encode(cfg, y, labels)
    obj, _, _ = masks(labels, cfg)
    # a responsible slot's channels, plus random ones
    b, s, i, j = (int(v) for v in obj.nonzero()[0])
    picks = [(s * 7 + ch, i, j) for ch in range(7)]
    g = torch.Generator().manual_seed(14)
    picks += [tuple(int(v) for v in (torch.randint(21, (1,), generator=g), i2, j2))
              for i2, j2 in [(0, 0), (1, 2), (2, 1)]]  # fmt: skip
    eps = 1e-6
    for ch, i, j in picks:
        plus, minus = y.clone(), y.clone()
        plus[b, ch, i, j] += eps
        minus[b, ch, i, j] -= eps
        diff = (_encode(cfg, plus, labels)[0].sum() - _encode(cfg, minus, labels)[0].sum()) / (
            2 * eps
        )
        assert abs(diff.item() - grad[b, ch, i, j].item()) <= 1e-6 * max(1.0, abs(diff.item()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_storage_formats(dtype) -> None:
    """Predictions stored as float32/float16/bfloat16: the float64 reference on the rounded
    values, within the format's tolerance; the gradient comes back in the source's format."""
    cfg = Config(ANCHORS, reduction=RT.SUM)
    labels = random_labels(2, ANCHORS, 2, 3, 3, seed=15)
    y = _predictions(2, 21, 3, 3, seed=16).to(dtype)
    loss, grad = _encode(cfg, y, labels.float())
    assert grad.dtype == dtype
    assert loss.dtype == torch.float32
    want_loss, want_grad = _reference(cfg, y.double(), labels)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    assert_close(loss, want_loss, "loss", tol)
    assert_close(grad, want_grad, "gradient", tol)


def test_encode_forms_agree() -> None:
    """``encode`` on a multi-image Image, ``encode_batch`` with one LossLabels for the batch and
    with one per image give the same gradient and loss; a given destination receives it."""
    cfg = Config(ANCHORS, reduction=RT.SUM)
    labels = random_labels(3, ANCHORS, 2, 2, 2, seed=17)
    y = _predictions(3, 21, 2, 2, seed=18)
    loss_a, grad_a = _encode(cfg, y, labels, batch=False)
    loss_b, grad_b = _encode(cfg, y, labels)
    kernel = m.YOLOLoss(DEV, cfg.descriptor())
    per_image = m.StateBatch(m.LossLabels(DEV, labels[i]) for i in range(3))
    dst = m.ImageBatch.from_tensor(torch.zeros_like(y))
    cb = DEV.new_command_queue().command_buffer()
    out = kernel.encode_batch(cb, m.ImageBatch.from_tensor(y), per_image, dst)
    run(cb)
    assert out is dst
    loss_c = torch.cat([lab.loss_image().tensor for lab in per_image])
    for loss, grad in [(loss_b, grad_b), (loss_c, dst.tensor)]:
        assert torch.equal(loss, loss_a) and torch.equal(grad, grad_a)


def test_non_finite_free_for_extreme_predictions() -> None:
    """Predictions of magnitude 1e4 (exp overflows in the rescore IoU) give finite results."""
    cfg = Config(ANCHORS, reduction=RT.SUM)
    labels = random_labels(1, ANCHORS, 2, 3, 3, seed=19).float()
    y = _predictions(1, 21, 3, 3, seed=20).float() * 1e4
    loss, grad = _encode(cfg, y, labels)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()


# -- descriptor and kernel properties ------------------------------------------------------


def test_descriptor_defaults_and_constructors() -> None:
    d = m.YOLOLossDescriptor.cnn_loss_descriptor(
        LT.MEAN_SQUARED_ERROR, LT.HUBER, LT.SIGMOID_CROSS_ENTROPY, LT.SOFTMAX_CROSS_ENTROPY,
        RT.SUM, [1.0, 2.0, 3.0, 4.0], 2,
    )  # fmt: skip
    assert d.anchor_boxes == ((1.0, 2.0), (3.0, 4.0)) and d.number_of_anchor_boxes == 2
    assert d.rescore is True
    assert (d.scale_xy, d.scale_wh, d.scale_no_object, d.scale_object, d.scale_class) == (
        10.0, 10.0, 5.0, 100.0, 2.0,
    )  # fmt: skip
    assert (d.min_iou_for_object_presence, d.max_iou_for_object_absence) == (0.7, 0.3)
    subs = (d.xy_loss_descriptor, d.wh_loss_descriptor, d.confidence_loss_descriptor,
            d.classes_loss_descriptor)  # fmt: skip
    assert [s.loss_type for s in subs] == [
        LT.MEAN_SQUARED_ERROR, LT.HUBER, LT.SIGMOID_CROSS_ENTROPY, LT.SOFTMAX_CROSS_ENTROPY,
    ]  # fmt: skip
    assert all(s.reduction_type is RT.SUM for s in subs)
    # an (n, 2) tensor works too; the sub-descriptors are retained (MPS), the kernel copies
    d2 = m.YOLOLossDescriptor(*[LT.MEAN_SQUARED_ERROR] * 3, LT.SOFTMAX_CROSS_ENTROPY, RT.MEAN,
                              torch.tensor([[1.5, 0.5]]))  # fmt: skip
    d2.wh_loss_descriptor.weight = 3.0
    k = m.YOLOLoss(DEV, d2)
    d2.wh_loss_descriptor.weight = 4.0
    d2.scale_xy = 1.0
    assert k.loss_wh.weight == 3.0 and k.scale_xy == 10.0
    assert k.loss_wh.loss_type is LT.MEAN_SQUARED_ERROR
    assert k.loss_classes.loss_type is LT.SOFTMAX_CROSS_ENTROPY
    assert k.anchor_boxes == ((1.5, 0.5),) and k.number_of_anchor_boxes == 1
    assert k.reduction_type is RT.MEAN and k.rescore is True
    assert k.loss_xy.loss_type is k.loss_confidence.loss_type is LT.MEAN_SQUARED_ERROR
    assert (k.scale_wh, k.scale_no_object, k.scale_object, k.scale_class) == (10, 5, 100, 2)
    assert (k.min_iou_for_object_presence, k.max_iou_for_object_absence) == (0.7, 0.3)
    assert "YOLOLossDescriptor(" in repr(d)


# -- the label helpers --------------------------------------------------------------------------


def test_boxes_to_labels_layout() -> None:
    """A box (x, y, width, height as image fractions) goes into every anchor slot of the cell
    holding its centre: centre in the cell, size in cells, objectness 1, one-hot class."""
    lab = boxes_to_labels([[0.25, 0.5, 0.5, 0.25], [0.0, 0.0, 0.0, 0.1], [1.2, 0.1, 0.2, 0.2]],
                          [1, 0, 0], 4, 2, 2, 3, torch.float64)  # fmt: skip
    assert lab.shape == (2 * 8, 2, 4)
    v = lab.view(2, 8, 2, 4)
    # centre (0.5, 0.625) -> cell column 2, row 1; inside it (0.0, 0.25); size (2.0, 0.5)
    want = torch.tensor([0.0, 0.25, 2.0, 0.5, 1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    for a in range(2):
        assert torch.equal(v[a, :, 1, 2], want)
    v[:, :, 1, 2] = 0
    assert v.abs().max() == 0  # the empty box and the one outside the image are skipped
    with pytest.raises(ValueError, match=r"\[boxes_to_labels\] classes must give one class per"):
        boxes_to_labels([[0, 0, 1, 1]], [0, 1], 2, 2, 1, 2)
    with pytest.raises(ValueError, match=r"\[boxes_to_labels\] classes must lie in \[0, 2\)"):
        boxes_to_labels([[0, 0, 1, 1]], [2], 2, 2, 1, 2)


def test_predicted_boxes_decodes_the_parametrization() -> None:
    y = _predictions(1, 2 * 7, 2, 3, seed=21)
    anchors = [(1.0, 2.0), (3.0, 0.5)]
    boxes, conf, probs = predicted_boxes(y, anchors)
    v = y.view(1, 2, 7, 2, 3)
    a, i, j = 1, 1, 2
    cx, cy, w, h = boxes[0, a, i, j].tolist()
    assert cx == pytest.approx(j + torch.sigmoid(v[0, a, 0, i, j]).item())
    assert cy == pytest.approx(i + torch.sigmoid(v[0, a, 1, i, j]).item())
    assert w == pytest.approx(3.0 * torch.exp(v[0, a, 2, i, j]).item())
    assert h == pytest.approx(0.5 * torch.exp(v[0, a, 3, i, j]).item())
    assert conf[0, a, i, j].item() == pytest.approx(torch.sigmoid(v[0, a, 4, i, j]).item())
    assert_close(probs[0, a, :, i, j], torch.softmax(v[0, a, 5:, i, j], 0), "class probs")


# -- errors ---------------------------------------------------------------------------------


def _desc(**kw) -> m.YOLOLossDescriptor:
    args = dict(
        xy_loss_type=LT.MEAN_SQUARED_ERROR, wh_loss_type=LT.HUBER,
        confidence_loss_type=LT.SIGMOID_CROSS_ENTROPY, classes_loss_type=LT.SOFTMAX_CROSS_ENTROPY,
        reduction_type=RT.SUM, anchor_boxes=ANCHORS,
    )  # fmt: skip
    args.update(kw)
    return m.YOLOLossDescriptor(**args)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"xy_loss_type": 1}, TypeError, r"xy_loss_type must be a LossType, got int"),
        ({"wh_loss_type": LT.SOFTMAX_CROSS_ENTROPY}, ValueError,
         r"wh_loss_type must be a per-element loss type .*got SOFTMAX_CROSS_ENTROPY"),
        ({"confidence_loss_type": LT.COSINE_DISTANCE}, ValueError,
         r"confidence_loss_type must be a per-element loss type .*got COSINE_DISTANCE"),
        ({"xy_loss_type": LT.CATEGORICAL_CROSS_ENTROPY}, ValueError,
         r"xy_loss_type must be a per-element .*got CATEGORICAL_CROSS_ENTROPY"),
        ({"reduction_type": "sum"}, TypeError, r"reduction_type must be a ReductionType"),
        ({"anchor_boxes": []}, ValueError, r"anchor_boxes must hold one or more .*got 0 numbers"),
        ({"anchor_boxes": [1.0, 2.0, 3.0]}, ValueError,
         r"anchor_boxes must hold one or more .*got 3 numbers"),
        ({"anchor_boxes": [(1.0, 0.0)]}, ValueError,
         r"anchor box widths and heights must be finite and > 0, got \[1.0, 0.0\]"),
        ({"anchor_boxes": [(1.0, float("inf"))]}, ValueError,
         r"anchor box widths and heights must be finite and > 0"),
        ({"anchor_boxes": [(1.0, 2.0), (1.0,)]}, TypeError,
         r"anchor_boxes must be \(width, height\) pairs of numbers, got list"),
        ({"anchor_boxes": "ab"}, TypeError, r"anchor_boxes must be \(width, height\) pairs"),
        ({"number_of_anchor_boxes": 2}, ValueError,
         r"number_of_anchor_boxes must equal the number of \(width, height\) pairs in "
         r"anchor_boxes \(3\), got 2"),
        ({"number_of_anchor_boxes": 0}, ValueError, r"number_of_anchor_boxes must be >= 1, got 0"),
        ({"number_of_anchor_boxes": 3.0}, TypeError, r"number_of_anchor_boxes must be an int"),
        ({"rescore": 1}, TypeError, r"rescore must be a bool, got int"),
        ({"scale_xy": "1"}, TypeError, r"scale_xy must be a number, got str"),
        ({"scale_object": float("nan")}, ValueError, r"scale_object must be finite, got nan"),
        ({"scale_class": True}, TypeError, r"scale_class must be a number, got bool"),
        ({"min_iou_for_object_presence": float("inf")}, ValueError,
         r"min_iou_for_object_presence must be finite"),
        ({"max_iou_for_object_absence": None}, TypeError,
         r"max_iou_for_object_absence must be a number, got NoneType"),
    ],
)  # fmt: skip
def test_descriptor_errors(kwargs, error, match) -> None:
    with pytest.raises(error, match=r"\[YOLOLossDescriptor\] " + match):
        _desc(**kwargs)


def test_descriptor_setter_errors() -> None:
    d = _desc()
    with pytest.raises(TypeError, match=r"\[YOLOLossDescriptor\] xy_loss_descriptor must be a "
                       r"LossDescriptor, got LossType"):  # fmt: skip
        d.xy_loss_descriptor = LT.HUBER
    with pytest.raises(ValueError, match=r"\[YOLOLossDescriptor\] scale_wh must be finite"):
        d.scale_wh = float("-inf")
    with pytest.raises(ValueError, match=r"\[YOLOLossDescriptor\] anchor box widths"):
        d.anchor_boxes = [(-1.0, 1.0)]
    assert d.scale_wh == 10.0 and d.anchor_boxes == tuple(ANCHORS)  # unchanged by a failed set


def test_sub_loss_type_changed_later_is_refused_by_kernel_and_node() -> None:
    d = _desc()
    d.confidence_loss_descriptor = m.LossDescriptor(LT.SOFTMAX_CROSS_ENTROPY, RT.SUM)
    with pytest.raises(ValueError, match=r"\[YOLOLoss\] confidence_loss_descriptor must have a "
                       r"per-element loss type .*got SOFTMAX_CROSS_ENTROPY"):  # fmt: skip
        m.YOLOLoss(DEV, d)
    with pytest.raises(ValueError, match=r"\[YOLOLossNode\] confidence_loss_descriptor must"):
        m.YOLOLossNode(m.ImageNode(), d)
    with pytest.raises(TypeError, match=r"\[YOLOLoss\] loss_descriptor must be a "
                       r"YOLOLossDescriptor, got LossDescriptor"):  # fmt: skip
        m.YOLOLoss(DEV, m.LossDescriptor(LT.HUBER, RT.SUM))
    bad_sub = _desc()
    bad_sub.wh_loss_descriptor.delta = -1.0  # LossDescriptor fields are checked when copied
    with pytest.raises(ValueError, match=r"\[LossDescriptor\] delta must be > 0, got -1.0"):
        m.YOLOLoss(DEV, bad_sub)


def _try(kernel, y, labels, *, dst=None, batch=True):
    cb = DEV.new_command_queue().command_buffer()
    if batch:
        return kernel.encode_batch(cb, m.ImageBatch.from_tensor(y), labels, dst)
    return kernel.encode(cb, m.Image.from_tensor(y), labels, dst)


def test_encode_errors() -> None:
    k = m.YOLOLoss(DEV, _desc())
    n, h, w = 2, 2, 3
    y = _predictions(n, 21, h, w, seed=30)
    good = random_labels(n, ANCHORS, 2, h, w, seed=31)
    with pytest.raises(ValueError, match=r"\[YOLOLoss\] the predictions must have "
                       r"number_of_anchor_boxes · \(5 \+ classes\) = 3 · \(5 \+ classes\) "
                       r"channels with classes >= 1, got 20"):  # fmt: skip
        _try(k, y[:, :20], m.LossLabels(DEV, good))
    with pytest.raises(ValueError, match=r"classes >= 1, got 15"):
        _try(k, y[:, :15], m.LossLabels(DEV, good))
    with pytest.raises(ValueError, match=r"\[YOLOLoss\] labels must be float labels in the "
                       r"predictions' layout, got class indices"):  # fmt: skip
        _try(k, y, m.LossLabels(DEV, torch.zeros(n, h, w, dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"\[YOLOLoss\] labels must be 3x2 with at least the "
                       r"predictions' 21 channels, got 3x2x20"):  # fmt: skip
        _try(k, y, m.LossLabels(DEV, good[:, :20]))
    with pytest.raises(ValueError, match=r"labels must be 3x2 .* got 2x2x21"):
        _try(k, y, m.LossLabels(DEV, good[:, :, :, :2]))
    with pytest.raises(ValueError, match=r"\[YOLOLoss\] loss_image_size must be .*1.*1.*1.* for "
                       r"SUM, got"):  # fmt: skip
        _try(k, y, m.LossLabels(DEV, good, loss_image_size=m.Size(3, 2, 21)))
    none = m.YOLOLoss(DEV, _desc(reduction_type=RT.NONE))
    with pytest.raises(ValueError, match=r"loss_image_size must be .* for NONE"):
        _try(none, y, m.LossLabels(DEV, good, loss_image_size=m.Size(1, 1, 1)))
    with pytest.raises(ValueError, match=r"\[YOLOLoss\] the labels must hold one image per "
                       r"source image \(2\), got 1"):  # fmt: skip
        _try(k, y, m.LossLabels(DEV, good[:1]))
    mixed = [m.LossLabels(DEV, good[0], torch.ones_like(good[0])), m.LossLabels(DEV, good[1])]
    with pytest.raises(ValueError, match=r"\[YOLOLoss\] labels must all have weights or all "
                       r"none, got a mix"):  # fmt: skip
        _try(k, y, mixed)
    with pytest.raises(TypeError, match=r"\[YOLOLoss\] labels_batch must be a LossLabels or a "
                       r"sequence of them, got Tensor"):  # fmt: skip
        _try(k, y, good)
    with pytest.raises(TypeError, match=r"\[YOLOLoss\] labels must be a LossLabels, got Tensor"):
        _try(k, y, good, batch=False)
    small = m.ImageBatch.from_tensor(torch.zeros(n, 21, h, 2, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"\[YOLOLoss\] the destination must be 3x2x21 like the "
                       r"source, got 2x2x21"):  # fmt: skip
        _try(k, y, m.LossLabels(DEV, good), dst=small)
    k.offset = m.Offset(1, 0, 0)
    with pytest.raises(m.UnsupportedError, match=r"\[YOLOLoss\] a loss reads whole images"):
        _try(k, y, m.LossLabels(DEV, good))


def test_failed_encode_leaves_labels_without_loss() -> None:
    k = m.YOLOLoss(DEV, _desc())
    labels = m.LossLabels(DEV, random_labels(1, ANCHORS, 2, 2, 2, seed=32))
    with pytest.raises(ValueError):
        _try(k, _predictions(1, 20, 2, 2, seed=33), labels)
    with pytest.raises(ValueError, match=r"\[LossLabels\] loss_image needs a Loss encode"):
        labels.loss_image()
