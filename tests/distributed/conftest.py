"""Fixtures shared by the data-parallel tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank() -> Iterator[None]:
    """A process group of this process alone (Gloo, in-memory store)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
