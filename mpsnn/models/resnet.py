"""ResNet-18 for small images (CIFAR-10 32×32×3, Fashion-MNIST 28×28×1), CIFAR style.

Architecture (``w`` = ``width``, 64 by default):

* stem: conv 3×3 stride 1, C→w, + batch norm + ReLU (no 7×7 convolution, no max pooling);
* four stages of two BasicBlocks with w, 2w, 4w, 8w channels; the first block of stages 2-4
  has stride 2. A BasicBlock is conv 3×3 (stride s) → BN → ReLU → conv 3×3 → BN, plus the
  shortcut (the identity, or conv 1×1 stride s + BN where the shape changes), then ReLU;
* global average pooling over the last stage's H×W, then fully connected 8w → ``classes``.

Convolutions have no bias (torchvision's choice: the batch norm after each has beta). 11.17 M
parameters for w = 64 and 10 classes. The PyTorch twin is torchvision's BasicBlock layout,
written here; convolutions are initialized as torchvision does (Kaiming normal, fan out),
batch norm with gamma 1, beta 0.

Layout and padding decisions (each checked against the twin in ``tests/models``):

* every convolution runs under MPS's default policy, set explicitly (``_SAME``: centred,
  remainder top-left, SIZE_SAME). Per axis it gives ``ceil(n / s)`` outputs and puts
  ``floor((pad + 1) / 2)`` of the ``pad = (dst - 1) s + k - n`` padding pixels before the image:
  3×3 stride 1 → 1 before (PyTorch ``padding=1``); 3×3 stride 2 → pad is 1 (n even) or 2 (n
  odd), 1 before in both cases (``padding=1, stride=2``: 32→16, 28→14, 14→7, 7→4); 1×1 stride
  2 → pad is -1 or 0, 0 before, so the taps are pixels 0, 2, 4, … as PyTorch's. (Remainder
  bottom-right would shift both strided convolutions one pixel right/down on even sizes: the
  1×1 shortcut would sample 1, 3, 5, ….) Sizes: 32→32→16→8→4 and 28→28→14→7→4;
* global average pooling is `PoolingAverageNode` with kernel = stride = the last stage's
  height/width: one window covering the image exactly (offset ``k // 2`` from the policy), no
  tap outside it, so the CLAMP/ZERO edge rule never applies and the divisor is H·W, as
  ``F.adaptive_avg_pool2d(x, 1)``;
* ReLU after a batch norm fuses into it (the graph's fusion pass); the ReLU after each
  `AdditionNode` runs as its own neuron kernel.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mpsnn.cnn.convolution import ConvolutionDescriptor
from mpsnn.core.device import Device
from mpsnn.core.geometry import DefaultPadding, PaddingMethod
from mpsnn.graph import ImageNode
from mpsnn.models.base import Model, batch_norm_source, conv_source, seeded
from mpsnn.nodes import (
    AdditionNode,
    BatchNormalizationNode,
    ConvolutionNode,
    FullyConnectedNode,
    NeuronReLUNode,
    PoolingAverageNode,
)

__all__ = ["ResNet18"]

_SAME = DefaultPadding(
    PaddingMethod.ALIGN_CENTERED | PaddingMethod.ADD_REMAINDER_TO_TOP_LEFT | PaddingMethod.SIZE_SAME
)


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: conv3×3-BN-ReLU-conv3×3-BN, plus the shortcut, ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Sequential | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18Twin(nn.Module):
    """The PyTorch ResNet-18 (CIFAR stem) the mpsnn model mirrors."""

    def __init__(self, in_channels: int, classes: int, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        stages: list[nn.Sequential] = []
        cin = width
        for i in range(4):
            cout, stride = width << i, 1 if i == 0 else 2
            stages.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, classes)
        for mod in self.modules():
            if isinstance(mod, nn.Conv2d):
                nn.init.kaiming_normal_(mod.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.layer4(self.layer3(self.layer2(self.layer1(h))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


def _half(n: int) -> int:
    """The size after a 3×3 stride-2 convolution with padding 1: ``ceil(n / 2)``."""
    return (n + 1) // 2


class ResNet18(Model):
    """ResNet-18, CIFAR style (see the module docstring).

    Args:
        device: where the weights live.
        optimizer: the optimizer every layer's data source holds (None: no updates).
        seed: seeds the initial weights.
        dtype: the weights' dtype (float32; float64 for verification).
        classes: the number of logits.
        input_shape: ``(channels, height, width)`` of one image: (3, 32, 32) for CIFAR,
            (1, 28, 28) for Fashion-MNIST; any size of at least 1×1 works.
        width: the stem's channel count (64: ResNet-18; smaller for quick tests).
    """

    name = "resnet18"
    input_shape = (3, 32, 32)
    # The stem convolution's result (64 channels at full resolution, 64 MiB in bfloat16 at
    # batch 512) is kept for its normalization's gradient, the last of the backward: the
    # training graph frees it after the forward and runs the stem again (3 input channels: a
    # fraction of a block's convolution) just before the backward needs it.
    recompute_input_convolution = True

    def __init__(
        self,
        device: Device,
        optimizer: Any = None,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        classes: int = 10,
        input_shape: tuple[int, int, int] = (3, 32, 32),
        width: int = 64,
    ) -> None:
        super().__init__(device)
        channels, height, wide = (int(v) for v in input_shape)
        if min(channels, height, wide, classes, width) < 1:
            raise ValueError(
                f"[ResNet18] input_shape, classes and width must be positive, got "
                f"input_shape={input_shape!r}, classes={classes!r}, width={width!r}"
            )
        self.input_shape = (channels, height, wide)
        self.classes = classes
        self.width = width
        # The last stage's size: three halvings (stages 2-4).
        self.pool_size = (_half(_half(_half(wide))), _half(_half(_half(height))))
        self.twin = seeded(seed, lambda: ResNet18Twin(channels, classes, width))

        def conv(mod: nn.Conv2d) -> tuple[nn.Module, Any]:
            k = mod.kernel_size[0]
            s = mod.stride[0]
            d = ConvolutionDescriptor(k, k, mod.in_channels, mod.out_channels, s, s)
            return mod, conv_source(mod, d, device, optimizer, dtype)

        def bn(mod: nn.BatchNorm2d) -> tuple[nn.Module, Any]:
            return mod, batch_norm_source(mod, device, optimizer, dtype)

        t = self.twin
        self.layers = [conv(t.conv1), bn(t.bn1)]
        for stage in (t.layer1, t.layer2, t.layer3, t.layer4):
            for block in stage:
                self.layers += [conv(block.conv1), bn(block.bn1), conv(block.conv2),
                                bn(block.bn2)]  # fmt: skip
                if block.downsample is not None:
                    self.layers += [conv(block.downsample[0]), bn(block.downsample[1])]
        fc = ConvolutionDescriptor(1, 1, t.fc.in_features, classes)
        self.layers.append((t.fc, conv_source(t.fc, fc, device, optimizer, dtype)))

    def recipe(self, image: ImageNode, *, training: bool) -> ImageNode:
        sources = iter(self.data_sources)

        def conv_bn(x: ImageNode) -> ImageNode:
            node = ConvolutionNode(x, next(sources))
            node.padding_policy = _SAME
            return BatchNormalizationNode(node.result_image, next(sources)).result_image

        h = NeuronReLUNode(conv_bn(image)).result_image
        for stage in (self.twin.layer1, self.twin.layer2, self.twin.layer3, self.twin.layer4):
            for block in stage:
                x = h
                h = conv_bn(NeuronReLUNode(conv_bn(x)).result_image)
                shortcut = x if block.downsample is None else conv_bn(x)
                h = NeuronReLUNode(AdditionNode(h, shortcut).result_image).result_image
        pw, ph = self.pool_size
        pool = PoolingAverageNode(h, 1, kernel_width=pw, kernel_height=ph,
                                  stride_in_pixels_x=pw, stride_in_pixels_y=ph)  # fmt: skip
        return FullyConnectedNode(pool.result_image, next(sources)).result_image
