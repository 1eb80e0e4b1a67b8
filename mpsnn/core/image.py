"""Images, temporary images, allocators and byte I/O.

An `Image` is backed by one tensor of shape ``(number_of_images, feature_channels, height,
width)``. Channels are dense: no padding to multiples of four, and channel offsets need not be
multiples of four.

Storage is allocated lazily. An image returned by an ``encode`` has no storage until the command
that writes it runs; when that command writes the whole image it *adopts* the result tensor
instead of copying it, so returning encodes cost no extra pass over memory. Touching
``image.tensor`` earlier allocates zeros, and the command then writes into them.

A `TemporaryImage` belongs to one command buffer. Its ``read_count`` starts at 1 and drops by one
at every encode that reads it; when it reaches 0 the storage is freed right after the command
that read it last, and any later use raises `StaleResourceError`.

A UNORM8 image stores uint8 bytes ``k`` that read as ``k/255``: kernels read it as float32 values
(`Image._read`) and write ``round(clamp(v, 0, 1) * 255)`` into it (`Image._write_block`);
``tensor`` and `Image.read_bytes` give the raw bytes (as MPS's ``readBytes``), `Image.numpy` the
float32 values ``k/255``. The region checks and conversions of byte I/O live in
`mpsnn.core.image_bytes`.

Storage that cannot be allocated raises `mpsnn.AllocationError` naming the sizes, dtype, byte
size and device (`mpsnn.core.allocation`), instead of the allocator's bare error.
"""

from __future__ import annotations

from typing import Any, Protocol, Self

import numpy as np
import torch

from mpsnn.core.allocation import allocation_error, is_allocation_failure
from mpsnn.core.command_buffer import CommandBuffer, CommandBufferStatus
from mpsnn.core.descriptor import (
    _FORMAT_TO_DTYPE,
    DataLayout,
    FeatureChannelFormat,
    ImageDescriptor,
    ImageReadWriteParams,
    _check_count,
)
from mpsnn.core.device import Device
from mpsnn.core.geometry import Region
from mpsnn.core.image_bytes import _bytes_to_write, _io_index, _to_numpy, _to_unorm8
from mpsnn.core.layout import storage_layout
from mpsnn.errors import AllocationError, CommandBufferError, StaleResourceError

__all__ = ["Image", "ImageAllocator", "TemporaryImage"]

_UNORM8 = FeatureChannelFormat.UNORM8


class Image:
    """A batch-of-one-or-more images: ``(number_of_images, feature_channels, height, width)``.

    Args:
        device: where the storage lives.
        descriptor: sizes and format.
        label: a name used in error messages and debug output.

    Contents written by an encode are valid once the command buffer completed.
    """

    __slots__ = (
        "_base",
        "_device",
        "_dtype",
        "_fmt",
        "_index",
        "_shape",
        "_storage",
        "_writer",
        "label",
    )

    def __init__(self, device: Device, descriptor: ImageDescriptor, *, label: str | None = None):
        if not isinstance(device, Device):
            raise TypeError(
                f"[{type(self).__name__}] device must be a Device, got {type(device).__name__}"
            )
        if not isinstance(descriptor, ImageDescriptor):
            raise TypeError(
                f"[{type(self).__name__}] descriptor must be an ImageDescriptor, "
                f"got {type(descriptor).__name__}"
            )
        self._device = device
        self._fmt = descriptor.channel_format
        self._dtype = self._fmt.dtype
        self._shape = descriptor.shape
        self._storage: torch.Tensor | None = None
        self._base: Image | None = None  # set for views (ImageBatch items)
        self._index = 0
        self._writer: CommandBuffer | None = None
        self.label = label

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, *, label: str | None = None) -> Image:
        """Wrap a ``(C, H, W)`` or ``(N, C, H, W)`` tensor without copying it (a uint8 tensor
        makes a UNORM8 image)."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"[Image] tensor must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dim() == 3:
            tensor = tensor.unsqueeze(0)
        if tensor.dim() != 4:
            raise ValueError(
                f"[Image] the tensor must have shape (C, H, W) or (N, C, H, W), "
                f"got shape {tuple(tensor.shape)}"
            )
        if min(tensor.shape) < 1:
            raise ValueError(
                f"[Image] every dimension must be >= 1, got shape {tuple(tensor.shape)}"
            )
        fmt = FeatureChannelFormat.from_dtype(tensor.dtype)
        n, c, h, w = tensor.shape
        image = cls.__new__(cls)
        Image.__init__(image, Device(tensor.device), ImageDescriptor(fmt, w, h, c, n), label=label)
        image._storage = tensor
        return image

    @staticmethod
    def default_allocator() -> ImageAllocator:
        """Allocator of permanent images (the default of every kernel in mpsnn)."""
        return _PERMANENT

    @classmethod
    def _make(cls, device: Device, descriptor: ImageDescriptor) -> Self:
        """Internal: an image for a descriptor already known to be valid (no checks)."""
        image = cls.__new__(cls)
        image._device = device
        image._fmt = descriptor._fmt
        image._dtype = _FORMAT_TO_DTYPE[descriptor._fmt]
        image._shape = (descriptor._n, descriptor._c, descriptor._h, descriptor._w)
        image._storage = None
        image._base = None
        image._index = 0
        image._writer = None
        image.label = None
        return image

    # -- properties ---------------------------------------------------------------------

    @property
    def device(self) -> Device:
        return self._device

    @property
    def width(self) -> int:
        return self._shape[3]

    @property
    def height(self) -> int:
        return self._shape[2]

    @property
    def feature_channels(self) -> int:
        return self._shape[1]

    @property
    def number_of_images(self) -> int:
        return self._shape[0]

    @property
    def feature_channel_format(self) -> FeatureChannelFormat:
        return self._fmt

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(number_of_images, feature_channels, height, width)``."""
        return self._shape

    @property
    def _read_dtype(self) -> torch.dtype:
        """The dtype kernels read (`_read`) and compute blocks for `_write_block` in: the
        storage's, float32 for UNORM8."""
        return torch.float32 if self._fmt is _UNORM8 else self._dtype

    @property
    def descriptor(self) -> ImageDescriptor:
        n, c, h, w = self._shape
        return ImageDescriptor(self._fmt, w, h, c, n)

    @property
    def read_count(self) -> int:
        """0: permanent images are not read-counted (see `TemporaryImage`)."""
        return 0

    @property
    def is_temporary(self) -> bool:
        return False

    @property
    def tensor(self) -> torch.Tensor:
        """The backing tensor (allocated as zeros on first access if nothing wrote it yet; uint8
        bytes for UNORM8).

        The contents are those of the last completed command buffer that wrote the image; on
        CUDA, torch work that reads the tensor on the queue's stream is ordered after it.

        Raises:
            ValueError: the command buffer that writes the image is not committed yet.
            CommandBufferError: the command buffer that writes the image failed.
        """
        self._check_live(None)
        writer = self._root()._writer
        if writer is not None:
            if writer._status is CommandBufferStatus.NOT_ENQUEUED:
                raise ValueError(
                    f"[{type(self).__name__}] reading {self._describe()} needs the command buffer "
                    "that writes it to be committed first, got status NOT_ENQUEUED"
                )
            if writer.error is not None:
                self._raise_failed(writer)
        return self._data()

    def _data(self) -> torch.Tensor:
        """The storage, for commands at execution time (no encode-time liveness check)."""
        if self._base is not None:
            return self._base._data()[self._index : self._index + self._shape[0]]
        if self._storage is None:
            device = self._device.torch_device
            layout = storage_layout(self._dtype, device)
            try:
                if layout is torch.preserve_format:  # new zeros: NCHW
                    self._storage = torch.zeros(self._shape, dtype=self._dtype, device=device)
                else:
                    self._storage = torch.empty(
                        self._shape, dtype=self._dtype, device=device, memory_format=layout
                    ).zero_()
            except (RuntimeError, MemoryError) as exc:
                if is_allocation_failure(exc):
                    raise self._allocation_error(exc) from exc
                raise
        return self._storage

    def _allocation_error(self, exc: BaseException) -> AllocationError:
        what = f"{self.label!r}, " if self.label else ""
        return allocation_error(
            type(self).__name__, [self._shape], self._dtype, self._device.torch_device, exc, what
        )

    def _read(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The contents as kernels read a source, at execution: the storage, or for UNORM8 a new
        tensor ``k/255`` (float32, or ``dtype`` when a kernel computes in a wider one)."""
        data = self._data()
        if self._fmt is _UNORM8:
            return data.to(dtype or torch.float32).div_(255)
        return data

    def numpy(self) -> np.ndarray:
        """The contents as an ``(N, C, H, W)`` array (bfloat16 is returned as float32, UNORM8 as
        the float32 values ``k/255``; `read_bytes` gives its raw bytes).

        Waits for a committed writer; raises if the writer was not committed.
        """
        self._sync_for_host("numpy")
        t = self.tensor
        if self._fmt is _UNORM8:
            t = t.float().div_(255)
        return _to_numpy(t)

    # -- byte I/O -----------------------------------------------------------------------

    def read_bytes(
        self,
        data_layout: DataLayout = DataLayout.HEIGHT_WIDTH_FEATURE_CHANNELS,
        image_index: int = 0,
        region: Region | None = None,
        feature_channel_info: ImageReadWriteParams | None = None,
    ) -> np.ndarray:
        """Copy a region of one image to a NumPy array.

        Returns ``(h, w, c)`` for HEIGHT_WIDTH_FEATURE_CHANNELS and ``(c, h, w)`` for
        FEATURE_CHANNELS_HEIGHT_WIDTH; bfloat16 images come back as float32 (exactly), UNORM8
        images as their raw uint8 bytes (as MPS's ``readBytes``; `numpy` gives ``k/255``).
        """
        self._sync_for_host("read_bytes")
        view = self._io_view("read_bytes", data_layout, image_index, region, feature_channel_info)
        return _to_numpy(view)

    def write_bytes(
        self,
        array: Any,
        data_layout: DataLayout = DataLayout.HEIGHT_WIDTH_FEATURE_CHANNELS,
        image_index: int = 0,
        region: Region | None = None,
        feature_channel_info: ImageReadWriteParams | None = None,
    ) -> None:
        """Copy an array into a region of one image (the shape must match the region).

        Into a UNORM8 image, uint8 data is written as is (the raw bytes, as MPS's
        ``writeBytes``) and float data as ``round(clamp(v, 0, 1) * 255)``.
        """
        self._sync_for_host("write_bytes")
        view = self._io_view("write_bytes", data_layout, image_index, region, feature_channel_info)
        data = _bytes_to_write(type(self).__name__, array, view.shape, self._fmt)
        view.copy_(data.to(self._device.torch_device))

    def _io_view(
        self,
        who: str,
        data_layout: DataLayout,
        image_index: int,
        region: Region | None,
        info: ImageReadWriteParams | None,
    ) -> torch.Tensor:
        index = _io_index(
            type(self).__name__, who, self._shape, data_layout, image_index, region, info
        )
        view = self.tensor[index]
        if data_layout is DataLayout.HEIGHT_WIDTH_FEATURE_CHANNELS:
            view = view.permute(1, 2, 0)
        return view

    def _sync_for_host(self, who: str) -> None:
        root = self._root()
        writer = root._writer
        if writer is None:
            return
        status = writer._status
        if status is CommandBufferStatus.NOT_ENQUEUED:
            raise ValueError(
                f"[{type(self).__name__}] {who} needs the command buffer that writes "
                f"{self._describe()} to be committed, got status NOT_ENQUEUED"
            )
        if status is CommandBufferStatus.COMMITTED:
            try:
                writer.wait_until_completed()
            except Exception:
                self._raise_failed(writer)
        if writer.error is not None:
            self._raise_failed(writer)

    def _raise_failed(self, writer: CommandBuffer) -> None:
        err = writer.error
        raise CommandBufferError(
            f"[{type(self).__name__}] {self._describe()} must come from work that ran, got a "
            f"result of {writer!r}, whose command {writer.failed_command!r} failed: "
            f"{type(err).__name__}: {err}"
        ) from err

    def _check_writable(self, who: str, name: str) -> None:
        """Raise unless every element of the image has its own memory (a destination of an
        expanded tensor would have several pixels written to one address)."""
        t = self._root()._storage
        if t is None:
            return
        if any(st == 0 and sz > 1 for st, sz in zip(t.stride(), t.shape, strict=True)) or (
            torch._debug_has_internal_overlap(t) == 1
        ):
            raise ValueError(
                f"[{who}] {name} must have one memory location per element (not an expanded or "
                f"overlapping tensor), got strides {tuple(t.stride())} for shape {tuple(t.shape)}"
            )

    # -- internals used by kernels ------------------------------------------------------

    def _root(self) -> Image:
        return self if self._base is None else self._base

    def _describe(self) -> str:
        label = f" {self.label!r}" if self.label else ""
        n, c, h, w = self._shape
        return f"{type(self).__name__}{label} {n}x{c}x{h}x{w}"

    def _check_live(self, who: str | None) -> None:
        """Raise StaleResourceError if the storage was released (temporary images only)."""

    def _consume_read(self, command_buffer: CommandBuffer, who: str) -> None:
        """An encode read this image (no effect on permanent images)."""

    def _note_writer(self, command_buffer: CommandBuffer) -> None:
        self._root()._writer = command_buffer

    def _write_block(
        self,
        block: torch.Tensor,
        z: int,
        c: int,
        y: int,
        x: int,
        source: torch.Tensor | None = None,
    ) -> None:
        """Write ``block`` (images, channels, rows, cols) at (z, c, y, x); runs at execution.

        A freshly computed ``block`` that covers a still-unallocated image becomes its storage
        (no copy). A view, or the ``source`` tensor itself, is copied instead, so that a
        destination never shares memory with an input. A UNORM8 image stores a floating-point
        block as ``round(clamp(v, 0, 1) * 255)``.
        """
        root = self if self._base is None else self._base  # _root(), without a call: per run
        z += self._index
        if root._fmt is _UNORM8 and block.is_floating_point():
            block = _to_unorm8(block)  # a new tensor: adopting it shares nothing
        if (
            root._storage is None
            and not (z or c or y or x)
            and block.shape == root._shape
            and block.dtype is root._dtype  # dtypes are singletons
            and block._base is None
            and (source is None or block.data_ptr() != source.data_ptr())
        ):
            root._storage = block
            return
        if root._storage is None and not (z or c or y or x) and block.shape == root._shape:
            # The whole image from a block it must not adopt (a view, the source itself, or
            # another dtype): one copy into new storage, not a zero fill and then a copy.
            layout = storage_layout(root._dtype, block.device)  # (mpsnn.core.layout)
            try:
                root._storage = block.to(root._dtype, memory_format=layout, copy=True)
            except (RuntimeError, MemoryError) as exc:
                if is_allocation_failure(exc):
                    raise root._allocation_error(exc) from exc
                raise
            return
        bn, bc, bh, bw = block.shape
        root._data()[z : z + bn, c : c + bc, y : y + bh, x : x + bw].copy_(block)

    def _free_storage(self) -> None:
        self._storage = None

    def __repr__(self) -> str:
        return f"<{self._describe()} {self._fmt.name} on {self._device.torch_device}>"


class TemporaryImage(Image):
    """An image that lives on one command buffer and is freed after its last reader.

    ``read_count`` starts at 1 and drops by one each time an encode reads the image; when it
    reaches 0 the storage is released after that encode's command has run, and reading,
    writing or changing ``read_count`` afterwards raises `StaleResourceError`. The storage is
    also released when the command buffer completes.
    """

    __slots__ = ("_command_buffer", "_freed", "_read_count", "_released_by")

    def __init__(
        self,
        command_buffer: CommandBuffer,
        descriptor: ImageDescriptor,
        *,
        label: str | None = None,
    ) -> None:
        if not isinstance(command_buffer, CommandBuffer):
            raise TypeError(
                "[TemporaryImage] command_buffer must be a CommandBuffer, "
                f"got {type(command_buffer).__name__}"
            )
        command_buffer.check_encodable("TemporaryImage")
        super().__init__(command_buffer.device, descriptor, label=label)
        self._command_buffer = command_buffer
        self._read_count = 1
        self._released_by: str | None = None
        self._freed = False
        command_buffer._on_enqueued(_release_temporary(self))

    @classmethod
    def _make_on(cls, command_buffer: CommandBuffer, descriptor: ImageDescriptor) -> TemporaryImage:
        """Internal: a temporary image for a descriptor known to be valid, on a buffer known to
        be encodable (a graph's intermediates: no checks, at every allocation of every step)."""
        image = cls._make(command_buffer._queue._device, descriptor)
        image._command_buffer = command_buffer
        image._read_count = 1
        image._released_by = None
        image._freed = False
        command_buffer._on_enqueued(_release_temporary(image))
        return image

    @classmethod
    def from_descriptor(
        cls,
        command_buffer: CommandBuffer,
        descriptor: ImageDescriptor,
        *,
        label: str | None = None,
    ) -> TemporaryImage:
        """A temporary image for ``command_buffer`` (MPS ``temporaryImageWithCommandBuffer:``)."""
        return cls(command_buffer, descriptor, label=label)

    @staticmethod
    def default_allocator() -> ImageAllocator:
        """Allocator of temporary images on the encoding command buffer."""
        return _TEMPORARY

    @property
    def command_buffer(self) -> CommandBuffer:
        return self._command_buffer

    @property
    def is_temporary(self) -> bool:
        return True

    @property
    def read_count(self) -> int:
        return self._read_count

    @read_count.setter
    def read_count(self, value: int) -> None:
        self._check_live("read_count")
        value = _check_count("TemporaryImage", "read_count", value, minimum=0)
        self._read_count = value
        if value == 0:
            self._release("read_count = 0")

    def _check_live(self, who: str | None) -> None:
        if self._released_by is not None:
            raise StaleResourceError(
                f"[{who or 'TemporaryImage'}] {self._describe()} must be live, but its "
                f"read_count reached 0 ({self._released_by}); raise read_count before that "
                "read to keep it, or use a permanent Image"
            )

    def _consume_read(self, command_buffer: CommandBuffer, who: str) -> None:
        self._read_count -= 1
        if self._read_count == 0:
            self._release(f"released after its last read by {who}")

    def _release(self, why: str) -> None:
        self._released_by = why
        self._command_buffer.release_after_last(self)

    def _data(self) -> torch.Tensor:
        if self._freed:
            raise RuntimeError(
                f"[TemporaryImage] internal error: {self._describe()} was used after its storage "
                "was freed; please report this"
            )
        return super()._data()

    def _free_storage(self) -> None:
        self._storage = None
        self._freed = True


def _check_usable(who: str, name: str, image: Image, command_buffer: Any) -> None:
    """``image`` may be read by work encoded on ``command_buffer``: live, and not a temporary
    image of another command buffer (what a kernel checks of a source, and a graph of the
    images it did not make)."""
    root = image._root()
    if type(root) is Image:  # permanent: always live, usable on any buffer (most encodes)
        return
    root._check_live(who)
    if isinstance(root, TemporaryImage) and root._command_buffer is not command_buffer:
        raise ValueError(
            f"[{who}] {name} is a TemporaryImage of another command buffer; a temporary "
            "image must be used on the command buffer it was made for"
        )


def _release_temporary(image: TemporaryImage) -> Any:
    def hook() -> None:
        if image._released_by is None:
            image._released_by = "its command buffer completed"
        image._free_storage()

    hook.resource = image  # type: ignore[attr-defined]  # what a capture keeps alive
    return hook


class ImageAllocator(Protocol):
    """Makes the destination images of returning encodes (MPS ``MPSImageAllocator``).

    ``image_batch`` is optional; without it a batch is allocated as one multi-image image.
    """

    def image(
        self, command_buffer: CommandBuffer, descriptor: ImageDescriptor, kernel: Any
    ) -> Image: ...


class _PermanentAllocator:
    def image(
        self, command_buffer: CommandBuffer, descriptor: ImageDescriptor, kernel: Any
    ) -> Image:
        return Image._make(command_buffer._queue._device, descriptor)

    def __repr__(self) -> str:
        return "Image.default_allocator()"


class _TemporaryAllocator:
    def image(
        self, command_buffer: CommandBuffer, descriptor: ImageDescriptor, kernel: Any
    ) -> Image:
        return TemporaryImage(command_buffer, descriptor)

    def __repr__(self) -> str:
        return "TemporaryImage.default_allocator()"


_PERMANENT = _PermanentAllocator()
_TEMPORARY = _TemporaryAllocator()
