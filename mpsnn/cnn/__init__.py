"""The MPS kernel classes, one subpackage or module per family. Each family's public names
are its module's ``__all__``; this package collects them (and `mpsnn` exports them)."""

from mpsnn.cnn.arithmetic import *  # noqa: F403
from mpsnn.cnn.arithmetic import __all__ as _arithmetic
from mpsnn.cnn.arithmetic_gradient import *  # noqa: F403
from mpsnn.cnn.arithmetic_gradient import __all__ as _arithmetic_gradient
from mpsnn.cnn.compare import *  # noqa: F403
from mpsnn.cnn.compare import __all__ as _compare
from mpsnn.cnn.convolution import *  # noqa: F403
from mpsnn.cnn.convolution import __all__ as _convolution
from mpsnn.cnn.correlation import *  # noqa: F403
from mpsnn.cnn.correlation import __all__ as _correlation
from mpsnn.cnn.dropout import *  # noqa: F403
from mpsnn.cnn.dropout import __all__ as _dropout
from mpsnn.cnn.gram import *  # noqa: F403
from mpsnn.cnn.gram import __all__ as _gram
from mpsnn.cnn.local_normalization import *  # noqa: F403
from mpsnn.cnn.local_normalization import __all__ as _local_normalization
from mpsnn.cnn.loss import *  # noqa: F403
from mpsnn.cnn.loss import __all__ as _loss
from mpsnn.cnn.loss_labels import *  # noqa: F403
from mpsnn.cnn.loss_labels import __all__ as _loss_labels
from mpsnn.cnn.loss_split import *  # noqa: F403
from mpsnn.cnn.loss_split import __all__ as _loss_split
from mpsnn.cnn.neuron import *  # noqa: F403
from mpsnn.cnn.neuron import __all__ as _neuron
from mpsnn.cnn.neuron_descriptor import *  # noqa: F403
from mpsnn.cnn.neuron_descriptor import __all__ as _neuron_descriptor
from mpsnn.cnn.normalization import *  # noqa: F403
from mpsnn.cnn.normalization import __all__ as _normalization
from mpsnn.cnn.pooling import *  # noqa: F403
from mpsnn.cnn.pooling import __all__ as _pooling
from mpsnn.cnn.reduce import *  # noqa: F403
from mpsnn.cnn.reduce import __all__ as _reduce
from mpsnn.cnn.reduce_spatial import *  # noqa: F403
from mpsnn.cnn.reduce_spatial import __all__ as _reduce_spatial
from mpsnn.cnn.resize import *  # noqa: F403
from mpsnn.cnn.resize import __all__ as _resize
from mpsnn.cnn.scale import *  # noqa: F403
from mpsnn.cnn.scale import __all__ as _scale
from mpsnn.cnn.shape import *  # noqa: F403
from mpsnn.cnn.shape import __all__ as _shape
from mpsnn.cnn.softmax import *  # noqa: F403
from mpsnn.cnn.softmax import __all__ as _softmax
from mpsnn.cnn.upsampling import *  # noqa: F403
from mpsnn.cnn.upsampling import __all__ as _upsampling
from mpsnn.cnn.yolo import *  # noqa: F403
from mpsnn.cnn.yolo import __all__ as _yolo

__all__ = sorted(
    {
        *_arithmetic,
        *_arithmetic_gradient,
        *_compare,
        *_convolution,
        *_correlation,
        *_dropout,
        *_gram,
        *_local_normalization,
        *_loss,
        *_loss_labels,
        *_loss_split,
        *_neuron,
        *_neuron_descriptor,
        *_normalization,
        *_pooling,
        *_reduce,
        *_reduce_spatial,
        *_resize,
        *_scale,
        *_shape,
        *_softmax,
        *_upsampling,
        *_yolo,
    }
)
