"""The node families: one module per family holds its forward node(s) and the gradient node(s)
that differentiate them (each gradient node names its forward node where it is declared,
``gradient_of=...``). A new family is a module here and its line below."""

from mpsnn.nodes.arithmetic import *  # noqa: F403
from mpsnn.nodes.arithmetic import __all__ as _arithmetic
from mpsnn.nodes.convolution import *  # noqa: F403
from mpsnn.nodes.convolution import __all__ as _convolution
from mpsnn.nodes.dropout import *  # noqa: F403
from mpsnn.nodes.dropout import __all__ as _dropout
from mpsnn.nodes.loss import *  # noqa: F403
from mpsnn.nodes.loss import __all__ as _loss
from mpsnn.nodes.neuron import *  # noqa: F403
from mpsnn.nodes.neuron import __all__ as _neuron
from mpsnn.nodes.normalization import *  # noqa: F403
from mpsnn.nodes.normalization import __all__ as _normalization
from mpsnn.nodes.pooling import *  # noqa: F403
from mpsnn.nodes.pooling import __all__ as _pooling
from mpsnn.nodes.reduction import *  # noqa: F403
from mpsnn.nodes.reduction import __all__ as _reduction
from mpsnn.nodes.resize import *  # noqa: F403
from mpsnn.nodes.resize import __all__ as _resize
from mpsnn.nodes.shape import *  # noqa: F403
from mpsnn.nodes.shape import __all__ as _shape
from mpsnn.nodes.softmax import *  # noqa: F403
from mpsnn.nodes.softmax import __all__ as _softmax
from mpsnn.nodes.upsampling import *  # noqa: F403
from mpsnn.nodes.upsampling import __all__ as _upsampling
from mpsnn.nodes.yolo import *  # noqa: F403
from mpsnn.nodes.yolo import __all__ as _yolo

__all__ = sorted(
    {
        *_arithmetic, *_convolution, *_dropout, *_loss, *_neuron, *_normalization, *_pooling,
        *_reduction, *_resize, *_shape, *_softmax, *_upsampling, *_yolo,
    }
)  # fmt: skip
