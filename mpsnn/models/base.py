"""`Model`: a network written once as an mpsnn node recipe, with its PyTorch twin.

A model owns its trainable layers' data sources (the weights, and the optimizer that updates
them inside a training step) and the node recipe from an input `ImageNode` to the logits. It
makes the two graphs a training loop needs — the training graph (forward, loss, gradients,
updates in one ``encode_batch``) and the inference graph (the same nodes up to the logits,
sharing the data sources) — and the equivalent ``torch.nn.Module`` with the same weights, so
that every model can be checked against, and benchmarked beside, PyTorch.

Weights are initialized by the PyTorch twin's own initializers (seeded), then copied into the
data sources: an mpsnn model and its twin start from identical weights.

Layouts: mpsnn convolution weights are OHWI (``[out][kh][kw][in]``), PyTorch's OIHW; a fully
connected layer's weights are those of a convolution whose kernel covers its whole input, so
``nn.Linear(C*H*W, O)`` after ``nn.Flatten`` (which flattens CHW) maps to OHWI
``weight.view(O, C, H, W).permute(0, 2, 3, 1)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mpsnn.cnn.convolution import ConvolutionDescriptor, TensorConvolutionDataSource
from mpsnn.cnn.loss import LossDescriptor, LossType, ReductionType
from mpsnn.cnn.normalization import TensorBatchNormalizationDataSource
from mpsnn.core.descriptor import FeatureChannelFormat
from mpsnn.core.device import Device
from mpsnn.graph import Graph, ImageNode, LossNode

__all__ = ["Model", "conv_source", "batch_norm_source"]


def conv_source(
    module: nn.Conv2d | nn.Linear,
    descriptor: ConvolutionDescriptor,
    device: Device,
    optimizer: Any,
    dtype: torch.dtype,
) -> TensorConvolutionDataSource:
    """A convolution data source holding ``module``'s weights (OIHW or flattened-CHW → OHWI)."""
    d = descriptor
    w = module.weight.detach().reshape(
        d.output_feature_channels, d.input_feature_channels // d.groups, d.kernel_height,
        d.kernel_width,
    )  # fmt: skip
    bias = None if module.bias is None else module.bias.detach()
    # copies: the data source's values are trained in place, the twin keeps the initial ones
    return TensorConvolutionDataSource(
        d,
        w.permute(0, 2, 3, 1).to(device.torch_device, dtype, copy=True),
        None if bias is None else bias.to(device.torch_device, dtype, copy=True),
        optimizer,
    )


def batch_norm_source(
    module: nn.BatchNorm2d, device: Device, optimizer: Any, dtype: torch.dtype
) -> TensorBatchNormalizationDataSource:
    """A batch-normalization data source holding ``module``'s gamma, beta and statistics."""
    t = device.torch_device
    return TensorBatchNormalizationDataSource(  # copies, as for convolutions
        module.num_features,
        gamma=module.weight.detach().to(t, dtype, copy=True),
        beta=module.bias.detach().to(t, dtype, copy=True),
        mean=module.running_mean.detach().to(t, dtype, copy=True),
        variance=module.running_var.detach().to(t, dtype, copy=True),
        epsilon=module.eps,
        momentum=module.momentum,
        optimizer=optimizer,
    )


class Model:
    """A network as an mpsnn node recipe with its PyTorch twin (see the module docstring).

    Subclasses build ``self.twin`` (the ``nn.Module``), ``self.layers`` (pairs of a twin
    module and the mpsnn data source holding its weights) and implement ``recipe``.

    Attributes:
        name: the model's name (``mpsnn train --model``).
        input_shape: ``(channels, height, width)`` of one input image.
        classes: the number of logits.
        twin: the PyTorch module (its parameters are the initial weights; `torch_module`
            returns one holding the current weights).
        layers: ``[(twin module, data source), ...]`` in forward order.
    """

    name = "model"
    input_shape: tuple[int, int, int] = (1, 28, 28)
    classes = 10

    def __init__(self, device: Device) -> None:
        self.device = device
        self.twin: nn.Module = nn.Identity()
        self.layers: list[tuple[nn.Module, Any]] = []

    # -- the recipe ----------------------------------------------------------------------

    def recipe(self, image: ImageNode, *, training: bool) -> ImageNode:
        """The forward nodes from ``image`` to the logits (``training`` adds the nodes only a
        training graph has, such as dropout)."""
        raise NotImplementedError

    @property
    def data_sources(self) -> list[Any]:
        return [ds for _, ds in self.layers]

    def training_graph(
        self,
        batch_size: int,
        loss: LossDescriptor | None = None,
        *,
        storage: FeatureChannelFormat = FeatureChannelFormat.FLOAT32,
        node_handler: Callable[..., None] | None = None,
    ) -> Graph:
        """The training graph: one ``encode_batch(cb, [images], [labels])`` runs the forward
        pass, the loss, every gradient and the data sources' updates. Nobody reads the
        gradient of the input images, so the first layer computes its weight gradient only.
        The logits are exported: ``graph.intermediate_images[0]`` after a step.

        The default loss is softmax cross-entropy averaged over a batch of ``batch_size``
        images: MPS reductions are per image, so the batch mean is SUM with weight
        ``1 / batch_size`` (a smaller last batch is then weighted by ``1 / batch_size`` too)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"[{type(self).__name__}] batch_size must be >= 1, got {batch_size!r}")
        image = ImageNode("image")
        loss = loss or LossDescriptor(
            LossType.SOFTMAX_CROSS_ENTROPY, ReductionType.SUM, weight=1.0 / batch_size
        )
        logits = self.recipe(image, training=True)
        logits.export_from_graph = True  # intermediate_images[0]: a step's logits (accuracy)
        loss_node = LossNode(logits, loss)
        exits = loss_node.training_graph(None, node_handler)
        graph = Graph.from_results(self.device, [e.result_image for e in exits],
                                   [False] * len(exits))  # fmt: skip
        graph.format = storage
        graph.label = f"{self.name} training"
        return graph

    def inference_graph(
        self, *, storage: FeatureChannelFormat = FeatureChannelFormat.FLOAT32
    ) -> Graph:
        """The inference graph: images in, logits out (batch normalization on its running
        statistics, dropout the identity), sharing the data sources. Call
        ``reload_from_data_sources()`` after training steps to read the current weights."""
        graph = Graph(self.device, self.recipe(ImageNode("image"), training=False))
        graph.format = storage
        graph.label = f"{self.name} inference"
        return graph

    # -- PyTorch ---------------------------------------------------------------------------

    def torch_module(self) -> nn.Module:
        """The PyTorch twin holding the data sources' current weights (a fresh copy, in the
        data sources' dtype: a float64 model gives a float64 module, not rounded values)."""
        import copy

        twin = copy.deepcopy(self.twin)
        if self.layers:
            ds = self.layers[0][1]
            held = ds.weights() if isinstance(ds, TensorConvolutionDataSource) else ds.gamma()
            twin = twin.to(dtype=held.dtype)
        modules = dict(self.twin.named_modules())
        names = {id(mod): name for name, mod in modules.items()}
        mine = dict(twin.named_modules())
        with torch.no_grad():
            for module, ds in self.layers:
                target = mine[names[id(module)]]
                if isinstance(ds, TensorConvolutionDataSource):
                    w = ds.weights().permute(0, 3, 1, 2)
                    target.weight.copy_(w.reshape(target.weight.shape))
                    if target.bias is not None:
                        target.bias.copy_(ds.bias_terms())
                else:
                    target.weight.copy_(ds.gamma())
                    target.bias.copy_(ds.beta())
                    target.running_mean.copy_(ds.mean())
                    target.running_var.copy_(ds.variance())
        return twin

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.twin.parameters())

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}: {self.parameter_count()} parameters>"


def seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with PyTorch's initializers drawing from ``seed`` (the global generator is
    restored afterwards)."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return build()
    finally:
        torch.random.set_rng_state(state)
