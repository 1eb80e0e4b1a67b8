"""Who keeps the optimizer's multi-tensor tables alive, checked on the CPU: a capture keeps
what its recording handed it (`mpsnn.core.capture.keep_for_replays`) and frees it with itself;
tables built outside a capture belong to the optimizer (its `UpdatePlans`) and die with it;
no process-wide store grows with the number of captures.

CUDA graphs cannot be recorded here, so captures are simulated: ``torch.cuda``'s graph, stream
and capture context are stand-ins that run the work at once, the capture status of the update
is forced, and the dispatch builds the Triton tables for CPU tensors (Triton's interpreter runs
the launches). What is real: `record_graph`, `CapturedCommandBuffer`, the scopes and the
update's caches. tests/ops/test_optim_cuda_graphs.py checks the same on a GPU."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

import mpsnn as m
import mpsnn.core.capture as capture
import mpsnn.optim.base as optim_base
from mpsnn.core.capture import CapturedCommandBuffer, keep_for_replays, keeping_for_replays
from mpsnn.ops import optim, optim_hyper
from mpsnn.ops import triton as fast_paths
from mpsnn.ops.optim_hyper import UpdateRule as Rule
from mpsnn.ops.triton import optim as triton_optim


class _Kept:
    """Something a recording hands to its capture (weak-referenceable)."""


class _Buffer:
    """What `record_graph` reads of a command buffer: its work, and its error."""

    def __init__(self, work: Callable[[], None]) -> None:
        self.error: BaseException | None = None
        self._work = work

    def _run(self) -> None:
        self._work()

    def _record_error(self, exc: BaseException, name: str) -> None:
        self.error = exc


class _Stream:
    def __init__(self, device: Any = None) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


@contextmanager
def _graph(graph: Any, stream: Any = None, capture_error_mode: str = "global") -> Iterator[None]:
    yield  # the work runs at once: nothing to record on the CPU


@pytest.fixture
def simulated(monkeypatch) -> Callable[[Callable[[], None]], CapturedCommandBuffer]:
    """``capture(work)``: `record_graph` of ``work`` with stand-ins for ``torch.cuda``'s graph
    machinery, the update seeing a capture in progress and the Triton tables dispatched for
    CPU tensors; returns the `CapturedCommandBuffer` of the result."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "graph", _graph)
    _dispatch_tables(monkeypatch)
    capturing = [False]
    monkeypatch.setattr(optim, "_capturing", lambda hyper: capturing[0])
    monkeypatch.setattr(optim_base, "_capturing", lambda hyper: capturing[0])

    def run(work: Callable[[], None]) -> CapturedCommandBuffer:
        buffer = _Buffer(work)
        keep: list[Any] = []
        capturing[0] = True
        try:
            graph = capture.record_graph(buffer, _Stream(), torch.device("cpu"), keep)
        finally:
            capturing[0] = False
        if buffer.error is not None:
            raise buffer.error
        return CapturedCommandBuffer(buffer, graph, keep)

    return run


def _dispatch_tables(monkeypatch) -> None:
    """The update dispatches the Triton tables for CPU tensors too (run by Triton's
    interpreter, which is off where a GPU compiles them: there the real captures of
    tests/ops/test_optim_cuda_graphs.py check the same)."""
    if torch.cuda.is_available():
        pytest.skip("simulated with Triton's interpreter, which a GPU machine does not run")
    monkeypatch.setattr(
        fast_paths,
        "optimizer_tables",
        lambda lists, capturing=None: triton_optim.build_tables(lists, capturing),
    )


def _lists(n: int = 2) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(n)
    values = [torch.randn(5, generator=gen), torch.randn(3, 4, generator=gen)][:n]
    return values, [torch.randn(v.shape, generator=gen) for v in values]


def _tables(captured: CapturedCommandBuffer) -> list[Any]:
    return [t for t in captured._keep_alive if isinstance(t, triton_optim.MultiTensorTables)]


# ---------------------------------------------------------------------------------------------
# the capture's keep-alive


def test_keep_for_replays_hands_objects_to_the_recording_of_this_thread() -> None:
    a, b, c = _Kept(), _Kept(), _Kept()
    assert keep_for_replays(a) is False  # no recording: nothing kept
    with keeping_for_replays() as outer:
        assert keep_for_replays(a) is True
        mine: list[Any] = []
        with keeping_for_replays(mine) as inner:
            assert inner is mine and keep_for_replays(b)
        seen = []
        thread = threading.Thread(target=lambda: seen.append(keep_for_replays(c)))
        thread.start()
        thread.join()
        assert seen == [False]  # another thread's work is not this recording's
    assert outer == [a] and mine == [b]
    assert keep_for_replays(c) is False


def test_a_captured_buffer_keeps_what_its_recording_was_given_and_frees_it_with_it(
    simulated,
) -> None:
    refs = []

    def work() -> None:
        kept = _Kept()
        refs.append(weakref.ref(kept))
        assert keep_for_replays(kept)

    captured = simulated(work)
    gc.collect()
    assert refs[0]() is not None and refs[0]() in captured._keep_alive
    assert keep_for_replays(_Kept()) is False  # the recording is over
    del captured
    gc.collect()
    assert refs[0]() is None


# ---------------------------------------------------------------------------------------------
# the update's tables


def test_tables_a_capture_records_are_the_captures(simulated) -> None:
    """Tables built during a recording (an update without owner, and one whose owner did not
    have them) and cached tables a recording uses are held by the captured buffer: neither
    clearing the owner's cache nor dropping the owner frees them; dropping the captured
    buffer does."""
    hyper = optim_hyper.make_hyper("cpu", learning_rate=0.5)
    values, grads = _lists()
    other, _ = _lists()
    owner = [optim.UpdatePlans()]
    optim.sgd_update(other, grads, other, None, hyper, plans=owner[0])  # cached, outside

    def work() -> None:
        optim.sgd_update(values, grads, values, None, hyper)  # built here, no owner
        optim.sgd_update(values, grads, values, None, hyper, plans=owner[0])  # built here
        optim.sgd_update(other, grads, other, None, hyper, plans=owner[0])  # cached

    captured = simulated(work)
    tables = _tables(captured)
    assert len(tables) == 3 and len(owner[0]) == 1  # what a capture built is not cached
    ((_, cached),) = owner[0]._plans.values()
    assert tables[2] is cached and cached not in tables[:2]
    refs = [weakref.ref(t) for t in tables]
    del tables, cached
    owner.clear()
    gc.collect()
    assert all(r() is not None for r in refs)
    del captured
    gc.collect()
    assert [r() for r in refs] == [None] * 3


def test_an_optimizer_owns_the_tables_it_builds(monkeypatch) -> None:
    """Outside a capture an optimizer's updates cache their tables in the optimizer (two
    optimizers share none), and they die with it."""
    _dispatch_tables(monkeypatch)
    dev = m.Device("cpu")
    q = dev.new_command_queue()
    values, grads = _lists(1)
    w, g = values[0], grads[0]
    opts = [m.SGD(dev, descriptor=m.OptimizerDescriptor(learning_rate=0.5)) for _ in range(2)]
    for opt in opts:
        for _ in range(2):
            cb = q.command_buffer()
            opt.encode(cb, input_gradient_vector=g, input_values_vector=w, result_values_vector=w)
            cb.commit()
            cb.wait_until_completed()
    (a,), (b,) = (o._plans._plans.values() for o in opts)
    assert isinstance(a[1], triton_optim.MultiTensorTables) and a[1] is not b[1]
    refs = [weakref.ref(a[1]), weakref.ref(b[1])]
    del a, b, cb, opt
    opts.pop()
    gc.collect()
    assert refs[0]() is not None and refs[1]() is None
    opts.clear()
    gc.collect()
    assert refs[0]() is None


def test_captures_register_nothing_process_wide(simulated) -> None:
    """Every module that handles captured updates holds no more after ten captures than after
    one (each capture's tables are its own), and a freed capture leaves nothing behind."""
    modules = [optim, triton_optim, capture, optim_base]
    hyper = optim_hyper.make_hyper("cpu", learning_rate=0.5)
    opt = m.SGD(m.Device("cpu"), descriptor=m.OptimizerDescriptor(learning_rate=0.5))
    values, grads = _lists()

    def work() -> None:
        fresh = [torch.empty_like(g).copy_(g) for g in grads]  # new gradients: new tables
        optim.sgd_update(values, fresh, values, None, hyper)
        opt._update(None, values, lambda: fresh, values, [])

    def sizes() -> dict[str, int]:
        gc.collect()
        return {
            f"{mod.__name__}.{name}": len(value)
            for mod in modules
            for name, value in vars(mod).items()
            if isinstance(value, dict | list | set) and not name.startswith("__")
        }

    captures = [simulated(work)]
    after_one = sizes()
    captures += [simulated(work) for _ in range(9)]
    assert sizes() == after_one
    assert [len(_tables(c)) for c in captures] == [2] * 10
    refs = [weakref.ref(t) for c in captures for t in _tables(c)]
    del captures
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(opt._plans) == 0  # tables built in captures never enter the owner's cache


def test_a_recorded_update_without_a_recording_scope_is_refused(monkeypatch) -> None:
    """A capture that is not mpsnn's (a plain ``torch.cuda.graph``, simulated) and records the
    Triton update must provide the scope that keeps its tables."""
    _dispatch_tables(monkeypatch)
    monkeypatch.setattr(optim, "_capturing", lambda hyper: True)
    hyper = optim_hyper.make_hyper("cpu", learning_rate=0.5)
    values, grads = _lists()
    for plans in (None, optim.UpdatePlans()):
        with pytest.raises(ValueError, match=r"\[apply_update\] a CUDA graph that records"):
            optim.apply_update(Rule.SGD, values, grads, values, [], hyper, plans=plans)
        with keeping_for_replays() as kept:
            optim.apply_update(Rule.SGD, values, grads, values, [], hyper, plans=plans)
        assert len(kept) == 1
