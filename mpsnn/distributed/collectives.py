"""The collectives of one data-parallel training step (`mpsnn.DataParallel`'s hooks): what
each hook records on the step's command buffer, the gradient buckets, and the helpers that
move the sums in and out of the states. The math and the order of the collectives are in
`mpsnn.distributed.data_parallel`'s docstring; this module sits below it and knows the
`DataParallel` only through the methods it calls (``_all_gather``, ``_all_reduce``,
``_all_reduce_each``, ``_coalesces``, ``_collective``, ``_count_step``, ``_sum_now``)."""

from __future__ import annotations

import math
from typing import Any

import torch

from mpsnn.cnn.normalization.batch_norm_state import BatchNormalizationState
from mpsnn.core.layout import channels_last_only, nhwc_view
from mpsnn.core.state import AccumulatorState, StateBatch
from mpsnn.ops.batch_norm import bn_merge_all, bn_merge_rows, bn_variance

__all__: list[str] = []


class _Bucket:
    """Gradient states whose sums are all-reduced together (one collective per dtype)."""

    def __init__(self, index: int) -> None:
        self.index = index
        # (state, slot summed, further per-image states folded into it before the exchange)
        self.states: list[tuple[AccumulatorState, int, list[AccumulatorState]]] = []
        self.labels: list[str] = []
        self.nbytes = 0
        # (the collective to wait for, its flat tensor to copy back or None: in place, sums)
        self.pending: list[tuple[Any, torch.Tensor | None, list[torch.Tensor]]] = []


class _StepCollectives:
    """The hooks of one step (`StepCollectives`): records the collectives on the step's
    command buffer (see `mpsnn.distributed.data_parallel`'s docstring)."""

    def __init__(self, dp: Any, step: Any) -> None:  # dp: a DataParallel
        self.dp = dp
        self.step = step
        self.cb = step.cb
        self.single = dp.world_size == 1
        self.buckets: list[_Bucket] = []
        self.open = _Bucket(0)
        self.statistics: list[Any] = []  # local batch norms: their statistics states
        # a convolution's weight gradient on the side stream overlaps the all-reduce of the
        # next normalization's gradient sums (measured: faster with synchronized statistics
        # on two GPUs, slower on one GPU, where nothing waits)
        self.weights_beside = not self.single and dp.sync_batch_norm

    # -- batch normalization -----------------------------------------------------------------

    def batch_norm_statistics(self, node: Any, state: Any) -> None:
        if self.single:
            return
        dp, what = self.dp, f"the batch-norm statistics of {_name(node)}"

        def combine() -> None:
            sums = state._slots[0]  # [count, mean, m2] of this rank's images
            packed = _adjacent(sums)  # the statistics kernel's one buffer: no copy
            if packed is None:
                count, mean, m2 = sums
                packed = torch.cat([count.reshape(-1).to(mean.dtype), mean.reshape(-1),
                                    m2.reshape(-1)])  # fmt: skip
            rows = dp._all_gather(what, packed)
            # the sums changed: their variance, in the same work (into its storage)
            var = state._var
            if var is not None and var.is_inference() and not torch.is_inference_mode_enabled():
                var = None  # replaced by _write_variance instead (PyTorch forbids the write)
            state._write_variance(bn_merge_rows(rows, sums, var))

        if not self.dp.sync_batch_norm:  # merged after the backward (`_merge_statistics`)
            self.statistics.append(state)
            return
        self.cb.record(f"all-gather {what}", combine)

    def batch_norm_gradient_sums(self, node: Any, state: Any) -> None:
        if self.single or not self.dp.sync_batch_norm:
            return  # local statistics: the sums join a weight-gradient bucket
        dp, what = self.dp, f"the all-reduce of the batch-norm gradient sums of {_name(node)}"

        def reduce() -> None:
            sums = state._slots[1]  # [Σgy·xhat, Σgy]
            whole = _adjacent(sums, ordered=False)  # the gradient sums' one buffer
            flat = whole if whole is not None else torch.cat([t.reshape(-1) for t in sums])
            dp._sum_now(what, flat)  # in place when it is the sums' own memory
            if whole is None:
                _copy_back(sums, flat)

        self.cb._record_beside(what, reduce)  # a convolution's weight gradient may overlap it

    # -- weight gradients ------------------------------------------------------------------

    def weight_gradient_ready(self, node: Any, kernel: Any, states: Any) -> None:
        if self.single:
            return
        unique = StateBatch(states if isinstance(states, list) else [states]).unique()
        state, extras = unique[0], list(unique[1:])
        slot = 0
        if isinstance(state, BatchNormalizationState):
            if self.dp.sync_batch_norm:
                return  # its sums were all-reduced before its input gradient
            slot = 1  # local statistics: [Σgy·xhat, Σgy] summed for the gamma/beta update
        elif not isinstance(state, AccumulatorState):
            return
        bucket = self.open
        bucket.states.append((state, slot, extras))
        bucket.labels.append(_name(node))
        bucket.nbytes += _gradient_bytes(state, kernel)
        if bucket.nbytes >= self.dp.bucket_bytes:
            self._launch()

    def _launch(self) -> None:
        bucket = self.open
        self.buckets.append(bucket)
        self.open = _Bucket(bucket.index + 1)
        dp, what = self.dp, f"the gradient all-reduce of bucket {bucket.index}"

        def launch() -> None:
            bucket.pending = []  # what a failed step left
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for st, slot, extras in bucket.states:
                if extras:  # per-image states (instance/group normalization): one exchange
                    _fold(st, extras, slot)
                for t in _sums(st, slot):
                    by_dtype.setdefault(t.dtype, []).append(_dense_view(t))
            for tensors in by_dtype.values():
                if dp._coalesces(tensors):  # in place: no flat copy and back
                    bucket.pending.append((dp._all_reduce_each(what, tensors), None, tensors))
                    continue
                flat = torch.cat([t.reshape(-1) for t in tensors])
                bucket.pending.append((dp._all_reduce(what, flat), flat, tensors))

        layers = ", ".join(bucket.labels)
        self.cb.record(f"launch {what} ({layers})", launch)

    def before_updates(self) -> None:
        if self.single:
            return
        if self.open.states:
            self._launch()
        self._merge_statistics()
        if not self.buckets:
            return
        buckets, dp = self.buckets, self.dp

        def wait() -> None:
            for bucket in buckets:
                what = f"the gradient all-reduce of bucket {bucket.index}"
                for work, flat, tensors in bucket.pending:
                    dp._collective(what, work.wait)
                    if flat is not None:
                        _copy_back(tensors, flat)
                bucket.pending = []

        self.cb.record(f"wait for the gradient all-reduces ({len(buckets)} buckets)", wait)

    def _merge_statistics(self) -> None:
        """Local batch normalization: every layer's (count, mean, m2) of this rank, gathered
        in one all-gather after the backward and merged into the whole batch's, which the
        running statistics' updates then read (identical on every rank)."""
        states = self.statistics
        if not states:
            return
        dp, what = self.dp, f"the all-gather of {len(states)} batch-norm statistics"

        def merge() -> None:
            triples = [st._slots[0] for st in states]
            sizes = [t[1].numel() for t in triples]
            counts = [
                t[0].to(t[1].dtype).reshape(-1).expand(c)
                for t, c in zip(triples, sizes, strict=True)
            ]
            means = [t[1].reshape(-1) for t in triples]
            m2s = [t[2].reshape(-1) for t in triples]
            packed = torch.cat(counts + means + m2s)
            rows = dp._all_gather(what, packed)
            total = sum(sizes)
            n, mean, m2 = bn_merge_all(rows[:, :total], rows[:, total : 2 * total],
                                       rows[:, 2 * total :])  # fmt: skip
            # the sums change, and with them their variances (`bn_variance`, the same formula
            # per channel): every layer's at once, written by the same copy where a layer's
            # variance storage can take it
            var = bn_variance(n, m2)
            dst: list[torch.Tensor] = []
            src: list[torch.Tensor] = []
            unwritten = []
            for st, (count, mu, q), ns, ms, qs, vs in zip(
                states, triples, n.split(sizes), mean.split(sizes), m2.split(sizes),
                var.split(sizes), strict=True,
            ):  # fmt: skip
                dst += [count, mu, q]
                src += [ns[: count.numel()].view_as(count), ms.view_as(mu), qs.view_as(q)]
                if _writable_like(st._var, vs):
                    dst.append(st._var)
                    src.append(vs.view_as(st._var))
                else:
                    unwritten.append(st)
            torch._foreach_copy_(dst, src)
            for st in unwritten:  # no storage yet (the first step), or another dtype or shape
                st._write_variance()

        self.cb.record(f"merge {what}", merge)

    # -- the weight check ---------------------------------------------------------------------

    def after_updates(self) -> None:
        dp = self.dp
        if not self.single and dp.check_every:
            dp._named = _weights(self.step)  # master tensors: the same at every step
        if not self.step.lowering:  # a lowered step is counted by `program_step`
            dp._count_step(self.cb)


# -- helpers --------------------------------------------------------------------------------


def _dense_view(t: torch.Tensor) -> torch.Tensor:
    """``t``, or for a channels-last sum (a CPU float32 convolution's weight gradient) its
    contiguous NHWC view: a sum over the ranks is element-wise, so the bucket's collective may
    read and write it in that order, in place (every rank lays its sums out alike)."""
    return nhwc_view(t) if channels_last_only(t) else t


def _writable_like(var: torch.Tensor | None, new: torch.Tensor) -> bool:
    """Whether ``new`` may be copied into the variance storage ``var`` as it is (what
    `BatchNormalizationState._write_variance` would do with it)."""
    return (
        var is not None
        and var.dtype == new.dtype
        and var.numel() == new.numel()
        and not (var.is_inference() and not torch.is_inference_mode_enabled())
    )


def _name(node: Any) -> str:
    forward = getattr(node, "inference_node", None) or node
    label = getattr(forward, "label", None)
    return repr(label) if label else f"{type(forward).__name__} #{getattr(forward, '_id', '?')}"


def _sums(state: AccumulatorState, slot: int = 0) -> list[torch.Tensor]:
    """The state's gradient sums (``slot``), zeros when no gradient ran into it."""
    if state._slots.get(slot) is None:
        state._sum(0, slot)  # a convolution state makes its zeros; others must have run
    return state._slots[slot]


def _fold(state: AccumulatorState, extras: list[AccumulatorState], slot: int) -> None:
    """Add the sums of ``extras`` (the batch's other per-image states) into ``state``'s and
    zero theirs, on the device: the all-reduce then moves one layer's sums, not one per image,
    and the data source's update, which sums the batch of states, still sees the total."""
    into = _sums(state, slot)
    for other in extras:
        sums = _sums(other, slot)
        torch._foreach_add_(into, sums)
        torch._foreach_zero_(sums)


def _gradient_bytes(state: Any, kernel: Any) -> int:
    """The bucket plan's estimate of a layer's float32 gradient bytes (the same on every rank;
    a skipped bias sum still counts)."""
    shape = getattr(state, "_oihw", None)
    if shape is not None:
        return 4 * (math.prod(shape) + shape[0])
    k = kernel[-1] if isinstance(kernel, tuple) else kernel
    return 8 * int(getattr(k, "number_of_feature_channels", 0) or 0)


def _adjacent(tensors: list[torch.Tensor], ordered: bool = True) -> torch.Tensor | None:
    """One flat view of the memory of ``tensors`` when they are contiguous pieces of one
    storage, of one dtype, that follow each other with no gap (``ordered``: in list order; else
    in any order); else None. The statistics and gradient-sum kernels of batch normalization
    write a layer's vectors into one buffer: a collective can run on it in place."""
    first = tensors[0]
    base = first.untyped_storage().data_ptr()
    for t in tensors:
        if (
            t.dtype != first.dtype
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != base
        ):
            return None
    pieces = tensors if ordered else sorted(tensors, key=lambda t: t.storage_offset())
    offset = pieces[0].storage_offset()
    end = offset
    for t in pieces:
        if t.storage_offset() != end:
            return None
        end += t.numel()
    return pieces[0].as_strided((end - offset,), (1,), offset)


def _copy_back(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    views = [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in tensors]), tensors,
                                          strict=True)]  # fmt: skip
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None and all(t.is_contiguous() for t in tensors):
        foreach(tensors, views)
        return
    for t, v in zip(tensors, views, strict=True):
        t.copy_(v)


def _weights(step: Any) -> list[tuple[str, torch.Tensor]]:
    """The master tensors the step's updates change: convolution weights and biases,
    normalization gamma/beta and running statistics, named for messages."""
    out: list[tuple[str, torch.Tensor]] = []
    for gnode, kernel, _ in step.updates:
        name = _name(gnode)
        for k in kernel if isinstance(kernel, tuple) else (kernel,):
            ws = getattr(k, "_weights", None)
            if ws is not None:
                out.append((f"{name} weights", ws.weight))
                if ws.bias is not None:
                    out.append((f"{name} biases", ws.bias))
            for attr, names in (("_affine", ("gamma", "beta")),
                                ("_running", ("running mean", "running variance"))):  # fmt: skip
                pair = getattr(k, attr, None)
                if pair is not None:
                    out += [(f"{name} {names[0]}", pair.first), (f"{name} {names[1]}", pair.second)]
    return out
