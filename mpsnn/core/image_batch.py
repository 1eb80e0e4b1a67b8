"""`ImageBatch`: the training batch (MPS ``MPSImageBatch``), one tensor for N images."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import numpy as np
import torch

from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.descriptor import FeatureChannelFormat, ImageDescriptor
from mpsnn.core.device import Device
from mpsnn.core.image import Image, _check_usable

__all__ = ["ImageBatch"]


class ImageBatch(Sequence[Image]):
    """A training batch (MPS ``MPSImageBatch``): images of one shape, backed by one tensor.

    ``batch[i]`` is a view of image ``i``; batch kernels run on the whole ``(N, C, H, W)``
    tensor as one operation.
    """

    __slots__ = ("_image",)

    def __init__(self, image: Image) -> None:
        if not isinstance(image, Image):
            raise TypeError(f"[ImageBatch] image must be an Image, got {type(image).__name__}")
        self._image = image

    @classmethod
    def from_tensor(cls, tensor: torch.Tensor, *, label: str | None = None) -> ImageBatch:
        """Wrap an ``(N, C, H, W)`` tensor without copying (a uint8 tensor makes a UNORM8
        batch)."""
        if isinstance(tensor, torch.Tensor) and tensor.dim() != 4:
            raise ValueError(
                f"[ImageBatch] the tensor must have shape (N, C, H, W), got {tuple(tensor.shape)}"
            )
        return cls(Image.from_tensor(tensor, label=label))

    @classmethod
    def from_images(cls, images: Sequence[Image], *, label: str | None = None) -> ImageBatch:
        """Stack images of one shape, format and device into a new batch (copies)."""
        images = list(images)
        if not images:
            raise ValueError("[ImageBatch] from_images needs at least one image, got 0")
        first = images[0]
        for i, im in enumerate(images):
            if not isinstance(im, Image):
                raise TypeError(
                    f"[ImageBatch] images[{i}] must be an Image, got {type(im).__name__}"
                )
            if (
                im.shape[1:] != first.shape[1:]
                or im.dtype != first.dtype
                or im.device != first.device
            ):
                raise ValueError(
                    "[ImageBatch] from_images needs images of one shape, format and device, "
                    f"got {first!r} and images[{i}] = {im!r}"
                )
        return cls(Image.from_tensor(torch.cat([im.tensor for im in images]), label=label))

    @classmethod
    def _of(
        cls, cb: CommandBuffer, who: str, name: str, value: Any, *, destination: bool = False
    ) -> Any:
        """``value`` as a batch for an ``encode_batch``: an `ImageBatch` as it is (anything
        else that is not a sequence: as it is, for the caller's type check), or a sequence
        of `Image` s (an MPS ``MPSImageBatch`` is an array of images) of one shape, format
        and device. Without a copy when they are one image, or views of one batch's
        consecutive images in order (``list(batch)``, ``batch[2:5]``); sources held in
        separate permanent images are stacked into a new image by a command recorded on ``cb``
        (read when the work runs; the caller rolls it back if its encode fails); destinations
        must need no copy, since the results are written where they are.

        Raises:
            TypeError: an element is not an `Image`.
            ValueError: no image; images of different shapes, formats or devices; separate
                destination images, or separate temporary source images.
        """
        if isinstance(value, ImageBatch | Image):
            return value
        if not isinstance(value, Sequence) or isinstance(value, str | bytes):
            return value
        images = list(value)
        if not images:
            raise ValueError(f"[{who}] {name} must hold at least one image, got 0")
        for i, im in enumerate(images):
            if not isinstance(im, Image):
                raise TypeError(f"[{who}] {name}[{i}] must be an Image, got {type(im).__name__}")
        first = images[0]
        for i, im in enumerate(images):
            if (
                im._shape[1:] != first._shape[1:]
                or im._fmt is not first._fmt
                or im._device != first._device
            ):
                raise ValueError(
                    f"[{who}] {name} must hold images of one shape, format and device "
                    f"({first._describe()} on {first._device}), got {name}[{i}] = "
                    f"{im._describe()} on {im._device}"
                )
        if len(images) == 1:
            return cls(first)
        n = sum(im._shape[0] for im in images)
        _, c, h, w = first._shape
        desc = ImageDescriptor(first._fmt, w, h, c, n)
        base, start = first._base, first._index
        if base is not None and all(im._base is base for im in images):
            at = start
            for im in images:
                if im._index != at:
                    break
                at += im._shape[0]
            else:  # consecutive views of one batch: a view of that range, no copy
                if start == 0 and n == base._shape[0]:
                    return cls(base)
                view = Image._make(first._device, desc)
                view._base, view._index = base, start
                return cls(view)
        if destination:
            raise ValueError(
                f"[{who}] {name} must be an ImageBatch, one image, or views of one batch's "
                f"consecutive images (the results are written in place), got {len(images)} "
                "separate images"
            )
        for i, im in enumerate(images):
            _check_usable(who, f"{name}[{i}]", im, cb)
            if im._root().is_temporary:  # its read count would count the copy's read only
                raise ValueError(
                    f"[{who}] {name}[{i}] must be a permanent image to be stacked with separate "
                    "images, got a temporary one (pass an ImageBatch, or views of one batch)"
                )
        out = Image._make(first._device, desc)

        def stack() -> None:
            dst, at = out._data(), 0
            for im in images:
                k = im._shape[0]
                dst[at : at + k].copy_(im._data())
                at += k

        cb.record(f"{who}.stack {name}", stack)
        out._writer = cb
        return cls(out)

    @property
    def image(self) -> Image:
        """The backing multi-image image."""
        return self._image

    @property
    def tensor(self) -> torch.Tensor:
        return self._image.tensor

    @property
    def device(self) -> Device:
        return self._image.device

    @property
    def feature_channel_format(self) -> FeatureChannelFormat:
        return self._image.feature_channel_format

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self._image.shape

    @property
    def read_count(self) -> int:
        return self._image.read_count

    def numpy(self) -> np.ndarray:
        return self._image.numpy()

    def __len__(self) -> int:
        return self._image.number_of_images

    @overload
    def __getitem__(self, index: int) -> Image: ...

    @overload
    def __getitem__(self, index: slice) -> list[Image]: ...

    def __getitem__(self, index: int | slice) -> Image | list[Image]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"[ImageBatch] index must be in [-{n}, {n}), got {index}")
        index %= n
        view = Image.__new__(Image)
        _, c, h, w = self._image.shape
        Image.__init__(
            view,
            self._image.device,
            ImageDescriptor(self._image.feature_channel_format, w, h, c, 1),
            label=f"{self._image.label or 'batch'}[{index}]",
        )
        view._base = self._image
        view._index = index
        return view

    def __iter__(self) -> Iterator[Image]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return f"<ImageBatch of {len(self)}: {self._image!r}>"
