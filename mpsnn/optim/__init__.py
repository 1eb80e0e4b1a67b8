"""Optimizers with MPS's formulas and encode forms (`mpsnn.optim.optimizers`)."""

from mpsnn.optim.optimizers import SGD as SGD
from mpsnn.optim.optimizers import Adam as Adam
from mpsnn.optim.optimizers import Optimizer as Optimizer
from mpsnn.optim.optimizers import OptimizerDescriptor as OptimizerDescriptor
from mpsnn.optim.optimizers import RegularizationType as RegularizationType
from mpsnn.optim.optimizers import RMSProp as RMSProp
