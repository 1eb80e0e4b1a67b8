"""Command buffers (MPS/Metal ``MTLCommandBuffer``): encoded work, committed once.

A `CommandBuffer` records work: every ``encode`` validates its arguments from shapes and
configuration only (no device memory is read, so nothing synchronizes) and appends a command.
Nothing is guaranteed to have run before `CommandBuffer.commit`.

* On the CPU, ``commit`` runs the commands in order before it returns.
* On CUDA, ``commit`` launches them on the queue's stream, records one CUDA event and returns.
  Completion is observed on the caller's thread: `CommandBuffer.wait_until_completed` waits for
  the event, and `CommandBuffer.status` polls it. Only a buffer with completed handlers needs a
  thread: its queue starts one worker (lazily, `mpsnn.core.completion`) that waits for such
  buffers in commit order and runs their handlers; the worker ends when its queue is
  garbage-collected.

An encoded CUDA buffer can be *captured* instead of committed (`CommandBuffer.capture`): its
work is recorded once into a CUDA graph (`mpsnn.core.capture`); each
`CapturedCommandBuffer.replay` reads the current contents of the input images (refill them in
place) and writes the same output storage.

This module sits below `mpsnn.core.device` (whose queues make command buffers): it knows a
queue only through `_Queue`, what a buffer reads of it.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from mpsnn.core.capture import CapturedCommandBuffer, allocated_before_capture, record_graph
from mpsnn.errors import UnsupportedError

__all__ = ["CommandBuffer", "CommandBufferStatus", "running_buffer"]


class CommandBufferStatus(enum.IntEnum):
    """Life cycle of a command buffer (a subset of ``MTLCommandBufferStatus``)."""

    NOT_ENQUEUED = 0
    COMMITTED = 2
    COMPLETED = 4
    ERROR = 5


_NOT_ENQUEUED = CommandBufferStatus.NOT_ENQUEUED
_COMMITTED = CommandBufferStatus.COMMITTED
_COMPLETED = CommandBufferStatus.COMPLETED
_ERROR = CommandBufferStatus.ERROR


class _Queue(Protocol):
    """What a command buffer needs of its queue (`mpsnn.core.device.CommandQueue`)."""

    _device: Any  # the queue's `mpsnn.core.device.Device`
    _stream: torch.cuda.Stream | None
    _spare_events: list[torch.cuda.Event]

    def _enter_stream(self) -> torch.cuda.StreamContext | None: ...

    def _take_event(self) -> torch.cuda.Event: ...

    def _side_stream(self) -> torch.cuda.Stream | None: ...

    def _completion_worker(self) -> Any: ...


# The buffer whose commands run in this thread (`running_buffer`), None outside a run.
_running = threading.local()


def running_buffer() -> CommandBuffer | None:
    """The command buffer whose commands run now in this thread (its commit, or a capture's
    recording), or None: for a command that keeps a value for its buffer's check."""
    return getattr(_running, "buffer", None)


class _Command:
    """One recorded command. ``beside``: it may run while work an earlier command handed to
    the side stream (`CommandBuffer._beside`) still runs, because it neither reads what that
    work writes nor writes what it reads; any other command first waits for that work."""

    __slots__ = ("beside", "check", "fn", "name", "releases")

    def __init__(self, name: str, fn: Callable[[], Any], beside: bool = False) -> None:
        self.name = name
        self.fn = fn
        self.releases: list[Any] | None = None
        self.check: Callable[[CommandBuffer], BaseException | None] | None = None
        self.beside = beside


class CommandBuffer:
    """A list of encoded commands, committed once (MPS/Metal ``MTLCommandBuffer``).

    Attributes:
        error: the exception the work raised, if any (status ERROR).
        failed_command: the name of the command that raised it.
        label: a name for debugging.
    """

    __slots__ = (
        "_captured",
        "_checks",
        "_commands",
        "_done",
        "_event",
        "_handlers",
        "_hooks",
        "_pending_releases",
        "_prior",
        "_queue",
        "_run_values",
        "_side",
        "_status",
        "error",
        "failed_command",
        "label",
    )

    def __init__(self, command_queue: _Queue, label: str | None = None) -> None:
        self._queue = command_queue
        self.label = label
        self._status = _NOT_ENQUEUED
        self.error: BaseException | None = None
        self.failed_command: str | None = None
        self._commands: list[_Command] = []
        self._handlers: list[Callable[[CommandBuffer], Any]] = []
        self._hooks: list[Callable[[], Any]] = []  # internal bookkeeping once work is enqueued
        self._pending_releases: list[Any] = []  # released before the first command runs
        self._done: threading.Event | None = None  # only when a worker runs the handlers
        self._event: torch.cuda.Event | None = None
        self._prior: torch.cuda.Event | None = None  # a replay before the last, not waited for
        self._captured = False
        self._checks: list[_Command] | None = None  # commands that ran and have a check
        self._run_values: dict[Any, Any] | None = None  # what a run kept for its check
        self._side: tuple[Any, ...] | None = None  # side-stream work not joined yet: its tensors

    @property
    def command_queue(self) -> Any:
        """The `mpsnn.core.device.CommandQueue` that made this buffer."""
        return self._queue

    @property
    def device(self) -> Any:
        """The queue's `mpsnn.core.device.Device`."""
        return self._queue._device

    @property
    def status(self) -> CommandBufferStatus:
        """NOT_ENQUEUED, COMMITTED, COMPLETED or ERROR (polls the device on CUDA)."""
        if self._status is _COMMITTED and self._done is None:
            event = self._event
            if event is not None:
                try:
                    done = event.query()
                except Exception as exc:  # a device fault shows up here
                    self._record_error(exc, "(device)")
                    done = True
                if done:
                    self._recycle_event()
                    self._complete()
        return self._status

    def __len__(self) -> int:
        """Number of encoded commands."""
        return len(self._commands)

    def add_completed_handler(self, handler: Callable[[CommandBuffer], Any]) -> None:
        """Run ``handler(command_buffer)`` once the work completed (before waiters wake up).

        On CUDA the handlers of a buffer run on its queue's completion thread.
        """
        if not callable(handler):
            raise TypeError(
                f"[CommandBuffer] handler must be callable, got {type(handler).__name__}"
            )
        if self._status is not _NOT_ENQUEUED and not self._captured:
            raise ValueError(
                "[CommandBuffer] completed handlers must be added before commit(), "
                f"got status {self._status.name}"
            )
        self._handlers.append(handler)

    def check_encodable(self, who: str) -> None:
        """Raise unless work can still be encoded (the buffer was not committed)."""
        if self._status is not _NOT_ENQUEUED:
            raise ValueError(
                f"[{who}] the command buffer must not be committed yet, "
                f"got status {self._status.name}"
            )

    # -- recording (kernels call these after validation succeeded) --------------------------

    def record(self, name: str, fn: Callable[[], Any]) -> None:
        """Append one command; ``fn`` runs at commit on the queue's device and stream.

        This is also the way to add work of your own (MPS: your own Metal kernel), e.g. a
        weight update written with torch operations.
        """
        self._commands.append(_Command(name, fn))

    def _record_beside(self, name: str, fn: Callable[[], Any]) -> None:
        """`record` for a command that may run beside side-stream work (see `_Command`)."""
        self._commands.append(_Command(name, fn, beside=True))

    def _beside(self, work: Callable[[], Any], keep: tuple[Any, ...]) -> None:
        """Run ``work`` (called by a running command) on the queue's side stream, after the
        work launched so far, so that it overlaps the commands after this one that are marked
        ``beside`` (a data-parallel collective's wait, say); the next command that is not
        waits for it on the queue's stream first (`_join_side`), as does the end of the run.
        ``keep``: the tensors it reads, held until then (their memory must not be handed to
        the queue's stream while the side stream may still read it). Tensors ``work``
        allocates belong to the side stream's pool. On the CPU ``work`` runs at once."""
        q = self._queue
        side = q._side_stream()
        if side is None:
            work()
            return
        if self._side is not None:
            self._join_side()
        main = torch.cuda.current_stream(side.device)
        if side == main:  # (a stream from the same pool): nothing to overlap
            work()
            return
        side.wait_stream(main)
        # recorded before the work runs: the join comes even when the work raises halfway
        # (a capture must end joined, and what already runs there keeps its tensors)
        self._side = (main, side, keep)
        with torch.cuda.stream(side):
            work()

    def _join_side(self) -> None:
        """The queue's stream waits for the side-stream work; its tensors are let go."""
        main, side, _ = self._side  # type: ignore[misc]
        self._side = None
        main.wait_stream(side)

    def release_after_last(self, resource: Any) -> None:
        """Free ``resource`` (its ``_free_storage()``) once the last recorded command has run
        (at once when the buffer's work already ran: a read count dropped after the commit)."""
        if not self._commands and self._status is not _NOT_ENQUEUED and not self._captured:
            resource._free_storage()  # launched work is stream-ordered before later reuse
            return
        if self._commands:
            last = self._commands[-1]
            if last.releases is None:
                last.releases = []
            last.releases.append(resource)
        else:
            self._pending_releases.append(resource)

    def _check_after_last(self, check: Callable[[CommandBuffer], BaseException | None]) -> None:
        """Once the work completed (before the completed handlers), ``check(buffer)`` reads what
        the last recorded command wrote on the device (an error flag) and returns the exception
        to record as the buffer's error, or None; after every run of the command (replays too).

        A command that runs in several buffers (a step program's) keeps what one run wrote for
        its check with ``running_buffer()._keep_run_value(key, value)`` and the check reads it
        back with ``buffer._run_value(key)``: each buffer then checks its own run, whatever the
        order in which the buffers complete. Replays run two deep (`_replay`): the check of a
        captured buffer runs once the replay before the last completed, while the last may
        still run, and not after every replay; what it reads must be folded by every replay (a
        running maximum, say) rather than overwritten, and reset once it reported an error."""
        self._commands[-1].check = check

    def _mark(self) -> tuple[Any, ...]:
        """Where the recorded work stands now (for `_rollback`)."""
        last = self._commands[-1] if self._commands else None
        releases = len(last.releases) if last is not None and last.releases else 0
        return (len(self._commands), len(self._hooks), len(self._pending_releases),
                len(self._handlers), last, releases)  # fmt: skip

    def _rollback(self, mark: tuple[Any, ...]) -> None:
        """Forget everything recorded since ``mark``: a multi-kernel encode (a graph) that
        fails halfway leaves the buffer as it was."""
        commands, hooks, pending, handlers, last, releases = mark
        del self._commands[commands:]
        del self._hooks[hooks:]
        del self._pending_releases[pending:]
        del self._handlers[handlers:]
        if last is not None and last.releases:
            del last.releases[releases:]

    def _on_enqueued(self, hook: Callable[[], Any]) -> None:
        """Internal bookkeeping to run once every command is enqueued (stream order makes
        releasing storage safe then, before the device has run the work)."""
        self._hooks.append(hook)

    # -- execution -----------------------------------------------------------------------

    def commit(self) -> None:
        """Run (CPU) or launch (CUDA) the encoded work. A command buffer is committed once."""
        if self._status is not _NOT_ENQUEUED:
            raise ValueError(
                "[CommandBuffer] a command buffer is committed once, "
                f"got commit() with status {self._status.name}"
            )
        if self._queue._stream is None:
            self._status = _COMMITTED
            self._run()
            self._complete()
            return
        self._launch(self._run)

    def _launch(self, work: Callable[[], None]) -> None:
        """Run ``work`` (a commit's or a replay's) on the queue's stream, record the completion
        event after it, and hand the buffer to the queue's completion worker when it has
        completed handlers."""
        self._status = _COMMITTED
        q = self._queue
        ctx = q._enter_stream()
        if ctx is None:
            work()
        else:
            with ctx:
                work()
        self._event = q._take_event()
        self._event.record(q._stream)
        if self._handlers:
            self._done = threading.Event()
            q._completion_worker().submit(self)
        else:
            self._done = None

    def capture(self) -> CapturedCommandBuffer:
        """Record the work once into a CUDA graph instead of running it (CUDA only).

        Returns a `CapturedCommandBuffer`; each ``replay()`` runs the work again, reading the
        current contents of the input images (write new data into them in place) and writing
        the same output storage. Run the same work eagerly once before capturing, so that
        libraries (cuDNN, cuBLAS, Triton) are initialized and one-time constants exist.

        Raises:
            UnsupportedError: on the CPU.
            ValueError: the buffer was already committed.
        """
        if self._status is not _NOT_ENQUEUED:
            raise ValueError(
                f"[CommandBuffer] capture() needs an uncommitted buffer, got status "
                f"{self._status.name}"
            )
        q = self._queue
        if q._stream is None:
            raise UnsupportedError(
                "[CommandBuffer] capture() records CUDA graphs and needs a CUDA queue, got a "
                "CPU queue; on the CPU commit the work instead"
            )
        keep = allocated_before_capture(self)
        self._status = _COMMITTED
        self._captured = True
        graph = record_graph(self, q._stream, q._device.torch_device, keep)
        if self.error is not None:
            self._complete()
            raise self.error
        self._status = _COMPLETED  # replays re-commit it
        return CapturedCommandBuffer(self, graph, keep)

    def _replay(self, graph: torch.cuda.CUDAGraph) -> None:
        """Launch the captured ``graph`` of this buffer's work once more
        (`CapturedCommandBuffer.replay`).

        Replays run two deep, as Metal command buffers committed back to back do: the host
        launches replay ``n + 1`` while replay ``n`` runs (stream order keeps them apart on
        the device), after waiting for replay ``n - 1`` and raising the error its checks found
        (`_wait_for_prior`). A buffer with completed handlers waits for the last replay
        instead: its handlers run once per replay, in order."""
        if self._handlers:
            self._wait_if_committed()
        else:
            self._wait_for_prior()
        self.error = None
        self.failed_command = None
        running = self._event if self._status is _COMMITTED else None
        self._launch(graph.replay)
        self._prior = running

    def _wait_for_prior(self) -> None:
        """Wait for the replay launched before the last one, if it was not waited for, then
        run the checks (what they read covers at least that replay: see `_check_after_last`)
        and raise the error they or the device report. The last replay may still run."""
        prior = self._prior
        if prior is None:
            return
        self._prior = None
        try:
            prior.synchronize()
        except Exception as exc:  # a device fault (illegal address, ...)
            self._record_error(exc, "(device)")
        else:
            self._queue._spare_events.append(prior)
        if self._checks is not None and self.error is None:
            self._run_checks()
        if self.error is not None:  # the last replay runs out first: the status says ERROR
            last = self._event
            if last is not None:
                with contextlib.suppress(Exception):  # reported already: the first error wins
                    last.synchronize()
            self._recycle_event()
            self._status = _ERROR
            raise self.error

    def _wait_if_committed(self) -> None:
        """Wait for the work launched last (a replay's), if it has not been waited for."""
        if self._status is _COMMITTED:
            self.wait_until_completed()

    def _run(self) -> None:
        outer = getattr(_running, "buffer", None)
        _running.buffer = self
        try:
            self._run_commands()
        finally:
            _running.buffer = outer

    def _run_commands(self) -> None:
        # The `if`s skip the empty lists most buffers have (this runs at every commit).
        if self._pending_releases:
            for res in self._pending_releases:
                res._free_storage()
        for cmd in self._commands:
            if self._side is not None and not cmd.beside:
                self._join_side()
            if self.error is None:
                try:
                    cmd.fn()
                except Exception as exc:  # kept for wait_until_completed(), like Metal errors
                    self._record_error(exc, cmd.name)
                else:
                    if cmd.check is not None:
                        self._checks = [*(self._checks or ()), cmd]
            if cmd.releases:
                for res in cmd.releases:
                    res._free_storage()
        if self._side is not None:  # the completion event and a capture's end come after it
            self._join_side()
        if self._hooks:
            for hook in self._hooks:
                hook()
            self._hooks = []
        if not self._captured:
            self._commands = []  # drop the closures, and with them the tensors they kept alive

    def _record_error(self, exc: BaseException, name: str) -> None:
        exc.add_note(f"while running command {name!r} of {self!r}")
        self.error = exc
        self.failed_command = name

    def _recycle_event(self) -> None:
        """The caller's thread saw the completion event fire: hand it back to the queue for a
        later commit (a completed buffer never reads its event again), with the event of an
        earlier replay (complete too: stream order). Buffers whose handlers a completion
        thread runs keep theirs."""
        event, self._event = self._event, None
        if event is not None:  # another thread that saw it fire may have handed it back
            self._queue._spare_events.append(event)
        prior, self._prior = self._prior, None
        if prior is not None:
            self._queue._spare_events.append(prior)

    def _complete(self) -> None:
        """The device work is done: run the checks, set the status, run the handlers."""
        if self._checks is not None:
            self._run_checks()
        self._status = _ERROR if self.error is not None else _COMPLETED
        for handler in self._handlers:
            try:
                handler(self)
            except Exception as exc:
                exc.add_note(f"raised by a completed handler of {self!r}")
                if self.error is None:
                    self.error = exc
                    self.failed_command = "(completed handler)"
                self._status = _ERROR

    def _keep_run_value(self, key: Any, value: Any) -> None:
        """Keep ``value`` for this buffer's checks (see `_check_after_last`)."""
        if self._run_values is None:
            self._run_values = {}
        self._run_values[key] = value

    def _run_value(self, key: Any) -> Any:
        """What a command's run kept for this buffer's checks under ``key``, or None."""
        values = self._run_values
        return None if values is None else values.get(key)

    def _run_checks(self) -> None:
        """`_check_after_last`'s checks of the commands that ran; the first error wins."""
        checks = self._checks or []
        if not self._captured:  # a replay runs the same commands again: keep theirs
            self._checks = None
        for cmd in checks:
            try:
                exc = cmd.check(self) if self.error is None else None  # type: ignore[misc]
            except Exception as raised:
                exc = raised
            if exc is not None:
                self._record_error(exc, cmd.name)

    def wait_until_completed(self) -> None:
        """Block until the work and the completed handlers are done; re-raise their error."""
        status = self._status
        if status is _NOT_ENQUEUED:
            raise ValueError(
                "[CommandBuffer] wait_until_completed() needs a committed command buffer, "
                "got status NOT_ENQUEUED"
            )
        if status is _COMMITTED:
            if self._done is not None:
                self._done.wait()
            else:
                event = self._event
                if event is not None:
                    try:
                        event.synchronize()
                        self._recycle_event()
                    except Exception as exc:  # a device fault (illegal address, ...)
                        if self.error is None:
                            self._record_error(exc, "(device)")
                self._complete()
        if self.error is not None:
            raise self.error

    def __repr__(self) -> str:
        label = f" {self.label!r}" if self.label else ""
        return f"<CommandBuffer{label} {self._status.name}, {len(self._commands)} commands>"
