"""`ConvolutionDescriptor` and the convolution enums."""

from __future__ import annotations

import enum
from typing import Any

from mpsnn.core._checks import check_positive

__all__ = [
    "ConvolutionAccumulatorPrecisionOption",
    "ConvolutionDescriptor",
    "ConvolutionGradientOption",
]


class ConvolutionGradientOption(enum.IntFlag):
    """What `ConvolutionGradient` computes (MPS ``MPSCNNConvolutionGradientOption``)."""

    GRADIENT_WITH_DATA = 1
    GRADIENT_WITH_WEIGHTS_AND_BIAS = 2
    ALL = 3


class ConvolutionAccumulatorPrecisionOption(enum.IntEnum):
    """MPS ``MPSNNConvolutionAccumulatorPrecisionOption``.

    FLOAT (the default, as the convolution header says): accumulate in at least float32. HALF
    computes with float16 operands and a float16 result, emulating a half accumulator; the
    accumulation inside the backend may still be wider, as MPS allows on older GPUs.
    """

    HALF = 0
    FLOAT = 1


class _Positive:
    """A positive-int attribute validated on every assignment."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.attr = "_" + name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj, self.attr)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, self.attr, check_positive("ConvolutionDescriptor", self.name, value))


class ConvolutionDescriptor:
    """Shape of a convolution (MPS ``MPSCNNConvolutionDescriptor``).

    Args:
        kernel_width, kernel_height: window size (any positive value; even sizes lean top-left).
        input_feature_channels, output_feature_channels: channel counts (any positive value: mpsnn
            has no multiple-of-4 rule).
        stride_in_pixels_x, stride_in_pixels_y: strides.
        dilation_rate_x, dilation_rate_y: dilations (effective window ``(k - 1) d + 1``).
        groups: input group ``g`` connects only to output group ``g``; must divide both channel
            counts. Depthwise convolution is ``groups == input_feature_channels``.
        fused_neuron_descriptor: a neuron applied after the bias (None: no neuron).

    Weights cross the data-source boundary in the OHWI layout
    ``[output_feature_channels][kernel_height][kernel_width][input_feature_channels / groups]``.

    Raises:
        ValueError: non-positive sizes, or groups that do not divide the channel counts.
    """

    kernel_width = _Positive()
    kernel_height = _Positive()
    input_feature_channels = _Positive()
    output_feature_channels = _Positive()
    stride_in_pixels_x = _Positive()
    stride_in_pixels_y = _Positive()
    dilation_rate_x = _Positive()
    dilation_rate_y = _Positive()
    groups = _Positive()

    def __init__(
        self,
        kernel_width: int = 3,
        kernel_height: int = 3,
        input_feature_channels: int = 1,
        output_feature_channels: int = 1,
        stride_in_pixels_x: int = 1,
        stride_in_pixels_y: int = 1,
        dilation_rate_x: int = 1,
        dilation_rate_y: int = 1,
        groups: int = 1,
        fused_neuron_descriptor: Any = None,
    ) -> None:
        self.kernel_width = kernel_width
        self.kernel_height = kernel_height
        self.input_feature_channels = input_feature_channels
        self.output_feature_channels = output_feature_channels
        self.stride_in_pixels_x = stride_in_pixels_x
        self.stride_in_pixels_y = stride_in_pixels_y
        self.dilation_rate_x = dilation_rate_x
        self.dilation_rate_y = dilation_rate_y
        self.groups = groups
        self.fused_neuron_descriptor = fused_neuron_descriptor
        self.validate()

    def validate(self, who: str = "ConvolutionDescriptor") -> None:
        """Check the cross-field rules (groups divide the channel counts)."""
        g = self.groups
        if self.input_feature_channels % g or self.output_feature_channels % g:
            raise ValueError(
                f"[{who}] groups must divide input_feature_channels and output_feature_channels, "
                f"got groups={g} with {self.input_feature_channels} input and "
                f"{self.output_feature_channels} output channels"
            )

    @property
    def weights_shape(self) -> tuple[int, int, int, int]:
        """OHWI shape of the weights: ``(O, kH, kW, I / groups)``."""
        # the validated fields read directly (this runs at every training step)
        return (
            self._output_feature_channels,
            self._kernel_height,
            self._kernel_width,
            self._input_feature_channels // self._groups,
        )

    def copy(self) -> ConvolutionDescriptor:
        return ConvolutionDescriptor(
            self.kernel_width,
            self.kernel_height,
            self.input_feature_channels,
            self.output_feature_channels,
            self.stride_in_pixels_x,
            self.stride_in_pixels_y,
            self.dilation_rate_x,
            self.dilation_rate_y,
            self.groups,
            self.fused_neuron_descriptor,
        )

    def _key(self) -> tuple[int, ...]:
        # the validated fields read directly: gradient kernels compare descriptors at every
        # encode
        return (
            self._kernel_width,
            self._kernel_height,
            self._input_feature_channels,
            self._output_feature_channels,
            self._stride_in_pixels_x,
            self._stride_in_pixels_y,
            self._dilation_rate_x,
            self._dilation_rate_y,
            self._groups,
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConvolutionDescriptor) and other._key() == self._key()

    def __repr__(self) -> str:
        return (
            f"ConvolutionDescriptor({self.kernel_width}x{self.kernel_height}, "
            f"{self.input_feature_channels}->{self.output_feature_channels}, "
            f"stride=({self.stride_in_pixels_x}, {self.stride_in_pixels_y}), "
            f"dilation=({self.dilation_rate_x}, {self.dilation_rate_y}), groups={self.groups})"
        )
