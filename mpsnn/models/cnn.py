"""A small CNN: mpsnn's default model for ``mpsnn train`` (28×28×1 images by default).

conv 3×3 C→32 (SAME) + ReLU, max pool 2, conv 3×3 32→64 (SAME) + ReLU, max pool 2, fully
connected (H/4)×(W/4)×64→128 + ReLU, 128→classes. 421,642 parameters for 28×28×1 images and 10
classes; about 91.5–92% on Fashion-MNIST after 5 epochs of Adam with a per-epoch learning-rate
decay.

Other image sizes: the poolings keep whole windows only (``SIZE_VALID_ONLY``: ``floor(n / 2)``,
PyTorch's ``MaxPool2d(2)``; on even sizes the same windows as MPS's default policy), so any
height and width of at least 4 works; the first fully connected layer covers what is left.
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

__all__ = ["SmallCNN"]

_VALID = DefaultPadding(PaddingMethod.SIZE_VALID_ONLY)


class SmallCNN(Model):
    """The small CNN (see the module docstring). Arguments as `LeNet5`'s (images of at least
    4×4)."""

    name = "cnn"
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
        channels, height, width = image_shape(self, input_shape, classes, 4, "two 2×2 poolings")
        self.input_shape = (channels, height, width)
        self.classes = classes
        h, w = height // 4, width // 4  # after the two poolings
        self.twin = seeded(seed, lambda: nn.Sequential(
            nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(h * w * 64, 128), nn.ReLU(), nn.Linear(128, classes),
        ))  # fmt: skip
        c = ConvolutionDescriptor
        t = self.twin
        specs = [(t[0], c(3, 3, channels, 32)), (t[3], c(3, 3, 32, 64)), (t[7], c(w, h, 64, 128)),
                 (t[9], c(1, 1, 128, classes))]  # fmt: skip
        self.layers = [(mod, conv_source(mod, d, device, optimizer, dtype)) for mod, d in specs]

    def recipe(self, image: ImageNode, *, training: bool) -> ImageNode:
        conv1, conv2, fc1, fc2 = self.data_sources
        h = NeuronReLUNode(ConvolutionNode(image, conv1).result_image).result_image
        h = _pool(h)
        h = NeuronReLUNode(ConvolutionNode(h, conv2).result_image).result_image
        h = _pool(h)
        h = NeuronReLUNode(FullyConnectedNode(h, fc1).result_image).result_image
        return FullyConnectedNode(h, fc2).result_image


def _pool(x: ImageNode) -> ImageNode:
    """Max pooling 2×2 stride 2 over whole windows only (PyTorch's ``MaxPool2d(2)``)."""
    node = PoolingMaxNode(x, 2)
    node.padding_policy = _VALID
    return node.result_image
