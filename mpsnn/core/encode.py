"""The one encode mechanism every kernel uses.

An encode is three steps:

1. **validate** its arguments (types, devices, liveness, shapes): pure, reads no device memory;
2. **plan** what it will do, as an `Encoding` (pure; kernels cache the configuration-dependent
   part): the command to run, the images it writes (given, or descriptors to allocate), what
   it reads (images and states whose read counts drop), the typed records it writes into
   gradient states, and the kernel properties the padding policy sets (``offset``, ...);
3. **apply** the plan (`apply_encoding`): the only step that changes anything. It allocates
   the outputs, records the command, marks the outputs' writer, writes the state records, sets
   the kernel properties and drops the read counts, in that order.

Validation and planning may raise; application does not. A failed encode therefore leaves the
command buffer, images, states and kernel as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mpsnn.core.descriptor import ImageDescriptor
from mpsnn.core.device import CommandBuffer
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch

__all__ = ["Encoding", "apply_encoding"]


@dataclass(slots=True)
class Encoding:
    """What one encode will do (see the module docstring).

    Attributes:
        run: the command, called at execution as ``run(*outputs)`` (allocated outputs and given
            ones, in order; None for an output the encode does not produce).
        outputs: per output, the given `Image`, an `ImageDescriptor` to allocate, or None.
        reads: images and states the command reads; each distinct temporary one has its read
            count dropped once.
        records: ``(state, record)`` pairs: the typed forward records written into states.
        properties: kernel attributes the encode sets (``{"_offset": Offset(...)}``).
        batch: allocate outputs as batches (an allocator's ``image_batch`` when it has one).
        after: other planned bookkeeping (e.g. a state noting what was encoded into it),
            run last; it must not raise.
    """

    run: Callable[..., None]
    outputs: Sequence[Image | ImageDescriptor | None] = ()
    reads: Sequence[Any] = ()
    records: Sequence[tuple[Any, Any]] = ()
    properties: dict[str, Any] | None = None
    batch: bool = False
    after: Callable[[], None] | None = None


def apply_encoding(kernel: Any, cb: CommandBuffer, enc: Encoding) -> list[Image | None]:
    """Apply a validated plan (the only side effects of an encode); returns the outputs."""
    who = type(kernel).__name__
    outs: list[Image | None] = [
        o if (o is None or isinstance(o, Image)) else _allocate(kernel, cb, o, enc.batch)
        for o in enc.outputs
    ]
    run = enc.run
    if len(outs) == 1:  # the common case: no argument tuple to unpack when it runs
        out = outs[0]
        cb.record(who, lambda: run(out))
    elif outs:
        cb.record(who, lambda: run(*outs))
    else:
        cb.record(who, run)
    for o in outs:
        if o is not None:
            o._root()._writer = cb
    for state, record in enc.records:
        state._forward = record
    if enc.properties:
        for name, value in enc.properties.items():
            object.__setattr__(kernel, name, value)
    seen: set[int] = set()
    for r in enc.reads:
        if r is None:
            continue
        if isinstance(r, Image):
            r = r._root()
        key = id(r)
        if key not in seen:
            seen.add(key)
            r._consume_read(cb, who)
    if enc.after is not None:
        enc.after()
    return outs


def _allocate(kernel: Any, cb: CommandBuffer, desc: ImageDescriptor, batch: bool) -> Image:
    alloc = kernel._allocator
    if batch and hasattr(alloc, "image_batch"):
        out = alloc.image_batch(cb, desc, kernel, desc.number_of_images)
        return out._image if isinstance(out, ImageBatch) else out
    return alloc.image(cb, desc, kernel)
