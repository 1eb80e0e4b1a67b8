"""Tiny-YOLOv2, the object detector Apple's Turi Create trains with ``MPSCNNYOLOLoss``.

Architecture (``w`` = ``width``, 16 by default: 16, 32, ..., 1024 channels):

* eight blocks of conv 3×3 (SAME, no bias) + batch normalization + leaky ReLU (``a = 0.1``)
  with w, 2w, 4w, 8w, 16w, 32w, 64w, 64w channels;
* max pooling 2×2 stride 2 after blocks 1-5 (416 → 13), and 2×2 stride 1 with TensorFlow's
  SAME padding after block 6 (one pixel after the image on the right and the bottom, which max
  pooling ignores: `PoolingMaxNode` with CLAMP edges and the padding remainder bottom-right);
* a final conv 1×1 with bias to ``A·(5 + classes)`` channels: per grid cell and anchor box
  ``tx, ty, tw, th, tc`` and the class logits (the layout of `mpsnn.YOLOLoss`).

The training graph ends in a `YOLOLossNode` (`loss_descriptor`: Turi Create's settings:
XY mean squared error, WH Huber, confidence sigmoid cross entropy, classes softmax cross
entropy, SUM, ``scale_no_object`` and ``scale_object`` divided by the batch size); its labels are
one `LossLabels` per batch or per image, the size of the output (`labels`), with
``loss_image_size`` (1, 1, 1). `optimizer` is SGD with momentum 0.9 and L2 weight decay 5e-4
through the optimizer descriptor. Anchor boxes are in grid cells; the default is Turi Create's
15 (three aspect ratios at five scales). Input sizes must be multiples of 32.

The PyTorch twin writes the stride-1 pooling as ``max_pool2d(pad(x, (0, 1, 0, 1),
"replicate"), 2, 1)``; convolutions keep PyTorch's default initialization (seeded), batch
normalization gamma 1, beta 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mpsnn.cnn.convolution import ConvolutionDescriptor
from mpsnn.cnn.loss import LossType, ReductionType
from mpsnn.cnn.loss_labels import LossLabels
from mpsnn.cnn.yolo import YOLOLossDescriptor
from mpsnn.core.descriptor import FeatureChannelFormat
from mpsnn.core.device import Device
from mpsnn.core.geometry import DefaultPadding, PaddingMethod, Size
from mpsnn.graph import Graph, ImageNode
from mpsnn.models.base import Model, batch_norm_source, conv_source, seeded
from mpsnn.nodes import (
    BatchNormalizationNode,
    ConvolutionNode,
    NeuronReLUNode,
    PoolingMaxNode,
    YOLOLossNode,
)
from mpsnn.ops.yolo import boxes_to_labels, predicted_boxes
from mpsnn.optim import SGD, OptimizerDescriptor, RegularizationType

__all__ = ["DEFAULT_ANCHOR_BOXES", "TinyYOLOv2"]

DEFAULT_ANCHOR_BOXES: tuple[tuple[float, float], ...] = (
    (1.0, 2.0), (1.0, 1.0), (2.0, 1.0),
    (2.0, 4.0), (2.0, 2.0), (4.0, 2.0),
    (4.0, 8.0), (4.0, 4.0), (8.0, 4.0),
    (8.0, 16.0), (8.0, 8.0), (16.0, 8.0),
    (16.0, 32.0), (16.0, 16.0), (32.0, 16.0),
)  # fmt: skip

# TensorFlow's SAME for the 2x2 stride-1 pooling: the one padding pixel after the image.
_SAME_AFTER = DefaultPadding(
    PaddingMethod.ALIGN_CENTERED
    | PaddingMethod.ADD_REMAINDER_TO_BOTTOM_RIGHT
    | PaddingMethod.SIZE_SAME
)


class TinyYOLOv2Twin(nn.Module):
    """The PyTorch Tiny-YOLOv2 the mpsnn model mirrors."""

    def __init__(self, in_channels: int, width: int, outputs: int) -> None:
        super().__init__()
        channels = [width << i for i in range(7)] + [width << 6]
        cins = [in_channels, *channels[:-1]]
        self.convs = nn.ModuleList(
            nn.Conv2d(cin, cout, 3, padding=1, bias=False)
            for cin, cout in zip(cins, channels, strict=True)
        )
        self.bns = nn.ModuleList(nn.BatchNorm2d(c) for c in channels)
        self.head = nn.Conv2d(channels[-1], outputs, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns, strict=True)):
            x = F.leaky_relu(bn(conv(x)), 0.1)
            if i < 5:
                x = F.max_pool2d(x, 2, 2)
            elif i == 5:
                x = F.max_pool2d(F.pad(x, (0, 1, 0, 1), mode="replicate"), 2, 1)
        return self.head(x)


class TinyYOLOv2(Model):
    """Tiny-YOLOv2 (see the module docstring).

    Args:
        device: where the weights live.
        optimizer: the optimizer every layer's data source holds (None: no updates; see
            `optimizer`).
        seed: seeds the initial weights.
        dtype: the weights' dtype (float32; float64 for verification).
        classes: the number of object classes ``K``.
        anchor_boxes: ``(width, height)`` of each anchor box, in grid cells.
        input_shape: ``(channels, height, width)``; height and width multiples of 32.
        width: the first block's channel count (16: Tiny-YOLOv2; smaller for quick tests).

    Attributes:
        grid_size: ``(grid width, grid height)`` of the output (the input's size / 32).
        outputs: the output channels, ``len(anchor_boxes) · (5 + classes)``.
    """

    name = "tiny_yolov2"
    input_shape = (3, 416, 416)

    def __init__(
        self,
        device: Device,
        optimizer: Any = None,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        classes: int = 20,
        anchor_boxes: Sequence[tuple[float, float]] = DEFAULT_ANCHOR_BOXES,
        input_shape: tuple[int, int, int] = (3, 416, 416),
        width: int = 16,
    ) -> None:
        super().__init__(device)
        channels, height, wide = (int(v) for v in input_shape)
        if min(channels, classes, width) < 1 or height < 32 or wide < 32 or (height | wide) % 32:
            raise ValueError(
                f"[TinyYOLOv2] classes, width and channels must be positive and the input's "
                f"height and width positive multiples of 32, got input_shape={input_shape!r}, "
                f"classes={classes!r}, width={width!r}"
            )
        # the anchors' checks are the loss descriptor's
        self.anchor_boxes = self._descriptor(1, anchor_boxes).anchor_boxes
        self.input_shape = (channels, height, wide)
        self.classes = classes
        self.width = width
        self.grid_size = (wide // 32, height // 32)
        self.outputs = len(self.anchor_boxes) * (5 + classes)
        self.twin = seeded(seed, lambda: TinyYOLOv2Twin(channels, width, self.outputs))
        t = self.twin
        for conv, bn in zip(t.convs, t.bns, strict=True):
            d = ConvolutionDescriptor(3, 3, conv.in_channels, conv.out_channels)
            self.layers.append((conv, conv_source(conv, d, device, optimizer, dtype)))
            self.layers.append((bn, batch_norm_source(bn, device, optimizer, dtype)))
        head = ConvolutionDescriptor(1, 1, t.head.in_channels, self.outputs)
        self.layers.append((t.head, conv_source(t.head, head, device, optimizer, dtype)))

    @staticmethod
    def optimizer(device: Device, learning_rate: float = 1e-3) -> SGD:
        """SGD with momentum 0.9 and L2 weight decay 5e-4 (through the descriptor)."""
        desc = OptimizerDescriptor(
            learning_rate,
            regularization_type=RegularizationType.L2,
            regularization_scale=5e-4,
        )
        return SGD(device, momentum_scale=0.9, descriptor=desc)

    def recipe(self, image: ImageNode, *, training: bool) -> ImageNode:
        sources = iter(self.data_sources)
        h = image
        for i in range(8):
            conv = ConvolutionNode(h, next(sources))
            bn = BatchNormalizationNode(conv.result_image, next(sources))
            h = NeuronReLUNode(bn.result_image, a=0.1).result_image
            if i < 5:
                h = PoolingMaxNode(h, 2).result_image
            elif i == 5:
                pool = PoolingMaxNode(h, 2, 1)
                pool.padding_policy = _SAME_AFTER
                h = pool.result_image
        return ConvolutionNode(h, next(sources)).result_image

    # -- the loss -------------------------------------------------------------------------

    def _descriptor(
        self, batch_size: int, anchor_boxes: Sequence[tuple[float, float]]
    ) -> YOLOLossDescriptor:
        d = YOLOLossDescriptor(
            LossType.MEAN_SQUARED_ERROR, LossType.HUBER, LossType.SIGMOID_CROSS_ENTROPY,
            LossType.SOFTMAX_CROSS_ENTROPY, ReductionType.SUM, anchor_boxes,
        )  # fmt: skip
        d.scale_no_object /= batch_size
        d.scale_object /= batch_size
        return d

    def loss_descriptor(self, batch_size: int) -> YOLOLossDescriptor:
        """Turi Create's YOLO loss for a batch of ``batch_size`` images (module docstring)."""
        return self._descriptor(batch_size, self.anchor_boxes)

    def training_graph(  # type: ignore[override]
        self,
        batch_size: int,
        loss: YOLOLossDescriptor | None = None,
        *,
        storage: FeatureChannelFormat = FeatureChannelFormat.FLOAT32,
        node_handler: Callable[..., None] | None = None,
    ) -> Graph:
        """The training graph: one ``encode_batch(cb, [images], [labels])`` runs the forward
        pass, the YOLO loss (``loss``, default `loss_descriptor`), every gradient and the
        updates. The predictions are exported: ``graph.intermediate_images[0]`` after a
        step."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"[TinyYOLOv2] batch_size must be >= 1, got {batch_size!r}")
        image = ImageNode("image")
        predictions = self.recipe(image, training=True)
        predictions.export_from_graph = True
        node = YOLOLossNode(predictions, loss or self.loss_descriptor(batch_size))
        exits = node.training_graph(None, node_handler)
        graph = Graph.from_results(self.device, [e.result_image for e in exits],
                                   [False] * len(exits))  # fmt: skip
        graph.format = storage
        graph.label = f"{self.name} training"
        return graph

    # -- labels and boxes ---------------------------------------------------------------------

    def labels(
        self,
        boxes: Sequence[Any],
        classes: Sequence[Any],
        dtype: torch.dtype = torch.float32,
    ) -> LossLabels:
        """One `LossLabels` for a batch: ``boxes[i]`` (B_i, 4) ``(x, y, width, height)`` as
        fractions of image ``i``, ``classes[i]`` their class indices
        (`mpsnn.ops.yolo.boxes_to_labels`), loss image size (1, 1, 1)."""
        gw, gh = self.grid_size
        a = len(self.anchor_boxes)
        t = torch.stack([
            boxes_to_labels(b, c, gw, gh, a, self.classes, dtype)
            for b, c in zip(boxes, classes, strict=True)
        ])  # fmt: skip
        return LossLabels(self.device, t, loss_image_size=Size(1, 1, 1))

    def boxes(self, predictions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Decoded predictions (`mpsnn.ops.yolo.predicted_boxes`): boxes (N, A, H, W, 4)
        ``(cx, cy, w, h)`` in grid cells, confidences (N, A, H, W), class probabilities
        (N, A, K, H, W)."""
        return predicted_boxes(predictions, self.anchor_boxes)
