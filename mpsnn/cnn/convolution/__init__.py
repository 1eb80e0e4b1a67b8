"""The convolution family: convolution, fully connected, transpose, their gradients and states."""

from mpsnn.cnn.convolution.data_source import ConvolutionDataSource as ConvolutionDataSource
from mpsnn.cnn.convolution.data_source import (
    ConvolutionWeightsAndBiasesState as ConvolutionWeightsAndBiasesState,
)
from mpsnn.cnn.convolution.data_source import (
    TensorConvolutionDataSource as TensorConvolutionDataSource,
)
from mpsnn.cnn.convolution.descriptor import (
    ConvolutionAccumulatorPrecisionOption as ConvolutionAccumulatorPrecisionOption,
)
from mpsnn.cnn.convolution.descriptor import ConvolutionDescriptor as ConvolutionDescriptor
from mpsnn.cnn.convolution.descriptor import ConvolutionGradientOption as ConvolutionGradientOption
from mpsnn.cnn.convolution.gradients import ConvolutionGradient as ConvolutionGradient
from mpsnn.cnn.convolution.gradients import (
    ConvolutionTransposeGradient as ConvolutionTransposeGradient,
)
from mpsnn.cnn.convolution.gradients import FullyConnectedGradient as FullyConnectedGradient
from mpsnn.cnn.convolution.kernels import Convolution as Convolution
from mpsnn.cnn.convolution.kernels import ConvolutionTranspose as ConvolutionTranspose
from mpsnn.cnn.convolution.kernels import FullyConnected as FullyConnected
from mpsnn.cnn.convolution.state import ConvolutionGradientState as ConvolutionGradientState
from mpsnn.cnn.convolution.state import (
    ConvolutionTransposeGradientState as ConvolutionTransposeGradientState,
)

__all__ = [
    "Convolution",
    "ConvolutionAccumulatorPrecisionOption",
    "ConvolutionDataSource",
    "ConvolutionDescriptor",
    "ConvolutionGradient",
    "ConvolutionGradientOption",
    "ConvolutionGradientState",
    "ConvolutionTranspose",
    "ConvolutionTransposeGradient",
    "ConvolutionTransposeGradientState",
    "ConvolutionWeightsAndBiasesState",
    "FullyConnected",
    "FullyConnectedGradient",
    "TensorConvolutionDataSource",
]
