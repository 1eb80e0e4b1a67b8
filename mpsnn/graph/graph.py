"""`Graph` (MPS ``MPSNNGraph``): a node graph bound to a device, planned once, encoded per step.

Planning (at construction): walk back from the results over image and state edges (what no
result needs is never reached), order the filters, bind a kernel to each filter node, fuse a
neuron into the convolution or batch normalization before it when nothing else reads that
result, decide which forward filters run in training mode (their state is read by a gradient
node of this graph), and count the readers of every image and state.

One encode (`encode_batch`, or `encode` for one image) runs the filters in order on one
command buffer. Intermediates are temporary images in the graph's ``format`` (a node's own
``format`` wins), each released after the last node that reads it ran — the caching allocator
then reuses the storage for later intermediates; results and exported images are permanent.
After every gradient, the trainable layers' updates run (`mpsnn.graph.updates`): GPU style on
the command buffer, or CPU style after completion, once per ``encode_batch``, from the
pre-update weights' gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mpsnn.core.command_buffer import CommandBuffer
from mpsnn.core.descriptor import FeatureChannelFormat, ImageDescriptor
from mpsnn.core.device import CommandQueue, Device
from mpsnn.core.image import Image, TemporaryImage, _check_usable
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.state import State, StateBatch
from mpsnn.graph import program
from mpsnn.graph.nodes import ImageNode
from mpsnn.graph.plan import GraphPlan, build_plan
from mpsnn.graph.step import _HELD, _ShapeOnly, _Step, nbytes
from mpsnn.graph.updates import encode_updates

if TYPE_CHECKING:
    from mpsnn.graph.compiled import CompiledGraph

__all__ = ["Graph"]


class Graph:
    """A node graph bound to a device (MPS ``MPSNNGraph``).

    Args:
        device: where it runs.
        result_image: the `ImageNode` ``encode`` returns.
        result_image_is_needed: False when the result is not wanted (a training graph whose
            last gradient only feeds weight updates): ``encode`` then returns None and work
            that only served the result is skipped (the first layer's data gradient).

    Attributes:
        format: storage of intermediate images (FLOAT32 default; FLOAT16, BFLOAT16, FLOAT64);
            a node's own ``format`` wins.
        destination_image_allocator: how the result image is allocated (None: permanent).
        recompute_normalization_results: True (default) frees a training-mode batch
            normalization's result after its last forward reader and computes it again,
            from the normalization's input and batch statistics, just before the first
            gradient that reads it (a convolution's weight gradient reads its source). The
            recomputed image equals the freed one bit for bit; the backward then holds one
            such image at a time instead of all of them (ResNet-18: every BN + ReLU result).
            It costs one elementwise pass per such result. False keeps them.
        recompute_input_convolution_results: True frees the result of a convolution (or
            fully connected layer) that reads one of the graph's source images (a network's
            first layer) after its last forward reader and computes it again, by the same
            kernel from the same source and weights, just before the first gradient that reads
            it (a normalization's or a pooling's gradient, at the end of the backward). The
            recomputed image equals the freed one bit for bit; the backward does not hold it.
            It costs one more forward of that layer per step, and one more read of that source
            (`read_count_for_source_image` counts it). False (default) keeps it.
        data_parallel: None (one process: no hook is called), or an object whose
            ``begin_step(step)`` returns the step's collectives (`StepCollectives`, in
            ``mpsnn.graph.step``), e.g. `mpsnn.DataParallel`: each process encodes its shard
            of the batch, and the hooks combine batch-normalization statistics and sum the
            weight gradients across processes before the updates. An object with
            ``capturable = False`` makes `compile` run every step eagerly.
        reuse_step: True (default) lowers the first step of each input layout to a step
            program (`mpsnn.graph.program`: the step's commands over slots, lowered once) that
            later encodes of that layout run while nothing the encode read changed (kernel
            properties, nodes, data sources, optimizers, these settings): equal to a full
            encode bit for bit at a fraction of its host time. False encodes every step in
            full. A ``data_parallel`` object runs programs when it says ``programmable``
            (its per-step host work then goes through ``program_step(command_buffer)``).
    """

    def __init__(
        self, device: Device, result_image: ImageNode, result_image_is_needed: bool = True
    ) -> None:
        self._init(device, [result_image], [result_image_is_needed])

    @classmethod
    def from_results(
        cls,
        device: Device,
        result_images: Sequence[ImageNode],
        results_are_needed: Sequence[bool] | None = None,
    ) -> Graph:
        """A graph with several results (MPS ``initWithDevice:resultImages:
        resultsAreNeeded:``): the first is returned by ``encode``, the others are kept in
        ``intermediate_images``."""
        graph = cls.__new__(cls)
        needed = [True] * len(result_images) if results_are_needed is None else results_are_needed
        graph._init(device, list(result_images), list(needed))
        return graph

    # -- planning --------------------------------------------------------------------------

    def _init(self, device: Device, results: list[ImageNode], needed: list[bool]) -> None:
        if not isinstance(device, Device):
            raise TypeError(f"[Graph] device must be a Device, got {type(device).__name__}")
        if not results:
            raise ValueError("[Graph] a graph needs at least one result image, got none")
        for r in results:
            if not isinstance(r, ImageNode):
                raise TypeError(f"[Graph] result images must be ImageNodes, got {type(r).__name__}")
        if len(needed) != len(results):
            raise ValueError(
                f"[Graph] results_are_needed must have one flag per result ({len(results)}), "
                f"got {len(needed)}"
            )
        self._device = device
        self._results = results
        self._needed = [bool(n) for n in needed]
        self.format = FeatureChannelFormat.FLOAT32
        self.destination_image_allocator: Any = None
        self.label: str | None = None
        self.data_parallel: Any = None
        self.recompute_normalization_results = True
        self.recompute_input_convolution_results = False
        self.reuse_step = True
        self._output_state_is_temporary = False
        self._result_states: list[Any] = []
        self._programs: list[Any] = []  # lowered steps, newest first (mpsnn.graph.program)
        self._lowering_refusals = 0  # lowerings in a row not kept
        self._plan = build_plan(self, results, self._needed)
        self._last_plan_report: dict[str, Any] | None = None
        self._intermediates: list[Any] = []

    @property
    def device(self) -> Device:
        return self._device

    @property
    def plan(self) -> GraphPlan:
        """What the graph decided when it was made (a frozen `mpsnn.graph.plan.GraphPlan`):
        the filters in order, training modes, fusion, liveness, recomputation, the kernels.
        For introspection; `debug_description` prints it."""
        return self._plan

    @property
    def source_image_handles(self) -> list[Any]:
        """The handles of the input images, in ``encode``'s order."""
        return [n.handle for n in self._plan.sources]

    @property
    def source_state_handles(self) -> list[Any]:
        """The handles of the input states (the loss nodes' labels), in ``encode``'s order."""
        return [n.handle for n in self._plan.state_sources]

    @property
    def result_handle(self) -> Any:
        return self._results[0].handle

    @property
    def result_image_is_needed(self) -> bool:
        return self._needed[0]

    @property
    def intermediate_image_handles(self) -> list[Any]:
        """Handles of the exported images and the extra results, in the order
        ``intermediate_images`` lists them."""
        return [n.handle for n in self._plan.modes.exported]

    @property
    def intermediate_images(self) -> list[Any]:
        """The exported images (and extra results) of the last encode."""
        return list(self._intermediates)

    @property
    def result_state_handles(self) -> list[Any]:
        """The handles of the result states (MPS ``resultStateHandles``): the state nodes of
        the graph's forward filters marked ``export_from_graph``, in the order
        ``result_states`` lists them. A filter with an exported state runs in training mode
        (it makes its state)."""
        return [st.handle for st in self._plan.modes.exported_states]

    @property
    def result_states(self) -> list[Any]:
        """The result states of the last encode: one `StateBatch` per result state handle."""
        return list(self._result_states)

    @property
    def output_state_is_temporary(self) -> bool:
        """Whether the result states an encode returns are temporary (MPS
        ``outputStateIsTemporary``, default False): False, permanent states that live as long
        as they are referenced; True, temporary states of the encode's command buffer, handed
        over with ``read_count`` 1 (a gradient encode that reads them consumes it; raise it to
        read them more, set it to 0 to release them)."""
        return self._output_state_is_temporary

    @output_state_is_temporary.setter
    def output_state_is_temporary(self, value: bool) -> None:
        if type(value) is not bool:
            raise TypeError(f"[Graph] output_state_is_temporary must be a bool, got {value!r}")
        self._output_state_is_temporary = value

    def read_count_for_source_image(self, index: int) -> int:
        """How many times one encode reads source image ``index`` (MPS
        ``readCountForSourceImageAtIndex:``)."""
        if not 0 <= index < len(self._plan.sources):
            raise ValueError(
                f"[Graph] index must be in [0, {len(self._plan.sources)}), got {index}"
            )
        reads = self._plan.liveness.source_reads[index]
        if self.recompute_input_convolution_results is True:
            reads += self._plan.recompute.source_reads(index)
        return reads

    def read_count_for_source_state(self, index: int) -> int:
        if not 0 <= index < len(self._plan.state_sources):
            raise ValueError(
                f"[Graph] index must be in [0, {len(self._plan.state_sources)}), got {index}"
            )
        return self._plan.liveness.state_source_reads[index]

    def reload_from_data_sources(self) -> None:
        """Every kernel with a data source reads it again now (MPS
        ``reloadFromDataSources``). Work already committed keeps the values it ran with (the
        copies are ordered on the current stream)."""
        for node in self._plan.order:
            kernel = self._plan.kernels[node._id]
            for k in kernel if isinstance(kernel, tuple) else (kernel,):
                for name in (
                    "reload_weights_and_biases_from_data_source",
                    "reload_gamma_and_beta_from_data_source",
                    "reload_mean_and_variance_from_data_source",
                ):
                    reload = getattr(k, name, None)
                    if reload is not None:
                        reload()

    # -- allocation (called by the kernels' allocators) -------------------------------------

    def _check_formats(self, who: str) -> None:
        """``format`` of the graph and of every result image node (plain attributes a user
        may set) is a `FeatureChannelFormat`: checked before anything is encoded, since the
        allocator trusts them."""
        for name in (
            "recompute_normalization_results",
            "recompute_input_convolution_results",
            "reuse_step",
        ):
            if type(getattr(self, name)) is not bool:
                raise TypeError(f"[{who}] {name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.format, FeatureChannelFormat):
            raise TypeError(
                f"[{who}] format must be a FeatureChannelFormat, got {type(self.format).__name__}"
            )
        for node in self._plan.order:
            fmt = node.result_image.format
            if fmt is not None and not isinstance(fmt, FeatureChannelFormat):
                raise TypeError(
                    f"[{who}] {node.result_image!r}'s format must be a FeatureChannelFormat or "
                    f"None, got {type(fmt).__name__}"
                )

    def _allocate(self, cb: CommandBuffer, node: ImageNode, desc: ImageDescriptor) -> Image:
        fmt = node.format or self.format
        # a new descriptor (the kernel's may be cached in its plans); checked already
        desc = ImageDescriptor._make(fmt, desc._w, desc._h, desc._c, desc._n)
        if node._id in self._plan.modes.kept:
            alloc = node.image_allocator or (
                self.destination_image_allocator if node is self._results[0] else None
            )
            if alloc is None:
                image = Image(self._device, desc)
            else:
                image = _checked_image(
                    "Graph", f"{node!r}'s image", alloc.image(cb, desc, None), cb
                )
        elif node.image_allocator is not None:
            image = node.image_allocator.image(cb, desc, None)
            _checked_image("Graph", f"{node!r}'s image", image, cb)
            if image.is_temporary:
                image.read_count = _HELD  # the graph releases it after its last reader
        else:
            # the graph's own intermediates (most images of a step): the buffer is encodable
            # and the descriptor valid, so the checked constructor is skipped
            image = TemporaryImage._make_on(cb, desc)
            image._read_count = _HELD
        step = self._current
        if step is not None:
            step.bytes += nbytes(image)
            if step.bytes > step.peak:
                step.peak = step.bytes
        return image

    # -- encode --------------------------------------------------------------------------------

    def encode_batch(
        self,
        command_buffer: CommandBuffer,
        source_images: Sequence[ImageBatch],
        source_states: Sequence[Any] | None = None,
    ) -> ImageBatch | None:
        """Encode one step: one `ImageBatch` per source image handle (or a sequence of
        `Image` s of one shape: views of one batch are wrapped, separate images stacked by a
        recorded copy), one `StateBatch` (one `LossLabels` per image, or one for the batch) per
        source state handle. Returns the result batch (None when the result is not needed).
        Trainable layers are updated."""
        who = "Graph"
        if not isinstance(command_buffer, CommandBuffer):
            raise TypeError(
                f"[{who}] command_buffer must be a CommandBuffer, got "
                f"{type(command_buffer).__name__}"
            )
        command_buffer.check_encodable(who)
        if command_buffer.device != self._device:
            raise ValueError(
                f"[{who}] the command buffer must be on {self._device}, got one on "
                f"{command_buffer.device}"
            )
        self._check_formats(who)
        mark = command_buffer._mark()
        try:  # a sequence of images may record a stacking copy before the checks
            images, checked = self._inputs(command_buffer, source_images, source_states)
        except BaseException:
            command_buffer._rollback(mark)
            raise
        n = len(images[0]) if images else 0
        key = program.input_key(images, checked) if program.programmable(self) else None
        if key is None and self._programs and not self.reuse_step:
            self._programs = []  # turned off: let go of the lowered steps
        if key is not None:
            found = program.find(self, key, checked)
            if found is not None:
                self._last_plan_report = found.report
                return found.encode(self, command_buffer, images, [s[0] for s in checked])
        try:
            if key is None:
                return self._encode_step(command_buffer, images, checked, n)
            return program.lower(
                self, command_buffer, key, images, checked,
                lambda cb, im, st: self._encode_step(cb, im, st, n, lowering=True),
            )  # fmt: skip
        except BaseException:
            # a shape only known at run time (e.g. a concatenation of mismatched inputs)
            # raised halfway: the buffer is left as it was before this encode
            command_buffer._rollback(mark)
            raise

    def _inputs(
        self,
        command_buffer: CommandBuffer,
        source_images: Sequence[Any],
        source_states: Sequence[Any] | None,
    ) -> tuple[list[ImageBatch], list[Any]]:
        """The checked inputs of `encode_batch`: the source batches and the label batches."""
        who = "Graph"
        images = [
            ImageBatch._of(command_buffer, who, f"source_images[{i}]", b)
            for i, b in enumerate(source_images)
        ]
        if len(images) != len(self._plan.sources):
            raise ValueError(
                f"[{who}] encode_batch needs one ImageBatch per source image handle "
                f"({len(self._plan.sources)}: {self.source_image_handles}), got {len(images)}"
            )
        for i, b in enumerate(images):
            if not isinstance(b, ImageBatch):
                raise TypeError(
                    f"[{who}] source_images[{i}] must be an ImageBatch, got {type(b).__name__}"
                )
            if b.device != self._device:
                raise ValueError(
                    f"[{who}] source_images[{i}] must be on {self._device}, got {b.device}"
                )
            # liveness and buffer, as a kernel checks its sources: the graph's kernels skip
            # those checks for the images the graph passes them
            _check_usable(who, f"source_images[{i}]", b._image, command_buffer)
        n = len(images[0]) if images else 0
        for i, b in enumerate(images):
            if len(b) != n:
                raise ValueError(
                    f"[{who}] every source ImageBatch must hold the same number of images "
                    f"({n}), got {len(b)} in source_images[{i}]"
                )
        states = list(source_states or [])
        if len(states) != len(self._plan.state_sources):
            raise ValueError(
                f"[{who}] encode_batch needs one state batch per source state handle "
                f"({len(self._plan.state_sources)}), got {len(states)}"
            )
        checked = [_labels_batch(self, value, n, i) for i, value in enumerate(states)]
        return images, checked

    def _encode_step(
        self,
        command_buffer: CommandBuffer,
        images: list[ImageBatch],
        checked: list[Any],
        n: int,
        lowering: bool = False,
    ) -> ImageBatch | None:
        """The ordinary encode of one step (inputs checked; ``lowering``: it is lowered to a
        step program, whose encodes do the per-step host work of the hooks)."""
        step = _Step(self, command_buffer, n, lowering)
        for node, value in zip(self._plan.sources, images, strict=True):
            step.set_image(node, value)
        for node, value in zip(self._plan.state_sources, checked, strict=True):
            step.set_state(node, value)
        self._current = step
        try:
            recompute = step.recompute
            for node in self._plan.order:
                if recompute and node._id in recompute:
                    step.recompute_before(node)
                node._run(step, self._plan.kernels[node._id])
                step.done(node)
            if step.collectives is not None:
                step.collectives.before_updates()
            encode_updates(self, step)
            if step.collectives is not None:
                step.collectives.after_updates()
        finally:
            self._current = None
        for batch in step.result_states:  # the graph's reads dropped: the client's one left
            for st in batch.unique():
                if st._released_by is None:
                    st._read_count = 1
        self._result_states = [
            StateBatch(step.states.get(st._id) or []) for st in self._plan.modes.exported_states
        ]
        self._intermediates = [step.images.get(x._id) for x in self._plan.modes.exported]
        # the total is computed when asked for (debug_description), not at every step
        self._last_plan_report = {
            "peak_bytes": step.peak,
            "images": [v for k, v in step.images.items() if k not in self._plan.topology.source_ids]
            + step.recomputed,
        }
        if not self._needed[0]:
            return None
        return step.image(self._results[0])

    def encode(
        self,
        command_buffer: CommandBuffer,
        source_images: Sequence[Image],
        source_states: Sequence[Any] | None = None,
    ) -> Image | None:
        """Like `encode_batch` for single (possibly multi-image) images."""
        for i, im in enumerate(source_images):
            if not isinstance(im, Image):
                raise TypeError(
                    f"[Graph] source_images[{i}] must be an Image, got {type(im).__name__}"
                )
        batches = [ImageBatch(im) for im in source_images]
        states = (
            None
            if source_states is None
            else [[s] if isinstance(s, State) else s for s in source_states]
        )
        out = self.encode_batch(command_buffer, batches, states)
        return None if out is None else out.image

    def compile(self, command_queue: CommandQueue | None = None) -> CompiledGraph:
        """This graph's step recorded once and replayed (a `CompiledGraph`): call it with each
        batch, ``compiled(source_images, source_states)``. The first call runs eagerly, the
        second records the step as a CUDA graph, later calls refill the inputs in place and
        replay it; on the CPU every call runs eagerly."""
        from mpsnn.graph.compiled import CompiledGraph

        return CompiledGraph(self, command_queue)

    def execute_async(
        self, source_images: Sequence[Image], completion_handler: Any = None
    ) -> Image | None:
        """Encode on a private queue and command buffer, commit, and return the result (valid
        once ``completion_handler(result, error)`` ran or the result is read)."""
        cb = self._device.new_command_queue().command_buffer()
        out = self.encode(cb, source_images)
        if completion_handler is not None:
            cb.add_completed_handler(lambda c: completion_handler(out, c.error))
        cb.commit()
        return out

    _current: _Step | None = None

    def _total(self, step_images: list[Any]) -> int:
        """Bytes of the intermediates of an encode (its images but the sources; a stand-in
        for an image never stored, a normalization run inside the sum after it, is none)."""
        images = {  # fused and passed-on nodes share their image: count it once
            id(v.image._root()): v.image._root()
            for v in step_images
            if isinstance(v, ImageBatch) and not isinstance(v.image._root(), _ShapeOnly)
        }
        return sum(nbytes(im) for im in images.values())

    # -- introspection -----------------------------------------------------------------------

    def debug_description(self) -> str:
        """A readable listing: the planned kernels in order, what each reads and makes, which
        run in training mode, the fused neurons, and (after an encode) the intermediates' peak
        memory against their total."""
        plan = self._plan
        lines = [f"Graph on {self._device} ({len(plan.order)} filters, format {self.format.name})"]
        lines += plan.describe(
            self.recompute_normalization_results, self.recompute_input_convolution_results
        )
        updates = plan.updates_planned()
        if updates:
            lines.append(f"  updates after the gradients: {', '.join(updates)}")
        if self._last_plan_report:
            r = self._last_plan_report
            total = self._total(r["images"])
            lines.append(
                f"  intermediates: peak {r['peak_bytes'] / 2**20:.2f} MiB of "
                f"{total / 2**20:.2f} MiB allocated in the last encode"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Graph on {self._device}: {len(self._plan.order)} filters>"


def _checked_image(who: str, name: str, image: Any, cb: CommandBuffer) -> Image:
    """An image a graph hands its kernels that it did not make itself (a source, or what an
    allocator of the user's returned), checked as a kernel checks a source: an `Image` of the
    command buffer's device, live, and no temporary image of another command buffer."""
    if not isinstance(image, Image):
        raise TypeError(f"[{who}] {name} must be an Image, got {type(image).__name__}")
    if image._device != cb._queue._device:
        raise ValueError(f"[{who}] {name} must be on {cb._queue._device}, got {image._device}")
    _check_usable(who, name, image, cb)
    return image


def _labels_batch(graph: Graph, value: Any, n: int, index: int) -> list[Any]:
    """Source state ``index`` as a list of states, checked before anything is encoded: loss
    labels must cover the batch's ``n`` images, on the graph's device."""
    from mpsnn.cnn.loss_labels import LossLabels

    who = "Graph"
    if isinstance(value, State):
        states = [value]
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        states = list(value)
    else:
        raise TypeError(
            f"[{who}] source_states[{index}] must be a StateBatch (one LossLabels per image) or "
            f"one LossLabels for the batch, got {type(value).__name__}"
        )
    for j, st in enumerate(states):
        if not isinstance(st, State):
            raise TypeError(
                f"[{who}] source_states[{index}][{j}] must be a state, got {type(st).__name__}"
            )
        if st.device != graph.device:
            raise ValueError(
                f"[{who}] source_states[{index}][{j}] must be on {graph.device}, got {st.device}"
            )
    if all(isinstance(st, LossLabels) for st in states):
        total = sum(st.number_of_images for st in states)
        if total != n:
            raise ValueError(
                f"[{who}] the labels of source state {index} must hold one image per source "
                f"image ({n}), got {total} in {len(states)} LossLabels"
            )
    return states
