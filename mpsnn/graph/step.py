"""One encode of a graph (`_Step`), the allocator a graph installs on its kernels, and the
shape-only stand-in of an image a step does not store.

Kept apart from `mpsnn.graph.graph` so that node modules can name the step without importing
the graph (imports point one way: nodes → step, graph → nodes).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.descriptor import FeatureChannelFormat, ImageDescriptor
from mpsnn.core.image import Image, TemporaryImage
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.state import GradientState, State, StateBatch, _unique


class _Node(Protocol):
    """What the step needs of a node: its id in the graph (the step does not import the node
    classes, which import the step)."""

    _id: int


class StepCollectives(Protocol):
    """The hooks of one distributed step (what ``graph.data_parallel.begin_step(step)``
    returns; `mpsnn.DataParallel` is the implementation). ``weights_beside`` (optional, False
    when absent): whether a convolution's weight gradient runs on the queue's side stream in
    captured work, beside the collectives recorded after it
    (`mpsnn.core.command_buffer.CommandBuffer._beside`). Each hook is called at encode time and
    records its work on ``step.cb`` (``cb.record``), so it runs in command order:

    * ``weight_gradient_ready(node, kernel, states)``: the trainable gradient node ``node``
      encoded its weight-gradient work; once that command ran, ``states`` hold the sums of
      this process's images (called in backward order, before the node's update is queued);
    * ``batch_norm_statistics(node, state)``: the statistics of a training-mode batch
      normalization were encoded into ``state`` (slot 0: count, mean, m2); the normalization
      is encoded next and reads them;
    * ``batch_norm_gradient_sums(node, state)``: its gradient sums were encoded (slot 1:
      Σgy·xhat, Σgy); the input gradient is encoded next and reads them;
    * ``before_updates()``: every gradient was encoded; the data sources' updates follow;
    * ``after_updates()``: the updates were encoded (the step's last work). When
      ``step.lowering``, the step becomes a step program: its per-step host work (counting
      the step, a periodic check) belongs to the object's ``program_step(command_buffer)``,
      which every encode that lowers or runs the program calls.
    """

    def weight_gradient_ready(self, node: Any, kernel: Any, states: Any) -> None: ...
    def batch_norm_statistics(self, node: Any, state: Any) -> None: ...
    def batch_norm_gradient_sums(self, node: Any, state: Any) -> None: ...
    def before_updates(self) -> None: ...
    def after_updates(self) -> None: ...


__all__ = ["StepCollectives", "itemsize", "nbytes"]

_HELD = 1 << 30  # read count of a graph-held temporary: the graph releases it itself


class _NodeAllocator:
    """The allocator a graph installs on a node's kernel: the node's format, a temporary image
    (released by the graph after its last reader) or a permanent one (results, exports)."""

    def __init__(self, graph: Any, node: _Node) -> None:
        self._graph = graph
        self._node = node

    def image(self, cb: CommandBuffer, descriptor: ImageDescriptor, kernel: Any) -> Image:
        return self._graph._allocate(cb, self._node, descriptor)

    def image_batch(
        self, cb: CommandBuffer, descriptor: ImageDescriptor, kernel: Any, count: int
    ) -> Image:
        return self._graph._allocate(cb, self._node, descriptor)


class _Step:
    """One encode of a graph: the command buffer, the value of every node, what to release."""

    def __init__(self, graph: Any, cb: CommandBuffer, n: int, lowering: bool = False) -> None:
        self.graph = graph
        self.cb = cb
        self.n = n
        self.lowering = lowering  # lowered to a step program (`mpsnn.graph.program`)
        self.images: dict[int, Any] = {}
        self.states: dict[int, Any] = {}
        self.updates: list[tuple[Any, Any, Any]] = []  # (gradient node, kernel, state batch)
        self.gamma_beta_reloads: list[tuple[Any, Any]] = []
        self.result_states: list[StateBatch] = []  # temporary result states made
        self.remaining = dict(graph._plan.liveness.readers)  # node id -> consumers still to run
        # results recomputed for the backward: freed after their forward readers
        plan = graph._plan.recompute
        norm = graph.recompute_normalization_results
        inputs = graph.recompute_input_convolution_results
        self.recompute = plan.selected(norm, inputs)
        if self.recompute:
            self.remaining.update(plan.start_reads(norm, inputs))
        self.recomputed: list[Any] = []  # the freed first images (for the plan report)
        # batch normalizations the addition after them runs: node id -> (its normalization
        # kernel, source, state), taken by that addition (`mpsnn.nodes.arithmetic`)
        self.deferred: dict[int, tuple[Any, Any, Any]] = {}
        self.shared: dict[int, int] = {}  # id(root image) -> keys holding it, when > 1
        self.bytes = 0
        self.peak = 0
        hooks = getattr(graph, "data_parallel", None)  # None: one process, no hook calls
        self.collectives: StepCollectives | None = None if hooks is None else hooks.begin_step(self)

    def image(self, node: _Node) -> ImageBatch:
        try:
            return self.images[node._id]
        except KeyError:
            raise ValueError(
                f"[Graph] {node!r} has no value in this encode (its producer did not run), got "
                "a read of it"
            ) from None

    def set_image(self, node: _Node, value: ImageBatch) -> None:
        self.images[node._id] = value

    def state(self, node: _Node) -> Any:
        try:
            return self.states[node._id]
        except KeyError:
            raise ValueError(
                f"[Graph] {node!r} has no value in this encode, got a read of it"
            ) from None

    def set_state(self, node: _Node, value: Any) -> None:
        self.states[node._id] = value

    def training(self, node: _Node) -> bool:
        """Whether ``node`` runs in training mode (its state is read by a gradient node)."""
        return node._id in self.graph._plan.modes.training

    def states_for(self, node: _Node, kernel: Any, source: ImageBatch) -> StateBatch:
        """States for a training forward: temporary and held by the graph until it releases
        them; permanent for a layer updated on the CPU after completion. A result state
        (exported) is permanent, or temporary with ``graph.output_state_is_temporary`` (the
        graph hands it over with one read, the client's, at the end of the encode)."""
        graph = self.graph
        exported = getattr(node, "result_state", None) in graph._plan.modes.exported_states
        if node._id in graph._plan.modes.cpu_updates or (
            exported and not graph.output_state_is_temporary
        ):
            return kernel.result_state_batch(source)
        if exported:
            batch = kernel.temporary_result_state_batch(self.cb, source)
            for st in batch.unique():
                st._read_count = _HELD
            self.result_states.append(batch)
            return batch
        if getattr(kernel, "_gradient_state_class", None) is GradientState:
            # A plain gradient state holds only the forward record, which one batch encode
            # makes identical for every image: one state repeated serves the batch (and saves
            # a Python object per image per layer per step).
            batch = StateBatch([GradientState(self.graph.device, command_buffer=self.cb)] * self.n)
        else:
            batch = kernel.temporary_result_state_batch(self.cb, source)
        for st in batch.unique():
            st._read_count = _HELD  # new temporary states of this buffer: no checks needed
        return batch

    def weight_gradient_ready(self, node: _Node, kernel: Any, states: Any) -> None:
        """The trainable gradient node ``node`` encoded its weight gradient: queue its layer's
        update (``kernel``: the forward node's kernel) and tell the collectives, if any."""
        if self.collectives is not None:
            self.collectives.weight_gradient_ready(node, kernel, states)
        self.updates.append((node, kernel, states))

    def alias(self, node: _Node, same_as: _Node) -> None:
        """``node`` holds the same image as ``same_as`` (fusion, pass-through)."""
        self.images[node._id] = self.image(same_as)

    def share(self, node: _Node, same_as: _Node) -> None:
        """``node`` holds the image of ``same_as``, decided at encode time (a gradient that
        equals its incoming gradient): each key is released after its own last reader, and
        the storage after the last of both."""
        value = self.image(same_as)
        self.images[node._id] = value
        root = _root(value)
        self.shared[id(root)] = self.shared.get(id(root), 1) + 1

    def recompute_before(self, node: _Node) -> None:
        """Compute again the results recomputed before ``node`` (freed after their last
        forward reader, `mpsnn.graph.plan_recompute`): the same kernel, source and state, so
        the same values."""
        for r in self.recompute.get(node._id, ()):
            made = r.node
            x = self.image(made.source_images[0])
            if made.recomputes_result:  # a normalization
                kernel = self.graph._plan.kernels[made._id][1]  # (statistics, normalization)
                value = kernel.encode_batch(self.cb, x, self.state(made.result_state)[0])
            else:  # an input convolution: its inference encode (no state)
                kernel = self.graph._plan.kernels[made._id]
                trusted = getattr(kernel, "_graph_encode_batch", None)
                value = trusted(self.cb, x, None) if trusted else kernel.encode_batch(self.cb, x)
            self.recomputed.append(self.images[r.ids[0]])  # the freed one, for the report
            for i in r.ids:
                self.images[i] = value
            self.remaining[r.key] = r.reads

    def done(self, node: _Node) -> None:
        """``node`` ran: release the images and states it was the last reader of."""
        remaining = self.remaining
        for key in self.graph._plan.liveness.reads_by[node._id]:
            left = remaining[key] - 1
            remaining[key] = left
            if left == 0:
                self._release(key)

    def _release(self, key: int) -> None:
        value = self.images.get(key)
        if value is not None:
            root = _root(value)
            holders = self.shared.get(id(root), 1)
            if holders > 1:  # another key still holds this storage
                self.shared[id(root)] = holders - 1
                return
            if isinstance(root, TemporaryImage) and root._released_by is None:
                root._read_count = 0  # freed after the last command that reads it
                root._release("read_count = 0")
                self.bytes -= nbytes(root)
            return
        states = self.states.get(key)
        if states is not None:
            for st in _unique(states if isinstance(states, list) else [states]):
                temporary = isinstance(st, State) and st._command_buffer is not None
                if temporary and st._released_by is None:
                    st._read_count = 0
                    st._release("read_count = 0")


def _root(value: ImageBatch | Image) -> Image:
    """The image that owns the storage of a step value (a batch or an image, maybe a view)."""
    return value.image._root() if isinstance(value, ImageBatch) else value._root()


def nbytes(image: Image) -> int:
    n, c, h, w = image._shape
    return n * c * h * w * _ITEMSIZE.get(image._fmt, 2)


def itemsize(fmt: FeatureChannelFormat) -> int:
    return _ITEMSIZE.get(fmt, 2)


_ITEMSIZE = {FeatureChannelFormat.FLOAT64: 8, FeatureChannelFormat.FLOAT32: 4,
             FeatureChannelFormat.UNORM8: 1}  # fmt: skip


class _ShapeOnly(Image):
    """A stand-in with an image's shape and format and no storage: what the add/subtract
    gradients get instead of an input image the graph may have released already, and the
    value of a batch normalization run inside the sum after it (never stored). They read only
    its shape; a command that read its contents would be a planning bug, and raises."""

    def _data(self) -> torch.Tensor:
        raise RuntimeError(
            f"[Graph] internal error: the contents of a shape-only stand-in ({self._describe()}) "
            "were read; please report this"
        )


def _shape_only(batch: ImageBatch | Image) -> ImageBatch | Image:
    """`_ShapeOnly` of ``batch`` (an `ImageBatch` for a batch)."""
    image = batch.image if isinstance(batch, ImageBatch) else batch
    n, c, h, w = image._shape
    stand_in = _ShapeOnly._make(image._device, ImageDescriptor._make(image._fmt, w, h, c, n))
    return ImageBatch(stand_in) if isinstance(batch, ImageBatch) else stand_in
