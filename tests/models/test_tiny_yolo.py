"""TinyYOLOv2: its graphs against the PyTorch twin in float64 (inference, and one training step
with the YOLO loss, SGD momentum 0.9 and L2 weight decay 5e-4), and a short training run on
synthetic images in which the loss falls and the boxes are found."""

from __future__ import annotations

import pytest
import torch

import mpsnn as m
from mpsnn.models import TinyYOLOv2
from mpsnn.models.tiny_yolo import DEFAULT_ANCHOR_BOXES
from mpsnn.ops.yolo import yolo_loss_forward_backward
from tests.cnn._yolo_reference import Config, box_iou, centred_iou, loss_image
from tests.helpers import assert_close, run
from tests.models._helpers import DEV, F64, TOL, check_twin_holds_data_sources, logits

ANCHORS = [(1.0, 1.0), (1.6, 0.8), (0.8, 1.6)]


def _synthetic(n: int, size: int, seed: int):
    """Noise images with one bright rectangle each (class = the colour channel it lights up):
    images (N, 3, size, size), boxes ``[[x, y, w, h]]`` as image fractions, classes."""
    g = torch.Generator().manual_seed(seed)
    xs, boxes, classes = [], [], []
    for _ in range(n):
        x = torch.randn(3, size, size, generator=g) * 0.2
        bw, bh = torch.randint(size // 4, 3 * size // 4, (2,), generator=g).tolist()
        x0 = int(torch.randint(0, size - bw + 1, (1,), generator=g))
        y0 = int(torch.randint(0, size - bh + 1, (1,), generator=g))
        c = int(torch.randint(0, 2, (1,), generator=g))
        x[c, y0 : y0 + bh, x0 : x0 + bw] += 1.0
        xs.append(x)
        boxes.append([[x0 / size, y0 / size, bw / size, bh / size]])
        classes.append([c])
    return torch.stack(xs), boxes, classes


def test_architecture_and_inference_graph_equal_the_twin() -> None:
    """96x64 input (a 3x2 grid: the stride-1 pooling on an odd size), 2 anchors, 3 classes."""
    model = TinyYOLOv2(DEV, seed=1, dtype=torch.float64, classes=3,
                       anchor_boxes=[(1.0, 2.0), (2.0, 1.0)], input_shape=(3, 64, 96),
                       width=2)  # fmt: skip
    assert model.grid_size == (3, 2) and model.outputs == 16
    convs = [mod for mod, _ in model.layers if isinstance(mod, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [2, 4, 8, 16, 32, 64, 128, 128, 16]
    assert [c.kernel_size for c in convs] == [(3, 3)] * 8 + [(1, 1)]
    x = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    with torch.no_grad():
        expected = model.torch_module().eval()(x)
    got = logits(model, x).view(expected.shape)
    assert_close(got, expected, "TinyYOLOv2 predictions", TOL)
    full = TinyYOLOv2(DEV)
    assert full.anchor_boxes == DEFAULT_ANCHOR_BOXES and full.grid_size == (13, 13)
    assert full.outputs == 15 * 25
    assert [c.out_channels for c in full.twin.convs] == [16, 32, 64, 128, 256, 512, 1024, 1024]


def test_one_training_step_equals_torch() -> None:
    """One step of the training graph (YOLO loss, SGD momentum 0.9, L2 5e-4) against the twin
    trained one step by ``torch.optim.SGD`` on the reference loss (their first steps agree: MPS
    keeps ``lr·g`` as momentum, PyTorch ``g``, and both start from zero)."""
    n, lr = 3, 0.01
    model = TinyYOLOv2(DEV, TinyYOLOv2.optimizer(DEV, lr), seed=3, dtype=torch.float64,
                       classes=2, anchor_boxes=ANCHORS, input_shape=(3, 64, 64),
                       width=2)  # fmt: skip
    x, boxes, classes = _synthetic(n, 64, seed=4)
    x = x.double()
    twin = model.torch_module().train()
    opt = torch.optim.SGD(twin.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    cfg = Config(ANCHORS, scales=(10.0, 10.0, 5.0 / n, 100.0 / n, 2.0))
    labels = model.labels(boxes, classes, torch.float64)
    loss_image(twin(x), labels._labels, None, cfg).sum().backward()
    opt.step()

    graph = model.training_graph(n, storage=F64)
    cb = DEV.new_command_queue().command_buffer()
    assert graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)], [labels]) is None
    run(cb)
    after = model.torch_module()
    check_twin_holds_data_sources(model, after)
    got, want = after.state_dict(), twin.state_dict()
    for name, value in want.items():
        if not name.endswith("num_batches_tracked"):
            assert_close(got[name], value, f"{name} after one step", TOL)


def test_training_finds_the_boxes() -> None:
    """Eight 64x64 noise images with one rectangle each, trained for 40 full-batch steps (the
    model's loss and optimizer, learning rate 1e-3, width 2): the loss falls by more than half
    (what remains is mostly the confidence term, whose rescored soft targets keep the sigmoid
    cross entropy above their entropy); the XY, WH and class terms fall by more than 80 %; for
    every training image (at least 7 of 8) the responsible anchor's predicted box overlaps the
    labelled box with IoU > 0.5 and names its class."""
    n, size, steps = 8, 64, 40
    x, boxes, classes = _synthetic(n, size, seed=0)
    model = TinyYOLOv2(DEV, TinyYOLOv2.optimizer(DEV, 1e-3), seed=0, classes=2,
                       anchor_boxes=ANCHORS, input_shape=(3, size, size), width=2)  # fmt: skip
    graph = model.training_graph(n)
    params = model.loss_descriptor(n)._params("test")._replace(reduction=0)
    losses, parts, predictions = [], [], None
    for _ in range(steps):
        labels = model.labels(boxes, classes)
        cb = DEV.new_command_queue().command_buffer()
        graph.encode_batch(cb, [m.ImageBatch.from_tensor(x)], [labels])
        run(cb)
        losses.append(labels.loss_image().tensor.sum().item())
        predictions = graph.intermediate_images[0].tensor.clone()
        if len(parts) == 0 or len(losses) == steps:
            image, _ = yolo_loss_forward_backward(predictions, labels._labels, None, params)
            v = image.view(n, len(ANCHORS), 7, 2, 2)
            parts.append((v[:, :, 0:4].sum() + v[:, :, 5:].sum()).item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert parts[-1] < 0.2 * parts[0], parts
    found, named = 0, 0
    pred_boxes, _, probs = model.boxes(predictions)
    gw, gh = model.grid_size
    for i in range(n):
        bx, by, bw, bh = boxes[i][0]
        cx, cy, w, h = (bx + bw / 2) * gw, (by + bh / 2) * gh, bw * gw, bh * gh
        col, row = int(cx), int(cy)
        a = max(range(len(ANCHORS)), key=lambda k: centred_iou(ANCHORS[k], (w, h)))
        found += box_iou(tuple(pred_boxes[i, a, row, col].tolist()), (cx, cy, w, h)) > 0.5
        named += int(probs[i, a, :, row, col].argmax()) == classes[i][0]
    assert found >= 7 and named >= 7, (found, named)


def test_errors() -> None:
    with pytest.raises(ValueError, match=r"\[TinyYOLOv2\] classes, width and channels must be "
                       r"positive and the input's height and width positive multiples of 32, "
                       r"got input_shape=\(3, 48, 64\)"):  # fmt: skip
        TinyYOLOv2(DEV, input_shape=(3, 48, 64))
    with pytest.raises(ValueError, match=r"\[TinyYOLOv2\] .*classes=0"):
        TinyYOLOv2(DEV, classes=0)
    with pytest.raises(ValueError, match=r"\[YOLOLossDescriptor\] anchor box widths and heights "
                       r"must be finite and > 0"):  # fmt: skip
        TinyYOLOv2(DEV, anchor_boxes=[(0.0, 1.0)])
    model = TinyYOLOv2(DEV, classes=1, anchor_boxes=ANCHORS, input_shape=(3, 32, 32), width=1)
    with pytest.raises(ValueError, match=r"\[TinyYOLOv2\] batch_size must be >= 1, got 0"):
        model.training_graph(0)
