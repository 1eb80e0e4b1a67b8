"""The step template: a graph's eager encode, recorded once and re-armed for later steps.

Why: a training step of a small network is a few dozen commands, and encoding them (walking
the nodes, validating, planning, allocating the temporaries and states, writing the records)
costs as much host time as launching them. From one step to the next of the same batch shape
the encode produces the same commands on new objects of the same shapes.

What is recorded (`record`): one ordinary encode, run on *proxies* of the source images and
labels (objects of the same descriptors that the step binds to the caller's objects when it
runs), with the command buffer's new commands, the temporaries made for them (every temporary
image and state registers a release hook on its buffer: that list is the set) and a snapshot
of each temporary's attributes as the encode left them.

What a later encode does (`_Template.use`), when the graph, its kernels, nodes, data sources
and optimizers are as they were when the step was recorded and the inputs have the recorded
layout:

1. restore every temporary to its snapshot (live, its read count and records as the encode
   set them, no storage) on the new command buffer;
2. make fresh *output* images (the loss image of each labels object, the exported images,
   the result) for the caller, so that each step's outputs are new objects, as with an
   ordinary encode;
3. append a command that binds the proxies to the caller's images and labels, the recorded
   commands, and a command that moves the outputs' storage to the fresh images.

The values are those of an ordinary encode bit for bit: the same commands run on the same
kinds of objects in the same order (tested over several steps, models, optimizers and formats
against the graph with the template off).

When an encode does not use it (it runs the ordinary way, and records a template when it can):
the first encode; a graph with ``data_parallel`` hooks, result states, updates on the CPU, an
allocator of the user's (nodes, result), a scale node's transform provider (asked at every
encode), a data source or optimizer defined outside mpsnn (its
``update`` may do host work at every step); sources that are not whole permanent images, labels
that are not one permanent `LossLabels` per state source; a changed input layout, graph
setting, Triton switch, kernel configuration (any public assignment), or attribute of a node,
data source (and the weights state it holds), optimizer or optimizer descriptor (the learning
rate aside: it lives in device memory); and a template still in use by a command buffer not yet
committed (two steps encoded before either is committed record a second template).
``Graph.reuse_step = False`` turns it off.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from mpsnn.cnn.loss_labels import LossLabels
from mpsnn.core.device import CommandBuffer, CommandBufferStatus, _Command
from mpsnn.core.image import Image
from mpsnn.core.image_batch import ImageBatch
from mpsnn.core.state import State
from mpsnn.ops import triton as fast_paths
from mpsnn.optim.base import journal

__all__ = ["eligible", "find", "key_of", "record"]

_NOT_ENQUEUED = CommandBufferStatus.NOT_ENQUEUED
_UNSET: Any = object()
_CONTAINERS = (dict, list, set)
_REFUSALS = 3  # recordings in a row that could not be kept: stop recording (a plain encode)


def eligible(graph: Any) -> bool:
    """Whether the graph's settings let an encode use or record a template (cheap: at every
    encode; what the nodes hold is checked when recording, and then watched)."""
    return (
        graph.reuse_step is True
        and graph.data_parallel is None
        and not graph._plan.modes.cpu_updates
        and graph.destination_image_allocator is None
        and not graph._plan.modes.exported_states  # result states: made for the client per encode
        and graph._template_refusals < _REFUSALS
        # tensors an encode makes under inference mode cannot be updated outside it
        and not torch.is_inference_mode_enabled()
    )


def _recordable(graph: Any) -> bool:
    """The node-level conditions: no allocator of the user's, mpsnn's own data sources and
    optimizers (another's ``update`` may do host work at every step)."""
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


def _has_tensor(values: Any) -> bool:
    """Whether a tensor is among ``values`` or inside their containers, at any depth."""
    for v in values:
        if isinstance(v, torch.Tensor):
            return True
        if isinstance(v, dict):
            v = list(v.values())
        if isinstance(v, list | tuple | set) and _has_tensor(v):
            return True
    return False


class _Memento:
    """One temporary's attributes as the recording encode left them, to restore at each use
    (containers are copied at each restore: a command may fill them in place)."""

    __slots__ = ("containers", "dict_values", "obj", "on_buffer", "slot_values")

    def __init__(self, obj: Any, cb: CommandBuffer) -> None:
        self.obj = obj
        self.on_buffer: list[str] = []  # attributes holding the recording buffer
        self.containers: list[tuple[str, Any]] = []
        slots = []
        d = getattr(obj, "__dict__", None)
        dict_values = {} if d is not None else None
        for name, value in _attrs(obj).items():
            in_dict = d is not None and name in d
            if value is cb:
                self.on_buffer.append(name)
            elif isinstance(value, _CONTAINERS):
                self.containers.append((name, value.copy()))
            elif in_dict:
                dict_values[name] = value  # type: ignore[index]
            else:
                slots.append((name, value))
        self.slot_values = tuple(slots)
        self.dict_values = dict_values

    def holds_tensors(self) -> bool:
        """Whether the encode left a tensor in it (made at encode time and filled by a
        command, it would carry one step's values into the next)."""
        values = [v for _, v in self.slot_values] + list((self.dict_values or {}).values())
        return _has_tensor(values) or _has_tensor([c for _, c in self.containers])

    def restore(self, cb: CommandBuffer) -> None:
        obj = self.obj
        setter = object.__setattr__
        for name, value in self.slot_values:
            if value is _UNSET:
                if hasattr(obj, name):
                    object.__delattr__(obj, name)
            else:
                setter(obj, name, value)
        if self.dict_values is not None:
            d = obj.__dict__
            d.clear()
            d.update(self.dict_values)
        for name in self.on_buffer:
            setter(obj, name, cb)
        for name, value in self.containers:
            setter(obj, name, value.copy())


def _signature(image: Image) -> tuple[Any, ...] | None:
    """What an encode may have read of a source image (None: not one a template binds)."""
    if type(image) is not Image or image._base is not None:
        return None
    t = image._storage
    tensor = None if t is None else (t.dtype, t.device, t.stride(), t.storage_offset())
    return (image._device, image._fmt, image._shape, tensor)


# attributes an encode does not read: the learning rate lives in device memory (the host
# value mirrors it), so a schedule that sets it at every step keeps the template; Adam's
# ``time_step`` is counted again at each use (the work runs with its use's count)
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
    """What `_Template.matches` compares of a watched object: its attributes, but a kernel's
    configuration number (an optimizer is a kernel: its public assignments, the learning rate
    included, show in its attributes anyway) and the attributes an encode does not read."""
    if plain:
        return vars(obj)
    return {k: v for k, v in _attrs(obj).items() if k not in _NOT_READ and k != "_config"}


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


def _kernels(graph: Any) -> list[Any]:
    out = []
    for k in graph._plan.kernels.values():
        out.extend(k if isinstance(k, tuple) else (k,))
    return out


class _Template:
    """One recorded step (see the module docstring)."""

    def __init__(self, graph: Any, key: tuple[Any, ...]) -> None:
        self.key = key
        self.kernels = _kernels(graph)
        self.configs = tuple(getattr(k, "_config", None) for k in self.kernels)
        self.watched = [(o, _plain(o)) for o in _watched(graph)]
        self.snapshots = [dict(_state_of(o, plain)) for o, plain in self.watched]
        self.weights = _weights_signature(self.kernels)
        self.graph_settings = _settings(graph)
        self.sources: list[Image] = []  # the proxies
        self.labels: list[Any] = []  # the label proxies (one per state source)
        self.label_sets: list[list[tuple[str, Any]]] = []  # attributes an encode sets on them
        self.commands: list[_Command] = []
        self.hooks: list[Any] = []
        self.pending: list[Any] = []
        self.mementos: list[_Memento] = []
        self.outputs: list[Image] = []  # recorded permanent images the caller receives
        self.descriptors: list[Any] = []  # theirs
        self.result: Any = None  # the recorded result batch (or None)
        self.exports: list[Any] = []  # the recorded exported batches (or None each)
        self.report: Any = None
        self.last_cb: CommandBuffer | None = None
        self.encodes: list[Any] = []  # (optimizer, its encode) of each update counting a step
        self.uses = 0  # encodes that re-armed it (for tests and reports)

    # -- checks at each use ------------------------------------------------------------------

    def busy(self) -> bool:
        cb = self.last_cb
        return cb is not None and cb._status is _NOT_ENQUEUED

    def matches(self, graph: Any) -> bool:
        if _settings(graph) != self.graph_settings:
            return False
        kernels = self.kernels
        configs = self.configs
        for i in range(len(kernels)):
            if getattr(kernels[i], "_config", None) != configs[i]:
                return False
        return self._same_reads() and _weights_signature(kernels) == self.weights

    def _same_reads(self, lazy: bool = False) -> bool:
        """The watched objects' attributes equal the snapshots (``lazy``: an attribute that
        was None may have been made since: state an encode makes once, e.g. an optimizer's,
        and then reads as made)."""
        for (obj, plain), snap in zip(self.watched, self.snapshots, strict=True):
            try:
                now = _state_of(obj, plain)
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

    # -- one use ------------------------------------------------------------------------------

    def use(
        self, graph: Any, cb: CommandBuffer, images: list[ImageBatch], labels: list[Any]
    ) -> Any:
        """Encode the recorded step on ``cb`` for these inputs (checked by the caller)."""
        for m in self.mementos:
            m.restore(cb)
        for opt, encode in self.encodes:  # Adam counts this step at encode, as when recorded
            opt._recount(encode)
        cmds = cb._commands
        cmds.append(_Command("Graph.bind", self._binder(images, labels)))
        cmds.extend(self.commands)
        if self.pending:
            cb._pending_releases.extend(self.pending)
        cb._hooks.extend(self.hooks)
        self.uses += 1
        return self._finish(graph, cb, labels, {})

    def _finish(
        self, graph: Any, cb: CommandBuffer, labels: list[Any], users: dict[int, ImageBatch]
    ) -> Any:
        """The step's last work and the caller's outputs (recording and re-arming alike):
        fresh output images, which the encode's settings on the labels and the exported
        images name, filled by a last command that moves the recorded outputs' storage; a hook
        that unbinds the proxies. Returns the result batch (``users``: the caller's batch for
        a proxy's)."""
        fresh = {}
        for out, desc in zip(self.outputs, self.descriptors, strict=True):
            new = Image._make(out._device, desc)
            new._writer = cb
            fresh[id(out)] = new
        for proxy_sets, user in zip(self.label_sets, labels, strict=True):
            for name, value in proxy_sets:
                setattr(user, name, fresh.get(id(value), value))
        cb._commands.append(
            _Command("Graph.outputs", self._mover([fresh[id(o)] for o in self.outputs]))
        )
        cb._on_enqueued(self._unbinder())
        self.last_cb = cb
        graph._intermediates = [_user_batch(_fresh_batch(e, fresh), users) for e in self.exports]
        return _user_batch(_fresh_batch(self.result, fresh), users)

    def _binder(self, images: list[ImageBatch], labels: list[Any]) -> Any:
        proxies, label_proxies = self.sources, self.labels
        users = [b._image for b in images]

        def bind() -> None:
            for proxy, user in zip(proxies, users, strict=True):
                proxy._storage = user._data()
            for proxy, user in zip(label_proxies, labels, strict=True):
                proxy._labels = user._labels
                proxy._weights = user._weights
                proxy._max_index = user._max_index

        return bind

    def _mover(self, fresh: list[Image]) -> Any:
        recorded = self.outputs

        def move() -> None:
            for old, new in zip(recorded, fresh, strict=True):
                new._storage, old._storage = old._storage, None

        return move

    def _unbinder(self) -> Any:
        """A hook (it runs once the step's work is enqueued, also after a failed command):
        the proxies let go of the caller's tensors."""
        proxies, label_proxies = self.sources, self.labels

        def unbind() -> None:
            for proxy in proxies:
                proxy._storage = None
            for proxy in label_proxies:
                proxy._labels = proxy._weights = None

        return unbind


def _user_batch(batch: Any, users: dict[int, ImageBatch]) -> Any:
    """The caller's own source batch for a proxy's batch (other batches as they are)."""
    return batch if batch is None else users.get(id(batch), batch)


def _fresh_batch(batch: Any, fresh: dict[int, Image]) -> Any:
    """The caller's batch for a recorded output batch."""
    if batch is None:
        return None
    new = fresh.get(id(batch._image))
    return batch if new is None else ImageBatch(new)


def _settings(graph: Any) -> tuple[Any, ...]:
    """The graph's settings an encode reads, and the process-wide Triton switch."""
    return (graph.format, graph.recompute_normalization_results, graph.destination_image_allocator,
            graph.data_parallel, graph.reuse_step, fast_paths.enabled())  # fmt: skip


def key_of(images: list[ImageBatch], labels: list[list[Any]]) -> tuple[Any, ...] | None:
    """The inputs' part of a template's key (None: inputs a template does not bind)."""
    parts: list[Any] = []
    for b in images:
        sig = _signature(b._image)
        if sig is None:
            return None
        parts.append(sig)
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


def find(graph: Any, key: tuple[Any, ...], labels: list[list[Any]]) -> _Template | None:
    """A recorded template that this encode may use, or None."""
    for t in graph._templates:
        if t.key == key and not t.busy() and t.matches(graph):
            for proxy, states in zip(t.labels, labels, strict=True):
                classes = proxy._classes
                if classes is not None and states[0]._max_index >= classes:
                    return None  # the loss kernel's own check raises on the ordinary path
            return t
    return None


def record(
    graph: Any, cb: CommandBuffer, key: tuple[Any, ...], images: list[ImageBatch],
    labels: list[list[Any]], encode: Any,
) -> Any:  # fmt: skip
    """Run ``encode(cb, proxy_images, proxy_labels)`` (the ordinary encode) on proxies of the
    inputs and keep it as a template when it qualifies; returns the encode's result."""
    t = _Template(graph, key)
    proxies = []
    for b in images:
        user = b._image
        proxy = Image._make(user._device, user.descriptor)
        proxy._storage = user._storage  # as the encode saw the caller's image
        proxy.label = user.label
        proxies.append(proxy)
    label_proxies = [copy.copy(states[0]) for states in labels]
    for p in label_proxies:  # what a loss encode writes: set again by this one
        p._loss = None
        p._classes = None
    before = [dict(vars(p)) for p in label_proxies]
    t.sources, t.labels = proxies, label_proxies
    start, hooks, pending = len(cb._commands), len(cb._hooks), len(cb._pending_releases)
    handlers, last = len(cb._handlers), cb._commands[-1] if cb._commands else None
    last_releases = len(last.releases or ()) if last is not None else 0
    proxy_batches = [ImageBatch(p) for p in proxies]
    with journal() as encodes:
        out = encode(cb, proxy_batches, [[p] for p in label_proxies])
    t.encodes = encodes
    users = {id(p): b for p, b in zip(proxy_batches, images, strict=True)}
    if len(cb._commands) == start:  # no work (a pass-through graph): nothing to bind or keep
        graph._intermediates = [_user_batch(e, users) for e in graph._intermediates]
        return _user_batch(out, users)
    # the proxies are bound to the caller's inputs before the first command runs
    binder = _Command("Graph.bind", t._binder(images, [s[0] for s in labels]))
    cb._commands.insert(start, binder)
    t.configs = tuple(getattr(k, "_config", None) for k in t.kernels)  # as the encode left them
    # an encode that changed what it reads (a lazily made optimizer state, a data source moved
    # to the device, a kernel reloaded with biases it did not have) made commands for the old
    # values: such a recording is not kept (the next one is)
    unchanged = (
        t._same_reads(lazy=True)
        and _weights_signature(t.kernels) == t.weights
        and [o for o, _ in t.watched] == _watched(graph)
    )
    # what the encode set on the labels: the caller's labels get the same (fresh outputs)
    sets, outputs = [], []
    for proxy, old in zip(label_proxies, before, strict=True):
        changed = [(k, v) for k, v in vars(proxy).items() if old.get(k, _UNSET) is not v]
        sets.append(changed)
        outputs += [v for _, v in changed if isinstance(v, Image)]
    if out is not None:
        outputs.append(out._image)
    t.exports = list(graph._intermediates)
    outputs += [e._image for e in t.exports if e is not None]
    outputs = list({id(o): o for o in outputs}.values())
    movable = [o for o in outputs if type(o) is Image and o._base is None and o._storage is None
               and all(o is not p for p in proxies)]  # fmt: skip
    ok = len(movable) == len(outputs) and len(cb._handlers) == handlers and _recordable(graph)
    ok = ok and unchanged
    ok = ok and (last is None or len(last.releases or ()) == last_releases)
    t.label_sets, t.outputs, t.result = sets, movable, out
    t.descriptors = [o.descriptor for o in movable]
    t.report = graph._last_plan_report
    t.commands = cb._commands[start + 1 :]
    t.hooks = cb._hooks[hooks:]
    t.pending = cb._pending_releases[pending:]
    made = [getattr(h, "resource", None) for h in t.hooks]
    t.mementos = [_Memento(o, cb) for o in made if o is not None]
    ok = ok and len(made) == len(t.mementos) and not any(m.holds_tensors() for m in t.mementos)
    result = t._finish(graph, cb, [s[0] for s in labels], users)
    if ok:
        graph._templates = [t, *graph._templates[:1]]  # the newest two
        graph._template_refusals = 0
    else:
        graph._template_refusals += 1
    return result
