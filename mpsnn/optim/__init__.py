"""Optimizers (MPS ``MPSNNOptimizerDescriptor``, ``MPSNNOptimizerStochasticGradientDescent``,
``MPSNNOptimizerRMSProp``, ``MPSNNOptimizerAdam``) with MPS's formulas and encode forms.

* `mpsnn.optim.base`: `OptimizerDescriptor` and the base `Optimizer`: the order every
  gradient goes through (clipping, rescaling, regularization, then the rule), the
  hyperparameters in device memory, the one update path and the encode forms (vectors, a
  convolution's states, a normalization's states);
* `mpsnn.optim.rules`: `SGD`, `RMSProp`, `Adam`: their formulas and how they relate to
  torch.optim's;
* `mpsnn.ops.optim`: the math; `mpsnn.ops.optim_hyper`: its vocabulary, `RegularizationType`
  among it.
"""

from mpsnn.ops.optim_hyper import RegularizationType as RegularizationType
from mpsnn.optim.base import Optimizer as Optimizer
from mpsnn.optim.base import OptimizerDescriptor as OptimizerDescriptor
from mpsnn.optim.rules import SGD as SGD
from mpsnn.optim.rules import Adam as Adam
from mpsnn.optim.rules import RMSProp as RMSProp

__all__ = ["SGD", "Adam", "Optimizer", "OptimizerDescriptor", "RMSProp", "RegularizationType"]
