"""Exceptions raised by mpsnn.

Every message reads ``[ClassName] what must hold, got what``. Bad values and shapes raise
`ValueError`, wrong types `TypeError`; these two are the built-in classes so that callers can
catch them the usual way. The classes below cover what the built-ins do not say.
"""

from __future__ import annotations

import torch

__all__ = [
    "AllocationError",
    "CheckpointError",
    "CommandBufferError",
    "DistributedError",
    "MpsnnError",
    "StaleResourceError",
    "UnsupportedError",
]


class MpsnnError(Exception):
    """Base class of the exceptions that are specific to mpsnn."""


class AllocationError(MpsnnError, MemoryError, torch.cuda.OutOfMemoryError):
    """Memory for an image or a kernel's result could not be allocated.

    The message names what was being allocated, its sizes and dtype, its byte size and the
    device, then the allocator's own words (its exception is the ``__cause__``). It is a
    `MemoryError`, and also PyTorch's ``OutOfMemoryError`` (a `RuntimeError`), so code that
    catches either keeps working.
    """


class StaleResourceError(MpsnnError, RuntimeError):
    """A temporary image or state was used after its read count reached zero.

    MPS recycles the storage of a temporary object once its last scheduled reader has run;
    mpsnn raises this instead of reading recycled memory. The message names the object, its
    label, and the kernel that touched it.
    """


class UnsupportedError(MpsnnError, NotImplementedError):
    """A valid configuration that mpsnn does not implement (the message says why)."""


class CommandBufferError(MpsnnError, RuntimeError):
    """A result of a command buffer whose work failed was read.

    The message names the image and the command that failed; the original exception is the
    ``__cause__``.
    """


class CheckpointError(MpsnnError, ValueError):
    """A file that `mpsnn.load` rejects: not a safetensors file, truncated, a header or
    structure that is not what `mpsnn.save` writes (another format version, an unknown type,
    missing or extra tensors, tensors of the wrong shape or dtype, malformed fields).

    The message reads ``[load] what must hold, got what``; nothing is built from such a file.
    """


class DistributedError(MpsnnError, RuntimeError):
    """A data-parallel run cannot go on: a rank died, hung or failed (the message names it
    when the heartbeats tell), a collective failed or timed out, or the ranks' weights
    diverged (the checksum check of `mpsnn.DataParallel`). The collective's own exception,
    if any, is the ``__cause__``.
    """
