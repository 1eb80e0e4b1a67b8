"""What host-side caches of device values must know about CUDA graphs.

A host cache derived from tensors' contents (a normalization state's batch variance,
`mpsnn.cnn.normalization.batch_norm_forward.BatchNormalizationState`) is keyed on the tensors'
version counters, which PyTorch moves at every in-place write it makes. Two writers do not
move them: a CUDA-graph replay runs recorded kernels again into the same tensors, and work
recorded during a capture runs only at the replays. `mpsnn.core.device` reports both here:
such a cache is bypassed while a capture is being recorded, and keyed on `epoch` too.

A leaf module (below `mpsnn.core.device` and the states): no imports from mpsnn.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["capturing", "epoch", "recording", "replayed"]

_counts = [0, 0]  # [replays so far, captures being recorded]


def epoch() -> int:
    """How many replays of captured work have been launched in this process."""
    return _counts[0]


def capturing() -> bool:
    """Whether a command buffer is being captured (in any thread: a cache is then only
    bypassed where it did not need to be, never read when it should not be)."""
    return _counts[1] > 0


def replayed() -> None:
    """A replay of captured work was launched."""
    _counts[0] += 1


@contextmanager
def recording() -> Iterator[None]:
    """The scope of one capture."""
    _counts[1] += 1
    try:
        yield
    finally:
        _counts[1] -= 1
