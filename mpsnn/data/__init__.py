"""Dataset readers: Fashion-MNIST, your own images (an ImageFolder tree or an ``.npz`` file),
and `load_dataset`, which reads any of them by name or path into an `ImageDataset`."""

from mpsnn.data.dataset import NAMED_DATASETS, ImageDataset, input_statistics, standardize
from mpsnn.data.fashion_mnist import load_fashion_mnist
from mpsnn.data.imagefolder import load_image_folder
from mpsnn.data.loader import load_dataset
from mpsnn.data.npz import load_npz

__all__ = [
    "NAMED_DATASETS",
    "ImageDataset",
    "input_statistics",
    "load_dataset",
    "load_fashion_mnist",
    "load_image_folder",
    "load_npz",
    "standardize",
]
