"""Dataset readers."""

from mpsnn.data.fashion_mnist import load_fashion_mnist as load_fashion_mnist
