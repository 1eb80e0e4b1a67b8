"""The step program: a graph's step lowered once per input layout to a flat list of commands
over slots, and run for every later step of that layout.

Why: from one step to the next of the same batch layout, a graph's encode makes the same
commands on objects of the same shapes; walking the nodes, validating, planning, allocating
and writing the records again costs as much host time as launching the work.

**Lowering** (`lower`). The first encode of a layout is the graph's ordinary encode, made on
*input slots* (images and labels the program owns, of the caller's descriptors and layout) on
the caller's command buffer. What it recorded becomes the program:

* the **commands**, in order: closures over the slots and the typed records the encode fixed
  (windows, weights, fused neurons, plans), each with the slots it reads last (the releases
  the encode attached to it) and its device-side check, if any;
* the **slots**: every image and state the encode made. Their encode-time bookkeeping (read
  counts, the forward records written into gradient states, kernel properties) is done once,
  here. Their tensors are run-time values: written by the commands, freed after the last
  command that reads them, and at the latest once the step's work is enqueued, which leaves
  every slot as the lowering left it (`_free_storage` drops exactly what a command wrote);
* the **outputs**: slots whose tensors the caller receives (the result, the exported images,
  the loss image of each `LossLabels`);
* the **encode-time counters**: the optimizers' step counts (Adam's ``time_step``).

**A step** (`StepProgram.encode`): count the counters (this use's values are bound when the
work runs, so buffers committed in any order run with their own counts), make fresh output
images for the caller, and append to the caller's buffer a command that binds the input
slots to the caller's tensors, the program's commands, and a command that hands the output
slots' tensors to the fresh images. The buffer's commit runs them like any encoded work
(errors, checks and completion as for an ordinary encode); `CompiledGraph` captures the same
list; data-parallel collectives are commands in it like the others.

**Validity** (`_Reads`). A program is what the encode made of what it read. It runs only while
that is unchanged: the graph's settings and the Triton switch, every kernel's configuration
number (any public assignment bumps it), the attributes of every node, data source (with the
weights state it holds), optimizer and optimizer descriptor (the learning rate aside: it lives
in device memory), and which weights each convolution-family kernel holds. Otherwise the
encode runs in full and lowers again. A lowering is kept only if it left what it read as it
found it (an encode that moved a data source to the device made its commands for the old
values), its slots hold no tensor made at encode time, and its outputs can be handed over; a
graph whose lowerings are refused three times in a row stops lowering.

Not lowered (every encode runs in full): updates on the CPU, an allocator of the user's,
result states, user code an encode calls (a padding policy, scale transform provider, loss
property callback, data source or optimizer defined outside mpsnn), inputs that are not whole
permanent images and one permanent `LossLabels` per state source, under
`torch.inference_mode()`, or with ``Graph.reuse_step = False``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from mpsnn.cnn.loss_labels import LossLabels
from mpsnn.core.command_buffer import CommandBuffer, _Command
from mpsnn.core.image import Image, TemporaryImage
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.state import State
from mpsnn.ops import triton as fast_paths
from mpsnn.optim.base import journal

__all__ = ["StepProgram", "find", "input_key", "lower", "programmable"]

_UNSET: Any = object()
_REFUSALS = 3  # lowerings in a row that could not be kept: stop lowering (plain encodes)
_KEPT = 4  # programs kept per graph (layouts, or what they read), the newest first


def programmable(graph: Any) -> bool:
    """Whether the graph's settings let an encode run or lower a program (cheap: at every
    encode; what the nodes hold is checked when lowering, and then watched)."""
    hooks = graph.data_parallel
    return (
        graph.reuse_step is True
        and (hooks is None or getattr(hooks, "programmable", False))
        and not graph._plan.modes.cpu_updates
        and graph.destination_image_allocator is None
        and not graph._plan.modes.exported_states  # result states: made for the client per encode
        and graph._lowering_refusals < _REFUSALS
        # tensors an encode makes under inference mode cannot be updated outside it
        and not torch.is_inference_mode_enabled()
    )


def input_key(images: list[ImageBatch], labels: list[list[Any]]) -> tuple[Any, ...] | None:
    """The input layout a program is lowered for (None: inputs a program does not bind)."""
    parts: list[Any] = []
    for b in images:
        image = b._image
        if type(image) is not Image or image._base is not None:
            return None
        t = image._storage
        tensor = None if t is None else (t.dtype, t.device, t.stride(), t.storage_offset())
        parts.append((image._device, image._fmt, image._shape, tensor))
    for states in labels:
        if len(states) != 1:
            return None
        lab = states[0]
        if type(lab) is not LossLabels or lab._command_buffer is not None:
            return None
        w = lab._weights
        parts.append((lab._index, lab._labels.shape, lab._labels.dtype, lab._labels.device,
                      None if w is None else (w.shape, w.dtype), lab._loss_size))  # fmt: skip
    return tuple(parts)


def find(graph: Any, key: tuple[Any, ...], labels: list[list[Any]]) -> StepProgram | None:
    """The program lowered for this layout, if it is still valid for the graph."""
    for p in graph._programs:
        if p.key == key and p.reads.same(graph):
            for slot, states in zip(p.labels, labels, strict=True):
                classes = slot._classes
                if classes is not None and states[0]._max_index >= classes:
                    return None  # the loss kernel's own check raises on the ordinary path
            return p
    return None


# -- what a lowering read --------------------------------------------------------------------


def _attrs(obj: Any) -> dict[str, Any]:
    """Every attribute of ``obj``: its ``__dict__`` and its slots (unset slots: `_UNSET`)."""
    out: dict[str, Any] = {}
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if name not in ("__dict__", "__weakref__"):
                out[name] = getattr(obj, name, _UNSET)
    d = getattr(obj, "__dict__", None)
    if d is not None:
        out.update(d)
    return out


# attributes an encode does not read: the learning rate lives in device memory (the host value
# mirrors it), so a schedule that sets it at every step keeps the program; Adam's
# ``time_step`` is an encode-time counter the program counts itself
_NOT_READ = frozenset({"learning_rate", "_time_step"})


def _watched(graph: Any) -> list[Any]:
    """The objects whose attributes an encode reads: nodes, data sources, optimizers."""
    objs: list[Any] = []
    seen: set[int] = set()

    def add(o: Any) -> None:
        if o is not None and id(o) not in seen:
            seen.add(id(o))
            objs.append(o)

    for node in graph._plan.order:
        add(node)
        add(node.result_image)
        forward = getattr(node, "inference_node", None)
        for n in (node, forward):
            ds = getattr(n, "data_source", None)
            add(ds)
            for value in getattr(ds, "__dict__", {}).values():
                if isinstance(value, State):  # the weights an update reads (which tensors)
                    add(value)
            opt = getattr(ds, "optimizer", None)
            add(opt)
            add(getattr(opt, "_desc", None))
    return objs


def _plain(obj: Any) -> bool:
    """Whether ``vars(obj)`` is all of it (no slots) and holds nothing `_state_of` drops."""
    if any(getattr(c, "__slots__", ()) for c in type(obj).__mro__):
        return False
    return not (_NOT_READ & vars(obj).keys()) and "_config" not in vars(obj)


def _state_of(obj: Any, plain: bool) -> dict[str, Any]:
    """What is compared of a watched object: its attributes, but a kernel's configuration
    number (an optimizer is a kernel: its public assignments show in its attributes anyway)
    and the attributes an encode does not read."""
    if plain:
        return vars(obj)
    return {k: v for k, v in _attrs(obj).items() if k not in _NOT_READ and k != "_config"}


def _kernels(graph: Any) -> list[Any]:
    out = []
    for k in graph._plan.kernels.values():
        out.extend(k if isinstance(k, tuple) else (k,))
    return out


def _weights_signature(kernels: list[Any]) -> tuple[Any, ...]:
    """Which weights tensors each convolution-family kernel holds, and whether it has biases:
    what its gradient's encode decides the bias sums from (reloads change them)."""
    out = []
    for k in kernels:
        ws = getattr(k, "_weights", None)
        w = getattr(ws, "weight", None)
        if isinstance(w, torch.Tensor):
            out.append((w.shape, w.dtype, getattr(ws, "bias", None) is None))
    return tuple(out)


def _settings(graph: Any) -> tuple[Any, ...]:
    """The graph's settings an encode reads, and the process-wide Triton switch."""
    hooks = graph.data_parallel
    return (graph.format, graph.recompute_normalization_results,
            graph.recompute_input_convolution_results, graph.destination_image_allocator,
            hooks, hooks and hooks.program_settings(), graph.reuse_step,
            fast_paths.enabled())  # fmt: skip


class _Reads:
    """What a lowering read, to compare with at each later encode (see the module docstring).
    Taken before the lowering encode; `settle` takes the values the encode left."""

    __slots__ = ("configs", "kernels", "settings", "snapshots", "watched", "weights")

    def __init__(self, graph: Any) -> None:
        self.kernels = _kernels(graph)
        self.configs = tuple(getattr(k, "_config", None) for k in self.kernels)
        self.watched = [(o, _plain(o)) for o in _watched(graph)]
        self.snapshots = [dict(_state_of(o, plain)) for o, plain in self.watched]
        self.weights = _weights_signature(self.kernels)
        self.settings = _settings(graph)

    def same(self, graph: Any) -> bool:
        if _settings(graph) != self.settings:
            return False
        kernels, configs = self.kernels, self.configs
        for i in range(len(kernels)):
            if getattr(kernels[i], "_config", None) != configs[i]:
                return False
        return self._same_watched() and _weights_signature(kernels) == self.weights

    def settle(self, graph: Any) -> bool:
        """After the lowering encode: whether it left what it read as it found it (an
        attribute that was None may have been made: state an encode makes once, such as an
        optimizer's, and then reads as made). Takes the kernels' configurations as the encode
        left them (its padding policy may set properties)."""
        self.configs = tuple(getattr(k, "_config", None) for k in self.kernels)
        return (
            self._same_watched(lazy=True)
            and _weights_signature(self.kernels) == self.weights
            and [o for o, _ in self.watched] == _watched(graph)
        )

    def _same_watched(self, lazy: bool = False) -> bool:
        for (obj, plain), snap in zip(self.watched, self.snapshots, strict=True):
            try:
                # (`_state_of` inlined for the plain objects, nearly all: this runs for each
                # watched object at every step)
                now = vars(obj) if plain else _state_of(obj, plain)
                if now != snap:
                    if not lazy or now.keys() != snap.keys():
                        return False
                    for k, v in snap.items():
                        if v is not None and not (now[k] is v or now[k] == v):
                            return False
                    snap.update(now)  # what later encodes compare with
            except Exception:  # a value whose == is not a bool (a tensor replaced)
                return False
        return True


def _recordable(graph: Any) -> bool:
    """The node-level conditions: no allocator of the user's, and no user code an encode
    calls (another class's ``update`` or callback may do host work at every step)."""
    for node in graph._plan.order:
        if node.result_image.image_allocator is not None:
            return False
        policy = getattr(node, "padding_policy", None)  # a user's is called at every encode
        if policy is not None and not type(policy).__module__.startswith("mpsnn."):
            return False
        if getattr(node, "transform_provider", None) is not None:  # a scale node's, likewise
            return False
        if getattr(node, "property_call_back", None) is not None:  # asked at every encode
            return False
        ds = getattr(getattr(node, "inference_node", node), "data_source", None)
        if ds is not None and not type(ds).__module__.startswith("mpsnn."):
            return False
        opt = getattr(ds, "optimizer", None)
        if opt is not None and not type(opt).__module__.startswith("mpsnn."):
            return False
    return True


def _holds_tensor(obj: Any) -> bool:
    """Whether an attribute of ``obj`` (or a container in one) holds a tensor: a slot the
    encode left one in would carry one step's values into the next."""

    def has(values: Any) -> bool:
        for v in values:
            if isinstance(v, torch.Tensor):
                return True
            if isinstance(v, dict):
                v = list(v.values())
            if isinstance(v, list | tuple | set) and has(v):
                return True
        return False

    return has(_attrs(obj).values())


# -- the program -----------------------------------------------------------------------------


class StepProgram:
    """One graph step lowered for one input layout (see the module docstring)."""

    def __init__(self, key: tuple[Any, ...], reads: _Reads) -> None:
        self.key = key
        self.reads = reads
        self.inputs: list[Image] = []  # the input image slots
        self.labels: list[Any] = []  # the label slots (one per state source)
        self.label_outputs: list[list[tuple[str, Any]]] = []  # what the encode set on them
        self.commands: list[_Command] = []
        self.pending: list[Any] = []  # slots released before the first command
        self.hooks: list[Any] = []  # each slot's release once the work is enqueued
        self.images: list[TemporaryImage] = []  # the temporary image slots
        self.outputs: list[Image] = []  # output slots, handed to fresh images at each step
        self.descriptors: list[Any] = []  # theirs
        self.result: Any = None  # the result batch of the lowering (or None)
        self.exports: list[Any] = []  # the exported batches of the lowering (or None each)
        self.counters: list[Any] = []  # (optimizer, its encode) of each update counting a step
        self.report: Any = None
        self.uses = 0  # steps that ran it after the lowering (for tests and reports)

    def __repr__(self) -> str:
        return (
            f"<StepProgram {len(self.commands)} commands, {len(self.hooks)} slots, "
            f"{len(self.outputs)} outputs, {self.uses} uses>"
        )

    def encode(
        self, graph: Any, cb: CommandBuffer, images: list[ImageBatch], labels: list[Any]
    ) -> Any:
        """Encode one step of this program on ``cb`` for these inputs (checked by the
        caller: their key is this program's)."""
        counts = []
        for opt, enc in self.counters:  # Adam counts this step at encode, as a full encode
            opt._recount(enc)
            counts.append(enc.t)
        cmds = cb._commands
        cmds.append(_Command("Graph.bind", self._binder(images, labels, counts)))
        cmds.extend(self.commands)
        if self.pending:
            cb._pending_releases.extend(self.pending)
        cb._hooks.extend(self.hooks)
        self.uses += 1
        return self._finish(graph, cb, labels, {})

    def _finish(
        self, graph: Any, cb: CommandBuffer, labels: list[Any], users: dict[int, ImageBatch]
    ) -> Any:
        """The step's last work and the caller's outputs (lowering and later steps alike):
        the data-parallel hooks' host work of the step (`program_step`); fresh output images,
        which the encode's settings on the labels and the exported images name, filled by a
        last command that hands over the output slots' tensors; a hook that empties the
        slots. Returns the result batch (``users``: the caller's batch for an input slot's)."""
        parallel = graph.data_parallel
        if parallel is not None:  # after the program's commands, before the hand-over
            parallel.program_step(cb)
        fresh = {}
        for out, desc in zip(self.outputs, self.descriptors, strict=True):
            new = Image._make(out._device, desc)
            new._writer = cb
            fresh[id(out)] = new
        for slot_sets, user in zip(self.label_outputs, labels, strict=True):
            for name, value in slot_sets:
                setattr(user, name, fresh.get(id(value), value))
        cb._commands.append(
            _Command("Graph.outputs", self._hand_over([fresh[id(o)] for o in self.outputs]))
        )
        cb._on_enqueued(self._emptier())
        graph._intermediates = [_user_batch(_fresh_batch(e, fresh), users) for e in self.exports]
        return _user_batch(_fresh_batch(self.result, fresh), users)

    def _binder(self, images: list[ImageBatch], labels: list[Any], counts: list[int]) -> Any:
        slots, label_slots, counters = self.inputs, self.labels, self.counters
        temporaries = self.images
        users = [b._image for b in images]

        def bind() -> None:
            for image in temporaries:  # emptied by the last run: ready to be written again
                image._freed = False
            for slot, user in zip(slots, users, strict=True):
                slot._storage = user._data()
            for slot, user in zip(label_slots, labels, strict=True):
                slot._labels = user._labels
                slot._weights = user._weights
                slot._max_index = user._max_index
            for (_, enc), t in zip(counters, counts, strict=True):
                enc.t = t  # this step's count, whichever buffer runs first

        return bind

    def _hand_over(self, fresh: list[Image]) -> Any:
        outputs = self.outputs

        def hand_over() -> None:
            for slot, new in zip(outputs, fresh, strict=True):
                new._storage, slot._storage = slot._storage, None

        return hand_over

    def _emptier(self) -> Any:
        """A hook (it runs once the step's work is enqueued, after the slots' own releases,
        also after a failed command): the input slots let go of the caller's tensors."""
        inputs, label_slots = self.inputs, self.labels

        def empty() -> None:
            for slot in inputs:
                slot._storage = None
            for slot in label_slots:
                slot._labels = slot._weights = None

        return empty


def _user_batch(batch: Any, users: dict[int, ImageBatch]) -> Any:
    """The caller's own source batch for an input slot's batch (other batches as they are)."""
    return batch if batch is None else users.get(id(batch), batch)


def _fresh_batch(batch: Any, fresh: dict[int, Image]) -> Any:
    """The caller's batch for an output slot's batch."""
    if batch is None:
        return None
    new = fresh.get(id(batch._image))
    return batch if new is None else ImageBatch(new)


def lower(
    graph: Any, cb: CommandBuffer, key: tuple[Any, ...], images: list[ImageBatch],
    labels: list[list[Any]], encode: Any,
) -> Any:  # fmt: skip
    """Run ``encode(cb, input_slots, label_slots)`` (the ordinary encode) on slots bound to
    the caller's inputs, and keep what it recorded as the program of ``key`` when it
    qualifies; returns the encode's result (the caller's objects)."""
    p = StepProgram(key, _Reads(graph))
    inputs = []
    for b in images:
        user = b._image
        slot = Image._make(user._device, user.descriptor)
        slot._storage = user._storage  # as the encode sees the caller's image
        slot.label = user.label
        inputs.append(slot)
    label_slots = [copy.copy(states[0]) for states in labels]
    for s in label_slots:  # what a loss encode writes: set again by this one
        s._loss = None
        s._classes = None
    before = [dict(vars(s)) for s in label_slots]
    p.inputs, p.labels = inputs, label_slots
    start, hooks, pending = len(cb._commands), len(cb._hooks), len(cb._pending_releases)
    handlers, last = len(cb._handlers), cb._commands[-1] if cb._commands else None
    last_releases = len(last.releases or ()) if last is not None else 0
    input_batches = [ImageBatch(s) for s in inputs]
    with journal() as counters:
        out = encode(cb, input_batches, [[s] for s in label_slots])
    p.counters = counters
    users = {id(s): b for s, b in zip(input_batches, images, strict=True)}
    if len(cb._commands) == start:  # no work (a pass-through graph): nothing to bind or keep
        if graph.data_parallel is not None:  # the step is counted all the same
            graph.data_parallel.program_step(cb)
        graph._intermediates = [_user_batch(e, users) for e in graph._intermediates]
        return _user_batch(out, users)
    unchanged = p.reads.settle(graph)
    # what the encode set on the labels: the caller's labels get the same (fresh outputs)
    sets, outputs = [], []
    for slot, old in zip(label_slots, before, strict=True):
        changed = [(k, v) for k, v in vars(slot).items() if old.get(k, _UNSET) is not v]
        sets.append(changed)
        outputs += [v for _, v in changed if isinstance(v, Image)]
    if out is not None:
        outputs.append(out._image)
    p.exports = list(graph._intermediates)
    outputs += [e._image for e in p.exports if e is not None]
    outputs = list({id(o): o for o in outputs}.values())
    movable = [o for o in outputs if type(o) is Image and o._base is None and o._storage is None
               and all(o is not s for s in inputs)]  # fmt: skip
    p.label_outputs, p.outputs, p.result = sets, movable, out
    p.descriptors = [o.descriptor for o in movable]
    p.report = graph._last_plan_report
    p.commands = cb._commands[start:]
    p.hooks = cb._hooks[hooks:]
    p.pending = cb._pending_releases[pending:]
    slots = [getattr(h, "resource", None) for h in p.hooks]
    p.images = [s for s in slots if isinstance(s, TemporaryImage)]
    # the input slots are bound to the caller's inputs before the first command runs
    counts = [enc.t for _, enc in counters]
    binder = p._binder(images, [s[0] for s in labels], counts)
    cb._commands.insert(start, _Command("Graph.bind", binder))
    ok = (
        unchanged
        and len(movable) == len(outputs)
        and len(cb._handlers) == handlers
        and (last is None or len(last.releases or ()) == last_releases)
        and _recordable(graph)
        # every hook releases a slot, and no slot holds a tensor made at encode time
        and all(s is not None and not _holds_tensor(s) for s in slots)
    )
    result = p._finish(graph, cb, [s[0] for s in labels], users)
    if ok:
        graph._programs = [p, *graph._programs[: _KEPT - 1]]
        graph._lowering_refusals = 0
    else:
        graph._lowering_refusals += 1
    return result
