"""Resize and scale nodes: `ResizeBilinearNode` and `CropAndResizeBilinearNode` with their
gradient nodes (an mpsnn extension: MPS has neither the nodes nor the gradients), and the scale
nodes (MPS ``MPSNNScaleNode``, ``MPSNNBilinearScaleNode``, ``MPSNNLanczosScaleNode``).

The scale nodes have no gradient, as in MPS: the automatic training graph stops at them, as at
an image with ``stop_gradient`` (nothing upstream of a scale node gets a gradient through it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mpsnn.cnn.resize as rs
import mpsnn.cnn.scale as sc
from mpsnn.core.device import Device
from mpsnn.core.geometry import Size
from mpsnn.core.saved import Field
from mpsnn.graph.nodes import (
    GradientFilterNode,
    ImageNode,
    UnaryGradientNode,
    UnaryNode,
)
from mpsnn.graph.step import _Step

__all__ = [
    "BilinearScaleNode",
    "CropAndResizeBilinearGradientNode",
    "CropAndResizeBilinearNode",
    "LanczosScaleNode",
    "ResizeBilinearGradientNode",
    "ResizeBilinearNode",
    "ScaleNode",
]


class ResizeBilinearNode(rs._BilinearSettings, UnaryNode):
    """Bilinear resize (the node of `mpsnn.ResizeBilinear`; an mpsnn extension)."""

    saved_fields = rs._BILINEAR_FIELDS  # the kernel's: resize_width, resize_height, align_corners

    def __init__(
        self,
        source: ImageNode,
        resize_width: int,
        resize_height: int,
        align_corners: bool = False,
    ) -> None:
        self._set_bilinear(resize_width, resize_height, align_corners)
        super().__init__(source)

    def _make_kernel(self, device: Device) -> Any:
        k = rs.ResizeBilinear(device, *self._resize, self._align)
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device) -> Any:
        return rs.ResizeBilinearGradient(device, *self._resize, self._align)


class CropAndResizeBilinearNode(rs._CropSettings, UnaryNode):
    """Crop and resize (the node of `mpsnn.CropAndResizeBilinear`; an mpsnn extension): its
    result has ``number_of_regions`` times the source's channels."""

    def __init__(
        self,
        source: ImageNode,
        resize_width: int,
        resize_height: int,
        number_of_regions: int,
        regions: Sequence[Sequence[float]],
    ) -> None:
        self._set_crop(resize_width, resize_height, number_of_regions, regions)
        super().__init__(source)

    def _make_kernel(self, device: Device) -> Any:
        k = rs.CropAndResizeBilinear(device, *self._resize, len(self._regions), self._regions)
        self._configure(k)
        return k

    def _gradient_kernel(self, device: Device) -> Any:
        n = len(self._regions)
        return rs.CropAndResizeBilinearGradient(device, *self._resize, n, self._regions)


class ResizeBilinearGradientNode(UnaryGradientNode, gradient_of=ResizeBilinearNode):
    """The gradient node of `ResizeBilinearNode` (with respect to its source)."""


class CropAndResizeBilinearGradientNode(UnaryGradientNode, gradient_of=CropAndResizeBilinearNode):
    """The gradient node of `CropAndResizeBilinearNode` (with respect to its source; the
    regions are constants)."""


class ScaleNode(UnaryNode):
    """Base of the scale nodes (MPS ``MPSNNScaleNode``, abstract: make a `BilinearScaleNode`
    or a `LanczosScaleNode`).

    Args:
        source: the image to scale.
        output_size: the result's size (a `Size`: ``width`` and ``height`` positive; its
            ``depth`` is not used: images and channels follow the source).
        transform_provider: an `ImageTransformProvider` asked for the transform at every
            encode (None: the source fits the ``output_size`` result).

    No gradient (MPS defines none): the result image's ``stop_gradient`` is True, so a
    training graph's walk ends here, and nothing upstream gets a gradient through it;
    `gradient_filters` (and `gradient_filter`) raise.
    """

    _has_state = False
    _kernel_class: type = sc.ImageScale
    # ScaleNode itself is abstract: a file naming it is refused by its constructor
    saved_fields = (Field("output_size", Size),)
    code_attributes = ("transform_provider",)

    def __init__(
        self,
        source: ImageNode,
        output_size: Size,
        transform_provider: sc.ImageTransformProvider | None = None,
    ) -> None:
        who = type(self).__name__
        if type(self) is ScaleNode:
            raise TypeError(
                "[ScaleNode] ScaleNode is abstract: make a BilinearScaleNode or a "
                "LanczosScaleNode, got ScaleNode"
            )
        if not isinstance(output_size, Size):
            raise TypeError(f"[{who}] output_size must be a Size, got {type(output_size).__name__}")
        if output_size.width < 1 or output_size.height < 1:
            raise ValueError(
                f"[{who}] output_size must have a positive width and height, got "
                f"{output_size.width}x{output_size.height}"
            )
        if transform_provider is not None and not isinstance(
            transform_provider, sc.ImageTransformProvider
        ):
            raise TypeError(
                f"[{who}] transform_provider must have a transform_for_source_image(source_image, "
                f"handle) method (an ImageTransformProvider) or be None, got "
                f"{type(transform_provider).__name__}"
            )
        super().__init__(source)
        self._output_size = output_size
        self._provider = transform_provider
        self.result_image.stop_gradient = True  # no gradient: a training graph ends here

    @property
    def output_size(self) -> Size:
        return self._output_size

    @property
    def transform_provider(self) -> sc.ImageTransformProvider | None:
        return self._provider

    def _make_kernel(self, device: Device) -> Any:
        k = self._kernel_class(device)
        k._output_size = (self._output_size.width, self._output_size.height)
        self._configure(k)
        return k

    def _run(self, step: _Step, kernel: Any) -> None:
        if self._provider is not None:
            source = self._sources[0]
            t = self._provider.transform_for_source_image(step.image(source).image, source.handle)
            if t is not None and not isinstance(t, sc.ScaleTransform):
                raise TypeError(
                    f"[{type(self).__name__}] the transform provider must return a "
                    f"ScaleTransform or None, got {type(t).__name__}"
                )
            if t != kernel.scale_transform:  # an assignment starts a new plan: only on change
                kernel.scale_transform = t
        super()._run(step, kernel)

    def gradient_filters(self, sources: Sequence[ImageNode]) -> list[GradientFilterNode]:
        """Raises: a scale node has no gradient node (its result's ``stop_gradient`` ends the
        training graph's walk before it is asked)."""
        raise ValueError(
            f"[{type(self).__name__}] a scale node has no gradient (MPS defines none; keep its "
            "result_image.stop_gradient True so that a training graph stops here), got a "
            "request for its gradient filters"
        )


class BilinearScaleNode(ScaleNode):
    """Bilinear scaling (MPS ``MPSNNBilinearScaleNode``; kernel
    `mpsnn.cnn.scale.ImageBilinearScale`)."""

    _kernel_class = sc.ImageBilinearScale
    saved_fields = ScaleNode.saved_fields


class LanczosScaleNode(ScaleNode):
    """Lanczos (a = 3) scaling (MPS ``MPSNNLanczosScaleNode``; kernel
    `mpsnn.cnn.scale.ImageLanczosScale`)."""

    _kernel_class = sc.ImageLanczosScale
    saved_fields = ScaleNode.saved_fields
