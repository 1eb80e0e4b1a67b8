"""Optimizer updates (`mpsnn.ops.optim`) over a whole list of tensors in one launch (Triton).

One program per chunk of ``BLOCK`` elements of one tensor. The lists' base addresses sit in an
int64 table (one row per parameter: values, gradients, results, then the state vectors) and
the chunks in another (tensor index, first element, end), built once per list of tensors
(the chunk table once per list of sizes) and kept on the device, so a step passes four
device pointers and copies nothing from the host. Bytes moved: every tensor of the rule read
once and written once (the gradients only read); the tables and the hyperparameters add a few
bytes per chunk.

The arithmetic follows the portable path operation by operation (float32, IEEE division and
square root, no fused multiply-add; Adam's ``lr_t`` in float64): on an H100 the two give the
same bits over 40 Adam steps of ResNet-18's parameters. Adam's step counter advances once per
update: the program that arrives last (an atomic arrival counter kept beside the step) writes
``t + 1`` after every program has read ``t``. Base addresses that are all 16-byte aligned
(fresh allocations are) let full chunks use vector accesses.

CUDA graphs. A graph records the device addresses of the tables its update kernel reads, so
those tables must hold the right values at every replay and must outlive the graph. Tables are
immutable once built. How they reach the device depends on when they are built:

* Outside a capture: written into a pinned host buffer and copied to the device with a
  non-blocking copy on the current stream, so the host never waits for the device (a copy
  from pageable memory would synchronize the stream: the host would wait for all the work
  queued before the update, at every step whose gradients are new tensors). The update that
  reads the table is queued after the copy on the same stream (`mpsnn.ops.optim` caches
  tables per stream); PyTorch's pinned-memory allocator keeps the buffer until the copy ran;
  and ``torch.cuda.graph`` (which `mpsnn.CommandBuffer.capture` uses) synchronizes the device
  when a capture begins, so a later capture that records a cached table finds it written. The
  chunk tables are shared between lists of the same sizes and gradient dtypes (``_CHUNKS``),
  possibly on other streams: they are copied synchronously (once per set of sizes), so they
  are written before any stream reads them.
* During a capture (a list first seen there, e.g. gradients allocated in the captured region):
  a synchronous copy cannot be captured. The table is written on the host into a **pinned**
  buffer and copied into a device table allocated in the capture (from the graph's memory
  pool) with a non-blocking copy. The capture records that copy as a memcpy node, ordered
  before the update kernel on the capturing stream, and the node reads the pinned buffer again
  at every replay. Tensors allocated inside a capture keep their addresses at every replay, so
  a table built at capture time stays valid. The cost is one copy of a few kilobytes per
  replay, in place of the portable update (about ten times slower). The device table holds
  the right values only after that copy has run in a replay. So tables built in a capture are
  never shared: a missing chunk table is built in the same way for this list alone (not
  entered in ``_CHUNKS``), and `mpsnn.ops.optim` does not cache the result, so neither eager
  code nor another capture uses it. This needs PyTorch's pinned-memory allocator to work
  during a capture: it must skip its event queries there. Older versions could fail when
  earlier pinned copies left events to process. The CUDA tests check this.
  Alternatives considered: allocating the device table before the capture is impossible,
  because the addresses exist only inside it. A copy from pageable memory is not reliably
  capturable. Writing the table with kernels whose arguments hold the addresses would add
  several launches per replay, each specialized by Triton on its argument values.

Lifetime rule: a table that a graph reads must outlive every replay of that graph. This covers
the device tables read by the kernel and the pinned buffers read by the memcpy nodes. Neither
may be freed (PyTorch's allocators would reuse the memory) or written again. A table holds its
pinned buffers (``staged``) and its chunk tables (``groups``), so keeping the table keeps all of
them, and tables have no other owner than whoever holds them: `build_tables` keeps nothing.
`mpsnn.ops.optim` hands every table that a capture records, built there or taken from its
cache, to that capture (`mpsnn.core.capture.keep_for_replays`): the `CapturedCommandBuffer`
(and the `CompiledGraph` holding it) keeps them, and they are freed with it. Tables built
outside a capture belong to the cache of the optimizer that built them, and die with it.
``_CHUNKS`` is the one table store shared by the process: at most ``_MAX_CHUNKS`` chunk
tables, keyed on sizes (no addresses), filled only outside captures; evicting one frees it
once no table holds it. Kept tables are never written: pinned buffers are filled once, before
their copy is recorded. Memory kept for a table built in a capture: 8 bytes per tensor and list
on the device, and as much pinned (rounded up to a power of two). The device table also keeps
its segment of the graph's pool (2 MiB) from being released until the capture is freed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from mpsnn.ops.optim_hyper import RegularizationType, UpdateRule
from mpsnn.ops.triton.launch import fast_kernel

__all__ = ["BLOCK", "MultiTensorTables", "build_tables"]

BLOCK = 2048  # elements per program: 16 per thread with 4 warps (four 16-byte accesses)
_NUM_WARPS = 4

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}

# rule and regularization codes as the kernel sees them (constexpr)
_SGD = tl.constexpr(int(UpdateRule.SGD))
_SGD_MOMENTUM = tl.constexpr(int(UpdateRule.SGD_MOMENTUM))
_SGD_NESTEROV = tl.constexpr(int(UpdateRule.SGD_NESTEROV))
_RMSPROP = tl.constexpr(int(UpdateRule.RMSPROP))
_ADAM = tl.constexpr(int(UpdateRule.ADAM))
_ADAM_AMSGRAD = tl.constexpr(int(UpdateRule.ADAM_AMSGRAD))
_L1 = tl.constexpr(int(RegularizationType.L1))
_L2 = tl.constexpr(int(RegularizationType.L2))


@triton.jit
def _powi(x, n):
    """``x ** n`` for a float64 ``x`` and an integer ``n >= 0``, by repeated squaring (plain
    multiplications: no pow/exp/log, which float64 lowers to library calls)."""
    r = x * 0.0 + 1.0
    while n > 0:
        if n % 2 == 1:
            r = r * x
        x = x * x
        n = n // 2
    return r


@triton.jit
def _load(ptr, offs, mask, MASKED: tl.constexpr):
    if MASKED:
        v = tl.load(ptr + offs, mask=mask, other=0.0)
    else:
        v = tl.load(ptr + offs)
    return v


@triton.jit
def _store(ptr, offs, v, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, v, mask=mask)
    else:
        tl.store(ptr + offs, v)


@triton.jit
def _sgd(w, g, m, lr, mu, RULE: tl.constexpr):
    """Decrement and new momentum of the three SGD variants (MPS's two momentum definitions)."""
    if RULE == _SGD_MOMENTUM:
        m = mu * m + lr * g
        d = m
    elif RULE == _SGD_NESTEROV:
        m = mu * m + g
        d = lr * (g + mu * m)
    else:
        d = lr * g
    return d, m


@triton.jit
def _rmsprop(g, s, lr, decay, eps):
    s = decay * s + (g * g) * (1.0 - decay)
    d = lr * tl.math.div_rn(g, tl.sqrt_rn(s) + eps)
    return d, s


@triton.jit
def _adam(g, m, v, vmax, lr_t, beta1, beta2, eps, RULE: tl.constexpr):
    m = beta1 * m + g * (1.0 - beta1)
    v = beta2 * v + (g * g) * (1.0 - beta2)
    if RULE == _ADAM_AMSGRAD:
        vmax = tl.maximum(vmax, v, propagate_nan=tl.PropagateNan.ALL)
        den = tl.sqrt_rn(vmax) + eps
    else:
        den = tl.sqrt_rn(v) + eps
    d = lr_t * tl.math.div_rn(m, den)
    return d, m, v, vmax


@triton.jit
def _chunk(
    w_ptr, g_ptr, r_ptr, s0_ptr, s1_ptr, s2_ptr, offs, mask, hyper, lr_t,
    RULE: tl.constexpr, CLIP: tl.constexpr, REG: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    w = _load(w_ptr, offs, mask, MASKED)
    g = _load(g_ptr, offs, mask, MASKED).to(tl.float32)
    # the gradient pipeline: clip, rescale, regularize (hyperparameters read as float32)
    if CLIP:
        lo = tl.load(hyper + 2).to(tl.float32)
        hi = tl.load(hyper + 3).to(tl.float32)
        g = tl.maximum(g, lo, propagate_nan=tl.PropagateNan.ALL)
        g = tl.minimum(g, hi, propagate_nan=tl.PropagateNan.ALL)
    g = g * tl.load(hyper + 1).to(tl.float32)
    if REG == _L1:
        reg = tl.load(hyper + 4).to(tl.float32)
        g = g + reg * tl.where(w > 0, 1.0, tl.where(w < 0, -1.0, 0.0))  # sign(NaN) = 0
    elif REG == _L2:
        g = g + tl.load(hyper + 4).to(tl.float32) * w
    a = tl.load(hyper + 5).to(tl.float32)
    if RULE == _SGD:
        d = tl.load(hyper).to(tl.float32) * g
    elif RULE == _SGD_MOMENTUM or RULE == _SGD_NESTEROV:  # noqa: SIM109 (Triton: no `in`)
        m = _load(s0_ptr, offs, mask, MASKED)
        d, m = _sgd(w, g, m, tl.load(hyper).to(tl.float32), a, RULE)
        _store(s0_ptr, offs, m, mask, MASKED)
    elif RULE == _RMSPROP:
        s = _load(s0_ptr, offs, mask, MASKED)
        d, s = _rmsprop(g, s, tl.load(hyper).to(tl.float32), a, tl.load(hyper + 7).to(tl.float32))
        _store(s0_ptr, offs, s, mask, MASKED)
    else:
        b = tl.load(hyper + 6).to(tl.float32)
        eps = tl.load(hyper + 7).to(tl.float32)
        m = _load(s0_ptr, offs, mask, MASKED)
        v = _load(s1_ptr, offs, mask, MASKED)
        if RULE == _ADAM_AMSGRAD:
            vmax = _load(s2_ptr, offs, mask, MASKED)
        else:
            vmax = v
        d, m, v, vmax = _adam(g, m, v, vmax, lr_t, a, b, eps, RULE)
        _store(s0_ptr, offs, m, mask, MASKED)
        _store(s1_ptr, offs, v, mask, MASKED)
        if RULE == _ADAM_AMSGRAD:
            _store(s2_ptr, offs, vmax, mask, MASKED)
    _store(r_ptr, offs, w - d, mask, MASKED)


@triton.jit
def _ptr(base, k: tl.constexpr, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    p = tl.load(base + k).to(tl.pointer_type(dtype))
    if ALIGNED:
        p = tl.multiple_of(p, 16)  # every base address is 16-byte aligned: vector accesses
    return p


@fast_kernel
@triton.jit
def _multi_tensor_update(
    ptrs, chunks, hyper, step,
    RULE: tl.constexpr, N_LISTS: tl.constexpr, CLIP: tl.constexpr, REG: tl.constexpr,
    G_DTYPE: tl.constexpr, ADVANCE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    ti = tl.load(chunks + pid * 3)
    start = tl.multiple_of(tl.load(chunks + pid * 3 + 1), BLOCK)
    end = tl.load(chunks + pid * 3 + 2)
    base = ptrs + ti * N_LISTS
    w_ptr = _ptr(base, 0, tl.float32, ALIGNED)
    g_ptr = _ptr(base, 1, G_DTYPE, ALIGNED)
    r_ptr = _ptr(base, 2, tl.float32, ALIGNED)
    # rules with fewer state vectors never touch the missing ones (placeholders)
    s0_ptr = w_ptr
    s1_ptr = w_ptr
    s2_ptr = w_ptr
    if N_LISTS > 3:
        s0_ptr = _ptr(base, 3, tl.float32, ALIGNED)
    if N_LISTS > 4:
        s1_ptr = _ptr(base, 4, tl.float32, ALIGNED)
    if N_LISTS > 5:
        s2_ptr = _ptr(base, 5, tl.float32, ALIGNED)
    lr_t = 0.0
    t = 0
    if RULE == _ADAM or RULE == _ADAM_AMSGRAD:  # noqa: SIM109
        # lr_t = lr sqrt(1 - beta2^t) / (1 - beta1^t) in float64, t read from device memory
        t = tl.load(step) + 1
        p1 = _powi(tl.load(hyper + 5), t)
        p2 = _powi(tl.load(hyper + 6), t)
        # (float64 sqrt and division are IEEE-rounded; only float32's default to approximate)
        lr_t = (tl.load(hyper) * tl.sqrt(1.0 - p2) / (1.0 - p1)).to(tl.float32)
    offs = start + tl.arange(0, BLOCK)
    if end - start == BLOCK:  # a full chunk: no mask, so that accesses vectorize
        _chunk(w_ptr, g_ptr, r_ptr, s0_ptr, s1_ptr, s2_ptr, offs, offs < end, hyper, lr_t,
               RULE, CLIP, REG, False)  # fmt: skip
    else:
        _chunk(w_ptr, g_ptr, r_ptr, s0_ptr, s1_ptr, s2_ptr, offs, offs < end, hyper, lr_t,
               RULE, CLIP, REG, True)  # fmt: skip
    if ADVANCE:
        # The last program to arrive advances the step, once every program has read it: the
        # barrier orders this program's reads of t before its arrival, acq_rel orders the
        # arrivals, and the counter is left at 0 for the next update.
        tl.debug_barrier()
        arrived = tl.atomic_add(step + 1, 1, sem="acq_rel")
        if arrived == tl.num_programs(0) - 1:
            tl.store(step, t)
            tl.store(step + 1, 0)


class MultiTensorTables:
    """The device tables of one list of tensors (see the module docstring), and the launch.

    ``groups``: one chunk table per gradient dtype present (one launch each; almost always
    one). ``ptrs``: (tensors, lists) int64 base addresses. ``staged``: for tables built during a
    CUDA-graph capture, the pinned host buffers that the graph's copy nodes read at every replay
    (empty otherwise). Built by `build_tables`; kept by whoever launches them (see the lifetime
    rule in the module docstring)."""

    __slots__ = ("__weakref__", "aligned", "block", "groups", "n_lists", "ptrs", "staged")

    def __init__(
        self,
        ptrs: torch.Tensor,
        groups: list[tuple[torch.Tensor, int, Any]],
        aligned: bool,
        block: int,
        staged: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self.ptrs = ptrs
        self.n_lists = ptrs.shape[1]
        self.groups = groups
        self.aligned = aligned
        self.block = block  # the chunk size the chunk tables were made with
        self.staged = staged

    def launch(
        self,
        rule: UpdateRule,
        hyper: torch.Tensor,
        step: torch.Tensor | None,
        clip: bool,
        regularization: RegularizationType,
    ) -> None:
        """Run the update: one launch per gradient dtype; Adam's step advances in the last."""
        adam = rule in (UpdateRule.ADAM, UpdateRule.ADAM_AMSGRAD)
        last = len(self.groups) - 1
        for k, (chunks, n_chunks, g_dtype) in enumerate(self.groups):
            _multi_tensor_update[(n_chunks,)](
                self.ptrs, chunks, hyper, step if adam else self.ptrs,
                RULE=int(rule), N_LISTS=self.n_lists, CLIP=bool(clip), REG=int(regularization),
                G_DTYPE=g_dtype, ADVANCE=adam and k == last, ALIGNED=self.aligned, BLOCK=self.block,
                num_warps=_NUM_WARPS, enable_fp_fusion=False,
            )  # fmt: skip


def build_tables(
    lists: Sequence[Sequence[torch.Tensor]], capturing: bool | None = None
) -> MultiTensorTables | None:
    """Tables for ``lists`` = (values, gradients, results, *state lists), already checked:
    CUDA, float32 (gradients float16/bfloat16/float32), contiguous, equal shapes per parameter.
    None when there is no element to update.

    ``capturing``: whether a CUDA graph is being captured on the current stream. None means
    detect it. Outside a capture the address table is copied to the device (and the chunk
    tables too, the first time these sizes and gradient dtypes are seen). During a capture the
    tables are staged through pinned memory and recorded as copies (see the module
    docstring); such tables belong to that capture: their device contents exist only once a
    replay has run. Either way nothing keeps the result but the caller: when a graph records
    a launch of it, the caller keeps it alive as long as the graph
    (`mpsnn.core.capture.keep_for_replays`).
    """
    values, grads = lists[0], lists[1]
    device = values[0].device
    if capturing is None:
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    numels = tuple(t.numel() for t in values)
    g_dtypes = tuple(g.dtype for g in grads)
    groups, staged = _chunk_tables(device, numels, g_dtypes, capturing)
    if not groups:
        return None
    host = _address_table(lists)
    ptrs, staged_ptrs = _upload(host, device, capturing)
    return MultiTensorTables(
        ptrs, groups, bool((host % 16 == 0).all()), BLOCK, (*staged, *staged_ptrs)
    )


def _address_table(lists: Sequence[Sequence[torch.Tensor]]) -> np.ndarray:
    """The host address table: int64, one row per parameter, one column per list."""
    ptrs = np.array([[t.data_ptr() for t in lst] for lst in lists], dtype=np.int64).T
    return np.ascontiguousarray(ptrs)


def _chunk_rows(
    numels: Sequence[int], g_dtypes: Sequence[torch.dtype], block: int = BLOCK
) -> list[tuple[np.ndarray, torch.dtype]]:
    """The host chunk tables: one per gradient dtype present, in order of first appearance.
    Each table has a row ``(tensor index, first element, end)`` for every chunk of ``block``
    elements of a non-empty tensor."""
    order: dict[torch.dtype, list[int]] = {}
    for i, dtype in enumerate(g_dtypes):
        if numels[i]:
            order.setdefault(dtype, []).append(i)
    out = []
    for dtype, idx in order.items():
        rows = []
        for i in idx:
            starts = np.arange(0, numels[i], block, dtype=np.int64)
            ends = np.minimum(starts + block, numels[i])
            rows.append(np.stack([np.full_like(starts, i), starts, ends], axis=1))
        out.append((np.ascontiguousarray(np.concatenate(rows)), dtype))
    return out


def _upload(
    host: np.ndarray, device: torch.device, capturing: bool, blocking: bool = False
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``host`` as a device table, and the staged host buffers a capture's copy reads.

    ``host`` is written into a new pinned buffer (a plain CPU buffer when ``device`` is the
    CPU) and copied with ``non_blocking=True`` into a new device table. Outside a capture the
    buffer is not kept (nothing staged): the pinned-memory allocator reuses it once the copy
    ran. During one, the capture records the copy as a memcpy node that reads the buffer at
    every replay: the buffer is new, written here once, never written again, and returned to
    be kept with the tables. ``blocking`` (outside a capture): the host waits for the copy, so
    the table is written before any stream reads it.
    """
    cuda = device.type == "cuda"
    if not (cuda or capturing):
        return torch.from_numpy(host), ()
    staged = torch.empty(host.shape, dtype=torch.int64, pin_memory=cuda)
    staged.numpy()[...] = host  # host to host, now
    if cuda:
        # captured: repeated at every replay
        table = staged.to(device, non_blocking=capturing or not blocking)
    else:
        table = staged.clone()
    return table, (staged,) if capturing else ()


# Chunk tables depend on the sizes and gradient dtypes only: shared by every list of tensors
# of the same sizes (new gradient tensors at new addresses rebuild only the address table).
# Only tables built outside a capture enter it.
_CHUNKS: OrderedDict[tuple, list[tuple[torch.Tensor, int, Any]]] = OrderedDict()
_MAX_CHUNKS = 16


def _chunk_tables(
    device: torch.device,
    numels: tuple[int, ...],
    g_dtypes: tuple[torch.dtype, ...],
    capturing: bool,
) -> tuple[list[tuple[torch.Tensor, int, Any]], tuple[torch.Tensor, ...]]:
    """The device chunk tables (``groups`` of `MultiTensorTables`) and what was staged for
    them. A cached table was copied before any later capture, so a capture may use it. A table
    built during a capture is for that capture alone and is not cached."""
    key = (device, numels, g_dtypes, BLOCK)
    groups = _CHUNKS.get(key)
    if groups is not None:
        _CHUNKS.move_to_end(key)
        return groups, ()
    groups = []
    staged: list[torch.Tensor] = []
    for table, dtype in _chunk_rows(numels, g_dtypes):
        dev, st = _upload(table, device, capturing, blocking=True)  # shared across streams
        groups.append((dev, len(table), _TL_DTYPES[dtype]))
        staged += st
    if capturing:
        return groups, tuple(staged)
    _CHUNKS[key] = groups
    if len(_CHUNKS) > _MAX_CHUNKS:
        _CHUNKS.popitem(last=False)
    return groups, ()
