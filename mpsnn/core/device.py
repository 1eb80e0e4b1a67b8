"""Devices and command queues (MPS ``MTLDevice``, ``MTLCommandQueue``).

A `Device` names where images, states and kernels live; a `CommandQueue` makes command buffers
(`mpsnn.core.command_buffer`) and, on CUDA, owns the stream their work runs on, in commit
order.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.completion import _CompletionWorker

__all__ = [
    "CommandQueue",
    "Device",
]


class Device:
    """Where images, states and kernels live: ``Device("cpu")`` or ``Device("cuda[:N]")``.

    Two devices are equal when they name the same torch device; ``"cuda"`` means the current
    CUDA device.
    """

    __slots__ = ("_torch",)

    def __init__(self, kind: str | torch.device = "cpu") -> None:
        if not isinstance(kind, str | torch.device):
            raise TypeError(
                f"[Device] kind must be 'cpu', 'cuda' or 'cuda:N', got {type(kind).__name__}"
            )
        try:
            dev = torch.device(kind)
        except RuntimeError as exc:
            raise ValueError(
                f"[Device] kind must be 'cpu', 'cuda' or 'cuda:N', got {kind!r}"
            ) from exc
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"[Device] CUDA is not available on this machine, got {kind!r}")
            index = torch.cuda.current_device() if dev.index is None else dev.index
            if index >= torch.cuda.device_count():
                raise ValueError(
                    f"[Device] cuda index must be < {torch.cuda.device_count()}, got {index}"
                )
            dev = torch.device("cuda", index)
        elif dev.type != "cpu":
            raise ValueError(f"[Device] kind must be 'cpu', 'cuda' or 'cuda:N', got {kind!r}")
        self._torch = dev

    @classmethod
    def default(cls) -> Device:
        """The current CUDA device when CUDA is available, else the CPU."""
        return cls("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def torch_device(self) -> torch.device:
        """The `torch.device` tensors of this device live on."""
        return self._torch

    @property
    def type(self) -> str:
        """``"cpu"`` or ``"cuda"``."""
        return self._torch.type

    @property
    def name(self) -> str:
        """A human-readable name, e.g. ``"NVIDIA H100 80GB HBM3"`` or ``"cpu"``."""
        if self._torch.type == "cuda":
            return torch.cuda.get_device_name(self._torch)
        return "cpu"

    def new_command_queue(
        self, label: str | None = None, *, stream: torch.cuda.Stream | None = None
    ) -> CommandQueue:
        """A new queue. On CUDA its work runs on ``stream`` (default: the current stream when
        the queue is made, so it orders with the caller's PyTorch work at no cost)."""
        return CommandQueue(self, label=label, stream=stream)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Device) and other._torch == self._torch

    def __hash__(self) -> int:
        return hash(self._torch)

    def __repr__(self) -> str:
        return f"Device({str(self._torch)!r})"


# The current stream's raw handle by device index (None in a build without it): looked up
# once, not at every commit, and shared by every module that compares or passes streams (no
# Stream object made per call).
_raw_stream: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class CommandQueue:
    """Creates command buffers; work committed to one queue runs in commit order.

    On CUDA the queue owns a stream: by default the current stream of the device when the queue
    is made (usually the default stream), so its work is ordered with the caller's PyTorch work
    without extra synchronization. Given a private ``stream``, each commit first makes that
    stream wait for the caller's current stream (so inputs written there are ready).
    """

    __slots__ = (
        "__weakref__",
        "_device",
        "_index",
        "_raw",
        "_side",
        "_spare_events",
        "_stream",
        "_worker",
        "label",
    )

    def __init__(
        self, device: Device, label: str | None = None, *, stream: torch.cuda.Stream | None = None
    ) -> None:
        if not isinstance(device, Device):
            raise TypeError(f"[CommandQueue] device must be a Device, got {type(device).__name__}")
        self._device = device
        self.label = label
        self._worker: _CompletionWorker | None = None
        # Completion events of this queue's finished buffers, reused by later commits: making
        # and first recording a CUDA event costs about three times recording a used one.
        self._spare_events: list[torch.cuda.Event] = []
        self._side: torch.cuda.Stream | None = None  # made by the first `_side_stream()`
        if device.type != "cuda":
            if stream is not None:
                raise ValueError("[CommandQueue] a stream needs a CUDA device, got one for the CPU")
            self._stream = None
            self._index = -1
            self._raw = 0
            return
        if stream is not None and stream.device != device.torch_device:
            raise ValueError(
                f"[CommandQueue] stream must be on {device.torch_device}, "
                f"got one on {stream.device}"
            )
        self._stream = stream or torch.cuda.current_stream(device.torch_device)
        self._index = device.torch_device.index
        self._raw = self._stream.cuda_stream

    @property
    def device(self) -> Device:
        return self._device

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream commands run on (None on the CPU)."""
        return self._stream

    def command_buffer(self, label: str | None = None) -> CommandBuffer:
        """A new, empty command buffer of this queue."""
        return CommandBuffer(self, label)

    def _take_event(self) -> torch.cuda.Event:
        """An event to record a commit's completion with (a spare one when there is one)."""
        try:
            return self._spare_events.pop()
        except IndexError:  # none spare (or another thread took the last one)
            return torch.cuda.Event()

    def _side_stream(self) -> torch.cuda.Stream | None:
        """The second stream of this queue (CUDA; None on the CPU): work a command hands to
        `CommandBuffer._beside` runs there, beside the commands that follow it."""
        if self._stream is None:
            return None
        side = self._side
        if side is None:
            side = self._side = torch.cuda.Stream(self._device.torch_device)
        return side

    def _completion_worker(self) -> _CompletionWorker:
        worker = self._worker
        if worker is None:
            worker = self._worker = _CompletionWorker(self.label)
            weakref.finalize(self, worker.stop_soon)  # the thread ends with its queue
        return worker

    def _enter_stream(self) -> torch.cuda.StreamContext | None:
        """A context that makes this queue's stream current, or None when it already is.

        Comparing raw stream handles is cheap; building `torch.cuda.current_stream()` objects
        costs several microseconds, which matters at one commit per training step.
        """
        if _raw_stream is not None and _raw_stream(self._index) == self._raw:
            return None
        current = torch.cuda.current_stream(self._device.torch_device)
        if current == self._stream:
            return None
        # Work the caller queued on its current stream (inputs) must finish first.
        self._stream.wait_stream(current)  # type: ignore[union-attr]  # a CUDA queue has a stream
        return torch.cuda.stream(self._stream)
