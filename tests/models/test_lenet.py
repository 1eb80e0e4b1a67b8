"""LeNet5 against its PyTorch twin in float64: the inference graph and one SGD step of the
training graph."""

from __future__ import annotations

import torch

from mpsnn.models import LeNet5
from tests.helpers import assert_close
from tests.models._helpers import DEV, TOL, check_one_sgd_step, logits, sgd


def _batch(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 28, 28, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 10, (n,), generator=g)


def test_inference_graph_equals_the_twin() -> None:
    model = LeNet5(DEV, seed=1, dtype=torch.float64)
    assert model.parameter_count() == 61_706
    x, _ = _batch(3, 2)
    with torch.no_grad():
        expected = model.torch_module().eval()(x)
    assert_close(logits(model, x), expected, "LeNet5 logits", TOL)


def test_one_sgd_step_equals_torch_optim_sgd() -> None:
    model = LeNet5(DEV, sgd(), seed=3, dtype=torch.float64)
    check_one_sgd_step(model, *_batch(4, 4))
