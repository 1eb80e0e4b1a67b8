"""Strict numerics for every test: no TF32, seeded."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _strict_numerics():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    yield
