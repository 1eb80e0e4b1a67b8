"""Allocation failures as `mpsnn.AllocationError`: what could not be allocated, in numbers.

PyTorch's allocators fail with a bare message (the CPU allocator's ``RuntimeError``, CUDA's
``OutOfMemoryError``). Where mpsnn allocates an image's storage, or runs a kernel whose result
is being allocated, such a failure is raised again as `AllocationError` whose message names
the sizes, the dtype, the byte size and the device, followed by the allocator's own first line
(its exception is the ``__cause__``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import torch

from mpsnn.errors import AllocationError

__all__ = ["allocation_error", "byte_size", "is_allocation_failure"]


# What PyTorch's allocators say when memory runs out: the CPU allocator's RuntimeError (POSIX and
# Windows wording), CUDA's OutOfMemoryError (and the host's MemoryError).
_ALLOCATOR_WORDS = ("can't allocate memory", "not enough memory", "out of memory")
_ENFORCE_PREFIX = re.compile(r"^\[enforce fail at [^\]]*\]\s*(?:\S+ == \S+\.\s*)?")


def is_allocation_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocator's failure (not one already turned into an
    `AllocationError`)."""
    if isinstance(exc, AllocationError):
        return False
    if isinstance(exc, MemoryError | torch.cuda.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(w in text for w in _ALLOCATOR_WORDS)


def allocation_error(
    who: str,
    shapes: Sequence[Sequence[int]],
    dtype: torch.dtype,
    device: torch.device | str,
    exc: BaseException,
    what: str = "",
) -> AllocationError:
    """The `AllocationError` for an allocator's failure ``exc`` while ``who`` allocated
    tensors of ``shapes`` and ``dtype`` on ``device``: ``[who] cannot allocate 12 x 3 x 100000
    x 100000 float32 (1.31 TiB) on cpu: <the allocator's first line>`` (``what``: a prefix
    naming the memory, e.g. its label)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = sum(math.prod(s) for s in shapes) * itemsize
    dims = ", ".join(" x ".join(map(str, s)) for s in shapes)
    name = str(dtype).removeprefix("torch.")
    lines = str(exc).strip().splitlines()
    said = _ENFORCE_PREFIX.sub("", lines[0]) if lines else type(exc).__name__
    return AllocationError(
        f"[{who}] cannot allocate {what}{dims} {name} ({byte_size(total)}) on {device}: {said}"
    )


def byte_size(n: int) -> str:
    """``n`` bytes in binary units with two decimals (``1.31 TiB``), plain bytes below 1 KiB."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        value /= 1024
        if value < 1024 or unit == "EiB":
            break
    return f"{value:.2f} {unit}"
