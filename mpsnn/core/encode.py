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
command buffer, images, states and kernel as they were. A command whose memory runs out raises
`mpsnn.AllocationError` naming the kernel and the sizes of the results it was making.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mpsnn.core.allocation import allocation_error, is_allocation_failure
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.descriptor import ImageDescriptor
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
    run = enc.run
    outputs = enc.outputs
    if len(outputs) == 1:  # the common case, at every encode: no list or argument tuple
        out = outputs[0]
        if out is not None and not isinstance(out, Image):
            out = _allocate(kernel, cb, out, enc.batch)
        outs = [out]

        def command() -> None:
            try:
                run(out)
            except (RuntimeError, MemoryError) as exc:  # (a try costs nothing when not raised)
                err = _results_error(who, outs, exc)
                if err is exc:
                    raise
                raise err from exc

        if kernel._runs_beside:
            cb._record_beside(who, command)
        else:
            cb.record(who, command)
    else:
        outs = [
            o if (o is None or isinstance(o, Image)) else _allocate(kernel, cb, o, enc.batch)
            for o in outputs
        ]

        def commands() -> None:
            try:
                run(*outs)
            except (RuntimeError, MemoryError) as exc:  # (a try costs nothing when not raised)
                err = _results_error(who, outs, exc)
                if err is exc:
                    raise
                raise err from exc

        cb.record(who, commands)
    for o in outs:
        if o is not None:
            o._root()._writer = cb
    for state, record in enc.records:
        state._forward = record
    if enc.properties:
        for name, value in enc.properties.items():
            object.__setattr__(kernel, name, value)
    reads = enc.reads
    if len(reads) == 1:  # the common case: one read, nothing to deduplicate
        if reads[0] is not None:
            _read_root(reads[0])._consume_read(cb, who)
    elif reads:
        seen: set[int] = set()
        for r in reads:
            if r is not None and id(root := _read_root(r)) not in seen:
                seen.add(id(root))
                root._consume_read(cb, who)
    if enc.after is not None:
        enc.after()
    return outs


def _results_error(who: str, outs: list[Image | None], exc: Exception) -> Exception:
    """``exc`` raised by a command: an allocator's failure becomes the `AllocationError` that
    names the kernel and its results; anything else is returned as is."""
    images = [o for o in outs if o is not None]
    if not images or not is_allocation_failure(exc):
        return exc
    first = images[0]
    what = "its results, " if len(images) > 1 else "its result, "
    shapes = [o._shape for o in images]
    return allocation_error(who, shapes, first._dtype, first._device.torch_device, exc, what)


def _read_root(r: Any) -> Any:
    """What a read counts against: an image's root (a batch item is a view), or the state."""
    return r._root() if isinstance(r, Image) else r


def _allocate(kernel: Any, cb: CommandBuffer, desc: ImageDescriptor, batch: bool) -> Image:
    alloc = kernel._allocator
    if batch and hasattr(alloc, "image_batch"):
        out = alloc.image_batch(cb, desc, kernel, desc.number_of_images)
        return out._image if isinstance(out, ImageBatch) else out
    return alloc.image(cb, desc, kernel)
