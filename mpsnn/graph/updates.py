"""The trainable layers' updates inside one ``encode_batch`` of a training graph.

After every gradient node ran (so every layer's gradient state holds the whole batch's sums,
and every data gradient used the pre-update weights), each trainable layer is updated once:

* ``TrainingStyle.UPDATE_ON_GPU`` (the default): the data source's ``update`` is encoded on
  the command buffer and the state it returns is reloaded into the layer's kernel. Layers whose
  data sources are mpsnn's ``Tensor*DataSource`` s sharing one optimizer are updated together:
  one optimizer update (one multi-tensor launch on the GPU, one time step for Adam) per step;
* ``TrainingStyle.UPDATE_ON_CPU``: after completion, the data source's ``update_on_cpu`` runs
  and the kernel reloads from the data source (mpsnn's data sources sharing one optimizer are
  again updated together: CPU and GPU styles give the same weights).

Batch normalization also updates its running statistics (``update_mean_and_variance``; the
layers whose data sources are mpsnn's ``TensorBatchNormalizationDataSource`` s as one command,
one launch on the GPU). The graph owns the gradient states and drops its own reads of them
after the updates: a state no one else reads is released; reads a data source added inside its
update (to read the state after completion, as MPS clients do) keep it alive until the data
source sets ``read_count`` back to 0.
"""

from __future__ import annotations

from typing import Any

from mpsnn.core.state import State, StateBatch

__all__ = ["encode_updates"]


def encode_updates(graph: Any, step: Any) -> None:
    from mpsnn.cnn.convolution.kernels import reload_weights_and_biases
    from mpsnn.cnn.normalization.batch_norm_forward import reload_normalization_states
    from mpsnn.cnn.normalization.data_sources import update_means_and_variances

    cb = step.cb
    # the graph's own reads of the temporary states the updates get: a data source may add
    # reads of its own (to read a state after completion), which the graph leaves to it
    held = _held_states(graph, step)
    groups: dict[int, tuple[Any, list[Any]]] = {}  # optimizer -> [(ds, lists), ...]
    reloads: list[tuple[Any, Any]] = []
    running_reloads: list[tuple[Any, Any]] = []  # (batch normalization, its running statistics)
    running: list[tuple[Any, Any, Any]] = []  # (data source, state, batch normalization)
    cpu: list[tuple[Any, Any, Any]] = []
    late: set[int] = set()  # temporary states read by a CPU-style fallback after completion
    for gnode, fkernel, states in step.updates:
        fnode = gnode.inference_node
        ds = fnode.data_source
        state = StateBatch(states).unique()[0]
        if fnode.updates_from_image_states:  # instance and group: one state per image,
            state = StateBatch(states)  # the data source sums the batch of them
        if fnode._id in graph._plan.modes.cpu_updates:
            cpu.append((fnode, fkernel, state))
            continue
        if fnode.updates_running_statistics:
            bn = fkernel[1]
            _gamma_beta(step, ds, bn, state, groups)
            if getattr(ds, "_own_running_updates", False):
                running.append((ds, state, bn))  # every layer's in one command, below
            else:
                _reload_running(cb, bn, ds.update_mean_and_variance(cb, state), running_reloads)
            continue
        if hasattr(fkernel, "reload_weights_and_biases"):  # the convolution family
            if _grouped(ds):
                lists = ds._update_lists(state, None)
                groups.setdefault(id(ds.optimizer), (ds.optimizer, []))[1].append(lists)
                reloads.append((fkernel, ds))
                continue
            new = ds.update(cb, state, fkernel.export_weights_and_biases(cb, True))
            if new is not None:
                fkernel.reload_weights_and_biases(cb, new)
            else:  # no GPU-style update: update_on_cpu reads the state after completion
                cpu.append((fnode, fkernel, state))
                late.add(id(state))
            continue
        _gamma_beta(step, ds, fkernel, state, groups)  # instance and group normalization
    if running:
        mvs = update_means_and_variances(cb, [(ds, state) for ds, state, _ in running])
        for (_, _, bn), mv in zip(running, mvs, strict=True):
            _reload_running(cb, bn, mv, running_reloads)
    _update_groups(cb, groups)
    reload_weights_and_biases(cb, [(kernel, ds.state) for kernel, ds in reloads])
    # every normalization layer's reloads (gamma/beta after the update, running statistics):
    # one command, one multi-tensor copy
    gamma_beta = []
    for kernel, ds in step.gamma_beta_reloads:
        if _own_reload(kernel, "reload_gamma_and_beta"):
            gamma_beta.append((kernel, ds._gb))
        else:
            kernel.reload_gamma_and_beta(cb, ds._gb)
    reload_normalization_states(cb, running_reloads + gamma_beta)
    after = [(st, own) for st, own in held if id(st) in late]
    _keep_past_enqueue(cb, [st for st, _ in after])  # the handler releases them
    if cpu:
        cb.add_completed_handler(_cpu_updates(cpu, after))
    _release(cb, [(st, own) for st, own in held if id(st) not in late])


def _reload_running(cb: Any, bn: Any, mv: Any, running_reloads: list[tuple[Any, Any]]) -> None:
    """Reload ``bn``'s running statistics from ``mv`` (None: its data source keeps none)."""
    from mpsnn.cnn.normalization.batch_norm_forward import check_normalization_reloads

    if mv is not None and _own_reload(bn, "reload_mean_and_variance"):
        # reloaded with the others at the end (nothing reads it before); checked now, so that
        # a bad state raises before the optimizers' updates are encoded
        check_normalization_reloads(cb, [(bn, mv)])
        running_reloads.append((bn, mv))
    elif mv is not None:
        bn.reload_mean_and_variance(cb, mv)


def _own_reload(kernel: Any, method: str) -> bool:
    """Whether ``kernel``'s ``method`` is mpsnn's own (one grouped reload does its work); a
    subclass that overrides it gets it called."""
    from mpsnn.cnn.normalization.batch_norm_forward import AffineChannels, BatchNormalization

    for base in (BatchNormalization, AffineChannels):
        if hasattr(base, method):
            return getattr(type(kernel), method, None) is getattr(base, method)
    return False


def _held_states(graph: Any, step: Any) -> list[tuple[State, int]]:
    """The distinct temporary states the updates read (a `StateBatch` repeating one state
    counts it once), with their read counts before the updates: all the graph's."""
    held: dict[int, tuple[State, int]] = {}
    results = {id(st) for batch in step.result_states for st in batch}  # the client's
    for gnode, _, states in step.updates:
        if gnode.inference_node._id in graph._plan.modes.cpu_updates:
            continue  # permanent states
        for st in StateBatch(states).unique():
            if (
                isinstance(st, State)
                and st.is_temporary
                and st._released_by is None
                and id(st) not in results
            ):
                held.setdefault(id(st), (st, st._read_count))
    return list(held.values())


def _release(cb: Any, held: list[tuple[State, int]]) -> None:
    """Drop the graph's own reads of the update states: a state nobody else reads is released
    (freed after the last command that reads it); one whose data source raised its read count
    keeps those reads, outlives the command buffer, and is released when the data source sets
    its count back to 0."""
    kept = []
    for st, own in held:
        if st._released_by is not None:
            continue
        extra = st._read_count - own
        if extra <= 0:
            st.read_count = 0
            continue
        st._read_count = extra
        kept.append(st)
    _keep_past_enqueue(cb, kept)


def _keep_past_enqueue(cb: Any, states: list[State]) -> None:
    """Drop the hooks that would free ``states`` once the buffer's work is enqueued (one pass
    over the hooks for all of them): they outlive the buffer's work."""
    if states:
        ids = {id(st) for st in states}
        cb._hooks[:] = [h for h in cb._hooks if id(getattr(h, "resource", None)) not in ids]


def _grouped(ds: Any) -> bool:
    """Whether the graph runs ``ds``'s optimizer itself, with the other layers sharing it:
    mpsnn's `TensorConvolutionDataSource` with an optimizer and its own updates (a subclass
    that overrides ``update`` / ``update_on_cpu`` gets them called)."""
    from mpsnn.cnn.convolution import TensorConvolutionDataSource

    return (
        isinstance(ds, TensorConvolutionDataSource) and ds.optimizer is not None and ds._own_updates
    )


def _update_groups(cb: Any, groups: dict[int, tuple[Any, list[Any]]]) -> None:
    """One optimizer update per optimizer for all its layers (``cb`` None: now)."""
    for optimizer, members in groups.values():
        values, results, grads, states = [], [], [], None
        for v, g, r, s in members:
            values += v
            results += r
            grads.append(g)
            if states is None:
                states = [list(x) for x in s]
            else:
                states = [a + list(b) for a, b in zip(states, s, strict=True)]

        def all_grads(parts: list[Any] = grads) -> list[Any]:
            return [t for part in parts for t in part()]

        optimizer._update(cb, values, all_grads, results, states or [])


def _gamma_beta(step: Any, ds: Any, kernel: Any, state: Any, groups: dict) -> None:
    """A normalization layer's gamma/beta: grouped with its optimizer for mpsnn's data
    sources, else through the data source's GPU update."""
    from mpsnn.cnn.normalization.data_sources import _TensorGammaBeta

    if isinstance(ds, _TensorGammaBeta) and ds.optimizer is not None:
        lists = ds._affine_lists(state)
        groups.setdefault(id(ds.optimizer), (ds.optimizer, []))[1].append(lists)
        step.gamma_beta_reloads.append((kernel, ds))
        return
    new = ds.update_gamma_and_beta(step.cb, state)
    if new is not None:
        kernel.reload_gamma_and_beta(step.cb, new)


def _cpu_updates(
    layers: list[tuple[Any, Any, Any]], after: list[tuple[State, int]] | None = None
) -> Any:
    """The completed handler of the CPU-style layers: update, then reload the kernels; then
    drop the graph's reads of the temporary states ``after`` (the layers whose GPU-style
    ``update`` returned None), which it kept for these updates."""

    from mpsnn.cnn.normalization.data_sources import _TensorGammaBeta

    def handler(_cb: Any) -> None:
        # mpsnn's data sources sharing an optimizer are updated together, as on the GPU path:
        # one update per optimizer (one Adam time step per step, not one per layer)
        groups: dict[int, tuple[Any, list[Any]]] = {}
        reloads: list[Any] = []
        for fnode, kernel, state in layers:
            ds = fnode.data_source
            last = (kernel if isinstance(kernel, tuple) else (kernel,))[-1]
            if hasattr(ds, "update_on_cpu"):
                if _grouped(ds):
                    lists = ds._update_lists(state, None)
                    groups.setdefault(id(ds.optimizer), (ds.optimizer, []))[1].append(lists)
                    reloads.append(last.reload_weights_and_biases_from_data_source)
                elif ds.update_on_cpu(state, None):
                    last.reload_weights_and_biases_from_data_source()
                continue
            if isinstance(ds, _TensorGammaBeta) and ds.optimizer is not None:
                lists = ds._affine_lists(state)
                groups.setdefault(id(ds.optimizer), (ds.optimizer, []))[1].append(lists)
                reloads.append(last.reload_gamma_and_beta_from_data_source)
            elif ds.update_gamma_and_beta_on_cpu(state):
                last.reload_gamma_and_beta_from_data_source()
            running = getattr(ds, "update_mean_and_variance_on_cpu", None)
            if running is not None and running(state):
                last.reload_mean_and_variance_from_data_source()
        _update_groups(None, groups)
        for reload in reloads:
            reload()
        if after:
            _release(_cb, after)

    return handler
