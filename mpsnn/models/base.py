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

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from mpsnn.cnn.convolution import ConvolutionDescriptor, TensorConvolutionDataSource
from mpsnn.cnn.loss import LossDescriptor, LossType, ReductionType
from mpsnn.cnn.normalization import TensorBatchNormalizationDataSource
from mpsnn.core.descriptor import FeatureChannelFormat
from mpsnn.core.device import Device
from mpsnn.core.layout import master_layout
from mpsnn.graph import Graph, ImageNode
from mpsnn.nodes import LossNode

__all__ = ["Model", "batch_norm_source", "conv_source", "image_shape"]


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
    ohwi = w.permute(0, 2, 3, 1).to(device.torch_device, dtype, copy=True)
    masters = master_layout(dtype, device.torch_device)
    if isinstance(module, nn.Conv2d) and masters is torch.channels_last:
        # the kernel's masters are channels-last OIHW there, which is OHWI memory: the same
        # layout here makes each reload a plain copy and the optimizer's operands alike
        ohwi = ohwi.contiguous()
    # copies: the data source's values are trained in place, the twin keeps the initial ones
    return TensorConvolutionDataSource(
        d,
        ohwi,
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
        recompute_input_convolution: the training graph's
            ``recompute_input_convolution_results`` (False: the graph's default).
    """

    name = "model"
    input_shape: tuple[int, int, int] = (1, 28, 28)
    classes = 10
    recompute_input_convolution = False

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
        graph.recompute_input_convolution_results = self.recompute_input_convolution
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

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The PyTorch twin's ``state_dict`` with the data sources' current values (that of
        `torch_module`): what ``twin.load_state_dict`` and `load_state_dict` read."""
        return self.torch_module().state_dict()

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Write a ``state_dict`` of the PyTorch twin (trained in PyTorch, or exported by
        ``mpsnn export``) into the data sources, in place: the inverse of `state_dict`.

        The tensors of the twin's module ``name`` go into the data source of that layer:
        ``name.weight`` (OIHW, or an ``nn.Linear`` weight over a flattened CHW input) as OHWI
        weights (see the module docstring), ``name.bias``; for batch normalization
        ``name.weight`` / ``name.bias`` as gamma / beta and ``name.running_mean`` /
        ``name.running_var`` as the running statistics. Values are rounded to the data
        sources' dtype on their device. The keys must be exactly the twin's (its
        ``state_dict()``; the ``num_batches_tracked`` counters may be left out, mpsnn keeps
        none) and every value a floating-point tensor of the twin's shape; a refused
        ``state_dict`` writes nothing. The optimizers' state is left as it is, and the
        model's ``twin`` keeps its initial weights. Graphs built before read the new values
        after ``reload_from_data_sources()``.

        Raises:
            TypeError: ``state_dict`` is not a mapping, or a value is not a tensor.
            ValueError: missing or unexpected keys, a shape other than the twin's, or a
                tensor that is not floating point.
        """
        who = type(self).__name__
        if not isinstance(state_dict, Mapping):
            raise TypeError(
                f"[{who}] state_dict must be a mapping of the twin's names to tensors, got "
                f"{type(state_dict).__name__}"
            )
        expected = self.twin.state_dict()
        optional = {k for k in expected if k.endswith("num_batches_tracked")}
        missing = sorted(set(expected) - set(state_dict) - optional)
        unexpected = sorted(set(state_dict) - set(expected), key=str)
        if missing or unexpected:
            raise ValueError(
                f"[{who}] state_dict must hold exactly the twin's tensors (the keys of "
                f"{who}.state_dict()), got missing {missing}, unexpected {unexpected}"
            )
        for key, want in expected.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"[{who}] state_dict[{key!r}] must be a tensor, got {type(value).__name__}"
                )
            if tuple(value.shape) != tuple(want.shape):
                raise ValueError(
                    f"[{who}] state_dict[{key!r}] must have the shape {tuple(want.shape)}, "
                    f"got {tuple(value.shape)}"
                )
            if key not in optional and not value.is_floating_point():
                raise ValueError(
                    f"[{who}] state_dict[{key!r}] must be a floating-point tensor, got "
                    f"{value.dtype}"
                )
        names = {id(mod): name for name, mod in self.twin.named_modules()}
        with torch.no_grad():
            for module, ds in self.layers:
                prefix = names[id(module)] + "." if names[id(module)] else ""
                if isinstance(ds, TensorConvolutionDataSource):
                    w = ds.weights()  # a view of the held OHWI values
                    o, kh, kw, i = w.shape
                    oihw = state_dict[prefix + "weight"].reshape(o, i, kh, kw)
                    w.copy_(oihw.permute(0, 2, 3, 1))
                    if ds.bias_terms() is not None:
                        ds.bias_terms().copy_(state_dict[prefix + "bias"])
                else:
                    ds.gamma().copy_(state_dict[prefix + "weight"])
                    ds.beta().copy_(state_dict[prefix + "bias"])
                    ds.mean().copy_(state_dict[prefix + "running_mean"])
                    ds.variance().copy_(state_dict[prefix + "running_var"])

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.twin.parameters())

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}: {self.parameter_count()} parameters>"


def image_shape(
    model: Model, input_shape: Any, classes: Any, minimum: int, why: str
) -> tuple[int, int, int]:
    """``input_shape`` as ``(channels, height, width)`` ints, checked: at least one channel,
    height and width at least ``minimum`` (``why``: what needs it), and ``classes`` >= 1."""
    who = type(model).__name__

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    if (
        not isinstance(input_shape, tuple | list)
        or len(input_shape) != 3
        or not all(is_int(v) for v in input_shape)
        or input_shape[0] < 1
        or min(input_shape[1:]) < minimum
    ):
        raise ValueError(
            f"[{who}] input_shape must be (channels, height, width) with at least one channel "
            f"and a height and width of at least {minimum} ({why}), got {input_shape!r}"
        )
    if not is_int(classes) or classes < 1:
        raise ValueError(f"[{who}] classes must be an int >= 1, got {classes!r}")
    return int(input_shape[0]), int(input_shape[1]), int(input_shape[2])


def seeded(seed: int, build: Callable[[], nn.Module]) -> nn.Module:
    """``build()`` with PyTorch's initializers drawing from ``seed`` (the global generator is
    restored afterwards)."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        return build()
    finally:
        torch.random.set_rng_state(state)
