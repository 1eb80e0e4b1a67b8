"""CUDA-graph capture of command buffers.

An encoded CUDA buffer can be *captured* instead of committed
(`mpsnn.core.device.CommandBuffer.capture`): its work is recorded once into a CUDA graph; each
`CapturedCommandBuffer.replay` reads the current contents of the input images (refill them in
place) and writes the same output storage.

This module sits below `mpsnn.core.device` (which re-exports `CapturedCommandBuffer`): it knows
a command buffer only through `_Capturable`, what the capture reads and calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from mpsnn.core import replays as _replays

__all__ = ["CapturedCommandBuffer"]


class _Capturable(Protocol):
    """What a capture needs of a command buffer (`mpsnn.core.device.CommandBuffer`)."""

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


def record_graph(
    buffer: _Capturable, stream: torch.cuda.Stream, device: torch.device
) -> torch.cuda.CUDAGraph:
    """Run ``buffer``'s work once into a new CUDA graph, on a side stream that first waits for
    ``stream`` (inputs written there are ready) and that ``stream`` then waits for. An error
    is recorded as the buffer's error, not raised."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device)
    side.wait_stream(stream)
    try:
        with (
            _replays.recording(),
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
        keep_alive: list[torch.Tensor] | None = None,
    ) -> None:
        self._buffer = buffer
        self._graph = graph
        # storage the recording uses, made before it (`allocated_before_capture`)
        self._keep_alive: list[torch.Tensor] = keep_alive or []
        self.replays = 0

    @property
    def command_buffer(self) -> Any:
        """The captured buffer (a `CommandBuffer`): the writer of the output images."""
        return self._buffer

    def replay(self) -> None:
        """Run the recorded work once more (asynchronously on CUDA)."""
        self._buffer._replay(self._graph)
        self.replays += 1

    def wait_until_completed(self) -> None:
        """Wait for the last replay; re-raise its error."""
        self._buffer._wait_if_committed()

    @property
    def status(self) -> Any:
        """The captured buffer's `CommandBufferStatus`."""
        return self._buffer.status
