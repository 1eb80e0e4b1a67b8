"""The models take ``input_shape=(channels, height, width)`` and ``classes``: against their
PyTorch twins in float64 on odd and even sizes (the inference graph and one SGD step of the
training graph), the default sizes unchanged, and the sizes a model cannot take refused."""

from __future__ import annotations

import pytest
import torch

from mpsnn.models import AppleMNIST, LeNet5, ResNet18, SmallCNN
from tests.helpers import assert_close
from tests.models._helpers import DEV, TOL, check_one_sgd_step, logits, sgd


class _AppleWithoutDropout(AppleMNIST):
    """AppleMNIST with its training-only dropout left out (the twin's p set to 0): one SGD step
    is then comparable with the twin's."""

    def recipe(self, image, *, training):
        return super().recipe(image, training=False)


def _batch(shape: tuple[int, int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(3, *shape, generator=g, dtype=torch.float64)
    return x, torch.tensor([0, 4, 2])


CASES = [
    (SmallCNN, (3, 17, 23)), (SmallCNN, (2, 4, 9)), (SmallCNN, (1, 16, 16)),
    (LeNet5, (2, 13, 19)), (LeNet5, (3, 12, 12)), (LeNet5, (1, 32, 30)),
    (_AppleWithoutDropout, (3, 15, 9)), (_AppleWithoutDropout, (2, 7, 6)),
    (_AppleWithoutDropout, (1, 1, 1)),
]  # fmt: skip


@pytest.mark.parametrize(("cls", "shape"), CASES, ids=[f"{c.__name__}-{s}" for c, s in CASES])
def test_an_adapted_model_equals_its_twin(cls: type, shape: tuple[int, int, int]) -> None:
    model = cls(DEV, seed=1, dtype=torch.float64, input_shape=shape, classes=5)
    assert model.input_shape == shape and model.classes == 5
    x, labels = _batch(shape, 2)
    twin = model.torch_module().eval()
    with torch.no_grad():
        expected = twin(x)
    assert expected.shape == (3, 5)
    assert_close(logits(model, x), expected, f"{cls.__name__} {shape} logits", TOL)
    model = cls(DEV, sgd(), seed=3, dtype=torch.float64, input_shape=shape, classes=5)
    if isinstance(model, AppleMNIST):
        model.twin[9].p = 0.0
    check_one_sgd_step(model, x, labels)


def test_the_default_sizes_are_unchanged() -> None:
    assert SmallCNN(DEV).parameter_count() == 421_642
    assert LeNet5(DEV).parameter_count() == 61_706
    assert AppleMNIST(DEV).parameter_count() == 3_274_634
    for cls in (SmallCNN, LeNet5, AppleMNIST):
        assert cls(DEV).input_shape == (1, 28, 28)
    assert ResNet18(DEV, width=4).input_shape == (3, 32, 32)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: LeNet5(DEV, input_shape=(1, 11, 28)),
         r"\[LeNet5\] input_shape must be \(channels, height, width\) with at least one channel "
         r"and a height and width of at least 12 \(two 2×2 poolings around a 5×5 convolution "
         r"without padding\), got \(1, 11, 28\)"),
        (lambda: SmallCNN(DEV, input_shape=(3, 3, 8)),
         r"\[SmallCNN\] input_shape must be .* at least 4 \(two 2×2 poolings\), got \(3, 3, 8\)"),
        (lambda: SmallCNN(DEV, input_shape=(0, 8, 8)), r"\[SmallCNN\] input_shape must be"),
        (lambda: SmallCNN(DEV, input_shape=(8, 8)), r"\[SmallCNN\] input_shape must be"),
        (lambda: AppleMNIST(DEV, input_shape=(1, 0, 4)),
         r"\[AppleMNIST\] input_shape must be .* at least 1 \(an image\), got \(1, 0, 4\)"),
        (lambda: AppleMNIST(DEV, classes=0), r"\[AppleMNIST\] classes must be an int >= 1, got 0"),
        (lambda: LeNet5(DEV, classes=2.5), r"\[LeNet5\] classes must be an int >= 1, got 2.5"),
    ],
    ids=["lenet-small", "cnn-small", "no-channels", "two-axes", "apple-empty", "apple-classes",
         "lenet-classes"],
)  # fmt: skip
def test_sizes_a_model_cannot_take_are_refused(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()
