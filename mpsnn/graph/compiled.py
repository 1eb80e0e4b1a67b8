"""`CompiledGraph`: one training (or inference) step of a `Graph`, recorded once as a CUDA
graph and replayed for every later batch (made by `Graph.compile`).

Why: a small network's step is a few hundred small kernels; encoding them costs host time
(Python, validation, launches) that can exceed the GPU time. A replay launches the whole
recorded step with one call.

How a call runs:

1. First call: an ordinary eager step (``encode_batch`` + commit) that also initializes the
   libraries (cuDNN, cuBLAS, Triton) and the one-time constants a capture must not create.
2. Second call: the graph's inputs are copied into **static** images and labels owned by the
   compiled graph, the step is encoded on a command buffer that is *captured*
   (`CommandBuffer.capture`) instead of committed, and the recording is replayed once.
3. Later calls: the new batch is copied into the static inputs in place (on the queue's
   stream) and the recording is replayed. A call does not wait for the step before it: the
   host prepares step ``n + 1`` while the device runs step ``n`` (replays run two deep, see
   `CapturedCommandBuffer.replay`), and an error of a replay is raised by a later call or by
   `wait_until_completed`.

Every call is exactly one training step, so eager and compiled training give the same weights:
everything that changes between steps is kept on the device — dropout keys, the optimizers'
step counts (Adam's ``time_step``, counted at encode, also counts each replay) and learning
rates, the master weights and their low-precision copies, the gradient accumulators — and
advances at each replay. The result image and the loss images are the same storage at every
replay: read (or copy) them before the next call.

A graph with ``data_parallel`` hooks (`mpsnn.DataParallel`) is recorded with its collectives
when the hooks say ``capturable`` (NCCL): each rank records and replays its own step, and after
every replay the hooks' ``replayed(new_step)`` does the step's host work (step count, progress
mark, the periodic weight check), on the queue's stream.

On the CPU there is nothing to record: every call is an eager step. So is every call of a
graph whose ``data_parallel`` hooks say ``capturable = False`` (Gloo), and of a graph with a
layer whose data source says ``capturable = False``. A data source's own ``update`` (the GPU
update path of a data source other than mpsnn's grouped ``Tensor…DataSource`` s) runs once,
when the step is recorded: the device work it encodes is replayed at every step, its host work
(a Python counter, a value read back) is not. A data source whose update needs host work at
every step sets ``capturable = False``.
`CompiledGraph.eager_reason` says why a compiled graph runs eagerly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from mpsnn.core.capture import CapturedCommandBuffer
from mpsnn.core.device import CommandQueue
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.state import State
from mpsnn.ops.optim_hyper import set_step
from mpsnn.optim.base import journal

__all__ = ["CompiledGraph"]


class CompiledGraph:
    """A graph step recorded once and replayed (see the module docstring).

    Args:
        graph: the `Graph`.
        command_queue: the queue the steps run on (None: a new queue of the graph's device).

    Call it like ``Graph.encode_batch`` without a command buffer: ``compiled(source_images,
    source_states=None)`` runs one step and returns the result batch (None when the graph's
    result is not needed). The batch shape, formats and label layout are fixed by the second
    call (the capture); a later batch that differs raises ``ValueError`` — compile one graph
    per batch shape (a last, smaller batch can go through the eager ``encode_batch``).
    """

    def __init__(self, graph: Any, command_queue: CommandQueue | None = None) -> None:
        if not hasattr(graph, "_plan") or not hasattr(graph, "encode_batch"):  # a Graph
            raise TypeError(f"[CompiledGraph] graph must be a Graph, got {type(graph).__name__}")
        queue = command_queue or graph.device.new_command_queue()
        if not isinstance(queue, CommandQueue):
            raise TypeError(
                f"[CompiledGraph] command_queue must be a CommandQueue, got {type(queue).__name__}"
            )
        if queue.device != graph.device:
            raise ValueError(
                f"[CompiledGraph] the command queue must be on {graph.device}, got one on "
                f"{queue.device}"
            )
        self._graph = graph
        self._queue = queue
        self._captured: CapturedCommandBuffer | None = None
        self._images: list[ImageBatch] = []  # the static inputs (after the capture)
        self._states: list[list[State]] = []
        self._result: ImageBatch | None = None
        self._last_states: list[list[State]] = []
        self._last_eager: Any = None
        self._encodes: list[Any] = []  # (optimizer, encode) the recorded step counted
        self.steps = 0

    @property
    def graph(self) -> Any:
        return self._graph

    @property
    def is_captured(self) -> bool:
        """Whether the step is recorded (after the second call on CUDA)."""
        return self._captured is not None

    @property
    def eager_reason(self) -> str | None:
        """Why this graph's steps are not recorded (None: they are, on CUDA after warm-up)."""
        hooks = getattr(self._graph, "data_parallel", None)
        if hooks is not None and not getattr(hooks, "capturable", True):
            backend = getattr(hooks, "backend", "this process group's backend")
            return f"data parallel: collectives of {backend} cannot be recorded (NCCL can)"
        refused = _uncapturable_sources(self._graph)
        if refused:
            return (
                "data sources that need host work at every update (capturable = False): "
                + ", ".join(refused)
            )
        return None

    @property
    def replays(self) -> int:
        """How many steps ran as replays."""
        return 0 if self._captured is None else self._captured.replays

    @property
    def source_states(self) -> list[list[State]]:
        """The source states of the last step (after a replay: the compiled graph's static
        labels, whose ``loss_image`` holds the last step's loss)."""
        return self._last_states

    def __call__(
        self, source_images: Sequence[ImageBatch], source_states: Sequence[Any] | None = None
    ) -> ImageBatch | None:
        """Run one step on ``source_images`` / ``source_states`` (see the class docstring)."""
        graph = self._graph
        if self._captured is not None:
            self._refill(source_images, source_states)
            self._captured.replay()
            for opt, encode in self._encodes:  # a replay is one more encode of the step
                opt._recount(encode)
            self.steps += 1
            self._replayed(new_step=True)
            return self._result
        capturable = self.eager_reason is None
        if self.steps == 0 or self._queue._stream is None or not capturable:
            # warm-up, the CPU, or collectives a CUDA graph must not capture: eager
            cb = self._queue.command_buffer()
            out = graph.encode_batch(cb, source_images, source_states)
            cb.commit()
            self._last_eager = cb
            if cb.error is not None:  # a command that raised (a failed collective, ...)
                raise cb.error
            self._last_states = [_as_list(s) for s in (source_states or [])]
            self.steps += 1
            return out
        # the capture: static copies of the inputs, the step recorded, then replayed once
        batches = _batches(source_images)
        states = [_static_states(s, i) for i, s in enumerate(source_states or [])]
        ctx = self._queue._enter_stream()  # the copies are ordered before the recorded step
        with ctx if ctx is not None else contextlib.nullcontext():
            self._images = [_static_batch(b, i) for i, b in enumerate(batches)]
            for new, static in zip(source_states or [], states, strict=True):
                for a, b in zip(_as_list(new), static, strict=True):
                    b._refill(a)
        self._states = states
        cb = self._queue.command_buffer()
        cb.label = "compiled step"
        with journal() as encodes:
            self._result = graph.encode_batch(cb, self._images, self._states)
        self._encodes = encodes
        _start_device_counts(self._queue, encodes)
        self._captured = cb.capture()
        self._last_states = self._states
        self._captured.replay()
        self.steps += 1
        self._replayed(new_step=False)  # the recorded step: counted when it was encoded
        return self._result

    def _replayed(self, new_step: bool) -> None:
        """The data-parallel hooks' host work after a replay, ordered after it on the
        queue's stream."""
        hooks = getattr(self._graph, "data_parallel", None)
        replayed = getattr(hooks, "replayed", None)
        if replayed is None:
            return
        ctx = self._queue._enter_stream()
        with ctx if ctx is not None else contextlib.nullcontext():
            replayed(new_step)

    def wait_until_completed(self) -> None:
        """Wait for the last step."""
        if self._captured is not None:
            self._captured.wait_until_completed()
        elif self._last_eager is not None:
            self._last_eager.wait_until_completed()

    def _refill(
        self, source_images: Sequence[ImageBatch], source_states: Sequence[Any] | None
    ) -> None:
        """Copy a new batch into the static inputs (checked first: nothing is copied when
        any of it does not match the recorded step)."""
        who = "CompiledGraph"
        batches = _batches(source_images)
        states = [_as_list(s) for s in (source_states or [])]
        if len(batches) != len(self._images) or len(states) != len(self._states):
            raise ValueError(
                f"[{who}] a step needs {len(self._images)} image batches and "
                f"{len(self._states)} state batches, got {len(batches)} and {len(states)}"
            )
        for i, (new, old) in enumerate(zip(batches, self._images, strict=True)):
            if new.shape != old.shape or new.feature_channel_format != old.feature_channel_format:
                raise ValueError(
                    f"[{who}] source_images[{i}] must match the recorded step "
                    f"({old.shape} {old.feature_channel_format.name}), got {new.shape} "
                    f"{new.feature_channel_format.name}; compile a graph per batch shape"
                )
            if new.device != old.device:
                raise ValueError(
                    f"[{who}] source_images[{i}] must be on {old.device}, got {new.device}"
                )
        for i, (new, old) in enumerate(zip(states, self._states, strict=True)):
            if len(new) != len(old):
                raise ValueError(
                    f"[{who}] source_states[{i}] must hold {len(old)} states (the recorded "
                    f"step's), got {len(new)}"
                )
            for a, b in zip(new, old, strict=True):
                b._check_refill(who, a)
        ctx = self._queue._enter_stream()
        with ctx if ctx is not None else contextlib.nullcontext():
            sources = self._copy(batches, states)
        if ctx is not None:
            # The caller's tensors were made on its own stream and the copies wait on the
            # queue's stream behind the running replay: their memory must not be reused for
            # the caller's next allocations before the copies read it.
            stream = self._queue.stream
            for t in sources:
                if t.is_cuda:
                    t.record_stream(stream)  # type: ignore[arg-type]

    def _copy(self, batches: list[ImageBatch], states: list[list[State]]) -> list[torch.Tensor]:
        """Queue the copies of the new batch into the static inputs; returns their sources."""
        if self._captured is not None:
            # Errors of earlier replays first. The last replay may still run: the copies are
            # queued after it on the queue's stream, so it reads its own batch.
            self._captured.wait_for_earlier()
        sources = []
        for new, old in zip(batches, self._images, strict=True):
            if new.image is not old.image:
                old.tensor.copy_(new.tensor, non_blocking=True)
                sources.append(new.tensor)
        for new, old in zip(states, self._states, strict=True):
            for a, b in zip(new, old, strict=True):
                if a is not b:
                    b._refill(a)
                    sources += a.resources()
        return sources

    def __repr__(self) -> str:
        mode = f"captured, {self.replays} replays" if self._captured else "not captured"
        return f"<CompiledGraph of {self._graph!r}: {self.steps} steps, {mode}>"


def _uncapturable_sources(graph: Any) -> list[str]:
    """The trainable layers whose data sources say ``capturable = False``."""
    names = []
    for node in graph._plan.order:
        forward = getattr(node, "inference_node", None)
        if forward is None or not getattr(node, "trainable", False):
            continue
        ds = getattr(forward, "data_source", None)
        if ds is not None and getattr(ds, "capturable", True) is False:
            names.append(forward.label or type(forward).__name__)
    return names


def _batches(source_images: Sequence[Any]) -> list[ImageBatch]:
    out = []
    for i, b in enumerate(source_images):
        if not isinstance(b, ImageBatch):
            raise TypeError(
                f"[CompiledGraph] source_images[{i}] must be an ImageBatch, got {type(b).__name__}"
            )
        out.append(b)
    return out


def _static_batch(batch: ImageBatch, index: int) -> ImageBatch:
    """A permanent copy of ``batch``: the storage the recorded step reads."""
    image = Image(batch.device, batch.image.descriptor, label=f"compiled source {index}")
    image._data().copy_(batch.tensor, non_blocking=True)
    return ImageBatch(image)


def _as_list(value: Any) -> list[State]:
    if isinstance(value, State):
        return [value]
    return list(value)


def _static_states(value: Any, index: int) -> list[State]:
    """Permanent copies of the source states (labels) the recorded step reads."""
    states = _as_list(value)
    out = []
    for j, st in enumerate(states):
        copy = getattr(st, "_static_copy", None)
        if copy is None:
            raise TypeError(
                f"[CompiledGraph] source_states[{index}][{j}] must be LossLabels (states a "
                f"compiled step can refill), got {type(st).__name__}"
            )
        out.append(copy())  # same layout; the values are copied on the queue's stream
    return out


def _start_device_counts(queue: Any, encodes: list[tuple[Any, Any]]) -> None:
    """Before a capture: each Adam's device step count set to its first recorded encode's
    count, on the queue's stream. Captured work only adds one per update, so it must start
    from the count the encode took (an abandoned buffer or buffers committed out of order
    leave the device count behind ``time_step``)."""
    first: dict[int, tuple[Any, int]] = {}
    for opt, encode in encodes:
        step = getattr(opt, "_step", None)
        if step is None or encode is None:
            continue
        known = first.get(id(opt))
        if known is None or encode.t < known[1]:
            first[id(opt)] = (step, encode.t)
    if not first:
        return
    ctx = queue._enter_stream() if queue._stream is not None else None  # CUDA: its stream
    with ctx if ctx is not None else contextlib.nullcontext():
        for step, t in first.values():
            set_step(step, t - 1)
