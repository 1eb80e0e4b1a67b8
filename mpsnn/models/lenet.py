"""LeNet-5 (28×28×1 images by default: Fashion-MNIST, MNIST).

conv 5×5 C→6 (SAME) + ReLU, max pool 2, conv 5×5 6→16 (VALID) + ReLU, max pool 2,
fully connected 5×5×16→120 + ReLU, 120→84 + ReLU, 84→classes. 61,706 parameters for 28×28×1
images and 10 classes. ReLU replaces the original's tanh/sigmoid, max pooling its subsampling.

Other image sizes: the poolings keep whole windows only (``SIZE_VALID_ONLY``: ``floor(n / 2)``,
PyTorch's ``MaxPool2d(2)``), so a side of ``n`` pixels leaves ``floor((floor(n / 2) - 4) / 2)``
for the first fully connected layer: heights and widths of at least 12.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mpsnn.cnn.convolution import ConvolutionDescriptor
from mpsnn.core.device import Device
from mpsnn.core.geometry import DefaultPadding, PaddingMethod
from mpsnn.graph import ImageNode
from mpsnn.models.base import Model, conv_source, image_shape, seeded
from mpsnn.nodes import ConvolutionNode, FullyConnectedNode, NeuronReLUNode, PoolingMaxNode

__all__ = ["LeNet5"]

_VALID = DefaultPadding(PaddingMethod.SIZE_VALID_ONLY)


class LeNet5(Model):
    """LeNet-5 (see the module docstring).

    Args:
        device: where the weights live.
        optimizer: the optimizer every layer's data source holds (None: no updates).
        seed: seeds the initial weights (PyTorch's default initializers).
        dtype: the weights' dtype (float32; float64 for verification).
        classes: the number of logits.
        input_shape: ``(channels, height, width)`` of one image (height and width >= 12).
    """

    name = "lenet5"
    input_shape = (1, 28, 28)

    def __init__(
        self,
        device: Device,
        optimizer: Any = None,
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        classes: int = 10,
        input_shape: tuple[int, int, int] = (1, 28, 28),
    ) -> None:
        super().__init__(device)
        why = "two 2×2 poolings around a 5×5 convolution without padding"
        channels, height, width = image_shape(self, input_shape, classes, 12, why)
        self.input_shape = (channels, height, width)
        self.classes = classes
        h, w = (height // 2 - 4) // 2, (width // 2 - 4) // 2  # what the fully connected sees
        self.twin = seeded(seed, lambda: nn.Sequential(
            nn.Conv2d(channels, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(16 * h * w, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, classes),
        ))  # fmt: skip
        c = ConvolutionDescriptor
        t = self.twin
        specs = [(t[0], c(5, 5, channels, 6)), (t[3], c(5, 5, 6, 16)), (t[7], c(w, h, 16, 120)),
                 (t[9], c(1, 1, 120, 84)), (t[11], c(1, 1, 84, classes))]  # fmt: skip
        self.layers = [(mod, conv_source(mod, d, device, optimizer, dtype)) for mod, d in specs]

    def recipe(self, image: ImageNode, *, training: bool) -> ImageNode:
        conv1, conv2, fc1, fc2, fc3 = self.data_sources
        h = NeuronReLUNode(ConvolutionNode(image, conv1).result_image).result_image
        h = _pool(h)
        node = ConvolutionNode(h, conv2)
        node.padding_policy = _VALID
        h = _pool(NeuronReLUNode(node.result_image).result_image)
        h = NeuronReLUNode(FullyConnectedNode(h, fc1).result_image).result_image
        h = NeuronReLUNode(FullyConnectedNode(h, fc2).result_image).result_image
        return FullyConnectedNode(h, fc3).result_image


def _pool(x: ImageNode) -> ImageNode:
    """Max pooling 2×2 stride 2 over whole windows only (PyTorch's ``MaxPool2d(2)``)."""
    node = PoolingMaxNode(x, 2)
    node.padding_policy = _VALID
    return node.result_image
