"""Strict numerics for every test: no TF32, seeded. Without a GPU, Triton kernels run in
Triton's interpreter (set before any kernel is defined)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _strict_numerics():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    yield
