"""Training from Python: `fit` (a model on tensors, NumPy arrays, a Dataset or a DataLoader)
and `TrainingLoop`, the steps it and ``mpsnn train`` share."""

from mpsnn.training.fit import History, fit
from mpsnn.training.loop import EpochSums, TrainingLoop, epoch_order

__all__ = ["EpochSums", "History", "TrainingLoop", "epoch_order", "fit"]
