"""A small CNN for 28×28×1 images: mpsnn's default model for ``mpsnn train``.

conv 3×3 1→32 (SAME) + ReLU, max pool 2, conv 3×3 32→64 (SAME) + ReLU, max pool 2, fully
connected 7×7×64→128 + ReLU, 128→classes. 421,642 parameters for 10 classes; about 91.5–92%
on Fashion-MNIST after 5 epochs of Adam with a per-epoch learning-rate decay.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mpsnn.cnn.convolution import ConvolutionDescriptor
from mpsnn.core.device import Device
from mpsnn.graph import (
    ConvolutionNode,
    FullyConnectedNode,
    ImageNode,
    NeuronReLUNode,
    PoolingMaxNode,
)
from mpsnn.models.base import Model, conv_source, seeded

__all__ = ["SmallCNN"]


class SmallCNN(Model):
    """The small CNN (see the module docstring). Arguments as `LeNet5`'s."""

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
    ) -> None:
        super().__init__(device)
        self.classes = classes
        self.twin = seeded(seed, lambda: nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(7 * 7 * 64, 128), nn.ReLU(), nn.Linear(128, classes),
        ))  # fmt: skip
        c = ConvolutionDescriptor
        t = self.twin
        specs = [(t[0], c(3, 3, 1, 32)), (t[3], c(3, 3, 32, 64)), (t[7], c(7, 7, 64, 128)),
                 (t[9], c(1, 1, 128, classes))]  # fmt: skip
        self.layers = [(mod, conv_source(mod, d, device, optimizer, dtype)) for mod, d in specs]

    def recipe(self, image: ImageNode, *, training: bool) -> ImageNode:
        conv1, conv2, fc1, fc2 = self.data_sources
        h = NeuronReLUNode(ConvolutionNode(image, conv1).result_image).result_image
        h = PoolingMaxNode(h, 2).result_image
        h = NeuronReLUNode(ConvolutionNode(h, conv2).result_image).result_image
        h = PoolingMaxNode(h, 2).result_image
        h = NeuronReLUNode(FullyConnectedNode(h, fc1).result_image).result_image
        return FullyConnectedNode(h, fc2).result_image
