"""The completion thread of a CUDA command queue.

Only a CUDA buffer with completed handlers needs a thread: its queue
(`mpsnn.core.device.CommandQueue`) starts one `_CompletionWorker` lazily, which waits for such
buffers in commit order and runs their handlers; the worker ends when its queue is
garbage-collected, and every worker left is drained at interpreter exit.

This module sits below `mpsnn.core.device` (whose queues start its workers): it knows a command
buffer only through `_Completable`, what the worker reads and calls.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from typing import Protocol

import torch


class _Completable(Protocol):
    """What the worker needs of a committed command buffer
    (`mpsnn.core.command_buffer.CommandBuffer`)."""

    error: BaseException | None
    _event: torch.cuda.Event | None
    _done: threading.Event | None

    def _record_error(self, exc: BaseException, name: str) -> None: ...

    def _complete(self) -> None: ...


class _CompletionWorker:
    """A daemon thread for one CUDA queue: waits for each submitted buffer's event, in order,
    and runs its completed handlers. It holds no reference to its queue and stops when the
    queue is collected (`stop_soon`) or at interpreter exit (after draining)."""

    def __init__(self, label: str | None) -> None:
        self._queue: queue.SimpleQueue[_Completable | None] = queue.SimpleQueue()
        name = f"mpsnn-completion-{label}" if label else "mpsnn-completion"
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _WORKERS.add(self)

    def submit(self, cb: _Completable) -> None:
        self._queue.put(cb)

    def stop_soon(self) -> None:
        self._queue.put(None)

    def stop(self, timeout: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            cb = self._queue.get()
            if cb is None:
                return
            event = cb._event
            try:
                if event is not None:
                    event.synchronize()
            except Exception as exc:  # a device fault (illegal address, ...)
                if cb.error is None:
                    cb._record_error(exc, "(device)")
            cb._complete()
            done = cb._done
            del cb  # hold no buffer (and so no queue) between submissions
            if done is not None:
                done.set()


_WORKERS: weakref.WeakSet[_CompletionWorker] = weakref.WeakSet()


@atexit.register
def _drain_workers() -> None:
    for worker in list(_WORKERS):
        worker.stop(timeout=60.0)
