"""States: what a forward kernel hands its gradient kernel (MPS ``MPSState``).

A permanent state has ``read_count`` 0 and lives as long as Python references it. A temporary
state (made with a command buffer) starts at ``read_count`` 1; each gradient encode that reads
it drops the count, and at 0 its tensors are freed after that encode's command has run. Any
later use raises `StaleResourceError`, naming the state and the kernel.

`GradientState` holds the forward encode's `ForwardRecord` (geometry plus the family's typed
parameters), so a gradient kernel never takes geometry of its own that could contradict the
forward, and never reads the forward kernel's attributes.

`AccumulatorState` is the base of every state that sums work (weight and bias gradients,
batch-normalization statistics and their gradients): whether a write stores or adds is decided
when the work *runs*, so any commit order, abandoned command buffers and several queues give
the sum of the work that ran.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.device import CommandQueue, Device
from mpsnn.core.geometry import EdgeMode, Offset, Region, Window
from mpsnn.errors import StaleResourceError

__all__ = [
    "AccumulatorState",
    "BinaryGradientState",
    "ForwardRecord",
    "GradientState",
    "State",
    "StateBatch",
]


class State:
    """Base class of states (MPS ``MPSState``).

    Args:
        device: where the state's tensors live.
        command_buffer: given, the state is temporary and belongs to that command buffer.
        label: a name used in messages.
    """

    def __init__(
        self,
        device: Device,
        *,
        command_buffer: CommandBuffer | None = None,
        label: str | None = None,
    ) -> None:
        if not isinstance(device, Device):
            raise TypeError(
                f"[{type(self).__name__}] device must be a Device, got {type(device).__name__}"
            )
        if command_buffer is not None:
            if not isinstance(command_buffer, CommandBuffer):
                raise TypeError(
                    f"[{type(self).__name__}] command_buffer must be a CommandBuffer, "
                    f"got {type(command_buffer).__name__}"
                )
            command_buffer.check_encodable(type(self).__name__)
        self._device = device
        self._command_buffer = command_buffer
        self._read_count = 1 if command_buffer is not None else 0
        self._released_by: str | None = None
        self.label = label
        if command_buffer is not None:
            command_buffer._on_enqueued(_release_state(self))

    @property
    def device(self) -> Device:
        return self._device

    @property
    def is_temporary(self) -> bool:
        return self._command_buffer is not None

    @property
    def command_buffer(self) -> CommandBuffer | None:
        """The command buffer a temporary state belongs to (None for permanent states)."""
        return self._command_buffer

    @property
    def read_count(self) -> int:
        """Reads left before a temporary state is freed (0 for permanent states)."""
        return self._read_count

    @read_count.setter
    def read_count(self, value: int) -> None:
        self._check_live("read_count")
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"[{type(self).__name__}] read_count must be an int, got {type(value).__name__}"
            )
        if not self.is_temporary:
            raise ValueError(
                f"[{type(self).__name__}] read_count can only be set on a temporary state, "
                "got a permanent one"
            )
        if value < 0:
            raise ValueError(f"[{type(self).__name__}] read_count must be >= 0, got {value}")
        self._read_count = value
        if value == 0:
            self._release("read_count = 0")

    def synchronize(self, command_buffer: CommandBuffer) -> None:
        """Make the contents visible to the CPU after ``command_buffer`` completes.

        A no-op: torch tensors read on the host after completion are already coherent.
        """

    def resources(self) -> list[torch.Tensor]:
        """The tensors this state holds (subclasses list theirs)."""
        return []

    def resource_size(self) -> int:
        """Bytes held by the state's tensors."""
        return sum(t.numel() * t.element_size() for t in self.resources())

    def destination_image_descriptor(
        self, source_images: Any, source_states: Any, kernel: Any, suggested_descriptor: Any
    ) -> Any:
        """Hook through which a state may resize a kernel's result (default: unchanged)."""
        return suggested_descriptor

    # -- lifetime -------------------------------------------------------------------------

    def _describe(self) -> str:
        label = f" {self.label!r}" if self.label else ""
        return f"{type(self).__name__}{label}"

    def _check_live(self, who: str | None) -> None:
        if self._released_by is not None:
            raise StaleResourceError(
                f"[{who or type(self).__name__}] {self._describe()} must be live, but its "
                f"read_count reached 0 ({self._released_by}); raise read_count before that read "
                "to keep it, or use a permanent state"
            )

    def _consume_read(self, command_buffer: CommandBuffer, who: str) -> None:
        if self._command_buffer is None:
            return
        self._read_count -= 1
        if self._read_count == 0:
            self._release(f"released after its last read by {who}")

    def _release(self, why: str) -> None:
        self._released_by = why
        cb = self._command_buffer
        if cb is not None:
            cb.release_after_last(self)

    def _free_storage(self) -> None:
        """Drop the tensors (called after the last reader ran); subclasses clear theirs."""

    def __repr__(self) -> str:
        kind = "temporary" if self.is_temporary else "permanent"
        return f"<{self._describe()} {kind} on {self._device.torch_device}>"


def _release_state(state: State) -> Callable[[], None]:
    def hook() -> None:
        if state._released_by is None:
            state._released_by = "its command buffer completed"
        state._free_storage()

    hook.resource = state  # type: ignore[attr-defined]  # what a capture keeps alive
    return hook


@dataclass(frozen=True, slots=True, eq=False)
class ForwardRecord:
    """What a forward encode did, as its gradient kernel needs it (written at encode time).

    Attributes:
        kernel: the forward kernel (MPS states expose it: ``convolution``, ...). Gradient
            kernels read ``params``, never the kernel's attributes.
        window: images, channels and the per-axis windows the forward used.
        edge_mode: the forward edge mode.
        offset, clip_rect: the forward properties as they were at encode time.
        source_shape: ``(N, C, H, W)`` of the forward source.
        destination_shape: ``(N, C, H, W)`` of the forward destination.
        params: the family's typed record (a frozen dataclass: weights used, neuron, plans).
        batch: made by ``encode_batch`` (the gradient may take the batch's images one by one).
    """

    kernel: Any
    window: Window
    edge_mode: EdgeMode
    offset: Offset
    clip_rect: Region
    source_shape: tuple[int, int, int, int]
    destination_shape: tuple[int, int, int, int]
    params: Any = None
    batch: bool = False

    @property
    def forward_class(self) -> type:
        return type(self.kernel)

    def same_geometry(self, other: ForwardRecord) -> bool:
        """True when two encodes used the same spatial and channel geometry (images may differ)."""
        a, b = self.window, other.window
        return (
            a.y == b.y
            and a.x == b.x
            and (a.src_channel, a.src_channels, a.dst_channel, a.dst_y, a.dst_x)
            == (b.src_channel, b.src_channels, b.dst_channel, b.dst_y, b.dst_x)
            and self.edge_mode == other.edge_mode
            and self.source_shape[1:] == other.source_shape[1:]
            and self.destination_shape[1:] == other.destination_shape[1:]
        )


class GradientState(State):
    """The forward kernel's record, read by its gradient kernel (MPS ``MPSNNGradientState``).

    Written by: the forward ``encode`` that receives it as ``destination_state``.
    Read by: the matching gradient kernel (``gradient_state``).
    """

    def __init__(
        self,
        device: Device,
        *,
        command_buffer: CommandBuffer | None = None,
        label: str | None = None,
    ) -> None:
        super().__init__(device, command_buffer=command_buffer, label=label)
        self._forward: ForwardRecord | None = None

    @property
    def forward(self) -> ForwardRecord | None:
        """What the last forward encode recorded (None before any)."""
        return self._forward

    # Convenience views of the record (MPS exposes sourceWidth/Height on size-encoding states).
    @property
    def source_width(self) -> int:
        return self._require_forward(type(self).__name__).source_shape[3]

    @property
    def source_height(self) -> int:
        return self._require_forward(type(self).__name__).source_shape[2]

    def _require_forward(self, who: str) -> ForwardRecord:
        if self._forward is None:
            raise ValueError(
                f"[{who}] the gradient state must have been written by a forward encode (pass "
                f"it as destination_state), got a {type(self).__name__} no forward encode wrote"
            )
        return self._forward

    def _check_record(self, record: ForwardRecord, who: str) -> None:
        """Raise if a state shared by several encodes would see two geometries."""
        if self._forward is not None and not self._forward.same_geometry(record):
            raise ValueError(
                f"[{who}] a gradient state shared by several encodes needs the same geometry "
                f"at each encode, got {self._forward.window} then {record.window}"
            )


class BinaryGradientState(GradientState):
    """Gradient state of a two-input forward kernel (MPS ``MPSNNBinaryGradientState``)."""


class AccumulatorState(GradientState):
    """A gradient state whose contents are sums of the work that ran.

    Sums are float32 (float64 when the values are float64, for verification). A write
    (`_accumulate`, called by a command as it runs) stores when nothing has been accumulated
    into its slot since the state was made or `reset`, and otherwise adds (or merges, for
    statistics): the decision is made at run time, never at encode time, so commit order,
    abandoned command buffers and several queues do not matter. Writes from different queues
    are ordered on the device (the later stream waits for the earlier one). A captured command
    buffer records the decision it made when it was captured, which is what one training step
    per replay needs. A state may keep several independent sums (slots): batch normalization
    keeps its statistics in slot 0 and their gradients in slot 1.
    """

    def __init__(
        self,
        device: Device,
        *,
        command_buffer: CommandBuffer | None = None,
        label: str | None = None,
    ) -> None:
        super().__init__(device, command_buffer=command_buffer, label=label)
        self._slots: dict[int, list[torch.Tensor]] = {}
        self._writer_queue: CommandQueue | None = None

    @property
    def _sums(self) -> list[torch.Tensor] | None:
        return self._slots.get(0)

    @property
    def has_accumulated(self) -> bool:
        """True once a write has run since the state was made or reset (host view)."""
        return bool(self._slots)

    def reset(self) -> None:
        """Clear the sums: the next write that runs stores instead of adding."""
        self._check_live("reset")
        self._slots = {}

    def _accumulate(
        self,
        cb: CommandBuffer,
        values: Sequence[torch.Tensor],
        merge: Callable[[list[torch.Tensor], Sequence[torch.Tensor]], None] | None = None,
        *,
        fresh: bool = True,
        slot: int = 0,
    ) -> None:
        """Add ``values`` to the sums of ``slot`` (run time). ``merge(sums, values)`` updates
        the sums in place instead of adding; ``fresh``: the values are new tensors nobody else
        holds, so the first write may adopt them."""
        q = cb.command_queue  # a CommandQueue
        prev = self._writer_queue
        if prev is not None and prev is not q and q._stream is not None and not cb._captured:
            # CUDA: the stream this write runs on (q's, or its side stream) waits
            torch.cuda.current_stream(q._stream.device).wait_stream(prev._stream)  # type: ignore[arg-type]  # a CUDA queue's
        self._writer_queue = q
        sums = self._slots.get(slot)
        if sums is None:
            self._slots[slot] = [_widen(v, fresh) for v in values]
            return
        for i, (s, v) in enumerate(zip(sums, values, strict=True)):
            want = _acc(v.dtype)
            if s.dtype != want and want == torch.float64:
                sums[i] = s.double()  # float64 verification runs accumulate in float64
        if merge is not None:
            merge(sums, values)
        elif all(s.dtype == v.dtype for s, v in zip(sums, values, strict=True)):
            torch._foreach_add_(sums, list(values))  # one launch for all on CUDA
        else:
            for s, v in zip(sums, values, strict=True):
                s.add_(v)  # add_ promotes a float16/bfloat16 value itself

    def _zeros(self) -> list[torch.Tensor]:
        """The sums of no work in slot 0 (states that can be read before a write)."""
        raise NotImplementedError

    def _sum(self, index: int, slot: int = 0) -> torch.Tensor:
        """Sum ``index`` of ``slot``. Read before any write, the sums of slot 0 become zeros
        that later writes add into, so a tensor obtained early sees the work that runs
        afterwards. Read by commands at execution, so it does not check liveness (a state
        released at encode time stays readable until its last command ran); public accessors
        check it."""
        sums = self._slots.get(slot)
        if sums is None:
            sums = self._slots[slot] = self._zeros()
        return sums[index]

    def resources(self) -> list[torch.Tensor]:
        return [t for sums in self._slots.values() for t in sums]

    def _free_storage(self) -> None:
        self._slots = {}


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _widen(v: torch.Tensor, fresh: bool) -> torch.Tensor:
    want = _acc(v.dtype)
    if v.dtype == want:
        return v if fresh else v.clone()
    return v.to(want)


class StateBatch(list[Any]):
    """A list of states, one per image of a batch (MPS ``MPSStateBatch``).

    A shared state may appear several times; read counts treat it once.
    """

    def unique(self) -> list[Any]:
        """The distinct states, in first-appearance order."""
        return _unique(self)

    def increment_read_count(self, amount: int) -> int:
        """Add ``amount`` to each distinct temporary state's read count; returns the number of
        distinct states (MPS ``MPSStateBatchIncrementReadCount``)."""
        states = self.unique()
        for s in states:
            if s is not None and s.is_temporary:
                s.read_count = s.read_count + amount
        return len(states)

    @classmethod
    def of(cls, states: Iterable[Any]) -> StateBatch:
        return cls(states)


def _unique(items: Iterable[Any]) -> list[Any]:
    items = items if isinstance(items, list) else list(items)
    if items and items.count(items[0]) == len(items):  # one shared state (the common case)
        return [items[0]]
    # a dict keeps the first appearance's position; built in C (a batch of 256 shared
    # states costs microseconds, not a Python loop per image)
    return list(dict(zip(map(id, items), items, strict=True)).values())
