"""Ready-made networks as mpsnn node recipes, each with its PyTorch twin (`Model`)."""

from mpsnn.models.base import Model
from mpsnn.models.lenet import LeNet5

__all__ = ["LeNet5", "Model"]
