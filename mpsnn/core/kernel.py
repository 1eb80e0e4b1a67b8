"""The kernel base (`Kernel`, MPS ``MPSKernel``) and the checks every encode shares.

Subclasses: `mpsnn.core.cnn_kernel.CNNKernel` (one source), `mpsnn.core.binary.BinaryKernel`
(two sources) and `mpsnn.core.binary.GradientKernel`. Every encode ends in
`mpsnn.core.encode.apply_encoding` (see that module for the validate → plan → apply steps).

Kernels cache plans per configuration. Any assignment of a public attribute (a property such
as ``edge_mode`` or ``zero_pad_size_x``) bumps the kernel's configuration number, which is
part of every plan key, so a cached plan never outlives the configuration it was made for.
"""

from __future__ import annotations

import enum
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from mpsnn.core._checks import check_int, check_type
from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.device import Device
from mpsnn.core.encode import Encoding, apply_encoding
from mpsnn.core.geometry import PaddingMethod, Region
from mpsnn.core.image import Image, _check_usable
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.saved import Field, declare_saved_fields
from mpsnn.core.state import StateBatch

__all__ = [
    "Kernel",
    "KernelOptions",
    "TrainingStyle",
    "image_sequences",
    "resolve_images",
    "resolve_span",
]

_F = TypeVar("_F", bound=Callable[..., Any])


def image_sequences(*sources: str, destinations: tuple[str, ...] = ()) -> Callable[[_F], _F]:
    """Decorate an ``encode_batch(self, command_buffer, ...)`` so that its parameters
    ``sources`` and ``destinations`` take any sequence of `Image` s as well as an `ImageBatch`
    (MPS's ``MPSImageBatch`` is an array of images).

    A sequence becomes a batch through `ImageBatch._of`: one image, or views of one batch's
    consecutive images, without a copy; separate permanent source images stacked into a new
    image by a command recorded on the command buffer first (rolled back, with whatever the
    encode recorded, if the encode then fails: a failed encode leaves the buffer as it was).
    Destinations must need no copy, since the results are written where they are. Calls whose
    batches are all `ImageBatch` es (or None) go straight through.
    """
    names = sources + destinations

    def wrap(fn: _F) -> _F:
        sig = inspect.signature(fn)
        params = list(sig.parameters)
        where = [(n, params.index(n) - 1) for n in names]  # positions after ``self``

        @functools.wraps(fn)
        def encode_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
            for n, i in where:
                v = args[i] if i < len(args) else kwargs.get(n)
                if v is not None and not isinstance(v, ImageBatch):
                    break
            else:
                return fn(self, *args, **kwargs)
            bound = sig.bind(self, *args, **kwargs)
            cb = bound.arguments["command_buffer"]
            self._check_command_buffer(cb)
            who, mark = type(self).__name__, cb._mark()
            try:
                for n in names:
                    v = bound.arguments.get(n)
                    if v is not None:
                        bound.arguments[n] = ImageBatch._of(
                            cb, who, n, v, destination=n in destinations
                        )
                return fn(*bound.args, **bound.kwargs)
            except BaseException:
                cb._rollback(mark)
                raise

        return encode_batch  # type: ignore[return-value]

    return wrap


class KernelOptions(enum.IntFlag):
    """MPS ``MPSKernelOptions``. mpsnn validates always (validation reads no device memory);
    ALLOW_REDUCED_PRECISION lets convolutions honour a half accumulator option."""

    NONE = 0
    SKIP_API_VALIDATION = 1
    ALLOW_REDUCED_PRECISION = 2
    DISABLE_INTERNAL_TILING = 4
    INSERT_DEBUG_GROUPS = 8
    VERBOSE = 16


class TrainingStyle(enum.IntEnum):
    """Where a trainable layer's update runs when a graph trains it (MPS
    ``MPSNNTrainingStyle``): the data source's ``update_on_cpu`` after completion, or its
    ``update`` encoded on the command buffer (the default)."""

    UPDATE_ON_CPU = 0
    UPDATE_ON_GPU = 1


class Kernel:
    """Base of every kernel (MPS ``MPSKernel``): a device, a label and options."""

    _config = 0  # bumped by every public assignment: part of every plan-cache key
    # whether the kernel's command may run beside side-stream work of an earlier command
    # (`mpsnn.core.command_buffer._Command`): it neither reads what such work writes (a
    # convolution's weight gradient sums) nor writes what it reads
    _runs_beside = False
    #: what the class saves (see `mpsnn.core.saved`): a class whose own body sets it is
    #: saved and loaded by `mpsnn.io` with no codec of its own
    saved_fields: ClassVar[tuple[Field, ...]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "saved_fields" in cls.__dict__:
            declare_saved_fields(cls)

    def __init__(self, device: Device) -> None:
        if not isinstance(device, Device):
            raise TypeError(
                f"[{type(self).__name__}] device must be a Device, got {type(device).__name__}"
            )
        self._device = device
        self._options = KernelOptions.NONE
        self.label: str | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name[0] != "_":
            object.__setattr__(self, "_config", self._config + 1)

    def _apply(self, cb: CommandBuffer, enc: Encoding) -> list[Image | None]:
        """Apply a validated plan: the only step of an encode that changes anything."""
        return apply_encoding(self, cb, enc)

    @property
    def device(self) -> Device:
        return self._device

    @property
    def options(self) -> KernelOptions:
        return self._options

    @options.setter
    def options(self, value: KernelOptions) -> None:
        self._options = KernelOptions(check_int(type(self).__name__, "options", value, 0))

    # -- validation shared by every encode -------------------------------------------------

    def _check_command_buffer(self, cb: Any) -> None:
        if not isinstance(cb, CommandBuffer):
            raise TypeError(
                f"[{type(self).__name__}] command_buffer must be a CommandBuffer, "
                f"got {type(cb).__name__}"
            )
        cb.check_encodable(type(self).__name__)
        device = cb._queue._device
        if device is not self._device and device != self._device:
            raise ValueError(
                f"[{type(self).__name__}] the command buffer must be on {self._device}, "
                f"got one on {cb.device}"
            )

    def _check_image(self, cb: CommandBuffer, image: Any, name: str) -> Image:
        who = type(self).__name__
        if not isinstance(image, Image):
            raise TypeError(f"[{who}] {name} must be an Image, got {type(image).__name__}")
        if image._device is not self._device and image._device != self._device:
            raise ValueError(
                f"[{who}] {name} must be on the kernel's device {self._device}, "
                f"got an image on {image._device}"
            )
        _check_usable(who, name, image, cb)
        return image

    def _check_destination(self, cb: CommandBuffer, image: Any, name: str, *inputs: Image) -> Image:
        """A destination: an image of this device that every element can be written to, and
        that shares no storage with any input."""
        who = type(self).__name__
        self._check_image(cb, image, name)
        image._check_writable(who, name)
        root = image._root()
        for src in inputs:
            if src is not None and src._root() is root:
                raise ValueError(
                    f"[{who}] {name} must not alias an input (MPS forbids in-place encodes), "
                    "got the same image"
                )
        return image

    def _check_state(self, cb: CommandBuffer, state: Any, name: str, kind: type[Any]) -> Any:
        who = type(self).__name__
        if not isinstance(state, kind):
            raise TypeError(f"[{who}] {name} must be a {kind.__name__}, got {type(state).__name__}")
        if state._device != self._device:
            raise ValueError(
                f"[{who}] {name} must be on the kernel's device {self._device}, "
                f"got a state on {state._device}"
            )
        state._check_live(who)
        if state._command_buffer is not None and state._command_buffer is not cb:
            raise ValueError(
                f"[{who}] {name} is a temporary state of another command buffer; a temporary "
                "state must be used on the command buffer it was made for"
            )
        return state

    def _check_batch(self, cb: CommandBuffer, batch: Any, name: str) -> Image:
        if not isinstance(batch, ImageBatch):
            raise TypeError(
                f"[{type(self).__name__}] {name} must be an ImageBatch "
                "(see ImageBatch.from_images), "
                f"got {type(batch).__name__}"
            )
        return self._check_image(cb, batch._image, name)

    def _check_state_batch(
        self,
        cb: CommandBuffer,
        states: Any,
        name: str,
        kind: type,
        count: int,
        *,
        shared: bool = False,
    ) -> list[Any]:
        """Check a batch of states (one per image) and return it as a list; ``shared``: the
        kernel keeps one state for the whole batch, so the batch must repeat one state."""
        if not isinstance(states, Sequence) or isinstance(states, str | bytes):
            raise TypeError(
                f"[{type(self).__name__}] {name} must be a StateBatch, got {type(states).__name__}"
            )
        if len(states) != count:
            raise ValueError(
                f"[{type(self).__name__}] {name} must hold one state per image ({count}), "
                f"got {len(states)}"
            )
        unique = StateBatch(states).unique()
        if shared and len(unique) != 1:
            raise ValueError(
                f"[{type(self).__name__}] {name} must repeat one state (see result_state_batch), "
                f"got {len(unique)} distinct states"
            )
        for s in unique:
            self._check_state(cb, s, name, kind)
        return list(states)


class SharedProperties:
    """The properties that unary and binary kernels share (MPS declares them on both
    ``MPSCNNKernel`` and ``MPSCNNBinaryKernel``): the clip rect, the destination channel offset,
    the padding policy, the destination allocator and the batch hooks. Subclasses set ``_clip``,
    ``_dco``, ``_padding`` and ``_allocator`` in ``__init__``; families that keep one state for
    a batch, or need the whole batch done before consumers, set the class flags."""

    _clip: Region
    _dco: int
    _padding: Any
    _allocator: Any
    _reused_across_batch = False
    _batch_barrier = False

    @property
    def is_result_state_reused_across_batch(self) -> bool:
        """True when ``result_state_batch`` repeats one shared state (accumulating kernels)."""
        return self._reused_across_batch

    @property
    def append_batch_barrier(self) -> bool:
        """True when consumers must wait for the whole batch (statistics kernels)."""
        return self._batch_barrier

    @property
    def clip_rect(self) -> Region:
        """Destination region to write (intersected with the destination)."""
        return self._clip

    @clip_rect.setter
    def clip_rect(self, value: Region) -> None:
        self._clip = check_type(type(self).__name__, "clip_rect", value, Region)

    @property
    def destination_feature_channel_offset(self) -> int:
        """First destination channel written (concatenation without a copy)."""
        return self._dco

    @destination_feature_channel_offset.setter
    def destination_feature_channel_offset(self, value: int) -> None:
        self._dco = check_int(type(self).__name__, "destination_feature_channel_offset", value, 0)

    @property
    def padding(self) -> Any:
        """The padding policy: sizes returned destinations and sets the offset."""
        return self._padding

    @padding.setter
    def padding(self, value: Any) -> None:
        if not hasattr(value, "padding_method"):
            raise TypeError(
                f"[{type(self).__name__}] padding must have a padding_method (see DefaultPadding), "
                f"got {type(value).__name__}"
            )
        _ = PaddingMethod(value.padding_method).size_style  # validates the size field
        self._padding = value

    @property
    def destination_image_allocator(self) -> Any:
        """Makes the destinations of returning encodes (``image(cb, descriptor, kernel)``)."""
        return self._allocator

    @destination_image_allocator.setter
    def destination_image_allocator(self, value: Any) -> None:
        if not callable(getattr(value, "image", None)):
            raise TypeError(
                f"[{type(self).__name__}] destination_image_allocator must have an "
                f"image(command_buffer, descriptor, kernel) method, got {type(value).__name__}"
            )
        self._allocator = value


def resolve_images(
    who: str, src_n: int, dst_n: int, offset_z: int, clip: Region, batch: bool
) -> tuple[int, int, int]:
    """(first source image, first destination image, count) of an encode."""
    if batch:
        if src_n != dst_n:
            raise ValueError(
                f"[{who}] the destination batch must hold as many images as the source ({src_n}), "
                f"got {dst_n}"
            )
        return 0, 0, src_n
    if offset_z < 0 or clip.origin.z < 0:
        raise ValueError(
            f"[{who}] offset.z and clip_rect.origin.z must be >= 0, "
            f"got {offset_z} and {clip.origin.z}"
        )
    count = min(clip.size.depth, src_n - offset_z, dst_n - clip.origin.z)
    if count <= 0:
        raise ValueError(
            f"[{who}] offset.z ({offset_z}) and the clip rect's z range "
            f"({clip.origin.z}, depth {clip.size.depth}) must select at least one image of the "
            f"{src_n}-image source and {dst_n}-image destination, got none"
        )
    return offset_z, clip.origin.z, count


def resolve_span(who: str, axis: str, origin: int, size: int, extent: int) -> tuple[int, int]:
    """Clip span ``[origin, origin + size)`` intersected with ``[0, extent)`` -> (first, count)."""
    lo = max(origin, 0)
    hi = min(origin + size, extent)
    if hi <= lo:
        raise ValueError(
            f"[{who}] the clip rect must overlap the {extent}-pixel destination along {axis}, "
            f"got origin {origin} and size {size}"
        )
    return lo, hi - lo
