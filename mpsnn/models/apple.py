"""The network of Apple's MPS training sample (an MNIST classifier trained with
``MPSNNGraph``), for images fed as raw bytes (UNORM8: the kernels read k/255); 28×28×1 by
default.

conv 5×5 C→32 (ADD_REMAINDER_TO_TOP_LEFT | ALIGN_CENTERED | SIZE_SAME) + ReLU, max pool 2/2
(``DefaultPadding.tensorflow_average_pooling()``, as the sample), conv 5×5 32→64 + ReLU, max
pool, fully connected (H/4)×(W/4)×64→1024 + ReLU, dropout (keep 0.5, seed 1; training only),
fully connected 1024→classes. Weights uniform in [−0.2, 0.2), biases 0.1. 3,274,634 parameters
for 28×28×1 images and 10 classes.

Other image sizes: the sample's pooling is TensorFlow's SAME (``ceil(n / 2)``, the window past
an odd edge reads the clamped edge pixel), PyTorch's ``MaxPool2d(2, ceil_mode=True)``: any
size works, the first fully connected layer covering ``ceil(ceil(n / 2) / 2)`` pixels a side.
The labels are class indices (the sample's 12-channel one-hot labels are
``examples/apple_mnist.py``'s), so any number of classes works.
``examples/apple_mnist.py`` is the full port of the sample (its own data source class, its
12-channel labels and loop); this model is the network, for ``mpsnn train --model apple-mnist``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mpsnn.cnn.convolution import ConvolutionDescriptor
from mpsnn.core.descriptor import FeatureChannelFormat
from mpsnn.core.device import Device
from mpsnn.core.geometry import DefaultPadding, PaddingMethod, Size
from mpsnn.graph import ImageNode
from mpsnn.models.base import Model, conv_source, image_shape, seeded
from mpsnn.nodes import (
    ConvolutionNode,
    DropoutNode,
    FullyConnectedNode,
    NeuronReLUNode,
    PoolingMaxNode,
)

__all__ = ["AppleMNIST"]

_SAME = DefaultPadding(
    PaddingMethod.ADD_REMAINDER_TO_TOP_LEFT | PaddingMethod.ALIGN_CENTERED | PaddingMethod.SIZE_SAME
)


def _init(module: nn.Module) -> None:
    """The sample's initialization: weights uniform in [-0.2, 0.2), biases 0.1."""
    if isinstance(module, nn.Conv2d | nn.Linear):
        nn.init.uniform_(module.weight, -0.2, 0.2)
        nn.init.constant_(module.bias, 0.1)


class AppleMNIST(Model):
    """The Apple sample's network (see the module docstring); arguments as `LeNet5`'s (any
    image size)."""

    name = "apple-mnist"
    input_shape = (1, 28, 28)
    input_format = FeatureChannelFormat.UNORM8

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
        channels, height, width = image_shape(self, input_shape, classes, 1, "an image")
        self.input_shape = (channels, height, width)
        self.classes = classes
        h, w = -(-height // 4), -(-width // 4)  # ceil(ceil(n / 2) / 2) == ceil(n / 4)

        def build() -> nn.Module:
            net = nn.Sequential(
                nn.Conv2d(channels, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
                nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2, ceil_mode=True),
                nn.Flatten(), nn.Linear(h * w * 64, 1024), nn.ReLU(), nn.Dropout(0.5),
                nn.Linear(1024, classes),
            )  # fmt: skip
            net.apply(_init)
            return net

        self.twin = seeded(seed, build)
        c = ConvolutionDescriptor
        t = self.twin
        specs = [(t[0], c(5, 5, channels, 32)), (t[3], c(5, 5, 32, 64)),
                 (t[7], c(w, h, 64, 1024)), (t[10], c(1, 1, 1024, classes))]  # fmt: skip
        self.layers = [(mod, conv_source(mod, d, device, optimizer, dtype)) for mod, d in specs]

    def recipe(self, image: ImageNode, *, training: bool) -> ImageNode:
        conv1, conv2, fc1, fc2 = self.data_sources
        x = image
        for data in (conv1, conv2):
            conv = ConvolutionNode(x, data)
            conv.padding_policy = _SAME
            pool = PoolingMaxNode(NeuronReLUNode(conv.result_image).result_image, 2, 2)
            pool.padding_policy = DefaultPadding.tensorflow_average_pooling()
            x = pool.result_image
        x = NeuronReLUNode(FullyConnectedNode(x, fc1).result_image).result_image
        if training:
            x = DropoutNode(x, keep_probability=0.5, seed=1, mask_stride_in_pixels=Size(1, 1, 1))
            x = x.result_image
        return FullyConnectedNode(x, fc2).result_image
