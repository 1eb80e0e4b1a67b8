"""Ready-made networks as mpsnn node recipes, each with its PyTorch twin (`Model`)."""

from mpsnn.models.apple import AppleMNIST
from mpsnn.models.base import Model
from mpsnn.models.cnn import SmallCNN
from mpsnn.models.lenet import LeNet5
from mpsnn.models.resnet import ResNet18
from mpsnn.models.tiny_yolo import TinyYOLOv2

__all__ = ["AppleMNIST", "LeNet5", "Model", "ResNet18", "SmallCNN", "TinyYOLOv2"]
