"""CUDA-graph capture of command buffers.

An encoded CUDA buffer can be *captured* instead of committed
(`mpsnn.core.command_buffer.CommandBuffer.capture`): its work is recorded once into a CUDA
graph; each `CapturedCommandBuffer.replay` reads the current contents of the input images
(refill them in place) and writes the same output storage.

This module sits below `mpsnn.core.command_buffer` (whose `CommandBuffer.capture` returns a
`CapturedCommandBuffer`): it knows a command buffer only through `_Capturable`, what the capture
reads and calls.

What a replay reads must outlive every replay. Storage made before the capture is kept by the
captured buffer (`allocated_before_capture`). Objects made *during* the recording that nothing
else holds (an optimizer's device tables, whose addresses the graph recorded) are handed to the
capture being recorded with `keep_for_replays`: the capture keeps them for as long as it lives,
and they are freed with it. Nothing is registered process-wide.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

__all__ = ["CapturedCommandBuffer", "keep_for_replays", "keeping_for_replays", "recording"]


class _Capturable(Protocol):
    """What a capture needs of a command buffer (`mpsnn.core.command_buffer.CommandBuffer`)."""

    error: BaseException | None
    _pending_releases: list[Any]
    _commands: list[Any]
    _hooks: list[Callable[[], Any]]

    @property
    def status(self) -> Any: ...

    def _run(self) -> None: ...

    def _record_error(self, exc: BaseException, name: str) -> None: ...

    def _replay(self, graph: torch.cuda.CUDAGraph) -> None: ...

    def _wait_if_committed(self) -> None: ...

    def _wait_for_prior(self) -> None: ...


def recording(t: torch.Tensor) -> bool:
    """Whether work on ``t``'s device is being recorded into a CUDA graph on the current stream
    (False for CPU tensors: CPU builds of PyTorch have no capture status)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def allocated_before_capture(buffer: _Capturable) -> list[torch.Tensor]:
    """The storage of the temporaries ``buffer`` releases that exists already (made at encode
    time, e.g. an exported weights state). Released during the capture, it would go back to
    PyTorch's allocator and to later allocations while every replay still uses it: the
    captured buffer keeps it. (Storage allocated during the capture comes from the graph's
    private pool, where later commands of the same graph may reuse it.)"""
    resources = list(buffer._pending_releases)
    for cmd in buffer._commands:
        resources.extend(cmd.releases or ())
    resources.extend(r for h in buffer._hooks if (r := getattr(h, "resource", None)) is not None)
    keep: list[torch.Tensor] = []
    seen: set[int] = set()
    for res in resources:
        if id(res) in seen:
            continue
        seen.add(id(res))
        storage = getattr(res, "_storage", None)  # images: None until a command writes
        if isinstance(storage, torch.Tensor):
            keep.append(storage)
        resources_of = getattr(res, "resources", None)
        if storage is None and callable(resources_of):  # states
            keep.extend(t for t in resources_of() if isinstance(t, torch.Tensor))
    return keep


# The recordings in progress in each thread, innermost last: each a list of the objects its
# capture keeps (`keeping_for_replays`). Empty outside a recording.
_recordings = threading.local()


@contextmanager
def keeping_for_replays(kept: list[Any] | None = None) -> Iterator[list[Any]]:
    """The scope of one recording in this thread: what `keep_for_replays` is given inside it is
    appended to ``kept`` (a new list when None), which it yields. Whoever holds the graph
    holds that list: `CommandBuffer.capture` does it for its `CapturedCommandBuffer`; around
    a ``torch.cuda.graph`` capture of your own, keep the list for as long as the graph."""
    kept = [] if kept is None else kept
    stack: list[list[Any]] = _recordings.__dict__.setdefault("stack", [])
    stack.append(kept)
    try:
        yield kept
    finally:
        stack.pop()


def keep_for_replays(obj: Any) -> bool:
    """Keep ``obj`` alive for as long as the capture being recorded in this thread (the
    innermost `keeping_for_replays` scope): for what the recorded work reads at every replay
    and nothing else holds. False when no recording is in progress in this thread (nothing
    is kept)."""
    stack = _recordings.__dict__.get("stack")
    if not stack:
        return False
    stack[-1].append(obj)
    return True


def record_graph(
    buffer: _Capturable, stream: torch.cuda.Stream, device: torch.device, keep: list[Any]
) -> torch.cuda.CUDAGraph:
    """Run ``buffer``'s work once into a new CUDA graph, on a side stream that first waits for
    ``stream`` (inputs written there are ready) and that ``stream`` then waits for. What the
    work hands to `keep_for_replays` is appended to ``keep`` (the captured buffer's). An
    error is recorded as the buffer's error, not raised."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device)
    side.wait_stream(stream)
    try:
        with (
            keeping_for_replays(keep),
            torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"),
        ):
            buffer._run()
    except Exception as exc:
        if buffer.error is None:
            buffer._record_error(exc, "(capture)")
    stream.wait_stream(side)
    return graph


class CapturedCommandBuffer:
    """The work of a command buffer recorded as a CUDA graph (see `CommandBuffer.capture`).

    ``replay()`` launches the whole recorded work on the queue's stream with one call. Input
    images are read where they are: refill them in place (``image.tensor.copy_(...)``) before a
    replay. Output images keep their storage: read them after the replay completed (reading
    them waits). Host work is not replayed: values computed on the host at capture are frozen.
    mpsnn keeps what changes between training steps on the device (dropout keys, accumulator
    contents, weights, optimizer steps): replaying a training step equals encoding it again."""

    __slots__ = ("_buffer", "_graph", "_keep_alive", "replays")

    def __init__(
        self,
        buffer: _Capturable,
        graph: torch.cuda.CUDAGraph,
        keep_alive: list[Any] | None = None,
    ) -> None:
        self._buffer = buffer
        self._graph = graph
        # what the replays read and nothing else holds: storage made before the recording
        # (`allocated_before_capture`) and objects made during it (`keep_for_replays`),
        # freed with this object
        self._keep_alive: list[Any] = keep_alive if keep_alive is not None else []
        self.replays = 0

    @property
    def command_buffer(self) -> Any:
        """The captured buffer (a `CommandBuffer`): the writer of the output images."""
        return self._buffer

    def replay(self) -> None:
        """Run the recorded work once more (asynchronously on CUDA).

        Replays run two deep: this call returns once replay ``n + 1`` is launched, replay
        ``n`` may still run, and replay ``n - 1`` has completed (an error it or the device
        reported is raised here, before the launch). So the host prepares the next step while
        the device runs this one, and an error surfaces at the latest two calls after the
        replay that made it, or at `wait_until_completed`."""
        self._buffer._replay(self._graph)
        self.replays += 1

    def wait_for_earlier(self) -> None:
        """Wait for the replays before the last one (the last may still run) and raise the
        error found: what `replay` does before its launch."""
        self._buffer._wait_for_prior()

    def wait_until_completed(self) -> None:
        """Wait for the last replay; re-raise its error."""
        self._buffer._wait_if_committed()

    @property
    def status(self) -> Any:
        """The captured buffer's `CommandBufferStatus`."""
        return self._buffer.status
