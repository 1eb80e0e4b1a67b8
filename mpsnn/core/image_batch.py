"""`ImageBatch`: the training batch (MPS ``MPSImageBatch``), one tensor for N images."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np
import torch

from mpsnn.core.descriptor import FeatureChannelFormat, ImageDescriptor
from mpsnn.core.device import Device
from mpsnn.core.image import Image

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
