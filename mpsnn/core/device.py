"""Devices, command queues and command buffers (SPEC §3).

A `CommandBuffer` records work: every ``encode`` validates its arguments from shapes and
configuration only (no device memory is read, so nothing synchronizes) and appends a command.
Nothing is guaranteed to have run before `CommandBuffer.commit`. On the CPU, ``commit`` runs the
commands in order before it returns. On CUDA it launches them on the queue's stream and returns;
a per-queue completion thread waits for the stream, marks the buffer COMPLETED and runs the
completed handlers. `CommandBuffer.wait_until_completed` returns after the handlers ran and
re-raises any exception the work raised.
"""

from __future__ import annotations

import atexit
import enum
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CommandBuffer", "CommandBufferStatus", "CommandQueue", "Device"]


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


class CommandBufferStatus(enum.IntEnum):
    """Life cycle of a command buffer (a subset of ``MTLCommandBufferStatus``)."""

    NOT_ENQUEUED = 0
    COMMITTED = 2
    COMPLETED = 4
    ERROR = 5


class CommandQueue:
    """Creates command buffers; work committed to one queue runs in commit order.

    On CUDA the queue owns a stream: by default the current stream of the device when the queue
    is made (usually the default stream), so its work is ordered with the caller's PyTorch work
    without extra synchronization. Given a private ``stream``, each commit first makes that
    stream wait for the caller's current stream (so inputs written there are ready).
    """

    __slots__ = ("_device", "_stream", "_worker", "label")

    def __init__(
        self, device: Device, label: str | None = None, *, stream: torch.cuda.Stream | None = None
    ) -> None:
        if not isinstance(device, Device):
            raise TypeError(f"[CommandQueue] device must be a Device, got {type(device).__name__}")
        self._device = device
        self.label = label
        if device.type != "cuda":
            if stream is not None:
                raise ValueError("[CommandQueue] a stream needs a CUDA device, got one for the CPU")
            self._stream = None
        else:
            if stream is not None and stream.device != device.torch_device:
                raise ValueError(
                    f"[CommandQueue] stream must be on {device.torch_device}, "
                    f"got one on {stream.device}"
                )
            self._stream = stream or torch.cuda.current_stream(device.torch_device)
        self._worker: _CompletionWorker | None = None

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

    def _completion_worker(self) -> _CompletionWorker:
        if self._worker is None:
            self._worker = _CompletionWorker()
        return self._worker


class _Command:
    __slots__ = ("fn", "name", "releases")

    def __init__(self, name: str, fn: Callable[[], Any]) -> None:
        self.name = name
        self.fn = fn
        self.releases: list[Any] | None = None


class CommandBuffer:
    """A list of encoded commands, committed once (MPS/Metal ``MTLCommandBuffer``).

    Attributes:
        status: a `CommandBufferStatus`.
        error: the exception the work raised, if any (status ERROR).
        label: a name for debugging.
    """

    __slots__ = (
        "_commands",
        "_done",
        "_event",
        "_handlers",
        "_pending_releases",
        "_queue",
        "error",
        "label",
        "status",
    )

    def __init__(self, command_queue: CommandQueue, label: str | None = None) -> None:
        self._queue = command_queue
        self.label = label
        self.status = CommandBufferStatus.NOT_ENQUEUED
        self.error: BaseException | None = None
        self._commands: list[_Command] = []
        self._handlers: list[Callable[[CommandBuffer], Any]] = []
        self._pending_releases: list[Any] = []  # released before the first command runs
        self._done: threading.Event | None = None  # only for asynchronous (CUDA) completion
        self._event: torch.cuda.Event | None = None

    @property
    def command_queue(self) -> CommandQueue:
        return self._queue

    @property
    def device(self) -> Device:
        return self._queue._device

    def __len__(self) -> int:
        """Number of encoded commands."""
        return len(self._commands)

    def add_completed_handler(self, handler: Callable[[CommandBuffer], Any]) -> None:
        """Run ``handler(command_buffer)`` once the work completed (before waiters wake up)."""
        if not callable(handler):
            raise TypeError(
                f"[CommandBuffer] handler must be callable, got {type(handler).__name__}"
            )
        if self.status is not CommandBufferStatus.NOT_ENQUEUED:
            raise ValueError(
                "[CommandBuffer] completed handlers must be added before commit(), "
                f"got status {self.status.name}"
            )
        self._handlers.append(handler)

    def check_encodable(self, who: str) -> None:
        """Raise unless work can still be encoded (the buffer was not committed)."""
        if self.status is not CommandBufferStatus.NOT_ENQUEUED:
            raise ValueError(
                f"[{who}] the command buffer must not be committed yet, "
                f"got status {self.status.name}"
            )

    # -- recording (kernels call these after validation succeeded) --------------------------

    def record(self, name: str, fn: Callable[[], Any]) -> None:
        """Append one command; ``fn`` runs at commit on the queue's device/stream."""
        self._commands.append(_Command(name, fn))

    def release_after_last(self, resource: Any) -> None:
        """Free ``resource`` (its ``_free_storage()``) once the last recorded command has run."""
        if self._commands:
            last = self._commands[-1]
            if last.releases is None:
                last.releases = []
            last.releases.append(resource)
        else:
            self._pending_releases.append(resource)

    # -- execution -----------------------------------------------------------------------

    def commit(self) -> None:
        """Run (CPU) or launch (CUDA) the encoded work. A command buffer is committed once."""
        if self.status is not CommandBufferStatus.NOT_ENQUEUED:
            raise ValueError(
                "[CommandBuffer] a command buffer is committed once, "
                f"got commit() with status {self.status.name}"
            )
        self.status = CommandBufferStatus.COMMITTED
        stream = self._queue._stream
        if stream is None:
            self._run()
            self._finish()
            return
        self._done = threading.Event()
        current = torch.cuda.current_stream(stream.device)
        if current == stream:
            self._run()
        else:
            # Work the caller queued on its current stream (inputs) must finish first.
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                self._run()
        self._event = torch.cuda.Event()
        self._event.record(stream)
        self._queue._completion_worker().submit(self)

    def _run(self) -> None:
        for res in self._pending_releases:
            res._free_storage()
        commands = self._commands
        failed = False
        for cmd in commands:
            if not failed:
                try:
                    cmd.fn()
                except Exception as exc:  # kept for wait_until_completed(), like Metal errors
                    exc.add_note(f"while running command {cmd.name!r} of {self!r}")
                    self.error = exc
                    failed = True
            if cmd.releases:
                for res in cmd.releases:
                    res._free_storage()

    def _finish(self) -> None:
        # Called once the device work is done (CPU: right away; CUDA: from the worker thread).
        self._commands = []  # drop the closures, and with them the tensors they kept alive
        self.status = CommandBufferStatus.ERROR if self.error else CommandBufferStatus.COMPLETED
        for handler in self._handlers:
            try:
                handler(self)
            except Exception as exc:
                exc.add_note(f"raised by a completed handler of {self!r}")
                if self.error is None:
                    self.error = exc
                self.status = CommandBufferStatus.ERROR
        if self._done is not None:
            self._done.set()

    def wait_until_completed(self) -> None:
        """Block until the work and the completed handlers are done; re-raise their error."""
        if self.status is CommandBufferStatus.NOT_ENQUEUED:
            raise ValueError(
                "[CommandBuffer] wait_until_completed() needs a committed command buffer, "
                "got status NOT_ENQUEUED"
            )
        if self._done is not None:
            self._done.wait()
        if self.error is not None:
            raise self.error

    def __repr__(self) -> str:
        label = f" {self.label!r}" if self.label else ""
        return f"<CommandBuffer{label} {self.status.name}, {len(self._commands)} commands>"


class _CompletionWorker:
    """One daemon thread per CUDA queue: waits for each committed buffer's event, in order.

    At interpreter exit the workers drain what was committed (`_drain_workers`), so no thread is
    inside CUDA while the runtime shuts down.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[CommandBuffer | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="mpsnn-completion", daemon=True)
        self._thread.start()
        _WORKERS.add(self)

    def submit(self, cb: CommandBuffer) -> None:
        self._queue.put(cb)

    def stop(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            cb = self._queue.get()
            if cb is None:
                return
            try:
                assert cb._event is not None  # internal invariant: set by commit()
                cb._event.synchronize()
            except Exception as exc:  # a device fault (illegal address, ...)
                if cb.error is None:
                    cb.error = exc
            cb._finish()


_WORKERS: weakref.WeakSet[_CompletionWorker] = weakref.WeakSet()


@atexit.register
def _drain_workers() -> None:
    for worker in list(_WORKERS):
        worker.stop(timeout=60.0)
