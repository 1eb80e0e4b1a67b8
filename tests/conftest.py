"""Seeded tests under PyTorch's default numerics: no TF32 switch is touched here, so CUDA tests
run with PyTorch's defaults (TF32 allowed for cuDNN convolutions) and mpsnn's float32 results
must be float32 regardless. A reference computed with PyTorch in float32 on the GPU turns TF32
off itself (`tests.helpers.float32_reference`). Without a GPU, Triton kernels run in Triton's
interpreter (set before any kernel is defined)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)
    yield
