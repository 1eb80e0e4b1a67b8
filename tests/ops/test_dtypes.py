"""Accumulation dtypes and the device-constant cache the ops share."""

from __future__ import annotations

import torch

from mpsnn.ops import _dtypes
from mpsnn.ops._dtypes import acc_dtype, device_constant, widen


def test_widen_keeps_float32_and_float64_and_widens_half_types() -> None:
    x32 = torch.randn(3)
    assert widen(x32) is x32 and widen(x32.double()).dtype == torch.float64
    assert widen(x32.half()).dtype == torch.float32 and widen(x32.bfloat16()).dtype == torch.float32
    assert acc_dtype(torch.bfloat16) == torch.float32


def test_device_constant_builds_once_per_key_and_dtype() -> None:
    calls: list[int] = []

    def build() -> torch.Tensor:
        calls.append(1)
        return torch.tensor([0.5, 1.25], dtype=torch.float64)

    cpu = torch.device("cpu")
    a = device_constant(("test", 1), torch.float32, cpu, build)
    b = device_constant(("test", 1), torch.float32, cpu, build)
    c = device_constant(("test", 1), torch.float64, cpu, build)
    d = device_constant(("test", 2), torch.float32, cpu, build)
    assert a is b and len(calls) == 3  # the repeat was served from the cache
    assert a.dtype == torch.float32 and c.dtype == torch.float64 and d is not a
    assert torch.equal(c, torch.tensor([0.5, 1.25], dtype=torch.float64))


def test_device_constant_forgets_the_least_recently_used(monkeypatch) -> None:
    monkeypatch.setattr(_dtypes, "_CONSTANTS", type(_dtypes._CONSTANTS)())
    monkeypatch.setattr(_dtypes, "_MAX_CONSTANTS", 2)
    cpu = torch.device("cpu")
    first = device_constant("first", torch.float32, cpu, lambda: torch.zeros(1))
    device_constant("second", torch.float32, cpu, lambda: torch.zeros(1))
    assert device_constant("first", torch.float32, cpu, lambda: torch.ones(1)) is first  # used
    device_constant("third", torch.float32, cpu, lambda: torch.zeros(1))  # evicts "second"
    assert len(_dtypes._CONSTANTS) == 2
    rebuilt = device_constant("second", torch.float32, cpu, lambda: torch.ones(1))
    assert rebuilt.item() == 1.0  # rebuilt, not the evicted zeros
